//! Outcomes beside numerics (issue 40): the user's own `outcome` tag on each
//! run, shown in the grid, the side-by-side table, each run's section, the
//! metrics Parquet and the JSON; never inferred, and a value that is no
//! outcome flagged wherever it shows.

use std::path::{Path, PathBuf};

use polars::prelude::{DataType, ParquetReader, SerReader};
use shadowtrace_analyzer::outcome::Outcome;
use shadowtrace_analyzer::report::{render_markdown, render_terminal, write_report};
use shadowtrace_analyzer::{Analysis, Options, analyze};
use shadowtrace_tracer::synth::SynthSpec;
use shadowtrace_tracer::{RunWriter, WriterOptions};

use crate::analyze_verdicts::clean;

/// Writes `spec`'s run with the run tags `tags`, as the reference engine's
/// `TraceOptions::tags` (and `SHADOWTRACE_TAGS`) hand them to the writer.
fn tagged(dir: &Path, spec: &SynthSpec, tags: &[(&str, &str)]) -> PathBuf {
    let path = dir.join(&spec.run_id);
    let mut identity = spec.identity();
    for (k, v) in tags {
        identity.tags.insert((*k).to_owned(), (*v).to_owned());
    }
    let writer = RunWriter::create(&path, identity, WriterOptions::default()).unwrap();
    for record in spec.records() {
        let _ = writer.send(record);
    }
    writer.close().unwrap();
    path
}

/// GLM tool prompts: one answer right, one corrupted; a GLM no-tool prompt
/// scored 0.73; a DeepSeek tool prompt whose tag is no outcome; a DeepSeek
/// no-tool prompt with none.
fn grid() -> (tempfile::TempDir, Analysis) {
    let tmp = tempfile::tempdir().unwrap();
    let deepseek = |id: &str| SynthSpec {
        model: "synthetic/deepseek-v32-shaped".to_owned(),
        seed: 5,
        ..clean(id)
    };
    let no_tool = |spec: SynthSpec| SynthSpec {
        prompt_kind: "no_tool".to_owned(),
        ..spec
    };
    let paths = [
        tagged(tmp.path(), &clean("glm-tool-a"), &[("outcome", "correct")]),
        tagged(
            tmp.path(),
            &SynthSpec {
                collapse_from_layer: Some(3),
                // another prompt of the same bucket: no determinism pair with glm-tool-a
                tokens: 72,
                ..clean("glm-tool-b")
            },
            &[("outcome", "corrupted")],
        ),
        tagged(
            tmp.path(),
            &no_tool(clean("glm-plain")),
            &[("outcome", "0.73")],
        ),
        tagged(tmp.path(), &deepseek("ds-tool"), &[("outcome", "maybe")]),
        tagged(tmp.path(), &no_tool(deepseek("ds-plain")), &[]),
    ];
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    (tmp, a)
}

#[test]
fn outcomes_in_the_terminal_grid_side_by_side_and_runs_are_pinned() {
    let (_tmp, a) = grid();
    insta::assert_snapshot!(render_terminal(&a));
}

#[test]
fn outcomes_in_the_markdown_report_are_pinned() {
    let (_tmp, a) = grid();
    insta::assert_snapshot!(render_markdown(&a, &[]));
}

#[test]
fn each_run_reads_its_own_tag_and_a_run_without_one_has_none() {
    let (_tmp, a) = grid();
    let outcome = |id: &str| {
        a.runs
            .iter()
            .find(|r| r.run_id == id)
            .unwrap()
            .outcome
            .clone()
    };
    assert_eq!(outcome("glm-tool-a"), Some(Outcome::Correct));
    assert_eq!(outcome("glm-tool-b"), Some(Outcome::Corrupted));
    assert_eq!(outcome("glm-plain"), Some(Outcome::Score(0.73)));
    assert!(matches!(
        outcome("ds-tool"),
        Some(Outcome::Malformed { value, .. }) if value == "maybe"
    ));
    assert_eq!(outcome("ds-plain"), None, "never inferred");
    // Nothing is judged from an outcome: the corrupted run's verdict is its numerics'.
    let corrupted = a.runs.iter().find(|r| r.run_id == "glm-tool-b").unwrap();
    assert_eq!(corrupted.topk_verdict.as_ref().map(|v| v.layer), Some(3));
    let correct = a.runs.iter().find(|r| r.run_id == "glm-tool-a").unwrap();
    assert!(!correct.has_verdict());
}

#[test]
fn outcomes_reach_the_metrics_parquet_and_the_json() {
    let (tmp, a) = grid();
    let dir = tmp.path().join("report");
    write_report(&dir, &a).unwrap();
    let runs = ParquetReader::new(std::fs::File::open(dir.join("metrics/runs.parquet")).unwrap())
        .finish()
        .unwrap();
    let column = |name: &str| runs.column(name).unwrap().as_materialized_series().clone();
    assert_eq!(column("outcome_score").dtype(), &DataType::Float64);
    assert_eq!(column("outcome_correct").dtype(), &DataType::Boolean);
    let ids = column("run_id");
    let ids = ids.str().unwrap();
    let row = |id: &str| (0..ids.len()).find(|&i| ids.get(i) == Some(id)).unwrap();
    let raw = column("outcome");
    let raw = raw.str().unwrap();
    assert_eq!(raw.get(row("ds-tool")), Some("maybe"));
    assert_eq!(raw.get(row("ds-plain")), None);
    let correct = column("outcome_correct");
    let correct = correct.bool().unwrap();
    assert_eq!(correct.get(row("glm-tool-a")), Some(true));
    assert_eq!(correct.get(row("glm-tool-b")), Some(false));
    assert_eq!(correct.get(row("glm-plain")), None);
    let score = column("outcome_score");
    let score = score.f64().unwrap();
    assert!((score.get(row("glm-plain")).unwrap() - 0.73).abs() < 1e-12);
    assert_eq!(score.get(row("glm-tool-a")), None);
    let malformed = column("outcome_malformed");
    let malformed = malformed.str().unwrap();
    assert!(
        malformed
            .get(row("ds-tool"))
            .unwrap()
            .starts_with("tag outcome=\"maybe\" is not")
    );
    assert_eq!(malformed.get(row("glm-plain")), None);

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("analysis.json")).unwrap()).unwrap();
    let run = |id: &str| {
        json["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["run_id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(run("glm-tool-a")["outcome"], "correct");
    assert_eq!(run("glm-plain")["outcome"]["score"], 0.73);
    assert_eq!(run("ds-tool")["outcome"]["malformed"]["value"], "maybe");
    assert!(run("ds-plain").get("outcome").is_none());
    let glm_tool = json["grid"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["key"][0] == "synthetic/glm5-shaped" && g["key"][1] == "tool")
        .unwrap()
        .clone();
    assert_eq!(
        glm_tool["outcomes"],
        serde_json::json!({"correct": 1, "corrupted": 1, "scored": 0, "mean_score": null,
                           "unrecorded": 0, "malformed": 0})
    );
}

#[test]
fn a_grid_whose_runs_record_no_outcome_has_no_outcome_column() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = [tagged(tmp.path(), &clean("plain"), &[])];
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert!(!a.grid.has_outcomes());
    let text = render_terminal(&a);
    assert!(!text.contains("outcome"), "{text}");
}
