//! Errors of the tracer library.

use std::path::PathBuf;

use shadowtrace_schemas::{ColumnType, Table};

/// What went wrong while producing a run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    // === I/O ===
    /// A file or directory could not be created, written or renamed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The Parquet encoder failed.
    #[error("parquet file {path}: {source}")]
    Parquet {
        /// The part file.
        path: PathBuf,
        /// What the encoder said.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// The manifest could not be serialized.
    #[error("manifest {path}: {source}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },

    // === Input ===
    /// The run directory already holds a run.
    #[error(
        "run directory {path}: already holds a run ({file} exists), expected a new or empty directory"
    )]
    RunExists {
        /// The run directory.
        path: PathBuf,
        /// The manifest file name.
        file: &'static str,
    },
    /// A run id with characters that do not belong in a file name.
    #[error("run id {got:?}: expected 1 to 128 letters, digits, '.', '_' or '-'")]
    InvalidRunId {
        /// The run id given.
        got: String,
    },

    // === Numerics ===
    /// A tensor of the wrong rank, size or dtype for a numerics function.
    #[error("{op}: {what}: expected {expected}, got {got}")]
    Shape {
        /// The function.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// What the function needs.
        expected: String,
        /// What it was given.
        got: String,
    },
    /// libtorch refused an operation.
    #[error("{op}: libtorch: {source}")]
    Torch {
        /// The function.
        op: &'static str,
        /// What libtorch said.
        #[source]
        source: tch::TchError,
    },

    /// A run asked to be written in a trace format version the schemas
    /// crate does not define.
    #[error("trace format version {version}: expected one of {expected}", expected = shadowtrace_schemas::readable_versions_text())]
    UnknownVersion {
        /// The version asked for.
        version: u32,
    },

    // === Defects ===
    /// A row type and the table definition disagree: a defect in this crate.
    #[error("table {table}: column {column} expects {expected}, the row supplied {got}")]
    SchemaDrift {
        /// The table.
        table: Table,
        /// The column index.
        column: usize,
        /// The column's type.
        expected: ColumnType,
        /// What the row supplied.
        got: &'static str,
    },
    /// An Arrow batch could not be assembled.
    #[error("table {table}: building a record batch: {source}")]
    Batch {
        /// The table.
        table: Table,
        /// What arrow said.
        #[source]
        source: arrow_schema::ArrowError,
    },
    /// The writer could not write every row within the flush deadline; the run
    /// is left incomplete and its manifest counts what was not written.
    #[error(
        "run {run_id}: rows not written within {seconds} s; the run stays incomplete (unflushed_rows)"
    )]
    FlushTimeout {
        /// The run.
        run_id: String,
        /// The deadline.
        seconds: f64,
    },
    /// The writer thread panicked; the run is left incomplete.
    #[error("run {run_id}: the writer thread panicked; the run is left incomplete")]
    WorkerPanicked {
        /// The run.
        run_id: String,
    },
}
