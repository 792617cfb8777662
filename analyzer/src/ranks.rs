//! Runs of one request traced on several ranks, read as one run.
//!
//! Under tensor parallelism every rank writes its own run of the same
//! request (the hooks give them one `request` tag and the manifest's world
//! size). The indexer and the residual stream are replicated across ranks,
//! so the ranks' traces must agree; the request is reported once, from its
//! lowest rank's metrics, with how far the other ranks were from it. Ranks
//! that disagree are themselves a finding (DeepSeek's reference asserts that
//! every rank selects the same top-k).
//!
//! What every rank holds is kept: counters are summed over the ranks (each
//! rank is its own process, so nothing is counted twice; a note says so),
//! every rank's notes are kept with its rank, failed sentinel checks are
//! united, and the merged run is complete only when every rank's run is. A
//! layer recorded on some ranks but not others is listed
//! ([`RankAgreement::uneven_layers`]) rather than compared.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::analysis::{RunAnalysis, identity_tag};
use crate::judged::NotMeasured;

/// How the ranks of one request compare with its lowest rank.
#[derive(Debug, Clone, Serialize)]
pub struct RankAgreement {
    /// The ranks read as this run, lowest first.
    pub ranks: Vec<u32>,
    /// Their run ids, in the same order.
    pub run_ids: Vec<String>,
    /// Largest per-layer difference of mean churn-free Jaccard.
    pub max_jaccard_diff: f64,
    /// Largest per-(layer, site, mode) difference of p95 relative L2 error.
    pub max_hidden_p95_diff: f64,
    /// Every rank reached the same verdicts and the same non-finite onset.
    pub same_verdicts: bool,
    /// Layers (top-k or hidden) recorded on some ranks but not on others,
    /// with the ranks that recorded them; left out of the differences above.
    pub uneven_layers: Vec<UnevenLayer>,
}

/// A layer only some ranks recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnevenLayer {
    /// The layer.
    pub layer: i32,
    /// The ranks that recorded it, lowest first.
    pub ranks: Vec<u32>,
}

/// Merges the ranks of each multi-rank request into one run (the lowest
/// rank's metrics with a [`RankAgreement`], and every rank's counters,
/// notes, failed sentinels and completeness), where its first rank was in
/// the input order; other runs pass unchanged.
#[must_use]
pub fn merge(runs: Vec<RunAnalysis>) -> Vec<RunAnalysis> {
    // Each output slot holds one run, or the ranks of one request.
    let mut slots: Vec<Vec<RunAnalysis>> = Vec::with_capacity(runs.len());
    let mut slot_of: BTreeMap<(String, String), usize> = BTreeMap::new();
    for run in runs {
        let world = identity_tag(&run.tags, "world_size")
            .cloned()
            .unwrap_or_default();
        match run.tags.get("request") {
            Some(request) if world.parse::<u32>().is_ok_and(|w| w > 1) => {
                let key = (request.clone(), world);
                if let Some(&slot) = slot_of.get(&key) {
                    slots[slot].push(run);
                } else {
                    slot_of.insert(key, slots.len());
                    slots.push(vec![run]);
                }
            }
            _ => slots.push(vec![run]),
        }
    }
    slots
        .into_iter()
        .filter_map(|mut ranks| {
            if ranks.len() == 1 {
                return ranks.pop();
            }
            ranks.sort_by_key(rank_of);
            let mut first = ranks.remove(0);
            first.ranks = Some(agreement(&first, &ranks));
            fold_ranks(&mut first, &ranks);
            Some(first)
        })
        .collect()
}

/// Folds the other ranks' state into the lowest rank's run.
fn fold_ranks(first: &mut RunAnalysis, others: &[RunAnalysis]) {
    let all = || std::iter::once(&*first).chain(others);
    let ranks: Vec<String> = all().map(|r| rank_of(r).to_string()).collect();
    let mut notes: Vec<String> = all()
        .flat_map(|r| {
            let rank = rank_of(r);
            r.notes.iter().map(move |n| format!("rank {rank}: {n}"))
        })
        .collect();
    notes.push(format!(
        "counters are summed over ranks {}",
        ranks.join(", ")
    ));
    // A rank that lost data leaves the request's verdicts not judged.
    let not_measured = all()
        .flat_map(|r| {
            let rank = rank_of(r);
            r.not_measured.iter().map(move |n| NotMeasured {
                questions: n.questions.clone(),
                why: format!("rank {rank}: {}", n.why),
            })
        })
        .collect();
    let complete = all().all(|r| r.complete);
    let mut sentinels = first.failed_sentinels.clone();
    for s in others.iter().flat_map(|r| &r.failed_sentinels) {
        if !sentinels.contains(s) {
            sentinels.push(s.clone());
        }
    }
    for other in others {
        for (name, value) in &other.counters {
            *first.counters.entry(name.clone()).or_insert(0) += value;
        }
    }
    first.notes = notes;
    first.not_measured = not_measured;
    first.complete = complete;
    first.failed_sentinels = sentinels;
}

fn rank_of(run: &RunAnalysis) -> u32 {
    identity_tag(&run.tags, "rank")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

fn agreement(first: &RunAnalysis, others: &[RunAnalysis]) -> RankAgreement {
    let mut max_jaccard_diff: f64 = 0.0;
    let mut max_hidden_p95_diff: f64 = 0.0;
    let mut same_verdicts = true;
    let layer_j = |r: &RunAnalysis| -> BTreeMap<i32, f64> {
        r.topk
            .iter()
            .filter_map(|l| l.jaccard_no_churn.as_ref().map(|j| (l.layer, j.mean)))
            .collect()
    };
    let site_p95 = |r: &RunAnalysis| -> BTreeMap<(i32, String, String), f64> {
        r.hidden
            .iter()
            .filter_map(|s| {
                let p95 = s.rel_l2_err.as_ref()?.p95;
                Some(((s.layer, s.site.clone(), s.shadow_mode.clone()), p95))
            })
            .collect()
    };
    let (first_jaccard, first_p95) = (layer_j(first), site_p95(first));
    for other in others {
        // A layer one of the two lacks has no difference: it is listed in
        // uneven_layers instead (f64::max would drop a NaN without a word).
        for (layer, j) in layer_j(other) {
            if let Some(base) = first_jaccard.get(&layer) {
                max_jaccard_diff = max_jaccard_diff.max((j - base).abs());
            }
        }
        for (key, p95) in site_p95(other) {
            if let Some(base) = first_p95.get(&key) {
                max_hidden_p95_diff = max_hidden_p95_diff.max((p95 - base).abs());
            }
        }
        let verdict_layers = |r: &RunAnalysis| {
            (
                r.hidden_verdict.as_ref().map(|v| v.layer),
                r.topk_verdict.as_ref().map(|v| v.layer),
                r.onset
                    .as_ref()
                    .map(|o| (o.step, o.layer, o.site.clone(), o.token)),
            )
        };
        same_verdicts &= verdict_layers(first) == verdict_layers(other);
    }
    let mut ranks = vec![rank_of(first)];
    let mut run_ids = vec![first.run_id.clone()];
    ranks.extend(others.iter().map(rank_of));
    run_ids.extend(others.iter().map(|r| r.run_id.clone()));
    RankAgreement {
        ranks,
        run_ids,
        max_jaccard_diff,
        max_hidden_p95_diff,
        same_verdicts,
        uneven_layers: uneven_layers(first, others),
    }
}

/// Layers some ranks recorded and others did not.
fn uneven_layers(first: &RunAnalysis, others: &[RunAnalysis]) -> Vec<UnevenLayer> {
    let layers = |r: &RunAnalysis| -> BTreeSet<i32> {
        r.topk
            .iter()
            .map(|l| l.layer)
            .chain(r.hidden.iter().map(|s| s.layer))
            .collect()
    };
    let per_rank: Vec<(u32, BTreeSet<i32>)> = std::iter::once(first)
        .chain(others)
        .map(|r| (rank_of(r), layers(r)))
        .collect();
    let every: BTreeSet<i32> = per_rank
        .iter()
        .flat_map(|(_, l)| l.iter().copied())
        .collect();
    every
        .into_iter()
        .filter_map(|layer| {
            let ranks: Vec<u32> = per_rank
                .iter()
                .filter(|(_, l)| l.contains(&layer))
                .map(|(rank, _)| *rank)
                .collect();
            (ranks.len() < per_rank.len()).then_some(UnevenLayer { layer, ranks })
        })
        .collect()
}
