//! Prompts for a sweep: the demo's tool and no-tool prompts (three JSON
//! function schemas and filler text, byte-level ids), or a user's files cut
//! to each length.

use std::path::{Path, PathBuf};

const TOOLS: &str = include_str!("../../demo/corpus/tools.json");
const FILLER: &str = include_str!("../../demo/corpus/filler.txt");

/// A prompt of `length` byte-level token ids: the three tool schemas first
/// for a tool prompt, then filler text, repeated as needed.
#[must_use]
pub fn demo_prompt(tool: bool, length: usize) -> Vec<i64> {
    let mut text = String::new();
    if tool {
        text.push_str("<tools>\n");
        text.push_str(TOOLS);
        text.push_str("</tools>\n");
    }
    while text.len() < length {
        text.push_str(FILLER);
    }
    text.bytes().take(length).map(i64::from).collect()
}

/// A prompt file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PromptError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A `.json` prompt that is not a list of integers.
    #[error("{path}: expected a JSON list of token ids: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// Text for a model whose vocabulary cannot hold byte-level ids.
    #[error("{path}: text needs a vocabulary of at least 256 byte ids, the model has {vocab}")]
    Vocabulary {
        /// The file.
        path: PathBuf,
        /// The model's vocabulary size.
        vocab: i64,
    },
    /// No tokens.
    #[error("{path}: the prompt has no tokens")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// An id outside the vocabulary.
    #[error("{path}: token id {id} is outside the vocabulary [0, {vocab})")]
    OutOfVocabulary {
        /// The file.
        path: PathBuf,
        /// The id.
        id: i64,
        /// The model's vocabulary size.
        vocab: i64,
    },
}

/// A prompt file's token ids: a JSON list of ids (`.json`), or text read as
/// byte-level ids (for vocabularies of 256 or more), each id checked against
/// the vocabulary.
///
/// # Errors
/// An unreadable file, ids that do not parse or lie outside the vocabulary,
/// text for a vocabulary under 256, or an empty prompt.
pub fn read_prompt(path: &Path, vocab: i64) -> Result<Vec<i64>, PromptError> {
    let path_buf = || path.to_owned();
    let text = std::fs::read_to_string(path).map_err(|source| PromptError::Io {
        path: path_buf(),
        source,
    })?;
    let ids: Vec<i64> = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|source| PromptError::Json {
            path: path_buf(),
            source,
        })?
    } else if vocab >= 256 {
        text.bytes().map(i64::from).collect()
    } else {
        return Err(PromptError::Vocabulary {
            path: path_buf(),
            vocab,
        });
    };
    if ids.is_empty() {
        return Err(PromptError::Empty { path: path_buf() });
    }
    if let Some(&id) = ids.iter().find(|&&id| id < 0 || id >= vocab) {
        return Err(PromptError::OutOfVocabulary {
            path: path_buf(),
            id,
            vocab,
        });
    }
    Ok(ids)
}
