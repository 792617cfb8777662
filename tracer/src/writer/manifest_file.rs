//! Writing `manifest.json` so that a full disk cannot silence a run.
//!
//! The manifest is rewritten through a temporary file and a rename, so a
//! reader sees the old or the new one, never half. A full disk refuses the
//! temporary file, and the manifest on disk would then stay an earlier one:
//! the rows sent since would be lost without a count. So every manifest file
//! is padded with JSON whitespace to twice its length (at least
//! [`MANIFEST_ROOM`]), and where the rename path finds no room the document is
//! rewritten in place, in the blocks the file already holds (on a file system
//! that overwrites in place; a copy-on-write one takes new blocks). The
//! Python writer does the same (`hooks/src/shadowtrace_hooks/writer.py`).

use std::fs;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::Path;

use shadowtrace_schemas::{MANIFEST_FILE, Manifest, TMP_SUFFIX};

use crate::TraceError;

/// The least a manifest file holds: a run's manifest with some dozens of parts.
pub(crate) const MANIFEST_ROOM: usize = 8 << 10;

/// The counter of a manifest rewritten in place because the disk was full.
pub(crate) const REWRITTEN_IN_PLACE: &str = "manifest_rewritten_in_place";

/// Writes `manifest.json` under `dir` atomically, padded.
pub(crate) fn write_atomically(dir: &Path, manifest: &Manifest) -> Result<(), TraceError> {
    let path = dir.join(MANIFEST_FILE);
    let tmp = dir.join(format!("{MANIFEST_FILE}{TMP_SUFFIX}"));
    let text = padded(&document(&path, manifest)?);
    if let Err(source) = fs::write(&tmp, text) {
        // Its blocks are what a full disk lacks.
        let _ = fs::remove_file(&tmp);
        return Err(TraceError::Io { path: tmp, source });
    }
    fs::rename(&tmp, &path).map_err(|source| TraceError::Io { path, source })
}

/// Overwrites the existing `manifest.json` under `dir` with `manifest`,
/// padded to the file's own length: no block the file does not hold. A reader
/// may see it half written. A document longer than the file is refused.
pub(crate) fn rewrite_in_place(dir: &Path, manifest: &Manifest) -> Result<(), TraceError> {
    let path = dir.join(MANIFEST_FILE);
    let text = document(&path, manifest)?;
    let io = |source| TraceError::Io {
        path: path.clone(),
        source,
    };
    let mut file = fs::OpenOptions::new().write(true).open(&path).map_err(io)?;
    let room = usize::try_from(file.metadata().map_err(io)?.len()).unwrap_or(usize::MAX);
    if text.len() + 1 > room {
        return Err(io(io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "manifest of {} bytes outgrew its room of {room}",
                text.len()
            ),
        )));
    }
    let mut bytes = text.into_bytes();
    bytes.push(b'\n');
    bytes.resize(room, b' ');
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.flush().map_err(io)
}

/// Whether `error` is a disk without room (a full disk, a quota, a file-size limit).
pub(crate) fn is_disk_full(error: &TraceError) -> bool {
    matches!(error, TraceError::Io { source, .. }
        if matches!(source.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
            | io::ErrorKind::FileTooLarge))
}

fn document(path: &Path, manifest: &Manifest) -> Result<String, TraceError> {
    manifest
        .to_json()
        .and_then(|value| serde_json::to_string_pretty(&value))
        .map_err(|source| TraceError::Manifest {
            path: path.to_owned(),
            source,
        })
}

/// `text`, a newline and spaces up to twice its length (at least [`MANIFEST_ROOM`]).
fn padded(text: &str) -> Vec<u8> {
    let mut bytes = text.as_bytes().to_vec();
    bytes.push(b'\n');
    bytes.resize(MANIFEST_ROOM.max(2 * text.len() + 1), b' ');
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use shadowtrace_schemas::manifest::Status;

    fn manifest(run_id: &str) -> Manifest {
        let identity = crate::synth::SynthSpec::demo(run_id).identity();
        let tool = shadowtrace_schemas::manifest::Tool {
            name: "shadowtrace-tracer".to_owned(),
            version: "test".to_owned(),
        };
        Manifest::open(identity, tool, 0)
    }

    fn read(dir: &Path) -> Manifest {
        let text = fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn a_manifest_file_holds_room_to_be_rewritten_in_place_and_reads_as_its_document() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = manifest("room");
        write_atomically(dir.path(), &m).unwrap();
        let size = fs::metadata(dir.path().join(MANIFEST_FILE)).unwrap().len();
        assert_eq!(size, MANIFEST_ROOM as u64);
        m.status = Status::Complete;
        m.counters.insert(REWRITTEN_IN_PLACE.to_owned(), 1);
        rewrite_in_place(dir.path(), &m).unwrap();
        assert_eq!(
            fs::metadata(dir.path().join(MANIFEST_FILE)).unwrap().len(),
            size
        );
        let back = read(dir.path());
        assert_eq!(back.status, Status::Complete);
        assert_eq!(back.counters.get(REWRITTEN_IN_PLACE), Some(&1));
    }

    #[test]
    fn a_manifest_that_outgrew_its_room_is_refused_in_place_and_the_old_one_stays_whole() {
        let dir = tempfile::tempdir().unwrap();
        let m = manifest("small");
        write_atomically(dir.path(), &m).unwrap();
        let mut big = manifest("big");
        for i in 0..2000 {
            big.counters.insert(format!("counter_{i:05}"), i);
        }
        let refused = rewrite_in_place(dir.path(), &big).unwrap_err();
        assert!(is_disk_full(&refused), "{refused}");
        assert!(
            refused.to_string().contains("outgrew its room"),
            "{refused}"
        );
        assert_eq!(read(dir.path()).run_id(), "small");
        // A larger document gets room for twice itself.
        write_atomically(dir.path(), &big).unwrap();
        let size = fs::metadata(dir.path().join(MANIFEST_FILE)).unwrap().len();
        assert!(size > 2 * MANIFEST_ROOM as u64, "{size}");
        rewrite_in_place(dir.path(), &big).unwrap();
    }
}
