//! Facts that identify a run: content hashes and the device.

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
}
