//! A part file's columns decoded by arrow-rs, one row group at a time, each
//! column of it a task of its own.
//!
//! Why not polars here: the summary check (`metrics::topk_check`) reads
//! every difference and boundary list of a v2 top-k part, and polars'
//! nested Parquet decoding costs about 30 ns a value on them, which made the
//! check nearly all of `analyze`'s time on a v2 run. Read this way, with
//! each column of a row group decoded as a task of its own (so a part of a
//! single row group still keeps both cores busy), the check of a 65,536-row
//! run went from 0.99 s to about 0.27 s on a quiet machine, 0.44–0.56 s at
//! load average 3 (README, analyze throughput). Flat
//! columns the metrics stack across parts stay with polars
//! ([`super::PartFile::read`]).
//!
//! Types come from the Parquet schema, not the embedded Arrow schema
//! (`with_skip_arrow_metadata`), so a list is an Arrow `List` (i32 offsets)
//! whoever wrote the file, the Rust writer or pyarrow.

use std::fs::File;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::ArrowPrimitiveType;
use arrow_array::{Array, ArrayRef, BooleanArray, ListArray, PrimitiveArray};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::errors::ParquetError;
use rayon::prelude::*;

use super::PartFile;
use crate::{AnalyzeError, LoadError};

/// Some columns of one row group of a part file.
#[derive(Debug)]
pub struct RowGroup {
    /// Its index in the file.
    pub index: usize,
    /// Its rows.
    pub rows: usize,
    columns: Vec<(String, ArrayRef)>,
}

impl PartFile {
    /// The footer as arrow-rs reads it: row groups and the Parquet schema.
    ///
    /// # Errors
    /// When the file cannot be opened or its footer parsed.
    pub fn arrow_metadata(&self) -> Result<ArrowReaderMetadata, LoadError> {
        let file = self.open_file()?;
        let options = ArrowReaderOptions::new().with_skip_arrow_metadata(true);
        ArrowReaderMetadata::load(&file, options)
            .map_err(|source| self.decode_error("footer".to_owned(), source))
    }

    /// The named columns of row group `index` (`metadata` from
    /// [`PartFile::arrow_metadata`]), each column decoded in parallel.
    ///
    /// # Errors
    /// A column the file lacks, or one arrow-rs cannot decode.
    pub fn read_row_group(
        &self,
        metadata: &ArrowReaderMetadata,
        index: usize,
        columns: &[&str],
    ) -> Result<RowGroup, LoadError> {
        let rows = metadata
            .metadata()
            .row_groups()
            .get(index)
            .map_or(0, |rg| usize::try_from(rg.num_rows()).unwrap_or(0));
        let columns = columns
            .par_iter()
            .map(|name| {
                Ok((
                    (*name).to_owned(),
                    self.read_column(metadata, index, name, rows)?,
                ))
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(RowGroup {
            index,
            rows,
            columns,
        })
    }

    fn read_column(
        &self,
        metadata: &ArrowReaderMetadata,
        index: usize,
        name: &str,
        rows: usize,
    ) -> Result<ArrayRef, LoadError> {
        let fail = |source| self.decode_error(format!("row group {index}, column {name}"), source);
        let root = metadata
            .schema()
            .index_of(name)
            .map_err(|_| LoadError::MissingColumn {
                path: self.path.clone(),
                table: self.table.name(),
                column: name.to_owned(),
            })?;
        let reader =
            ParquetRecordBatchReaderBuilder::new_with_metadata(self.open_file()?, metadata.clone())
                .with_projection(ProjectionMask::roots(metadata.parquet_schema(), [root]))
                .with_row_groups(vec![index])
                .with_batch_size(rows.max(1))
                .build()
                .map_err(fail)?;
        let mut arrays = Vec::with_capacity(1);
        for batch in reader {
            let batch = batch.map_err(|e| fail(e.into()))?;
            arrays.push(Arc::clone(batch.column(0)));
        }
        // One batch of the row group's rows, or none for an empty one.
        match arrays.len() {
            0 => Ok(arrow_array::new_empty_array(
                metadata.schema().field(root).data_type(),
            )),
            1 => Ok(arrays.swap_remove(0)),
            n => Err(fail(ParquetError::General(format!(
                "{n} batches for one row group of {rows} rows, expected one"
            )))),
        }
    }

    fn open_file(&self) -> Result<File, LoadError> {
        File::open(&self.path).map_err(|source| LoadError::Io {
            path: self.path.clone(),
            source,
        })
    }

    fn decode_error(&self, part: String, source: ParquetError) -> LoadError {
        LoadError::ArrowDecode {
            path: self.path.clone(),
            part,
            source,
        }
    }
}

impl RowGroup {
    fn column(&self, name: &str) -> Result<&ArrayRef, AnalyzeError> {
        self.columns
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
            .ok_or_else(|| layout(name, "not read"))
    }

    fn primitive<T: ArrowPrimitiveType>(
        &self,
        name: &str,
    ) -> Result<&PrimitiveArray<T>, AnalyzeError> {
        self.column(name)?
            .as_primitive_opt::<T>()
            .ok_or_else(|| layout(name, "not of the expected primitive type"))
    }

    /// A column without nulls, as a slice.
    ///
    /// # Errors
    /// A column not read, of another type, or holding a null.
    pub fn values<T: ArrowPrimitiveType>(&self, name: &str) -> Result<&[T::Native], AnalyzeError> {
        let array = self.primitive::<T>(name)?;
        if array.null_count() > 0 {
            return Err(layout(name, "null in a column that never holds one"));
        }
        Ok(array.values())
    }

    /// A nullable column.
    ///
    /// # Errors
    /// A column not read or of another type.
    pub fn nullable<T: ArrowPrimitiveType>(
        &self,
        name: &str,
    ) -> Result<Nullable<'_, T>, AnalyzeError> {
        Ok(Nullable {
            array: self.primitive::<T>(name)?,
        })
    }

    fn list_array(&self, name: &str) -> Result<&ListArray, AnalyzeError> {
        let list = self
            .column(name)?
            .as_list_opt::<i32>()
            .ok_or_else(|| layout(name, "not a list"))?;
        if list.values().null_count() > 0 {
            return Err(layout(name, "null entries inside a list"));
        }
        Ok(list)
    }

    /// A list column of primitive values, row by row as slices.
    ///
    /// # Errors
    /// A column not read, not a list of `T`, or with null entries in a list.
    pub fn list<T: ArrowPrimitiveType>(
        &self,
        name: &str,
    ) -> Result<ListColumn<'_, T::Native>, AnalyzeError> {
        let list = self.list_array(name)?;
        let values = list
            .values()
            .as_primitive_opt::<T>()
            .ok_or_else(|| layout(name, "list values of an unexpected type"))?;
        Ok(ListColumn {
            list,
            offsets: list.value_offsets(),
            values: values.values(),
        })
    }

    /// A `list<bool>` column.
    ///
    /// # Errors
    /// A column not read, not a list of booleans, or with null entries.
    pub fn bool_list(&self, name: &str) -> Result<BoolListColumn<'_>, AnalyzeError> {
        let list = self.list_array(name)?;
        let values = list
            .values()
            .as_boolean_opt()
            .ok_or_else(|| layout(name, "list values of an unexpected type"))?;
        Ok(BoolListColumn { list, values })
    }
}

fn layout(column: &str, detail: &str) -> AnalyzeError {
    AnalyzeError::Layout {
        column: column.to_owned(),
        detail: detail.to_owned(),
    }
}

/// A nullable primitive column of a [`RowGroup`].
#[derive(Debug, Clone, Copy)]
pub struct Nullable<'a, T: ArrowPrimitiveType> {
    array: &'a PrimitiveArray<T>,
}

impl<T: ArrowPrimitiveType> Nullable<'_, T> {
    /// Row `i`, `None` where null.
    #[must_use]
    pub fn get(&self, i: usize) -> Option<T::Native> {
        self.array.is_valid(i).then(|| self.array.value(i))
    }
}

/// A list column of a [`RowGroup`], row by row as slices into one buffer.
#[derive(Debug, Clone, Copy)]
pub struct ListColumn<'a, T> {
    list: &'a ListArray,
    offsets: &'a [i32],
    values: &'a [T],
}

impl<'a, T> ListColumn<'a, T> {
    /// Row `i`, `None` where the list is null.
    #[must_use]
    pub fn get(&self, i: usize) -> Option<&'a [T]> {
        if !self.list.is_valid(i) {
            return None;
        }
        let (start, end) = (self.offsets[i], self.offsets[i + 1]);
        self.values
            .get(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }
}

/// A `list<bool>` column of a [`RowGroup`]: booleans are bit-packed, so a
/// row is copied into a caller's buffer.
#[derive(Debug, Clone, Copy)]
pub struct BoolListColumn<'a> {
    list: &'a ListArray,
    values: &'a BooleanArray,
}

impl BoolListColumn<'_> {
    /// Copies row `i` into `out` (cleared first); `false` where the list is null.
    pub fn fill(&self, i: usize, out: &mut Vec<bool>) -> bool {
        out.clear();
        if !self.list.is_valid(i) {
            return false;
        }
        let offsets = self.list.value_offsets();
        let (Ok(start), Ok(end)) = (usize::try_from(offsets[i]), usize::try_from(offsets[i + 1]))
        else {
            return false;
        };
        out.extend((start..end).map(|j| self.values.value(j)));
        true
    }
}
