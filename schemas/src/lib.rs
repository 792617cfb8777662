//! The shadowtrace trace format: version 2 written, versions 1 and 2 read.
//!
//! A *run* is a directory holding `manifest.json` and one folder of Parquet part
//! files per table (`hidden/`, `topk/`, `events/`, `logits/`). The tables are
//! defined once, as JSON under `schemas/v1/` and `schemas/v2/`, so the Rust
//! producers and consumers and the Python hooks read the same definition; this
//! crate parses those files and exposes them as Arrow schemas, column-name
//! constants and the serde model of the manifest.
//!
//! Version 2 replaces the `topk` table (tiers: summary, differences and
//! boundary candidates, sampled full lists) and the manifest's JSON Schema,
//! and keeps v1's `hidden`, `events`, `logits` and vocabulary
//! (`schemas/v2/README.md`). [`Table::spec_for`] gives a table's definition in
//! either version.
//!
//! Every Parquet file carries [`META_SCHEMA_VERSION`], [`META_TABLE`] and
//! [`META_RUN_ID`] in its key-value metadata ([`footer::FOOTER_KEYS`]), so a
//! file moved out of its run directory still says what it is; a reader
//! refuses a file without one of them ([`footer::check`]).

#![warn(missing_docs)]

pub mod columns;
pub mod content_hash;
pub mod env;
mod error;
pub mod footer;
pub mod manifest;
pub mod selection;
pub mod stats;
mod table;
pub mod text_table;
mod vocabulary;

pub use error::{SchemaError, error_line};
pub use manifest::{Convention, Manifest};
pub use table::{ColumnSpec, ColumnType, Encoding, Table, TableSpec};
pub use vocabulary::{Vocabulary, vocabulary};

/// Trace format version written by this crate's producers.
pub const SCHEMA_VERSION: u32 = 2;

/// Trace format versions a reader of this crate accepts, oldest first.
pub const READ_VERSIONS: [u32; 2] = [1, 2];

/// Whether a reader of this crate accepts runs of trace format `version`.
#[must_use]
pub fn is_readable(version: u32) -> bool {
    READ_VERSIONS.contains(&version)
}

/// The versions a reader accepts, as an error message says them: `1 or 2`.
#[must_use]
pub fn readable_versions_text() -> String {
    let words: Vec<String> = READ_VERSIONS.iter().map(ToString::to_string).collect();
    words.join(" or ")
}

/// Parquet key-value metadata key holding the trace format version.
pub const META_SCHEMA_VERSION: &str = "shadowtrace.schema_version";
/// Parquet key-value metadata key holding the table name.
pub const META_TABLE: &str = "shadowtrace.table";
/// Parquet key-value metadata key holding the run id.
pub const META_RUN_ID: &str = "shadowtrace.run_id";
/// Parquet key-value metadata key of a top-k part holding its boundary band
/// rule, so a part moved out of its run still says what its per-row
/// `boundary_band` is: JSON `{"band", "scale", "stored"}` from the run's
/// settings (`boundary_band`, `boundary_band_scale`, `boundary_stored`);
/// absent where the run records no relative band.
pub const META_BOUNDARY_BAND: &str = "shadowtrace.boundary_band";

/// File name of a run's manifest, at the root of the run directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Suffix of a file still being written; it is renamed without it when complete.
pub const TMP_SUFFIX: &str = ".tmp";

/// The vocabulary file, as shipped in `schemas/v1/` (v2 keeps v1's).
pub const VOCABULARY_JSON: &str = include_str!("../v1/vocabulary.json");

/// The JSON Schema of a v2 `manifest.json`, as shipped in `schemas/v2/`.
pub const MANIFEST_JSON_SCHEMA: &str = include_str!("../v2/manifest.schema.json");

/// The JSON Schema of a v1 `manifest.json`, as shipped in `schemas/v1/`.
pub const MANIFEST_JSON_SCHEMA_V1: &str = include_str!("../v1/manifest.schema.json");
