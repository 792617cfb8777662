//! The run manifest (`manifest.json`): identity, tags, status and row counts.
//!
//! The JSON Schemas in `schemas/v2/manifest.schema.json` (and, for old runs,
//! `schemas/v1/`) are the contract; [`Manifest::to_json`] gives documents that
//! validate against the schema of their `schema_version` (checked by the
//! Python contract test, which uses an independent JSON Schema validator).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{SCHEMA_VERSION, Table};

/// Whether a run or one of its tables was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Still being written, or its process died before closing it.
    Incomplete,
    /// Closed; every listed file is complete.
    Complete,
}

impl Status {
    /// The status word as written in the manifest.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Incomplete => "incomplete",
            Status::Complete => "complete",
        }
    }
}

/// The manifest of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Trace format version; [`SCHEMA_VERSION`] for runs this crate writes.
    pub schema_version: u32,
    /// The producer.
    pub tool: Tool,
    /// Whether the run was closed.
    pub status: Status,
    /// When the run was opened, Unix milliseconds.
    pub started_unix_ms: u64,
    /// When the run was closed, Unix milliseconds.
    #[serde(default)]
    pub closed_unix_ms: Option<u64>,
    /// Who and what the run is: model, engine, device, prompt, tags.
    #[serde(flatten)]
    pub identity: RunIdentity,
    /// Per-table status, row counts and files.
    pub tables: BTreeMap<String, TableEntry>,
    /// Losses and failures, each counted.
    pub counters: BTreeMap<String, u64>,
}

impl Manifest {
    /// A fresh, incomplete manifest for a run with this identity.
    #[must_use]
    pub fn open(identity: RunIdentity, tool: Tool, started_unix_ms: u64) -> Manifest {
        Manifest {
            schema_version: SCHEMA_VERSION,
            tool,
            status: Status::Incomplete,
            started_unix_ms,
            closed_unix_ms: None,
            identity,
            tables: BTreeMap::new(),
            counters: BTreeMap::new(),
        }
    }

    /// The run id; also the `run_id` column of every table.
    #[must_use]
    pub fn run_id(&self) -> &str {
        &self.identity.run_id
    }

    /// The entry of one table, if the run lists it.
    #[must_use]
    pub fn table(&self, table: Table) -> Option<&TableEntry> {
        self.tables.get(table.name())
    }

    /// The document `manifest.json` holds, in the layout of the manifest's
    /// own `schema_version`: v2 lists `conventions` and `deviations` (empty
    /// or not), v1 has neither.
    ///
    /// # Errors
    /// When a value does not serialize (a settings or injection value serde
    /// refuses).
    pub fn to_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        let mut value = serde_json::to_value(self)?;
        if self.schema_version < 2
            && let Some(object) = value.as_object_mut()
        {
            object.remove("conventions");
            object.remove("deviations");
        }
        Ok(value)
    }
}

/// Everything about a run that its producer knows before the first row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    /// Unique run identity: letters, digits, `.`, `_`, `-`.
    pub run_id: String,
    /// The model traced.
    pub model: Model,
    /// The engine.
    pub engine: Engine,
    /// Where it runs.
    pub device: Device,
    /// Dtype per role.
    pub dtypes: Dtypes,
    /// Parallel layout.
    pub parallelism: Parallelism,
    /// Shadow precision and modes.
    pub shadow: Shadow,
    /// The prompt's identity.
    pub prompt: Prompt,
    /// Producer settings.
    pub settings: serde_json::Map<String, serde_json::Value>,
    /// User tags.
    pub tags: BTreeMap<String, String>,
    /// Faults planted on purpose.
    pub injections: Vec<serde_json::Value>,
    /// Numerics choices with the engine's value beside the model's (format
    /// v2, where the list is required; a v1 manifest has none).
    #[serde(default)]
    pub conventions: Vec<Convention>,
    /// Engine behaviours run on purpose by the reference engine (format v2,
    /// required there; a v1 manifest has none).
    #[serde(default)]
    pub deviations: Vec<serde_json::Value>,
}

/// One numerics choice the model defines and an engine may get wrong
/// (DESIGN.md, convention): the engine's value beside the model's, and where
/// each was read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Convention {
    /// For example `indexer_rope_layout`.
    pub name: String,
    /// The engine's value; null when it could not be read.
    pub engine: serde_json::Value,
    /// The model's value (`config.json` and the family's reference code).
    pub model: serde_json::Value,
    /// Where the engine's value was read.
    pub engine_source: String,
    /// Where the model's value was read.
    pub model_source: String,
    /// Whether the engine's value is the adapter's prior for the engine
    /// version it recognised, not read from the running engine: such a
    /// value is an assumption, and a verdict on it is not judged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub engine_assumed: bool,
}

impl Convention {
    /// Whether both values are known and differ: a model that defines no
    /// value (null) has nothing an engine could get wrong.
    #[must_use]
    pub fn mismatch(&self) -> bool {
        !self.engine.is_null() && !self.model.is_null() && self.engine != self.model
    }
}

/// The producer that wrote a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tool {
    /// For example `shadowtrace-tracer` or `shadowtrace-hooks`.
    pub name: String,
    /// Its version.
    pub version: String,
}

/// The model traced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    /// For example `zai-org/GLM-5.1-FP8`.
    pub name: String,
    /// HF `model_type`, for example `glm_moe_dsa`.
    pub architecture: String,
    /// sha256 of the `config.json` bytes.
    pub config_hash: String,
    /// Checkpoint revision, if known.
    pub revision: Option<String>,
    /// Decoder layers.
    pub num_layers: u32,
    /// The indexer's k, if the model has an indexer.
    pub index_topk: Option<u32>,
}

/// The engine that ran the production path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Engine {
    /// `shadowtrace-reference`, `transformers`, `tensorrt_llm`, `sglang`, `vllm`.
    pub name: String,
    /// Its version.
    pub version: String,
    /// Its commit, if known.
    pub commit: Option<String>,
    /// FP8 indexer variant, if it matters.
    #[serde(default)]
    pub variant: Option<String>,
}

/// Where the run executed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// `cpu` or `cuda`.
    pub kind: String,
    /// Human name, for example `NVIDIA H200`.
    pub name: String,
    /// Device ordinal.
    #[serde(default)]
    pub index: Option<u32>,
}

/// Dtype per role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dtypes {
    /// Production dtype, for example `fp8_e4m3`.
    pub prod: String,
    /// Shadow dtype, `bf16` or `fp32`; null without a shadow.
    pub shadow: Option<String>,
    /// Further roles, for example `kv_cache`.
    #[serde(flatten)]
    pub other: BTreeMap<String, String>,
}

/// Parallel layout and this writer's rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallelism {
    /// Tensor parallel size.
    pub tp: u32,
    /// Pipeline parallel size.
    pub pp: u32,
    /// Data parallel size.
    pub dp: u32,
    /// Expert parallel size.
    pub ep: u32,
    /// This writer's global rank.
    pub rank: u32,
    /// Processes in the job.
    pub world_size: u32,
}

impl Parallelism {
    /// One process, no parallelism.
    pub const SINGLE: Parallelism = Parallelism {
        tp: 1,
        pp: 1,
        dp: 1,
        ep: 1,
        rank: 0,
        world_size: 1,
    };
}

/// Shadow precision and modes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shadow {
    /// `bf16` or `fp32`; null without a shadow.
    pub precision: Option<String>,
    /// `local`, `free`, or both.
    pub modes: Vec<String>,
}

/// The prompt's identity; its text is never stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prompt {
    /// `tool`, `no_tool`, or a user word.
    pub kind: Option<String>,
    /// Prompt length in tokens.
    pub length: u64,
    /// Salted sha256 of the token ids.
    pub token_hash: String,
    /// Names the salt, so hashes of the same salt can be compared.
    #[serde(default)]
    pub salt_id: Option<String>,
}

/// Status, row counts and files of one table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableEntry {
    /// Whether the table was closed.
    pub status: Status,
    /// Rows in completed files.
    pub rows: u64,
    /// Rows the writer dropped and counted.
    pub dropped_rows: u64,
    /// Rows the producer handed to the writer when the manifest was written;
    /// absent in runs written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_rows: Option<u64>,
    /// Completed part files, relative to the run directory.
    pub files: Vec<String>,
    /// Each completed file's content hash ([`crate::content_hash`]), by
    /// file; absent in runs written before it was recorded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub file_hashes: BTreeMap<String, String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_match_the_vocabulary() {
        let words = &crate::vocabulary().run_statuses;
        for s in [Status::Incomplete, Status::Complete] {
            assert!(words.contains_key(s.as_str()), "{}", s.as_str());
            assert_eq!(
                serde_json::to_value(s).ok(),
                Some(serde_json::Value::from(s.as_str()))
            );
        }
    }
}
