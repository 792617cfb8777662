//! shadowtrace's consumer side: reads runs written by the tracer or the
//! Python hooks (trace format v1, see `shadowtrace-schemas`) and turns them
//! into answers. No libtorch: it runs wherever polars does.
//!
//! What is here today:
//! - [`load`]: a directory of runs as one dataset, each run checked whole;
//! - [`inspect`]: one run as a person reads it;
//! - [`schema_doc`]: the format as text or JSON.

#![warn(missing_docs)]

mod error;
pub mod inspect;
pub mod load;
pub mod schema_doc;

pub use error::LoadError;
pub use load::{Dataset, PartFile, Run};
