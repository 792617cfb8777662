//! A part file's columns decoded by the `parquet` crate's column readers,
//! one row group at a time and a batch of its rows at a time, each column of
//! a batch a task of its own.
//!
//! Why not polars here: the summary check (`metrics::topk_check`) reads
//! every difference and boundary list of a v2 top-k part, and polars'
//! nested Parquet decoding costs about 30 ns a value on them, which made the
//! check nearly all of `analyze`'s time on a v2 run. The overlap
//! (`metrics::topk_v2`) reads a v2 part's summary here too: decoded whole by
//! polars, its strings as 16-byte views a row, it was fresh memory the
//! kernel zeroed for longer than the rest of a remembered `analyze` took.
//! A string column whose row group holds one value (the footer's exact
//! minimum equals its maximum, no null: [`same_string`]) is not decoded.
//!
//! Why not arrow-rs arrays either: building Arrow lists from the levels
//! (offsets, validity bitmaps of lists and items, booleans packed into bits
//! and unpacked again) took about a fifth of the check, and each batch's
//! arrays were fresh memory the kernel had to zero. Here each column keeps
//! its levels, values and row starts in buffers that every batch reuses, and
//! a row is a slice of them.
//!
//! Why batches: decoded whole, a 65,536-row row group's lists took about
//! 350 MB, and a fresh process spent as much time having the kernel zero
//! those pages as decoding them. [`BATCH_ROWS`] rows at a time, the same
//! buffers serve every batch of a row group, and the allocator (mimalloc)
//! keeps their pages for the next row group (docs/benchmarks.md, analyze throughput).
//! The other tables, small and stacked across parts, stay with polars
//! ([`super::PartFile::read`]).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use bytes::{Buf, Bytes};

use parquet::basic::{ConvertedType, LogicalType, Repetition, Type as PhysicalType};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl, get_column_reader};
use parquet::data_type::{BoolType, ByteArray, ByteArrayType, FloatType, Int32Type};
use parquet::errors::ParquetError;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData};
use parquet::file::reader::{ChunkReader, FileReader, Length, SerializedFileReader};
use parquet::file::serialized_reader::SerializedPageReader;
use parquet::file::statistics::Statistics;
use parquet::schema::types::Type as SchemaType;
use rayon::prelude::*;

use super::PartFile;
use crate::{AnalyzeError, LoadError};

/// Rows decoded at a time: a few MB per difference or candidate column at
/// the default tier (a sampled full prod list adds about 16 KB a row), and a
/// task per column large enough that the split costs nothing.
pub const BATCH_ROWS: usize = 8192;

/// The non-null values of one leaf column of a batch, by physical type.
#[derive(Debug)]
pub enum Values {
    /// INT32.
    I32(Vec<i32>),
    /// FLOAT.
    F32(Vec<f32>),
    /// BOOLEAN.
    Bool(Vec<bool>),
    /// BYTE_ARRAY (strings): each value shares its page's or dictionary's
    /// bytes, no copy per row.
    Bytes(Vec<ByteArray>),
}

impl Values {
    /// Spreads packed values to one a row ([`spread`]).
    fn spread(&mut self, valid: &[bool]) {
        match self {
            Values::I32(v) => spread(v, valid),
            Values::F32(v) => spread(v, valid),
            Values::Bool(v) => spread(v, valid),
            Values::Bytes(v) => spread(v, valid),
        }
    }

    fn len(&self) -> usize {
        match self {
            Values::I32(v) => v.len(),
            Values::F32(v) => v.len(),
            Values::Bool(v) => v.len(),
            Values::Bytes(v) => v.len(),
        }
    }
}

/// A primitive type a column's values can be read as.
pub trait Leaf: Sized {
    /// The values, when the column holds this type.
    fn of(values: &Values) -> Option<&[Self]>;
}

impl Leaf for i32 {
    fn of(values: &Values) -> Option<&[i32]> {
        match values {
            Values::I32(v) => Some(v),
            _ => None,
        }
    }
}

impl Leaf for f32 {
    fn of(values: &Values) -> Option<&[f32]> {
        match values {
            Values::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Leaf for bool {
    fn of(values: &Values) -> Option<&[bool]> {
        match values {
            Values::Bool(v) => Some(v),
            _ => None,
        }
    }
}

impl Leaf for ByteArray {
    fn of(values: &Values) -> Option<&[ByteArray]> {
        match values {
            Values::Bytes(v) => Some(v),
            _ => None,
        }
    }
}

enum Reader {
    I32(ColumnReaderImpl<Int32Type>),
    F32(ColumnReaderImpl<FloatType>),
    Bool(ColumnReaderImpl<BoolType>),
    Bytes(ColumnReaderImpl<ByteArrayType>),
}

/// How a column nests: a flat value or a list of them, and which
/// definition levels mean a present value, a null item or a null list.
#[derive(Debug, Clone, Copy)]
struct Shape {
    list: bool,
    max_def: i16,
    /// A list's definition level when it is present and empty; below it, null.
    empty_def: i16,
    item_optional: bool,
}

/// One column of a batch: its levels, non-null values, and where each row's
/// values start; the buffers are kept for the next batch.
struct Column {
    name: String,
    shape: Shape,
    def: Vec<i16>,
    rep: Vec<i16>,
    values: Values,
    /// A list's `rows + 1` entries: row `i`'s values are
    /// `values[starts[i]..starts[i + 1]]`; empty for a flat column, whose row
    /// `i` is value `i`.
    starts: Vec<u32>,
    /// Whether row `i` is not null; empty for a batch without a null.
    valid: Vec<bool>,
    null_items: bool,
}

impl Column {
    /// Decodes the next `rows` rows from `reader` into the column's buffers.
    fn read(&mut self, reader: &mut Reader, rows: usize) -> Result<(), String> {
        self.def.clear();
        self.rep.clear();
        let (def, rep) = (Some(&mut self.def), Some(&mut self.rep));
        let read = match (reader, &mut self.values) {
            (Reader::I32(r), Values::I32(v)) => {
                v.clear();
                r.read_records(rows, def, rep, v)
            }
            (Reader::F32(r), Values::F32(v)) => {
                v.clear();
                r.read_records(rows, def, rep, v)
            }
            (Reader::Bool(r), Values::Bool(v)) => {
                v.clear();
                r.read_records(rows, def, rep, v)
            }
            (Reader::Bytes(r), Values::Bytes(v)) => {
                v.clear();
                r.read_records(rows, def, rep, v)
            }
            _ => return Err("reader and values of different types (a defect)".to_owned()),
        };
        let (records, _, _) = read.map_err(|e| e.to_string())?;
        if records != rows {
            return Err(format!("{records} rows decoded, expected {rows}"));
        }
        self.index_rows(rows)
    }

    /// Indexes the batch's rows from the levels. A list column: `starts` and
    /// `valid`. A flat column: its values spread to one a row (a null row's
    /// value a default), with `valid` where some row is null; read on every
    /// row of a v2 summary, so a flag and a value there, not an index into
    /// packed values (docs/benchmarks.md, analyze throughput).
    fn index_rows(&mut self, rows: usize) -> Result<(), String> {
        let Shape {
            list,
            max_def,
            empty_def,
            item_optional,
        } = self.shape;
        self.starts.clear();
        self.valid.clear();
        self.null_items = false;
        if !list && max_def == 0 {
            if self.values.len() != rows {
                return Err(format!(
                    "{} values decoded, expected one for each of {rows} rows",
                    self.values.len()
                ));
            }
            return Ok(());
        }
        if !list {
            if self.def.len() != rows {
                return Err(format!(
                    "{} rows in the levels, expected {rows}",
                    self.def.len()
                ));
            }
            self.valid.extend(self.def.iter().map(|&d| d == max_def));
            let count = self.valid.iter().filter(|&&v| v).count();
            if count != self.values.len() {
                return Err(format!(
                    "{} values decoded, the levels say {count}",
                    self.values.len()
                ));
            }
            if count == rows {
                self.valid.clear();
            } else {
                self.values.spread(&self.valid);
            }
            return Ok(());
        }
        let mut count = 0_u32;
        for (&d, &r) in self.def.iter().zip(&self.rep) {
            if r == 0 {
                self.starts.push(count);
                self.valid.push(d >= empty_def);
            }
            if d == max_def {
                count += 1;
            } else if item_optional && d == max_def - 1 {
                self.null_items = true;
            }
        }
        self.starts.push(count);
        if self.starts.len() != rows + 1 {
            return Err(format!(
                "{} rows in the levels, expected {rows}",
                self.starts.len() - 1
            ));
        }
        // A row's slice past the values would read as a null list: refuse it.
        if count as usize != self.values.len() {
            return Err(format!(
                "{} values decoded, the levels say {count}",
                self.values.len()
            ));
        }
        Ok(())
    }
}

/// Moves packed `values` (one per `true` of `valid`) to their rows, in place
/// from the back; a null row keeps a default.
fn spread<T: Default>(values: &mut Vec<T>, valid: &[bool]) {
    let mut next = values.len();
    values.resize_with(valid.len(), T::default);
    for (row, _) in valid.iter().enumerate().rev().filter(|(_, v)| **v) {
        next -= 1;
        values.swap(row, next);
    }
}

/// Some columns of a batch of rows of one row group of a part file.
#[derive(Debug)]
pub struct RowBatch<'a> {
    /// Its rows.
    pub rows: usize,
    columns: &'a [Column],
}

impl std::fmt::Debug for Column {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Column")
            .field("name", &self.name)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// Some columns of one row group, read a batch of [`BATCH_ROWS`] rows at a
/// time ([`PartFile::row_group_batches`]).
pub struct RowGroupBatches<'a> {
    part: &'a PartFile,
    index: usize,
    rows: usize,
    read: usize,
    readers: Vec<Reader>,
    columns: Vec<Column>,
}

impl std::fmt::Debug for RowGroupBatches<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowGroupBatches")
            .field("part", &self.part.path)
            .field("index", &self.index)
            .field("rows", &self.rows)
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

impl PartFile {
    /// The file's footer: row groups and the Parquet schema.
    ///
    /// # Errors
    /// When the file cannot be opened or its footer parsed.
    pub fn parquet_metadata(&self) -> Result<Arc<ParquetMetaData>, LoadError> {
        let reader = SerializedFileReader::new(self.open_file()?)
            .map_err(|source| self.decode_error("footer".to_owned(), source))?;
        Ok(Arc::new(reader.metadata().clone()))
    }

    /// The named columns of row group `index` (`metadata` from
    /// [`PartFile::parquet_metadata`]), to be read a batch at a time.
    ///
    /// # Errors
    /// A column the file lacks, one that is not a primitive or a list of
    /// primitives, or a reader that cannot be built.
    pub fn row_group_batches<'a>(
        &'a self,
        metadata: &ParquetMetaData,
        index: usize,
        columns: &[&str],
    ) -> Result<RowGroupBatches<'a>, LoadError> {
        let group = metadata.row_group(index);
        let rows = usize::try_from(group.num_rows()).unwrap_or(0);
        let file = self.open_file()?;
        let (readers, columns) = columns
            .iter()
            .map(|name| self.column(&file, metadata, index, name))
            .collect::<Result<Vec<_>, LoadError>>()?
            .into_iter()
            .unzip();
        Ok(RowGroupBatches {
            part: self,
            index,
            rows,
            read: 0,
            readers,
            columns,
        })
    }

    fn column(
        &self,
        file: &File,
        metadata: &ParquetMetaData,
        index: usize,
        name: &str,
    ) -> Result<(Reader, Column), LoadError> {
        let schema = metadata.file_metadata().schema_descr();
        let fail = |detail: String| {
            self.decode_error(
                format!("row group {index}, column {name}"),
                ParquetError::General(detail),
            )
        };
        let mut leaves = leaves_of(metadata, name);
        let (Some(leaf), None) = (leaves.next(), leaves.next()) else {
            return Err(LoadError::MissingColumn {
                path: self.path.clone(),
                table: self.table.name(),
                column: name.to_owned(),
            });
        };
        let descr = schema.column(leaf);
        let shape = shape_of(schema.get_column_root(leaf), descr.max_def_level()).map_err(fail)?;
        if descr.physical_type() == PhysicalType::INT32 {
            signed_32(descr.converted_type(), descr.logical_type_ref()).map_err(fail)?;
        }
        let chunk = metadata.row_group(index).column(leaf);
        let rows = usize::try_from(metadata.row_group(index).num_rows()).unwrap_or(0);
        let bytes = ChunkBytes::read(file, chunk, self.bytes).map_err(&fail)?;
        let pages =
            SerializedPageReader::new(Arc::new(bytes), chunk, rows, None).map_err(|source| {
                self.decode_error(format!("row group {index}, column {name}"), source)
            })?;
        let (reader, values) = match get_column_reader(descr.clone(), Box::new(pages)) {
            ColumnReader::Int32ColumnReader(r) => (Reader::I32(r), Values::I32(Vec::new())),
            ColumnReader::FloatColumnReader(r) => (Reader::F32(r), Values::F32(Vec::new())),
            ColumnReader::BoolColumnReader(r) => (Reader::Bool(r), Values::Bool(Vec::new())),
            ColumnReader::ByteArrayColumnReader(r) => (Reader::Bytes(r), Values::Bytes(Vec::new())),
            _ => {
                return Err(fail(format!(
                    "values of Parquet type {}, expected INT32, FLOAT, BOOLEAN or BYTE_ARRAY",
                    descr.physical_type()
                )));
            }
        };
        Ok((
            reader,
            Column {
                name: name.to_owned(),
                shape,
                def: Vec::new(),
                rep: Vec::new(),
                values,
                starts: Vec::new(),
                valid: Vec::new(),
                null_items: false,
            },
        ))
    }

    fn open_file(&self) -> Result<File, LoadError> {
        File::open(&self.path).map_err(|source| LoadError::Io {
            path: self.path.clone(),
            source,
        })
    }

    fn decode_error(&self, part: String, source: ParquetError) -> LoadError {
        LoadError::ParquetDecode {
            path: self.path.clone(),
            part,
            source,
        }
    }
}

/// A column chunk's bytes, read with one call, at their offset in the file.
/// Given the file itself, the page reader duplicated its descriptor, seeked,
/// read and closed for every page header and every page: some 3,500 system
/// calls for a GLM-5.1 prefill's summary, not 220 (docs/benchmarks.md,
/// analyze throughput).
struct ChunkBytes {
    offset: u64,
    bytes: Bytes,
}

impl ChunkBytes {
    /// The bytes of `chunk` in `file` (`file_bytes` long), refusing a range
    /// the footer puts outside the file.
    fn read(mut file: &File, chunk: &ColumnChunkMetaData, file_bytes: u64) -> Result<Self, String> {
        let start = chunk
            .dictionary_page_offset()
            .unwrap_or(chunk.data_page_offset());
        let (offset, len) = match (u64::try_from(start), u64::try_from(chunk.compressed_size())) {
            (Ok(offset), Ok(len))
                if offset.checked_add(len).is_some_and(|end| end <= file_bytes) =>
            {
                (offset, len)
            }
            _ => {
                return Err(format!(
                    "column chunk at {start}, {} bytes: outside the file's {file_bytes} bytes",
                    chunk.compressed_size()
                ));
            }
        };
        let mut buffer = vec![0_u8; usize::try_from(len).map_err(|e| e.to_string())?];
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(&mut buffer))
            .map_err(|e| format!("reading the column chunk at {offset}, {len} bytes: {e}"))?;
        Ok(ChunkBytes {
            offset,
            bytes: buffer.into(),
        })
    }

    /// `length` bytes from file offset `start`, or all that follow.
    fn slice(&self, start: u64, length: Option<usize>) -> parquet::errors::Result<Bytes> {
        let outside = || {
            ParquetError::EOF(format!(
                "offset {start} outside the column chunk at {}, {} bytes",
                self.offset,
                self.bytes.len()
            ))
        };
        let from = usize::try_from(start.checked_sub(self.offset).ok_or_else(outside)?)
            .map_err(|_| outside())?;
        let to = length.map_or(Some(self.bytes.len()), |n| from.checked_add(n));
        match to {
            Some(to) if from <= to && to <= self.bytes.len() => Ok(self.bytes.slice(from..to)),
            _ => Err(outside()),
        }
    }
}

impl Length for ChunkBytes {
    fn len(&self) -> u64 {
        self.offset + self.bytes.len() as u64
    }
}

impl ChunkReader for ChunkBytes {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(self.slice(start, None)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.slice(start, Some(length))
    }
}

/// The leaf columns under the top-level column `name`: one for a value or a
/// list of values, none where the file lacks it.
fn leaves_of<'a>(metadata: &'a ParquetMetaData, name: &'a str) -> impl Iterator<Item = usize> + 'a {
    let schema = metadata.file_metadata().schema_descr();
    (0..schema.num_columns())
        .filter(move |&i| schema.column(i).path().parts().first().map(String::as_str) == Some(name))
}

/// Whether the file (`metadata` from [`PartFile::parquet_metadata`]) has
/// the top-level column `name`.
#[must_use]
pub fn has_column(metadata: &ParquetMetaData, name: &str) -> bool {
    leaves_of(metadata, name).next().is_some()
}

/// The one value of the string column `name` in row group `index`, where
/// the footer's statistics say every row holds it (exact minimum equal to
/// exact maximum, no null): a column such a row group need not decode.
/// `None` where they do not say so, or the file lacks the column.
#[must_use]
pub fn same_string(metadata: &ParquetMetaData, index: usize, name: &str) -> Option<String> {
    let mut leaves = leaves_of(metadata, name);
    let (Some(leaf), None) = (leaves.next(), leaves.next()) else {
        return None;
    };
    let Some(Statistics::ByteArray(stats)) = metadata.row_group(index).column(leaf).statistics()
    else {
        return None;
    };
    let (min, max) = (stats.min_opt()?, stats.max_opt()?);
    let whole = stats.min_is_exact() && stats.max_is_exact() && stats.null_count_opt() == Some(0);
    (whole && min == max).then(|| min.as_utf8().ok().map(str::to_owned))?
}

/// The one value of the INT32 column `name` in row group `index`, where the
/// footer's statistics say every row holds it, as [`same_string`] does.
#[must_use]
pub fn same_i32(metadata: &ParquetMetaData, index: usize, name: &str) -> Option<i32> {
    let mut leaves = leaves_of(metadata, name);
    let (Some(leaf), None) = (leaves.next(), leaves.next()) else {
        return None;
    };
    let column = metadata.row_group(index).column(leaf);
    let descr = column.column_descr();
    // An unsigned or narrower logical type orders its minimum and maximum
    // otherwise: decoded, and refused there ([`signed_32`]).
    if descr.max_rep_level() > 0
        || signed_32(descr.converted_type(), descr.logical_type_ref()).is_err()
    {
        return None;
    }
    let Some(Statistics::Int32(stats)) = column.statistics() else {
        return None;
    };
    let (min, max) = (stats.min_opt()?, stats.max_opt()?);
    let whole = stats.min_is_exact() && stats.max_is_exact() && stats.null_count_opt() == Some(0);
    (whole && min == max).then_some(*min)
}

/// How the column under `root` nests, from its schema path: one value per
/// row, or a list whose repeated node is the leaf (a legacy 2-level list) or
/// the leaf's parent (a 3-level `LIST`). Anything else (a struct, a list of
/// structs, a list of lists) is refused, since its levels mean something else.
fn shape_of(root: &SchemaType, max_def: i16) -> Result<Shape, String> {
    let mut nodes = vec![root];
    let mut node = root;
    while let SchemaType::GroupType { fields, .. } = node {
        let [field] = fields.as_slice() else {
            return Err(format!(
                "a group of {} fields, expected a value or a list of values",
                fields.len()
            ));
        };
        node = field;
        nodes.push(node);
    }
    let leaf = nodes.len() - 1;
    let repetition = |i: usize| nodes[i].get_basic_info().repetition();
    let repeated: Vec<usize> = (0..nodes.len())
        .filter(|&i| repetition(i) == Repetition::REPEATED)
        .collect();
    // Each node that is not required adds a definition level.
    let def_through = |i: usize| {
        (0..=i)
            .filter(|&j| repetition(j) != Repetition::REQUIRED)
            .count()
    };
    let level = |n: usize| i16::try_from(n).map_err(|e| e.to_string());
    match repeated.as_slice() {
        [] if leaf == 0 => Ok(Shape {
            list: false,
            max_def,
            empty_def: 0,
            item_optional: false,
        }),
        [] => Err("a group, expected a value or a list of values".to_owned()),
        &[r] if r == leaf || r + 1 == leaf => Ok(Shape {
            list: true,
            max_def,
            // A list with no item stops at the repeated node's parent's level.
            empty_def: level(def_through(r))? - 1,
            item_optional: r != leaf && repetition(leaf) == Repetition::OPTIONAL,
        }),
        [_] => Err("a list of groups, expected a list of values".to_owned()),
        _ => Err(format!(
            "nested {} lists deep, expected at most one",
            repeated.len()
        )),
    }
}

/// Refuses an INT32 leaf annotated as anything but a signed 32-bit integer
/// (unsigned, a date, a decimal): its values would read as other numbers.
fn signed_32(converted: ConvertedType, logical: Option<&LogicalType>) -> Result<(), String> {
    let plain_logical = match logical {
        None => true,
        Some(LogicalType::Integer(int)) => int.bit_width == 32 && int.is_signed,
        Some(_) => false,
    };
    if plain_logical && matches!(converted, ConvertedType::NONE | ConvertedType::INT_32) {
        Ok(())
    } else {
        Err(format!(
            "INT32 annotated {converted} ({logical:?}), expected a signed 32-bit integer"
        ))
    }
}

impl RowGroupBatches<'_> {
    /// The next batch of rows of every column, each column decoded as a task
    /// of its own into its own buffers; `None` after the row group's last row.
    ///
    /// # Errors
    /// A column that cannot be decoded, or columns that end at different rows.
    pub fn next_batch(&mut self) -> Option<Result<RowBatch<'_>, LoadError>> {
        if self.read >= self.rows {
            return None;
        }
        let want = BATCH_ROWS.min(self.rows - self.read);
        let (part, index, first) = (self.part, self.index, self.read);
        let decoded = self
            .columns
            .par_iter_mut()
            .zip(self.readers.par_iter_mut())
            .map(|(column, reader)| {
                column.read(reader, want).map_err(|detail| {
                    part.decode_error(
                        format!(
                            "row group {index}, column {}, rows from {first}",
                            column.name
                        ),
                        ParquetError::General(detail),
                    )
                })
            })
            .collect::<Result<Vec<()>, LoadError>>();
        // After a failure the columns may stand at different rows: no more batches.
        self.read = if decoded.is_ok() {
            self.read + want
        } else {
            self.rows
        };
        Some(decoded.map(|_| RowBatch {
            rows: want,
            columns: &self.columns,
        }))
    }
}

impl RowBatch<'_> {
    fn column(&self, name: &str) -> Result<&Column, AnalyzeError> {
        self.columns
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| layout(name, "not read"))
    }

    fn typed<T: Leaf>(&self, name: &str, list: bool) -> Result<(&Column, &[T]), AnalyzeError> {
        let column = self.column(name)?;
        if column.shape.list != list {
            let detail = if list {
                "not a list"
            } else {
                "a list, expected one value per row"
            };
            return Err(layout(name, detail));
        }
        let values =
            T::of(&column.values).ok_or_else(|| layout(name, "values of an unexpected type"))?;
        Ok((column, values))
    }

    /// A column without nulls, as a slice.
    ///
    /// # Errors
    /// A column not read, of another type, or holding a null.
    pub fn values<T: Leaf>(&self, name: &str) -> Result<&[T], AnalyzeError> {
        let (column, values) = self.typed::<T>(name, false)?;
        if values.len() != self.rows || column.valid.iter().any(|v| !v) {
            return Err(layout(name, "null in a column that never holds one"));
        }
        Ok(values)
    }

    /// A nullable column.
    ///
    /// # Errors
    /// A column not read or of another type.
    pub fn nullable<T: Leaf>(&self, name: &str) -> Result<Nullable<'_, T>, AnalyzeError> {
        let (column, values) = self.typed::<T>(name, false)?;
        Ok(Nullable {
            values,
            valid: &column.valid,
        })
    }

    /// A list column of primitive values, row by row as slices.
    ///
    /// # Errors
    /// A column not read, not a list of `T`, or with null entries in a list.
    pub fn list<T: Leaf>(&self, name: &str) -> Result<ListColumn<'_, T>, AnalyzeError> {
        let (column, values) = self.typed::<T>(name, true)?;
        if column.null_items {
            return Err(layout(name, "null entries inside a list"));
        }
        Ok(ListColumn {
            values,
            starts: &column.starts,
            valid: &column.valid,
        })
    }
}

fn layout(column: &str, detail: &str) -> AnalyzeError {
    AnalyzeError::Layout {
        column: column.to_owned(),
        detail: detail.to_owned(),
    }
}

/// A nullable primitive column of a [`RowBatch`]: row `i`'s value, where
/// present, is `values[i]`.
#[derive(Debug, Clone, Copy)]
pub struct Nullable<'a, T> {
    values: &'a [T],
    /// Empty for a batch without a null.
    valid: &'a [bool],
}

impl<'a, T> Nullable<'a, T> {
    /// Row `i`, `None` where null.
    #[must_use]
    #[inline]
    pub fn get(&self, i: usize) -> Option<T>
    where
        T: Copy,
    {
        self.get_ref(i).copied()
    }

    /// Row `i` by reference, `None` where null.
    #[must_use]
    #[inline]
    pub fn get_ref(&self, i: usize) -> Option<&'a T> {
        match self.valid.get(i) {
            Some(false) => None,
            _ => self.values.get(i),
        }
    }
}

/// A list column of a [`RowBatch`], row by row as slices into one buffer.
#[derive(Debug, Clone, Copy)]
pub struct ListColumn<'a, T> {
    values: &'a [T],
    starts: &'a [u32],
    valid: &'a [bool],
}

impl<'a, T> ListColumn<'a, T> {
    /// Row `i`, `None` where the list is null.
    #[must_use]
    pub fn get(&self, i: usize) -> Option<&'a [T]> {
        if self.valid.get(i) == Some(&false) {
            return None;
        }
        let (start, end) = (*self.starts.get(i)?, *self.starts.get(i + 1)?);
        self.values.get(start as usize..end as usize)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{BooleanBuilder, Float32Builder, Int32Builder, ListBuilder};
    use arrow_array::{ArrayRef, Int32Array, RecordBatch};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    use super::*;

    const ROWS: usize = BATCH_ROWS + 1808;

    /// Row `i` of the list column: null, empty, or a few ascending values.
    fn gaps(i: usize) -> Option<Vec<i32>> {
        let i32_of = |v: usize| i32::try_from(v).unwrap();
        match (i % 11, i % 5) {
            (0, _) => None,
            (_, 0) => Some(Vec::new()),
            _ => Some((0..=i % 4).map(|j| i32_of(i * 10 + j)).collect()),
        }
    }

    fn flat(i: usize) -> Option<i32> {
        (!i.is_multiple_of(7)).then(|| i32::try_from(i).unwrap())
    }

    fn flags(i: usize) -> Vec<bool> {
        (0..i % 3).map(|j| (i + j).is_multiple_of(2)).collect()
    }

    /// Writes the columns with arrow-rs's own writer, in small pages and in
    /// record batches that do not line up with [`BATCH_ROWS`].
    fn part(dir: &std::path::Path, null_item_at: Option<usize>) -> PartFile {
        let path = dir.join("part.parquet");
        let mut list = ListBuilder::new(Int32Builder::new());
        let mut bools = ListBuilder::new(BooleanBuilder::new());
        let mut offsets = ListBuilder::new(Float32Builder::new());
        for i in 0..ROWS {
            match gaps(i) {
                Some(v) => {
                    for x in v {
                        list.values().append_value(x);
                    }
                    if null_item_at == Some(i) {
                        list.values().append_null();
                    }
                    list.append(true);
                }
                None => list.append(false),
            }
            for b in flags(i) {
                bools.values().append_value(b);
            }
            bools.append(true);
            offsets.values().append_value(i as f32 * 0.5);
            offsets.append(true);
        }
        let columns: Vec<(&str, ArrayRef)> = vec![
            (
                "flat",
                Arc::new((0..ROWS).map(flat).collect::<Int32Array>()),
            ),
            (
                "required",
                Arc::new(Int32Array::from_iter_values(
                    (0..ROWS).map(|i| i32::try_from(i).unwrap()),
                )),
            ),
            ("gaps", Arc::new(list.finish())),
            ("flags", Arc::new(bools.finish())),
            ("offsets", Arc::new(offsets.finish())),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let props = WriterProperties::builder()
            .set_data_page_size_limit(1024)
            .set_write_batch_size(97)
            .build();
        let file = File::create(&path).unwrap();
        let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
        for start in (0..ROWS).step_by(3001) {
            writer
                .write(&batch.slice(start, 3001.min(ROWS - start)))
                .unwrap();
        }
        writer.close().unwrap();
        PartFile::written_topk(path, ROWS as u64)
    }

    #[test]
    fn every_row_of_every_batch_reads_back_as_arrow_rs_wrote_it() {
        let tmp = tempfile::tempdir().unwrap();
        let part = part(tmp.path(), None);
        let metadata = part.parquet_metadata().unwrap();
        assert_eq!(metadata.num_row_groups(), 1);
        let names = ["flat", "required", "gaps", "flags", "offsets"];
        let mut batches = part.row_group_batches(&metadata, 0, &names).unwrap();
        let (mut first, mut seen) = (0, 0);
        while let Some(batch) = batches.next_batch() {
            let batch = batch.unwrap();
            let required = batch.values::<i32>("required").unwrap();
            let flat_col = batch.nullable::<i32>("flat").unwrap();
            let (list, bools, offs) = (
                batch.list::<i32>("gaps").unwrap(),
                batch.list::<bool>("flags").unwrap(),
                batch.list::<f32>("offsets").unwrap(),
            );
            assert_eq!(required.len(), batch.rows);
            for (r, &value) in required.iter().enumerate() {
                let i = first + r;
                assert_eq!(value, i32::try_from(i).unwrap());
                assert_eq!(flat_col.get(r), flat(i), "row {i}");
                assert_eq!(list.get(r).map(<[i32]>::to_vec), gaps(i), "row {i}");
                assert_eq!(bools.get(r), Some(flags(i).as_slice()), "row {i}");
                assert_eq!(offs.get(r), Some([i as f32 * 0.5].as_slice()), "row {i}");
            }
            first += batch.rows;
            seen += 1;
        }
        assert_eq!((first, seen), (ROWS, 2), "every row, in two batches");
    }

    #[test]
    fn a_null_inside_a_list_a_null_in_a_required_read_and_a_wrong_type_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let part = part(tmp.path(), Some(1));
        let metadata = part.parquet_metadata().unwrap();
        let mut batches = part
            .row_group_batches(&metadata, 0, &["flat", "required", "gaps"])
            .unwrap();
        let batch = batches.next_batch().unwrap().unwrap();
        let refused = |r: Result<(), AnalyzeError>| r.unwrap_err().to_string();
        assert!(
            refused(batch.list::<i32>("gaps").map(|_| ())).contains("null entries inside a list")
        );
        assert!(refused(batch.values::<i32>("flat").map(|_| ())).contains("null in a column"));
        assert!(refused(batch.values::<f32>("required").map(|_| ())).contains("unexpected type"));
        assert!(refused(batch.nullable::<i32>("gaps").map(|_| ())).contains("a list"));
        assert!(refused(batch.list::<i32>("absent").map(|_| ())).contains("not read"));
        let missing = part
            .row_group_batches(&metadata, 0, &["absent"])
            .unwrap_err();
        assert!(missing.to_string().contains("absent"), "{missing}");
    }

    /// Required lists of required items, a legacy 2-level list, a list of
    /// structs and a DATE, written with the `parquet` crate's low-level
    /// writer from a schema written by hand (arrow-rs writes only optional
    /// lists of optional items).
    #[test]
    fn hand_written_list_shapes_read_as_their_levels_say_and_structs_and_dates_are_refused() {
        use parquet::data_type::Int32Type as Int32;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;

        let schema = "message m {
            required group req_list (LIST) { repeated group list { required int32 element; } }
            optional group legacy (LIST) { repeated int32 array; }
            optional group structs (LIST) {
                repeated group list { optional group element { optional int32 x; } }
            }
            optional int32 day (DATE);
        }";
        // (values, definition levels, repetition levels) per leaf, 4 rows:
        // req_list [1, 2], [], [3], []; legacy [5], null, [], [6, 7].
        let leaves: [(&[i32], &[i16], &[i16]); 4] = [
            (&[1, 2, 3], &[1, 1, 0, 1, 0], &[0, 1, 0, 0, 0]),
            (&[5, 6, 7], &[2, 0, 1, 2, 2], &[0, 0, 0, 0, 1]),
            (&[1, 1, 1, 1], &[4, 4, 4, 4], &[0, 0, 0, 0]),
            (&[1, 2, 3, 4], &[1, 1, 1, 1], &[]),
        ];
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("part.parquet");
        let mut writer = SerializedFileWriter::new(
            File::create(&path).unwrap(),
            Arc::new(parse_message_type(schema).unwrap()),
            Arc::new(WriterProperties::builder().build()),
        )
        .unwrap();
        let mut group = writer.next_row_group().unwrap();
        for (values, def, rep) in leaves {
            let mut column = group.next_column().unwrap().unwrap();
            let rep = (!rep.is_empty()).then_some(rep);
            column
                .typed::<Int32>()
                .write_batch(values, Some(def), rep)
                .unwrap();
            column.close().unwrap();
        }
        group.close().unwrap();
        writer.close().unwrap();
        let part = PartFile::written_topk(path, 4);
        let metadata = part.parquet_metadata().unwrap();
        let mut batches = part
            .row_group_batches(&metadata, 0, &["req_list", "legacy"])
            .unwrap();
        let batch = batches.next_batch().unwrap().unwrap();
        let rows = |name: &str| -> Vec<Option<Vec<i32>>> {
            let list = batch.list::<i32>(name).unwrap();
            (0..batch.rows)
                .map(|i| list.get(i).map(<[i32]>::to_vec))
                .collect()
        };
        assert_eq!(
            rows("req_list"),
            [Some(vec![1, 2]), Some(vec![]), Some(vec![3]), Some(vec![])]
        );
        assert_eq!(
            rows("legacy"),
            [Some(vec![5]), None, Some(vec![]), Some(vec![6, 7])]
        );
        let refused = |name: &str| {
            part.row_group_batches(&metadata, 0, &[name])
                .unwrap_err()
                .to_string()
        };
        assert!(
            refused("structs").contains("a list of groups"),
            "{}",
            refused("structs")
        );
        assert!(refused("day").contains("DATE"), "{}", refused("day"));
    }

    #[test]
    fn levels_that_count_more_or_fewer_values_than_were_decoded_are_refused() {
        // An optional list of required items: def 2 a value, 1 an empty list, 0 null.
        let shape = Shape {
            list: true,
            max_def: 2,
            empty_def: 1,
            item_optional: false,
        };
        let column = |values: Vec<i32>| Column {
            name: "prod_only_gaps".to_owned(),
            shape,
            // Rows [5, 6], [], null, [7].
            def: vec![2, 2, 1, 0, 2],
            rep: vec![0, 1, 0, 0, 0],
            values: Values::I32(values),
            starts: Vec::new(),
            valid: Vec::new(),
            null_items: false,
        };
        let mut whole = column(vec![5, 6, 7]);
        whole.index_rows(4).unwrap();
        assert_eq!(whole.starts, [0, 2, 2, 2, 3]);
        for values in [vec![5, 6], vec![5, 6, 7, 8]] {
            let n = values.len();
            let err = column(values).index_rows(4).unwrap_err();
            assert_eq!(err, format!("{n} values decoded, the levels say 3"));
        }
        let required = Shape {
            list: false,
            max_def: 0,
            empty_def: 0,
            item_optional: false,
        };
        let mut flat = Column {
            shape: required,
            def: Vec::new(),
            rep: Vec::new(),
            ..column(vec![1, 2])
        };
        assert_eq!(
            flat.index_rows(3).unwrap_err(),
            "2 values decoded, expected one for each of 3 rows"
        );
    }

    #[test]
    fn a_flat_column_with_nulls_is_spread_to_one_value_a_row() {
        let optional = Shape {
            list: false,
            max_def: 1,
            empty_def: 1,
            item_optional: false,
        };
        let column = |def: Vec<i16>, values: Vec<i32>| Column {
            name: "boundary_band".to_owned(),
            shape: optional,
            def,
            rep: Vec::new(),
            values: Values::I32(values),
            starts: Vec::new(),
            valid: Vec::new(),
            null_items: false,
        };
        let rows = |column: &Column, n: usize| {
            let batch = RowBatch {
                rows: n,
                columns: std::slice::from_ref(column),
            };
            let read = batch.nullable::<i32>("boundary_band").unwrap();
            let got: Vec<Option<i32>> = (0..n).map(|i| read.get(i)).collect();
            (got, batch.values::<i32>("boundary_band").is_ok())
        };
        // Rows 5, null, 6, 7, null.
        let mut nulls = column(vec![1, 0, 1, 1, 0], vec![5, 6, 7]);
        nulls.index_rows(5).unwrap();
        assert_eq!(
            rows(&nulls, 5),
            (vec![Some(5), None, Some(6), Some(7), None], false)
        );
        let mut whole = column(vec![1, 1, 1], vec![5, 6, 7]);
        whole.index_rows(3).unwrap();
        assert!(whole.valid.is_empty());
        assert_eq!(rows(&whole, 3), (vec![Some(5), Some(6), Some(7)], true));
        // Levels that count another number of values or rows are refused.
        assert_eq!(
            column(vec![1, 0, 1], vec![5, 6, 7])
                .index_rows(3)
                .unwrap_err(),
            "3 values decoded, the levels say 2"
        );
        assert_eq!(
            column(vec![1, 1], vec![5, 6]).index_rows(3).unwrap_err(),
            "2 rows in the levels, expected 3"
        );
    }

    #[test]
    fn a_column_chunk_answers_only_for_its_own_bytes_and_refuses_a_range_outside_the_file() {
        let chunk = ChunkBytes {
            offset: 100,
            bytes: Bytes::from_static(b"0123456789"),
        };
        assert_eq!(Length::len(&chunk), 110);
        assert_eq!(&chunk.get_bytes(102, 3).unwrap()[..], b"234");
        let mut rest = Vec::new();
        chunk.get_read(107).unwrap().read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"789");
        for (start, len) in [(99, 1), (105, 6), (111, 0)] {
            assert!(chunk.get_bytes(start, len).is_err(), "{start}, {len}");
        }

        let tmp = tempfile::tempdir().unwrap();
        let part = part(tmp.path(), None);
        let metadata = part.parquet_metadata().unwrap();
        let file = File::open(&part.path).unwrap();
        let chunk = metadata.row_group(0).column(0);
        let read = ChunkBytes::read(&file, chunk, part.bytes).unwrap();
        let (start, len) = chunk.byte_range();
        assert_eq!((read.offset, read.bytes.len() as u64), (start, len));
        let beyond = ColumnChunkMetaData::builder(chunk.column_descr_ptr())
            .set_data_page_offset(i64::try_from(part.bytes).unwrap() - 4)
            .set_total_compressed_size(8)
            .build()
            .unwrap();
        let err = ChunkBytes::read(&file, &beyond, part.bytes).err().unwrap();
        assert!(err.contains("outside the file"), "{err}");
    }
}
