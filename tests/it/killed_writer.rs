//! A writer killed with SIGKILL mid-run leaves its completed files intact and
//! the run reported incomplete; its completed files are still read.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use shadowtrace_analyzer::{Dataset, Run, inspect};
use shadowtrace_schemas::Table;
use shadowtrace_schemas::manifest::Status;

#[test]
fn a_run_killed_mid_write_keeps_its_complete_parts_and_says_incomplete() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("killed");
    let mut child = Command::new(env!("CARGO_BIN_EXE_write-then-hang"))
        .arg(&dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready", "the helper reached its kill point");
    // An idle writer rewrites the manifest within a second: what was sent is on disk.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    child.kill().unwrap(); // SIGKILL on Unix: no destructor, no flush.
    child.wait().unwrap();

    let run = Run::open(&dir).unwrap();
    assert_eq!(run.manifest.status, Status::Incomplete);
    assert!(!run.is_complete());
    assert_eq!(
        run.manifest.table(Table::Hidden).unwrap().status,
        Status::Complete
    );
    assert_eq!(run.rows(Table::Hidden), 20_000);
    assert_eq!(run.rows(Table::Topk), 0, "the open topk part is not data");
    assert!(
        run.notes
            .iter()
            .any(|n| n.contains("topk/part-00000.parquet.tmp") && n.contains("half-written")),
        "{:?}",
        run.notes
    );

    // The 300 top-k rows sent and never completed are said, not silently missing.
    assert_eq!(
        run.manifest.table(Table::Topk).unwrap().sent_rows,
        Some(300)
    );
    assert!(run.manifest.counters["unflushed_rows"] >= 300);
    assert!(
        run.notes
            .iter()
            .any(|n| n.starts_with("300 rows handed to the writer are in no complete part")),
        "{:?}",
        run.notes
    );

    let dataset = Dataset::load(std::slice::from_ref(&dir), true, |_, _| {}).unwrap();
    let hidden = dataset.read_table(Table::Hidden, Some(&["token"])).unwrap();
    assert_eq!(hidden.height(), 20_000);
    assert!(inspect::render_run(&run).contains("INCOMPLETE"));
}
