//! The shadowtrace trace format, version 1.
//!
//! A *run* is a directory holding `manifest.json` and one folder of Parquet part
//! files per table (`hidden/`, `topk/`, `events/`, `logits/`). The tables are
//! defined once, as JSON under `schemas/v1/`, so the Rust producers and
//! consumers and the Python hooks read the same definition; this crate parses
//! those files and exposes them as Arrow schemas, column-name constants and the
//! serde model of the manifest.
//!
//! Every Parquet file carries [`META_SCHEMA_VERSION`], [`META_TABLE`] and
//! [`META_RUN_ID`] in its key-value metadata, so a file moved out of its run
//! directory still says what it is.

#![warn(missing_docs)]

pub mod columns;
pub mod env;
mod error;
pub mod manifest;
pub mod selection;
pub mod stats;
mod table;
mod vocabulary;

pub use error::SchemaError;
pub use manifest::{Convention, Manifest};
pub use table::{ColumnSpec, ColumnType, Encoding, Table, TableSpec};
pub use vocabulary::{Vocabulary, vocabulary};

/// Trace format version written by this crate and the only one it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// Parquet key-value metadata key holding the trace format version.
pub const META_SCHEMA_VERSION: &str = "shadowtrace.schema_version";
/// Parquet key-value metadata key holding the table name.
pub const META_TABLE: &str = "shadowtrace.table";
/// Parquet key-value metadata key holding the run id.
pub const META_RUN_ID: &str = "shadowtrace.run_id";

/// File name of a run's manifest, at the root of the run directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Suffix of a file still being written; it is renamed without it when complete.
pub const TMP_SUFFIX: &str = ".tmp";

/// The vocabulary file, as shipped in `schemas/v1/`.
pub const VOCABULARY_JSON: &str = include_str!("../v1/vocabulary.json");

/// The JSON Schema of `manifest.json`, as shipped in `schemas/v1/`.
pub const MANIFEST_JSON_SCHEMA: &str = include_str!("../v1/manifest.schema.json");
