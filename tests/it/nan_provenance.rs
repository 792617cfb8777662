//! NaN provenance on faults with known answers: the reference engine traced
//! with a NaN planted at one token, in one token's KV entry, in the reserved
//! KV slot read through unused top-k entries, and in the last row (where an
//! engine appends its padding rows); the analyzer must name where each was
//! produced, what it explains, and what leaked through a mask.
//!
//! The answers follow from the engine's attention, not from the analyzer: a
//! query reads keys at or before it (every one while it sees at most k), and
//! a NaN key's score is NaN before the mask is added, so it poisons the
//! softmax of every query, including those the mask hides it from.

use std::path::{Path, PathBuf};

use shadowtrace_analyzer::metrics::nan_provenance::{Provenance, SiteSpread};
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_tracer::model::deviation::{Deviation, DeviationKind};
use shadowtrace_tracer::model::fault::{Fault, NonFiniteValue};
use shadowtrace_tracer::model::{Model, synthetic};
use shadowtrace_tracer::trace::{TraceOptions, trace};
use tch::Device;

const TOKENS: i64 = 48;

/// A 3-layer GLM-shaped checkpoint with index_topk `k`.
fn checkpoint(dir: &Path, k: i64) -> Model {
    let mut config = synthetic::glm51_config(3);
    config["index_topk"] = k.into();
    synthetic::write(dir, &config, 7).unwrap();
    Model::open(dir, Device::Cpu).unwrap()
}

fn traced(
    model: &Model,
    runs: &Path,
    name: &str,
    faults: Vec<Fault>,
    deviations: Vec<Deviation>,
) -> PathBuf {
    let mut opts = TraceOptions::new("tiny-glm");
    opts.faults = faults;
    opts.deviations = deviations;
    let ids: Vec<i64> = (0..TOKENS).map(|i| (i * 37) % 256).collect();
    let dir = runs.join(name);
    tch::no_grad(|| trace(model, &ids, name, &dir, &opts)).unwrap();
    dir
}

fn provenance(dir: &Path) -> Provenance {
    let a = analyze(&[dir.to_path_buf()], &[], &Options::default(), |_, _, _| {}).unwrap();
    a.runs[0]
        .nan_provenance
        .clone()
        .expect("an onset has a provenance")
}

fn at<'a>(p: &'a Provenance, layer: i32, site: &str) -> &'a SiteSpread {
    p.spread
        .iter()
        .find(|s| s.layer == layer && s.site == site)
        .unwrap_or_else(|| panic!("no spread at layer {layer} {site}: {p:#?}"))
}

fn range(a: i32, b: i32) -> Vec<i32> {
    (a..b).collect()
}

fn planted_nan(token: i64) -> Fault {
    Fault::NonFinite {
        layer: 0,
        site: "mlp_out".to_owned(),
        token,
        channel: 3,
        value: NonFiniteValue::Nan,
    }
}

#[test]
fn a_nan_planted_at_one_token_spreads_to_the_tokens_after_it_and_leaks_to_those_before() {
    let tmp = tempfile::tempdir().unwrap();
    // k above the prompt: every query reads every key at or before it.
    let model = checkpoint(&tmp.path().join("model"), 64);
    let dir = traced(&model, tmp.path(), "planted", vec![planted_nan(20)], vec![]);
    let p = provenance(&dir);
    let d = &p.produced;
    assert_eq!(
        (
            d.step,
            d.layer,
            d.site.as_str(),
            d.tokens.clone(),
            d.inputs_not_known.clone()
        ),
        (0, 0, "mlp_out", vec![20], None),
        "{p:#?}"
    );
    assert_eq!(at(&p, 0, "layer_out").explained, vec![20]);
    assert_eq!(at(&p, 1, "layer_in").explained, vec![20]);
    let attn = at(&p, 1, "attn_out");
    assert_eq!(attn.explained, range(20, 48), "{attn:?}");
    assert_eq!(attn.unexplained, range(0, 20), "{attn:?}");
    assert!(attn.not_known.is_empty(), "{attn:?}");
    // The tokens before 20 could not see it: they share its key, masked.
    let leak = &p.leaks[0];
    assert_eq!(
        (leak.layer, leak.site.as_str(), leak.tokens.clone()),
        (1, "attn_out", range(0, 20))
    );
    assert!(leak.shares.contains("key 20"), "{}", leak.shares);
    // After the leak, tokens 0-19 follow it, 20-47 follow the source.
    let out = at(&p, 1, "layer_out");
    assert_eq!(
        (out.explained.clone(), out.follow_unexplained.clone()),
        (range(20, 48), range(0, 20))
    );
}

#[test]
fn a_nan_in_one_tokens_kv_entry_is_read_by_the_tokens_after_it_and_leaks_to_those_before() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"), 64);
    let fault = Fault::KvSlot {
        layer: 1,
        token: 20,
    };
    let dir = traced(&model, tmp.path(), "kv-slot", vec![fault], vec![]);
    let p = provenance(&dir);
    let d = &p.produced;
    assert_eq!(
        (
            d.layer,
            d.site.as_str(),
            d.tokens.clone(),
            d.inputs_not_known.clone()
        ),
        (1, "attn_out", range(0, 48), None),
        "{p:#?}"
    );
    let op = p.operand.as_ref().expect("the KV sentinel names the slot");
    assert_eq!((op.slot, op.reserved, op.token), (20, false, Some(20)));
    let attn = at(&p, 1, "attn_out");
    assert_eq!(
        (attn.explained.clone(), attn.unexplained.clone()),
        (range(20, 48), range(0, 20))
    );
    assert_eq!(p.leaks.len(), 1, "{:?}", p.leaks);
    assert_eq!(p.leaks[0].tokens, range(0, 20));
    assert!(
        p.leaks[0].shares.contains("KV slot 20"),
        "{}",
        p.leaks[0].shares
    );
}

#[test]
fn a_nan_in_the_reserved_slot_leaks_only_to_rows_with_unused_topk_entries() {
    let tmp = tempfile::tempdir().unwrap();
    // k = 16 of 48 tokens: queries 0-14 see fewer than k keys, and their
    // lists carry unused entries that read the reserved slot.
    let model = checkpoint(&tmp.path().join("model"), 16);
    let deviation = Deviation {
        kind: DeviationKind::KvSlotNan,
        layer: Some(1),
        param: None,
    };
    let dir = traced(&model, tmp.path(), "reserved", vec![], vec![deviation]);
    let p = provenance(&dir);
    let d = &p.produced;
    assert_eq!(
        (
            d.layer,
            d.site.as_str(),
            d.tokens.clone(),
            d.inputs_not_known.clone()
        ),
        (1, "attn_out", range(0, 15), None),
        "{p:#?}"
    );
    let op = p.operand.as_ref().expect("the KV sentinel names the slot");
    assert_eq!((op.slot, op.reserved), (0, true));
    assert_eq!(p.leaks.len(), 1, "{:?}", p.leaks);
    let leak = &p.leaks[0];
    assert_eq!((leak.layer, leak.tokens.clone()), (1, range(0, 15)));
    assert!(
        leak.shares.contains("reserved KV slot 0"),
        "{}",
        leak.shares
    );
    assert!(
        leak.shares.contains("unused top-k entries"),
        "{}",
        leak.shares
    );
}

#[test]
fn a_nan_in_the_last_row_is_produced_there_and_whether_it_is_padding_is_not_known() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"), 64);
    // The last row, where an engine appends the rows that pad its batch.
    let dir = traced(
        &model,
        tmp.path(),
        "padding",
        vec![planted_nan(TOKENS - 1)],
        vec![],
    );
    let p = provenance(&dir);
    assert_eq!(
        (
            p.produced.layer,
            p.produced.site.as_str(),
            p.produced.tokens.clone()
        ),
        (0, "mlp_out", vec![47])
    );
    let attn = at(&p, 1, "attn_out");
    assert_eq!(
        (attn.explained.clone(), attn.unexplained.clone()),
        (vec![47], range(0, 47))
    );
    assert!(
        p.not_known.iter().any(|n| n.contains("padding rows")),
        "{:?}",
        p.not_known
    );
}

/// The report lines of NaN provenance (and the onset before them): the
/// rest of a report carries the engine's numbers, pinned elsewhere.
fn provenance_lines(report: &str) -> String {
    const LABELS: [&str; 6] = [
        "non-finite onset:",
        "NaN produced:",
        "NaN operand:",
        "NaN spread:",
        "not explained:",
        "NaN not known:",
    ];
    // A labelled line, and the lines it wrapped onto (indented deeper, as `text_table::wrap`).
    let mut kept = Vec::new();
    let mut keeping = false;
    for line in report.lines() {
        let l = line.trim_start_matches([' ', '-']);
        if LABELS.iter().any(|p| l.starts_with(p)) || l.starts_with("masked-operand leak:") {
            keeping = true;
            kept.push(line);
        } else if keeping && line.starts_with("    ") {
            kept.push(line);
        } else {
            keeping = false;
        }
    }
    kept.join("\n")
}

#[test]
fn provenance_lines_are_pinned() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(&tmp.path().join("model"), 64);
    let dir = traced(&model, tmp.path(), "planted", vec![planted_nan(20)], vec![]);
    let a = analyze(&[dir], &[], &Options::default(), |_, _, _| {}).unwrap();
    insta::assert_snapshot!(
        "planted_terminal",
        provenance_lines(&shadowtrace_analyzer::report::render_terminal(&a))
    );
    let model = checkpoint(&tmp.path().join("model16"), 16);
    let deviation = Deviation {
        kind: DeviationKind::KvSlotNan,
        layer: Some(1),
        param: None,
    };
    let dir = traced(&model, tmp.path(), "reserved", vec![], vec![deviation]);
    let a = analyze(&[dir], &[], &Options::default(), |_, _, _| {}).unwrap();
    insta::assert_snapshot!(
        "reserved_markdown",
        provenance_lines(&shadowtrace_analyzer::report::render_markdown(&a, &[]))
    );
}
