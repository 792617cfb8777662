//! `shadowtrace bisect`: which layers' shadow value, grafted into the reference engine's
//! production at one site, restores its output (issue 30).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command line reports on its terminal"
)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use shadowtrace_tracer::bisect::{
    Bisection, Metric, OutputMetrics, Setup, Target, bisect, max_forwards,
};
use shadowtrace_tracer::model::Model;
use shadowtrace_tracer::model::glm5_next::is_glm5_next;
use shadowtrace_tracer::model::graft::GraftSite;
use shadowtrace_tracer::progress;
use shadowtrace_tracer::suspects::prompts::read_prompt;
use shadowtrace_tracer::trace::TraceOptions;
use shadowtrace_tracer::trace::production_args::{Prod, ProductionArgs};
use tch::{Device, Kind};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum MetricArg {
    /// Argmax agreement with the reference (the tokens greedy decoding emits).
    Argmax,
    /// Mean Jensen-Shannon divergence from the reference, in bits (the whole distribution).
    Js,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Precision {
    Fp32,
    Bf16,
}

/// Find the layers whose shadow value, grafted into production, restores its output.
///
/// Production is the reference engine's on one prompt, untraced, with what --prod,
/// --fp8-indexer, --deviation and --fault plant in it. Its logits at --rows are judged by
/// --metric against the reference: the shadow's own chain from the embeddings in
/// --precision.
///
/// For each site of --sites the search grafts every layer first (production takes the local
/// shadow's value there, as `shadowtrace run --graft`), then binary-searches the smallest
/// contiguous range that meets the target: at most 1 + 2 ceil(log2 L) grafted forwards per
/// site. It assumes grafting more layers never undoes a restoration; the range it reports is
/// one whose own forward met the target.
///
/// The target is printed first: --threshold, or the clean noise floor (production with
/// nothing planted) less --slack. With nothing planted there is no clean floor: give
/// --threshold. The answer, in one line, is the smallest restoring range, ties going to the
/// narrowest site (indexer, then attn_out or mlp_out, then layer_out).
///
/// Exit codes: 0 the bisection ran (whatever it found), 2 bad input or error.
#[derive(Parser, Debug)]
#[command(name = "shadowtrace bisect", bin_name = "shadowtrace bisect", version)]
struct Args {
    /// Model directory: config.json and *.safetensors (GLM-5 or DeepSeek-V3.2 layers).
    #[arg(long)]
    model: PathBuf,
    /// Prompt file: a JSON list of token ids, or text read as byte-level ids.
    prompt: PathBuf,
    #[command(flatten)]
    production: ProductionArgs,
    /// Sites searched, comma-separated, among indexer, attn_out, mlp_out, layer_out.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "indexer,attn_out,mlp_out,layer_out"
    )]
    sites: Vec<String>,
    /// What "restored" measures.
    #[arg(long, value_enum, default_value = "argmax")]
    metric: MetricArg,
    /// Restored at this argmax agreement or more (argmax), or this JS divergence or less (js).
    /// Default: the clean noise floor with --slack.
    #[arg(long)]
    threshold: Option<f64>,
    /// The clean floor's slack [default: 0.01 for argmax, 0.5 for js].
    ///
    /// Argmax: subtracted from the floor's agreement. JS: the floor's divergence is multiplied
    /// by (1 + slack).
    #[arg(long)]
    slack: Option<f64>,
    /// The token rows whose logits are compared: all, last:N or every:N.
    ///
    /// last:N compares the last N rows: past the indexer's top-k on a long prompt, the rows
    /// whose queries choose.
    #[arg(long, default_value = "all", value_parser = parse_rows)]
    rows: serde_json::Value,
    /// The shadow's precision: of the reference chain and of every grafted value.
    #[arg(long, value_enum, default_value = "fp32")]
    precision: Precision,
    /// Also write the whole bisection (target, every step) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    shadowtrace_tracer::host_memory::keep_freed_memory();
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", shadowtrace_schemas::error_line(&*error));
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let config = std::fs::read(args.model.join("config.json")).unwrap_or_default();
    if is_glm5_next(&config) {
        bail!("bisect: grafts are not implemented for glm5_next (GLM-5.3-Flash)");
    }
    let sites = args
        .sites
        .iter()
        .map(|s| {
            GraftSite::named(s).with_context(|| {
                format!("--sites {s}: expected indexer, attn_out, mlp_out or layer_out")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let metric = match args.metric {
        MetricArg::Argmax => Metric::Argmax,
        MetricArg::Js => Metric::Js,
    };
    let device = Device::cuda_if_available();
    let model = Model::open(&args.model, device)?;
    let mut opts = TraceOptions::new("bisect");
    opts.precision = match args.precision {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
    };
    opts.tokens_setting = args.rows.clone();
    args.production.apply(&model, &mut opts)?;
    let ids = read_prompt(&args.prompt, model.config.vocab_size)?;
    let prompt = args.prompt.display().to_string();
    args.production
        .check_prompt(&model, &opts, ids.len(), &prompt)?;
    let planted = planted(&opts);
    if planted.is_empty() && args.threshold.is_none() {
        bail!(
            "nothing is planted (no --deviation, no --fault), so there is no clean noise floor \
             to restore to: give --threshold"
        );
    }
    let layers = model.config.num_hidden_layers;
    println!(
        "bisect {} on {prompt}: {} tokens, {layers} layers on {device:?}; production {}, FP8 \
         indexer {}; planted: {}; reference: the {} chain",
        args.model.display(),
        ids.len(),
        match args.production.prod {
            Prod::Fp8 => "fp8",
            Prod::Fp8Checkpoint => "fp8-checkpoint",
        },
        opts.fp8_indexer_name,
        if planted.is_empty() {
            "nothing".to_owned()
        } else {
            planted.join(", ")
        },
        precision_name(opts.precision),
    );
    // The clean floor's own forward only where it sets the target.
    let setup_forwards = if planted.is_empty() || args.threshold.is_some() {
        2
    } else {
        3
    };
    let mut bar = progress::bar(setup_forwards, "bisect: set up");
    bar.set_message("production, the reference and the clean floor".to_owned());
    let started = Instant::now();
    let setup = tch::no_grad(|| Setup::new(&model, &ids, &opts, args.threshold.is_none()))?;
    let setup_s = started.elapsed().as_secs_f64();
    bar.inc(setup_forwards);
    bar.finish_and_clear();
    let target = match (args.threshold, &setup.clean) {
        (Some(t), _) => Target::given(metric, t),
        (None, Some(clean)) => {
            let slack = args.slack.unwrap_or(match metric {
                Metric::Argmax => 0.01,
                Metric::Js => 0.5,
            });
            Target::clean(metric, clean, slack)
        }
        (None, None) => unreachable!("refused above: nothing planted and no threshold"),
    };
    println!("target: {target}");
    println!(
        "production ungrafted ({} of its {} rows compared, --rows {}): {}",
        setup.chains.rows(),
        ids.len(),
        rows_text(&args.rows),
        metrics_text(&setup.before)
    );
    let mut bar = progress::bar(max_forwards(layers, sites.len()), "bisect");
    let searched = Instant::now();
    let mut forwards = 0_u64;
    let bisection = tch::no_grad(|| {
        bisect(&setup, target, &sites, |step| {
            forwards += 1;
            bar.set_message(format!(
                "{} {}",
                step.graft,
                if step.restored {
                    "restores"
                } else {
                    "does not"
                }
            ));
            bar.inc(1);
        })
    })?;
    let search_s = searched.elapsed().as_secs_f64();
    bar.finish_and_clear();
    print_table(&bisection);
    println!("{}", bisection.summary());
    println!(
        "forwards: {setup_forwards} to set up ({:.2} s each), {forwards} grafted ({} each)",
        setup_s / setup_forwards as f64,
        if forwards == 0 {
            "none run".to_owned()
        } else {
            format!("{:.2} s", search_s / forwards as f64)
        }
    );
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&bisection)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `--rows`: all, last:N or every:N, as the token sampling of the environment spells it.
fn parse_rows(text: &str) -> Result<serde_json::Value, String> {
    if text == "all" {
        return Ok(serde_json::json!({"kind": "all"}));
    }
    let bad = || format!("{text:?}: expected all, last:N or every:N with N >= 1");
    let (kind, n) = text.split_once(':').ok_or_else(bad)?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: i64 = n.parse().map_err(|_| bad())?;
    if n < 1 || !matches!(kind, "last" | "every") {
        return Err(bad());
    }
    Ok(serde_json::json!({"kind": kind, "n": n}))
}

/// What is planted in production, as the command line spells it.
fn planted(opts: &TraceOptions) -> Vec<String> {
    let deviations = opts.deviations.iter().map(ToString::to_string);
    let faults = opts
        .faults
        .iter()
        .map(|f| serde_json::to_string(f).unwrap_or_else(|_| format!("{f:?}")));
    deviations.chain(faults).collect()
}

fn rows_text(rows: &serde_json::Value) -> String {
    match (rows["kind"].as_str(), rows["n"].as_i64()) {
        (Some(kind), Some(n)) => format!("{kind}:{n}"),
        _ => "all".to_owned(),
    }
}

fn precision_name(kind: Kind) -> &'static str {
    if kind == Kind::BFloat16 {
        "bf16"
    } else {
        "fp32"
    }
}

fn metrics_text(m: &OutputMetrics) -> String {
    format!(
        "argmax agreement {:.3}, JS divergence {:.2e} bits, {} non-finite rows of {}",
        m.argmax_agreement, m.js_bits, m.nonfinite_rows, m.rows
    )
}

fn print_table(b: &Bisection) {
    if b.sites.is_empty() {
        return;
    }
    println!(
        "{:<10} {:<16} {:>9} {:>10} {:>9}",
        "site", "restoring layers", "argmax", "JS (bits)", "forwards"
    );
    for s in &b.sites {
        let layers = match s.layers {
            Some((a, c)) if a == c => format!("{a}"),
            Some((a, c)) => format!("{a}-{c}"),
            None => "none".to_owned(),
        };
        println!(
            "{:<10} {:<16} {:>9.3} {:>10.2e} {:>9}",
            s.site,
            layers,
            s.after.argmax_agreement,
            s.after.js_bits,
            s.steps.len()
        );
    }
    if b.sites.iter().any(|s| s.layers.is_none()) {
        println!("(none: no range restores; its figures are those of grafting every layer)");
    }
}
