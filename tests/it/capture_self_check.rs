//! What the reports say of a run's capture self-check where it could not
//! judge: a layer with no informative row, a producer that ran no check, and
//! a check that cannot be read (a broken run, never "no check").

use std::path::Path;

use shadowtrace_analyzer::judged::{Question, why_not_judged};
use shadowtrace_analyzer::report::{render_markdown, render_terminal};
use shadowtrace_analyzer::{Options, Run, analyze, capture_check, inspect};

use crate::analyze_verdicts::{clean, write};

fn with_check(path: &Path, check: serde_json::Value) {
    crate::support::edit_manifest(path, |m| {
        m["engine"]["name"] = "vllm".into();
        m["engine"]["version"] = "0.34.0".into();
        m["settings"]["capture_check"] = check;
    });
}

#[test]
fn a_layer_the_check_had_no_informative_row_at_is_not_judged_never_counted_consistent() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("partly-checked")]);
    with_check(
        &paths[0],
        serde_json::json!({
            "tolerance": 1e-3,
            "sources": ["captured: production's top-k input"],
            "layers": {
                "1": {"rows": 40, "disagree": 0, "first_token": null},
                "3": {"rows": 0, "disagree": 0, "first_token": null}
            }
        }),
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let text = render_terminal(&a);
    assert!(
        text.contains(
            "  capture self-check: 1 layer, 40 informative rows, every selection production's own \
             scores' top-k (tolerance 1e-3; scores captured: production's top-k input)\n  \
             capture self-check: not judged at layer 3: no informative row (every row saw at most \
             k keys)\n"
        ),
        "{text}"
    );
    assert!(!a.runs[0].capture_inconsistent());
}

#[test]
fn a_run_whose_producer_ran_no_check_says_not_run_and_why() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("unsaid"), clean("said")]);
    crate::support::edit_manifest(&paths[1], |m| {
        // As the producers that run no check write it (the hooks' writer,
        // tracer/src/trace/mod.rs): `run` false, why, and the empty fields.
        m["settings"]["capture_check"] = serde_json::json!({
            "run": false,
            "why": "DeepSeek-V4's compressed selection: the check is not calibrated there",
            "tolerance": 0.0, "sources": [], "layers": {}
        });
    });
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let text = render_terminal(&a);
    let md = render_markdown(&a, &[]);
    for (run, why) in [
        ("unsaid", "the run records no check"),
        (
            "said",
            "DeepSeek-V4's compressed selection: the check is not calibrated there",
        ),
    ] {
        let line = format!("capture self-check: not run ({why})");
        let section = text.split(&format!("run {run}:")).nth(1).unwrap();
        assert!(
            section.lines().nth(1) == Some(&format!("  {line}")),
            "{run}: {text}"
        );
        assert!(md.contains(&format!("- {line}\n")), "{md}");
        let inspected = inspect::render_run(&Run::open(&tmp.path().join(run)).unwrap());
        assert!(
            inspected.contains(&format!("capture    {line}\n")),
            "{inspected}"
        );
    }
    // Nothing was missing: the run's verdicts stand.
    assert!(a.runs.iter().all(|r| r.judged(Question::Topk)));
}

#[test]
fn an_unreadable_check_is_a_broken_run_said_everywhere_never_no_check() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("garbled")]);
    with_check(
        &paths[0],
        serde_json::json!({"tolerance": "tight", "layers": {}}),
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let run = &a.runs[0];
    assert!(run.capture_check.is_none());
    assert!(!run.judged(Question::Capture) && !run.judged(Question::Topk));
    assert!(
        why_not_judged(&run.not_measured, Question::Capture)
            .unwrap()
            .starts_with("settings.capture_check unreadable: ")
    );
    let text = render_terminal(&a);
    let section = text.split("run garbled:").nth(1).unwrap();
    assert!(
        section
            .lines()
            .nth(1)
            .unwrap()
            .starts_with("  CAPTURE SELF-CHECK UNREADABLE: settings.capture_check unreadable: "),
        "{text}"
    );
    assert!(
        render_markdown(&a, &[]).contains("- **CAPTURE SELF-CHECK UNREADABLE: "),
        "bold, as an alarm"
    );
    let opened = Run::open(&paths[0]).unwrap();
    assert!(inspect::render_run(&opened).contains("CAPTURE    CAPTURE SELF-CHECK UNREADABLE: "));
    let problem = capture_check::problem(&opened).expect("inspect fails on it");
    assert!(
        problem
            .to_string()
            .contains("settings.capture_check unreadable: "),
        "{problem}"
    );
    let json = serde_json::to_value(run).unwrap();
    assert!(
        json["capture_check_unreadable"]
            .as_str()
            .unwrap()
            .starts_with("settings.capture_check unreadable: ")
    );
}

#[test]
fn a_reference_engine_run_says_why_it_runs_no_check() {
    use shadowtrace_tracer::model::{Model, synthetic};
    use shadowtrace_tracer::trace::{TraceOptions, trace};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    synthetic::write(&dir, &synthetic::glm51_config(2), 13).unwrap();
    let model = Model::open(&dir, tch::Device::Cpu).unwrap();
    let ids: Vec<i64> = (0..32).map(|i| (i * 37 + 11) % 256).collect();
    let run = tmp.path().join("runs/reference");
    tch::no_grad(|| {
        trace(
            &model,
            &ids,
            "reference",
            &run,
            &TraceOptions::new("synthetic"),
        )
    })
    .unwrap();
    let a = analyze(&[run], &[], &Options::default(), |_, _, _| {}).unwrap();
    assert_eq!(
        a.runs[0].capture_lines(),
        (
            false,
            vec![
                "capture self-check: not run (the reference engine selects from the scores it \
                 records itself: no engine's selection was read, so there is no capture to check)"
                    .to_owned()
            ]
        )
    );
}

#[test]
fn a_layer_short_of_winners_is_a_judged_top_k_verdict_and_a_misread_layer_stays_inconsistent() {
    use shadowtrace_analyzer::fail_on::{self, FailOn};
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("drops-winners"), clean("misread")]);
    let rule = serde_json::json!({"kept_top": 0.25, "recall": 0.5});
    // As the hooks wrote it for transformers' GLM with an overflowing candidate buffer at
    // layer 0 (tests/python/test_hooks_short_of_winners.py).
    let drops = serde_json::json!({"rows": 1024, "disagree": 458, "first_token": 2050,
        "unchecked": 0, "short_of_winners": 458, "short_kept_top": 0.3759765625,
        "short_recall": 0.68994140625, "short_worst_rank_beyond_k": 1024});
    let agree = serde_json::json!({"rows": 1024, "disagree": 0, "first_token": null,
        "unchecked": 0, "short_of_winners": 0});
    with_check(
        &paths[0],
        serde_json::json!({"tolerance": 1e-3, "sources": ["captured"],
            "short_of_winners_rule": rule, "layers": {"0": drops, "1": agree}}),
    );
    // The same layer read one query late: no row short of winners.
    with_check(
        &paths[1],
        serde_json::json!({"tolerance": 1e-3, "sources": ["captured"],
            "short_of_winners_rule": rule, "layers": {"0": {"rows": 1024, "disagree": 996,
            "first_token": 2048, "unchecked": 0, "short_of_winners": 0}, "1": agree}}),
    );
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let (drops_run, misread) = (&a.runs[0], &a.runs[1]);
    assert!(!drops_run.capture_inconsistent());
    assert!(drops_run.has_verdict());
    assert!(
        drops_run.judged(Question::Topk),
        "{:?}",
        drops_run.not_measured
    );
    assert!(misread.capture_inconsistent());
    assert!(!misread.judged(Question::Topk));
    let text = render_terminal(&a);
    assert!(
        text.contains(
            "  TOP-K SHORT OF WINNERS at layer 0: 458 of 1024 informative rows select production's \
             top keys short of some (458 of 458 that disagree; recall >= 0.69, production's top \
             0.38k kept whole, selected keys down to rank k+1024; rule: recall >= 0.5 and top \
             0.25k kept, in at least 50% of the rows that disagree): the top-k kernel drops \
             winners; the adapter reads the engine\n  capture self-check: 1 layer, 1024 \
             informative rows, every selection production's own scores' top-k"
        ),
        "{text}"
    );
    assert!(
        text.contains("  CAPTURE INCONSISTENT at layer 0: 996 of 1024 informative rows (97.3%)"),
        "{text}"
    );
    assert!(render_markdown(&a, &[]).contains("- **TOP-K SHORT OF WINNERS at layer 0: "));
    // --fail-on topk fails the run on it; the misread fails every --fail-on.
    let exit = fail_on::exit(&a, &FailOn::parse(&["topk"], false).unwrap());
    assert_eq!(exit.code, 1, "{exit:?}");
    assert!(
        exit.lines.iter().any(|l| l.contains("drops-winners")
            && l.contains("topk short of winners@L0 (458 of 1024 rows)")),
        "{exit:?}"
    );
    let json = serde_json::to_value(&a).unwrap();
    let check = &json["runs"][0]["capture_check"];
    assert_eq!(check["short_of_winners_rule"], rule);
    assert_eq!(check["layers"][0]["short_of_winners"], 458);
    assert_eq!(check["layers"][0]["short_worst_rank_beyond_k"], 1024);
}
