use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use shadowtrace_analyzer::capture_check;
use shadowtrace_analyzer::metrics::topk_check;
use shadowtrace_analyzer::{Dataset, Run, inspect};
use shadowtrace_schemas::Table;

use super::{Format, exit_error};

#[derive(Debug, clap::Args)]
pub(crate) struct InspectArgs {
    /// Run directories, or directories holding runs.
    #[arg(required = true, value_name = "RUN_DIR")]
    paths: Vec<PathBuf>,
    /// text for people, json for scripts.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

pub(crate) fn run(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let show_progress = std::io::stderr().is_terminal();
    let mut dataset = Dataset::load(&args.paths, false, |done, total| {
        if show_progress && total > 1 {
            eprint!("\rchecking runs {done}/{total}");
            if done == total {
                eprintln!();
            }
        }
    })?;
    // A v2 run's top-k summaries must agree with their lists: the analyzer
    // reads only the summaries.
    for run in &mut dataset.runs {
        run.problems.extend(topk_check::problem(run)?);
        // A capture self-check that cannot be read is a broken run, not "no check".
        run.problems.extend(capture_check::problem(run));
    }
    let mut stdout = std::io::stdout().lock();
    match args.format {
        Format::Text => {
            for (i, run) in dataset.runs.iter().enumerate() {
                if i > 0 {
                    writeln!(stdout)?;
                }
                stdout.write_all(inspect::render_run(run).as_bytes())?;
            }
        }
        Format::Json => {
            let runs: Vec<serde_json::Value> = dataset.runs.iter().map(run_json).collect();
            let errors: Vec<serde_json::Value> = dataset
                .skipped
                .iter()
                .map(|e| serde_json::json!({"path": e.path(), "error": e.to_string()}))
                .collect();
            let doc = serde_json::json!({"runs": runs, "errors": errors});
            writeln!(stdout, "{}", serde_json::to_string_pretty(&doc)?)?;
        }
    }
    for error in &dataset.skipped {
        eprintln!("error: {error}");
    }
    let problems: Vec<_> = dataset.runs.iter().flat_map(|r| &r.problems).collect();
    for problem in &problems {
        eprintln!("error: {problem}");
    }
    Ok(if dataset.skipped.is_empty() && problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        exit_error()
    })
}

fn run_json(run: &Run) -> serde_json::Value {
    let files: serde_json::Map<String, serde_json::Value> = Table::ALL
        .iter()
        .map(|t| {
            let parts: Vec<serde_json::Value> = run
                .files
                .get(t)
                .into_iter()
                .flatten()
                .map(|p| serde_json::json!({"path": p.path, "rows": p.rows, "bytes": p.bytes}))
                .collect();
            (t.name().to_owned(), parts.into())
        })
        .collect();
    let problems: Vec<String> = run.problems.iter().map(ToString::to_string).collect();
    serde_json::json!({
        "dir": run.dir,
        "manifest": run.manifest,
        "files": files,
        "notes": run.notes,
        "problems": problems,
    })
}
