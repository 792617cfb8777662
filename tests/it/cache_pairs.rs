//! Prefix-cache pairs on synthetic runs whose answer is known by
//! construction: a hit whose rows equal the miss's (a clean reuse), a hit
//! whose free-shadow error is 0.5 larger from one layer on (stale state
//! there), a hit non-finite where the miss is finite, a hit whose first
//! token differs, and a hit of another prompt (no miss to pair with).

use std::path::{Path, PathBuf};

use shadowtrace_analyzer::report::{render_markdown, render_terminal};
use shadowtrace_analyzer::{Analysis, Options, analyze};
use shadowtrace_tracer::record::Record;
use shadowtrace_tracer::synth::SynthSpec;

use crate::analyze_verdicts::clean;
use crate::support::{edit_manifest, write_edited};

/// The first generated position of [`clean`]'s 64-token prompt.
const FIRST: i32 = 63;

/// A run of [`clean`]'s prompt traced in the free mode only, tagged
/// `cache=<cache>`, after `edit` changed its rows.
fn cache_run(
    dir: &Path,
    spec: SynthSpec,
    cache: &str,
    edit: impl FnOnce(&mut Vec<Record>),
) -> PathBuf {
    let path = write_edited(dir, &spec, |records| {
        for record in records.iter_mut() {
            if let Record::Hidden(row) = record
                && let Some(shadow) = row.shadow.as_mut()
            {
                shadow.mode = "free".to_owned();
            }
        }
        edit(records);
    });
    edit_manifest(&path, |m| {
        m["tags"]["cache"] = cache.into();
        m["shadow"]["modes"] = serde_json::json!(["free"]);
    });
    path
}

/// Adds `by` to the free-shadow error of every hidden row at the first
/// generated position from `layer` on.
fn stale_from(layer: i32, by: f32) -> impl FnOnce(&mut Vec<Record>) {
    move |records| {
        for record in records.iter_mut() {
            if let Record::Hidden(row) = record
                && row.token == FIRST
                && row.layer >= layer
                && let Some(shadow) = row.shadow.as_mut()
            {
                shadow.comparison.rel_l2_err += by;
            }
        }
    }
}

fn pairs_of(runs: &[PathBuf]) -> Analysis {
    let a = analyze(runs, &[], &Options::default(), |_, _, _| {}).unwrap();
    assert!(a.skipped.is_empty(), "{:?}", a.skipped);
    a
}

fn grid(dir: &Path) -> Vec<PathBuf> {
    vec![
        cache_run(dir, clean("miss"), "miss", |_| {}),
        cache_run(dir, clean("hit-clean"), "hit", |_| {}),
        cache_run(dir, clean("hit-stale"), "hit", stale_from(2, 0.5)),
        cache_run(dir, clean("hit-nan"), "hit", |records| {
            for record in records.iter_mut() {
                if let Record::Hidden(row) = record
                    && row.token == FIRST
                    && (row.layer, row.site.as_str()) == (3, "mlp_out")
                {
                    row.prod.nan = 5;
                }
            }
        }),
        cache_run(dir, clean("hit-flipped"), "hit", |records| {
            for record in records.iter_mut() {
                if let Record::Logits(row) = record
                    && row.token == FIRST
                {
                    row.prod.ids.swap(0, 1);
                }
            }
        }),
        cache_run(
            dir,
            SynthSpec {
                prompt_kind: "other".to_owned(),
                ..clean("hit-other-prompt")
            },
            "hit",
            |_| {},
        ),
    ]
}

#[test]
fn runs_without_a_cache_hit_have_no_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    let a = pairs_of(&[cache_run(tmp.path(), clean("miss"), "miss", |_| {})]);
    assert!(a.cache.is_none());
    assert!(!render_terminal(&a).contains("prefix-cache"));
}

#[test]
fn a_clean_reuse_is_not_flagged_and_stale_state_is_named_at_its_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let a = pairs_of(&grid(tmp.path()));
    let cache = a.cache.as_ref().unwrap();
    let pair = |hit: &str| cache.pairs.iter().find(|p| p.hit == hit).unwrap();

    let clean = pair("hit-clean");
    assert_eq!((clean.miss.as_str(), clean.token), ("miss", FIRST));
    assert!(clean.parted.is_none() && !clean.parted_or_flipped());
    assert!(clean.sites.iter().all(|s| s.gap == Some(0.0)));
    assert!(!clean.sites.is_empty() && clean.notes.is_empty());
    assert_eq!(
        clean.first_token.as_ref().unwrap().argmax_agreement,
        Some(1.0)
    );

    let stale = pair("hit-stale");
    let parted = stale.parted.as_ref().unwrap();
    assert_eq!((parted.layer, parted.site.as_str()), (2, "layer_in"));
    assert!((parted.gap - 0.5).abs() < 1e-6, "{parted:?}");
    assert_eq!(parted.limit, 0.1);
    assert!(parted.nonfinite.is_none());
    // layers before the stale one are alike in both
    assert!(
        stale
            .sites
            .iter()
            .filter(|s| s.layer < 2)
            .all(|s| s.gap == Some(0.0))
    );

    let nan = pair("hit-nan").parted.as_ref().unwrap();
    assert_eq!((nan.layer, nan.site.as_str()), (3, "mlp_out"));
    assert_eq!(
        (nan.gap, nan.nonfinite),
        (f64::INFINITY, Some("in the hit only"))
    );

    let flipped = pair("hit-flipped");
    assert!(flipped.parted.is_none() && flipped.parted_or_flipped());
    assert_eq!(
        flipped.first_token.as_ref().unwrap().argmax_agreement,
        Some(0.0)
    );
    assert_ne!(flipped.argmax.0, flipped.argmax.1);

    assert_eq!(cache.pairs.len(), 4);
    assert_eq!(cache.unpaired.len(), 1);
    assert!(cache.unpaired[0].starts_with("hit-other-prompt: no cache=miss run of its prompt"));
    assert!(cache.any_parted());
    assert!(
        a.rule_lines().iter().any(|r| r.contains("> 0.1")),
        "{:?}",
        a.rule_lines()
    );
}

#[test]
fn the_pairs_threshold_is_the_hidden_state_threshold() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = grid(tmp.path());
    let mut options = Options::default();
    options.thresholds.hidden_rel_err = 0.6;
    let a = analyze(&runs, &[], &options, |_, _, _| {}).unwrap();
    let cache = a.cache.unwrap();
    let stale = cache.pairs.iter().find(|p| p.hit == "hit-stale").unwrap();
    assert!(stale.parted.is_none(), "{:?}", stale.parted);
    assert!(cache.rule.contains("> 0.6"));
}

#[test]
fn prefix_cache_pairs_are_pinned_in_terminal_markdown_and_json() {
    let tmp = tempfile::tempdir().unwrap();
    let a = pairs_of(&grid(tmp.path()));
    let terminal = render_terminal(&a);
    let section = |text: &str, from: &str, to: &str| -> String {
        let start = text.find(from).unwrap();
        let end = text[start..].find(to).map_or(text.len(), |e| start + e);
        text[start..end].to_owned()
    };
    insta::assert_snapshot!(
        "terminal",
        section(&terminal, "prefix-cache pairs (", "\nrun ")
    );
    let markdown = render_markdown(&a, &[]);
    insta::assert_snapshot!(
        "markdown",
        section(&markdown, "## Prefix-cache pairs", "\n## ")
    );
    let mut json = serde_json::to_value(&a).unwrap()["cache"].clone();
    // per-site rows are long and covered above; keep their count
    for pair in json["pairs"].as_array_mut().unwrap() {
        let sites = pair["sites"].as_array().unwrap().len();
        pair["sites"] = sites.into();
    }
    insta::assert_json_snapshot!("json", json);
}

#[test]
fn hits_without_a_token_hash_are_never_paired_and_say_why() {
    // A serving engine's runs: tagged by the adapter, no token ids to hash.
    let tmp = tempfile::tempdir().unwrap();
    let runs: Vec<PathBuf> = [("miss", "miss"), ("hit", "hit")]
        .into_iter()
        .map(|(id, cache)| {
            let run = cache_run(tmp.path(), clean(id), cache, |_| {});
            edit_manifest(&run, |m| m["prompt"]["token_hash"] = "".into());
            run
        })
        .collect();
    let cache = pairs_of(&runs).cache.unwrap();
    assert!(cache.pairs.is_empty());
    let note = &cache.unpaired;
    assert_eq!(note.len(), 1);
    assert!(
        note[0].starts_with("hit: no cache=miss run of its prompt"),
        "{note:?}"
    );
    assert!(
        note[0]
            .ends_with("its run has no token hash (serving engines give the hooks no token ids)")
    );
}
