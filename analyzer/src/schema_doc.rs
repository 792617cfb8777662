//! `shadowtrace schema`: the trace format as a person reads it, or as the
//! JSON definitions other tools consume.

use std::fmt::Write;

use shadowtrace_schemas::footer::FOOTER_KEYS;
use shadowtrace_schemas::{
    MANIFEST_JSON_SCHEMA, MANIFEST_JSON_SCHEMA_V1, SCHEMA_VERSION, Table, TableSpec,
    readable_versions_text, vocabulary,
};

/// One table's columns as text.
fn write_table(out: &mut String, title: &str, spec: &TableSpec) {
    let _ = writeln!(out);
    let _ = writeln!(out, "{title}: {}", spec.doc);
    let _ = writeln!(out, "  key: {}", spec.key.join(", "));
    let width = spec.columns.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for c in &spec.columns {
        let null = if c.nullable { "null" } else { "    " };
        let _ = writeln!(
            out,
            "  {:<width$}  {:<10} {null}  {:<17} {}",
            c.name,
            c.ty.as_str(),
            c.encoding.as_str(),
            c.doc
        );
    }
}

/// The format as text: vocabulary, the footer keys, each table's columns,
/// and v1's top-k table for reading old runs.
#[must_use]
pub fn render_text() -> String {
    let v = vocabulary();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "shadowtrace trace format v{SCHEMA_VERSION} (written; read: {})",
        readable_versions_text()
    );
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
    let units: Vec<String> = v
        .selection_units
        .iter()
        .map(|(name, doc)| format!("{name} ({doc})"))
        .collect();
    let _ = writeln!(out, "selection units {}", units.join("; "));
    let tags: Vec<&str> = v.run_tags.keys().map(String::as_str).collect();
    let _ = writeln!(
        out,
        "run tags      {} (read by the tools; any other tag is the user's)",
        tags.join(", ")
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Parquet footer keys (key-value metadata) a reader requires in every part file:"
    );
    for (key, doc) in FOOTER_KEYS {
        let _ = writeln!(out, "  {key:<27} {doc}");
    }
    for table in Table::ALL {
        write_table(&mut out, &format!("table {}", table.name()), table.spec());
    }
    if let Some(v1) = Table::Topk.spec_for(1) {
        write_table(
            &mut out,
            "table topk in runs written as v1 (read, no longer written)",
            v1,
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "manifest.json: see `shadowtrace schema --format json` (key \"manifest\"; v1's under \"v1\") for its JSON Schema."
    );
    out
}

/// The format as one JSON document: the vocabulary, every table definition,
/// the footer keys and the manifest's JSON Schema, exactly as shipped in
/// `schemas/v2/` (v1's top-k table and manifest schema beside them).
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
    let footer_keys: serde_json::Map<String, serde_json::Value> = FOOTER_KEYS
        .iter()
        .map(|(key, doc)| ((*key).to_owned(), (*doc).into()))
        .collect();
    let topk_v1 = Table::Topk
        .definition_json_for(1)
        .map(serde_json::from_str::<serde_json::Value>)
        .transpose()?;
    let document = serde_json::json!({
        "schema_version": SCHEMA_VERSION,
        "read_versions": shadowtrace_schemas::READ_VERSIONS,
        "footer_keys": footer_keys,
        "vocabulary": serde_json::from_str::<serde_json::Value>(shadowtrace_schemas::VOCABULARY_JSON)?,
        "tables": tables,
        "manifest": serde_json::from_str::<serde_json::Value>(MANIFEST_JSON_SCHEMA)?,
        "v1": {
            "tables": {"topk": topk_v1},
            "manifest": serde_json::from_str::<serde_json::Value>(MANIFEST_JSON_SCHEMA_V1)?,
        },
    });
    serde_json::to_string_pretty(&document)
}
