//! `shadowtrace`: the command line. Thin: parse, dispatch, map to exit codes.

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Args::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(error) => {
            // A closed pipe (`shadowtrace schema | head`) is not a failure.
            if error.chain().any(|e| {
                e.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {error:#}");
            cli::exit_error()
        }
    }
}
