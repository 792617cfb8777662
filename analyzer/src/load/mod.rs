//! Loading runs: any number of run directories, or directories of runs, as
//! one dataset. Each run is checked whole before any of it is used; a bad
//! run is reported with the file and the problem, and either skipped or, in
//! strict mode, fatal.

mod part_file;
mod row_group;
mod run;

use std::path::{Path, PathBuf};

use part_file::spec_of;
pub use part_file::{PartFile, polars_type};
use polars::prelude::{CompatLevel, DataFrame, Series};
use polars_arrow::array::new_empty_array;
pub use row_group::{
    BATCH_ROWS, Leaf, ListColumn, Nullable, RowBatch, RowGroupBatches, Values, has_column,
    same_i32, same_string,
};
pub use run::Run;
use shadowtrace_schemas::{MANIFEST_FILE, SCHEMA_VERSION, Table};

use crate::LoadError;

/// How deep below a given path runs are searched for.
const MAX_DEPTH: usize = 4;

/// Runs loaded from the paths given, and the ones that could not be.
#[derive(Debug, Default)]
pub struct Dataset {
    /// Runs that passed every check, in path order.
    pub runs: Vec<Run>,
    /// Runs that failed a check, each with the file and the problem.
    pub skipped: Vec<LoadError>,
    /// Run directories reached more than once (a path given twice, or
    /// inside another given path): read once.
    pub repeated: Vec<PathBuf>,
}

impl Dataset {
    /// Finds every run under `paths` and opens each.
    ///
    /// With `strict`, the first bad run is the error (a run whose files
    /// contradict its manifest, [`Run::problems`], included); otherwise bad
    /// runs are collected in [`Dataset::skipped`], and runs with problems are
    /// kept with them. `progress` is called after each run
    /// with (runs done, runs found).
    ///
    /// # Errors
    /// A path with no run under it, or in strict mode the first bad run.
    pub fn load(
        paths: &[PathBuf],
        strict: bool,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Dataset, LoadError> {
        let mut dirs = Vec::new();
        for path in paths {
            let before = dirs.len();
            find_runs(path, 0, &mut dirs)?;
            if dirs.len() == before {
                return Err(LoadError::NoRuns { path: path.clone() });
            }
        }
        let mut dataset = Dataset::default();
        // One directory read twice would be counted twice, and paired with
        // itself as a determinism check.
        let mut seen = std::collections::BTreeSet::new();
        dirs.retain(|dir| {
            let key = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            let first = seen.insert(key);
            if !first {
                dataset.repeated.push(dir.clone());
            }
            first
        });
        for (i, dir) in dirs.iter().enumerate() {
            match Run::open(dir) {
                Ok(run) if strict && !run.problems.is_empty() => {
                    return Err(run.problems[0].clone().into());
                }
                Ok(run) => dataset.runs.push(run),
                Err(e) if strict => return Err(e),
                Err(e) => dataset.skipped.push(e),
            }
            progress(i + 1, dirs.len());
        }
        Ok(dataset)
    }

    /// One table of every run, stacked, with only the named columns (all when
    /// `None`). Each row carries its `run_id`, which joins it to
    /// [`Dataset::runs`]. The runs' trace format versions must define the
    /// same columns (the top-k table differs between v1 and v2: read it per
    /// run, [`Run::read_table`]).
    ///
    /// # Errors
    /// When a file cannot be decoded, or runs of different top-k versions
    /// are stacked.
    pub fn read_table(
        &self,
        table: Table,
        columns: Option<&[&str]>,
    ) -> Result<DataFrame, LoadError> {
        stack(
            self.runs
                .iter()
                .flat_map(|r| r.files.get(&table).into_iter().flatten()),
            table,
            self.runs
                .first()
                .map_or(SCHEMA_VERSION, |r| r.manifest.schema_version),
            columns,
        )
    }
}

/// Reads part files and stacks them into one rechunked frame (an empty
/// frame of the table's types when there are none).
fn stack<'a>(
    parts: impl Iterator<Item = &'a PartFile>,
    table: Table,
    version: u32,
    columns: Option<&[&str]>,
) -> Result<DataFrame, LoadError> {
    let mut stacked: Option<DataFrame> = None;
    for part in parts {
        let frame = part.read(columns)?;
        match stacked.as_mut() {
            Some(acc) => {
                acc.vstack_mut(&frame).map_err(|source| LoadError::Decode {
                    path: part.path.clone(),
                    source,
                })?;
            }
            None => stacked = Some(frame),
        }
    }
    match stacked {
        Some(mut frame) => {
            frame.rechunk_mut();
            Ok(frame)
        }
        None => Ok(empty_frame(table, version, columns)),
    }
}

/// A frame with the table's columns and types and no rows. Built from empty
/// Arrow arrays, not `Series::new_empty`: that goes through `full_null`,
/// whose first call has polars zero an 8 MiB buffer it keeps for good, a
/// sixth of a remembered `analyze` of a run without hidden-state tables
/// (docs/benchmarks.md, analyze throughput).
fn empty_frame(table: Table, version: u32, columns: Option<&[&str]>) -> DataFrame {
    let spec = spec_of(table, version);
    let series = spec
        .columns
        .iter()
        .filter(|c| columns.is_none_or(|names| names.contains(&c.name.as_str())))
        .map(|c| {
            let ty = polars_type(c.ty);
            let empty = new_empty_array(ty.to_arrow(CompatLevel::newest()));
            Series::from_arrow(c.name.as_str().into(), empty)
                .unwrap_or_else(|_| Series::new_empty(c.name.as_str().into(), &ty))
                .into()
        })
        .collect();
    DataFrame::new(0, series).unwrap_or_default()
}

/// Collects run directories at or below `path`: a directory holding a
/// manifest is a run; a directory holding table folders but no manifest is a
/// run whose manifest is missing, reported by [`Run::open`].
fn find_runs(path: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<(), LoadError> {
    if path.join(MANIFEST_FILE).is_file() || Table::ALL.iter().any(|t| path.join(t.name()).is_dir())
    {
        out.push(path.to_owned());
        return Ok(());
    }
    if depth >= MAX_DEPTH || !path.is_dir() {
        return Ok(());
    }
    let mut children: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|source| LoadError::Io {
            path: path.to_owned(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    children.sort();
    for child in children {
        find_runs(&child, depth + 1, out)?;
    }
    Ok(())
}
