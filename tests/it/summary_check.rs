//! A v2 run's top-k summaries are checked against its own lists: a planted
//! disagreement is counted in `analyze` (field and note) and is a problem
//! for `inspect`, with the first disagreeing row named; rounding within the
//! tolerance is not. Parts of several row groups (checked in parallel) are
//! checked whole. Rows that hold other than what their footer's statistics
//! claim of every row (values `analyze` takes without decoding) are counted
//! too.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::types::{ArrowPrimitiveType, Float32Type, Int32Type};
use arrow_array::{
    Array, ArrayRef, Float32Array, Int32Array, ListArray, PrimitiveArray, RecordBatch,
};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::metadata::{ParquetMetaDataReader, ParquetMetaDataWriter};
use parquet::file::properties::WriterProperties;
use parquet::file::statistics::Statistics;
use shadowtrace_analyzer::judged::Question;
use shadowtrace_analyzer::load::BATCH_ROWS;
use shadowtrace_analyzer::metrics::topk_check::{self, RowAt, SummaryCheck};
use shadowtrace_analyzer::{Options, Run, analyze, inspect};
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::synth::SynthSpec;
use shadowtrace_tracer::writer::TopkLists;

use crate::analyze_verdicts::clean;
use crate::support;

fn topk_part(run: &Path) -> PathBuf {
    run.join("topk/part-00000.parquet")
}

/// Where each planted row is.
fn row_at(batch: &RecordBatch, row: usize) -> RowAt {
    let int = |name: &str| {
        batch
            .column(batch.schema().index_of(name).unwrap())
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap()
            .value(row)
    };
    RowAt {
        step: int("step"),
        layer: int("layer"),
        token: int("token"),
    }
}

/// Rewrites the run's top-k part with `edit` applied to the sparse rows
/// with a shadow picked by `pick` (their order among such rows, given how
/// many there are), keeping
/// the footer keys, in row groups of `row_group_rows` when given; returns
/// where the edited rows are.
fn plant_rows(
    run: &Path,
    pick: impl Fn(usize) -> Vec<usize>,
    row_group_rows: Option<usize>,
    edit: impl Fn(&str, &ArrayRef, &[usize]) -> Option<ArrayRef>,
) -> Vec<RowAt> {
    let path = topk_part(run);
    let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap();
    let kv = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .cloned();
    let batches: Vec<RecordBatch> = builder
        .with_batch_size(1 << 20)
        .build()
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(batches.len(), 1, "the run fits one batch");
    let batch = batches[0].clone();
    let schema = batch.schema();
    let column = |name: &str| batch.column(schema.index_of(name).unwrap()).clone();
    let (k, visible) = (column("k"), column("visible"));
    let ints = |a: &ArrayRef| a.as_any().downcast_ref::<Int32Array>().unwrap().clone();
    let (k, visible, shadow) = (ints(&k), ints(&visible), column("shadow_selected"));
    let sparse: Vec<usize> = (0..batch.num_rows())
        .filter(|&i| visible.value(i) > k.value(i) && shadow.is_valid(i))
        .collect();
    let rows: Vec<usize> = pick(sparse.len()).iter().map(|&p| sparse[p]).collect();
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(f, c)| edit(f.name(), c, &rows).unwrap_or_else(|| c.clone()))
        .collect();
    let edited = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let props = WriterProperties::builder()
        .set_key_value_metadata(kv)
        .set_max_row_group_row_count(row_group_rows)
        .build();
    let mut writer =
        ArrowWriter::try_new(File::create(&path).unwrap(), schema, Some(props)).unwrap();
    writer.write(&edited).unwrap();
    writer.close().unwrap();
    support::rehash(run);
    rows.iter().map(|&r| row_at(&batch, r)).collect()
}

/// [`plant_rows`] on the first sparse row with a shadow, one row group.
pub(crate) fn plant(
    run: &Path,
    edit: impl Fn(&str, &ArrayRef, usize) -> Option<ArrayRef>,
) -> RowAt {
    plant_rows(
        run,
        |_| vec![0],
        None,
        |name, c, rows| edit(name, c, rows[0]),
    )[0]
}

pub(crate) fn with_i32(c: &ArrayRef, row: usize, f: impl Fn(i32) -> i32) -> ArrayRef {
    with_i32_rows(c, &[row], f)
}

fn with_i32_rows(c: &ArrayRef, rows: &[usize], f: impl Fn(i32) -> i32) -> ArrayRef {
    let a = c.as_any().downcast_ref::<Int32Array>().unwrap();
    Arc::new(
        (0..a.len())
            .map(|i| {
                a.is_valid(i).then(|| {
                    if rows.contains(&i) {
                        f(a.value(i))
                    } else {
                        a.value(i)
                    }
                })
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

/// A `list<i32>` column with row `row`'s list replaced by `f` of it.
fn with_list(c: &ArrayRef, row: usize, f: impl Fn(Vec<i32>) -> Vec<i32>) -> ArrayRef {
    let a = c.as_any().downcast_ref::<ListArray>().unwrap();
    let rows = (0..a.len()).map(|i| {
        a.is_valid(i).then(|| {
            let values = a.value(i);
            let values: Vec<i32> = values
                .as_any()
                .downcast_ref::<Int32Array>()
                .unwrap()
                .values()
                .to_vec();
            let values = if i == row { f(values) } else { values };
            values.into_iter().map(Some).collect::<Vec<_>>()
        })
    });
    Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(rows))
}

fn run_with(tmp: &Path, edit: impl Fn(&str, &ArrayRef, usize) -> Option<ArrayRef>) -> PathBuf {
    run_with_lists(tmp, TopkLists::None, edit).0
}

fn run_with_lists(
    tmp: &Path,
    lists: TopkLists,
    edit: impl Fn(&str, &ArrayRef, usize) -> Option<ArrayRef>,
) -> (PathBuf, RowAt) {
    let dir = tmp.join("planted");
    let options = WriterOptions {
        topk_lists: lists,
        ..WriterOptions::default()
    };
    clean("planted").write(&dir, options).unwrap();
    let at = plant(&dir, edit);
    (dir, at)
}

fn checked(dir: &Path) -> SummaryCheck {
    let a = analyze(&[dir.to_owned()], &[], &Options::default(), |_, _, _| {}).unwrap();
    let run = &a.runs[0];
    let check = run.topk_summary_check.unwrap();
    assert_eq!(
        run.not_measured
            .iter()
            .any(|n| n.why.contains("summaries disagree")),
        check.rows_disagreeing > 0,
        "a disagreement is listed as not measured, and only then: {:?}",
        run.not_measured
    );
    assert_eq!(
        run.judged(Question::Topk),
        check.rows_disagreeing == 0,
        "a disagreement leaves the top-k verdict not judged"
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
            parts: 1,
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

fn checked_with_memo(dir: &Path, memo: &Path) -> SummaryCheck {
    let options = Options {
        check_memo: Some(memo.to_owned()),
        ..Options::default()
    };
    let a = analyze(&[dir.to_owned()], &[], &options, |_, _, _| {}).unwrap();
    a.runs[0].topk_summary_check.unwrap()
}

/// The memo's one entry, as JSON, and where it is.
fn memo_entry(memo: &Path) -> (PathBuf, serde_json::Value) {
    let entries: Vec<PathBuf> = std::fs::read_dir(memo)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "one entry per part: {entries:?}");
    let text = std::fs::read(&entries[0]).unwrap();
    (entries[0].clone(), serde_json::from_slice(&text).unwrap())
}

#[test]
fn a_check_is_remembered_for_its_part_and_redone_once_the_part_or_the_definition_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, at) = run_with_lists(tmp.path(), TopkLists::None, |name, c, row| {
        (name == "shared").then(|| with_i32(c, row, |v| v - 1))
    });
    let memo = tmp.path().join("memo");
    let first = checked_with_memo(&dir, &memo);
    assert_eq!((first.parts, first.parts_remembered), (1, 0));
    assert_eq!((first.shared, first.first_disagreeing), (1, Some(at)));
    let second = checked_with_memo(&dir, &memo);
    assert_eq!(second.parts_remembered, 1, "the same bytes: remembered");
    assert_eq!(
        SummaryCheck {
            parts_remembered: 0,
            ..second
        },
        first,
        "the remembered result is the checked one"
    );
    // What the memo says is what analyze reports while the part is the
    // same: the part was not decoded again.
    let (entry, mut json) = memo_entry(&memo);
    json["check"]["shared"] = 7.into();
    std::fs::write(&entry, serde_json::to_vec(&json).unwrap()).unwrap();
    assert_eq!(checked_with_memo(&dir, &memo).shared, 7);
    // The part touched (same bytes, a new modification time): checked again.
    let part = topk_part(&dir);
    let later =
        std::fs::metadata(&part).unwrap().modified().unwrap() + std::time::Duration::from_secs(1);
    File::options()
        .write(true)
        .open(&part)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let third = checked_with_memo(&dir, &memo);
    assert_eq!((third.shared, third.parts_remembered), (1, 0));
    // An entry of another check definition is not this check's result.
    let (entry, mut json) = memo_entry(&memo);
    json["check"]["shared"] = 7.into();
    json["key"]["definition"] = "0 0.0.0".into();
    std::fs::write(&entry, serde_json::to_vec(&json).unwrap()).unwrap();
    let fourth = checked_with_memo(&dir, &memo);
    assert_eq!((fourth.shared, fourth.parts_remembered), (1, 0));
    // A memo that cannot be written (a file where its directory would be)
    // costs a check every time, never a result.
    let blocked = tmp.path().join("blocked");
    std::fs::write(&blocked, b"not a directory").unwrap();
    for _ in 0..2 {
        let check = checked_with_memo(&dir, &blocked);
        assert_eq!((check.shared, check.parts_remembered), (1, 0));
    }
}

#[test]
fn a_shared_count_that_contradicts_the_differences_is_counted_and_a_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, at) = run_with_lists(tmp.path(), TopkLists::None, |name, c, row| {
        (name == "shared").then(|| with_i32(c, row, |v| v - 1))
    });
    let check = checked(&dir);
    assert_eq!((check.rows_disagreeing, check.shared), (1, 1), "{check:?}");
    assert_eq!(check.first_disagreeing, Some(at));
    let mut run = Run::open(&dir).unwrap();
    run.problems.extend(topk_check::problem(&run).unwrap());
    let text = inspect::render_run(&run);
    let place = format!(
        "the first at step {}, layer {}, token {}",
        at.step, at.layer, at.token
    );
    assert!(
        text.contains("PROBLEMS")
            && text.contains("1 of ")
            && text.contains("shared 1")
            && text.contains(&place),
        "{text}"
    );
}

#[test]
fn disagreements_in_several_row_groups_are_all_counted_and_the_first_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("planted");
    clean("planted")
        .write(&dir, WriterOptions::default())
        .unwrap();
    // Row groups of 4 rows: the second and the last sparse rows lie in
    // different ones, read and checked in parallel.
    let at = plant_rows(
        &dir,
        |n| vec![n - 1, 1],
        Some(4),
        |name, c, rows| (name == "shared").then(|| with_i32_rows(c, rows, |v| v + 2)),
    );
    let groups = ParquetRecordBatchReaderBuilder::try_new(File::open(topk_part(&dir)).unwrap())
        .unwrap()
        .metadata()
        .num_row_groups();
    assert!(groups > 2, "{groups} row groups");
    let check = checked(&dir);
    assert_eq!((check.rows_disagreeing, check.shared), (2, 2), "{check:?}");
    assert_eq!(check.first_disagreeing, Some(at[0].min(at[1])));
    assert!(at[1] < at[0], "the second sparse row comes first: {at:?}");
}

#[test]
fn a_row_group_longer_than_a_batch_is_checked_whole_across_its_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("planted");
    // 5 layers x 2000 queries: one row group of 10,000 rows, read in two
    // batches; the first sparse row is in the first, the last in the second.
    let spec = SynthSpec {
        tokens: 2048,
        topk_queries: 2000,
        ..clean("planted")
    };
    spec.write(&dir, WriterOptions::default()).unwrap();
    let rows = usize::try_from(spec.layers * spec.topk_queries).unwrap();
    assert!(rows > BATCH_ROWS, "{rows} rows, batches of {BATCH_ROWS}");
    let at = plant_rows(
        &dir,
        |n| vec![0, n - 1],
        None,
        |name, c, rows| (name == "shared").then(|| with_i32_rows(c, rows, |v| v + 1)),
    );
    let groups = ParquetRecordBatchReaderBuilder::try_new(File::open(topk_part(&dir)).unwrap())
        .unwrap()
        .metadata()
        .num_row_groups();
    assert_eq!(groups, 1);
    let check = checked(&dir);
    assert_eq!(check.rows_checked, rows, "every row, in both batches");
    assert_eq!((check.rows_disagreeing, check.shared), (2, 2), "{check:?}");
    assert_eq!(check.first_disagreeing, Some(at[0].min(at[1])));
}

#[test]
fn a_sampled_full_list_short_of_a_key_is_counted() {
    let tmp = tempfile::tempdir().unwrap();
    // Merge the first two gaps: the list loses its first key, and holds
    // one key fewer than prod_selected.
    let (dir, at) = run_with_lists(tmp.path(), TopkLists::All, |name, c, row| {
        (name == "prod_gaps").then(|| {
            with_list(c, row, |mut gaps| {
                let first = gaps.remove(0);
                gaps[0] += first;
                gaps
            })
        })
    });
    let check = checked(&dir);
    assert_eq!(
        (check.rows_disagreeing, check.full_list, check.shared),
        (1, 1, 0),
        "{check:?}"
    );
    assert_eq!(check.first_disagreeing, Some(at));
}

#[test]
fn a_stored_churn_free_jaccard_off_by_more_than_rounding_is_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_with(tmp.path(), |name, c, row| {
        (name == "jaccard_no_churn").then(|| with_f32(c, row, |v| v - 1e-3))
    });
    let check = checked(&dir);
    assert_eq!(
        (
            check.rows_disagreeing,
            check.jaccard_no_churn,
            check.jaccard
        ),
        (1, 1, 0),
        "{check:?}"
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

/// Row `row` of a list column with its first two entries swapped.
fn swap_first_two<T: Copy>(
    c: &ArrayRef,
    row: usize,
    values: impl Fn(&ArrayRef) -> Vec<T>,
    build: impl Fn(Vec<Option<Vec<Option<T>>>>) -> ArrayRef,
) -> ArrayRef {
    let a = c.as_any().downcast_ref::<ListArray>().unwrap();
    let rows = (0..a.len())
        .map(|i| {
            a.is_valid(i).then(|| {
                let mut v = values(&a.value(i));
                if i == row {
                    assert!(v.len() >= 2, "the planted row lists two candidates");
                    v.swap(0, 1);
                }
                v.into_iter().map(Some).collect()
            })
        })
        .collect();
    build(rows)
}

#[test]
fn boundary_keys_out_of_order_are_a_churn_disagreement() {
    use arrow_array::types::Float32Type;
    use arrow_array::{BooleanArray, builder::BooleanBuilder, builder::ListBuilder};
    let tmp = tempfile::tempdir().unwrap();
    // prod's first two candidates swapped, key, offset and flag together:
    // the same candidates, listed out of order.
    let dir = run_with(tmp.path(), |name, c, row| match name {
        "prod_boundary_gaps" => Some(with_list(c, row, |gaps| {
            let (k0, k1) = (gaps[0], gaps[0] + gaps[1]);
            let mut swapped = vec![k1, k0 - k1];
            if let Some(g2) = gaps.get(2) {
                swapped.push(k1 + g2 - k0);
            }
            swapped.extend_from_slice(gaps.get(3..).unwrap_or(&[]));
            swapped
        })),
        "prod_boundary_offsets" => Some(swap_first_two(
            c,
            row,
            |v| {
                v.as_any()
                    .downcast_ref::<Float32Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            },
            |rows| Arc::new(ListArray::from_iter_primitive::<Float32Type, _, _>(rows)),
        )),
        "prod_boundary_selected" => Some(swap_first_two(
            c,
            row,
            |v| {
                let b = v.as_any().downcast_ref::<BooleanArray>().unwrap();
                (0..b.len()).map(|j| b.value(j)).collect()
            },
            |rows| {
                let mut list = ListBuilder::new(BooleanBuilder::new());
                for r in rows {
                    match r {
                        Some(v) => {
                            for x in v {
                                list.values().append_option(x);
                            }
                            list.append(true);
                        }
                        None => list.append(false),
                    }
                }
                Arc::new(list.finish())
            },
        )),
        _ => None,
    });
    let check = checked(&dir);
    assert_eq!((check.rows_disagreeing, check.churn), (1, 1), "{check:?}");
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

/// A list column of `T` with row `row` made null.
fn null_at<T: ArrowPrimitiveType>(c: &ArrayRef, row: usize) -> ArrayRef {
    let a = c.as_any().downcast_ref::<ListArray>().unwrap();
    let rows = (0..a.len()).map(|i| {
        (a.is_valid(i) && i != row).then(|| {
            let values = a.value(i);
            let values = values.as_any().downcast_ref::<PrimitiveArray<T>>().unwrap();
            values.iter().collect::<Vec<_>>()
        })
    });
    Arc::new(ListArray::from_iter_primitive::<T, _, _>(rows))
}

#[test]
fn a_row_with_a_shadow_and_no_difference_lists_is_a_disagreement_not_a_row_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, at) = run_with_lists(tmp.path(), TopkLists::None, |name, c, row| {
        (name == "shadow_only_gaps").then(|| null_at::<Int32Type>(c, row))
    });
    let check = checked(&dir);
    assert_eq!(
        (check.rows_disagreeing, check.missing_lists),
        (1, 1),
        "{check:?}"
    );
    assert_eq!(check.first_disagreeing, Some(at));
    assert!(check.text().contains("missing_lists 1"), "{}", check.text());
}

#[test]
fn recorded_churn_without_the_boundary_offsets_it_came_from_is_a_disagreement() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = run_with(tmp.path(), |name, c, row| {
        (name == "prod_boundary_offsets").then(|| null_at::<Float32Type>(c, row))
    });
    let check = checked(&dir);
    assert_eq!(
        (check.rows_disagreeing, check.missing_lists, check.churn),
        (1, 1, 0),
        "{check:?}"
    );
}

/// Rewrites the footer of the part at `path` with the statistics of the
/// flat column `name` in every row group replaced by `stats`; the data pages
/// stay as they are, so the footer says what the rows may not.
fn lie_in_footer(path: &Path, name: &str, stats: &Statistics) {
    let bytes = std::fs::read(path).unwrap();
    let metadata = ParquetMetaDataReader::new()
        .parse_and_finish(&File::open(path).unwrap())
        .unwrap();
    let tail: [u8; 4] = bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap();
    let data_end = bytes.len() - 8 - u32::from_le_bytes(tail) as usize;
    let leaf = metadata
        .file_metadata()
        .schema_descr()
        .columns()
        .iter()
        .position(|c| c.path().parts() == [name])
        .unwrap();
    let groups = metadata
        .row_groups()
        .iter()
        .map(|group| {
            let columns = group
                .columns()
                .iter()
                .enumerate()
                .map(|(i, column)| match i == leaf {
                    true => column
                        .clone()
                        .into_builder()
                        .set_statistics(stats.clone())
                        .build()
                        .unwrap(),
                    false => column.clone(),
                })
                .collect();
            group
                .clone()
                .into_builder()
                .set_column_metadata(columns)
                .build()
                .unwrap()
        })
        .collect();
    let metadata = metadata.into_builder().set_row_groups(groups).build();
    let mut out = bytes[..data_end].to_vec();
    ParquetMetaDataWriter::new(&mut out, &metadata)
        .finish()
        .unwrap();
    std::fs::write(path, out).unwrap();
}

/// Where the rows of the run's top-k part whose `step` is not `step` are,
/// read by arrow-rs.
fn rows_off_step(run: &Path, step: i32) -> Vec<RowAt> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(topk_part(run)).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let mut off = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        off.extend(
            (0..batch.num_rows())
                .map(|row| row_at(&batch, row))
                .filter(|at| at.step != step),
        );
    }
    off
}

#[test]
fn rows_that_hold_other_than_their_footer_claims_are_counted_and_leave_top_k_unjudged() {
    let tmp = tempfile::tempdir().unwrap();
    // A prefill (every row at step 0) with one row moved to step 7, its
    // footer written honestly: k is one value in the row group and taken
    // from there, the step is decoded; nothing disagrees.
    let (dir, _) = run_with_lists(tmp.path(), TopkLists::None, |name, c, row| {
        (name == "step").then(|| with_i32(c, row, |v| v + 7))
    });
    let honest = checked(&dir);
    assert_eq!(
        (honest.rows_disagreeing, honest.footer),
        (0, 0),
        "{honest:?}"
    );
    // A footer claiming every row is at step 0, as a writer whose statistics
    // were wrong would: `analyze` would read step 0 for the moved row too.
    let off = rows_off_step(&dir, 0);
    assert_eq!(off.len(), 1, "{off:?}");
    let stats = Statistics::int32(Some(0), Some(0), None, Some(0), false);
    lie_in_footer(&topk_part(&dir), "step", &stats);
    // A writer whose statistics were wrong hashed the part it wrote as it was.
    support::rehash(&dir);
    let check = checked(&dir);
    assert_eq!((check.rows_disagreeing, check.footer), (1, 1), "{check:?}");
    assert_eq!(check.first_disagreeing, Some(off[0]));
    let mut run = Run::open(&dir).unwrap();
    run.problems.extend(topk_check::problem(&run).unwrap());
    let text = inspect::render_run(&run);
    assert!(
        text.contains("PROBLEMS") && text.contains("footer 1"),
        "{text}"
    );
}
