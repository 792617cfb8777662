//! shadowtrace's producer side: the FP8 production path and its shadow, the
//! hook sites, and the Parquet writer that records them as runs in trace
//! format v1 (see the `shadowtrace-schemas` crate).
//!
//! What is here today:
//! - [`writer`]: the run writer, off the caller's thread behind a bounded
//!   queue, with per-table part files and an always-current manifest;
//! - [`record`]: the rows producers hand it;
//! - [`fp8`]: FP8 formats, block quantization (tch, and an ndarray reference);
//! - [`identity`]: hashes and device facts that identify a run;
//! - [`indexer`]: the DSA indexer score in fp32, bf16 and engine FP8 variants, top-k with margins;
//! - [`model`]: the reference GLM-5 / DeepSeek-V3.2 engine, its deviations
//!   and conventions;
//! - [`bisect`]: which layers' shadow value, grafted into production, restores its output;
//! - [`suspects`]: the clean path and every deviation side by side, ranked
//!   against observed runs;
//! - [`synth`]: synthetic runs with known contents, for the demo, tests and
//!   benchmarks.

#![warn(missing_docs)]

pub mod bisect;
mod error;
pub mod fp8;
pub mod host_memory;
pub mod identity;
pub mod indexer;
pub mod model;
pub mod progress;
pub mod record;
pub mod suspects;
pub mod synth;
pub mod trace;
pub mod writer;

pub use error::TraceError;
pub use writer::{Delivery, QueueMode, RunWriter, WriterOptions};
