//! The fixed words of the format, parsed from `schemas/v1/vocabulary.json`
//! (trace format v2 keeps v1's vocabulary).

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::Deserialize;

use crate::SchemaError;

/// The vocabulary of trace formats v1 and v2 (see DESIGN.md, Vocabulary).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vocabulary {
    /// Format version.
    pub schema_version: u32,
    /// What this file is.
    pub doc: String,
    /// `prod` and `shadow`.
    pub paths: Vec<String>,
    /// `local` and `free`.
    pub shadow_modes: Vec<String>,
    /// Shadow inputs of the indexer and what each isolates.
    pub shadow_inputs: BTreeMap<String, String>,
    /// Capture sites in execution order within a layer.
    pub sites: Vec<SiteSpec>,
    /// Event kinds and their meaning.
    pub event_kinds: BTreeMap<String, String>,
    /// What a key of a top-k selection stands for (v2 `topk.unit`), and
    /// what each means; selections over different units are never compared.
    pub selection_units: BTreeMap<String, String>,
    /// Prompt kinds the demo and grid use by default.
    pub prompt_kinds: Vec<String>,
    /// Run statuses and their meaning.
    pub run_statuses: BTreeMap<String, String>,
    /// Run tags the tools read with a meaning of their own (`outcome`,
    /// `cache`, `graft`), and what each means; any other tag is the user's.
    pub run_tags: BTreeMap<String, String>,
}

/// A capture site.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteSpec {
    /// The site's name, as written in the `site` columns.
    pub name: String,
    /// Where in the layer it is.
    pub doc: String,
}

impl Vocabulary {
    /// Parses the compiled-in vocabulary.
    ///
    /// # Errors
    /// When the file is malformed.
    pub fn try_load() -> Result<Vocabulary, SchemaError> {
        let file = "v1/vocabulary.json";
        serde_json::from_str(crate::VOCABULARY_JSON)
            .map_err(|source| SchemaError::Parse { file, source })
    }

    /// Execution-order rank of a site within a layer, if the site is known.
    #[must_use]
    pub fn site_rank(&self, site: &str) -> Option<usize> {
        self.sites.iter().position(|s| s.name == site)
    }
}

// Invariant: compiled in and parsed by `vocabulary_parses` below.
#[expect(
    clippy::expect_used,
    reason = "compiled-in definition, parsed by a unit test"
)]
static VOCABULARY: LazyLock<Vocabulary> =
    LazyLock::new(|| Vocabulary::try_load().expect("compiled-in vocabulary parses"));

/// The vocabulary of trace formats v1 and v2.
#[must_use]
pub fn vocabulary() -> &'static Vocabulary {
    &VOCABULARY
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_parses_with_the_design_words() {
        let v = Vocabulary::try_load().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v.paths, ["prod", "shadow"]);
        assert_eq!(v.shadow_modes, ["local", "free"]);
        assert_eq!(v.prompt_kinds, ["tool", "no_tool"]);
        assert!(v.event_kinds.contains_key("nan") && v.event_kinds.contains_key("sentinel"));
        let units: Vec<&str> = v.selection_units.keys().map(String::as_str).collect();
        assert_eq!(units, ["compressed", "kpool", "token"]);
        assert!(v.selection_units.values().all(|doc| !doc.is_empty()));
    }

    #[test]
    fn sites_are_in_execution_order() {
        let v = vocabulary();
        assert!(v.site_rank("layer_in") < v.site_rank("attn_out"));
        assert!(v.site_rank("attn_out") < v.site_rank("mlp_out"));
        assert!(v.site_rank("mlp_out") < v.site_rank("layer_out"));
        assert_eq!(v.site_rank("nowhere"), None);
    }
}
