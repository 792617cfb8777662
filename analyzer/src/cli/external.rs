//! `shadowtrace NAME ...` for commands other programs provide, cargo-style:
//! the tracer's binaries need libtorch, and this one must run without it.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};

pub(crate) fn run(argv: &[OsString]) -> anyhow::Result<ExitCode> {
    let Some((name, rest)) = argv.split_first() else {
        bail!("no command given; see `shadowtrace --help`");
    };
    let program = format!("shadowtrace-{}", name.to_string_lossy());
    let Some(path) = find(&program) else {
        bail!(
            "unknown command {:?}: no program {program} next to this one or on PATH \
             (built-in commands: schema, inspect; the tracer provides demo)",
            name.to_string_lossy()
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
