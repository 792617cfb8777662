//! One Parquet part file: checked against the format before polars decodes it.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use polars::prelude::{DataFrame, DataType, ParquetReader, SerReader};
use shadowtrace_schemas::footer::{self, FooterError};
use shadowtrace_schemas::{ColumnType, Table, TableSpec};

use crate::LoadError;

const MAGIC: &[u8; 4] = b"PAR1";

/// A part file that passed every check: its rows can be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartFile {
    /// The file.
    pub path: PathBuf,
    /// The table it belongs to.
    pub table: Table,
    /// Its trace format version (the run's).
    pub version: u32,
    /// Rows, from the footer.
    pub rows: u64,
    /// Size on disk.
    pub bytes: u64,
    /// Its content hash, where the run's manifest recorded one and the bytes
    /// on disk were found to match it when the run was opened.
    pub content_hash: Option<String>,
}

#[cfg(test)]
impl PartFile {
    /// A v2 top-k part a test wrote itself with arrow-rs or the parquet
    /// crate: taken as it is, without [`PartFile::open`]'s footer keys.
    #[allow(clippy::unwrap_used, reason = "a test's own file")]
    pub(crate) fn written_topk(path: PathBuf, rows: u64) -> PartFile {
        PartFile {
            bytes: std::fs::metadata(&path).unwrap().len(),
            path,
            table: Table::Topk,
            version: 2,
            rows,
            content_hash: None,
        }
    }
}

impl PartFile {
    /// Opens and checks a part file of a run of trace format `run_version`:
    /// Parquet magic and footer, the footer keys (version, table and run id;
    /// `shadowtrace_schemas::footer::check`), and every column of the table
    /// in that version with its type.
    ///
    /// # Errors
    /// The first check that fails, naming the file.
    pub fn open(
        path: &Path,
        table: Table,
        run_id: &str,
        run_version: u32,
    ) -> Result<PartFile, LoadError> {
        let bytes = check_footer(path)?;
        let open = || {
            File::open(path).map_err(|source| LoadError::Io {
                path: path.to_owned(),
                source,
            })
        };
        // The parquet crate's footer reader first: it refuses a damaged
        // footer with an error, where polars' own Thrift reader panics on
        // some (a flipped byte in a boolean field: tests/it/fuzzed_parts.rs).
        let footer_error = |source| LoadError::ParquetDecode {
            path: path.to_owned(),
            part: "footer".to_owned(),
            source,
        };
        let checked =
            parquet::file::reader::SerializedFileReader::new(open()?).map_err(footer_error)?;
        // polars adds each column chunk's offset and size unchecked and panics on an
        // overflow (a flipped byte in either): a chunk must lie inside the file.
        for (g, group) in parquet::file::reader::FileReader::metadata(&checked)
            .row_groups()
            .iter()
            .enumerate()
        {
            for column in group.columns() {
                let start = column
                    .dictionary_page_offset()
                    .unwrap_or_else(|| column.data_page_offset());
                let size = column.compressed_size();
                let end = u64::try_from(start)
                    .ok()
                    .zip(u64::try_from(size).ok())
                    .and_then(|(a, b)| a.checked_add(b));
                if end.is_none_or(|end| end > bytes) {
                    return Err(footer_error(parquet::errors::ParquetError::General(
                        format!(
                            "row group {g}, column {}: chunk at offset {start} of {size} bytes, expected inside the file's {bytes} bytes",
                            column.column_path()
                        ),
                    )));
                }
            }
        }
        let file = open()?;
        let mut reader = ParquetReader::new(file);
        let decode = |source| LoadError::Decode {
            path: path.to_owned(),
            source,
        };
        let metadata = reader.get_metadata().map_err(decode)?.clone();
        let lookup = |key: &str| {
            metadata
                .key_value_metadata()
                .as_ref()
                .and_then(|kv| kv.iter().find(|e| e.key == key))
                .and_then(|e| e.value.clone())
        };
        let version = footer::check(lookup, table, run_id, run_version).map_err(|e| match e {
            FooterError::MissingKey { key } => LoadError::MissingMetadata {
                path: path.to_owned(),
                key,
            },
            FooterError::UnknownVersion { expected, got, .. } => LoadError::UnknownSchemaVersion {
                path: path.to_owned(),
                expected,
                got,
            },
            FooterError::WrongValue { key, expected, got } => LoadError::WrongMetadata {
                path: path.to_owned(),
                key,
                expected,
                got,
            },
            other => LoadError::Footer {
                path: path.to_owned(),
                source: other,
            },
        })?;
        let spec = spec_of(table, version);
        let schema = reader.schema().map_err(decode)?;
        for column in &spec.columns {
            let Some(field) = schema.get(column.name.as_str()) else {
                return Err(LoadError::MissingColumn {
                    path: path.to_owned(),
                    table: table.name(),
                    column: column.name.clone(),
                });
            };
            let got = DataType::from_arrow_field(field);
            let expected = polars_type(column.ty);
            if got != expected {
                return Err(LoadError::WrongType {
                    path: path.to_owned(),
                    table: table.name(),
                    column: column.name.clone(),
                    expected: format!("{} ({expected})", column.ty),
                    got: got.to_string(),
                });
            }
        }
        Ok(PartFile {
            path: path.to_owned(),
            table,
            version,
            rows: metadata.num_rows as u64,
            bytes,
            content_hash: None,
        })
    }

    /// Reads the named columns (every column of the table when `None`).
    ///
    /// # Errors
    /// When polars cannot decode the file.
    pub fn read(&self, columns: Option<&[&str]>) -> Result<DataFrame, LoadError> {
        let file = File::open(&self.path).map_err(|source| LoadError::Io {
            path: self.path.clone(),
            source,
        })?;
        let names = match columns {
            Some(names) => names.iter().map(|s| (*s).to_owned()).collect(),
            None => spec_of(self.table, self.version)
                .columns
                .iter()
                .map(|c| c.name.clone())
                .collect(),
        };
        ParquetReader::new(file)
            .with_columns(Some(names))
            .finish()
            .map_err(|source| LoadError::Decode {
                path: self.path.clone(),
                source,
            })
    }
}

/// The polars type a column of this format type reads as.
#[must_use]
pub fn polars_type(ty: ColumnType) -> DataType {
    match ty {
        ColumnType::I32 => DataType::Int32,
        ColumnType::I64 => DataType::Int64,
        ColumnType::F32 => DataType::Float32,
        ColumnType::Bool => DataType::Boolean,
        ColumnType::Utf8 => DataType::String,
        ColumnType::ListI32 => DataType::List(Box::new(DataType::Int32)),
        ColumnType::ListF32 => DataType::List(Box::new(DataType::Float32)),
        ColumnType::ListBool => DataType::List(Box::new(DataType::Boolean)),
    }
}

/// The definition of `table` in trace format `version`, one the footer check
/// accepted (the current one otherwise, never reached).
pub(crate) fn spec_of(table: Table, version: u32) -> &'static TableSpec {
    table.spec_for(version).unwrap_or_else(|| table.spec())
}

/// Checks the Parquet frame: magic at both ends and a footer that fits.
/// A file cut short by a killed writer fails here, before any decoding.
fn check_footer(path: &Path) -> Result<u64, LoadError> {
    let io = |source| LoadError::Io {
        path: path.to_owned(),
        source,
    };
    let truncated = |detail: String| LoadError::TruncatedParquet {
        path: path.to_owned(),
        detail,
    };
    let mut file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    if size < 12 {
        return Err(truncated(format!("{size} bytes, expected at least 12")));
    }
    let mut head = [0_u8; 4];
    file.read_exact(&mut head).map_err(io)?;
    if &head != MAGIC {
        return Err(truncated("no PAR1 magic at the start".to_owned()));
    }
    let mut tail = [0_u8; 8];
    file.seek(SeekFrom::End(-8)).map_err(io)?;
    file.read_exact(&mut tail).map_err(io)?;
    if &tail[4..] != MAGIC {
        return Err(truncated(
            "no PAR1 magic at the end: the footer is missing".to_owned(),
        ));
    }
    let footer = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if footer + 12 > size {
        return Err(truncated(format!(
            "footer of {footer} bytes does not fit in a {size}-byte file"
        )));
    }
    Ok(size)
}
