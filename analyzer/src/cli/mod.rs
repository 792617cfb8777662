//! Arguments and dispatch. One file per subcommand.

mod analyze;
mod env;
mod export;
mod external;
mod inspect;
mod schema;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// Exit code for bad input or a failed command.
pub(crate) fn exit_error() -> ExitCode {
    ExitCode::from(2)
}

/// Layer-wise shadow-precision tracing for LLM inference numerics.
///
/// Runs are written by shadowtrace's producers: the Python hooks inside an
/// engine's process (SHADOWTRACE=1), and the reference engine (`shadowtrace
/// run`, `shadowtrace demo`). This program reads them, without libtorch.
///
/// Exit codes: 0 success, 1 a verdict `analyze --fail-on` names, 2 bad input
/// or error (`inspect`: a bad run; `analyze`: no run could be read;
/// `analyze --fail-on`: a verdict not judged, or no run that could be judged).
#[derive(Debug, Parser)]
#[command(
    name = "shadowtrace",
    version,
    propagate_version = true,
    after_help = external::commands_help()
)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the trace format: vocabulary, tables, columns, types, encodings.
    Schema(schema::SchemaArgs),
    /// Print a run's identity, tables, row counts and status.
    ///
    /// Accepts run directories or directories of runs. Every part file is
    /// checked (Parquet footer, format version, columns and types), and each
    /// table's manifest row count against the rows its listed files hold; a
    /// bad run is reported with the file and the problem (exit 2).
    Inspect(inspect::InspectArgs),
    /// Compute metrics and verdicts over runs: top-k overlap, hidden-state
    /// error, logits agreement, non-finite onset, first-divergence layers,
    /// grouped into a grid.
    ///
    /// Every verdict is printed with the rule and threshold that produced
    /// it. Exit codes: 0 success, 1 a verdict named by --fail-on (one line
    /// per failing run names it), 2 error, no run that could be read, or
    /// under --fail-on a verdict not judged or no run that could be judged
    /// (every run incomplete, or with hook errors).
    Analyze(Box<analyze::AnalyzeArgs>),
    /// Print the SHADOWTRACE_* environment variables: values here, defaults,
    /// meaning.
    ///
    /// A value that does not read is an error naming it; a SHADOWTRACE_*
    /// name that is no variable is warned about, with the closest one.
    Env(env::EnvArgs),
    /// Write a run's full top-k index lists as Parquet.
    ///
    /// Every row the run holds enough to rebuild (`--lists`); says how many
    /// rows it does not.
    Export(export::ExportArgs),
    /// Any other command NAME runs the program `shadowtrace-NAME` from this
    /// program's directory or PATH (the tracer's demo, run, bisect, suspects).
    #[command(external_subcommand)]
    External(Vec<OsString>),
}

/// Output format of commands that print data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Format {
    /// Aligned text for a terminal.
    Text,
    /// JSON for scripts.
    Json,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Schema(a) => schema::run(&a),
        Command::Inspect(a) => inspect::run(&a),
        Command::Analyze(a) => analyze::run(&a),
        Command::Env(a) => env::run(&a),
        Command::Export(a) => export::run(&a),
        Command::External(argv) => external::run(&argv),
    }
}
