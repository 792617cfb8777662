use std::path::PathBuf;
use std::process::ExitCode;

use shadowtrace_analyzer::{Run, export};

#[derive(Debug, clap::Args)]
pub(crate) struct ExportArgs {
    /// Write the full prod and shadow index lists of every top-k row that
    /// can be rebuilt.
    ///
    /// Absolute keys, in columns prod_indices and shadow_indices: every row
    /// of a v1 run; the rows of a v2 run whose full prod list
    /// SHADOWTRACE_TOPK_LISTS sampled. Prints how many rows could not be
    /// rebuilt.
    #[arg(long, required = true)]
    lists: bool,
    /// The run directory.
    #[arg(value_name = "RUN_DIR")]
    run: PathBuf,
    /// Directory for the Parquet files (created); default `<run_id>-lists`
    /// in the current directory.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub(crate) fn run(args: &ExportArgs) -> anyhow::Result<ExitCode> {
    let run = Run::open(&args.run)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}-lists", run.manifest.run_id())));
    let export = export::export_lists(&run, &out)?;
    println!("{}", export.text(&out));
    Ok(ExitCode::SUCCESS)
}
