//! The run writer: producers hand it rows, a worker thread turns them into
//! Parquet part files and keeps the manifest current.
//!
//! # Guarantees
//! - The caller's thread never encodes or touches disk: rows go through a
//!   queue bounded in bytes ([`WriterOptions::queue_bytes`]). In
//!   [`QueueMode::Blocking`] a full queue makes the caller wait, at most
//!   [`WriterOptions::queue_timeout`]; in [`QueueMode::Lossy`] the row is
//!   dropped at once. Every row not queued is counted, and the count lands in
//!   the manifest (`tables.<t>.dropped_rows`; `queue_wait_timeouts`).
//! - A part file is written as `part-NNNNN.parquet.tmp` and renamed when its
//!   footer is on disk; the manifest lists only renamed parts.
//! - `manifest.json` says `incomplete` from the moment the run opens until
//!   [`RunWriter::close`] has written every row; it is rewritten atomically
//!   (temporary file, then rename) whenever a part completes and at most
//!   every second while rows arrive, with the rows handed over so far
//!   (`tables.<t>.sent_rows`) and those not yet in a complete part
//!   (`counters.unflushed_rows`). A process killed at any point leaves a
//!   manifest that lists exactly the complete parts and says what it lost.
//!   Where the disk is full, the manifest is rewritten in place in the room
//!   its padded file holds (`manifest_file`; `manifest_rewritten_in_place`).
//! - Closing waits at most [`WriterOptions::flush_timeout`]; a run that cannot
//!   finish in time stays `incomplete`.

mod batch;
mod manifest_file;
mod part;
mod props;
mod queue;
mod topk;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use part::part_path;
pub use props::{row_group_rows, writer_properties, zstd_level};
use shadowtrace_schemas::manifest::{RunIdentity, Tool};
use shadowtrace_schemas::{MANIFEST_FILE, Manifest, SCHEMA_VERSION, Table, is_readable};
pub use topk::TopkLists;

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

/// How a run is written. [`crate::trace::TraceOptions::from_env`] fills it
/// from `SHADOWTRACE_QUEUE`, `SHADOWTRACE_QUEUE_MB`,
/// `SHADOWTRACE_QUEUE_TIMEOUT_S` and `SHADOWTRACE_FLUSH_TIMEOUT_S`.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Bytes of rows the queue holds before it blocks or drops (defaults to
    /// 256 MiB).
    pub queue_bytes: usize,
    /// Full-queue behaviour (defaults to [`QueueMode::Blocking`]).
    pub queue_mode: QueueMode,
    /// How long a blocking send waits for room before the row is dropped and
    /// counted (defaults to 30 s).
    pub queue_timeout: Duration,
    /// How long closing the run may wait for its rows to be written (defaults
    /// to 30 s).
    pub flush_timeout: Duration,
    /// A part file is completed once it reaches this many bytes (defaults to
    /// 256 MiB), so a long run killed midway keeps all but its last part.
    pub part_max_bytes: usize,
    /// The producer named in the manifest.
    pub tool: Tool,
    /// Trace format version written (defaults to [`SCHEMA_VERSION`]). Version
    /// 1 writes both full selections per top-k row, as builds before v2 did:
    /// for tests and benchmarks that need an old run.
    pub schema_version: u32,
    /// Top-k rows that keep their full prod list (defaults to none;
    /// `SHADOWTRACE_TOPK_LISTS`). Version 1 keeps every list anyway.
    pub topk_lists: TopkLists,
}

impl Default for WriterOptions {
    fn default() -> WriterOptions {
        WriterOptions {
            queue_bytes: 256 << 20,
            queue_mode: QueueMode::Blocking,
            queue_timeout: Duration::from_secs(30),
            flush_timeout: Duration::from_secs(30),
            part_max_bytes: 256 << 20,
            tool: Tool {
                name: "shadowtrace-tracer".to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
            },
            schema_version: SCHEMA_VERSION,
            topk_lists: TopkLists::None,
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
    pub(crate) sent: [AtomicU64; 4],
    pub(crate) dropped: [AtomicU64; 4],
    pub(crate) queue_wait_timeouts: AtomicU64,
    pub(crate) interrupted: AtomicBool,
    pub(crate) failed: AtomicBool,
    pub(crate) counters: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Writes one run. Dropping it without [`RunWriter::close`] still completes
/// the files, but leaves the run marked `incomplete`.
#[must_use = "a run writer must be closed for its run to be marked complete"]
pub struct RunWriter {
    dir: PathBuf,
    run_id: String,
    mode: QueueMode,
    queue_timeout: Duration,
    flush_timeout: Duration,
    queue: Arc<queue::ByteQueue>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<Result<Manifest, TraceError>>>,
    done: Option<Receiver<()>>,
}

impl std::fmt::Debug for RunWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunWriter")
            .field("dir", &self.dir)
            .field("run_id", &self.run_id)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl RunWriter {
    /// Opens a run in `dir` (created if missing; must not hold a run yet) and
    /// writes its manifest as `incomplete`.
    ///
    /// # Errors
    /// When the directory already holds a run, the run id is not a valid file
    /// name, the trace format version is unknown, or the directory or
    /// manifest cannot be written.
    pub fn create(
        dir: &Path,
        identity: RunIdentity,
        options: WriterOptions,
    ) -> Result<RunWriter, TraceError> {
        validate_run_id(&identity.run_id)?;
        if !is_readable(options.schema_version) {
            return Err(TraceError::UnknownVersion {
                version: options.schema_version,
            });
        }
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
        manifest.schema_version = options.schema_version;
        let settings = &mut manifest.identity.settings;
        settings.insert("queue_mode".to_owned(), options.queue_mode.as_str().into());
        settings.insert("queue_bytes".to_owned(), options.queue_bytes.into());
        if options.schema_version >= 2 {
            settings.insert("topk_lists".to_owned(), options.topk_lists.setting());
        }
        manifest_file::write_atomically(dir, &manifest)?;

        let queue = Arc::new(queue::ByteQueue::new(options.queue_bytes));
        let shared = Arc::new(Shared::default());
        let run_id = manifest.run_id().to_owned();
        let worker = worker::Worker::new(
            dir.to_owned(),
            manifest,
            options.part_max_bytes,
            options.topk_lists,
            shared.clone(),
        )?;
        let (done_tx, done) = channel();
        let worker_queue = queue.clone();
        let handle = std::thread::Builder::new()
            .name(format!("shadowtrace-writer-{run_id}"))
            .spawn(move || {
                let result = worker.run(&worker_queue);
                let _ = done_tx.send(());
                result
            })
            .map_err(|source| TraceError::Io {
                path: dir.to_owned(),
                source,
            })?;
        Ok(RunWriter {
            dir: dir.to_owned(),
            run_id,
            mode: options.queue_mode,
            queue_timeout: options.queue_timeout,
            flush_timeout: options.flush_timeout,
            queue,
            shared,
            worker: Some(handle),
            done: Some(done),
        })
    }

    /// The run directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Hands a row to the writer. Never panics and never fails loudly: a row
    /// that cannot be queued in time is counted as dropped.
    pub fn send(&self, record: impl Into<Record>) -> Delivery {
        let record = record.into();
        let table = record.table() as usize;
        self.shared.sent[table].fetch_add(1, Ordering::Relaxed);
        let queued = !self.shared.failed.load(Ordering::Relaxed) && {
            let bytes = record.approx_bytes();
            let deadline = match self.mode {
                QueueMode::Blocking => Some(Instant::now() + self.queue_timeout),
                QueueMode::Lossy => None,
            };
            let queued = self.queue.push(Message::Row(record), bytes, deadline);
            if !queued && self.mode == QueueMode::Blocking {
                self.shared
                    .queue_wait_timeouts
                    .fetch_add(1, Ordering::Relaxed);
            }
            queued
        };
        if queued {
            Delivery::Queued
        } else {
            self.shared.dropped[table].fetch_add(1, Ordering::Relaxed);
            Delivery::Dropped
        }
    }

    /// Completes `table`: its last part is finished and listed in the
    /// manifest, and later rows for it are counted as dropped. Waits for room
    /// in the queue in either mode (up to the flush deadline), since losing it
    /// would lose the table.
    pub fn close_table(&self, table: Table) {
        let deadline = Instant::now() + self.flush_timeout;
        // Refused only by a closed queue: the worker has stopped, and close() says why.
        let _ = self
            .queue
            .push(Message::CloseTable(table), 0, Some(deadline));
    }

    /// Adds producer counts to the manifest's counters (what a path fell back
    /// to, for instance); written with the next manifest.
    pub fn add_counters(&self, counts: &[(&str, u64)]) {
        let mut extra = self
            .shared
            .counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for &(name, n) in counts {
            *extra.entry(name.to_owned()).or_insert(0) += n;
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
    /// The first error the worker met, or that it could not finish within the
    /// flush deadline; the run then stays `incomplete`, with every part
    /// completed before listed.
    pub fn close(mut self) -> Result<Manifest, TraceError> {
        self.shutdown(true)
    }

    /// Finishes every table as [`RunWriter::close`] does, but leaves the run
    /// `incomplete` with `counters.interrupted`: its producer stopped half way
    /// (a signal), so rows it would have sent are missing.
    ///
    /// # Errors
    /// As [`RunWriter::close`].
    pub fn close_interrupted(mut self) -> Result<Manifest, TraceError> {
        self.shared.interrupted.store(true, Ordering::Relaxed);
        self.shutdown(true)
    }

    fn shutdown(&mut self, finish: bool) -> Result<Manifest, TraceError> {
        let deadline = Instant::now() + self.flush_timeout;
        if finish {
            let _ = self.queue.push(Message::CloseRun, 0, Some(deadline));
        }
        self.queue.close();
        let done = self.done.take();
        let finished = done.is_some_and(|rx| {
            rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .is_ok()
        });
        let worker = self
            .worker
            .take()
            .ok_or_else(|| TraceError::WorkerPanicked {
                run_id: self.run_id.clone(),
            })?;
        if !finished && !worker.is_finished() {
            // The thread goes on writing; its manifest says what is not yet written.
            return Err(TraceError::FlushTimeout {
                run_id: self.run_id.clone(),
                seconds: self.flush_timeout.as_secs_f64(),
            });
        }
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
