//! Typed, zero-copy views of the columns the metrics read. Frames come from
//! [`crate::Dataset::read_table`], which rechunks, so each column is one
//! contiguous arrow array.

use polars::prelude::{DataFrame, Series, StringChunked};
use polars_arrow::array::{Array, ListArray, PrimitiveArray};

use crate::AnalyzeError;

fn series<'a>(df: &'a DataFrame, name: &str) -> Result<&'a Series, AnalyzeError> {
    df.column(name)
        .map(polars::prelude::Column::as_materialized_series)
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })
}

/// A non-null i32 column as a slice.
pub(crate) fn i32s<'a>(df: &'a DataFrame, name: &str) -> Result<&'a [i32], AnalyzeError> {
    series(df, name)?
        .i32()
        .and_then(|ca| ca.cont_slice())
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })
}

/// A non-null i64 column as a slice.
pub(crate) fn i64s<'a>(df: &'a DataFrame, name: &str) -> Result<&'a [i64], AnalyzeError> {
    series(df, name)?
        .i64()
        .and_then(|ca| ca.cont_slice())
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })
}

/// A nullable f32 column, nulls as `None`.
pub(crate) fn opt_f32s(df: &DataFrame, name: &str) -> Result<Vec<Option<f32>>, AnalyzeError> {
    let ca = series(df, name)?
        .f32()
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })?;
    Ok(ca.iter().collect())
}

/// A nullable i64 column, nulls as `None`.
pub(crate) fn opt_i64s(df: &DataFrame, name: &str) -> Result<Vec<Option<i64>>, AnalyzeError> {
    let ca = series(df, name)?
        .i64()
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })?;
    Ok(ca.iter().collect())
}

/// A nullable i32 column, nulls as `None`.
pub(crate) fn opt_i32s(df: &DataFrame, name: &str) -> Result<Vec<Option<i32>>, AnalyzeError> {
    let ca = series(df, name)?
        .i32()
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })?;
    Ok(ca.iter().collect())
}

/// A nullable bool column, nulls as `None`.
pub(crate) fn opt_bools(df: &DataFrame, name: &str) -> Result<Vec<Option<bool>>, AnalyzeError> {
    let ca = series(df, name)?
        .bool()
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })?;
    Ok(ca.iter().collect())
}

fn strings<'a>(df: &'a DataFrame, name: &str) -> Result<&'a StringChunked, AnalyzeError> {
    series(df, name)?
        .str()
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })
}

/// A string column, nulls as `None`.
pub(crate) fn opt_strs(df: &DataFrame, name: &str) -> Result<Vec<Option<String>>, AnalyzeError> {
    Ok(strings(df, name)?
        .iter()
        .map(|v| v.map(str::to_owned))
        .collect())
}

/// A nullable primitive column read in place: its values and validity, no
/// `Vec<Option<T>>` built (on a GLM-5.1 run's 639k top-k rows, seven such
/// vectors were 36 MB of fresh pages).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NullView<'a, T: polars_arrow::types::NativeType> {
    /// `None` for a column with no chunk (an empty frame).
    array: Option<&'a PrimitiveArray<T>>,
}

impl<T: polars_arrow::types::NativeType> NullView<'_, T> {
    /// Row `i`, or `None` where it is null.
    pub(crate) fn get(&self, i: usize) -> Option<T> {
        let array = self.array?;
        array.is_valid(i).then(|| array.value(i))
    }
}

/// A nullable primitive column as a [`NullView`]. The frame must be
/// rechunked (one array).
pub(crate) fn null_view<'a, T: polars_arrow::types::NativeType>(
    df: &'a DataFrame,
    name: &str,
) -> Result<NullView<'a, T>, AnalyzeError> {
    let array = match one_chunk(series(df, name)?.chunks().iter(), name)? {
        Some(array) => Some(
            array
                .as_any()
                .downcast_ref::<PrimitiveArray<T>>()
                .ok_or_else(|| layout(name, "a column of an unexpected type"))?,
        ),
        None => None,
    };
    Ok(NullView { array })
}

/// A string column's rows borrowed from its buffers, nulls as `None`.
pub(crate) fn str_refs<'a>(
    df: &'a DataFrame,
    name: &str,
) -> Result<Vec<Option<&'a str>>, AnalyzeError> {
    Ok(strings(df, name)?.iter().collect())
}

/// Whether each row of a string column equals `value` (null: no), without
/// a `String` per row.
pub(crate) fn str_equals(
    df: &DataFrame,
    name: &str,
    value: &str,
) -> Result<Vec<bool>, AnalyzeError> {
    Ok(strings(df, name)?
        .iter()
        .map(|v| v == Some(value))
        .collect())
}

fn layout(name: &str, detail: &str) -> AnalyzeError {
    AnalyzeError::Layout {
        column: name.to_owned(),
        detail: detail.to_owned(),
    }
}

/// A column's one chunk; `None` for a column with none (an empty frame).
fn one_chunk<'a, A>(
    mut chunks: impl Iterator<Item = &'a A>,
    name: &str,
) -> Result<Option<&'a A>, AnalyzeError> {
    match (chunks.next(), chunks.next()) {
        (Some(chunk), None) => Ok(Some(chunk)),
        (None, _) => Ok(None),
        _ => Err(layout(name, "more than one chunk: rechunk first")),
    }
}

/// A list column of primitive values, row by row as slices into one
/// buffer: no allocation per row.
#[derive(Debug)]
pub(crate) struct ListView<'a, T: polars_arrow::types::NativeType> {
    /// `None` for a column with no chunk (an empty frame).
    list: Option<&'a ListArray<i64>>,
    offsets: &'a [i64],
    values: &'a [T],
}

impl<'a, T: polars_arrow::types::NativeType> ListView<'a, T> {
    /// Row `i`, or `None` where the list is null.
    pub(crate) fn get(&self, i: usize) -> Option<&'a [T]> {
        if !self.list?.is_valid(i) {
            return None;
        }
        let (start, end) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        Some(&self.values[start..end])
    }
}

/// A list column's one arrow array (`None` for a column with no chunk: an
/// empty frame) and its values as `V`, which hold no null entry.
fn list_array<'a, V: Array + 'static>(
    df: &'a DataFrame,
    name: &str,
) -> Result<Option<(&'a ListArray<i64>, &'a V)>, AnalyzeError> {
    let bad = |detail: &str| layout(name, detail);
    let ca = series(df, name)?
        .list()
        .map_err(|source| AnalyzeError::Frame {
            column: name.to_owned(),
            source,
        })?;
    let Some(list) = one_chunk(ca.downcast_iter(), name)? else {
        return Ok(None);
    };
    let values = list
        .values()
        .as_any()
        .downcast_ref::<V>()
        .ok_or_else(|| bad("list values of an unexpected type"))?;
    if values.null_count() > 0 {
        return Err(bad("null entries inside a list"));
    }
    Ok(Some((list, values)))
}

/// A list column as a [`ListView`]. The frame must be rechunked (one array).
pub(crate) fn list<'a, T: polars_arrow::types::NativeType>(
    df: &'a DataFrame,
    name: &str,
) -> Result<ListView<'a, T>, AnalyzeError> {
    Ok(match list_array::<PrimitiveArray<T>>(df, name)? {
        Some((list, values)) => ListView {
            list: Some(list),
            offsets: list.offsets().as_slice(),
            values: values.values().as_slice(),
        },
        None => ListView {
            list: None,
            offsets: &[0],
            values: &[],
        },
    })
}
