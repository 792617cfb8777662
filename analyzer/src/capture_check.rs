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
//! judged. A layer with no informative row to check is not judged, and
//! said so. A producer that ran no check says so, and why (`run` false in
//! `settings.capture_check`: the reference engine, which computes its
//! selection itself; DeepSeek-V4's compressed keys, not calibrated): the
//! reports print `capture self-check: not run (why)`; older runs that record
//! nothing print `not run` with [`NOT_RUN_UNSAID`]. A setting that cannot be
//! read is a broken run: not judged for capture, never read as "no check".

use serde::{Deserialize, Serialize};
use shadowtrace_schemas::Manifest;

/// The manifest setting the hooks write.
pub const SETTING: &str = "capture_check";

/// Why a run records no check, where the producer does not say.
pub const NOT_RUN_UNSAID: &str = "the run records no check";

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
    /// lines, or else the line of the layers found consistent; then the
    /// layers with no informative row, not judged.
    #[must_use]
    pub fn report_lines(&self) -> (bool, Vec<String>) {
        let mut lines = self.verdict_lines();
        let inconsistent = !lines.is_empty();
        if !inconsistent && let Some(line) = self.consistent_line() {
            lines.push(line);
        }
        lines.extend(self.not_judged_line());
        (inconsistent, lines)
    }

    /// One line for the layers checked and found consistent, counting only
    /// those that had an informative row; `None` when none had.
    fn consistent_line(&self) -> Option<String> {
        let judged: Vec<&LayerCheck> = self.layers.iter().filter(|c| c.rows > 0).collect();
        let rows: u64 = judged.iter().map(|c| c.rows).sum();
        (rows > 0).then(|| {
            format!(
                "capture self-check: {} layer{}, {rows} informative rows, every selection production's own scores' top-k (tolerance {:e}; scores {})",
                judged.len(),
                plural(judged.len()),
                self.tolerance,
                self.sources.join("; ")
            )
        })
    }

    /// One line naming the layers the check had no informative row at
    /// (dense rows only): not judged, never counted as consistent.
    fn not_judged_line(&self) -> Option<String> {
        let empty: Vec<String> = self
            .layers
            .iter()
            .filter(|c| c.rows == 0)
            .map(|c| c.layer.to_string())
            .collect();
        (!empty.is_empty()).then(|| {
            format!(
                "capture self-check: not judged at layer{} {}: no informative row (every row saw at most k keys)",
                plural(empty.len()),
                empty.join(", ")
            )
        })
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// What a run records of its capture self-check, as the reports read it.
#[derive(Debug, Clone, PartialEq)]
pub enum Recorded {
    /// The producer ran the check.
    Checked(CaptureCheck),
    /// The producer ran none: why (its own words, or [`NOT_RUN_UNSAID`]).
    NotRun(String),
    /// The setting cannot be read: a broken run, not judged for capture.
    Unreadable(String),
}

impl Recorded {
    /// The check `manifest` records, or why there is none.
    #[must_use]
    pub fn of(manifest: &Manifest) -> Recorded {
        match CaptureCheck::of(manifest) {
            Ok(Some(CaptureCheck {
                not_run: Some(why), ..
            })) => Recorded::NotRun(why),
            Ok(Some(check)) => Recorded::Checked(check),
            Err(why) => Recorded::Unreadable(why),
            Ok(None) => Recorded::NotRun(NOT_RUN_UNSAID.to_owned()),
        }
    }

    /// What the reports print: whether it is an alarm (a layer that
    /// disagrees, or a setting that cannot be read), and its lines.
    #[must_use]
    pub fn report_lines(&self) -> (bool, Vec<String>) {
        match self {
            Recorded::Checked(check) => check.report_lines(),
            Recorded::NotRun(why) => (false, vec![not_run_line(why)]),
            Recorded::Unreadable(why) => (true, vec![unreadable_line(why)]),
        }
    }
}

/// A run whose check cannot be read, as a problem of the run (`inspect`
/// fails on it); `None` where it reads or the run records none.
#[must_use]
pub fn problem(run: &crate::Run) -> Option<crate::RunProblem> {
    CaptureCheck::of(&run.manifest)
        .err()
        .map(|detail| crate::RunProblem::CaptureCheckUnreadable {
            manifest: run.dir.join(shadowtrace_schemas::MANIFEST_FILE),
            detail,
        })
}

/// The line of a run whose producer ran no check.
#[must_use]
pub fn not_run_line(why: &str) -> String {
    format!("capture self-check: not run ({why})")
}

/// The line of a check that cannot be read.
#[must_use]
pub fn unreadable_line(why: &str) -> String {
    format!(
        "CAPTURE SELF-CHECK UNREADABLE: {why}; a broken run: not judged for capture, and its top-k verdict not judged"
    )
}

fn ran() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(settings: serde_json::Value) -> Manifest {
        serde_json::from_value(serde_json::json!({
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
            "settings": settings, "tags": {}, "tables": {}, "counters": {}, "injections": []
        }))
        .unwrap()
    }

    fn check(layers: serde_json::Value) -> Result<Option<CaptureCheck>, String> {
        CaptureCheck::of(&manifest(serde_json::json!({
            SETTING: {"tolerance": 1e-3, "sources": ["s"], "layers": layers}
        })))
    }

    fn stored(setting: serde_json::Value) -> Result<Option<CaptureCheck>, String> {
        CaptureCheck::of(&manifest(serde_json::json!({ SETTING: setting })))
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
                vec!["capture self-check: not judged at layer 0: no informative row (every row saw at most k keys)".to_owned()]
            )
        );
    }

    #[test]
    fn a_layer_with_no_informative_row_is_not_judged_and_not_counted_consistent() {
        let c = check(serde_json::json!({
            "1": {"rows": 40, "disagree": 0, "first_token": null},
            "3": {"rows": 0, "disagree": 0, "first_token": null},
            "5": {"rows": 0, "disagree": 0, "first_token": null}
        }))
        .unwrap()
        .unwrap();
        assert_eq!(
            c.report_lines(),
            (
                false,
                vec![
                    "capture self-check: 1 layer, 40 informative rows, every selection production's own scores' top-k (tolerance 1e-3; scores s)".to_owned(),
                    "capture self-check: not judged at layers 3, 5: no informative row (every row saw at most k keys)".to_owned(),
                ]
            )
        );
        // Beside a layer that disagrees, the empty one is still said.
        let c = check(serde_json::json!({
            "1": {"rows": 40, "disagree": 4, "first_token": 9},
            "3": {"rows": 0, "disagree": 0, "first_token": null}
        }))
        .unwrap()
        .unwrap();
        let (inconsistent, lines) = c.report_lines();
        assert!(inconsistent);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[1].starts_with("capture self-check: not judged at layer 3:"));
    }

    #[test]
    fn a_run_without_a_check_says_not_run_and_why() {
        assert_eq!(
            Recorded::of(&manifest(serde_json::json!({}))).report_lines(),
            (
                false,
                vec!["capture self-check: not run (the run records no check)".to_owned()]
            )
        );
        assert_eq!(
            Recorded::of(&manifest(serde_json::json!({SETTING: {
                "run": false, "why": "compressed selection: not calibrated",
                "tolerance": 0.0, "sources": [], "layers": {}
            }})))
            .report_lines()
            .1,
            ["capture self-check: not run (compressed selection: not calibrated)"]
        );
        let broken = Recorded::of(&manifest(serde_json::json!({SETTING: "yes"})));
        let (alarm, lines) = broken.report_lines();
        assert!(alarm, "{lines:?}");
        assert!(
            lines[0]
                .starts_with("CAPTURE SELF-CHECK UNREADABLE: settings.capture_check unreadable:"),
            "{lines:?}"
        );
    }

    #[test]
    fn a_check_the_producer_did_not_run_says_so_and_why() {
        assert_eq!(check(serde_json::json!({})).unwrap().unwrap().not_run, None);
        // As the reference engine writes it (tracer/src/trace/mod.rs).
        let setting = serde_json::json!({"run": false, "why": "the reference engine selects itself",
            "tolerance": 0.0, "sources": [], "layers": {}});
        let c = stored(setting.clone()).unwrap().unwrap();
        assert_eq!(c.inconsistent().count(), 0);
        assert_eq!(
            Recorded::of(&manifest(serde_json::json!({ SETTING: setting }))).report_lines(),
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
