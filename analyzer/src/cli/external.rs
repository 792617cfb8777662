//! `shadowtrace NAME ...` for commands other programs provide, cargo-style:
//! the tracer's binaries need libtorch, and this one must run without it.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::CommandFactory;

/// The tracer's commands, each the program `shadowtrace-NAME`, with what it
/// does: listed in the help and in the answer to an unknown command.
const TRACER_COMMANDS: [(&str, &str); 4] = [
    (
        "demo",
        "Trace a grid of prompts through two small trained DSA models, analyse it, report",
    ),
    (
        "run",
        "The reference engine on a checkpoint, traced or not, with --fault and --deviation",
    ),
    (
        "bisect",
        "Which layers' shadow value, grafted into production, restores its output",
    ),
    (
        "suspects",
        "The clean production path and every deviation side by side, ranked",
    ),
];

/// The help's closing section: the tracer's commands.
pub(crate) fn commands_help() -> String {
    let mut text = String::from(
        "Commands of the tracer (programs named shadowtrace-NAME beside this one or on PATH; \
         they need libtorch):\n",
    );
    for (name, what) in TRACER_COMMANDS {
        let _ = writeln!(text, "  {name:<10}{what}");
    }
    text
}

/// Every command there is: this program's own, then the tracer's.
fn all_commands() -> String {
    let own: Vec<String> = super::Args::command()
        .get_subcommands()
        .map(|c| c.get_name().to_owned())
        .filter(|name| name != "help")
        .collect();
    let tracer: Vec<&str> = TRACER_COMMANDS.iter().map(|(name, _)| *name).collect();
    format!("{}; the tracer's: {}", own.join(", "), tracer.join(", "))
}

pub(crate) fn run(argv: &[OsString]) -> anyhow::Result<ExitCode> {
    let Some((name, rest)) = argv.split_first() else {
        bail!("no command given; see `shadowtrace --help`");
    };
    let program = format!("shadowtrace-{}", name.to_string_lossy());
    let Some(path) = find(&program) else {
        bail!(
            "unknown command {:?}: no program {program} next to this one or on PATH \
             (commands: {})",
            name.to_string_lossy(),
            all_commands()
        );
    };
    let status = std::process::Command::new(&path)
        .args(rest)
        .status()
        .with_context(|| format!("running {}", path.display()))?;
    Ok(status
        .code()
        .and_then(|c| u8::try_from(c).ok())
        .map_or(super::exit_error(), ExitCode::from))
}

fn find(program: &str) -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(program)));
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(program));
    beside
        .into_iter()
        .chain(on_path)
        .find(|candidate| candidate.is_file())
}
