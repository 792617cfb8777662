//! Summary of a distribution over tokens or rows: defined in
//! `shadowtrace_schemas::stats`, shared with the suspects sweep (see there
//! for the definition of quantiles over NaN and infinities).

pub use shadowtrace_schemas::stats::{Summary, quantile};
