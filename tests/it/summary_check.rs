//! A v2 run's top-k summaries are checked against its own lists: a planted
//! disagreement is counted in `analyze` (field and note) and is a problem
//! for `inspect`; rounding within the tolerance is not.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Float32Array, Int32Array, RecordBatch};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::properties::WriterProperties;
use shadowtrace_analyzer::metrics::topk_check::{self, SummaryCheck};
use shadowtrace_analyzer::{Options, Run, analyze, inspect};
use shadowtrace_tracer::WriterOptions;

use crate::analyze_verdicts::clean;

fn topk_part(run: &Path) -> PathBuf {
    run.join("topk/part-00000.parquet")
}

/// Rewrites the run's top-k part with `edit` applied to the first sparse
/// row that has a shadow, keeping the footer keys.
fn plant(run: &Path, edit: impl Fn(&str, &ArrayRef, usize) -> Option<ArrayRef>) {
    let path = topk_part(run);
    let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap();
    let kv = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .cloned();
    let batches: Vec<RecordBatch> = builder.build().unwrap().map(Result::unwrap).collect();
    assert_eq!(batches.len(), 1, "the small run fits one batch");
    let batch = batches[0].clone();
    let schema = batch.schema();
    let column = |name: &str| batch.column(schema.index_of(name).unwrap()).clone();
    let (k, visible) = (column("k"), column("visible"));
    let ints = |a: &ArrayRef| a.as_any().downcast_ref::<Int32Array>().unwrap().clone();
    let (k, visible, shadow) = (ints(&k), ints(&visible), column("shadow_selected"));
    let row = (0..batch.num_rows())
        .find(|&i| visible.value(i) > k.value(i) && shadow.is_valid(i))
        .unwrap();
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(f, c)| edit(f.name(), c, row).unwrap_or_else(|| c.clone()))
        .collect();
    let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let props = WriterProperties::builder()
        .set_key_value_metadata(kv)
        .build();
    let mut writer =
        ArrowWriter::try_new(File::create(&path).unwrap(), schema, Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

fn with_i32(c: &ArrayRef, row: usize, f: impl Fn(i32) -> i32) -> ArrayRef {
    let a = c.as_any().downcast_ref::<Int32Array>().unwrap();
    Arc::new(
        (0..a.len())
            .map(|i| {
                a.is_valid(i)
                    .then(|| if i == row { f(a.value(i)) } else { a.value(i) })
            })
            .collect::<Int32Array>(),
    )
}

fn with_f32(c: &ArrayRef, row: usize, f: impl Fn(f32) -> f32) -> ArrayRef {
    let a = c.as_any().downcast_ref::<Float32Array>().unwrap();
    Arc::new(
        (0..a.len())
            .map(|i| {
                a.is_valid(i)
                    .then(|| if i == row { f(a.value(i)) } else { a.value(i) })
            })
            .collect::<Float32Array>(),
    )
}

fn run_with(tmp: &Path, edit: impl Fn(&str, &ArrayRef, usize) -> Option<ArrayRef>) -> PathBuf {
    let dir = tmp.join("planted");
    clean("planted")
        .write(&dir, WriterOptions::default())
        .unwrap();
    plant(&dir, edit);
    dir
}

fn checked(dir: &Path) -> SummaryCheck {
    let a = analyze(&[dir.to_owned()], &[], &Options::default(), |_, _, _| {}).unwrap();
    let run = &a.runs[0];
    let check = run.topk_summary_check.unwrap();
    assert_eq!(
        run.notes.iter().any(|n| n.contains("summaries disagree")),
        check.rows_disagreeing > 0,
        "a disagreement is a note of the run, and only then: {:?}",
        run.notes
    );
    check
}

#[test]
fn a_writer_run_s_summaries_agree_with_its_lists() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("clean");
    clean("clean")
        .write(&dir, WriterOptions::default())
        .unwrap();
    let check = checked(&dir);
    assert!(check.rows_checked > 0);
    assert_eq!(
        check,
        SummaryCheck {
            rows_checked: check.rows_checked,
            ..SummaryCheck::default()
        }
    );
    assert!(
        topk_check::problem(&Run::open(&dir).unwrap())
            .unwrap()
            .is_none()
    );
}

#[test]
fn a_shared_count_that_contradicts_the_differences_is_counted_and_a_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_with(tmp.path(), |name, c, row| {
        (name == "shared").then(|| with_i32(c, row, |v| v - 1))
    });
    let check = checked(&dir);
    assert_eq!((check.rows_disagreeing, check.shared), (1, 1), "{check:?}");
    let mut run = Run::open(&dir).unwrap();
    run.problems.extend(topk_check::problem(&run).unwrap());
    let text = inspect::render_run(&run);
    assert!(
        text.contains("PROBLEMS") && text.contains("1 of ") && text.contains("shared 1"),
        "{text}"
    );
}

#[test]
fn a_stored_jaccard_off_by_more_than_rounding_is_counted_and_rounding_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_with(tmp.path(), |name, c, row| {
        (name == "jaccard").then(|| with_f32(c, row, |v| v - 1e-3))
    });
    let check = checked(&dir);
    assert_eq!(
        (check.rows_disagreeing, check.jaccard, check.shared),
        (1, 1, 0)
    );

    let tmp = tempfile::tempdir().unwrap();
    let dir = run_with(tmp.path(), |name, c, row| {
        (name == "jaccard").then(|| with_f32(c, row, |v| f32::from_bits(v.to_bits() - 1)))
    });
    assert_eq!(checked(&dir).rows_disagreeing, 0, "one ulp is rounding");
}

#[test]
fn churn_counts_that_contradict_the_boundary_lists_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_with(tmp.path(), |name, c, row| {
        (name == "churn_unselected").then(|| with_i32(c, row, |v| v + 1))
    });
    let check = checked(&dir);
    assert_eq!((check.rows_disagreeing, check.churn), (1, 1), "{check:?}");
}
