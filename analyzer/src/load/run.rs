//! One run directory: its manifest and the part files of each table.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use shadowtrace_schemas::manifest::Status;
use shadowtrace_schemas::{
    MANIFEST_FILE, Manifest, TMP_SUFFIX, Table, content_hash, is_readable, readable_versions_text,
};

use super::part_file::PartFile;
use crate::{LoadError, RunProblem};

/// A run whose manifest and files passed every check.
#[derive(Debug, Clone)]
pub struct Run {
    /// The run directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Complete part files per table, in part order.
    pub files: BTreeMap<Table, Vec<PartFile>>,
    /// Things a user should know that do not stop the run being read, for
    /// example files a killed writer left behind.
    pub notes: Vec<String>,
    /// What the run's files contradict (see [`RunProblem`]): the run reads,
    /// but `inspect` fails on it.
    pub problems: Vec<RunProblem>,
}

impl Run {
    /// Whether the producer closed the run.
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.manifest.status == Status::Complete
    }

    /// Rows of `table` in complete files.
    #[must_use]
    pub fn rows(&self, table: Table) -> u64 {
        self.files
            .get(&table)
            .map_or(0, |f| f.iter().map(|p| p.rows).sum())
    }

    /// Bytes of `table` on disk.
    #[must_use]
    pub fn bytes(&self, table: Table) -> u64 {
        self.files
            .get(&table)
            .map_or(0, |f| f.iter().map(|p| p.bytes).sum())
    }

    /// The named columns (all when `None`) of one table of this run, its
    /// part files stacked.
    ///
    /// # Errors
    /// When a file cannot be decoded.
    pub fn read_table(
        &self,
        table: Table,
        columns: Option<&[&str]>,
    ) -> Result<polars::prelude::DataFrame, LoadError> {
        super::stack(
            self.files.get(&table).into_iter().flatten(),
            table,
            self.manifest.schema_version,
            columns,
        )
    }

    /// Opens a run directory: reads the manifest, then checks every complete
    /// part file on disk. A run whose writer was killed is still opened: its
    /// manifest says `incomplete`, its complete parts are read, and what the
    /// writer left half-written is listed in [`Run::notes`]. A table whose
    /// manifest row count is not what its listed files hold is a
    /// [`Run::problems`] entry.
    ///
    /// # Errors
    /// A missing, corrupt or unknown-version manifest, a listed file missing
    /// on disk, or a part file that fails [`PartFile::open`].
    pub fn open(dir: &Path) -> Result<Run, LoadError> {
        let manifest = read_manifest(dir)?;
        let mut files = BTreeMap::new();
        let mut notes = Vec::new();
        let mut problems = Vec::new();
        let mut unhashed = 0_usize;
        if manifest.status == Status::Incomplete {
            notes.push(if manifest.closed_unix_ms.is_some() {
                "run is incomplete: closed by a producer that lost rows it never sent (its counters say which)"
                    .to_owned()
            } else {
                "run is incomplete: its writer has not closed it (still running, or killed)"
                    .to_owned()
            });
        }
        if let Some(why) = manifest
            .identity
            .settings
            .get("untested_engine_version")
            .and_then(serde_json::Value::as_str)
        {
            // The adapter's signatures matched a release newer than any it was checked
            // against: the run is read, and the reader is told.
            notes.push(format!("untested engine version: {why}"));
        }
        for table in Table::ALL {
            let (complete, partial) = list_parts(&dir.join(table.name()))?;
            let listed: Vec<&String> = manifest
                .table(table)
                .map(|t| t.files.iter().collect())
                .unwrap_or_default();
            for name in &listed {
                let path = dir.join(name);
                if !path.exists() {
                    return Err(LoadError::MissingFile { path });
                }
            }
            let hashes = manifest.table(table).map(|t| &t.file_hashes);
            let mut parts = Vec::new();
            let mut listed_rows = 0;
            for path in complete {
                let relative = format!("{}/{}", table.name(), file_name(&path));
                let mut part =
                    PartFile::open(&path, table, manifest.run_id(), manifest.schema_version)?;
                if let Some(expected) = hashes.and_then(|h| h.get(&relative)) {
                    part.content_hash = Some(verify(&path, expected)?);
                } else if listed.iter().any(|l| **l == relative) {
                    unhashed += 1;
                }
                if listed.iter().any(|l| **l == relative) {
                    listed_rows += part.rows;
                } else if manifest.status == Status::Complete {
                    // A closed run lists every part it wrote: another one
                    // (a copy, a part of another run) is not this run's
                    // data, and reading it would count its rows twice.
                    problems.push(RunProblem::UnlistedPart {
                        path: path.clone(),
                        rows: part.rows,
                    });
                    continue;
                } else {
                    notes.push(format!(
                        "{relative}: complete but not yet listed in the manifest (read anyway)"
                    ));
                }
                parts.push(part);
            }
            if let Some(entry) = manifest.table(table)
                && entry.rows != listed_rows
            {
                problems.push(RunProblem::RowCount {
                    manifest: dir.join(MANIFEST_FILE),
                    table: table.name(),
                    expected: entry.rows,
                    got: listed_rows,
                });
            }
            for path in partial {
                notes.push(format!(
                    "{}/{}: left half-written by its writer (not read)",
                    table.name(),
                    file_name(&path)
                ));
            }
            files.insert(table, parts);
        }
        if unhashed > 0 {
            notes.push(format!(
                "{unhashed} listed part file(s) carry no content hash (written before hashes \
                 were recorded, or by a writer that could not hash): their bytes are not verified"
            ));
        }
        if let Some(missing) = unaccounted(&manifest) {
            if manifest.status == Status::Complete {
                problems.push(RunProblem::Unaccounted {
                    manifest: dir.join(MANIFEST_FILE),
                    missing,
                });
            } else {
                notes.push(format!(
                    "{missing} rows handed to the writer are in no complete part (when its manifest \
                     was last written): lost if its process is gone"
                ));
            }
        }
        Ok(Run {
            dir: dir.to_owned(),
            manifest,
            files,
            notes,
            problems,
        })
    }
}

/// Recomputes the content hash of the part at `path` and compares it with
/// the one its writer recorded; returns it when they agree.
fn verify(path: &Path, expected: &str) -> Result<String, LoadError> {
    let got = content_hash::of_file(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    if got == expected {
        Ok(got)
    } else {
        Err(LoadError::ContentHash {
            path: path.to_owned(),
            expected: expected.to_owned(),
            got,
        })
    }
}

/// Rows the producer handed to the writer (`tables.<t>.sent_rows`) that are
/// neither in a complete part nor counted as dropped, invalid or rejected;
/// `None` when there are none, or the manifest predates `sent_rows`.
fn unaccounted(manifest: &Manifest) -> Option<u64> {
    // Saturating: a manifest is input, and its counts may be anything.
    let mut sent: u64 = 0;
    let mut accounted: u64 = 0;
    for entry in manifest.tables.values() {
        sent = sent.saturating_add(entry.sent_rows?);
        accounted = accounted
            .saturating_add(entry.rows)
            .saturating_add(entry.dropped_rows);
    }
    for counter in ["invalid_rows", "rejected_rows"] {
        accounted = accounted.saturating_add(manifest.counters.get(counter).copied().unwrap_or(0));
    }
    Some(sent.saturating_sub(accounted)).filter(|&n| n > 0)
}

/// Reads and checks `manifest.json`: JSON first, then the format version, and
/// only then the full structure, so a newer format is reported as such
/// rather than as corruption.
fn read_manifest(dir: &Path) -> Result<Manifest, LoadError> {
    let path = dir.join(MANIFEST_FILE);
    if !path.exists() {
        return Err(LoadError::MissingManifest {
            run: dir.to_owned(),
        });
    }
    let text = fs::read_to_string(&path).map_err(|source| LoadError::Io {
        path: path.clone(),
        source,
    })?;
    let corrupt = |e: serde_json::Error| LoadError::CorruptManifest {
        path: path.clone(),
        detail: e.to_string(),
    };
    let value: serde_json::Value = serde_json::from_str(&text).map_err(corrupt)?;
    let version = value.get("schema_version");
    let readable = version
        .and_then(serde_json::Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .is_some_and(is_readable);
    if !readable {
        return Err(LoadError::UnknownSchemaVersion {
            path,
            expected: readable_versions_text(),
            got: version.map_or_else(|| "<absent>".to_owned(), ToString::to_string),
        });
    }
    serde_json::from_value(value).map_err(corrupt)
}

/// Complete and half-written part files of one table folder, sorted by name.
fn list_parts(table_dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), LoadError> {
    let mut complete = Vec::new();
    let mut partial = Vec::new();
    let entries = match fs::read_dir(table_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((complete, partial)),
        Err(source) => {
            return Err(LoadError::Io {
                path: table_dir.to_owned(),
                source,
            });
        }
    };
    for entry in entries {
        let path = entry
            .map_err(|source| LoadError::Io {
                path: table_dir.to_owned(),
                source,
            })?
            .path();
        let name = file_name(&path);
        if name.ends_with(&format!(".parquet{TMP_SUFFIX}")) {
            partial.push(path);
        } else if name.ends_with(".parquet") {
            complete.push(path);
        }
    }
    complete.sort();
    partial.sort();
    Ok((complete, partial))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
