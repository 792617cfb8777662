use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::ValueEnum;
use shadowtrace_analyzer::judged::{Question, why_not_judged};
use shadowtrace_analyzer::metrics::check_memo;
use shadowtrace_analyzer::report::{render_terminal, sizes_line, write_report};
use shadowtrace_analyzer::verdict::{
    DEFAULT_BASELINE_FACTOR, DEFAULT_HIDDEN_REL_ERR, DEFAULT_TOPK_JACCARD, Thresholds,
};
use shadowtrace_analyzer::{Analysis, Options, analyze};

use super::{Format, exit_error};

#[derive(Debug, clap::Args)]
pub(crate) struct AnalyzeArgs {
    /// Run directories, or directories holding runs.
    #[arg(required = true, value_name = "DIR")]
    paths: Vec<PathBuf>,
    /// Healthy runs to calibrate against: per layer, the worst error they
    /// show becomes the noise floor, and a verdict needs --baseline-factor
    /// times it. Matched to runs by model. Repeatable.
    #[arg(long, value_name = "DIR")]
    baseline: Vec<PathBuf>,
    /// Multiple of the baseline noise floor that marks divergence.
    #[arg(long, default_value_t = DEFAULT_BASELINE_FACTOR, value_name = "X")]
    baseline_factor: f64,
    /// p95 relative L2 error (over tokens) above which a layer's hidden
    /// state has diverged, without a baseline.
    #[arg(long, default_value_t = DEFAULT_HIDDEN_REL_ERR, value_name = "ERR")]
    hidden_threshold: f64,
    /// Capture site whose hidden-state error decides.
    #[arg(long, default_value = "layer_out", value_name = "SITE")]
    hidden_site: String,
    /// Shadow mode whose error decides [default: local where recorded, else free].
    #[arg(long, value_parser = ["local", "free"], value_name = "MODE")]
    shadow_mode: Option<String>,
    /// Mean churn-free top-k Jaccard below which a layer's selection has
    /// diverged, without a baseline.
    #[arg(long, default_value_t = DEFAULT_TOPK_JACCARD, value_name = "J")]
    topk_threshold: f64,
    /// The boundary-churn band, relative to each row's score scale (the mean
    /// |score| of the reference path's top-k), as SHADOWTRACE_BOUNDARY_BAND
    /// and `suspects --churn-band` [default: each run's recorded band].
    ///
    /// It can narrow the band, or widen it as far as the run's boundary
    /// lists reach (settings.boundary_stored: twice the band by default);
    /// wider is refused. Runs recorded with an
    /// absolute band (no settings.boundary_band_scale) read it as a score
    /// distance. A row without boundary lists has no churn any band can
    /// find: such rows are counted as churn unknown beside the verdict,
    /// every difference there counting.
    #[arg(long, value_name = "BAND")]
    churn_band: Option<f32>,
    /// Tags to group the grid by, comma-separated (manifest identity names
    /// such as model, engine, prompt_kind, length_bucket, or user tags).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "model,prompt_kind,length_bucket",
        value_name = "TAGS"
    )]
    group_by: Vec<String>,
    /// Write report.md, analysis.json, plots (SVG line charts, a PNG heatmap
    /// per run) and metrics/*.parquet
    /// into this directory.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// text for people, json for scripts.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Exit with status 1 when a run has this verdict. Repeatable. A run
    /// whose capture is inconsistent (the adapter's self-check found
    /// recorded selections that production's own scores contradict) fails
    /// whichever verdict is asked for. When no
    /// run has it but a run's verdict is not judged (its data is not whole:
    /// a capture disabled, rows dropped or lost, the run incomplete, ...),
    /// or no run could be judged at all, exit with status 2: no verdict from
    /// missing data is not a pass.
    #[arg(long, value_enum, value_name = "VERDICT")]
    fail_on: Vec<FailOn>,
    /// With --fail-on: accept runs whose verdicts are not judged (each is
    /// still reported as not judged, and a verdict found in the partial data
    /// still fails). Exit with status 2 only when no run could be judged.
    #[arg(long, requires = "fail_on")]
    allow_partial: bool,
    /// Fail on the first unreadable run, or run whose files contradict its
    /// manifest, instead of reporting and skipping it (or noting it).
    #[arg(long)]
    strict: bool,
    /// Where the top-k summary check (every row's counts against its lists)
    /// is remembered per part file, so a part unchanged since it was checked
    /// (path, size, modification time and Parquet footer) is not decoded
    /// again [default: $XDG_CACHE_HOME/shadowtrace/topk-checks, else
    /// ~/.cache/shadowtrace/topk-checks]. How many parts were remembered is
    /// printed; `inspect` always checks every part.
    #[arg(long, value_name = "DIR")]
    check_memo: Option<PathBuf>,
    /// Check every top-k part's summary again, whatever the memo holds (and
    /// leave the memo as it is).
    #[arg(long, conflicts_with = "check_memo")]
    recheck: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FailOn {
    /// Any verdict below.
    Any,
    /// A convention the engine ran differently from the model.
    Convention,
    /// A non-finite onset in prod, or a failed sentinel check.
    Nonfinite,
    /// A hidden-state divergence.
    Hidden,
    /// A top-k selection divergence.
    Topk,
    /// A prefix-cache hit that parts from a miss of the same prompt, or
    /// whose first token differs from the miss's.
    Cache,
}

pub(crate) fn run(args: &AnalyzeArgs) -> anyhow::Result<ExitCode> {
    for (name, value, lo, hi) in [
        ("--topk-threshold", args.topk_threshold, 0.0, 1.0),
        (
            "--hidden-threshold",
            args.hidden_threshold,
            0.0,
            f64::INFINITY,
        ),
        (
            "--baseline-factor",
            args.baseline_factor,
            1.0,
            f64::INFINITY,
        ),
    ] {
        anyhow::ensure!(
            value >= lo && value <= hi && !value.is_nan(),
            "{name}: expected a value in [{lo}, {hi}], got {value}"
        );
    }
    let options = Options {
        thresholds: Thresholds {
            hidden_rel_err: args.hidden_threshold,
            hidden_site: args.hidden_site.clone(),
            hidden_mode: args.shadow_mode.clone(),
            topk_jaccard: args.topk_threshold,
            churn_band: args.churn_band,
            baseline_factor: args.baseline_factor,
        },
        group_by: args.group_by.clone(),
        strict: args.strict,
        check_memo: if args.recheck {
            None
        } else {
            args.check_memo.clone().or_else(check_memo::default_dir)
        },
    };
    let show_progress = std::io::stderr().is_terminal();
    let analysis = analyze(
        &args.paths,
        &args.baseline,
        &options,
        |what, done, total| {
            if show_progress {
                eprint!("\r{what} {done}/{total}   ");
                if done == total {
                    eprintln!();
                }
            }
        },
    )?;
    let mut stdout = std::io::stdout().lock();
    match args.format {
        Format::Text => stdout.write_all(render_terminal(&analysis).as_bytes())?,
        Format::Json => writeln!(stdout, "{}", serde_json::to_string_pretty(&analysis)?)?,
    }
    if let Some(dir) = &args.report {
        let files = write_report(dir, &analysis)?;
        eprintln!(
            "report: {} ({} files; {})",
            dir.join(shadowtrace_analyzer::report::REPORT_FILE)
                .display(),
            files.len(),
            sizes_line(&files)
        );
    }
    for s in &analysis.skipped {
        eprintln!("warning: skipped {s}");
    }
    if let Some(line) = remembered_line(&analysis, options.check_memo.as_deref()) {
        eprintln!("{line}");
    }
    if fails(&analysis, &args.fail_on) {
        return Ok(ExitCode::from(1));
    }
    let lines = not_judged_lines(&analysis, &args.fail_on);
    let none_judged = !args.fail_on.is_empty() && !analysis.runs.iter().any(|r| r.can_be_judged());
    if none_judged || !args.allow_partial {
        for line in &lines {
            eprintln!("error: --fail-on: {line}");
        }
    }
    if none_judged {
        eprintln!(
            "error: --fail-on: no run could be judged: {}",
            unjudged(&analysis)
        );
        return Ok(exit_error());
    }
    if !args.allow_partial && !lines.is_empty() {
        eprintln!(
            "error: --fail-on: {} verdict{} not judged: data missing is not a pass (--allow-partial accepts it)",
            lines.len(),
            if lines.len() == 1 { "" } else { "s" }
        );
        return Ok(exit_error());
    }
    Ok(ExitCode::SUCCESS)
}

/// The questions a `--fail-on` verdict answers: the ones whose "not
/// judged" it cannot pass.
fn questions(f: FailOn) -> &'static [Question] {
    match f {
        FailOn::Any => &[
            Question::Convention,
            Question::Nonfinite,
            Question::Hidden,
            Question::Topk,
        ],
        FailOn::Convention => &[Question::Convention],
        FailOn::Nonfinite => &[Question::Nonfinite],
        FailOn::Hidden => &[Question::Hidden],
        FailOn::Topk => &[Question::Topk],
        // From paired runs' own verdicts.
        FailOn::Cache => &[],
    }
}

/// One line saying how many top-k parts took their summary check from the
/// memo, where any did: a result not decoded in this call is never silent.
fn remembered_line(a: &Analysis, memo: Option<&Path>) -> Option<String> {
    let (mut parts, mut remembered) = (0, 0);
    for check in a.runs.iter().filter_map(|r| r.topk_summary_check.as_ref()) {
        parts += check.parts;
        remembered += check.parts_remembered;
    }
    (remembered > 0).then(|| {
        format!(
            "top-k summary check: {remembered} of {parts} parts remembered from an earlier check of the same bytes ({}; --recheck checks them again)",
            memo.map_or_else(String::new, |m| m.display().to_string())
        )
    })
}

/// One line per run and question asked for by `fail_on` whose verdict is
/// not judged: `run r1: top-k divergence not judged: <why>`.
fn not_judged_lines(a: &Analysis, fail_on: &[FailOn]) -> Vec<String> {
    let mut asked: Vec<Question> = fail_on
        .iter()
        .flat_map(|&f| questions(f).to_vec())
        .collect();
    // A capture the adapter may have misread fails whatever is asked for
    // (`fails`): one whose self-check cannot be read is not judged for any.
    if !fail_on.is_empty() {
        asked.push(Question::Capture);
    }
    asked.sort_unstable();
    asked.dedup();
    a.runs
        .iter()
        .flat_map(|run| {
            asked.iter().filter_map(move |&q| {
                why_not_judged(&run.not_measured, q)
                    .map(|why| format!("run {}: {} not judged: {why}", run.run_id, q.name()))
            })
        })
        .collect()
}

/// Why no run could be judged, counted: `1 unreadable, 2 incomplete, ...`.
fn unjudged(a: &Analysis) -> String {
    let unreadable = a
        .skipped
        .iter()
        .filter(|s| !s.starts_with("baseline "))
        .count();
    let incomplete = a.runs.iter().filter(|r| !r.complete).count();
    let unmeasured = a
        .runs
        .iter()
        .filter(|r| r.complete && !r.can_be_judged())
        .count();
    let parts: Vec<String> = [
        (unreadable, "unreadable"),
        (incomplete, "incomplete"),
        (unmeasured, "with data not measured"),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    if parts.is_empty() {
        "no runs".to_owned()
    } else {
        parts.join(", ")
    }
}

fn fails(a: &Analysis, fail_on: &[FailOn]) -> bool {
    let cache = a.cache.as_ref().is_some_and(|c| c.any_parted());
    // A capture the adapter misread fails whatever verdict was asked for: no
    // verdict of that run can be trusted to mean what it says.
    if !fail_on.is_empty() && a.runs.iter().any(|r| r.capture_inconsistent()) {
        return true;
    }
    fail_on.iter().any(|f| match f {
        FailOn::Cache => cache,
        FailOn::Any => cache || a.runs.iter().any(|r| r.has_verdict()),
        FailOn::Convention => a.runs.iter().any(|r| !r.convention_mismatches.is_empty()),
        FailOn::Nonfinite => a
            .runs
            .iter()
            .any(|r| r.onset.is_some() || !r.failed_sentinels.is_empty()),
        FailOn::Hidden => a.runs.iter().any(|r| r.hidden_verdict.is_some()),
        FailOn::Topk => a.runs.iter().any(|r| r.topk_verdict.is_some()),
    })
}
