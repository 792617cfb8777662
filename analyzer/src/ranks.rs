//! Runs of one request traced on several ranks, read as one run.
//!
//! Under tensor parallelism every rank writes its own run of the same
//! request (the hooks give them one `request` tag and the manifest's world
//! size). The indexer and the residual stream are replicated across ranks,
//! so the ranks' traces must agree; the request is reported once, from its
//! lowest rank, with how far the other ranks were from it. Ranks that
//! disagree are themselves a finding (DeepSeek's reference asserts that
//! every rank selects the same top-k).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::analysis::RunAnalysis;

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
}

/// Merges the ranks of each multi-rank request into one run (the lowest
/// rank's analysis with a [`RankAgreement`]), where its first rank was in
/// the input order; other runs pass unchanged.
#[must_use]
pub fn merge(runs: Vec<RunAnalysis>) -> Vec<RunAnalysis> {
    // Each output slot holds one run, or the ranks of one request.
    let mut slots: Vec<Vec<RunAnalysis>> = Vec::with_capacity(runs.len());
    let mut slot_of: BTreeMap<(String, String), usize> = BTreeMap::new();
    for run in runs {
        let world = run.tags.get("world_size").cloned().unwrap_or_default();
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
            Some(first)
        })
        .collect()
}

fn rank_of(run: &RunAnalysis) -> u32 {
    run.tags
        .get("rank")
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
    let (j0, h0) = (layer_j(first), site_p95(first));
    for other in others {
        for (layer, j) in layer_j(other) {
            let base = j0.get(&layer).copied().unwrap_or(f64::NAN);
            max_jaccard_diff = max_jaccard_diff.max((j - base).abs());
        }
        for (key, p95) in site_p95(other) {
            let base = h0.get(&key).copied().unwrap_or(f64::NAN);
            max_hidden_p95_diff = max_hidden_p95_diff.max((p95 - base).abs());
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
    }
}
