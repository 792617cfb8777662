//! `shadowtrace export --lists` rebuilds the full selections a run can give
//! back (every row of a v1 run, the sampled rows of a v2 run) equal to what
//! the producer selected, and counts the rows it cannot rebuild.

use std::collections::BTreeMap;
use std::path::Path;

use polars::prelude::{ParquetReader, SerReader};
use shadowtrace_analyzer::{Run, export};
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::record::Record;
use shadowtrace_tracer::writer::TopkLists;

use crate::analyze_verdicts::clean;

type Lists = BTreeMap<(i32, i32, i32), (Vec<i32>, Option<Vec<i32>>)>;

/// The producer's selections, stored form (padding dropped, ascending).
fn selected(records: &[Record], keep: impl Fn(i32) -> bool) -> Lists {
    let stored = |v: &[i32]| {
        let mut v: Vec<i32> = v.iter().copied().filter(|&k| k >= 0).collect();
        v.sort_unstable();
        v
    };
    records
        .iter()
        .filter_map(|r| match r {
            Record::Topk(t) if keep(t.token) => Some((
                (t.step, t.layer, t.token),
                (
                    stored(&t.prod.indices),
                    t.shadow.as_ref().map(|(_, s)| stored(&s.indices)),
                ),
            )),
            _ => None,
        })
        .collect()
}

fn exported(files: &[std::path::PathBuf]) -> Lists {
    let mut out = Lists::new();
    for path in files {
        let df = ParquetReader::new(std::fs::File::open(path).unwrap())
            .finish()
            .unwrap();
        let col = |n: &str| df.column(n).unwrap().as_materialized_series().clone();
        let (step, layer, token) = (col("step"), col("layer"), col("token"));
        let (prod, shadow) = (col("prod_indices"), col("shadow_indices"));
        let ints = |s: &polars::prelude::Series| -> Vec<i32> {
            s.i32().unwrap().into_no_null_iter().collect()
        };
        let (step, layer, token) = (ints(&step), ints(&layer), ints(&token));
        let lists = |s: &polars::prelude::Series| -> Vec<Option<Vec<i32>>> {
            let ca = s.list().unwrap();
            (0..ca.len())
                .map(|i| ca.get_as_series(i).map(|v| ints(&v)))
                .collect()
        };
        let (prod, shadow) = (lists(&prod), lists(&shadow));
        for i in 0..step.len() {
            out.insert(
                (step[i], layer[i], token[i]),
                (prod[i].clone().unwrap(), shadow[i].clone()),
            );
        }
    }
    out
}

fn export_run(dir: &Path, version: u32, lists: TopkLists) -> (export::ListExport, Lists) {
    let spec = clean("export");
    let run = dir.join("run");
    let options = WriterOptions {
        schema_version: version,
        topk_lists: lists,
        ..WriterOptions::default()
    };
    spec.write(&run, options).unwrap();
    let result = export::export_lists(&Run::open(&run).unwrap(), &dir.join("out")).unwrap();
    let got = exported(&result.files);
    (result, got)
}

#[test]
fn v2_sampled_rows_rebuild_both_selections_and_the_rest_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let (result, got) = export_run(tmp.path(), 2, TopkLists::Every(3));
    let records = clean("export").records();
    let expected = selected(&records, |t| t % 3 == 0);
    let all = selected(&records, |_| true).len();
    assert!(!expected.is_empty() && expected.len() < all);
    assert_eq!(got, expected);
    assert_eq!(
        (result.rows, result.rebuilt, result.without_list),
        (all, expected.len(), all - expected.len())
    );
    assert!(result.text(Path::new("out")).contains(&format!(
        "{} rows could not be rebuilt",
        all - expected.len()
    )));
}

#[test]
fn a_v2_run_without_sampled_lists_exports_nothing_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let (result, got) = export_run(tmp.path(), 2, TopkLists::None);
    assert!(got.is_empty() && result.files.is_empty());
    assert_eq!(result.without_list, result.rows);
    assert!(result.rows > 0);
}

#[test]
fn a_v1_run_exports_every_row() {
    let tmp = tempfile::tempdir().unwrap();
    let (result, got) = export_run(tmp.path(), 1, TopkLists::None);
    assert_eq!(got, selected(&clean("export").records(), |_| true));
    assert_eq!(result.without_list, 0);
}
