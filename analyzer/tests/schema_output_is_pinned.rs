//! The exported trace format is pinned, so every change to it is deliberate:
//! a changed column, type, encoding or doc shows up as a snapshot diff.

use shadowtrace_analyzer::schema_doc;

#[test]
fn schema_text_is_pinned() {
    insta::assert_snapshot!(schema_doc::render_text());
}

#[test]
fn schema_json_is_pinned() {
    insta::assert_snapshot!(schema_doc::render_json().unwrap());
}
