//! The run writer: producers hand it rows, a worker thread turns them into
//! Parquet part files and keeps the manifest current.
//!
//! # Guarantees
//! - The caller's thread never encodes or touches disk: rows go through a
//!   bounded queue. In [`QueueMode::Blocking`] a full queue makes the caller
//!   wait; in [`QueueMode::Lossy`] the row is dropped and counted, and the
//!   count lands in the manifest (`tables.<t>.dropped_rows`).
//! - A part file is written as `part-NNNNN.parquet.tmp` and renamed when its
//!   footer is on disk; the manifest lists only renamed parts.
//! - `manifest.json` says `incomplete` from the moment the run opens until
//!   [`RunWriter::close`] returns; it is rewritten atomically (temporary file,
//!   then rename) whenever a part completes. A process killed at any point
//!   leaves a manifest that lists exactly the complete parts.

mod batch;
mod part;
mod props;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

pub use part::part_path;
pub use props::{row_group_rows, writer_properties};
use shadowtrace_schemas::manifest::{RunIdentity, Tool};
use shadowtrace_schemas::{MANIFEST_FILE, Manifest, Table};

use crate::TraceError;
use crate::record::Record;

/// What the caller's thread does when the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueMode {
    /// Wait for room: no row is lost, the traced process may slow down.
    Blocking,
    /// Drop the row and count it: the traced process never waits.
    Lossy,
}

impl QueueMode {
    /// The mode's name, as recorded in the manifest settings.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            QueueMode::Blocking => "blocking",
            QueueMode::Lossy => "lossy",
        }
    }
}

/// How a run is written.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Rows the queue holds before it blocks or drops (defaults to 4096).
    pub queue_capacity: usize,
    /// Full-queue behaviour (defaults to [`QueueMode::Blocking`]).
    pub queue_mode: QueueMode,
    /// A part file is completed once it reaches this many bytes (defaults to
    /// 256 MiB), so a long run killed midway keeps all but its last part.
    pub part_max_bytes: usize,
    /// The producer named in the manifest.
    pub tool: Tool,
}

impl Default for WriterOptions {
    fn default() -> WriterOptions {
        WriterOptions {
            queue_capacity: 4096,
            queue_mode: QueueMode::Blocking,
            part_max_bytes: 256 << 20,
            tool: Tool {
                name: "shadowtrace-tracer".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
        }
    }
}

/// What happened to a row handed to [`RunWriter::send`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Delivery {
    /// Queued for writing.
    Queued,
    /// Dropped by the lossy queue, or because the writer had failed; counted.
    Dropped,
}

#[expect(
    clippy::large_enum_variant,
    reason = "rows are nearly every message; boxing would allocate once more per row"
)]
pub(crate) enum Message {
    Row(Record),
    CloseTable(Table),
    CloseRun,
}

/// Counts shared by the caller's side and the worker.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) dropped: [AtomicU64; 4],
    pub(crate) failed: AtomicBool,
}

/// Writes one run. Dropping it without [`RunWriter::close`] still completes
/// the files, but leaves the run marked `incomplete`.
#[derive(Debug)]
#[must_use = "a run writer must be closed for its run to be marked complete"]
pub struct RunWriter {
    dir: PathBuf,
    run_id: String,
    mode: QueueMode,
    tx: Option<SyncSender<Message>>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<Result<Manifest, TraceError>>>,
}

impl RunWriter {
    /// Opens a run in `dir` (created if missing; must not hold a run yet) and
    /// writes its manifest as `incomplete`.
    ///
    /// # Errors
    /// When the directory already holds a run, the run id is not a valid file
    /// name, or the directory or manifest cannot be written.
    pub fn create(
        dir: &Path,
        identity: RunIdentity,
        options: WriterOptions,
    ) -> Result<RunWriter, TraceError> {
        validate_run_id(&identity.run_id)?;
        if dir.join(MANIFEST_FILE).exists() {
            return Err(TraceError::RunExists {
                path: dir.to_owned(),
                file: MANIFEST_FILE,
            });
        }
        std::fs::create_dir_all(dir).map_err(|source| TraceError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let mut manifest = Manifest::open(identity, options.tool.clone(), worker::unix_ms());
        manifest
            .identity
            .settings
            .insert("queue_mode".to_owned(), options.queue_mode.as_str().into());
        manifest
            .identity
            .settings
            .insert("queue_capacity".to_owned(), options.queue_capacity.into());
        worker::write_manifest(dir, &manifest)?;

        let (tx, rx) = sync_channel(options.queue_capacity.max(1));
        let shared = Arc::new(Shared::default());
        let run_id = manifest.run_id().to_owned();
        let worker = worker::Worker::new(
            dir.to_owned(),
            manifest,
            options.part_max_bytes,
            shared.clone(),
        );
        let handle = std::thread::Builder::new()
            .name(format!("shadowtrace-writer-{run_id}"))
            .spawn(move || worker.run(&rx))
            .map_err(|source| TraceError::Io {
                path: dir.to_owned(),
                source,
            })?;
        Ok(RunWriter {
            dir: dir.to_owned(),
            run_id,
            mode: options.queue_mode,
            tx: Some(tx),
            shared,
            worker: Some(handle),
        })
    }

    /// The run directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Hands a row to the writer. Never panics and never fails loudly: a row
    /// that cannot be queued is counted as dropped.
    pub fn send(&self, record: impl Into<Record>) -> Delivery {
        let record = record.into();
        let table = record.table();
        let queued = match (&self.tx, self.mode) {
            _ if self.shared.failed.load(Ordering::Relaxed) => false,
            (Some(tx), QueueMode::Blocking) => tx.send(Message::Row(record)).is_ok(),
            (Some(tx), QueueMode::Lossy) => match tx.try_send(Message::Row(record)) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            },
            (None, _) => false,
        };
        if queued {
            Delivery::Queued
        } else {
            self.shared.dropped[table as usize].fetch_add(1, Ordering::Relaxed);
            Delivery::Dropped
        }
    }

    /// Completes `table`: its last part is finished and listed in the
    /// manifest, and later rows for it are counted as dropped. Waits for room
    /// in the queue in either mode, since losing it would lose the table.
    pub fn close_table(&self, table: Table) {
        if let Some(tx) = &self.tx {
            // A closed channel means the worker has already stopped; close() reports why.
            let _ = tx.send(Message::CloseTable(table));
        }
    }

    /// Rows dropped so far for `table`.
    #[must_use]
    pub fn dropped_rows(&self, table: Table) -> u64 {
        self.shared.dropped[table as usize].load(Ordering::Relaxed)
    }

    /// Finishes every table, marks the run `complete` and returns its final
    /// manifest.
    ///
    /// # Errors
    /// The first error the worker met; the run then stays `incomplete`, with
    /// every part completed before the error listed.
    pub fn close(mut self) -> Result<Manifest, TraceError> {
        self.shutdown(true)
    }

    fn shutdown(&mut self, mark_complete: bool) -> Result<Manifest, TraceError> {
        if let Some(tx) = self.tx.take() {
            if mark_complete {
                let _ = tx.send(Message::CloseRun);
            }
            drop(tx);
        }
        let worker = self
            .worker
            .take()
            .ok_or_else(|| TraceError::WorkerPanicked {
                run_id: self.run_id.clone(),
            })?;
        worker.join().map_err(|_| TraceError::WorkerPanicked {
            run_id: self.run_id.clone(),
        })?
    }
}

impl Drop for RunWriter {
    fn drop(&mut self) {
        if self.worker.is_some() {
            // Nowhere to report from Drop; the manifest stays `incomplete`.
            let _ = self.shutdown(false);
        }
    }
}

fn validate_run_id(run_id: &str) -> Result<(), TraceError> {
    let ok = !run_id.is_empty()
        && run_id.len() <= 128
        && run_id != "."
        && run_id != ".."
        && run_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(TraceError::InvalidRunId {
            got: run_id.to_owned(),
        })
    }
}
