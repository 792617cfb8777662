//! Helpers shared by the cross-component tests: a cell-by-cell view of
//! tables, so a row written by the tracer can be compared with the row the
//! analyzer reads back, NaN payloads and all.

use polars::prelude::{AnyValue, DataFrame};
use shadowtrace_analyzer::load::polars_type;
use shadowtrace_schemas::{ColumnType, Table};

/// One value of a table, with floats as their bit patterns so that NaN and
/// signed zeros compare exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cell {
    /// An i32 column.
    I32(Option<i32>),
    /// An i64 column.
    I64(Option<i64>),
    /// An f32 column, as bits.
    F32(Option<u32>),
    /// A bool column.
    Bool(Option<bool>),
    /// A utf8 column.
    Str(Option<String>),
    /// A list<i32> column.
    ListI32(Option<Vec<i32>>),
    /// A list<f32> column, as bits.
    ListF32(Option<Vec<u32>>),
    /// A list<bool> column.
    ListBool(Option<Vec<bool>>),
}

/// Every row of a frame as cells, in the column order of the table's
/// definition in the current trace format version, after checking that each
/// column has the defined polars type.
///
/// # Panics
/// When a column is missing or of another type: the test fails there.
#[must_use]
pub fn rows_as_cells(table: Table, df: &DataFrame) -> Vec<Vec<Cell>> {
    rows_as_cells_of(table, shadowtrace_schemas::SCHEMA_VERSION, df)
}

/// [`rows_as_cells`] against the table's definition in trace format `version`.
///
/// # Panics
/// When the version is unknown, or a column is missing or of another type.
#[must_use]
pub fn rows_as_cells_of(table: Table, version: u32, df: &DataFrame) -> Vec<Vec<Cell>> {
    let spec = table
        .spec_for(version)
        .unwrap_or_else(|| panic!("no trace format version {version}"));
    let columns: Vec<_> = spec
        .columns
        .iter()
        .map(|c| {
            let column = df
                .column(&c.name)
                .unwrap_or_else(|e| panic!("{table}.{}: {e}", c.name));
            assert_eq!(
                column.dtype(),
                &polars_type(c.ty),
                "{table}.{} type",
                c.name
            );
            (c.ty, column.as_materialized_series().clone())
        })
        .collect();
    (0..df.height())
        .map(|i| {
            columns
                .iter()
                .map(|(ty, series)| cell(*ty, &series.get(i).unwrap_or(AnyValue::Null)))
                .collect()
        })
        .collect()
}

fn cell(ty: ColumnType, value: &AnyValue<'_>) -> Cell {
    let null = matches!(value, AnyValue::Null);
    match (ty, value) {
        (ColumnType::I32, AnyValue::Int32(v)) => Cell::I32(Some(*v)),
        (ColumnType::I64, AnyValue::Int64(v)) => Cell::I64(Some(*v)),
        (ColumnType::F32, AnyValue::Float32(v)) => Cell::F32(Some(v.to_bits())),
        (ColumnType::Bool, AnyValue::Boolean(v)) => Cell::Bool(Some(*v)),
        (ColumnType::Utf8, AnyValue::String(v)) => Cell::Str(Some((*v).to_owned())),
        (ColumnType::Utf8, AnyValue::StringOwned(v)) => Cell::Str(Some(v.to_string())),
        (ColumnType::ListI32, AnyValue::List(s)) => Cell::ListI32(Some(
            s.i32()
                .map(|c| c.into_no_null_iter().collect())
                .unwrap_or_default(),
        )),
        (ColumnType::ListF32, AnyValue::List(s)) => Cell::ListF32(Some(
            s.f32()
                .map(|c| c.into_no_null_iter().map(f32::to_bits).collect())
                .unwrap_or_default(),
        )),
        (ColumnType::ListBool, AnyValue::List(s)) => Cell::ListBool(Some(
            s.bool()
                .map(|c| c.iter().map(|v| v.unwrap_or_default()).collect())
                .unwrap_or_default(),
        )),
        (ColumnType::I32, _) if null => Cell::I32(None),
        (ColumnType::I64, _) if null => Cell::I64(None),
        (ColumnType::F32, _) if null => Cell::F32(None),
        (ColumnType::Bool, _) if null => Cell::Bool(None),
        (ColumnType::Utf8, _) if null => Cell::Str(None),
        (ColumnType::ListI32, _) if null => Cell::ListI32(None),
        (ColumnType::ListF32, _) if null => Cell::ListF32(None),
        (ColumnType::ListBool, _) if null => Cell::ListBool(None),
        (ty, other) => panic!("column of type {ty} holds {other:?}"),
    }
}
