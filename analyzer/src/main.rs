//! `shadowtrace`: the command line. Thin: parse, dispatch, map to exit codes.

#![allow(
    clippy::print_stderr,
    reason = "a command line reports progress and errors on its terminal"
)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc keeps freed pages for the next allocation. glibc handed the
/// summary check's decode buffers back to the kernel and faulted them in
/// again: a third of `analyze`'s time on a v2 run went to page faults
/// (docs/benchmarks.md, analyze throughput).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
            eprintln!("error: {}", shadowtrace_schemas::error_line(&*error));
            cli::exit_error()
        }
    }
}
