//! One Parquet part file: checked against the format before polars decodes it.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use polars::prelude::{DataFrame, DataType, ParquetReader, SerReader};
use shadowtrace_schemas::{
    ColumnType, META_RUN_ID, META_SCHEMA_VERSION, META_TABLE, SCHEMA_VERSION, Table,
};

use crate::LoadError;

const MAGIC: &[u8; 4] = b"PAR1";

/// A part file that passed every check: its rows can be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartFile {
    /// The file.
    pub path: PathBuf,
    /// The table it belongs to.
    pub table: Table,
    /// Rows, from the footer.
    pub rows: u64,
    /// Size on disk.
    pub bytes: u64,
}

impl PartFile {
    /// Opens and checks a part file: Parquet magic and footer, trace format
    /// version, table and run id in the metadata, and every column of the
    /// table with its type.
    ///
    /// # Errors
    /// The first check that fails, naming the file.
    pub fn open(path: &Path, table: Table, run_id: &str) -> Result<PartFile, LoadError> {
        let bytes = check_footer(path)?;
        let file = File::open(path).map_err(|source| LoadError::Io {
            path: path.to_owned(),
            source,
        })?;
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
        match lookup(META_SCHEMA_VERSION) {
            Some(v) if v == SCHEMA_VERSION.to_string() => {}
            got => {
                return Err(LoadError::UnknownSchemaVersion {
                    path: path.to_owned(),
                    expected: SCHEMA_VERSION,
                    got: got.unwrap_or_else(|| "<absent>".to_owned()),
                });
            }
        }
        for (key, expected) in [(META_TABLE, table.name()), (META_RUN_ID, run_id)] {
            let got = lookup(key);
            if got.as_deref() != Some(expected) {
                return Err(LoadError::WrongMetadata {
                    path: path.to_owned(),
                    key,
                    expected: expected.to_owned(),
                    got: got.unwrap_or_else(|| "<absent>".to_owned()),
                });
            }
        }
        let schema = reader.schema().map_err(decode)?;
        for column in &table.spec().columns {
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
            rows: metadata.num_rows as u64,
            bytes,
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
            None => self
                .table
                .spec()
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
    }
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
