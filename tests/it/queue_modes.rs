//! The queue in front of the writer, bounded in bytes: blocking loses nothing
//! while it may wait, and drops and counts what outlives its deadline; lossy
//! drops when full and counts every row it drops, in the handle and the
//! manifest, which also says how many rows were sent.

use std::time::Duration;

use shadowtrace_schemas::Table;
use shadowtrace_tracer::{Delivery, QueueMode, RunWriter, WriterOptions};

use crate::support::{hidden_row, small_spec};

const SENT: i64 = 200_000;

fn send_burst(mode: QueueMode, queue_bytes: usize) -> (u64, u64, u64) {
    send_burst_with(WriterOptions {
        queue_bytes,
        queue_mode: mode,
        ..WriterOptions::default()
    })
    .0
}

/// (written, dropped, reported dropped), and the manifest's counters.
fn send_burst_with(
    options: WriterOptions,
) -> ((u64, u64, u64), std::collections::BTreeMap<String, u64>) {
    let tmp = tempfile::tempdir().unwrap();
    let writer = RunWriter::create(
        &tmp.path().join("run"),
        small_spec("queue").identity(),
        options,
    )
    .unwrap();
    let mut dropped_here = 0;
    for seq in 0..SENT {
        if writer.send(hidden_row(seq, 0)) == Delivery::Dropped {
            dropped_here += 1;
        }
    }
    assert_eq!(
        writer.dropped_rows(Table::Hidden),
        dropped_here,
        "the handle counts what send reported"
    );
    let manifest = writer.close().unwrap();
    let entry = manifest.table(Table::Hidden).unwrap();
    assert_eq!(manifest.counters["dropped_rows"], entry.dropped_rows);
    assert_eq!(
        entry.sent_rows,
        Some(SENT as u64),
        "the manifest says what was sent"
    );
    (
        (entry.rows, entry.dropped_rows, dropped_here),
        manifest.counters.clone(),
    )
}

#[test]
fn the_lossy_queue_counts_every_row_it_drops() {
    // A one-byte queue (one row at a time) against a burst of 200k rows: the
    // producer outruns the encoder, so rows are dropped; every one must be
    // accounted for.
    let (written, dropped, reported) = send_burst(QueueMode::Lossy, 1);
    assert!(
        dropped > 0,
        "a one-slot queue under a 200k-row burst drops rows"
    );
    assert_eq!(dropped, reported);
    assert_eq!(written + dropped, SENT as u64, "written + dropped = sent");
}

#[test]
fn the_blocking_queue_loses_nothing() {
    let (written, dropped, reported) = send_burst(QueueMode::Blocking, 1);
    assert_eq!((written, dropped, reported), (SENT as u64, 0, 0));
}

#[test]
fn a_blocking_queue_drops_and_counts_what_outlives_its_deadline() {
    // A one-row queue that may not wait at all: every row that finds it full
    // is dropped at its (immediate) deadline, and counted as a timeout.
    let ((written, dropped, reported), counters) = send_burst_with(WriterOptions {
        queue_bytes: 1,
        queue_mode: QueueMode::Blocking,
        queue_timeout: Duration::ZERO,
        ..WriterOptions::default()
    });
    assert!(
        dropped > 0,
        "a zero deadline under a 200k-row burst drops rows"
    );
    assert_eq!(dropped, reported);
    assert_eq!(counters["queue_wait_timeouts"], dropped);
    assert_eq!(written + dropped, SENT as u64, "written + dropped = sent");
}

#[test]
fn rows_sent_after_their_table_closed_are_counted_as_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let writer = RunWriter::create(
        &tmp.path().join("run"),
        small_spec("late").identity(),
        WriterOptions::default(),
    )
    .unwrap();
    let _ = writer.send(hidden_row(0, 0));
    writer.close_table(Table::Hidden);
    let _ = writer.send(hidden_row(1, 1));
    let manifest = writer.close().unwrap();
    let entry = manifest.table(Table::Hidden).unwrap();
    assert_eq!((entry.rows, entry.dropped_rows), (1, 1));
}
