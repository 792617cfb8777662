//! The top-k summary check, remembered per part file.
//!
//! ## What it is
//! [`super::topk_check`] decodes every difference and boundary list of a v2
//! part and recounts its summary: 70–90% of `analyze`'s time on a v2 run,
//! where the per-layer aggregation itself reads the counts alone. A part is
//! written once and never changed (both writers close it with its footer),
//! so its check's result is a property of its bytes: `analyze` keeps it in a
//! memo directory, one file per part, and checks a part again only where the
//! part is not what was checked.
//!
//! ## What "the same part" is
//! The same bytes: the part's content hash (XXH3-64 of the whole file,
//! `shadowtrace_schemas::content_hash`), which its writer recorded in the
//! manifest and the loader recomputed and compared before this check was
//! asked for, so a remembered check answers only for the bytes it checked.
//! Beside it, the canonical path, size on disk, modification time
//! (nanoseconds), the Parquet footer (its length and a hash of its bytes)
//! and the check's own definition ([`CHECK_DEFINITION`] and the analyzer's
//! version). A part whose writer recorded no hash (runs written before
//! hashes were) is keyed on those alone; what that misses: a part rewritten
//! in place to the same size, with its modification time set back and its
//! footer unchanged. `analyze --recheck` checks every part again, and
//! `inspect` never reads the memo.
//!
//! Every key field is stored and compared, so a hash collision of paths
//! only costs a recheck. A memo that cannot be read or written costs a
//! recheck too, never a result: the check then runs as if there were none.

use std::collections::hash_map::DefaultHasher;
use std::fs::File;
use std::hash::{Hash, Hasher};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use super::topk_check::SummaryCheck;
use crate::load::PartFile;

/// What the check checks: bump it whenever `topk_check` changes what it
/// counts, so that no result of another definition is taken for this one.
pub const CHECK_DEFINITION: u32 = 2;

/// A part as it was checked: everything that must be equal for the memo to
/// answer for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartKey {
    /// Canonical path of the part.
    pub path: PathBuf,
    /// Size on disk.
    pub bytes: u64,
    /// Modification time, nanoseconds since the epoch.
    pub modified_ns: u128,
    /// Length of the Parquet footer.
    pub footer_len: u32,
    /// Hash of the footer's bytes.
    pub footer_hash: u64,
    /// [`CHECK_DEFINITION`] and the analyzer's version.
    pub definition: String,
    /// The part's content hash, verified against the bytes on disk when the
    /// run was opened; `None` for parts whose writer recorded none.
    #[serde(default)]
    pub content_hash: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    key: PartKey,
    check: SummaryCheck,
}

/// The key of `part` as it is on disk now; `None` where it cannot be read
/// (the check then runs and reports the error itself).
#[must_use]
pub fn key(part: &PartFile) -> Option<PartKey> {
    let path = part.path.canonicalize().ok()?;
    let mut file = File::open(&path).ok()?;
    let meta = file.metadata().ok()?;
    let modified_ns = meta
        .modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_nanos();
    // Parquet ends with the footer, its length (u32 LE) and b"PAR1".
    let bytes = meta.len();
    let mut tail = [0_u8; 8];
    file.seek(SeekFrom::End(-8)).ok()?;
    file.read_exact(&mut tail).ok()?;
    if &tail[4..] != b"PAR1" {
        return None;
    }
    let footer_len = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    if u64::from(footer_len) + 8 > bytes {
        return None;
    }
    let mut footer = vec![0_u8; footer_len as usize];
    file.seek(SeekFrom::End(-8 - i64::from(footer_len))).ok()?;
    file.read_exact(&mut footer).ok()?;
    let mut hasher = DefaultHasher::new();
    footer.hash(&mut hasher);
    Some(PartKey {
        path,
        bytes,
        modified_ns,
        footer_len,
        footer_hash: hasher.finish(),
        definition: format!("{CHECK_DEFINITION} {}", env!("CARGO_PKG_VERSION")),
        content_hash: part.content_hash.clone(),
    })
}

fn entry_path(dir: &Path, key: &PartKey) -> PathBuf {
    let mut hasher = DefaultHasher::new();
    key.path.hash(&mut hasher);
    dir.join(format!("{:016x}.json", hasher.finish()))
}

/// The remembered check of the part `key` names, if one was stored for
/// exactly that part.
#[must_use]
pub fn recall(dir: &Path, key: &PartKey) -> Option<SummaryCheck> {
    let text = std::fs::read(entry_path(dir, key)).ok()?;
    let entry: Entry = serde_json::from_slice(&text).ok()?;
    (entry.key == *key).then_some(entry.check)
}

/// Remembers `check` for the part `key` names. Best effort: a directory
/// that cannot be written leaves the next analyze to check again.
pub fn remember(dir: &Path, key: &PartKey, check: &SummaryCheck) {
    let entry = Entry {
        key: key.clone(),
        check: *check,
    };
    let Ok(text) = serde_json::to_vec(&entry) else {
        return;
    };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // Written aside and renamed: a reader never sees half an entry.
    let path = entry_path(dir, key);
    let partial = path.with_extension(format!("json.{}", std::process::id()));
    if std::fs::write(&partial, text).is_ok() && std::fs::rename(&partial, &path).is_err() {
        let _ = std::fs::remove_file(&partial);
    }
}

/// Where `analyze` keeps its memo unless told otherwise:
/// `$XDG_CACHE_HOME/shadowtrace/topk-checks`, else
/// `$HOME/.cache/shadowtrace/topk-checks`; `None` without either.
#[must_use]
pub fn default_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("shadowtrace").join("topk-checks"))
}
