//! `shadowtrace export --lists`: the full prod and shadow selections of a
//! run's top-k rows, as absolute keys, wherever the run holds enough to
//! rebuild them.
//!
//! A v1 row stores both lists. A v2 row stores the differences always and
//! the full prod list only where `SHADOWTRACE_TOPK_LISTS` sampled it; there
//! the shadow's list is prod minus prod-only plus shadow-only. Every other
//! v2 row cannot be rebuilt, and is counted, never dropped silently.
//!
//! The files written use v1's column names (`prod_indices`,
//! `shadow_indices`), so tools written for v1's full lists read them.

use std::path::{Path, PathBuf};

use polars::prelude::{
    DataFrame, DataType, Int32Type, IntoColumn, IntoSeries, ListBuilderTrait,
    ListPrimitiveChunkedBuilder, NamedFrom, ParquetWriter, PlSmallStr, Series,
};
use shadowtrace_schemas::Table;
use shadowtrace_schemas::columns::{topk as c, topk_v1 as c1};
use shadowtrace_schemas::selection::{extend_keys_from_gaps, keys_from_gaps};

use crate::AnalyzeError;
use crate::frame::{i32s, list, opt_strs};
use crate::load::Run;

/// What an export wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListExport {
    /// Top-k rows of the run.
    pub rows: usize,
    /// Rows whose lists were rebuilt and written.
    pub rebuilt: usize,
    /// Rows that hold no full prod list (v2, not sampled): not written.
    pub without_list: usize,
    /// Files written, one per top-k part that had a row to write.
    pub files: Vec<PathBuf>,
}

impl ListExport {
    /// The line a person reads: what was written and what could not be.
    #[must_use]
    pub fn text(&self, out: &Path) -> String {
        format!(
            "exported the full lists of {} of {} top-k rows to {} ({} files); {} rows could not be rebuilt (no sampled full prod list: SHADOWTRACE_TOPK_LISTS was none, or every:N did not sample them)",
            self.rebuilt,
            self.rows,
            out.display(),
            self.files.len(),
            self.without_list
        )
    }
}

fn write_err(path: &Path) -> impl Fn(polars::prelude::PolarsError) -> AnalyzeError + '_ {
    move |e| AnalyzeError::Write {
        path: path.to_owned(),
        detail: e.to_string(),
    }
}

/// Writes the rebuildable rows of `run`'s top-k table under `out` (created).
///
/// # Errors
/// When a part cannot be read, a column is missing, or a file cannot be written.
pub fn export_lists(run: &Run, out: &Path) -> Result<ListExport, AnalyzeError> {
    std::fs::create_dir_all(out).map_err(|e| AnalyzeError::Write {
        path: out.to_owned(),
        detail: e.to_string(),
    })?;
    let v2 = run.manifest.schema_version >= 2;
    let mut export = ListExport::default();
    for (n, part) in run
        .files
        .get(&Table::Topk)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let columns: &[&str] = if v2 {
            &[
                c::STEP,
                c::LAYER,
                c::TOKEN,
                c::SHADOW_INPUT,
                c::PROD_ONLY_GAPS,
                c::SHADOW_ONLY_GAPS,
                c::PROD_GAPS,
            ]
        } else {
            &[
                c1::STEP,
                c1::LAYER,
                c1::TOKEN,
                c1::SHADOW_INPUT,
                c1::PROD_INDICES,
                c1::SHADOW_INDICES,
            ]
        };
        let mut frame = part.read(Some(columns))?;
        frame.rechunk_mut();
        let rows = frame.height();
        let (step, layer, token) = (
            i32s(&frame, c::STEP)?,
            i32s(&frame, c::LAYER)?,
            i32s(&frame, c::TOKEN)?,
        );
        let shadow_input = opt_strs(&frame, c::SHADOW_INPUT)?;
        let mut keep = Vec::with_capacity(rows);
        let mut prod_out = ListPrimitiveChunkedBuilder::<Int32Type>::new(
            c1::PROD_INDICES.into(),
            rows,
            0,
            DataType::Int32,
        );
        let mut shadow_out = ListPrimitiveChunkedBuilder::<Int32Type>::new(
            c1::SHADOW_INDICES.into(),
            rows,
            0,
            DataType::Int32,
        );
        if v2 {
            let prod_gaps = list::<i32>(&frame, c::PROD_GAPS)?;
            let prod_only = list::<i32>(&frame, c::PROD_ONLY_GAPS)?;
            let shadow_only = list::<i32>(&frame, c::SHADOW_ONLY_GAPS)?;
            let (mut po, mut so, mut shadow) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..rows {
                let Some(gaps) = prod_gaps.get(i) else {
                    continue;
                };
                let prod = keys_from_gaps(gaps);
                prod_out.append_slice(&prod);
                match (prod_only.get(i), shadow_only.get(i)) {
                    (Some(p), Some(s)) => {
                        po.clear();
                        so.clear();
                        extend_keys_from_gaps(p, &mut po);
                        extend_keys_from_gaps(s, &mut so);
                        shadow.clear();
                        shadow.extend(prod.iter().filter(|k| po.binary_search(k).is_err()));
                        shadow.extend_from_slice(&so);
                        shadow.sort_unstable();
                        shadow_out.append_slice(&shadow);
                    }
                    _ => shadow_out.append_null(),
                }
                keep.push(i);
            }
        } else {
            let prod = list::<i32>(&frame, c1::PROD_INDICES)?;
            let shadow = list::<i32>(&frame, c1::SHADOW_INDICES)?;
            for i in 0..rows {
                prod_out.append_opt_slice(prod.get(i));
                shadow_out.append_opt_slice(shadow.get(i));
                keep.push(i);
            }
        }
        export.rows += rows;
        export.rebuilt += keep.len();
        export.without_list += rows - keep.len();
        if keep.is_empty() {
            continue;
        }
        let pick = |v: &[i32], name: &str| {
            Series::new(
                name.into(),
                keep.iter().map(|&i| v[i]).collect::<Vec<i32>>(),
            )
            .into_column()
        };
        let run_id = vec![run.manifest.run_id(); keep.len()];
        let mut out_frame = DataFrame::new(
            keep.len(),
            vec![
                Series::new(PlSmallStr::from_static(c::RUN_ID), run_id).into_column(),
                pick(step, c::STEP),
                pick(layer, c::LAYER),
                pick(token, c::TOKEN),
                Series::new(
                    c::SHADOW_INPUT.into(),
                    keep.iter()
                        .map(|&i| shadow_input[i].clone())
                        .collect::<Vec<Option<String>>>(),
                )
                .into_column(),
                prod_out.finish().into_series().into_column(),
                shadow_out.finish().into_series().into_column(),
            ],
        )
        .map_err(write_err(out))?;
        let path = out.join(format!("topk-lists-part-{n:05}.parquet"));
        let file = std::fs::File::create(&path).map_err(|e| AnalyzeError::Write {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        ParquetWriter::new(file)
            .finish(&mut out_frame)
            .map_err(write_err(&path))?;
        export.files.push(path);
    }
    Ok(export)
}
