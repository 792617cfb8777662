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
//!
//! A top-k kernel that drops winners (a radix top-k whose candidate buffer
//! overflows and silently loses keys of its threshold bucket) also leaves
//! selections production's own scores contradict, with the adapter reading
//! the engine right. Producers that tell the two apart record, per layer,
//! how many disagreeing rows are short of winners (the selection keeps
//! production's top keys whole and most of its top-k: the rule they record
//! as `short_of_winners_rule`; a misread misses a top key within a few
//! ranks) and the figures that decided it. A layer where at least
//! [`SHORT_LAYER_SHARE`] of the disagreeing rows are short of winners gets a
//! numerics verdict of its own, `TOP-K SHORT OF WINNERS`, judged under
//! top-k; the others stay `capture inconsistent`. Runs that record no such
//! count read as before.

use serde::{Deserialize, Serialize};
use shadowtrace_schemas::Manifest;

/// The manifest setting the hooks write.
pub const SETTING: &str = "capture_check";

/// Why a run records no check, where the producer does not say.
pub const NOT_RUN_UNSAID: &str = "the run records no check";

/// The least share of a layer's disagreeing rows that must be short of
/// winners for the layer to read as a top-k kernel that drops them rather
/// than a misread. A half: on the committed trained checkpoints every
/// disagreeing row of an overflowing candidate buffer is short of winners,
/// and at most 4% of the rows of a selection read one or 37 tokens late or
/// from another layer are.
pub const SHORT_LAYER_SHARE: f64 = 0.5;

/// The rule a producer read a disagreeing row as short of winners by:
/// least shares of k (`settings.capture_check.short_of_winners_rule`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShortRule {
    /// Production's top keys the selection keeps whole (those scored above
    /// the best key it left out), as a share of k.
    pub kept_top: f64,
    /// Keys of production's top-k it selected, as a share of k.
    pub recall: f64,
}

/// One layer's counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Of the rows that disagree, those short of winners (a top-k kernel
    /// that drops them, not a misread; [`ShortRule`]). `None` where the
    /// producer did not read them (older runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_of_winners: Option<u64>,
    /// Over those rows, the least share of k of production's top keys kept
    /// whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_kept_top: Option<f64>,
    /// Over those rows, the least recall of production's top-k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_recall: Option<f64>,
    /// Over those rows, the worst rank a selected key holds in production's
    /// scores, beyond k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_worst_rank_beyond_k: Option<i64>,
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

    /// Whether the layer's disagreement is a top-k kernel that drops
    /// winners: at least [`SHORT_LAYER_SHARE`] of its disagreeing rows short
    /// of them.
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // row counts far below 2^52
    pub fn short_of_winners(&self) -> bool {
        let short = self.short_of_winners.unwrap_or(0);
        self.disagree > 0 && short > 0 && short as f64 >= SHORT_LAYER_SHARE * self.disagree as f64
    }

    /// The verdict's line, naming the engine the adapter may misread; the
    /// rows short of winners among them, where some are.
    #[must_use]
    pub fn line(&self, engine: &str) -> String {
        let short = match self.short_of_winners {
            Some(n) if n > 0 => format!(
                "; {n} of them short of winners, fewer than {} of them",
                percent(SHORT_LAYER_SHARE)
            ),
            _ => String::new(),
        };
        format!(
            "CAPTURE INCONSISTENT at layer {}: {} of {} informative rows ({:.1}%) select keys production's own scores rank outside its top-k{}{short}; the adapter may not match {engine}, so this layer's top-k rows are not judged as numerics",
            self.layer,
            self.disagree,
            self.rows,
            100.0 * self.share(),
            self.first_token
                .map_or_else(String::new, |t| format!(" (first at token {t})")),
        )
    }

    /// The line of a layer whose top-k kernel drops winners, with the
    /// figures that decided it and the rule.
    #[must_use]
    pub fn short_line(&self, rule: Option<&ShortRule>) -> String {
        let short = self.short_of_winners.unwrap_or(0);
        let figure = |v: Option<f64>| v.map_or_else(|| "?".to_owned(), |v| format!("{v:.2}"));
        let rule = rule.map_or_else(
            || "the producer's rule unrecorded".to_owned(),
            |r| format!("recall >= {} and top {}k kept", r.recall, r.kept_top),
        );
        format!(
            "TOP-K SHORT OF WINNERS at layer {}: {short} of {} informative rows select production's top keys short of some ({short} of {} that disagree; recall >= {}, production's top {}k kept whole, selected keys down to rank k+{}; rule: {rule}, in at least {} of the rows that disagree): the top-k kernel drops winners; the adapter reads the engine",
            self.layer,
            self.rows,
            self.disagree,
            figure(self.short_recall),
            figure(self.short_kept_top),
            self.short_worst_rank_beyond_k
                .map_or_else(|| "?".to_owned(), |d| d.to_string()),
            percent(SHORT_LAYER_SHARE),
        )
    }
}

fn percent(share: f64) -> String {
    format!("{:.0}%", 100.0 * share)
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
    /// The rule the producer read rows short of winners by; `None` where it
    /// read none (older runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub short_of_winners_rule: Option<ShortRule>,
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
    #[serde(default)]
    short_of_winners_rule: Option<ShortRule>,
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
            if check.short_of_winners.is_some_and(|n| n > check.disagree) {
                return Err(format!(
                    "settings.{SETTING}: layer {key}: {} rows short of winners of {} that disagree",
                    check.short_of_winners.unwrap_or(0),
                    check.disagree
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
            short_of_winners_rule: stored.short_of_winners_rule,
        }))
    }

    /// The layers that disagree, but for those whose top-k kernel drops
    /// winners: the adapter misread the engine there.
    pub fn inconsistent(&self) -> impl Iterator<Item = &LayerCheck> {
        self.layers
            .iter()
            .filter(|c| c.disagree > 0 && !c.short_of_winners())
    }

    /// The layers whose disagreement is a top-k kernel that drops winners
    /// ([`LayerCheck::short_of_winners`]): a top-k verdict, judged.
    pub fn short_of_winners(&self) -> impl Iterator<Item = &LayerCheck> {
        self.layers.iter().filter(|c| c.short_of_winners())
    }

    /// The verdict's lines, one per layer that disagrees (capture
    /// inconsistent first, then short of winners); empty when the capture is
    /// consistent.
    #[must_use]
    pub fn verdict_lines(&self) -> Vec<String> {
        let rule = self.short_of_winners_rule.as_ref();
        self.inconsistent()
            .map(|c| c.line(&self.engine))
            .chain(self.short_of_winners().map(|c| c.short_line(rule)))
            .collect()
    }

    /// What the reports print: whether a layer disagrees, with its verdict
    /// lines, or else the line of the layers found consistent (beside
    /// layers short of winners, those that agree); then the layers with no
    /// informative row, not judged.
    #[must_use]
    pub fn report_lines(&self) -> (bool, Vec<String>) {
        let mut lines = self.verdict_lines();
        let alarm = !lines.is_empty();
        if self.inconsistent().next().is_none()
            && let Some(line) = self.consistent_line()
        {
            lines.push(line);
        }
        lines.extend(self.not_judged_line());
        (alarm, lines)
    }

    /// One line for the layers checked and found consistent, counting only
    /// those that had an informative row; `None` when none had.
    fn consistent_line(&self) -> Option<String> {
        let judged: Vec<&LayerCheck> = self
            .layers
            .iter()
            .filter(|c| c.rows > 0 && c.disagree == 0)
            .collect();
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

    fn short_check(layers: serde_json::Value) -> CaptureCheck {
        stored(
            serde_json::json!({"tolerance": 1e-3, "sources": ["s"], "layers": layers,
            "short_of_winners_rule": {"kept_top": 0.25, "recall": 0.5}}),
        )
        .unwrap()
        .unwrap()
    }

    #[test]
    fn a_layer_whose_disagreeing_rows_are_mostly_short_of_winners_is_a_top_k_verdict() {
        // Layer 0: every disagreeing row short of winners (a kernel that drops them);
        // layer 1: 3 of 10 (below the half): a misread; layer 2: consistent.
        let c = short_check(serde_json::json!({
            "0": {"rows": 1024, "disagree": 482, "first_token": 2050, "short_of_winners": 482,
                  "short_kept_top": 0.3759765625, "short_recall": 0.68994140625,
                  "short_worst_rank_beyond_k": 1024},
            "1": {"rows": 1024, "disagree": 10, "first_token": 2048, "short_of_winners": 3,
                  "short_kept_top": 0.3, "short_recall": 0.9, "short_worst_rank_beyond_k": 12},
            "2": {"rows": 1024, "disagree": 0, "first_token": null, "short_of_winners": 0}
        }));
        assert_eq!(
            c.short_of_winners().map(|l| l.layer).collect::<Vec<_>>(),
            [0]
        );
        assert_eq!(c.inconsistent().map(|l| l.layer).collect::<Vec<_>>(), [1]);
        let (alarm, lines) = c.report_lines();
        assert!(alarm);
        assert_eq!(
            lines,
            [
                "CAPTURE INCONSISTENT at layer 1: 10 of 1024 informative rows (1.0%) select keys production's own scores rank outside its top-k (first at token 2048); 3 of them short of winners, fewer than 50% of them; the adapter may not match vllm 0.34.0, so this layer's top-k rows are not judged as numerics",
                "TOP-K SHORT OF WINNERS at layer 0: 482 of 1024 informative rows select production's top keys short of some (482 of 482 that disagree; recall >= 0.69, production's top 0.38k kept whole, selected keys down to rank k+1024; rule: recall >= 0.5 and top 0.25k kept, in at least 50% of the rows that disagree): the top-k kernel drops winners; the adapter reads the engine",
            ]
        );
        // Without the misread layer, the consistent layers are said beside the verdict,
        // counting only those that agree.
        let c = short_check(serde_json::json!({
            "0": {"rows": 8, "disagree": 4, "first_token": 9, "short_of_winners": 2,
                  "short_kept_top": 0.5, "short_recall": 0.75, "short_worst_rank_beyond_k": 3},
            "2": {"rows": 40, "disagree": 0, "first_token": null, "short_of_winners": 0}
        }));
        let (alarm, lines) = c.report_lines();
        assert!(alarm);
        assert_eq!(
            c.inconsistent().count(),
            0,
            "half of the disagreeing rows: short"
        );
        assert_eq!(
            lines,
            [
                "TOP-K SHORT OF WINNERS at layer 0: 2 of 8 informative rows select production's top keys short of some (2 of 4 that disagree; recall >= 0.75, production's top 0.50k kept whole, selected keys down to rank k+3; rule: recall >= 0.5 and top 0.25k kept, in at least 50% of the rows that disagree): the top-k kernel drops winners; the adapter reads the engine",
                "capture self-check: 1 layer, 40 informative rows, every selection production's own scores' top-k (tolerance 1e-3; scores s)",
            ]
        );
    }

    #[test]
    fn a_run_that_records_no_short_count_reads_as_before() {
        let c = check(serde_json::json!({"2": {"rows": 8, "disagree": 2, "first_token": 5}}))
            .unwrap()
            .unwrap();
        assert_eq!(c.short_of_winners_rule, None);
        assert_eq!(c.short_of_winners().count(), 0);
        assert_eq!(c.inconsistent().count(), 1);
        // A count of none short keeps today's line too.
        let none = short_check(serde_json::json!({"2": {"rows": 8, "disagree": 2,
            "first_token": 5, "short_of_winners": 0}}));
        assert_eq!(none.verdict_lines(), c.verdict_lines());
        assert!(
            stored(
                serde_json::json!({"tolerance": 1e-3, "layers": {"1": {"rows": 4,
                "disagree": 1, "first_token": 0, "short_of_winners": 2}}})
            )
            .is_err(),
            "more rows short of winners than disagree"
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
