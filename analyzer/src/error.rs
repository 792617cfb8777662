//! Errors of the analyzer library. Each names the file and what is wrong
//! with it, expected versus found.

use std::path::PathBuf;

/// What can go wrong while analysing runs that loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnalyzeError {
    /// A run could not be read.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A column the metric reads is missing or of another type.
    #[error("column {column}: {source}")]
    Frame {
        /// The column.
        column: String,
        /// What polars said.
        #[source]
        source: polars::prelude::PolarsError,
    },
    /// A column's memory layout is not what the metric reads zero-copy.
    #[error("column {column}: {detail}")]
    Layout {
        /// The column.
        column: String,
        /// What is off.
        detail: String,
    },
    /// A layer's top-k rows are over different selection units
    /// ([`crate::metrics::selection_unit`]): never compared.
    #[error(
        "topk layer {layer}: selections over {first} and over {other}; selections over different units are never compared"
    )]
    MixedUnits {
        /// The layer.
        layer: i32,
        /// The unit its first rows are over.
        first: String,
        /// The other unit found.
        other: String,
    },
    /// `--churn-band` asks for churn beyond what a run's boundary lists hold.
    #[error(
        "run {run}: its boundary lists reach {stored:e} (settings.boundary_stored), so no churn band wider than that can be counted; asked {asked:e}"
    )]
    ChurnBandBeyondStored {
        /// The run.
        run: String,
        /// The band asked for.
        asked: f32,
        /// How far the run's lists reach, in the same terms.
        stored: f32,
    },
    /// A report file could not be written.
    #[error("{path}: {detail}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
}

/// A run or file that cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    // === runs ===
    /// No run was found under a path given on the command line.
    #[error(
        "{path}: no shadowtrace run found (expected a directory holding manifest.json, or a directory of such runs)"
    )]
    NoRuns {
        /// The path given.
        path: PathBuf,
    },
    /// A directory with table folders but no manifest.
    #[error("run {run}: manifest.json is missing (the run holds table folders but no manifest)")]
    MissingManifest {
        /// The run directory.
        run: PathBuf,
    },
    /// A manifest that is not valid JSON or lacks a required field.
    #[error("manifest {path}: corrupt: {detail}")]
    CorruptManifest {
        /// The manifest file.
        path: PathBuf,
        /// What the parser found, with line and column.
        detail: String,
    },
    /// A manifest or file of a trace format this analyzer does not read.
    #[error("{path}: unknown trace format version {got}, expected {expected}")]
    UnknownSchemaVersion {
        /// The manifest or Parquet file.
        path: PathBuf,
        /// The versions this analyzer reads (`1 or 2`).
        expected: String,
        /// The version found.
        got: String,
    },
    /// A part file the manifest lists but the disk lacks.
    #[error("parquet file {path}: listed in the manifest but missing on disk")]
    MissingFile {
        /// The part file.
        path: PathBuf,
    },

    /// A part file whose bytes are not those its writer hashed when it
    /// closed it (`tables.<t>.file_hashes` in the manifest): changed on disk
    /// since, by a flipped bit, a copy or an edit.
    #[error(
        "parquet file {path}: its bytes changed since its writer closed it: content hash {got}, the manifest recorded {expected}"
    )]
    ContentHash {
        /// The part file.
        path: PathBuf,
        /// The hash the manifest recorded.
        expected: String,
        /// The hash of the bytes on disk now.
        got: String,
    },

    // === Parquet files ===
    /// A file cut short: its footer is missing or incomplete.
    #[error("parquet file {path}: truncated or not Parquet: {detail}")]
    TruncatedParquet {
        /// The part file.
        path: PathBuf,
        /// What is missing.
        detail: String,
    },
    /// Key-value metadata that contradicts where the file sits.
    #[error("parquet file {path}: metadata {key} is {got:?}, expected {expected:?}")]
    WrongMetadata {
        /// The part file.
        path: PathBuf,
        /// The metadata key.
        key: &'static str,
        /// The value the run implies.
        expected: String,
        /// The value found (`<absent>` when missing).
        got: String,
    },
    /// A footer key every part file carries is absent: not a shadowtrace
    /// part file (`shadowtrace_schemas::footer::FOOTER_KEYS`).
    #[error("parquet file {path}: metadata {key} is missing (a shadowtrace part file carries {})", shadowtrace_schemas::footer::FOOTER_KEYS.map(|(k, _)| k).join(", "))]
    MissingMetadata {
        /// The part file.
        path: PathBuf,
        /// The missing key.
        key: &'static str,
    },
    /// Any other footer problem the schemas crate reports.
    #[error("parquet file {path}: {source}")]
    Footer {
        /// The part file.
        path: PathBuf,
        /// What the check found.
        #[source]
        source: shadowtrace_schemas::footer::FooterError,
    },
    /// A column the format requires is absent.
    #[error("parquet file {path}: table {table} is missing column {column}")]
    MissingColumn {
        /// The part file.
        path: PathBuf,
        /// The table.
        table: &'static str,
        /// The column.
        column: String,
    },
    /// A column of another type than the format defines.
    #[error("parquet file {path}: column {table}.{column} has type {got}, expected {expected}")]
    WrongType {
        /// The part file.
        path: PathBuf,
        /// The table.
        table: &'static str,
        /// The column.
        column: String,
        /// The type the format defines.
        expected: String,
        /// The type found.
        got: String,
    },
    /// polars failed to decode a file that passed the checks above.
    #[error("parquet file {path}: {source}")]
    Decode {
        /// The part file.
        path: PathBuf,
        /// What polars said.
        #[source]
        source: polars::prelude::PolarsError,
    },
    /// The `parquet` crate's column readers failed to decode a file that
    /// passed the checks above (`load::RowGroupBatches`).
    #[error("parquet file {path}: {part}: {source}")]
    ParquetDecode {
        /// The part file.
        path: PathBuf,
        /// Which part of it: the footer, or a row group's column and rows.
        part: String,
        /// What the `parquet` crate said.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// An OS-level read failure.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A run that reads but contradicts itself, refused in strict mode.
    #[error(transparent)]
    Problem(#[from] RunProblem),
}

/// What a run's own files contradict, found while it still reads: `inspect`
/// reports it as an error (exit 2); `analyze` notes it and leaves the
/// verdicts of the table it concerns not judged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RunProblem {
    /// v2 top-k rows whose summary disagrees with their own lists
    /// (`metrics::topk_check`).
    #[error("{manifest}: {detail}")]
    SummaryDisagreement {
        /// The manifest of the run.
        manifest: PathBuf,
        /// How many rows, by check.
        detail: String,
    },
    /// A table whose manifest claims another row count than its listed
    /// files hold: rows lost without a word, or a manifest that lies.
    #[error(
        "{manifest}: table {table}: the manifest says {expected} rows, its listed files hold {got}"
    )]
    RowCount {
        /// The manifest.
        manifest: PathBuf,
        /// The table.
        table: &'static str,
        /// Rows the manifest claims.
        expected: u64,
        /// Rows the files it lists hold (from their footers).
        got: u64,
    },
    /// A `settings.capture_check` that cannot be read: whether the adapter
    /// read the engine right is unknown (`capture_check`).
    #[error("{manifest}: {detail}")]
    CaptureCheckUnreadable {
        /// The manifest of the run.
        manifest: PathBuf,
        /// What cannot be read.
        detail: String,
    },
    /// A part file in a run whose manifest says it is complete, and does not
    /// list it: not read.
    #[error(
        "parquet file {path}: the run is complete and its manifest does not list this part ({rows} rows, not read)"
    )]
    UnlistedPart {
        /// The part file.
        path: PathBuf,
        /// Rows its footer holds.
        rows: u64,
    },
    /// A run that says it is complete, whose producer handed its writer more
    /// rows than the run holds or counts as dropped.
    #[error(
        "{manifest}: the run is complete, yet {missing} rows its producer sent are neither written nor counted as dropped"
    )]
    Unaccounted {
        /// The manifest.
        manifest: PathBuf,
        /// Rows sent and neither written nor counted.
        missing: u64,
    },
}

impl LoadError {
    /// The file or directory the error is about.
    #[must_use]
    pub fn path(&self) -> &std::path::Path {
        match self {
            LoadError::NoRuns { path }
            | LoadError::CorruptManifest { path, .. }
            | LoadError::UnknownSchemaVersion { path, .. }
            | LoadError::MissingFile { path }
            | LoadError::ContentHash { path, .. }
            | LoadError::TruncatedParquet { path, .. }
            | LoadError::WrongMetadata { path, .. }
            | LoadError::MissingMetadata { path, .. }
            | LoadError::Footer { path, .. }
            | LoadError::MissingColumn { path, .. }
            | LoadError::WrongType { path, .. }
            | LoadError::Decode { path, .. }
            | LoadError::ParquetDecode { path, .. }
            | LoadError::Io { path, .. } => path,
            LoadError::MissingManifest { run } => run,
            LoadError::Problem(
                RunProblem::RowCount { manifest, .. }
                | RunProblem::Unaccounted { manifest, .. }
                | RunProblem::SummaryDisagreement { manifest, .. }
                | RunProblem::CaptureCheckUnreadable { manifest, .. },
            ) => manifest,
            LoadError::Problem(RunProblem::UnlistedPart { path, .. }) => path,
        }
    }
}
