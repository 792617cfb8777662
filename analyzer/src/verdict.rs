//! Verdicts: a convention the engine runs differently from the model, then
//! the first layer where prod departs from the shadow, in hidden states and
//! in top-k selection, each with the threshold that produced it.
//!
//! A threshold is either fixed (a flag with a documented default) or
//! calibrated from baseline runs the user marks healthy: per layer, the
//! noise floor is the worst value any baseline run of the same model showed
//! there, and the verdict is the first layer exceeding `factor` times it.

use std::collections::BTreeMap;

use serde::Serialize;
use shadowtrace_schemas::Convention;

use crate::metrics::hidden_error::SiteError;
use crate::metrics::topk_overlap::LayerOverlap;

/// Default p95 relative L2 error that marks hidden-state divergence. FP8
/// block-scaled GEMMs leave a few percent in healthy layers; ten percent is
/// beyond that. Calibrate with baseline runs for a tighter, per-layer bar.
pub const DEFAULT_HIDDEN_REL_ERR: f64 = 0.1;
/// Default mean churn-free top-k Jaccard below which selection has diverged.
pub const DEFAULT_TOPK_JACCARD: f64 = 0.8;
/// Default multiple of the baseline noise floor that marks divergence.
pub const DEFAULT_BASELINE_FACTOR: f64 = 3.0;
/// Smallest noise floor used, so a baseline with no error at a layer does
/// not turn any rounding into a verdict: hidden (relative L2) and top-k
/// (1 − Jaccard).
pub const MIN_FLOOR: (f64, f64) = (1e-6, 1e-3);

/// What the verdicts compare against.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Thresholds {
    /// p95 relative L2 error over tokens above which a layer has diverged.
    pub hidden_rel_err: f64,
    /// The site whose error decides (default `layer_out`: the residual stream).
    pub hidden_site: String,
    /// Shadow mode whose error decides; `None`: local where recorded, else free.
    pub hidden_mode: Option<String>,
    /// Mean churn-free Jaccard below which a layer's selection has diverged.
    pub topk_jaccard: f64,
    /// The churn band, relative to each row's score scale as
    /// `SHADOWTRACE_BOUNDARY_BAND` is; `None`: each run's recorded band. It
    /// can narrow the band, or widen it as far as the run's boundary lists
    /// reach (see [`crate::metrics::topk_overlap`]).
    pub churn_band: Option<f32>,
    /// Multiple of the baseline noise floor that marks divergence.
    pub baseline_factor: f64,
}

impl Default for Thresholds {
    fn default() -> Thresholds {
        Thresholds {
            hidden_rel_err: DEFAULT_HIDDEN_REL_ERR,
            hidden_site: "layer_out".to_owned(),
            hidden_mode: None,
            topk_jaccard: DEFAULT_TOPK_JACCARD,
            churn_band: None,
            baseline_factor: DEFAULT_BASELINE_FACTOR,
        }
    }
}

/// Per-layer noise floors of one model, from its baseline runs.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NoiseFloor {
    /// Baseline runs it came from.
    pub runs: Vec<String>,
    /// Worst p95 relative L2 error per layer at the deciding site.
    pub hidden: BTreeMap<i32, f64>,
    /// Worst 1 − mean churn-free Jaccard per layer.
    pub topk: BTreeMap<i32, f64>,
}

impl NoiseFloor {
    /// Folds one healthy run into the floor.
    pub fn add(
        &mut self,
        run_id: &str,
        hidden: &[SiteError],
        topk: &[LayerOverlap],
        t: &Thresholds,
    ) {
        self.runs.push(run_id.to_owned());
        for (layer, value) in hidden_series(hidden, t) {
            let floor = self.hidden.entry(layer).or_insert(0.0);
            *floor = floor.max(value);
        }
        for (layer, jaccard) in topk_series(topk) {
            let floor = self.topk.entry(layer).or_insert(0.0);
            *floor = floor.max(1.0 - jaccard);
        }
    }
}

/// A layer verdict: where, the value there, and the rule it broke.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerVerdict {
    /// The first layer that broke the rule.
    pub layer: i32,
    /// Its value (p95 relative L2 error, or mean churn-free Jaccard).
    pub value: f64,
    /// The limit at that layer.
    pub limit: f64,
}

/// The rule a verdict applies, printed with every verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rule {
    /// One line a person reads, thresholds included.
    pub text: String,
}

/// The shadow mode whose error decides: the one asked for, else `local`
/// where the run recorded it, else `free`.
#[must_use]
pub fn deciding_mode(sites: &[SiteError], t: &Thresholds) -> String {
    t.hidden_mode.clone().unwrap_or_else(|| {
        if sites.iter().any(|s| s.shadow_mode == "local") {
            "local".to_owned()
        } else {
            "free".to_owned()
        }
    })
}

/// The p95 relative L2 error per layer at the deciding site and mode.
#[must_use]
pub fn hidden_series(sites: &[SiteError], t: &Thresholds) -> Vec<(i32, f64)> {
    let mode = deciding_mode(sites, t);
    sites
        .iter()
        .filter(|s| s.site == t.hidden_site && s.shadow_mode == mode)
        .filter_map(|s| s.rel_l2_err.map(|e| (s.layer, e.p95)))
        .collect()
}

/// Why the hidden verdict has nothing to judge in a run: no capture at the
/// deciding site and shadow mode with a shadow to compare (a site the run
/// did not record, a mode it did not run); `None` where some layer has one.
/// "none" there would read as a pass over data that does not exist.
#[must_use]
pub fn hidden_not_captured(sites: &[SiteError], t: &Thresholds) -> Option<String> {
    hidden_series(sites, t)
        .is_empty()
        .then(|| format!("no {}/{} captures", t.hidden_site, deciding_mode(sites, t)))
}

/// Mean churn-free Jaccard per layer with informative rows.
#[must_use]
pub fn topk_series(layers: &[LayerOverlap]) -> Vec<(i32, f64)> {
    layers
        .iter()
        .filter_map(|l| l.jaccard_no_churn.map(|j| (l.layer, j.mean)))
        .collect()
}

/// The first layer of `series` (ascending layers) whose value breaks its
/// limit: `above` means exceeds it, otherwise falls below it.
fn first_breaking(
    series: &[(i32, f64)],
    limit: impl Fn(i32) -> f64,
    above: bool,
) -> Option<LayerVerdict> {
    series
        .iter()
        .find(|&&(layer, value)| {
            if above {
                value > limit(layer)
            } else {
                value < limit(layer)
            }
        })
        .map(|&(layer, value)| LayerVerdict {
            layer,
            value,
            limit: limit(layer),
        })
}

fn baseline_runs(f: &NoiseFloor) -> String {
    format!(
        "{} baseline run{}",
        f.runs.len(),
        if f.runs.len() == 1 { "" } else { "s" }
    )
}

/// The rule's tail for the layers of `series` that no baseline run
/// recorded (a baseline traced with fewer layers, say): they take the fixed
/// threshold, since a floor of nothing would make any rounding a verdict.
/// Empty when every layer has a floor.
fn without_baseline(series: &[(i32, f64)], floor: &BTreeMap<i32, f64>, fixed: f64) -> String {
    let missing: Vec<i32> = series
        .iter()
        .map(|&(layer, _)| layer)
        .filter(|layer| !floor.contains_key(layer))
        .collect();
    if missing.is_empty() {
        return String::new();
    }
    format!(
        "; layer{} {} had no baseline data and took the fixed threshold {fixed}",
        if missing.len() == 1 { "" } else { "s" },
        layer_ranges(&missing)
    )
}

/// Ascending layers as ranges: `0, 3-5, 9`.
fn layer_ranges(layers: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// The first-divergence layer in hidden states, and the rule applied.
#[must_use]
pub fn hidden_verdict(
    sites: &[SiteError],
    t: &Thresholds,
    floor: Option<&NoiseFloor>,
) -> (Option<LayerVerdict>, Rule) {
    let series = hidden_series(sites, t);
    let site = &t.hidden_site;
    let (verdict, text) = match floor {
        Some(f) => (
            first_breaking(
                &series,
                |l| {
                    f.hidden.get(&l).map_or(t.hidden_rel_err, |floor| {
                        t.baseline_factor * floor.max(MIN_FLOOR.0)
                    })
                },
                true,
            ),
            format!(
                "hidden: first layer whose p95 relative L2 error at {site} exceeds {} x its baseline floor (from {}){}",
                t.baseline_factor,
                baseline_runs(f),
                without_baseline(&series, &f.hidden, t.hidden_rel_err)
            ),
        ),
        None => (
            first_breaking(&series, |_| t.hidden_rel_err, true),
            format!(
                "hidden: first layer whose p95 relative L2 error at {site} exceeds {}",
                t.hidden_rel_err
            ),
        ),
    };
    (verdict, Rule { text })
}

/// The churn rule where no `--churn-band` was asked for.
pub const RECORDED_CHURN_RULE: &str = "churn within each row's recorded band excluded: the run's relative band x the mean |score| of the reference's top-k";

/// How churn was told apart, as a report's rules print it.
#[must_use]
pub fn churn_rule(churn_band: Option<f32>) -> String {
    match churn_band {
        Some(b) => format!(
            "churn within {b:e} x each row's score scale (mean |score| of the reference's top-k) of the k-th score excluded; runs with an absolute band: within {b:e}"
        ),
        None => RECORDED_CHURN_RULE.to_owned(),
    }
}

/// The first-divergence layer in top-k selection, and the rule applied.
#[must_use]
pub fn topk_verdict(
    layers: &[LayerOverlap],
    t: &Thresholds,
    floor: Option<&NoiseFloor>,
) -> (Option<LayerVerdict>, Rule) {
    let series = topk_series(layers);
    let churn = churn_rule(t.churn_band);
    let (verdict, text) = match floor {
        Some(f) => (
            first_breaking(
                &series,
                |l| {
                    f.topk.get(&l).map_or(t.topk_jaccard, |floor| {
                        1.0 - t.baseline_factor * floor.max(MIN_FLOOR.1)
                    })
                },
                false,
            ),
            format!(
                "top-k: first layer whose mean Jaccard ({churn}) falls below 1 - {} x its baseline floor of 1 - Jaccard (from {}){}",
                t.baseline_factor,
                baseline_runs(f),
                without_baseline(&series, &f.topk, t.topk_jaccard)
            ),
        ),
        None => (
            first_breaking(&series, |_| t.topk_jaccard, false),
            format!(
                "top-k: first layer whose mean Jaccard ({churn}) falls below {}",
                t.topk_jaccard
            ),
        ),
    };
    (verdict, Rule { text })
}

/// A numerics convention the engine ran differently from the model
/// (DESIGN.md, convention): its own verdict, named before any metric,
/// because a shadow that takes the model's convention diverges from such an
/// engine everywhere the convention acts, and no threshold is needed to say
/// why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConventionMismatch {
    /// The convention, for example `indexer_rope`.
    pub name: String,
    /// The engine's value.
    pub engine: serde_json::Value,
    /// The model's value.
    pub model: serde_json::Value,
    /// Where the engine's value was read.
    pub engine_source: String,
    /// Where the model's value was read.
    pub model_source: String,
}

impl ConventionMismatch {
    /// The verdict's line, for example `convention mismatch: indexer rope:
    /// engine neox, model interleaved`.
    #[must_use]
    pub fn line(&self) -> String {
        format!(
            "convention mismatch: {}: engine {}, model {}",
            self.name.replace('_', " "),
            convention_value(&self.engine),
            convention_value(&self.model)
        )
    }
}

/// A convention's value as a person reads it: strings bare, the rest as JSON.
#[must_use]
pub fn convention_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "unknown".to_owned(),
        other => other.to_string(),
    }
}

/// The rule of the convention verdict, printed with it.
pub const CONVENTION_RULE: &str = "convention: a numerics convention whose engine value is known and differs from the model's (config.json and the family's reference code); an engine value the adapter assumed is not judged";

/// The conventions whose engine value is known, read from the engine and
/// not assumed, and differs from the model's. An assumed one is not judged
/// ([`crate::judged`]).
#[must_use]
pub fn convention_verdict(conventions: &[Convention]) -> Vec<ConventionMismatch> {
    conventions
        .iter()
        .filter(|c| c.mismatch() && !c.engine_assumed)
        .map(|c| ConventionMismatch {
            name: c.name.clone(),
            engine: c.engine.clone(),
            model: c.model.clone(),
            engine_source: c.engine_source.clone(),
            model_source: c.model_source.clone(),
        })
        .collect()
}

/// A kind of verdict, as `--fail-on` names it, in the order a run's
/// verdicts are listed: what makes every other one meaningless first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VerdictKind {
    /// The capture self-check found recorded selections production's own
    /// scores contradict (`capture inconsistent`).
    Capture,
    /// A convention the engine ran differently from the model.
    Convention,
    /// A non-finite onset in prod, or a failed sentinel check.
    Nonfinite,
    /// A hidden-state divergence.
    Hidden,
    /// A top-k selection divergence.
    Topk,
    /// A prefix-cache hit that parts from a miss of the same prompt.
    Cache,
}

/// Every kind, in listing order.
pub const EVERY_KIND: [VerdictKind; 6] = [
    VerdictKind::Capture,
    VerdictKind::Convention,
    VerdictKind::Nonfinite,
    VerdictKind::Hidden,
    VerdictKind::Topk,
    VerdictKind::Cache,
];

impl VerdictKind {
    /// The kind as `--fail-on` and the JSON name it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            VerdictKind::Capture => "capture",
            VerdictKind::Convention => "convention",
            VerdictKind::Nonfinite => "nonfinite",
            VerdictKind::Hidden => "hidden",
            VerdictKind::Topk => "topk",
            VerdictKind::Cache => "cache",
        }
    }
}

/// One verdict a run has: its kind, and the short mark the summary lines,
/// the grid and `--fail-on` print: `topk@L1 (J 0.749 < 0.8)`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Found {
    /// The kind.
    pub kind: VerdictKind,
    /// Where and what, thresholds included.
    pub mark: String,
}

/// A limit or value as few digits as say it: `0.8`, `0.749`.
fn short(v: f64) -> String {
    let text = format!("{v:.4}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    text.to_owned()
}

/// Every verdict of `run`, in [`VerdictKind`] order (cache verdicts are the
/// pairs', not a run's). `hidden_site` names the site when it is not the
/// default `layer_out`.
#[must_use]
pub fn found(run: &crate::analysis::RunAnalysis, hidden_site: &str) -> Vec<Found> {
    let mut out = Vec::new();
    let mut push = |kind, mark: String| out.push(Found { kind, mark });
    if let Some(check) = &run.capture_check {
        for l in check.inconsistent() {
            push(
                VerdictKind::Capture,
                format!(
                    "capture inconsistent@L{} ({} of {} rows)",
                    l.layer, l.disagree, l.rows
                ),
            );
        }
    }
    for m in &run.convention_mismatches {
        push(
            VerdictKind::Convention,
            format!(
                "convention {} (engine {}, model {})",
                m.name.replace('_', " "),
                convention_value(&m.engine),
                convention_value(&m.model)
            ),
        );
    }
    for s in &run.failed_sentinels {
        push(
            VerdictKind::Nonfinite,
            format!("sentinel {}@L{} step {}", s.check, s.layer, s.step),
        );
    }
    if let Some(o) = &run.onset {
        let token = o.token.map_or_else(String::new, |t| format!(" t{t}"));
        let step = if o.step == 0 {
            String::new()
        } else {
            format!(" step {}", o.step)
        };
        push(
            VerdictKind::Nonfinite,
            format!("nonfinite@L{} {}{token}{step}", o.layer, o.site),
        );
    }
    if let Some(v) = &run.hidden_verdict {
        let site = if hidden_site == "layer_out" {
            String::new()
        } else {
            format!(" {hidden_site}")
        };
        push(
            VerdictKind::Hidden,
            format!(
                "hidden@L{}{site} (p95 {:.2e} > {:.2e})",
                v.layer, v.value, v.limit
            ),
        );
    }
    if let Some(check) = &run.capture_check {
        for l in check.short_of_winners() {
            push(
                VerdictKind::Topk,
                format!(
                    "topk short of winners@L{} ({} of {} rows)",
                    l.layer,
                    l.short_of_winners.unwrap_or(0),
                    l.rows
                ),
            );
        }
    }
    if let Some(v) = &run.topk_verdict {
        push(
            VerdictKind::Topk,
            format!(
                "topk@L{} (J {} < {})",
                v.layer,
                short(v.value),
                short(v.limit)
            ),
        );
    }
    out
}

/// Where a run, or the whole analysis, stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every verdict judged, and none found.
    Pass,
    /// A verdict found.
    Fail,
    /// No verdict found, and some verdict's data not whole (or a run not
    /// read): not a pass.
    NotJudged,
}

impl Status {
    /// As the summary line prints it.
    #[must_use]
    pub fn word(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::NotJudged => "NOT JUDGED",
        }
    }
}

/// A question whose verdict is not judged in a run, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotJudged {
    /// The question.
    pub question: crate::judged::Question,
    /// Why, as the reports say it.
    pub why: String,
}

/// One run's verdicts, for a CI: its status, the verdicts found, and the
/// questions not judged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunVerdict {
    /// Run id.
    pub run_id: String,
    /// Fail where a verdict was found; else not judged where a question's
    /// data is not whole; else pass.
    pub status: Status,
    /// The verdicts found, in [`VerdictKind`] order.
    pub found: Vec<Found>,
    /// The questions not judged.
    pub not_judged: Vec<NotJudged>,
}

impl RunVerdict {
    /// The run's summary line: `glm-tool-3k FAIL topk@L1 (J 0.749 < 0.8);
    /// nonfinite@L2 mlp_out t2500`, `r PASS`, or `r NOT JUDGED (hidden
    /// divergence: no layer_out/local captures)`.
    #[must_use]
    pub fn line(&self) -> String {
        let marks: Vec<&str> = self.found.iter().map(|f| f.mark.as_str()).collect();
        let not_judged: Vec<String> = self
            .not_judged
            .iter()
            .map(|n| format!("{}: {}", n.question.name(), n.why))
            .collect();
        match self.status {
            Status::Fail if not_judged.is_empty() => {
                format!("{} FAIL {}", self.run_id, marks.join("; "))
            }
            Status::Fail => format!(
                "{} FAIL {} (not judged: {})",
                self.run_id,
                marks.join("; "),
                self.not_judged
                    .iter()
                    .map(|n| n.question.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Status::NotJudged => format!("{} NOT JUDGED ({})", self.run_id, not_judged.join("; ")),
            Status::Pass => format!("{} PASS", self.run_id),
        }
    }
}

/// The analysis's verdict as a CI reads it (`--format json`'s `verdict`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Overall {
    /// Fail where any run or prefix-cache pair has a verdict; else not
    /// judged where a run's verdict is not judged or a run was skipped (or
    /// none was read); else pass.
    pub status: Status,
    /// Every kind `--fail-on` knows, each with what has it: `run: mark`,
    /// or the cache pair; empty where nothing has it.
    pub kinds: BTreeMap<&'static str, Vec<String>>,
    /// Per run.
    pub runs: Vec<RunVerdict>,
    /// Runs that could not be read (not judged).
    pub skipped: usize,
}

/// The questions a run's status is judged on: every verdict's, and the
/// convention's.
const STATUS_QUESTIONS: [crate::judged::Question; 4] = [
    crate::judged::Question::Convention,
    crate::judged::Question::Nonfinite,
    crate::judged::Question::Hidden,
    crate::judged::Question::Topk,
];

impl Overall {
    /// The verdict of `runs`, with `cache`'s pairs and `skipped` runs not
    /// read; `hidden_site` as [`found`] takes it.
    #[must_use]
    pub fn of(
        runs: &[crate::analysis::RunAnalysis],
        cache: Option<&crate::cache_pair::CachePairs>,
        skipped: usize,
        hidden_site: &str,
    ) -> Overall {
        let mut kinds: BTreeMap<&'static str, Vec<String>> =
            EVERY_KIND.iter().map(|k| (k.name(), Vec::new())).collect();
        let runs: Vec<RunVerdict> = runs
            .iter()
            .map(|run| {
                let found = found(run, hidden_site);
                let not_judged: Vec<NotJudged> = STATUS_QUESTIONS
                    .iter()
                    .filter_map(|&q| {
                        crate::judged::why_not_judged(&run.not_measured, q)
                            .map(|why| NotJudged { question: q, why })
                    })
                    .collect();
                for f in &found {
                    kinds
                        .entry(f.kind.name())
                        .or_default()
                        .push(format!("{}: {}", run.run_id, f.mark));
                }
                let status = if !found.is_empty() {
                    Status::Fail
                } else if !not_judged.is_empty() {
                    Status::NotJudged
                } else {
                    Status::Pass
                };
                RunVerdict {
                    run_id: run.run_id.clone(),
                    status,
                    found,
                    not_judged,
                }
            })
            .collect();
        for p in cache
            .into_iter()
            .flat_map(|c| &c.pairs)
            .filter(|p| p.parted_or_flipped())
        {
            kinds
                .entry(VerdictKind::Cache.name())
                .or_default()
                .push(format!("cache hit {} against miss {}", p.hit, p.miss));
        }
        let status = if kinds.values().any(|v| !v.is_empty()) {
            Status::Fail
        } else if runs.is_empty() || skipped > 0 || runs.iter().any(|r| r.status != Status::Pass) {
            Status::NotJudged
        } else {
            Status::Pass
        };
        Overall {
            status,
            kinds,
            runs,
            skipped,
        }
    }
}
