//! `shadowtrace schema`: the trace format as a person reads it, or as the
//! JSON definitions other tools consume.

use std::fmt::Write;

use shadowtrace_schemas::{MANIFEST_JSON_SCHEMA, SCHEMA_VERSION, Table, vocabulary};

/// The format as text: vocabulary, then each table's columns.
#[must_use]
pub fn render_text() -> String {
    let v = vocabulary();
    let mut out = String::new();
    let _ = writeln!(out, "shadowtrace trace format v{SCHEMA_VERSION}");
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "A run is a directory: manifest.json plus <table>/part-NNNNN.parquet files."
    );
    let _ = writeln!(
        out,
        "Files still being written end in .tmp and are not data."
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "paths         {}", v.paths.join(", "));
    let _ = writeln!(out, "shadow modes  {}", v.shadow_modes.join(", "));
    let sites: Vec<&str> = v.sites.iter().map(|s| s.name.as_str()).collect();
    let _ = writeln!(out, "sites         {} (execution order)", sites.join(" > "));
    let kinds: Vec<&str> = v.event_kinds.keys().map(String::as_str).collect();
    let _ = writeln!(out, "event kinds   {}", kinds.join(", "));
    for table in Table::ALL {
        let spec = table.spec();
        let _ = writeln!(out);
        let _ = writeln!(out, "table {}: {}", table.name(), spec.doc);
        let _ = writeln!(out, "  key: {}", spec.key.join(", "));
        let width = spec.columns.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for c in &spec.columns {
            let null = if c.nullable { "null" } else { "    " };
            let _ = writeln!(
                out,
                "  {:<width$}  {:<9} {null}  {:<17} {}",
                c.name,
                c.ty.as_str(),
                c.encoding.as_str(),
                c.doc
            );
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "manifest.json: see `shadowtrace schema --format json` (key \"manifest\") for its JSON Schema."
    );
    out
}

/// The format as one JSON document: the vocabulary, every table definition
/// and the manifest's JSON Schema, exactly as shipped in `schemas/v1/`.
///
/// # Errors
/// Never in a correct build; the definitions are compiled in and parsed by tests.
pub fn render_json() -> Result<String, serde_json::Error> {
    let tables: serde_json::Map<String, serde_json::Value> = Table::ALL
        .iter()
        .map(|t| {
            Ok((
                t.name().to_owned(),
                serde_json::from_str(t.definition_json())?,
            ))
        })
        .collect::<Result<_, serde_json::Error>>()?;
    let document = serde_json::json!({
        "schema_version": SCHEMA_VERSION,
        "vocabulary": serde_json::from_str::<serde_json::Value>(shadowtrace_schemas::VOCABULARY_JSON)?,
        "tables": tables,
        "manifest": serde_json::from_str::<serde_json::Value>(MANIFEST_JSON_SCHEMA)?,
    });
    serde_json::to_string_pretty(&document)
}
