//! Verdicts a CI can read, and nothing unknown read as a pass: a damaged
//! top-k count, a site or shadow mode with no captures, dense-only top-k,
//! a run read twice, a part its closed manifest does not list, doubled
//! manifest counts; the `--fail-on` lines and exit status, the summary
//! lines and the JSON verdict.

use std::path::{Path, PathBuf};

use polars::prelude::SerReader;

use shadowtrace_analyzer::fail_on::{self, FailOn};
use shadowtrace_analyzer::judged::{Question, why_not_judged};
use shadowtrace_analyzer::report::{render_summary, render_terminal, write_report};
use shadowtrace_analyzer::verdict::{Status, Thresholds};
use shadowtrace_analyzer::{Analysis, Options, Run, RunProblem, analyze};
use shadowtrace_schemas::Convention;
use shadowtrace_tracer::synth::SynthSpec;

use crate::analyze_verdicts::{clean, write};
use crate::summary_check::{plant, with_i32};
use crate::support::edit_manifest;

fn analysed(paths: &[PathBuf], thresholds: Thresholds) -> Analysis {
    let options = Options {
        thresholds,
        ..Options::default()
    };
    analyze(paths, &[], &options, |_, _, _| {}).unwrap()
}

fn asked(values: &[&str]) -> FailOn {
    FailOn::parse(values, false).unwrap()
}

/// The `topk@L2` run of the demo's kind: a selection collapse from layer 2.
fn collapsed(run_id: &str) -> SynthSpec {
    SynthSpec {
        collapse_from_layer: Some(2),
        ..clean(run_id)
    }
}

#[test]
fn a_top_k_row_sharing_more_keys_than_prod_selected_is_not_measured_and_its_part_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), &[clean("badcount")]).remove(0);
    let at = plant(&dir, |name, c, row| {
        (name == "shared").then(|| with_i32(c, row, |_| 5000))
    });
    // Before: `attempt to subtract with overflow` in RowOverlap::differing_keys.
    let a = analysed(std::slice::from_ref(&dir), Thresholds::default());
    let run = &a.runs[0];
    let why = why_not_judged(&run.not_measured, Question::Topk).unwrap();
    assert!(
        why.contains("topk/part-00000.parquet: 1 top-k row whose counts contradict each other")
            && why.contains(&format!(
                "the first at step {}, layer {}, token {}: shared 5000 > prod_selected",
                at.step, at.layer, at.token
            )),
        "{why}"
    );
    assert_eq!(a.verdict.runs[0].status, Status::NotJudged);
    let informative: usize = run.topk.iter().map(|l| l.informative_rows).sum();
    let clean_run = &analysed(
        &write(&tmp.path().join("c"), &[clean("c")]),
        Thresholds::default(),
    )
    .runs[0];
    let clean_informative: usize = clean_run.topk.iter().map(|l| l.informative_rows).sum();
    assert_eq!(informative + 1, clean_informative, "the row is left out");
    assert_eq!(fail_on::exit(&a, &asked(&["topk"])).code, 2);
}

#[test]
fn a_shadow_mode_or_site_with_no_captures_is_not_judged_and_fails_fail_on_with_2() {
    let tmp = tempfile::tempdir().unwrap();
    // The synthetic run records the local shadow only.
    let dirs = write(tmp.path(), &[clean("local-only")]);
    for (site, mode, expected) in [
        ("layer_out", Some("free"), "no layer_out/free captures"),
        ("bogus", None, "no bogus/local captures"),
    ] {
        let t = Thresholds {
            hidden_site: site.to_owned(),
            hidden_mode: mode.map(str::to_owned),
            ..Thresholds::default()
        };
        let a = analysed(&dirs, t);
        let run = &a.runs[0];
        assert_eq!(
            why_not_judged(&run.not_measured, Question::Hidden).as_deref(),
            Some(expected)
        );
        let text = render_terminal(&a);
        assert!(
            text.contains(&format!("hidden divergence: not judged: {expected}")),
            "{text}"
        );
        for values in [&["hidden"][..], &["any"]] {
            let exit = fail_on::exit(&a, &asked(values));
            assert_eq!(exit.code, 2, "{values:?}: {exit:?}");
            assert!(exit.lines.iter().any(|l| l.contains(expected)), "{exit:?}");
        }
    }
    // The mode it recorded is judged.
    let a = analysed(&dirs, Thresholds::default());
    assert!(a.runs[0].judged(Question::Hidden));
    assert_eq!(fail_on::exit(&a, &asked(&["hidden"])).code, 0);
}

#[test]
fn a_run_whose_top_k_rows_are_all_dense_says_n_a_not_none() {
    let tmp = tempfile::tempdir().unwrap();
    // 16 tokens, k = 16: no query sees more than k keys.
    let dirs = write(
        tmp.path(),
        &[SynthSpec {
            tokens: 16,
            ..clean("dense")
        }],
    );
    let a = analysed(&dirs, Thresholds::default());
    assert_eq!(
        a.runs[0]
            .topk
            .iter()
            .map(|l| l.informative_rows)
            .sum::<usize>(),
        0
    );
    let text = render_terminal(&a);
    assert!(
        text.contains("top-k divergence:  n/a (dense: no row saw more than k keys)"),
        "{text}"
    );
}

#[test]
fn the_layer_table_and_the_grid_read_the_hidden_site_the_verdict_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = write(tmp.path(), &[clean("attn")]);
    let t = Thresholds {
        hidden_site: "attn_out".to_owned(),
        ..Thresholds::default()
    };
    let a = analysed(&dirs, t);
    let run = &a.runs[0];
    let p95 = |site: &str| {
        run.hidden
            .iter()
            .find(|s| s.layer == 0 && s.site == site)
            .and_then(|s| s.rel_l2_err)
            .map(|e| format!("{:.2e}", e.p95))
            .unwrap()
    };
    assert_ne!(p95("attn_out"), p95("layer_out"), "the sites differ");
    let text = render_terminal(&a);
    let table = text.split("run attn:").nth(1).unwrap();
    let mut lines = table
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("layer "));
    let header = lines.next().unwrap();
    assert!(
        header.contains("attn_out p95") && !header.contains("hidden p95"),
        "{header}"
    );
    let layer0 = lines.next().unwrap();
    assert!(layer0.contains(&p95("attn_out")), "{layer0}");
    assert!(text.contains("worst attn_out p95"), "{text}");
}

fn mismatched(run_id: &str) -> SynthSpec {
    SynthSpec {
        conventions: vec![Convention {
            name: "indexer_hadamard".to_owned(),
            engine: false.into(),
            model: true.into(),
            engine_source: "engine module".to_owned(),
            model_source: "config.json".to_owned(),
            engine_assumed: false,
        }],
        ..clean(run_id)
    }
}

#[test]
fn the_grid_and_runs_parquet_show_every_verdict_kind_fail_on_knows() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = write(tmp.path(), &[mismatched("hadamard")]);
    let a = analysed(&dirs, Thresholds::default());
    let text = render_terminal(&a);
    let grid: Vec<&str> = text
        .split("grid by")
        .nth(1)
        .unwrap()
        .lines()
        .take(3)
        .collect();
    assert!(grid[2].contains("convention x1"), "{grid:?}");
    let report = tmp.path().join("report");
    write_report(&report, &a).unwrap();
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("convention x1"), "{md}");
    let file = std::fs::File::open(report.join("metrics/runs.parquet")).unwrap();
    let runs = polars::prelude::ParquetReader::new(file).finish().unwrap();
    let column = runs.column("convention_mismatches").unwrap().str().unwrap();
    assert_eq!(
        column.get(0),
        Some("convention mismatch: indexer hadamard: engine false, model true")
    );
    assert!(runs.column("capture_check").is_ok());
}

#[test]
fn a_run_given_twice_is_read_once_and_copies_of_a_run_are_never_a_determinism_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), &[clean("twice")]).remove(0);
    let a = analysed(&[dir.clone(), dir.clone()], Thresholds::default());
    assert_eq!(a.runs.len(), 1);
    assert!(a.determinism.is_empty(), "{:?}", a.determinism);
    assert!(
        a.warnings[0].contains("given more than once, read once"),
        "{:?}",
        a.warnings
    );
    let copy = tmp.path().join("copies/twice");
    copy_dir(&dir, &copy);
    let a = analysed(&[dir, copy], Thresholds::default());
    assert_eq!(a.runs.len(), 2);
    assert!(a.determinism.is_empty(), "{:?}", a.determinism);
    assert!(
        a.warnings
            .iter()
            .any(|w| w.contains("run id twice is held by 2 directories")),
        "{:?}",
        a.warnings
    );
    // Two runs of the same prompt are still paired.
    let b = analysed(
        &write(&tmp.path().join("pair"), &[clean("one"), clean("two")]),
        Thresholds::default(),
    );
    assert_eq!(b.determinism.len(), 1);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap().path();
        let target = to.join(entry.file_name().unwrap());
        if entry.is_dir() {
            copy_dir(&entry, &target);
        } else {
            std::fs::copy(&entry, &target).unwrap();
        }
    }
}

#[test]
fn a_part_a_closed_manifest_does_not_list_is_a_problem_and_not_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), &[clean("extra")]).remove(0);
    let hidden = dir.join("hidden");
    let rows = Run::open(&dir)
        .unwrap()
        .rows(shadowtrace_schemas::Table::Hidden);
    std::fs::copy(
        hidden.join("part-00000.parquet"),
        hidden.join("part-00001.parquet"),
    )
    .unwrap();
    let run = Run::open(&dir).unwrap();
    assert_eq!(
        run.rows(shadowtrace_schemas::Table::Hidden),
        rows,
        "not read"
    );
    assert!(
        matches!(&run.problems[..], [RunProblem::UnlistedPart { path, .. }] if path.ends_with("hidden/part-00001.parquet")),
        "{:?}",
        run.problems
    );
    let a = analysed(&[dir], Thresholds::default());
    let why = why_not_judged(&a.runs[0].not_measured, Question::Hidden).unwrap();
    assert!(why.contains("hidden/part-00001.parquet"), "{why}");
    assert_eq!(fail_on::exit(&a, &asked(&["any"])).code, 2);
}

#[test]
fn doubled_manifest_row_counts_leave_every_verdict_not_judged_and_fail_on_any_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), &[clean("doubled")]).remove(0);
    edit_manifest(&dir, |m| {
        for table in m["tables"].as_object_mut().unwrap().values_mut() {
            let rows = table["rows"].as_u64().unwrap();
            table["rows"] = (2 * rows).into();
        }
    });
    // inspect's problems, and analyze's verdicts, from the same check.
    assert!(!Run::open(&dir).unwrap().problems.is_empty());
    let a = analysed(&[dir], Thresholds::default());
    let run = &a.runs[0];
    for q in [Question::Nonfinite, Question::Hidden, Question::Topk] {
        assert!(!run.judged(q), "{q:?}: {:?}", run.not_measured);
    }
    let exit = fail_on::exit(&a, &asked(&["any"]));
    assert_eq!(exit.code, 2, "{exit:?}");
}

#[test]
fn nothing_read_exits_2_with_or_without_fail_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), &[clean("garbage")]).remove(0);
    std::fs::write(dir.join("manifest.json"), b"{ not json").unwrap();
    let a = analysed(&[dir], Thresholds::default());
    assert!(a.runs.is_empty() && a.skipped.len() == 1);
    for values in [&[][..], &["any"]] {
        let exit = fail_on::exit(&a, &asked(values));
        assert_eq!(exit.code, 2, "{values:?}");
        assert_eq!(exit.lines, ["error: no run could be read (1 skipped)"]);
    }
    assert_eq!(a.verdict.status, Status::NotJudged);
}

#[test]
fn fail_on_names_each_failing_run_and_the_verdicts_that_failed_it() {
    let tmp = tempfile::tempdir().unwrap();
    let nan = SynthSpec {
        planted_nan: Some((1, "mlp_out", 60)),
        ..collapsed("faulted")
    };
    let a = analysed(
        &write(tmp.path(), &[nan, clean("healthy")]),
        Thresholds::default(),
    );
    let exit = fail_on::exit(&a, &asked(&["any"]));
    assert_eq!(exit.code, 1);
    let topk = a.runs[0].topk_verdict.as_ref().unwrap();
    assert_eq!(exit.lines.len(), 1, "the healthy run passes: {exit:?}");
    let j = exit.lines[0]
        .strip_prefix("FAIL (--fail-on any): faulted nonfinite@L1 mlp_out t60; topk@L2 (J ")
        .and_then(|rest| rest.strip_suffix(" < 0.8)"))
        .unwrap_or_else(|| panic!("{exit:?}"));
    assert!((j.parse::<f64>().unwrap() - topk.value).abs() < 1e-4, "{j}");
    let exit = fail_on::exit(&a, &asked(&["hidden", "topk"]));
    assert!(
        exit.lines[0].starts_with("FAIL (--fail-on hidden,topk): faulted topk@L2"),
        "{exit:?}"
    );
}

#[test]
fn the_summary_has_one_line_per_run_and_the_json_a_verdict_of_every_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = write(
        tmp.path(),
        &[
            collapsed("faulted"),
            clean("healthy"),
            mismatched("hadamard"),
        ],
    );
    let a = analysed(&dirs, Thresholds::default());
    let summary = render_summary(&a);
    let lines: Vec<&str> = summary.lines().collect();
    assert_eq!(lines.len(), 3, "{summary}");
    assert!(
        lines[0].starts_with("faulted FAIL topk@L2 (J "),
        "{summary}"
    );
    assert_eq!(lines[1], "healthy PASS");
    assert_eq!(
        lines[2],
        "hadamard FAIL convention indexer hadamard (engine false, model true)"
    );
    let json = serde_json::to_value(&a).unwrap();
    let verdict = &json["verdict"];
    assert_eq!(verdict["status"], "fail");
    let kinds: Vec<&str> = verdict["kinds"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        kinds,
        [
            "cache",
            "capture",
            "convention",
            "hidden",
            "nonfinite",
            "topk"
        ]
    );
    assert_eq!(
        verdict["kinds"]["topk"][0]
            .as_str()
            .unwrap()
            .split(':')
            .next(),
        Some("faulted")
    );
    assert_eq!(verdict["runs"][1]["status"], "pass");
}
