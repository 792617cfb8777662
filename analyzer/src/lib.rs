//! shadowtrace's consumer side: reads runs written by the tracer or the
//! Python hooks (trace format v1, see `shadowtrace-schemas`) and turns them
//! into answers. No libtorch: it runs wherever polars does.
//!
//! What is here today:
//! - [`load`]: a directory of runs as one dataset, each run checked whole;
//! - [`metrics`]: top-k overlap, hidden-state error, logits agreement,
//!   non-finite onset — one per module, each with its definition;
//! - [`verdict`]: first-divergence layers and the thresholds behind them;
//! - [`judged`]: what a run did not measure, and the verdicts it leaves not judged;
//! - [`fail_on`]: which runs fail `--fail-on`, and the exit status a CI reads;
//! - [`analysis`], [`grid`], [`report`]: runs to answers, tables, files;
//! - [`cache_pair`]: prefix-cache hits against the same prompt from scratch;
//! - [`graft_pair`]: a graft run against its ungrafted base run;
//! - [`inspect`]: one run as a person reads it;
//! - [`schema_doc`]: the format as text or JSON.

#![warn(missing_docs)]

pub mod analysis;
pub mod cache_pair;
pub mod capture_check;
mod error;
pub mod export;
pub mod fail_on;
mod frame;
pub mod graft_pair;
pub mod grid;
pub mod inspect;
pub mod judged;
pub mod load;
pub mod metrics;
pub mod outcome;
pub mod ranks;
pub mod report;
pub mod schema_doc;
pub mod verdict;

pub use analysis::{Analysis, Options, RunAnalysis, analyze};
pub use error::{AnalyzeError, LoadError, RunProblem};
pub use load::{Dataset, PartFile, Run};
