//! Graft pairs (issue 30): a run whose production took the shadow's value at
//! some sites (tagged `graft`) against its ungrafted base run of the same
//! prompt.
//!
//! ## What it measures
//! What putting the shadow's value back into production did: to the output,
//! and to the layers after the graft. Whether it heals is the question a
//! graft asks.
//!
//! ## Definition
//! Runs are paired by prompt and setup: the same model, engine, production
//! dtype, shadow precision and token hash, one tagged `graft` and one not
//! (each graft run with the first base run in path order).
//! - The output against the reference: argmax agreement and Jensen–Shannon
//!   divergence (bits) of production's top-N logits against the free
//!   shadow's ([`crate::metrics::logits`]), before (the base run) and after
//!   (the graft run). The free shadow is the shadow's own chain from the
//!   embeddings: the same computation in both runs, so both are measured
//!   against one reference. A run whose logits' shadow is not the free chain
//!   has no reference here: not judged, and the pair says why.
//! - What the graft changed: production against production, graft run
//!   against base run.
//! - A graft run whose producer could not graft some of it (a graft not
//!   applied at a layer, or steps served from a cache, which ran ungrafted:
//!   `graft_skipped_cached_steps`) is not what its tag says: its output and
//!   what it changed are not judged, and a note gives the count.
//! - Downstream: each run's first hidden-state divergence, first top-k
//!   divergence and non-finite onset. A graft that heals moves them past the
//!   grafted layers, or removes them. Each is `not judged: <why>` where that
//!   run's data for it is not whole, and so are the logits agreements (a
//!   note says why): "none" is said only where it was measured.
//!
//! ## Why it matters
//! The shadow shows where production and the fp32 recompute part; a graft
//! shows which parting causes the bad output (the central bug report, 003,
//! answered it by hand: dequantize a set of GEMMs, see whether the output
//! turns coherent).
//!
//! ## References
//! `../shared/context/003`; `tracer/src/model/graft.rs`; DESIGN.md, shadow
//! modes.

use serde::Serialize;

use crate::analysis::{RunAnalysis, identity_tag};
use crate::judged::{self, Question, why_not_judged};
use crate::metrics::logits::{self, Agreement};

/// The tag a producer puts on a graft run: the grafts, as
/// `SHADOWTRACE_GRAFT` spells them.
pub const GRAFT_TAG: &str = "graft";

/// The counter of a graft run's steps that ran ungrafted from a cache.
pub const SKIPPED_CACHED_STEPS: &str = "graft_skipped_cached_steps";

/// One graft run against its base run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraftPair {
    /// The graft run.
    pub graft: String,
    /// The base run.
    pub base: String,
    /// The grafts, as tagged.
    pub spec: String,
    /// The base run's production against the free shadow; `None` where it
    /// has no free shadow's logits (a note says so).
    pub before: Option<Agreement>,
    /// The graft run's production against the free shadow.
    pub after: Option<Agreement>,
    /// The graft run's production against the base run's.
    pub changed: Option<Agreement>,
    /// First hidden-state divergence: base, graft (`layer N`, `none`, or
    /// `not judged: <why>` where that run's hidden data is not whole).
    pub hidden_first: (String, String),
    /// First top-k divergence: base, graft, as `hidden_first`.
    pub topk_first: (String, String),
    /// Non-finite onset: base, graft, as `hidden_first`.
    pub onset: (String, String),
    /// What could not be compared, and why.
    pub notes: Vec<String>,
}

/// Every graft pair of an analysis, and the graft runs without a base.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraftPairs {
    /// Pairs.
    pub pairs: Vec<GraftPair>,
    /// Graft runs with no base run of their prompt.
    pub unpaired: Vec<String>,
    /// How they were paired and judged.
    pub rule: String,
}

/// The rule of the pairs.
pub const RULE: &str = "a graft run (tags.graft) is paired with the first ungrafted run of the same \
     model, engine, production dtype, shadow precision and prompt; its output is judged against \
     the free shadow's logits (the shadow's own chain, the same in both runs), before and after";

fn key(r: &RunAnalysis) -> Vec<String> {
    [
        "model",
        "engine",
        "prod_dtype",
        "shadow_precision",
        "token_hash",
    ]
    .iter()
    .map(|k| identity_tag(&r.tags, k).cloned().unwrap_or_default())
    .collect()
}

/// Pairs the graft runs among `runs` with base runs of the same prompt;
/// `None` when no run is a graft run.
#[must_use]
pub fn pairs(runs: &[RunAnalysis]) -> Option<GraftPairs> {
    let spec = |r: &RunAnalysis| r.tags.get(GRAFT_TAG).cloned();
    if !runs.iter().any(|r| spec(r).is_some()) {
        return None;
    }
    let mut out = GraftPairs {
        pairs: Vec::new(),
        unpaired: Vec::new(),
        rule: RULE.to_owned(),
    };
    for graft in runs.iter().filter(|r| spec(r).is_some()) {
        let prompt_known = identity_tag(&graft.tags, "token_hash").is_some_and(|h| !h.is_empty());
        let base = runs
            .iter()
            .find(|r| spec(r).is_none() && prompt_known && key(r) == key(graft));
        match base {
            Some(base) => out.pairs.push(compare(graft, base)),
            None => out.unpaired.push(format!(
                "{}: no ungrafted run of its prompt (same model, engine, production dtype, shadow \
                 precision and token hash){}",
                graft.run_id,
                if prompt_known {
                    ""
                } else {
                    "; its run has no token hash (serving engines give the hooks no token ids)"
                }
            )),
        }
    }
    Some(out)
}

fn compare(graft: &RunAnalysis, base: &RunAnalysis) -> GraftPair {
    let mut notes = Vec::new();
    // Logits rows lost or a logits capture disabled: no agreement is judged from the rest.
    let logits_not_judged = |r: &RunAnalysis| why_not_judged(&r.not_measured, Question::Logits);
    for r in [base, graft] {
        if let Some(why) = logits_not_judged(r) {
            notes.push(format!("{}: logits not judged: {why}", r.run_id));
        } else if !r.logits_shadow_free {
            notes.push(format!(
                "{}: no free shadow's logits (trace with SHADOWTRACE_MODE=local,free): its output \
                 against the reference is not judged",
                r.run_id
            ));
        }
    }
    // A graft the producer could not apply everywhere (a shadow re-run that failed, an
    // indexer graft on a layer without an indexer): the run is not what its tag says.
    let missed: u64 = ["graft_not_applied", "graft_indexer_on_shared_layer"]
        .iter()
        .filter_map(|k| graft.counters.get(*k))
        .sum();
    if missed > 0 {
        notes.push(format!(
            "{}: the graft was not applied at {missed} grafted layer(s) (graft_not_applied, \
             graft_indexer_on_shared_layer): its output is not judged",
            graft.run_id
        ));
    }
    // Steps served from a cache (a prefill after a prefix-cache hit, a decode step) ran
    // ungrafted where the hooks re-run layers only without one: production there is not
    // what the tag says, and which rows those steps wrote the run does not say.
    let cached = graft
        .counters
        .get(SKIPPED_CACHED_STEPS)
        .copied()
        .unwrap_or(0);
    if cached > 0 {
        notes.push(format!(
            "{}: {cached} step(s) ran ungrafted from a cache (a prefill served from the prefix \
             cache, or a decode step; {SKIPPED_CACHED_STEPS}): its output and what the graft \
             changed are not judged",
            graft.run_id
        ));
    }
    let missed = missed + cached;
    let against_free = |r: &RunAnalysis| {
        (r.logits_shadow_free && logits_not_judged(r).is_none())
            .then(|| logits::agreement(&r.prod_top_n, &r.shadow_top_n))
            .flatten()
    };
    let before = against_free(base);
    let after = if missed > 0 {
        None
    } else {
        against_free(graft)
    };
    let changed =
        if missed == 0 && logits_not_judged(base).is_none() && logits_not_judged(graft).is_none() {
            logits::agreement(&graft.prod_top_n, &base.prod_top_n)
        } else {
            None
        };
    if changed.is_none() {
        notes.push("what the graft changed in the logits is not judged".to_owned());
    }
    let first = |r: &RunAnalysis, question, layer: Option<i32>| {
        let found = layer.map_or_else(|| "none".to_owned(), |l| format!("layer {l}"));
        judged::cell(&r.not_measured, question, &found)
    };
    let both = |question, layer: fn(&RunAnalysis) -> Option<i32>| {
        (
            first(base, question, layer(base)),
            first(graft, question, layer(graft)),
        )
    };
    GraftPair {
        graft: graft.run_id.clone(),
        base: base.run_id.clone(),
        spec: graft.tags.get(GRAFT_TAG).cloned().unwrap_or_default(),
        before,
        after,
        changed,
        hidden_first: both(Question::Hidden, |r| {
            r.hidden_verdict.as_ref().map(|v| v.layer)
        }),
        topk_first: both(Question::Topk, |r| r.topk_verdict.as_ref().map(|v| v.layer)),
        onset: both(Question::Nonfinite, |r| r.onset.as_ref().map(|o| o.layer)),
        notes,
    }
}

impl GraftPair {
    /// The pair in one line: the output before and after, and where the
    /// first divergences went.
    #[must_use]
    pub fn line(&self) -> String {
        let share = |a: &Option<Agreement>| match a {
            None => "-".to_owned(),
            Some(a) => match a.argmax_agreement {
                Some(s) => format!("{s:.3}"),
                None => format!("none (all {} positions non-finite)", a.nonfinite_positions),
            },
        };
        let js = |a: &Option<Agreement>| {
            a.as_ref()
                .and_then(|a| a.js_divergence.as_ref())
                .map_or_else(|| "-".to_owned(), |s| format!("{:.2e}", s.mean))
        };
        let output = if self.before.is_some() && self.after.is_some() {
            format!(
                "argmax agreement with the free shadow {} -> {}, mean JS {} -> {} bits",
                share(&self.before),
                share(&self.after),
                js(&self.before),
                js(&self.after)
            )
        } else {
            "output against the reference not judged (the notes say why)".to_owned()
        };
        format!(
            "graft {} ({} against {}): {output}; argmax agreement with the base run {}; first \
             hidden divergence {} -> {}; first top-k divergence {} -> {}; non-finite onset {} -> {}",
            self.spec,
            self.graft,
            self.base,
            share(&self.changed),
            self.hidden_first.0,
            self.hidden_first.1,
            self.topk_first.0,
            self.topk_first.1,
            self.onset.0,
            self.onset.1,
        )
    }
}
