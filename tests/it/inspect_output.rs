//! `shadowtrace inspect` output is pinned: it is read by people.

use shadowtrace_analyzer::{Run, inspect};
use shadowtrace_schemas::MANIFEST_FILE;
use shadowtrace_tracer::WriterOptions;

use crate::support::small_spec;

#[test]
fn inspect_of_a_complete_run_is_pinned() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pinned");
    small_spec("pinned")
        .write(&dir, WriterOptions::default())
        .unwrap();
    // Fix what differs between machines and moments: time and device.
    let path = dir.join(MANIFEST_FILE);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["started_unix_ms"] = 1_796_000_000_000_u64.into();
    m["closed_unix_ms"] = 1_796_000_001_500_u64.into();
    m["device"] = serde_json::json!({"kind": "cpu", "name": "cpu", "index": null});
    std::fs::write(&path, m.to_string()).unwrap();

    let text = inspect::render_run(&Run::open(&dir).unwrap())
        .replace(&dir.display().to_string(), "<RUN_DIR>");
    insta::assert_snapshot!(text);
}
