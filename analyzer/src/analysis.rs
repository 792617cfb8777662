//! The analysis of a set of runs: per-run metrics and verdicts, baseline
//! calibration, determinism pairs and the grid. Everything a report prints
//! comes from here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;
use shadowtrace_schemas::manifest::Status;
use shadowtrace_schemas::{Convention, Table};

use crate::AnalyzeError;
use crate::cache_pair::{self, CachePairs, FirstPosition};
use crate::capture_check::{self, CaptureCheck};
use crate::graft_pair::{self, GraftPairs};
use crate::grid::{Grid, group_runs};
use crate::judged::{self, EVERY_QUESTION, NotMeasured, Question, why_not_judged};
use crate::load::{Dataset, PartFile, Run};
use crate::metrics::hidden_error::{self, SiteError};
use crate::metrics::logits::{self, Agreement, TopN};
use crate::metrics::nan_provenance::{self, Provenance};
use crate::metrics::nan_reads::{self, Selections};
use crate::metrics::nan_trace::Captures;
use crate::metrics::nonfinite::{self, FailedSentinel, Onset};
use crate::metrics::selection_unit;
use crate::metrics::topk_check::{self, SummaryCheck};
use crate::metrics::topk_overlap::{self, LayerOverlap, Pieces, Rows, SkippedRow};
use crate::metrics::topk_v2::{self, PartOverlaps};
use crate::outcome::Outcome;
use crate::ranks::{self, RankAgreement};
use crate::verdict::{
    CONVENTION_RULE, ConventionMismatch, LayerVerdict, NoiseFloor, Overall, Thresholds,
    convention_verdict, hidden_not_captured, hidden_verdict, topk_verdict,
};

/// How to analyse.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Thresholds of the verdicts.
    pub thresholds: Thresholds,
    /// Tags runs are grouped by; empty: model, prompt_kind, length_bucket.
    pub group_by: Vec<String>,
    /// Fail on the first bad run instead of skipping it.
    pub strict: bool,
    /// Where the top-k summary check's results are remembered per part file
    /// ([`crate::metrics::check_memo`]); `None`: every part is checked.
    pub check_memo: Option<PathBuf>,
}

/// The default grouping of the grid.
pub const DEFAULT_GROUP_BY: [&str; 3] = ["model", "prompt_kind", "length_bucket"];

/// One run, analysed.
#[derive(Debug, Clone, Serialize)]
pub struct RunAnalysis {
    /// Run id.
    pub run_id: String,
    /// Run directory.
    pub dir: PathBuf,
    /// Whether the producer closed the run (every rank's, for ranks read as
    /// one run).
    pub complete: bool,
    /// Tags: the manifest's identity flattened, then the user's tags (see
    /// [`run_tags`]: a user tag named like an identity name wins, and the
    /// identity's value stays as `manifest.<name>`).
    pub tags: BTreeMap<String, String>,
    /// The user's judgement of the answer (the `outcome` tag); `None` where
    /// the run has none. Never inferred, never judged from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Losses and failures the producer counted, and rows dropped per table
    /// (summed over the ranks, for ranks read as one run).
    pub counters: BTreeMap<String, u64>,
    /// What the loader noticed (files left half-written, a manifest row
    /// count its files do not hold, ...); for ranks read as one run, every
    /// rank's, each prefixed with its rank.
    pub notes: Vec<String>,
    /// Top-k overlap per layer, against the reference recompute.
    pub topk: Vec<LayerOverlap>,
    /// Top-k overlap per layer against a recompute of production's own
    /// dequantized FP8 operands: kernel and accumulation error alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub topk_dequant: Vec<LayerOverlap>,
    /// v2 runs: each top-k row's summary checked against its lists
    /// ([`topk_check`]); disagreements are also a note. Absent for v1 runs,
    /// which store no summary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topk_summary_check: Option<SummaryCheck>,
    /// Hidden-state error per layer and site.
    pub hidden: Vec<SiteError>,
    /// Prod against shadow logits.
    pub logits: Option<Agreement>,
    /// The numerics conventions the producer recorded: the engine's value
    /// beside the model's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub conventions: Vec<Convention>,
    /// Conventions the engine ran differently from the model: a verdict of
    /// its own, named before any metric.
    pub convention_mismatches: Vec<ConventionMismatch>,
    /// The producer's capture self-check ([`crate::capture_check`]): a layer
    /// whose recorded selections production's own scores contradict is
    /// `capture inconsistent`, a verdict printed before every other. Absent
    /// where the producer ran none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture_check: Option<CaptureCheck>,
    /// Where the producer ran no capture self-check: why (the `why` of its
    /// `settings.capture_check` with `run` false, else that the run records
    /// none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture_check_not_run: Option<String>,
    /// A `settings.capture_check` that cannot be read: why. A broken run,
    /// not judged for capture (nor its top-k verdict), never "no check".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture_check_unreadable: Option<String>,
    /// Engine behaviours the reference engine ran on purpose (the manifest's
    /// `deviations`, by name).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deviations: Vec<String>,
    /// First non-finite value of prod.
    pub onset: Option<Onset>,
    /// Where the onset was produced, where it spread, what it does not
    /// explain ([`nan_provenance`]); absent without an onset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nan_provenance: Option<Provenance>,
    /// Sentinel checks that failed.
    pub failed_sentinels: Vec<FailedSentinel>,
    /// First hidden-state divergence.
    pub hidden_verdict: Option<LayerVerdict>,
    /// First top-k divergence.
    pub topk_verdict: Option<LayerVerdict>,
    /// What the run did not measure, each with the verdicts it leaves not
    /// judged ([`crate::judged`]): a verdict is given only where its data is
    /// whole.
    pub not_measured: Vec<NotMeasured>,
    /// The rules the verdicts applied, thresholds included.
    pub rules: Vec<String>,
    /// For a request traced on several ranks: the ranks read as this run
    /// and how they agree (see [`crate::ranks`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<RankAgreement>,
    /// Per-row overlaps, for heatmaps and the metrics Parquet.
    #[serde(skip)]
    pub topk_rows: Rows,
    /// Per-row overlaps against the dequantized operands.
    #[serde(skip)]
    pub topk_dequant_rows: Rows,
    /// The top-k rows left out of the averages (dense, or without a
    /// shadow), by key: ranks that scored different rows of one request
    /// are united from these and `topk_rows` ([`crate::ranks`]).
    #[serde(skip)]
    pub topk_skipped: Pieces<SkippedRow>,
    /// Per-token error at the hidden verdict's site, for heatmaps.
    #[serde(skip)]
    pub hidden_tokens: Vec<hidden_error::TokenError>,
    /// Prod top-N logits, for determinism pairs.
    #[serde(skip)]
    pub prod_top_n: TopN,
    /// The logits' shadow top-N, for graft pairs.
    #[serde(skip)]
    pub shadow_top_n: TopN,
    /// Whether the logits' shadow is the free chain (the shadow's own, from
    /// the embeddings): `settings.logits_shadow_mode` where the producer
    /// wrote it, else whether the run's shadow modes include free (the
    /// reference engine's rule).
    #[serde(skip)]
    pub logits_shadow_free: bool,
    /// What a run tagged `cache=hit|miss` recorded at its first generated
    /// position, for prefix-cache pairs.
    #[serde(skip)]
    pub first_position: Option<FirstPosition>,
}

impl RunAnalysis {
    /// Whether the absence of a verdict in this run means something for at
    /// least one question: its data is whole there ([`Self::not_measured`]).
    #[must_use]
    pub fn can_be_judged(&self) -> bool {
        EVERY_QUESTION.iter().any(|&q| self.judged(q))
    }

    /// Whether `question`'s data is whole in this run, so that its verdict,
    /// or the absence of one, means something.
    #[must_use]
    pub fn judged(&self, question: Question) -> bool {
        why_not_judged(&self.not_measured, question).is_none()
    }

    /// Whether the capture self-check found a layer whose recorded
    /// selections production's own scores contradict.
    #[must_use]
    pub fn capture_inconsistent(&self) -> bool {
        self.capture_check
            .as_ref()
            .is_some_and(|c| c.inconsistent().next().is_some())
    }

    /// The capture self-check's lines for the reports, and whether they are
    /// an alarm (a layer that disagrees, or a check that cannot be read).
    #[must_use]
    pub fn capture_lines(&self) -> (bool, Vec<String>) {
        if let Some(why) = &self.capture_check_unreadable {
            return (true, vec![capture_check::unreadable_line(why)]);
        }
        match &self.capture_check {
            Some(check) => check.report_lines(),
            None => (
                false,
                vec![capture_check::not_run_line(
                    self.capture_check_not_run
                        .as_deref()
                        .unwrap_or(capture_check::NOT_RUN_UNSAID),
                )],
            ),
        }
    }

    /// Whether any verdict fired.
    #[must_use]
    pub fn has_verdict(&self) -> bool {
        self.capture_inconsistent()
            || self
                .capture_check
                .as_ref()
                .is_some_and(|c| c.short_of_winners().next().is_some())
            || !self.convention_mismatches.is_empty()
            || self.onset.is_some()
            || self.hidden_verdict.is_some()
            || self.topk_verdict.is_some()
            || !self.failed_sentinels.is_empty()
    }
}

/// Two runs of the same model, engine and prompt, prod against prod.
#[derive(Debug, Clone, Serialize)]
pub struct DeterminismPair {
    /// First run.
    pub a: String,
    /// Second run.
    pub b: String,
    /// Their prod logits' agreement.
    pub agreement: Agreement,
}

/// Everything the analysis found.
#[derive(Debug, Clone, Serialize)]
pub struct Analysis {
    /// The thresholds used.
    pub thresholds: Thresholds,
    /// Noise floors per model, from baseline runs.
    pub floors: BTreeMap<String, NoiseFloor>,
    /// Runs analysed, in path order.
    pub runs: Vec<RunAnalysis>,
    /// Runs that could not be read, with the file and the problem.
    pub skipped: Vec<String>,
    /// What the reader should know about the input as a whole: a run
    /// directory given twice (read once), a run id that more than one
    /// directory holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Grid over the runs.
    pub grid: Grid,
    /// Determinism pairs among the runs.
    pub determinism: Vec<DeterminismPair>,
    /// Prefix-cache hits against misses of the same prompt, when any run is
    /// a hit ([`crate::cache_pair`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CachePairs>,
    /// Graft runs against their ungrafted base runs, when any run is a
    /// graft run ([`crate::graft_pair`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grafts: Option<GraftPairs>,
    /// The verdict as a CI reads it: overall, per kind and per run.
    pub verdict: Overall,
}

impl Analysis {
    /// The distinct rules the verdicts applied (runs calibrated against a
    /// baseline and runs without one apply different ones), then the
    /// baseline runs behind each model's floor.
    #[must_use]
    pub fn rule_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = Vec::new();
        for rule in self.runs.iter().flat_map(|r| &r.rules) {
            if !lines.contains(rule) {
                lines.push(rule.clone());
            }
        }
        if let Some(cache) = &self.cache {
            lines.push(cache.rule.clone());
        }
        lines.extend(
            self.floors
                .iter()
                .map(|(model, f)| format!("baseline for {model}: {}", f.runs.join(", "))),
        );
        lines
    }
}

/// Analyses the runs under `paths`, calibrating against the runs under
/// `baselines` when given. `progress(done, total)` is called per run.
///
/// # Errors
/// No run under a path, a bad run under `strict`, or an unreadable column.
pub fn analyze(
    paths: &[PathBuf],
    baselines: &[PathBuf],
    options: &Options,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<Analysis, AnalyzeError> {
    let t = &options.thresholds;
    let mut skipped = Vec::new();
    let mut floors: BTreeMap<String, NoiseFloor> = BTreeMap::new();
    if !baselines.is_empty() {
        let dataset = Dataset::load(baselines, options.strict, |d, n| {
            progress("reading baselines", d, n)
        })?;
        skipped.extend(dataset.skipped.iter().map(|e| format!("baseline {e}")));
        for (i, run) in dataset.runs.iter().enumerate() {
            let a = match analyze_run(run, t, None, options.check_memo.as_deref()) {
                Ok(a) => a,
                Err(e) if !options.strict => {
                    skipped.push(format!("baseline run {}: {e}", run.dir.display()));
                    continue;
                }
                Err(e) => return Err(e),
            };
            // Matched by the manifest's model name, whatever a user tag says.
            let model = run.manifest.identity.model.name.clone();
            floors
                .entry(model)
                .or_default()
                .add(&a.run_id, &a.hidden, &a.topk, t);
            progress("calibrating", i + 1, dataset.runs.len());
        }
    }
    let dataset = Dataset::load(paths, options.strict, |d, n| progress("reading runs", d, n))?;
    skipped.extend(dataset.skipped.iter().map(ToString::to_string));
    let mut warnings: Vec<String> = dataset
        .repeated
        .iter()
        .map(|d| format!("{}: given more than once, read once", d.display()))
        .collect();
    let mut runs = Vec::with_capacity(dataset.runs.len());
    for (i, run) in dataset.runs.iter().enumerate() {
        let model = run.manifest.identity.model.name.clone();
        match analyze_run(run, t, floors.get(&model), options.check_memo.as_deref()) {
            Ok(a) => runs.push(a),
            // A part that passed the load checks and still does not decode
            // (damaged data pages): the run is skipped and said, as an
            // unreadable run is, and the others are analysed.
            Err(e) if !options.strict => {
                skipped.push(format!("run {}: {e}", run.dir.display()));
            }
            Err(e) => return Err(e),
        }
        progress("analysing", i + 1, dataset.runs.len());
    }
    let mut runs = ranks::merge(runs, t, &floors);
    // After the ranks are united: the hidden verdict reads the lowest rank's
    // captures, whichever ranks recorded hidden states.
    for run in &mut runs {
        if let Some(why) = hidden_not_captured(&run.hidden, t) {
            run.not_measured.push(NotMeasured {
                questions: vec![Question::Hidden],
                why,
            });
        }
    }
    let group_by: Vec<String> = if options.group_by.is_empty() {
        DEFAULT_GROUP_BY.iter().map(|s| (*s).to_owned()).collect()
    } else {
        options.group_by.clone()
    };
    let grid = group_runs(&runs, &group_by, t);
    warnings.extend(repeated_run_ids(&runs));
    let determinism = determinism_pairs(&runs);
    let cache = cache_pair::pairs(&runs, t);
    let grafts = graft_pair::pairs(&runs);
    let verdict = Overall::of(&runs, cache.as_ref(), skipped.len(), &t.hidden_site);
    Ok(Analysis {
        thresholds: t.clone(),
        floors,
        runs,
        skipped,
        warnings,
        grid,
        determinism,
        cache,
        grafts,
        verdict,
    })
}

/// Analyses one run; `check_memo` as [`Options::check_memo`].
///
/// # Errors
/// When a table cannot be read or lacks a column.
pub fn analyze_run(
    run: &Run,
    t: &Thresholds,
    floor: Option<&NoiseFloor>,
    check_memo: Option<&Path>,
) -> Result<RunAnalysis, AnalyzeError> {
    let parts: Vec<&PartFile> = run.files.get(&Table::Topk).into_iter().flatten().collect();
    let band_factor = band_factor(run, t.churn_band)?;
    // v1: part by part, since a GLM-5.1 prefill's full selections are tens of
    // GB decoded and one part file at a time bounds memory by the writer's
    // part size. v2's summaries are small: parts are read in parallel.
    let overlaps = |part: &PartFile| {
        if part.version >= 2 {
            topk_v2::part_overlaps(part, band_factor)
        } else {
            overlaps_v1(part, band_factor)
        }
    };
    let per_part: Vec<Result<PartOverlaps, AnalyzeError>> = if run.manifest.schema_version >= 2 {
        parts.par_iter().map(|p| overlaps(p)).collect()
    } else {
        parts.iter().map(|p| overlaps(p)).collect()
    };
    let mut topk_rows = Rows::default();
    let mut dequant_rows = Rows::default();
    let mut skipped_rows = topk_overlap::Skipped::default();
    let mut units = BTreeMap::new();
    let mut contradicted = Vec::new();
    for (part, result) in parts.iter().zip(per_part) {
        let PartOverlaps {
            rows,
            dequant_rows: dequant,
            skipped,
            units: part_units,
            contradictions,
        } = result?;
        if contradictions.rows > 0 {
            contradicted.push(judged::contradicting_counts(
                &run.dir,
                &part.path,
                &contradictions,
            ));
        }
        // A layer's rows are summarised together: one selection unit each.
        selection_unit::merge(&mut units, part_units)?;
        topk_rows.append(rows);
        dequant_rows.append(dequant);
        skipped_rows.add(skipped);
    }
    let mut topk =
        topk_overlap::by_layer(topk_rows.pieces(), &skipped_rows.reference, t.topk_jaccard);
    let mut topk_dequant =
        topk_overlap::by_layer(dequant_rows.pieces(), &skipped_rows.dequant, t.topk_jaccard);
    for layer in topk.iter_mut().chain(topk_dequant.iter_mut()) {
        layer.unit = units.get(&layer.layer).cloned();
    }

    let mut hidden_columns: Vec<&str> = hidden_error::COLUMNS.to_vec();
    hidden_columns.extend(
        nonfinite::HIDDEN_COLUMNS
            .iter()
            .filter(|c| !hidden_error::COLUMNS.contains(c)),
    );
    let hidden_frame = run.read_table(Table::Hidden, Some(&hidden_columns))?;
    let hidden = hidden_error::by_site(&hidden_frame)?;
    let hidden_tokens = hidden_error::tokens_at_verdict_site(&hidden_frame, &hidden, t)?;
    let events_frame = run.read_table(Table::Events, Some(&nonfinite::EVENT_COLUMNS))?;
    let (onset, failed_sentinels) = nonfinite::onset(&hidden_frame, &events_frame)?;
    let nan_provenance = if onset.is_some() {
        provenance(run, &hidden_frame, &events_frame)?
    } else {
        None
    };

    let logits_frame = run.read_table(Table::Logits, Some(&logits::COLUMNS))?;
    let (prod_top_n, shadow_top_n) = logits::top_n(&logits_frame)?;
    let logits = logits::agreement(&prod_top_n, &shadow_top_n);
    let tags = run_tags(run);
    let m = &run.manifest;
    let logits_shadow_free = m
        .identity
        .settings
        .get("logits_shadow_mode")
        .and_then(|v| v.as_str())
        .map_or_else(
            || m.identity.shadow.modes.iter().any(|mode| mode == "free"),
            |mode| mode == "free",
        );
    let first_position = if tags.contains_key(cache_pair::CACHE_TAG) {
        let length = run.manifest.identity.prompt.length;
        Some(FirstPosition::of(&hidden_frame, &prod_top_n, length)?)
    } else {
        None
    };
    drop(hidden_frame);

    let (hidden_verdict, hidden_rule) = hidden_verdict(&hidden, t, floor);
    let (topk_verdict, topk_rule) = topk_verdict(&topk, t, floor);
    let topk_summary_check = topk_check::check_run(run, check_memo)?;
    let conventions = recorded_conventions(m);
    let convention_mismatches = convention_verdict(&conventions);
    let counters = judged::run_counters(m);
    let mut not_measured =
        judged::not_measured(m, &conventions, &counters, topk_summary_check.as_ref());
    not_measured.extend(contradicted);
    not_measured.extend(judged::problems_not_measured(&run.problems));
    // An unreadable check is not measured (above) and said, never a pass.
    let (capture_check, capture_check_not_run, capture_check_unreadable) =
        match capture_check::Recorded::of(m) {
            capture_check::Recorded::Checked(c) => (Some(c), None, None),
            capture_check::Recorded::NotRun(why) => (None, Some(why), None),
            capture_check::Recorded::Unreadable(why) => (None, None, Some(why)),
        };
    Ok(RunAnalysis {
        run_id: m.run_id().to_owned(),
        dir: run.dir.clone(),
        complete: m.status == Status::Complete,
        outcome: Outcome::of(&tags),
        tags,
        counters,
        notes: run
            .notes
            .iter()
            .cloned()
            .chain(run.problems.iter().map(ToString::to_string))
            .collect(),
        topk,
        topk_dequant,
        topk_summary_check,
        hidden,
        logits,
        conventions,
        convention_mismatches,
        capture_check,
        capture_check_not_run,
        capture_check_unreadable,
        deviations: m
            .identity
            .deviations
            .iter()
            .map(|d| {
                let name = d.get("name").and_then(|n| n.as_str()).unwrap_or("unnamed");
                match d.get("layers").and_then(|l| l.as_array()) {
                    Some(layers) => format!(
                        "{name}@{}",
                        layers
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    None => name.to_owned(),
                }
            })
            .collect(),
        onset,
        nan_provenance,
        failed_sentinels,
        hidden_verdict,
        topk_verdict,
        not_measured,
        rules: vec![hidden_rule.text, topk_rule.text, CONVENTION_RULE.to_owned()],
        ranks: None,
        topk_rows,
        topk_dequant_rows: dequant_rows,
        topk_skipped: skipped_rows.rows,
        hidden_tokens,
        prod_top_n,
        shadow_top_n,
        logits_shadow_free,
        first_position,
    })
}

/// NaN provenance of a run with an onset: its selections are read only then.
fn provenance(
    run: &Run,
    hidden: &polars::prelude::DataFrame,
    events: &polars::prelude::DataFrame,
) -> Result<Option<Provenance>, AnalyzeError> {
    let m = &run.manifest;
    let captures = Captures::of(
        hidden,
        events,
        &m.identity.engine.name,
        m.identity.prompt.length,
    )?;
    let selections = if m.identity.model.index_topk.is_none() {
        Selections::dense()
    } else if m.schema_version < 2 {
        Selections::not_read(
            "the selections of a trace format v1 run are not read: reads through the indexer are not known"
                .to_owned(),
        )
    } else {
        Selections::of(&run.read_table(Table::Topk, Some(&nan_reads::COLUMNS))?)?
    };
    Ok(nan_provenance::provenance(&captures, &selections))
}

/// The conventions a run recorded: the manifest's (format v2, and v1
/// documents that carry them), else the `settings.conventions` the engine
/// hooks wrote before conventions moved to the top level.
pub(crate) fn recorded_conventions(m: &shadowtrace_schemas::Manifest) -> Vec<Convention> {
    if !m.identity.conventions.is_empty() {
        return m.identity.conventions.clone();
    }
    m.identity
        .settings
        .get("conventions")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// What `--churn-band` `asked` makes of `run`'s recorded bands: the factor
/// each row's `boundary_band` is multiplied by (`None`: the recorded band).
/// The run's settings give its relative band and how far its boundary lists
/// reach (`boundary_stored`; the band itself where absent: lists before the
/// relative rule reached only the band). A run recorded with an absolute band
/// has one band for every row, so the asked band is read as a score distance
/// there, as its report's rule says.
///
/// # Errors
/// When the asked band is wider than the lists reach.
fn band_factor(run: &Run, asked: Option<f32>) -> Result<Option<f32>, AnalyzeError> {
    let Some(asked) = asked else {
        return Ok(None);
    };
    let setting = |name: &str| {
        run.manifest
            .identity
            .settings
            .get(name)
            .and_then(|v| v.as_f64())
    };
    let Some(recorded) = setting("boundary_band") else {
        // No band recorded: no row has boundary lists, whatever is asked.
        return Ok(None);
    };
    let stored = setting("boundary_stored").unwrap_or(recorded);
    // f32 tolerance: the asked value and the recorded one went through f32
    if f64::from(asked) > stored * (1.0 + 1e-6) {
        return Err(AnalyzeError::ChurnBandBeyondStored {
            run: run.manifest.run_id().to_owned(),
            asked,
            stored: stored as f32,
        });
    }
    if recorded <= 0.0 {
        // a zero band: every row's is zero, and any factor keeps it there
        return Ok(None);
    }
    Ok(Some((f64::from(asked) / recorded) as f32))
}

/// Per-row overlap of a v1 `topk` part (its full selections), row group by
/// row group as decoded: no copy into one chunk.
fn overlaps_v1(part: &PartFile, band_factor: Option<f32>) -> Result<PartOverlaps, AnalyzeError> {
    let mut frame = part.read(Some(&topk_overlap::COLUMNS_V1))?;
    let mut out = PartOverlaps::default();
    for chunk in frame.split_chunks() {
        selection_unit::merge(&mut out.units, selection_unit::per_layer(&chunk)?)?;
        let (rows, skipped) = topk_overlap::row_overlaps_v1(&chunk, band_factor)?;
        let (dequant, reference) = Rows::from(rows).partition(|r| r.dequant);
        out.rows.append(reference);
        out.dequant_rows.append(dequant);
        out.skipped.add(skipped);
    }
    Ok(out)
}

/// The prefix under which an identity value a user tag displaced is kept.
pub const MANIFEST_TAG_PREFIX: &str = "manifest.";

/// The identity's value of `name` in a run's tags: `manifest.<name>` where a
/// user tag displaced it, else `name` itself.
#[must_use]
pub fn identity_tag<'a>(tags: &'a BTreeMap<String, String>, name: &str) -> Option<&'a String> {
    tags.get(&format!("{MANIFEST_TAG_PREFIX}{name}"))
        .or_else(|| tags.get(name))
}

/// The tags a run is grouped by: its identity flattened, then user tags. The
/// user chose a tag's name: one named like an identity name (`model=...`)
/// takes that name, and the identity's value, when it differs, stays as
/// `manifest.<name>`; the grid says which runs it grouped by a user's tag.
#[must_use]
pub fn run_tags(run: &Run) -> BTreeMap<String, String> {
    let id = &run.manifest.identity;
    let mut tags = BTreeMap::new();
    tags.insert("model".to_owned(), id.model.name.clone());
    tags.insert("architecture".to_owned(), id.model.architecture.clone());
    tags.insert("engine".to_owned(), id.engine.name.clone());
    if let Some(v) = &id.engine.variant {
        tags.insert("engine_variant".to_owned(), v.clone());
    }
    tags.insert("device".to_owned(), id.device.kind.clone());
    tags.insert("prod_dtype".to_owned(), id.dtypes.prod.clone());
    tags.insert(
        "shadow_precision".to_owned(),
        id.shadow
            .precision
            .clone()
            .unwrap_or_else(|| "none".to_owned()),
    );
    tags.insert(
        "prompt_kind".to_owned(),
        id.prompt.kind.clone().unwrap_or_else(|| "-".to_owned()),
    );
    tags.insert("prompt_len".to_owned(), id.prompt.length.to_string());
    tags.insert("token_hash".to_owned(), id.prompt.token_hash.clone());
    tags.insert(
        "length_bucket".to_owned(),
        length_bucket(id.prompt.length, id.model.index_topk),
    );
    tags.insert("rank".to_owned(), id.parallelism.rank.to_string());
    tags.insert(
        "world_size".to_owned(),
        id.parallelism.world_size.to_string(),
    );
    for (k, v) in &id.tags {
        if let Some(identity) = tags.insert(k.clone(), v.clone())
            && identity != *v
        {
            tags.insert(format!("{MANIFEST_TAG_PREFIX}{k}"), identity);
        }
    }
    tags
}

/// A prompt length relative to the indexer's k: at most k (every query
/// dense), up to 2k (the sparse regime begins), or beyond.
#[must_use]
pub fn length_bucket(length: u64, k: Option<u32>) -> String {
    match k {
        None => "no indexer".to_owned(),
        Some(k) if length <= u64::from(k) => format!("<={k}"),
        Some(k) if length <= 2 * u64::from(k) => format!("{}-{}", k + 1, 2 * k),
        Some(k) => format!(">{}", 2 * k),
    }
}

/// One warning per run id that more than one analysed run carries (a run
/// copied into two directories, say): each copy is analysed, and none is
/// paired with another for determinism.
fn repeated_run_ids(runs: &[RunAnalysis]) -> Vec<String> {
    let mut dirs: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for run in runs {
        dirs.entry(&run.run_id)
            .or_default()
            .push(run.dir.display().to_string());
    }
    dirs.into_iter()
        .filter(|(_, d)| d.len() > 1)
        .map(|(id, d)| {
            format!(
                "run id {id} is held by {} directories ({}): copies of one run, never paired with each other for determinism",
                d.len(),
                d.join(", ")
            )
        })
        .collect()
}

/// Pairs runs that share model, engine, prod dtype, prompt (token hash) and
/// grafts: their prod logits should agree exactly if the engine is
/// deterministic.
/// A run whose producer saw no token ids (empty hash) pairs with nothing.
fn determinism_pairs(runs: &[RunAnalysis]) -> Vec<DeterminismPair> {
    let mut by_identity: BTreeMap<Vec<String>, Vec<&RunAnalysis>> = BTreeMap::new();
    for run in runs {
        if identity_tag(&run.tags, "token_hash").is_none_or(String::is_empty) {
            continue;
        }
        // A graft changes production on purpose: it pairs with runs of the same grafts only.
        let key = [
            "model",
            "engine",
            "prod_dtype",
            "token_hash",
            graft_pair::GRAFT_TAG,
        ]
        .iter()
        .map(|k| identity_tag(&run.tags, k).cloned().unwrap_or_default())
        .collect();
        by_identity.entry(key).or_default().push(run);
    }
    by_identity
        .values()
        .flat_map(|group| group.windows(2))
        // Copies of one run agree by construction: no determinism check.
        .filter(|w| w[0].run_id != w[1].run_id)
        .filter_map(|w| {
            logits::agreement(&w[0].prod_top_n, &w[1].prod_top_n).map(|agreement| DeterminismPair {
                a: w[0].run_id.clone(),
                b: w[1].run_id.clone(),
                agreement,
            })
        })
        .collect()
}
