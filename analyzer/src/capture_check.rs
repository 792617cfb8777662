//! The capture self-check a producer ran (`settings.capture_check`).
//!
//! Where an adapter holds production's own indexer scores (captured from
//! its top-k call, or recomputed from its own FP8 operands), it checks
//! production's recorded selection against them on every informative
//! (sparse) row: a selection that is not their top-k, beyond ties and a
//! stated tolerance, was read against other tokens, requests or layers than
//! the scores. That is the adapter misreading the engine, not numerics, so
//! a layer that disagrees gets a verdict of its own, `capture inconsistent`,
//! printed before every numerics verdict, and its top-k verdict is not
//! judged. A producer that ran no check says so, and why (`run` false: the
//! reference engine, which computes its selection itself): the reports print
//! `capture self-check: not run (why)`. Older runs that record nothing give
//! no line here.

use serde::{Deserialize, Serialize};
use shadowtrace_schemas::Manifest;

/// The manifest setting the hooks write.
pub const SETTING: &str = "capture_check";

/// One layer's counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerCheck {
    /// Decoder layer.
    #[serde(default)]
    pub layer: i64,
    /// Informative rows checked: sparse rows whose scores were known.
    pub rows: u64,
    /// Rows whose selection production's own scores contradict.
    pub disagree: u64,
    /// The first such row's token.
    pub first_token: Option<i64>,
    /// Informative rows the check could not judge (a non-finite k-th or
    /// selected score): never among `rows`. Absent in older runs.
    #[serde(default)]
    pub unchecked: u64,
}

impl LayerCheck {
    /// The share of checked rows that disagree.
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // row counts far below 2^52
    pub fn share(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.disagree as f64 / self.rows as f64
        }
    }

    /// The verdict's line, naming the engine the adapter may misread.
    #[must_use]
    pub fn line(&self, engine: &str) -> String {
        format!(
            "CAPTURE INCONSISTENT at layer {}: {} of {} informative rows ({:.1}%) select keys production's own scores rank outside its top-k{}; the adapter may not match {engine}, so this layer's top-k rows are not judged as numerics",
            self.layer,
            self.disagree,
            self.rows,
            100.0 * self.share(),
            self.first_token
                .map_or_else(String::new, |t| format!(" (first at token {t})")),
        )
    }
}

/// A run's capture self-check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaptureCheck {
    /// The engine and version the adapter read, as the verdict names it.
    pub engine: String,
    /// Relative tolerance below the k-th score (of the row's largest
    /// selected |score|).
    pub tolerance: f64,
    /// Where production's scores came from.
    pub sources: Vec<String>,
    /// Per layer, ascending.
    pub layers: Vec<LayerCheck>,
    /// Why the producer ran no check, where it says so (`run` false: the
    /// reference engine, adapters whose selection the check cannot read).
    pub not_run: Option<String>,
}

#[derive(Deserialize)]
struct Stored {
    #[serde(default = "ran")]
    run: bool,
    #[serde(default)]
    why: Option<String>,
    tolerance: f64,
    #[serde(default)]
    sources: Vec<String>,
    layers: std::collections::BTreeMap<String, LayerCheck>,
}

impl CaptureCheck {
    /// The check `manifest` records: `Ok(None)` when it records none,
    /// `Err(why)` when the setting cannot be read (a verdict then cannot
    /// rest on it).
    ///
    /// # Errors
    /// The setting's shape or a layer key that is not a number.
    pub fn of(manifest: &Manifest) -> Result<Option<Self>, String> {
        let Some(value) = manifest.identity.settings.get(SETTING) else {
            return Ok(None);
        };
        let stored: Stored = serde_json::from_value(value.clone())
            .map_err(|e| format!("settings.{SETTING} unreadable: {e}"))?;
        let mut layers = Vec::with_capacity(stored.layers.len());
        for (key, mut check) in stored.layers {
            check.layer = key
                .parse()
                .map_err(|_| format!("settings.{SETTING}: layer key {key:?} is not a number"))?;
            if check.disagree > check.rows {
                return Err(format!(
                    "settings.{SETTING}: layer {key}: {} rows disagree of {} checked",
                    check.disagree, check.rows
                ));
            }
            layers.push(check);
        }
        layers.sort_by_key(|c| c.layer);
        let engine = &manifest.identity.engine;
        let not_run = (!stored.run).then(|| {
            stored
                .why
                .unwrap_or_else(|| "the producer gave no reason".to_owned())
        });
        Ok(Some(Self {
            engine: format!("{} {}", engine.name, engine.version),
            tolerance: stored.tolerance,
            sources: stored.sources,
            layers,
            not_run,
        }))
    }

    /// The layers that disagree.
    pub fn inconsistent(&self) -> impl Iterator<Item = &LayerCheck> {
        self.layers.iter().filter(|c| c.disagree > 0)
    }

    /// The verdict's lines, one per layer that disagrees; empty when the
    /// capture is consistent.
    #[must_use]
    pub fn verdict_lines(&self) -> Vec<String> {
        self.inconsistent().map(|c| c.line(&self.engine)).collect()
    }

    /// What the reports print: whether a layer disagrees, with its verdict
    /// lines, or else the one line of a consistent check.
    #[must_use]
    pub fn report_lines(&self) -> (bool, Vec<String>) {
        let lines = self.verdict_lines();
        if lines.is_empty() {
            (false, vec![self.consistent_line()])
        } else {
            (true, lines)
        }
    }

    /// One line for a check that found every layer consistent, or that had
    /// no informative row to check (dense rows only): never read as clean.
    fn consistent_line(&self) -> String {
        if let Some(why) = &self.not_run {
            return format!("capture self-check: not run ({why})");
        }
        let rows: u64 = self.layers.iter().map(|c| c.rows).sum();
        if rows == 0 {
            return format!(
                "capture self-check: not judged: no informative row (every row saw at most k keys) in {} layer{}",
                self.layers.len(),
                if self.layers.len() == 1 { "" } else { "s" },
            );
        }
        format!(
            "capture self-check: {} layer{}, {rows} informative rows, every selection production's own scores' top-k (tolerance {:e}; scores {})",
            self.layers.len(),
            if self.layers.len() == 1 { "" } else { "s" },
            self.tolerance,
            self.sources.join("; ")
        )
    }
}

fn ran() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(layers: serde_json::Value) -> Result<Option<CaptureCheck>, String> {
        stored(serde_json::json!({"tolerance": 1e-3, "sources": ["s"], "layers": layers}))
    }

    fn stored(setting: serde_json::Value) -> Result<Option<CaptureCheck>, String> {
        let mut m: Manifest = serde_json::from_value(serde_json::json!({
            "schema_version": 2, "tool": {"name": "t", "version": "0"}, "run_id": "r",
            "status": "complete", "started_unix_ms": 0, "closed_unix_ms": 1,
            "model": {"name": "m", "architecture": "glm_moe_dsa", "config_hash": "0", "revision": null,
                      "num_layers": 2, "index_topk": 4},
            "engine": {"name": "vllm", "version": "0.34.0", "commit": null, "variant": null},
            "device": {"kind": "cpu", "name": "cpu", "index": null},
            "dtypes": {"prod": "bf16", "shadow": "fp32"},
            "parallelism": {"tp": 2, "pp": 1, "dp": 1, "ep": 1, "rank": 0, "world_size": 2},
            "shadow": {"precision": "fp32", "modes": []},
            "prompt": {"kind": null, "length": 8, "token_hash": "", "salt_id": null},
            "settings": {}, "tags": {}, "tables": {}, "counters": {}, "injections": []
        }))
        .map_err(|e| e.to_string())?;
        m.identity.settings.insert(SETTING.to_owned(), setting);
        CaptureCheck::of(&m)
    }

    #[test]
    fn layers_read_in_numeric_order_and_only_disagreeing_ones_are_inconsistent() {
        let c = check(serde_json::json!({
            "10": {"rows": 4, "disagree": 0, "first_token": null},
            "2": {"rows": 8, "disagree": 2, "first_token": 5}
        }))
        .unwrap()
        .unwrap();
        assert_eq!(
            c.layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
            [2, 10]
        );
        let bad: Vec<&LayerCheck> = c.inconsistent().collect();
        assert_eq!(bad.len(), 1);
        assert!((bad[0].share() - 0.25).abs() < 1e-12);
        assert_eq!(c.verdict_lines(), [bad[0].line("vllm 0.34.0")]);
        assert_eq!(
            bad[0].line("vllm 0.34.0"),
            "CAPTURE INCONSISTENT at layer 2: 2 of 8 informative rows (25.0%) select keys production's own scores rank outside its top-k (first at token 5); the adapter may not match vllm 0.34.0, so this layer's top-k rows are not judged as numerics"
        );
    }

    #[test]
    fn a_check_with_no_informative_row_says_not_judged_never_consistent() {
        let c = check(serde_json::json!({"0": {"rows": 0, "disagree": 0, "first_token": null}}))
            .unwrap()
            .unwrap();
        assert_eq!(
            c.report_lines(),
            (
                false,
                vec!["capture self-check: not judged: no informative row (every row saw at most k keys) in 1 layer".to_owned()]
            )
        );
    }

    #[test]
    fn a_check_the_producer_did_not_run_says_so_and_why() {
        assert_eq!(check(serde_json::json!({})).unwrap().unwrap().not_run, None);
        // As the reference engine writes it (tracer/src/trace/mod.rs).
        let c = stored(
            serde_json::json!({"run": false, "why": "the reference engine selects itself",
            "tolerance": 0.0, "sources": [], "layers": {}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.inconsistent().count(), 0);
        assert_eq!(
            c.report_lines(),
            (
                false,
                vec![
                    "capture self-check: not run (the reference engine selects itself)".to_owned()
                ]
            )
        );
    }

    #[test]
    fn an_unreadable_check_is_an_error_never_a_pass() {
        assert!(
            check(serde_json::json!({"x": {"rows": 1, "disagree": 0, "first_token": null}}))
                .is_err()
        );
        assert!(
            check(serde_json::json!({"1": {"rows": 1, "disagree": 2, "first_token": 0}})).is_err()
        );
        assert!(check(serde_json::json!({"1": {"rows": "many"}})).is_err());
    }
}
