use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::ValueEnum;
use shadowtrace_analyzer::metrics::check_memo;
use shadowtrace_analyzer::report::{
    TABLE_COLUMNS, render_summary, render_terminal_at, sizes_line, write_report,
};
use shadowtrace_analyzer::verdict::{
    DEFAULT_BASELINE_FACTOR, DEFAULT_HIDDEN_REL_ERR, DEFAULT_TOPK_JACCARD, Thresholds,
};
use shadowtrace_analyzer::{Analysis, Options, analyze, fail_on};

use super::Format;

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
    /// Capture site whose hidden-state error decides (a site of the
    /// format's vocabulary; `shadowtrace schema` lists them).
    #[arg(long, default_value = "layer_out", value_name = "SITE", value_parser = hidden_site)]
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
    /// Print one line per run instead of the tables: `RUN FAIL <verdicts>`,
    /// `RUN PASS`, or `RUN NOT JUDGED (<why>)`, then the skipped runs.
    #[arg(long, conflicts_with = "format")]
    summary: bool,
    /// Print every column of the grid and layer tables. Without it a table
    /// wider than 100 columns leaves out its least needed columns, and a
    /// line after it names them.
    #[arg(long)]
    wide: bool,
    /// Exit with status 1 when a run has this verdict, with one line per
    /// such run: `FAIL (--fail-on any): RUN topk@L1 (J 0.749 < 0.8);
    /// nonfinite@L2 mlp_out t2500`. Repeatable. A run
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

/// `--hidden-site`: a hidden-state site of the vocabulary. A typo would
/// otherwise find no capture, and the verdict would have nothing to judge.
fn hidden_site(s: &str) -> Result<String, String> {
    let sites: Vec<&str> = shadowtrace_schemas::vocabulary()
        .sites
        .iter()
        .map(|site| site.name.as_str())
        // The indexer's rows are top-k selections, the logits' top-N lists:
        // neither is a hidden state.
        .filter(|name| !matches!(*name, "indexer" | "logits"))
        .collect();
    if sites.contains(&s) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "unknown hidden-state site {s:?}: expected one of {}",
            sites.join(", ")
        ))
    }
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
        Format::Text if args.summary => {
            stdout.write_all(render_summary(&analysis).as_bytes())?;
        }
        Format::Text => {
            let fit = (!args.wide).then_some(TABLE_COLUMNS);
            stdout.write_all(render_terminal_at(&analysis, fit).as_bytes())?;
        }
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
    for w in &analysis.warnings {
        eprintln!("warning: {w}");
    }
    if let Some(line) = remembered_line(&analysis, options.check_memo.as_deref()) {
        eprintln!("{line}");
    }
    let names: Vec<String> = args
        .fail_on
        .iter()
        .filter_map(|f| f.to_possible_value().map(|v| v.get_name().to_owned()))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let asked = fail_on::FailOn::parse(&names, args.allow_partial).map_err(anyhow::Error::msg)?;
    let exit = fail_on::exit(&analysis, &asked);
    for line in &exit.lines {
        eprintln!("{line}");
    }
    Ok(ExitCode::from(exit.code))
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
