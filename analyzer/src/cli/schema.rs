use std::io::Write;
use std::process::ExitCode;

use shadowtrace_analyzer::schema_doc;

use super::Format;

#[derive(Debug, clap::Args)]
pub(crate) struct SchemaArgs {
    /// text for people, json for tools (the exact definitions the writers use).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

pub(crate) fn run(args: &SchemaArgs) -> anyhow::Result<ExitCode> {
    let text = match args.format {
        Format::Text => schema_doc::render_text(),
        Format::Json => schema_doc::render_json()? + "\n",
    };
    std::io::stdout().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
