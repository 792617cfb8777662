//! Column buffers: rows in, Arrow record batches out, shaped by the table
//! definitions of the run's trace format version.

use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Float32Builder, Int32Builder, Int64Builder, ListBuilder, StringBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::SchemaRef;
use shadowtrace_schemas::{ColumnType, Table, TableSpec};

use super::TopkLists;
use super::topk::append_topk_v2;
use crate::TraceError;
use crate::record::{EventRow, HiddenRow, LogitsRow, Record, Selection, TopLogits, TopkRow};

enum ColumnBuilder {
    I32(Int32Builder),
    I64(Int64Builder),
    F32(Float32Builder),
    Bool(BooleanBuilder),
    Utf8(StringBuilder),
    ListI32(ListBuilder<Int32Builder>),
    ListF32(ListBuilder<Float32Builder>),
    ListBool(ListBuilder<BooleanBuilder>),
}

impl ColumnBuilder {
    fn new(ty: ColumnType) -> ColumnBuilder {
        match ty {
            ColumnType::I32 => ColumnBuilder::I32(Int32Builder::new()),
            ColumnType::I64 => ColumnBuilder::I64(Int64Builder::new()),
            ColumnType::F32 => ColumnBuilder::F32(Float32Builder::new()),
            ColumnType::Bool => ColumnBuilder::Bool(BooleanBuilder::new()),
            ColumnType::Utf8 => ColumnBuilder::Utf8(StringBuilder::new()),
            ColumnType::ListI32 => ColumnBuilder::ListI32(ListBuilder::new(Int32Builder::new())),
            ColumnType::ListF32 => ColumnBuilder::ListF32(ListBuilder::new(Float32Builder::new())),
            ColumnType::ListBool => {
                ColumnBuilder::ListBool(ListBuilder::new(BooleanBuilder::new()))
            }
        }
    }

    fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnBuilder::I32(b) => Arc::new(b.finish()),
            ColumnBuilder::I64(b) => Arc::new(b.finish()),
            ColumnBuilder::F32(b) => Arc::new(b.finish()),
            ColumnBuilder::Bool(b) => Arc::new(b.finish()),
            ColumnBuilder::Utf8(b) => Arc::new(b.finish()),
            ColumnBuilder::ListI32(b) => Arc::new(b.finish()),
            ColumnBuilder::ListF32(b) => Arc::new(b.finish()),
            ColumnBuilder::ListBool(b) => Arc::new(b.finish()),
        }
    }
}

/// Rows of one table, buffered column by column until the next batch.
pub(crate) struct TableBuffer {
    spec: &'static TableSpec,
    schema: SchemaRef,
    run_id: String,
    topk_lists: TopkLists,
    columns: Vec<ColumnBuilder>,
    rows: usize,
}

impl TableBuffer {
    /// A buffer for `table` in trace format `version` (a version the schemas
    /// crate reads; the writer checks it when the run opens).
    pub(crate) fn new(
        table: Table,
        version: u32,
        run_id: &str,
        topk_lists: TopkLists,
    ) -> Result<TableBuffer, TraceError> {
        let (Some(spec), Some(schema)) = (table.spec_for(version), table.arrow_schema_for(version))
        else {
            return Err(TraceError::UnknownVersion { version });
        };
        let columns = spec
            .columns
            .iter()
            .map(|c| ColumnBuilder::new(c.ty))
            .collect();
        Ok(TableBuffer {
            spec,
            schema,
            run_id: run_id.to_owned(),
            topk_lists,
            columns,
            rows: 0,
        })
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Appends one row. A row that does not fit the definition is a defect:
    /// the buffer is then unusable and the error says which column.
    pub(crate) fn push(&mut self, record: &Record) -> Result<(), TraceError> {
        debug_assert_eq!(record.table(), self.spec.table);
        let mut row = RowCursor {
            spec: self.spec,
            columns: &mut self.columns,
            next: 0,
        };
        row.str(Some(&self.run_id))?;
        match record {
            Record::Hidden(r) => append_hidden(&mut row, r)?,
            Record::Topk(r) if self.spec.schema_version == 1 => append_topk_v1(&mut row, r)?,
            Record::Topk(r) => append_topk_v2(&mut row, r, self.topk_lists.samples(r.token))?,
            Record::Event(r) => append_event(&mut row, r)?,
            Record::Logits(r) => append_logits(&mut row, r)?,
        }
        row.end()?;
        self.rows += 1;
        Ok(())
    }

    /// Takes the buffered rows as one record batch.
    pub(crate) fn take_batch(&mut self) -> Result<RecordBatch, TraceError> {
        let arrays: Vec<ArrayRef> = self.columns.iter_mut().map(ColumnBuilder::finish).collect();
        self.rows = 0;
        RecordBatch::try_new(self.schema.clone(), arrays).map_err(|source| TraceError::Batch {
            table: self.spec.table,
            source,
        })
    }
}

/// Appends the values of one row to consecutive columns, checking each
/// value's type against the column's.
pub(crate) struct RowCursor<'a> {
    spec: &'static TableSpec,
    columns: &'a mut [ColumnBuilder],
    next: usize,
}

macro_rules! cursor_method {
    ($name:ident, $arg:ty, $variant:ident, $got:literal, |$b:ident, $v:ident| $append:expr) => {
        pub(crate) fn $name(&mut self, $v: $arg) -> Result<(), TraceError> {
            match self.columns.get_mut(self.next) {
                Some(ColumnBuilder::$variant($b)) => {
                    $append;
                    self.next += 1;
                    Ok(())
                }
                _ => Err(self.drift($got)),
            }
        }
    };
}

impl RowCursor<'_> {
    cursor_method!(i32, Option<i32>, I32, "i32", |b, v| b.append_option(v));
    cursor_method!(i64, Option<i64>, I64, "i64", |b, v| b.append_option(v));
    cursor_method!(f32, Option<f32>, F32, "f32", |b, v| b.append_option(v));
    cursor_method!(bool, Option<bool>, Bool, "bool", |b, v| b.append_option(v));
    cursor_method!(str, Option<&str>, Utf8, "utf8", |b, v| b.append_option(v));
    cursor_method!(
        list_i32,
        Option<&[i32]>,
        ListI32,
        "list<i32>",
        |b, v| match v {
            Some(values) => {
                b.values().append_slice(values);
                b.append(true);
            }
            None => b.append(false),
        }
    );
    cursor_method!(
        list_f32,
        Option<&[f32]>,
        ListF32,
        "list<f32>",
        |b, v| match v {
            Some(values) => {
                b.values().append_slice(values);
                b.append(true);
            }
            None => b.append(false),
        }
    );
    cursor_method!(
        list_bool,
        Option<&[bool]>,
        ListBool,
        "list<bool>",
        |b, v| match v {
            Some(values) => {
                b.values().append_slice(values);
                b.append(true);
            }
            None => b.append(false),
        }
    );

    fn end(&self) -> Result<(), TraceError> {
        if self.next == self.columns.len() {
            Ok(())
        } else {
            Err(self.drift("end of row"))
        }
    }

    fn drift(&self, got: &'static str) -> TraceError {
        let expected = self
            .spec
            .columns
            .get(self.next)
            .map_or(ColumnType::Utf8, |c| c.ty);
        TraceError::SchemaDrift {
            table: self.spec.table,
            column: self.next,
            expected,
            got,
        }
    }
}

// === rows, in the column order of schemas/v1/<table>.json (v2: writer/topk.rs) ===

fn append_hidden(row: &mut RowCursor<'_>, r: &HiddenRow) -> Result<(), TraceError> {
    let shadow = r.shadow.as_ref();
    row.i64(Some(r.seq))?;
    row.i32(Some(r.step))?;
    row.i32(Some(r.layer))?;
    row.str(Some(&r.site))?;
    row.i32(Some(r.token))?;
    row.str(shadow.map(|s| s.mode.as_str()))?;
    row.i64(Some(r.numel))?;
    row.i64(Some(r.prod.nan))?;
    row.i64(Some(r.prod.pos_inf))?;
    row.i64(Some(r.prod.neg_inf))?;
    row.f32(Some(r.prod.max_abs))?;
    row.f32(Some(r.prod.l2))?;
    row.i64(shadow.map(|s| s.stats.nan))?;
    row.i64(shadow.map(|s| s.stats.pos_inf))?;
    row.i64(shadow.map(|s| s.stats.neg_inf))?;
    row.f32(shadow.map(|s| s.stats.max_abs))?;
    row.f32(shadow.map(|s| s.stats.l2))?;
    row.f32(shadow.map(|s| s.comparison.rel_l2_err))?;
    row.f32(shadow.map(|s| s.comparison.cosine))?;
    row.f32(shadow.map(|s| s.comparison.max_abs_diff))
}

fn append_selection(row: &mut RowCursor<'_>, s: Option<&Selection>) -> Result<(), TraceError> {
    let boundary = s.and_then(|s| s.boundary.as_ref());
    row.list_i32(s.map(|s| s.indices.as_slice()))?;
    row.f32(s.and_then(|s| s.kth_score))?;
    row.f32(s.and_then(|s| s.kth_margin))?;
    row.list_i32(boundary.map(|b| b.indices.as_slice()))?;
    row.list_f32(boundary.map(|b| b.scores.as_slice()))
}

/// A top-k row as trace format v1 stores it: both full lists (runs written
/// in v1 on purpose, for reading old runs back in tests and benchmarks).
fn append_topk_v1(row: &mut RowCursor<'_>, r: &TopkRow) -> Result<(), TraceError> {
    row.i32(Some(r.step))?;
    row.i32(Some(r.layer))?;
    row.i32(Some(r.token))?;
    row.str(r.shadow.as_ref().map(|(input, _)| input.as_str()))?;
    row.i32(Some(r.indexer_layer))?;
    row.i32(Some(r.k))?;
    row.i32(Some(r.visible))?;
    append_selection(row, Some(&r.prod))?;
    append_selection(row, r.shadow.as_ref().map(|(_, s)| s))?;
    row.f32(r.boundary_band)
}

fn append_event(row: &mut RowCursor<'_>, r: &EventRow) -> Result<(), TraceError> {
    row.i64(Some(r.seq))?;
    row.i32(Some(r.step))?;
    row.i32(Some(r.layer))?;
    row.str(Some(&r.site))?;
    row.str(Some(&r.path))?;
    row.str(Some(&r.kind))?;
    row.i32(r.token)?;
    row.i32(r.channel)?;
    row.i64(Some(r.count))?;
    row.bool(r.shadow_finite)?;
    row.str(r.check.as_deref())?;
    row.bool(r.passed)?;
    row.f32(r.value)?;
    row.str(r.detail.as_deref())
}

fn append_logits(row: &mut RowCursor<'_>, r: &LogitsRow) -> Result<(), TraceError> {
    fn top(t: &TopLogits) -> (&[i32], &[f32]) {
        (t.ids.as_slice(), t.logprobs.as_slice())
    }
    let (prod_ids, prod_logprobs) = top(&r.prod);
    let shadow = r.shadow.as_ref().map(top);
    row.i32(Some(r.step))?;
    row.i32(Some(r.token))?;
    row.list_i32(Some(prod_ids))?;
    row.list_f32(Some(prod_logprobs))?;
    row.list_i32(shadow.map(|s| s.0))?;
    row.list_f32(shadow.map(|s| s.1))
}

/// Puts a selection in the stored form: padding dropped, indices ascending,
/// boundary scores kept aligned with their indices.
pub(crate) fn normalize_selection(s: &mut Selection) {
    s.indices.retain(|&i| i >= 0);
    s.indices.sort_unstable();
    if let Some(b) = s.boundary.as_mut() {
        let mut pairs: Vec<(i32, f32)> = b
            .indices
            .iter()
            .copied()
            .zip(b.scores.iter().copied())
            .collect();
        pairs.sort_unstable_by_key(|p| p.0);
        (b.indices, b.scores) = pairs.into_iter().unzip();
    }
}

/// Whether a row is well-formed beyond its types; a malformed row is counted
/// and not written.
pub(crate) fn is_well_formed(record: &Record) -> bool {
    let aligned = |s: &Selection| {
        s.boundary
            .as_ref()
            .is_none_or(|b| b.indices.len() == b.scores.len())
    };
    match record {
        Record::Topk(r) => aligned(&r.prod) && r.shadow.as_ref().is_none_or(|(_, s)| aligned(s)),
        Record::Logits(r) => {
            r.prod.ids.len() == r.prod.logprobs.len()
                && r.shadow
                    .as_ref()
                    .is_none_or(|s| s.ids.len() == s.logprobs.len())
        }
        Record::Hidden(_) | Record::Event(_) => true,
    }
}
