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
//! vLLM 0.34's ShardQ breaks the replication of the indexer's rows: each rank
//! scores its own zigzag share of a prefill's tokens, and records those rows
//! (counting the rest as `topk_rows_on_other_ranks`). When every rank's count
//! of the rows it did not score equals the rows the other ranks recorded, the
//! ranks' top-k rows are united, each row once, and the request's top-k
//! layers and verdict are computed from the union; otherwise they stay not
//! judged. Ranks are then compared on the rows they all recorded.
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
use crate::metrics::topk_overlap::{self, LayerOverlap, RowOverlap, Skipped, SkippedRow};
use crate::verdict::{NoiseFloor, Thresholds, topk_verdict};

/// The hooks' count of a rank's rows another rank scored (vLLM ShardQ).
pub const OTHER_RANKS: &str = "topk_rows_on_other_ranks";

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
/// notes, failed sentinels and completeness; top-k rows the ranks scored
/// apart united, judged with `t` and the model's noise floor from
/// `floors`), where its first rank was in the input order; other runs pass
/// unchanged.
#[must_use]
pub fn merge(
    runs: Vec<RunAnalysis>,
    t: &Thresholds,
    floors: &BTreeMap<String, NoiseFloor>,
) -> Vec<RunAnalysis> {
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
            let united = unite_sharded(&first, &ranks);
            first.ranks = Some(agreement(&first, &ranks, united.is_some()));
            fold_ranks(&mut first, &ranks);
            if let Some(united) = united {
                let floor = identity_tag(&first.tags, "model").and_then(|m| floors.get(m));
                apply_united(&mut first, united, t, floor);
            }
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

/// A request's top-k rows as its ranks recorded them together.
struct United {
    rows: Vec<RowOverlap>,
    skipped: Vec<SkippedRow>,
    /// Whether every rank's count of the rows it did not score equals the
    /// rows the others recorded.
    whole: bool,
    ranks: Vec<u32>,
}

type RowKey = (i32, i32, i32, bool);

fn row_keys(r: &RunAnalysis) -> BTreeSet<RowKey> {
    r.topk_rows
        .iter()
        .chain(&r.topk_dequant_rows)
        .map(|o| (o.step, o.layer, o.token, o.dequant))
        .chain(
            r.topk_skipped
                .iter()
                .map(|s| (s.step, s.layer, s.token, s.dequant)),
        )
        .collect()
}

/// The union of the ranks' top-k rows, where some rank counted rows
/// another scored (ShardQ); None for replicated ranks. Each row once: a
/// row several ranks recorded (decode rows, replicated) from the lowest.
fn unite_sharded(first: &RunAnalysis, others: &[RunAnalysis]) -> Option<United> {
    let all = || std::iter::once(first).chain(others);
    if !all().any(|r| r.counters.get(OTHER_RANKS).is_some_and(|&n| n > 0)) {
        return None;
    }
    let mut rows: BTreeMap<RowKey, RowOverlap> = BTreeMap::new();
    let mut skipped: BTreeMap<RowKey, SkippedRow> = BTreeMap::new();
    for run in all() {
        for r in run.topk_rows.iter().chain(&run.topk_dequant_rows) {
            rows.entry((r.step, r.layer, r.token, r.dequant))
                .or_insert(*r);
        }
        for s in &run.topk_skipped {
            skipped
                .entry((s.step, s.layer, s.token, s.dequant))
                .or_insert(*s);
        }
    }
    skipped.retain(|k, _| !rows.contains_key(k));
    // The hooks count a missing row once per call, whatever the shadows:
    // compare the rows of the reference input (or none).
    let united: usize = rows.keys().chain(skipped.keys()).filter(|k| !k.3).count();
    let whole = all().all(|r| {
        let own = row_keys(r).iter().filter(|k| !k.3).count();
        r.counters.get(OTHER_RANKS).copied().unwrap_or(0) == (united - own) as u64
    });
    Some(United {
        rows: rows.into_values().collect(),
        skipped: skipped.into_values().collect(),
        whole,
        ranks: all().map(rank_of).collect(),
    })
}

/// The request's top-k from its ranks' united rows, where they make it
/// whole: layers, verdict and rule recomputed, the ranks' "rows on other
/// ranks" no longer a loss. Where they do not, a note says so and the
/// top-k stays not judged.
fn apply_united(
    first: &mut RunAnalysis,
    united: United,
    t: &Thresholds,
    floor: Option<&NoiseFloor>,
) {
    let ranks: Vec<String> = united.ranks.iter().map(ToString::to_string).collect();
    if !united.whole {
        first.notes.push(format!(
            "ranks {} scored different rows of this request (vLLM ShardQ), and their rows do not make it whole: \
             each rank's {OTHER_RANKS} differs from the rows the others recorded, so the top-k stays not judged",
            ranks.join(", ")
        ));
        return;
    }
    let units: BTreeMap<i32, _> = first
        .topk
        .iter()
        .chain(&first.topk_dequant)
        .filter_map(|l| l.unit.clone().map(|u| (l.layer, u)))
        .collect();
    let skipped = Skipped::of(united.skipped);
    let (dequant, reference): (Vec<RowOverlap>, Vec<RowOverlap>) =
        united.rows.into_iter().partition(|r| r.dequant);
    let layers = |rows: &[RowOverlap], uninformative| -> Vec<LayerOverlap> {
        let mut out = topk_overlap::by_layer([rows], uninformative, t.topk_jaccard);
        for layer in &mut out {
            layer.unit = units.get(&layer.layer).cloned();
        }
        out
    };
    first.topk = layers(&reference, &skipped.reference);
    first.topk_dequant = layers(&dequant, &skipped.dequant);
    let (verdict, rule) = topk_verdict(&first.topk, t, floor);
    first.topk_verdict = verdict;
    if let Some(slot) = first.rules.get_mut(1) {
        *slot = rule.text;
    }
    first.topk_rows = reference.into();
    first.topk_dequant_rows = dequant.into();
    first.topk_skipped = skipped.rows;
    let loss = format!("counted {OTHER_RANKS} = ");
    first.not_measured.retain(|n| !n.why.contains(&loss));
    first.notes.push(format!(
        "top-k rows of ranks {} united: each scored its own rows of this request's prefill (vLLM ShardQ), \
         and every rank's {OTHER_RANKS} equals the rows the others recorded",
        ranks.join(", ")
    ));
}

fn agreement(first: &RunAnalysis, others: &[RunAnalysis], sharded: bool) -> RankAgreement {
    let mut max_jaccard_diff: f64 = 0.0;
    let mut max_hidden_p95_diff: f64 = 0.0;
    let mut same_verdicts = true;
    // Ranks that scored different rows are compared on the rows all of them
    // recorded (the replicated ones), never on their own shares.
    let common: Option<BTreeSet<RowKey>> = sharded.then(|| {
        others.iter().fold(row_keys(first), |acc, r| {
            acc.intersection(&row_keys(r)).copied().collect()
        })
    });
    let layer_j = |r: &RunAnalysis| -> BTreeMap<i32, f64> {
        match &common {
            None => r
                .topk
                .iter()
                .filter_map(|l| l.jaccard_no_churn.as_ref().map(|j| (l.layer, j.mean)))
                .collect(),
            Some(keys) => {
                let mut sums: BTreeMap<i32, (f64, usize)> = BTreeMap::new();
                for o in r
                    .topk_rows
                    .iter()
                    .filter(|o| keys.contains(&(o.step, o.layer, o.token, o.dequant)))
                {
                    let e = sums.entry(o.layer).or_default();
                    e.0 += o.jaccard_no_churn();
                    e.1 += 1;
                }
                #[allow(clippy::cast_precision_loss)] // row counts far below 2^52
                sums.into_iter()
                    .map(|(l, (s, n))| (l, s / n as f64))
                    .collect()
            }
        }
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
        // Ranks that scored different rows reach their own top-k verdicts on
        // their own shares: only the united rows give the request's.
        let verdict_layers = |r: &RunAnalysis| {
            (
                r.hidden_verdict.as_ref().map(|v| v.layer),
                r.topk_verdict
                    .as_ref()
                    .map(|v| v.layer)
                    .filter(|_| !sharded),
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
