//! A run written by the tracer's writer is read back by the analyzer's
//! loader (polars) with every column, type and value intact.

use shadowtrace_analyzer::Dataset;
use std::collections::BTreeSet;

use shadowtrace_e2e::{Cell, rows_as_cells, rows_as_cells_of};
use shadowtrace_schemas::Table;
use shadowtrace_schemas::manifest::Status;
use shadowtrace_tracer::record::{EventRow, HiddenRow, LogitsRow, Record, Selection, TopkRow};
use shadowtrace_tracer::writer::TopkLists;
use shadowtrace_tracer::{RunWriter, WriterOptions};

use crate::support::{edge_rows, small_spec};

// The expected cells restate the column order of schemas/v1 (and v2's top-k)
// independently of the writer's own mapping, so a drift in either shows up
// here. v2's counts, differences and churn are recomputed with sets, not
// with shadowtrace_schemas::selection, which the writer uses.

fn f(v: f32) -> Cell {
    Cell::F32(Some(v.to_bits()))
}

fn of(v: Option<f32>) -> Cell {
    Cell::F32(v.map(f32::to_bits))
}

fn s(v: &str) -> Cell {
    Cell::Str(Some(v.to_owned()))
}

fn floats(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn hidden_cells(run_id: &str, r: &HiddenRow) -> Vec<Cell> {
    let sh = r.shadow.as_ref();
    vec![
        s(run_id),
        Cell::I64(Some(r.seq)),
        Cell::I32(Some(r.step)),
        Cell::I32(Some(r.layer)),
        s(&r.site),
        Cell::I32(Some(r.token)),
        Cell::Str(sh.map(|x| x.mode.clone())),
        Cell::I64(Some(r.numel)),
        Cell::I64(Some(r.prod.nan)),
        Cell::I64(Some(r.prod.pos_inf)),
        Cell::I64(Some(r.prod.neg_inf)),
        f(r.prod.max_abs),
        f(r.prod.l2),
        Cell::I64(sh.map(|x| x.stats.nan)),
        Cell::I64(sh.map(|x| x.stats.pos_inf)),
        Cell::I64(sh.map(|x| x.stats.neg_inf)),
        of(sh.map(|x| x.stats.max_abs)),
        of(sh.map(|x| x.stats.l2)),
        of(sh.map(|x| x.comparison.rel_l2_err)),
        of(sh.map(|x| x.comparison.cosine)),
        of(sh.map(|x| x.comparison.max_abs_diff)),
    ]
}

/// The stored form of a selection, computed here from first principles:
/// padding dropped, ascending, boundary pairs ordered by index.
fn selection_cells(sel: Option<&Selection>) -> Vec<Cell> {
    let indices = sel.map(|x| {
        let mut v: Vec<i32> = x.indices.iter().copied().filter(|&i| i != -1).collect();
        v.sort_unstable();
        v
    });
    let boundary = sel.and_then(|x| x.boundary.as_ref()).map(|b| {
        let mut pairs: Vec<(i32, f32)> = b
            .indices
            .iter()
            .copied()
            .zip(b.scores.iter().copied())
            .collect();
        pairs.sort_by_key(|p| p.0);
        pairs
    });
    vec![
        Cell::ListI32(indices),
        of(sel.and_then(|x| x.kth_score)),
        of(sel.and_then(|x| x.kth_margin)),
        Cell::ListI32(boundary.as_ref().map(|p| p.iter().map(|x| x.0).collect())),
        Cell::ListF32(
            boundary
                .as_ref()
                .map(|p| p.iter().map(|x| x.1.to_bits()).collect()),
        ),
    ]
}

fn topk_cells(run_id: &str, r: &TopkRow) -> Vec<Cell> {
    let mut cells = vec![
        s(run_id),
        Cell::I32(Some(r.step)),
        Cell::I32(Some(r.layer)),
        Cell::I32(Some(r.token)),
        Cell::Str(r.shadow.as_ref().map(|x| x.0.clone())),
        Cell::I32(Some(r.indexer_layer)),
        Cell::I32(Some(r.k)),
        Cell::I32(Some(r.visible)),
    ];
    cells.extend(selection_cells(Some(&r.prod)));
    cells.extend(selection_cells(r.shadow.as_ref().map(|x| &x.1)));
    cells.push(of(r.boundary_band));
    cells
}

fn gap_coded(keys: &BTreeSet<i32>) -> Vec<i32> {
    let mut previous = 0;
    keys.iter()
        .map(|&k| {
            let gap = k - previous;
            previous = k;
            gap
        })
        .collect()
}

fn stored_set(sel: &Selection) -> BTreeSet<i32> {
    sel.indices.iter().copied().filter(|&i| i >= 0).collect()
}

fn set_jaccard(a: &BTreeSet<i32>, b: &BTreeSet<i32>) -> f32 {
    let union = a.union(b).count();
    if union == 0 {
        1.0
    } else {
        (a.intersection(b).count() as f64 / union as f64) as f32
    }
}

/// A path's boundary candidates by key: (key, score - k-th score, selected).
fn candidates(sel: &Selection, band: Option<f32>) -> Option<Vec<(i32, f32, bool)>> {
    band?;
    let b = sel.boundary.as_ref()?;
    let kth = sel.kth_score.unwrap_or(f32::NAN);
    let set = stored_set(sel);
    let mut c: Vec<(i32, f32, bool)> = b
        .indices
        .iter()
        .zip(&b.scores)
        .map(|(&k, &score)| (k, score - kth, set.contains(&k)))
        .collect();
    c.sort_by_key(|x| x.0);
    Some(c)
}

fn candidate_cells(c: Option<&Vec<(i32, f32, bool)>>) -> [Cell; 3] {
    [
        Cell::ListI32(c.map(|c| gap_coded(&c.iter().map(|x| x.0).collect()))),
        Cell::ListF32(c.map(|c| c.iter().map(|x| x.1.to_bits()).collect())),
        Cell::ListBool(c.map(|c| c.iter().map(|x| x.2).collect())),
    ]
}

/// A top-k row as v2 stores it, from the producer's selections.
fn topk_cells_v2(run_id: &str, r: &TopkRow, keep_list: bool) -> Vec<Cell> {
    let prod = stored_set(&r.prod);
    let shadow = r.shadow.as_ref().map(|(_, s)| s);
    let shadow_set = shadow.map(stored_set);
    let prod_c = candidates(&r.prod, r.boundary_band);
    let shadow_c = shadow.and_then(|s| candidates(s, r.boundary_band));
    // Churn: keys within the band of either path's k-th score, by that path's score.
    let churn: Option<BTreeSet<i32>> = match (r.boundary_band, &prod_c, &shadow_c, &shadow_set) {
        (Some(band), Some(p), Some(s), Some(_)) if r.visible > r.k => Some(
            p.iter()
                .chain(s)
                .filter(|x| x.1.abs() <= band)
                .map(|x| x.0)
                .collect(),
        ),
        _ => None,
    };
    let churn_by = |in_p: bool, in_s: bool| {
        let ss = shadow_set.as_ref()?;
        let n = churn
            .as_ref()?
            .iter()
            .filter(|k| prod.contains(k) == in_p && ss.contains(k) == in_s)
            .count();
        Some(n as i32)
    };
    let mut cells = vec![
        s(run_id),
        Cell::I32(Some(r.step)),
        Cell::I32(Some(r.layer)),
        Cell::I32(Some(r.token)),
        Cell::Str(r.shadow.as_ref().map(|x| x.0.clone())),
        Cell::I32(Some(r.indexer_layer)),
        s(r.unit.name),
        Cell::I32(Some(r.unit.tokens)),
        Cell::I32(Some(r.k)),
        Cell::I32(Some(r.visible)),
        Cell::I32(Some(prod.len() as i32)),
        of(r.prod.kth_score),
        of(r.prod.kth_margin),
        Cell::I32(shadow_set.as_ref().map(|s| s.len() as i32)),
        of(shadow.and_then(|s| s.kth_score)),
        of(shadow.and_then(|s| s.kth_margin)),
        Cell::I32(
            shadow_set
                .as_ref()
                .map(|s| prod.intersection(s).count() as i32),
        ),
        of(r.boundary_band),
        Cell::I32(churn_by(true, true)),
        Cell::I32(churn_by(true, false)),
        Cell::I32(churn_by(false, true)),
        Cell::I32(churn_by(false, false)),
        of(shadow_set.as_ref().map(|s| set_jaccard(&prod, s))),
        of(shadow_set.as_ref().zip(churn.as_ref()).map(|(s, churn)| {
            let keep = |set: &BTreeSet<i32>| set.difference(churn).copied().collect();
            set_jaccard(&keep(&prod), &keep(s))
        })),
        Cell::ListI32(
            shadow_set
                .as_ref()
                .map(|s| gap_coded(&prod.difference(s).copied().collect())),
        ),
        Cell::ListI32(
            shadow_set
                .as_ref()
                .map(|s| gap_coded(&s.difference(&prod).copied().collect())),
        ),
    ];
    cells.extend(candidate_cells(prod_c.as_ref()));
    cells.extend(candidate_cells(shadow_c.as_ref()));
    cells.push(Cell::ListI32(keep_list.then(|| gap_coded(&prod))));
    cells
}

fn event_cells(run_id: &str, r: &EventRow) -> Vec<Cell> {
    vec![
        s(run_id),
        Cell::I64(Some(r.seq)),
        Cell::I32(Some(r.step)),
        Cell::I32(Some(r.layer)),
        s(&r.site),
        s(&r.path),
        s(&r.kind),
        Cell::I32(r.token),
        Cell::I32(r.channel),
        Cell::I64(Some(r.count)),
        Cell::Bool(r.shadow_finite),
        Cell::Str(r.check.clone()),
        Cell::Bool(r.passed),
        of(r.value),
        Cell::Str(r.detail.clone()),
    ]
}

fn logits_cells(run_id: &str, r: &LogitsRow) -> Vec<Cell> {
    vec![
        s(run_id),
        Cell::I32(Some(r.step)),
        Cell::I32(Some(r.token)),
        Cell::ListI32(Some(r.prod.ids.clone())),
        Cell::ListF32(Some(floats(&r.prod.logprobs))),
        Cell::ListI32(r.shadow.as_ref().map(|x| x.ids.clone())),
        Cell::ListF32(r.shadow.as_ref().map(|x| floats(&x.logprobs))),
    ]
}

fn expected_cells(run_id: &str, version: u32, lists: TopkLists, record: &Record) -> Vec<Cell> {
    match record {
        Record::Hidden(r) => hidden_cells(run_id, r),
        Record::Topk(r) if version == 1 => topk_cells(run_id, r),
        Record::Topk(r) => topk_cells_v2(run_id, r, lists.samples(r.token)),
        Record::Event(r) => event_cells(run_id, r),
        Record::Logits(r) => logits_cells(run_id, r),
    }
}

/// Writes the small run and the edge rows in trace format `version` with
/// `lists`, reads every table back and compares each cell.
fn round_trip(version: u32, lists: TopkLists) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = small_spec("roundtrip");
    let dir = tmp.path().join(&spec.run_id);
    let mut records = spec.records();
    let (hidden, topk, events, logits) = edge_rows();
    records.extend(hidden.into_iter().map(Record::from));
    records.extend(topk.into_iter().map(Record::from));
    records.extend(events.into_iter().map(Record::from));
    records.extend(logits.into_iter().map(Record::from));

    let options = WriterOptions {
        schema_version: version,
        topk_lists: lists,
        ..WriterOptions::default()
    };
    let writer = RunWriter::create(&dir, spec.identity(), options).unwrap();
    for record in &records {
        assert_eq!(
            writer.send(record.clone()),
            shadowtrace_tracer::Delivery::Queued
        );
    }
    let manifest = writer.close().unwrap();
    assert_eq!(manifest.status, Status::Complete);

    let dataset = Dataset::load(std::slice::from_ref(&dir), true, |_, _| {}).unwrap();
    assert_eq!(dataset.runs.len(), 1);
    assert!(
        dataset.runs[0].notes.is_empty(),
        "{:?}",
        dataset.runs[0].notes
    );
    for table in Table::ALL {
        let expected: Vec<Vec<Cell>> = records
            .iter()
            .filter(|r| r.table() == table)
            .map(|r| expected_cells(&spec.run_id, version, lists, r))
            .collect();
        assert!(
            !expected.is_empty(),
            "{table}: the test writes rows of every table"
        );
        let frame = dataset.read_table(table, None).unwrap();
        let got = rows_as_cells_of(table, version, &frame);
        assert_eq!(got.len(), expected.len(), "{table}: row count");
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "{table} row {i}");
        }
        assert_eq!(
            manifest.table(table).unwrap().rows,
            expected.len() as u64,
            "{table}: manifest rows"
        );
    }
}

#[test]
fn every_column_type_and_value_survives_the_round_trip() {
    round_trip(2, TopkLists::None);
}

#[test]
fn v2_sampled_full_lists_are_kept_for_every_nth_token_and_all() {
    round_trip(2, TopkLists::Every(2));
    round_trip(2, TopkLists::All);
}

#[test]
fn a_run_written_in_v1_still_round_trips() {
    round_trip(1, TopkLists::None);
}

#[test]
fn reading_a_projection_returns_only_those_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = small_spec("projection");
    spec.write(&tmp.path().join("projection"), WriterOptions::default())
        .unwrap();
    let dataset = Dataset::load(&[tmp.path().to_owned()], true, |_, _| {}).unwrap();
    let frame = dataset
        .read_table(Table::Topk, Some(&["layer", "prod_only_gaps"]))
        .unwrap();
    let names: Vec<&str> = frame
        .get_column_names()
        .iter()
        .map(|n| n.as_str())
        .collect();
    assert_eq!(names, ["layer", "prod_only_gaps"]);
    assert_eq!(frame.height(), 3 * 6);
}

#[test]
fn a_directory_of_runs_loads_as_one_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    for id in ["a", "b"] {
        small_spec(id)
            .write(&tmp.path().join("grid").join(id), WriterOptions::default())
            .unwrap();
    }
    let dataset = Dataset::load(&[tmp.path().to_owned()], true, |_, _| {}).unwrap();
    let ids: Vec<&str> = dataset.runs.iter().map(|r| r.manifest.run_id()).collect();
    assert_eq!(ids, ["a", "b"]);
    let frame = dataset.read_table(Table::Logits, None).unwrap();
    assert_eq!(frame.height(), 2 * 4);
}

#[test]
fn a_table_with_no_rows_reads_as_an_empty_frame_of_the_right_types() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = small_spec("empty");
    let writer = RunWriter::create(
        &tmp.path().join("empty"),
        spec.identity(),
        WriterOptions::default(),
    )
    .unwrap();
    writer.close().unwrap();
    let dataset = Dataset::load(&[tmp.path().to_owned()], true, |_, _| {}).unwrap();
    let frame = dataset.read_table(Table::Topk, None).unwrap();
    assert_eq!(frame.height(), 0);
    assert!(rows_as_cells(Table::Topk, &frame).is_empty());
}
