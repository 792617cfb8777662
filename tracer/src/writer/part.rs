//! One Parquet part file of one table: written under a temporary name and
//! renamed when complete, so a reader never mistakes a partial file for data.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use parquet::arrow::ArrowWriter;
use shadowtrace_schemas::{TMP_SUFFIX, Table, content_hash};

use crate::TraceError;
use crate::writer::props::writer_properties;

/// Path of part `index` of `table`, relative to the run directory.
#[must_use]
pub fn part_path(table: Table, index: u32) -> String {
    format!("{}/part-{index:05}.parquet", table.name())
}

pub(crate) struct PartWriter {
    tmp_path: PathBuf,
    final_path: PathBuf,
    relative: String,
    writer: ArrowWriter<File>,
    rows: u64,
}

impl PartWriter {
    pub(crate) fn create(
        run_dir: &Path,
        table: Table,
        version: u32,
        index: u32,
        run_id: &str,
        footer: Vec<parquet::file::metadata::KeyValue>,
    ) -> Result<PartWriter, TraceError> {
        let relative = part_path(table, index);
        let final_path = run_dir.join(&relative);
        let tmp_path = run_dir.join(format!("{relative}{TMP_SUFFIX}"));
        let table_dir = run_dir.join(table.name());
        fs::create_dir_all(&table_dir).map_err(|source| TraceError::Io {
            path: table_dir,
            source,
        })?;
        let parquet_err = |source| TraceError::Parquet {
            path: tmp_path.clone(),
            source,
        };
        let schema = table
            .arrow_schema_for(version)
            .ok_or(TraceError::UnknownVersion { version })?;
        let props = writer_properties(table, version, run_id, footer).map_err(parquet_err)?;
        let file = File::create(&tmp_path).map_err(|source| TraceError::Io {
            path: tmp_path.clone(),
            source,
        })?;
        let writer = ArrowWriter::try_new(file, schema, Some(props)).map_err(parquet_err)?;
        Ok(PartWriter {
            tmp_path,
            final_path,
            relative,
            writer,
            rows: 0,
        })
    }

    pub(crate) fn write(&mut self, batch: &RecordBatch) -> Result<(), TraceError> {
        self.writer
            .write(batch)
            .map_err(|source| TraceError::Parquet {
                path: self.tmp_path.clone(),
                source,
            })?;
        self.rows += batch.num_rows() as u64;
        Ok(())
    }

    /// Bytes this part will take on disk, counting the open row group.
    pub(crate) fn size(&self) -> usize {
        self.writer.bytes_written() + self.writer.in_progress_size()
    }

    /// Writes the footer, syncs, hashes the file as it is on disk, and
    /// renames it to its final name. Returns the path relative to the run
    /// directory, the row count and the content hash
    /// (`shadowtrace_schemas::content_hash`).
    pub(crate) fn finish(self) -> Result<(String, u64, String), TraceError> {
        let PartWriter {
            tmp_path,
            final_path,
            relative,
            writer,
            rows,
        } = self;
        let file = writer.into_inner().map_err(|source| TraceError::Parquet {
            path: tmp_path.clone(),
            source,
        })?;
        file.sync_all().map_err(|source| TraceError::Io {
            path: tmp_path.clone(),
            source,
        })?;
        drop(file);
        // Read back from the page cache: the hash is of the bytes on disk, which is
        // what a reader will check, not of what was handed to the OS.
        let hash = content_hash::of_file(&tmp_path).map_err(|source| TraceError::Io {
            path: tmp_path.clone(),
            source,
        })?;
        fs::rename(&tmp_path, &final_path).map_err(|source| TraceError::Io {
            path: final_path,
            source,
        })?;
        Ok((relative, rows, hash))
    }
}
