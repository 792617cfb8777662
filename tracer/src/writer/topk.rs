//! A top-k row as trace format v2 stores it (`schemas/v2/topk.json`): the
//! summary always, the differences and each path's boundary candidates by
//! default, the full prod list for rows `SHADOWTRACE_TOPK_LISTS` samples.
//!
//! Producers hand over both paths' full selections (stored form: sorted,
//! padding dropped) and boundary keys with their scores; everything here is
//! derived from them with `shadowtrace_schemas::selection`, which readers
//! use to recompute and check the same numbers.

use shadowtrace_schemas::selection::{BoundaryView, Counts, churn_from_boundaries, gaps};

use super::batch::RowCursor;
use crate::TraceError;
use crate::record::{Selection, TopkRow};

/// Which query rows keep their full prod list (`SHADOWTRACE_TOPK_LISTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TopkLists {
    /// None: the summary and differences only.
    #[default]
    None,
    /// The rows whose token position is a multiple of N, in every layer, so
    /// a sampled token's selections are complete across layers.
    Every(u64),
    /// Every row.
    All,
}

impl TopkLists {
    /// Reads the canonical JSON of `SHADOWTRACE_TOPK_LISTS`
    /// (`shadowtrace_schemas::env::resolve`); `None` for any other value.
    #[must_use]
    pub fn from_setting(value: &serde_json::Value) -> Option<TopkLists> {
        match value.get("kind")?.as_str()? {
            "none" => Some(TopkLists::None),
            "all" => Some(TopkLists::All),
            "every" => value
                .get("n")?
                .as_u64()
                .filter(|&n| n >= 1)
                .map(TopkLists::Every),
            _ => None,
        }
    }

    /// The setting as the manifest records it (the same JSON).
    #[must_use]
    pub fn setting(self) -> serde_json::Value {
        match self {
            TopkLists::None => serde_json::json!({"kind": "none"}),
            TopkLists::All => serde_json::json!({"kind": "all"}),
            TopkLists::Every(n) => serde_json::json!({"kind": "every", "n": n}),
        }
    }

    /// Whether the row of query `token` keeps its full prod list.
    #[must_use]
    pub fn samples(self, token: i32) -> bool {
        match self {
            TopkLists::None => false,
            TopkLists::All => true,
            TopkLists::Every(n) => u64::try_from(token).is_ok_and(|t| t % n == 0),
        }
    }
}

/// One path's boundary candidates in v2's form: keys, score minus the
/// path's k-th score (f32, as the path scored), whether the path selected it.
struct Candidates {
    keys: Vec<i32>,
    offsets: Vec<f32>,
    selected: Vec<bool>,
}

impl Candidates {
    fn of(selection: &Selection) -> Option<Candidates> {
        let boundary = selection.boundary.as_ref()?;
        // A dense row has no k-th score: its producer lists no candidates.
        let kth = selection.kth_score.unwrap_or(f32::NAN);
        Some(Candidates {
            keys: boundary.indices.clone(),
            offsets: boundary.scores.iter().map(|&s| s - kth).collect(),
            selected: boundary
                .indices
                .iter()
                .map(|key| selection.indices.binary_search(key).is_ok())
                .collect(),
        })
    }

    fn view(&self) -> BoundaryView<'_> {
        BoundaryView {
            keys: &self.keys,
            offsets: &self.offsets,
            selected: &self.selected,
        }
    }
}

/// Keys of sorted `a` that sorted `b` lacks.
fn only_in(a: &[i32], b: &[i32]) -> Vec<i32> {
    let mut out = Vec::new();
    let mut j = 0;
    for &key in a {
        while j < b.len() && b[j] < key {
            j += 1;
        }
        if b.get(j) != Some(&key) {
            out.push(key);
        }
    }
    out
}

fn count(n: usize) -> Option<i32> {
    Some(i32::try_from(n).unwrap_or(i32::MAX))
}

/// Appends `r` (selections in stored form) in the column order of
/// `schemas/v2/topk.json`; `keep_list` stores the full prod list.
pub(crate) fn append_topk_v2(
    row: &mut RowCursor<'_>,
    r: &TopkRow,
    keep_list: bool,
) -> Result<(), TraceError> {
    let prod = &r.prod;
    let shadow = r.shadow.as_ref().map(|(_, s)| s);
    let prod_only = shadow.map(|s| only_in(&prod.indices, &s.indices));
    let shadow_only = shadow.map(|s| only_in(&s.indices, &prod.indices));
    let prod_candidates = r.boundary_band.and_then(|_| Candidates::of(prod));
    let shadow_candidates = r.boundary_band.and(shadow).and_then(Candidates::of);
    let counts = shadow.map(|s| Counts::of(&prod.indices, &s.indices, &[]));
    let sparse = r.visible > r.k;
    // Churn needs the band, both paths' candidates and a sparse row; where
    // one is missing the counts are null and a reader calls the churn unknown.
    let churn = match (
        r.boundary_band,
        &prod_candidates,
        &shadow_candidates,
        &prod_only,
        &shadow_only,
    ) {
        (Some(band), Some(p), Some(s), Some(po), Some(so)) if sparse => {
            Some(churn_from_boundaries(po, so, p.view(), s.view(), band))
        }
        _ => None,
    };

    row.i32(Some(r.step))?;
    row.i32(Some(r.layer))?;
    row.i32(Some(r.token))?;
    row.str(r.shadow.as_ref().map(|(input, _)| input.as_str()))?;
    row.i32(Some(r.indexer_layer))?;
    row.str(Some(r.unit.name))?;
    row.i32(Some(r.unit.tokens))?;
    row.i32(Some(r.k))?;
    row.i32(Some(r.visible))?;
    row.i32(count(prod.indices.len()))?;
    row.f32(prod.kth_score)?;
    row.f32(prod.kth_margin)?;
    row.i32(shadow.and_then(|s| count(s.indices.len())))?;
    row.f32(shadow.and_then(|s| s.kth_score))?;
    row.f32(shadow.and_then(|s| s.kth_margin))?;
    row.i32(counts.and_then(|c| count(c.shared)))?;
    row.f32(r.boundary_band)?;
    row.i32(churn.and_then(|c| count(c.shared)))?;
    row.i32(churn.and_then(|c| count(c.prod_only)))?;
    row.i32(churn.and_then(|c| count(c.shadow_only)))?;
    row.i32(churn.and_then(|c| count(c.unselected)))?;
    row.f32(counts.map(|c| c.overlap().jaccard() as f32))?;
    row.f32(
        counts
            .zip(churn)
            .map(|(c, churn)| Counts { churn, ..c }.overlap_no_churn().jaccard() as f32),
    )?;
    row.list_i32(prod_only.as_deref().map(gaps).as_deref())?;
    row.list_i32(shadow_only.as_deref().map(gaps).as_deref())?;
    for candidates in [&prod_candidates, &shadow_candidates] {
        row.list_i32(candidates.as_ref().map(|c| gaps(&c.keys)).as_deref())?;
        row.list_f32(candidates.as_ref().map(|c| c.offsets.as_slice()))?;
        row.list_bool(candidates.as_ref().map(|c| c.selected.as_slice()))?;
    }
    row.list_i32(keep_list.then(|| gaps(&prod.indices)).as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_n_samples_token_positions_that_are_multiples_of_n() {
        let every = TopkLists::Every(4);
        let sampled: Vec<i32> = (0..10).filter(|&t| every.samples(t)).collect();
        assert_eq!(sampled, [0, 4, 8]);
        assert!(!TopkLists::None.samples(0));
        assert!(TopkLists::All.samples(7));
        assert!(!every.samples(-4), "no position is negative");
    }

    #[test]
    fn settings_round_trip_through_their_json() {
        for lists in [TopkLists::None, TopkLists::All, TopkLists::Every(64)] {
            assert_eq!(TopkLists::from_setting(&lists.setting()), Some(lists));
        }
        assert_eq!(
            TopkLists::from_setting(&serde_json::json!({"kind": "every", "n": 0})),
            None
        );
    }

    #[test]
    fn only_in_keeps_the_keys_the_other_list_lacks() {
        assert_eq!(only_in(&[1, 2, 5, 9], &[2, 3, 9]), [1, 5]);
        assert_eq!(only_in(&[], &[1]), Vec::<i32>::new());
        assert_eq!(only_in(&[4], &[]), [4]);
    }
}
