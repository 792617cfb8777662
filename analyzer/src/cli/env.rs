use std::fmt::Write as _;
use std::io::Write;
use std::process::ExitCode;

use shadowtrace_schemas::env::{env_vars, resolve, unknown_names};

use super::Format;

#[derive(Debug, clap::Args)]
pub(crate) struct EnvArgs {
    /// text for people, json (name to value, defaults applied) for scripts.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

pub(crate) fn run(args: &EnvArgs) -> anyhow::Result<ExitCode> {
    let names: Vec<String> = std::env::vars_os()
        .map(|(name, _)| name.to_string_lossy().into_owned())
        .collect();
    for unknown in unknown_names(names.iter().map(String::as_str)) {
        eprintln!("warning: {unknown}");
    }
    let values = resolve(|name| std::env::var(name).ok())?;
    let text = match args.format {
        Format::Json => serde_json::to_string_pretty(&values)? + "\n",
        Format::Text => {
            let mut out = String::new();
            let width = env_vars().iter().map(|v| v.name.len()).max().unwrap_or(0);
            for var in env_vars() {
                let set = std::env::var(&var.name).is_ok();
                let value = values
                    .get(&var.name)
                    .map(ToString::to_string)
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "{:<width$}  {value}{}",
                    var.name,
                    if set { "" } else { "  (default)" }
                );
                let _ = writeln!(out, "{:<width$}  {}", "", var.doc);
            }
            out
        }
    };
    std::io::stdout().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
