//! The content hash of a part file, written into the manifest when the part
//! is closed and checked on every read.
//!
//! A part's footer says what its columns are, not that its data pages are the
//! bytes its writer wrote: flipped bits in a hidden part's pages decode to
//! other floats and nothing else notices. Each writer records
//! `tables.<t>.file_hashes.<file>` = [`text`] of the closed file's bytes, and
//! the analyzer recomputes it before it reads a row.
//!
//! XXH3-64 (seed 0), not a cryptographic hash: the threat is a disk, a copy or
//! a hand edit, not an adversary, and at well over 10 GB/s a core it costs a
//! read of the file from the page cache, where sha256 would cost seconds a
//! gigabyte. The Python writer uses the `xxhash` package's `xxh3_64`, the same
//! function.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

/// The algorithm's prefix in a recorded hash.
pub const ALGORITHM: &str = "xxh3-64";

/// The recorded form of a digest: `xxh3-64:` and 16 lowercase hex digits.
#[must_use]
pub fn text(digest: u64) -> String {
    format!("{ALGORITHM}:{digest:016x}")
}

/// A streaming hash of bytes as they are written.
#[derive(Default)]
pub struct Hasher(Xxh3);

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("content_hash::Hasher")
    }
}

impl Hasher {
    /// Adds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The recorded form of everything added so far.
    #[must_use]
    pub fn text(&self) -> String {
        text(self.0.digest())
    }
}

/// The recorded form of the hash of the file at `path`, read in 1 MiB pieces.
///
/// # Errors
/// The file cannot be opened or read.
pub fn of_file(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Hasher::default();
    let mut buf = vec![0_u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher.text());
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// XXH3-64 of the empty input and of one byte, from the reference
    /// implementation's published test vectors (xxHash's `sanity_test_vectors.h`,
    /// seed 0), so this is the function the Python writer's `xxh3_64` computes.
    #[test]
    fn the_digest_is_xxh3_64_of_the_reference_vectors() {
        let mut h = Hasher::default();
        assert_eq!(h.text(), "xxh3-64:2d06800538d394c2");
        h.update(b"");
        assert_eq!(h.text(), "xxh3-64:2d06800538d394c2");
    }

    #[test]
    fn streaming_in_pieces_equals_one_call() {
        let data: Vec<u8> = (0..10_000_u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut whole = Hasher::default();
        whole.update(&data);
        let mut pieces = Hasher::default();
        for chunk in data.chunks(777) {
            pieces.update(chunk);
        }
        assert_eq!(whole.text(), pieces.text());
        assert_eq!(whole.text(), text(xxhash_rust::xxh3::xxh3_64(&data)));
    }
}
