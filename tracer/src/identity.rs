//! Facts that identify a run: content hashes and the device.

use std::path::Path;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};
use shadowtrace_schemas::manifest::Device;

/// sha256 of a model's `config.json` bytes, hex.
#[must_use]
pub fn config_hash(config_json: &[u8]) -> String {
    hex(&Sha256::digest(config_json))
}

/// Salted sha256 of a prompt's token ids, hex: equal prompts give equal
/// hashes under the same salt, and the ids cannot be read back from it.
/// The ids are hashed as little-endian u32, the salt first.
#[must_use]
pub fn token_hash(salt: &[u8], token_ids: &[u32]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(salt);
    for id in token_ids {
        hasher.update(id.to_le_bytes());
    }
    hex(&hasher.finalize())
}

/// A short public name for a salt, so runs hashed with the same salt can be
/// recognised without revealing it: the first 12 hex digits of its sha256.
#[must_use]
pub fn salt_id(salt: &[u8]) -> String {
    let mut id = hex(&Sha256::digest(salt));
    id.truncate(12);
    id
}

/// The file beside a directory's runs that holds their prompt-hash salt.
pub const SALT_FILE: &str = ".shadowtrace-salt";

/// The secret salt of the runs written under `runs_dir`, created on first use:
/// runs of one directory hash one prompt alike (determinism and prefix-cache
/// pairs), and a hash cannot be tested against guessed prompts without the
/// file. Concurrent writers publish with a hard link, which fails when the
/// file exists, so every process reads the one salt that won. Where the
/// directory cannot hold it, a salt of this process alone: never a public one.
#[must_use]
pub fn directory_salt(runs_dir: &Path) -> Vec<u8> {
    static PROCESS_SALT: OnceLock<Vec<u8>> = OnceLock::new();
    read_or_create_salt(runs_dir).unwrap_or_else(|_| PROCESS_SALT.get_or_init(fresh_salt).clone())
}

fn fresh_salt() -> Vec<u8> {
    let mut salt = vec![0_u8; 32];
    // No randomness at all leaves a salt unique to this process and moment.
    if getrandom::fill(&mut salt).is_err() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let seed = format!("{}:{}", std::process::id(), now.as_nanos());
        salt = Sha256::digest(seed.as_bytes()).to_vec();
    }
    salt
}

fn read_or_create_salt(runs_dir: &Path) -> std::io::Result<Vec<u8>> {
    let path = runs_dir.join(SALT_FILE);
    if !path.exists() {
        std::fs::create_dir_all(runs_dir)?;
        let tmp = runs_dir.join(format!(
            "{SALT_FILE}.{}.{}.tmp",
            std::process::id(),
            hex(&fresh_salt()[..4])
        ));
        std::fs::write(&tmp, fresh_salt())?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        if let Err(e) = linked
            && e.kind() != std::io::ErrorKind::AlreadyExists
        {
            return Err(e);
        }
    }
    let salt = std::fs::read(&path)?;
    if salt.len() != 32 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {} bytes, expected 32", path.display(), salt.len()),
        ));
    }
    Ok(salt)
}

/// The device tensors of this process run on: the first CUDA device when
/// libtorch sees one, else the CPU.
#[must_use]
pub fn default_device() -> Device {
    if tch::Cuda::is_available() {
        Device {
            kind: "cuda".to_owned(),
            name: "cuda:0".to_owned(),
            index: Some(0),
        }
    } else {
        Device {
            kind: "cpu".to_owned(),
            name: "cpu".to_owned(),
            index: None,
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_hash_is_the_sha256_of_the_bytes() {
        // sha256("abc"), FIPS 180-2 appendix B.1.
        assert_eq!(
            config_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn token_hash_depends_on_salt_ids_and_order() {
        let base = token_hash(b"s", &[1, 2, 3]);
        assert_eq!(base, token_hash(b"s", &[1, 2, 3]));
        assert_ne!(base, token_hash(b"t", &[1, 2, 3]));
        assert_ne!(base, token_hash(b"s", &[3, 2, 1]));
        // Little-endian u32 after the salt: equal to hashing those bytes directly.
        assert_eq!(
            base,
            config_hash(&[b's', 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])
        );
    }

    #[test]
    fn salt_id_is_short_and_stable() {
        assert_eq!(salt_id(b"abc"), "ba7816bf8f01");
    }

    #[test]
    fn two_directories_hash_one_prompt_differently_and_one_directory_alike() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let prompt = [1_u32, 2, 3, 2048];
        let salt_a = directory_salt(&a);
        assert_eq!(salt_a.len(), 32);
        assert_eq!(std::fs::read(a.join(SALT_FILE)).unwrap(), salt_a);
        assert_eq!(directory_salt(&a), salt_a, "the directory keeps its salt");
        let salt_b = directory_salt(&b);
        assert_ne!(token_hash(&salt_a, &prompt), token_hash(&salt_b, &prompt));
        assert_ne!(salt_id(&salt_a), salt_id(&salt_b));
        // The salt the tracer used before, public in its source, is gone.
        assert_ne!(salt_a, b"shadowtrace-reference");
    }

    #[test]
    fn a_directory_that_cannot_hold_a_salt_gets_one_of_this_process_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-directory");
        std::fs::write(&file, b"x").unwrap();
        let salt = directory_salt(&file);
        assert_eq!(salt.len(), 32);
        assert_eq!(directory_salt(&file), salt, "one salt per process");
        assert_ne!(salt, directory_salt(&tmp.path().join("other")));
    }
}
