//! The writer thread: buffers rows per table, writes batches into part files,
//! rolls parts over by size and keeps the manifest current.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use shadowtrace_schemas::manifest::{Status, TableEntry};
use shadowtrace_schemas::{MANIFEST_FILE, Manifest, Table};

use super::batch::{TableBuffer, is_well_formed, normalize_selection};
use super::part::PartWriter;
use super::queue::{ByteQueue, Popped};
use super::{Message, Shared, TopkLists, manifest_file};
use crate::TraceError;
use crate::record::Record;

/// While rows arrive, the manifest's sent and written counts on disk are at
/// most this old: what a killed process lost is then known to within it.
const MANIFEST_EVERY: Duration = Duration::from_secs(1);

/// Rows buffered before they are encoded as one batch: large enough to
/// amortise the per-batch cost, small enough to bound the worker's memory.
fn batch_rows(table: Table) -> usize {
    match table {
        Table::Topk => 256,
        Table::Hidden | Table::Events | Table::Logits => 8192,
    }
}

struct TableState {
    table: Table,
    buffer: TableBuffer,
    part: Option<PartWriter>,
    next_part: u32,
    files: Vec<String>,
    file_hashes: BTreeMap<String, String>,
    rows: u64,
    invalid_rows: u64,
    closed: bool,
}

pub(crate) struct Worker {
    dir: PathBuf,
    manifest: Manifest,
    part_max_bytes: usize,
    shared: Arc<Shared>,
    tables: Vec<TableState>,
    last_manifest: Instant,
}

impl Worker {
    pub(crate) fn new(
        dir: PathBuf,
        manifest: Manifest,
        part_max_bytes: usize,
        topk_lists: TopkLists,
        shared: Arc<Shared>,
    ) -> Result<Worker, TraceError> {
        let tables = Table::ALL
            .iter()
            .map(|&table| {
                Ok(TableState {
                    table,
                    buffer: TableBuffer::new(
                        table,
                        manifest.schema_version,
                        manifest.run_id(),
                        topk_lists,
                    )?,
                    part: None,
                    next_part: 0,
                    files: Vec::new(),
                    file_hashes: BTreeMap::new(),
                    rows: 0,
                    invalid_rows: 0,
                    closed: false,
                })
            })
            .collect::<Result<_, TraceError>>()?;
        Ok(Worker {
            dir,
            manifest,
            part_max_bytes,
            shared,
            tables,
            last_manifest: Instant::now(),
        })
    }

    /// Runs until the run is closed or the queue is closed. After the first
    /// error, rows are drained and counted as dropped so the producer never
    /// blocks on a dead writer.
    pub(crate) fn run(mut self, queue: &ByteQueue) -> Result<Manifest, TraceError> {
        let mut error = None;
        let mut close_run = false;
        loop {
            let message = match queue.pop(MANIFEST_EVERY) {
                Popped::Message(message) => message,
                Popped::Closed => break,
                Popped::Idle => {
                    // Idle: the producer may be stuck or about to die; what it sent is on disk.
                    if error.is_none()
                        && self.sent_changed()
                        && let Err(e) = self.write_manifest(Status::Incomplete)
                    {
                        self.shared.failed.store(true, Ordering::Relaxed);
                        error = Some(e);
                    }
                    continue;
                }
            };
            if error.is_some() {
                if let Message::Row(record) = message {
                    self.shared.dropped[record.table() as usize].fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            let result = match message {
                Message::Row(record) => self.push(record),
                Message::CloseTable(table) => self.close_table(table),
                Message::CloseRun => {
                    close_run = true;
                    break;
                }
            };
            let result = result.and_then(|()| {
                if self.last_manifest.elapsed() >= MANIFEST_EVERY {
                    self.write_manifest(Status::Incomplete)
                } else {
                    Ok(())
                }
            });
            if let Err(e) = result {
                self.shared.failed.store(true, Ordering::Relaxed);
                error = Some(e);
            }
        }
        if let Some(e) = error {
            // Keep what was completed before the error on record; the run stays incomplete.
            let _ = self.write_manifest(Status::Incomplete);
            return Err(e);
        }
        for table in Table::ALL {
            self.finish_table(table)?;
        }
        let interrupted = self.shared.interrupted.load(Ordering::Relaxed);
        let status = if close_run && !interrupted {
            Status::Complete
        } else {
            Status::Incomplete
        };
        self.write_manifest(status)?;
        Ok(self.manifest)
    }

    fn push(&mut self, mut record: Record) -> Result<(), TraceError> {
        let state = &mut self.tables[record.table() as usize];
        if state.closed {
            self.shared.dropped[record.table() as usize].fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if !is_well_formed(&record) {
            state.invalid_rows += 1;
            return Ok(());
        }
        if let Record::Topk(row) = &mut record {
            normalize_selection(&mut row.prod);
            if let Some((_, shadow)) = row.shadow.as_mut() {
                normalize_selection(shadow);
            }
        }
        state.buffer.push(&record)?;
        if state.buffer.rows() >= batch_rows(state.table) {
            self.flush_batch(record.table())?;
        }
        Ok(())
    }

    fn flush_batch(&mut self, table: Table) -> Result<(), TraceError> {
        let state = &mut self.tables[table as usize];
        if state.buffer.rows() == 0 {
            return Ok(());
        }
        let batch = state.buffer.take_batch()?;
        if state.part.is_none() {
            let footer = if table == Table::Topk {
                band_footer(&self.manifest.identity.settings)
            } else {
                Vec::new()
            };
            state.part = Some(PartWriter::create(
                &self.dir,
                table,
                self.manifest.schema_version,
                state.next_part,
                self.manifest.run_id(),
                footer,
            )?);
            state.next_part += 1;
        }
        let rolled = match state.part.as_mut() {
            Some(part) => {
                part.write(&batch)?;
                part.size() >= self.part_max_bytes
            }
            None => false,
        };
        if rolled {
            self.finish_part(table)?;
        }
        Ok(())
    }

    fn finish_part(&mut self, table: Table) -> Result<(), TraceError> {
        let state = &mut self.tables[table as usize];
        if let Some(part) = state.part.take() {
            let (relative, rows, hash) = part.finish()?;
            state.file_hashes.insert(relative.clone(), hash);
            state.files.push(relative);
            state.rows += rows;
            self.write_manifest(Status::Incomplete)?;
        }
        Ok(())
    }

    fn finish_table(&mut self, table: Table) -> Result<(), TraceError> {
        if self.tables[table as usize].closed {
            return Ok(());
        }
        self.flush_batch(table)?;
        self.finish_part(table)?;
        self.tables[table as usize].closed = true;
        Ok(())
    }

    fn close_table(&mut self, table: Table) -> Result<(), TraceError> {
        self.finish_table(table)?;
        self.write_manifest(Status::Incomplete)
    }

    /// Whether rows were sent since the manifest on disk counted them.
    fn sent_changed(&self) -> bool {
        self.tables.iter().any(|state| {
            let sent = self.shared.sent[state.table as usize].load(Ordering::Relaxed);
            self.manifest
                .tables
                .get(state.table.name())
                .and_then(|e| e.sent_rows)
                != Some(sent)
        })
    }

    fn write_manifest(&mut self, status: Status) -> Result<(), TraceError> {
        self.last_manifest = Instant::now();
        let mut dropped_total = 0;
        let mut invalid_total = 0;
        let mut unflushed = 0;
        let mut tables = BTreeMap::new();
        for state in &self.tables {
            let t = state.table as usize;
            let dropped_rows = self.shared.dropped[t].load(Ordering::Relaxed);
            let sent_rows = self.shared.sent[t].load(Ordering::Relaxed);
            dropped_total += dropped_rows;
            invalid_total += state.invalid_rows;
            unflushed += sent_rows.saturating_sub(dropped_rows + state.invalid_rows + state.rows);
            let table_status = if state.closed {
                Status::Complete
            } else {
                Status::Incomplete
            };
            tables.insert(
                state.table.name().to_owned(),
                TableEntry {
                    status: table_status,
                    rows: state.rows,
                    dropped_rows,
                    sent_rows: Some(sent_rows),
                    files: state.files.clone(),
                    file_hashes: state.file_hashes.clone(),
                },
            );
        }
        self.manifest.tables = tables;
        let counters = &mut self.manifest.counters;
        let extra = self
            .shared
            .counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        counters.extend(extra.iter().map(|(k, v)| (k.clone(), *v)));
        drop(extra);
        counters.insert("dropped_rows".to_owned(), dropped_total);
        counters.insert("invalid_rows".to_owned(), invalid_total);
        for (name, value) in [
            ("unflushed_rows", unflushed),
            (
                "queue_wait_timeouts",
                self.shared.queue_wait_timeouts.load(Ordering::Relaxed),
            ),
            (
                "interrupted",
                u64::from(self.shared.interrupted.load(Ordering::Relaxed)),
            ),
        ] {
            if value > 0 {
                counters.insert(name.to_owned(), value);
            } else {
                counters.remove(name);
            }
        }
        self.manifest.status = status;
        if status == Status::Complete {
            self.manifest.closed_unix_ms = Some(unix_ms());
        }
        match manifest_file::write_atomically(&self.dir, &self.manifest) {
            // The disk is full: the run's counts go into the room its manifest holds.
            Err(e) if manifest_file::is_disk_full(&e) && self.dir.join(MANIFEST_FILE).exists() => {
                *self
                    .manifest
                    .counters
                    .entry(manifest_file::REWRITTEN_IN_PLACE.to_owned())
                    .or_default() += 1;
                manifest_file::rewrite_in_place(&self.dir, &self.manifest)
            }
            written => written,
        }
    }
}

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A top-k part's boundary band rule for its footer
/// ([`shadowtrace_schemas::META_BOUNDARY_BAND`]), from the run's settings;
/// none where the run records no relative band.
fn band_footer(
    settings: &serde_json::Map<String, serde_json::Value>,
) -> Vec<parquet::file::metadata::KeyValue> {
    let Some(scale) = settings.get("boundary_band_scale") else {
        return Vec::new();
    };
    let rule = serde_json::json!({
        "band": settings.get("boundary_band"),
        "scale": scale,
        "stored": settings.get("boundary_stored"),
    });
    vec![parquet::file::metadata::KeyValue::new(
        shadowtrace_schemas::META_BOUNDARY_BAND.to_owned(),
        rule.to_string(),
    )]
}
