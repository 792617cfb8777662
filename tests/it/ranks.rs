//! A request traced on several ranks is one run: the analyzer merges the
//! ranks (same `request` tag, world size above 1) and says whether they agree.

use std::path::Path;

use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_tracer::synth::SynthSpec;

use crate::analyze_verdicts::{clean, write};
use crate::support::edit_manifest;

/// Marks a written run as one rank of a tensor-parallel request.
fn as_rank(run: &Path, rank: u32, world: u32, request: &str) {
    let path = run.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    manifest["parallelism"]["rank"] = rank.into();
    manifest["parallelism"]["world_size"] = world.into();
    manifest["parallelism"]["tp"] = world.into();
    manifest["tags"]["request"] = request.into();
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}

#[test]
fn the_ranks_of_one_request_are_read_as_one_run_that_agrees() {
    let tmp = tempfile::tempdir().unwrap();
    let planted = |id: &str| SynthSpec {
        planted_nan: Some((2, "layer_out", 9)),
        ..clean(id)
    };
    let paths = write(
        tmp.path(),
        &[planted("r-rank0"), planted("r-rank1"), clean("single")],
    );
    as_rank(&paths[0], 0, 2, "r");
    as_rank(&paths[1], 1, 2, "r");
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    let ids: Vec<&str> = a.runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(ids, ["r-rank0", "single"]);
    let merged = &a.runs[0];
    let ranks = merged.ranks.as_ref().unwrap();
    assert_eq!(ranks.ranks, [0, 1]);
    assert_eq!(ranks.run_ids, ["r-rank0", "r-rank1"]);
    assert!(ranks.same_verdicts);
    assert_eq!(
        (ranks.max_jaccard_diff, ranks.max_hidden_p95_diff),
        (0.0, 0.0)
    );
    assert_eq!(merged.onset.as_ref().unwrap().layer, 2);
    assert!(a.runs[1].ranks.is_none());
    assert!(
        a.determinism
            .iter()
            .all(|d| d.a != "r-rank0" || d.b != "r-rank1")
    );
}

#[test]
fn ranks_that_reach_different_verdicts_are_reported_as_disagreeing() {
    let tmp = tempfile::tempdir().unwrap();
    let rank1 = SynthSpec {
        planted_nan: Some((3, "layer_out", 5)),
        ..clean("q-rank1")
    };
    let paths = write(tmp.path(), &[clean("q-rank0"), rank1]);
    as_rank(&paths[0], 0, 2, "q");
    as_rank(&paths[1], 1, 2, "q");
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert_eq!(a.runs.len(), 1);
    let ranks = a.runs[0].ranks.as_ref().unwrap();
    assert!(!ranks.same_verdicts);
    let text = shadowtrace_analyzer::report::render_terminal(&a);
    assert!(
        text.contains("ranks 0, 1 read as one run: RANKS DISAGREE"),
        "{text}"
    );
}

#[test]
fn runs_of_one_rank_each_stay_separate() {
    let tmp = tempfile::tempdir().unwrap();
    let paths = write(tmp.path(), &[clean("a"), clean("b")]);
    as_rank(&paths[0], 0, 1, "same");
    as_rank(&paths[1], 0, 1, "same");
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert_eq!(a.runs.len(), 2);
}

#[test]
fn merged_ranks_sum_counters_keep_every_note_and_any_incomplete_rank_makes_the_run_incomplete() {
    let tmp = tempfile::tempdir().unwrap();
    // Rank 0 lacks layer 4; rank 1 is incomplete and counted more errors.
    let rank0 = SynthSpec {
        layers: 4,
        ..clean("m-rank0")
    };
    let paths = write(tmp.path(), &[rank0, clean("m-rank1")]);
    as_rank(&paths[0], 0, 2, "m");
    as_rank(&paths[1], 1, 2, "m");
    edit_manifest(&paths[0], |m| {
        m["counters"]["hook_errors"] = 1.into();
    });
    edit_manifest(&paths[1], |m| {
        m["counters"]["hook_errors"] = 2.into();
        m["counters"]["sites_disabled"] = 1.into();
        m["status"] = "incomplete".into();
    });
    let a = analyze(&paths, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert_eq!(a.runs.len(), 1);
    let merged = &a.runs[0];
    assert_eq!(merged.counters["hook_errors"], 3, "{:?}", merged.counters);
    assert_eq!(merged.counters["sites_disabled"], 1);
    assert!(!merged.complete, "rank 1 never closed its run");
    assert!(
        merged
            .notes
            .iter()
            .any(|n| n.starts_with("rank 1: run is incomplete")),
        "{:?}",
        merged.notes
    );
    assert!(
        merged
            .notes
            .iter()
            .any(|n| n == "counters are summed over ranks 0, 1"),
        "{:?}",
        merged.notes
    );
    let ranks = serde_json::to_value(merged.ranks.as_ref().unwrap()).unwrap();
    assert_eq!(
        ranks["uneven_layers"],
        serde_json::json!([{"layer": 4, "ranks": [1]}]),
        "{ranks}"
    );
    let text = shadowtrace_analyzer::report::render_terminal(&a);
    assert!(text.contains("layer 4 recorded on rank 1 only"), "{text}");
}
