//! Trace formats v1 and v2 read side by side: runs an older build wrote in
//! v1 analyse as that build analysed them, and the same selections written
//! as v1 (full lists) and as v2 (summary, differences, boundary candidates)
//! give the same analysis, with the recorded band and with a narrower churn
//! margin that v2 answers from its boundary lists.

use std::path::{Path, PathBuf};

use shadowtrace_analyzer::verdict::Thresholds;
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_tracer::record::Record;
use shadowtrace_tracer::synth::{BOUNDARY_BAND, SynthSpec};
use shadowtrace_tracer::{RunWriter, WriterOptions};

use crate::analyze_verdicts::clean;

/// The analysis as JSON, without the run directories (which differ by
/// where the runs sit, not by what they hold).
fn analysis_json(paths: &[PathBuf], churn_band: Option<f32>) -> serde_json::Value {
    let options = Options {
        thresholds: Thresholds {
            churn_band,
            ..Thresholds::default()
        },
        ..Options::default()
    };
    let a = analyze(paths, &[], &options, |_, _, _| {}).unwrap();
    assert!(a.skipped.is_empty(), "{:?}", a.skipped);
    // Through the text, as `analyze --format json` prints it: f32 fields
    // then compare as printed, not widened to f64.
    let mut value: serde_json::Value =
        serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
    drop_dirs(&mut value);
    value
}

/// A v2 analysis without what only v2 has: the check of each row's
/// summary against its lists, which must have found nothing.
fn as_v1(mut value: serde_json::Value) -> serde_json::Value {
    for run in value["runs"].as_array_mut().unwrap() {
        let check = run
            .as_object_mut()
            .unwrap()
            .remove("topk_summary_check")
            .unwrap();
        assert!(check["rows_checked"].as_u64().unwrap() > 0, "{check}");
        assert_eq!(check["rows_disagreeing"], 0, "{check}");
    }
    value
}

fn drop_dirs(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.remove("dir");
            map.values_mut().for_each(drop_dirs);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_dirs),
        _ => {}
    }
}

/// Writes `records` as run `spec` in trace format `version`.
fn write(dir: &Path, spec: &SynthSpec, version: u32, records: &[Record]) -> PathBuf {
    let path = dir.join(format!("v{version}")).join(&spec.run_id);
    let options = WriterOptions {
        schema_version: version,
        ..WriterOptions::default()
    };
    let writer = RunWriter::create(&path, spec.identity(), options).unwrap();
    for record in records {
        let _ = writer.send(record.clone());
    }
    writer.close().unwrap();
    path
}

/// A churn run (a collapse at layer 3 too) whose last top-k row lost the
/// shadow's boundary list: churn known from prod's list only.
fn selections() -> (SynthSpec, Vec<Record>) {
    let spec = SynthSpec {
        collapse_from_layer: Some(3),
        ..clean("v1-v2")
    };
    let mut records = spec.records();
    let last = records
        .iter_mut()
        .rev()
        .find_map(|r| match r {
            Record::Topk(t) if t.visible > t.k => Some(t),
            _ => None,
        })
        .unwrap();
    last.shadow.as_mut().unwrap().1.boundary = None;
    (spec, records)
}

#[test]
fn v1_runs_written_by_an_older_build_analyse_as_that_build_did() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/v1");
    let got = analysis_json(std::slice::from_ref(&fixtures), None);
    let mut expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("analyze-by-v1-build.json")).unwrap())
            .unwrap();
    drop_dirs(&mut expected);
    assert_eq!(without_the_convention_verdict(got), expected);
}

/// The analysis less what came after the v1 build: the convention verdict
/// (issue 13), its rule and its empty list of mismatches, and the lists of
/// what was not measured and each layer's selection unit (issue 28), empty
/// and tokens for these whole v1 runs, the churn rule's and threshold's
/// new names, and the note that their parts carry no content hash. Nothing
/// else may differ.
fn without_the_convention_verdict(mut got: serde_json::Value) -> serde_json::Value {
    // `--churn-margin` (absolute, narrowing only) became `--churn-band` (issue 28).
    let thresholds = got["thresholds"].as_object_mut().unwrap();
    let band = thresholds.remove("churn_band").unwrap();
    thresholds.insert("churn_margin".to_owned(), band);
    // The verdict a CI reads, and the grid's count of every verdict kind
    // and the site of its hidden column (issue 44).
    let status = got.as_object_mut().unwrap().remove("verdict").unwrap()["status"].clone();
    assert!(status == "fail" || status == "pass", "{status}");
    let grid = got["grid"].as_object_mut().unwrap();
    assert_eq!(
        grid.remove("hidden_site"),
        Some(serde_json::json!("layer_out"))
    );
    for group in got["grid"]["groups"].as_array_mut().unwrap() {
        let group = group.as_object_mut().unwrap();
        assert_eq!(group.remove("not_judged_runs"), Some(serde_json::json!(0)));
        for none in ["capture_runs", "convention_runs", "sentinel_runs"] {
            assert_eq!(group.remove(none), Some(serde_json::json!(0)), "{none}");
        }
        // The users' outcomes (issue 40): none recorded in these runs.
        let outcomes = group.remove("outcomes").unwrap();
        assert_eq!(outcomes["unrecorded"], group["runs"], "{outcomes}");
        for none in ["correct", "corrupted", "malformed", "scored"] {
            assert_eq!(outcomes[none], serde_json::json!(0), "{none}");
        }
        let onsets = group.remove("nonfinite_layers").unwrap();
        assert_eq!(
            Some(onsets.as_array().unwrap().len() as u64),
            group["nonfinite_runs"].as_u64()
        );
    }
    for run in got["runs"].as_array_mut().unwrap() {
        let run = run.as_object_mut().unwrap();
        assert_eq!(
            run.remove("convention_mismatches"),
            Some(serde_json::json!([]))
        );
        assert_eq!(run.remove("not_measured"), Some(serde_json::json!([])));
        // The capture self-check says it was not run where a run records none
        // (issue 42); the v1 build said nothing.
        if let Some(why) = run.remove("capture_check_not_run") {
            assert_eq!(why, serde_json::json!("the run records no check"));
        }
        // NaN provenance came after the v1 build: a run with an onset has one,
        // which says that a v1 run's selections are not read.
        let provenance = run.remove("nan_provenance");
        assert_eq!(provenance.is_some(), !run["onset"].is_null());
        if let Some(p) = provenance {
            assert!(
                p["not_known"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|n| n.as_str().unwrap().contains("trace format v1")),
                "{p}"
            );
        }
        // Part files' content hashes came after the v1 build: its runs record
        // none, and the reader says their bytes are not verified.
        let notes = run["notes"].as_array_mut().unwrap();
        let before = notes.len();
        notes.retain(|n| {
            !n.as_str()
                .unwrap()
                .ends_with("carry no content hash (written before hashes were recorded, or by a writer that could not hash): their bytes are not verified")
        });
        assert_eq!(
            notes.len(),
            before - 1,
            "the unverified bytes are noted once"
        );
        for layer in run["topk"].as_array_mut().unwrap() {
            let unit = layer.as_object_mut().unwrap().remove("unit");
            assert_eq!(
                unit,
                Some(serde_json::json!({"unit": "token", "tokens": 1}))
            );
        }
        let rules = run["rules"].as_array_mut().unwrap();
        // The rule names the relative band now (issue 28); these v1 runs
        // recorded an absolute one, read as that build read it.
        for rule in rules.iter_mut() {
            if let Some(text) = rule.as_str() {
                *rule = text
                    .replace(
                        shadowtrace_analyzer::verdict::RECORDED_CHURN_RULE,
                        "churn within the recorded band excluded",
                    )
                    .into();
            }
        }
        let before = rules.len();
        rules.retain(|r| r != shadowtrace_analyzer::verdict::CONVENTION_RULE);
        assert_eq!(
            rules.len(),
            before - 1,
            "the convention rule is listed once"
        );
    }
    got
}

#[test]
fn the_same_selections_as_v1_and_v2_give_the_same_analysis() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, records) = selections();
    let v1 = write(tmp.path(), &spec, 1, &records);
    let v2 = write(tmp.path(), &spec, 2, &records);
    let (a1, a2) = (analysis_json(&[v1], None), analysis_json(&[v2], None));
    assert_eq!(a1, as_v1(a2.clone()));
    // Not vacuous: the run has churn, a collapse and a churn-unknown row.
    let run = &a2["runs"][0];
    assert!(run["topk_verdict"].is_object(), "{run:#}");
    let layers = run["topk"].as_array().unwrap();
    let unknown: u64 = layers
        .iter()
        .map(|l| l["churn_unknown_rows"].as_u64().unwrap())
        .sum();
    assert_eq!(unknown, 1);
    assert!(
        layers
            .iter()
            .any(|l| l["churn_keys_mean"].as_f64().unwrap() > 0.0)
    );
}

#[test]
fn a_narrower_churn_margin_reads_v2_boundary_lists_and_equals_full_lists() {
    let tmp = tempfile::tempdir().unwrap();
    let (spec, records) = selections();
    let v1 = write(tmp.path(), &spec, 1, &records);
    let v2 = write(tmp.path(), &spec, 2, &records);
    // Synthetic boundary keys lie uniformly within half the band of the k-th
    // score: a quarter of the band keeps about half of them as churn.
    let margin = Some(BOUNDARY_BAND / 4.0);
    let (a1, a2) = (
        analysis_json(&[v1], margin),
        analysis_json(std::slice::from_ref(&v2), margin),
    );
    assert_eq!(a1, as_v1(a2.clone()));
    let recorded = analysis_json(&[v2], None);
    let churn = |a: &serde_json::Value| -> Vec<f64> {
        a["runs"][0]["topk"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["churn_keys_mean"].as_f64().unwrap())
            .collect()
    };
    let (narrow, full) = (churn(&a2), churn(&recorded));
    assert!(
        narrow.iter().zip(&full).all(|(n, f)| n <= f) && narrow != full,
        "the narrower margin removes less churn: {narrow:?} vs {full:?}"
    );
}
