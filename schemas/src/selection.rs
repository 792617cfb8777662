//! Top-k Jaccard and boundary churn as the vocabulary defines them
//! (DESIGN.md): overlap between two selections over their valid entries
//! (padding, any negative index, excluded), and the same with boundary churn
//! removed. Defined once here, beside the format that stores selections, so
//! the tracer and the analyzer compute the same thing.
//!
//! Inputs are sorted ascending (the stored form); merging two sorted lists
//! needs no allocation and no hashing.
//!
//! Trace format v2 stores a row's selections as counts ([`Counts`]), the keys
//! only one path selected, and each path's boundary candidates
//! ([`BoundaryView`]), all key lists gap-coded ([`gaps`], [`keys_from_gaps`]):
//! the producer computes the counts with these functions, and a reader
//! recomputes them from the lists with the same ones.

/// The boundary band is relative (`SHADOWTRACE_BOUNDARY_BAND`): in scores, the
/// band times a row's score scale, the mean |score| of the reference path's
/// top-k (schemas/v2/topk.json `boundary_band` says why). What the manifest
/// calls that scale (`settings.boundary_band_scale`); a run without it
/// recorded one absolute band for every row.
pub const BAND_SCALE: &str = "mean_abs_reference_topk_score";

/// How far the boundary lists reach, in bands: churn counts use the band, the
/// lists keep keys out to this many times it, so a reader can widen the band
/// up to that as well as narrow it (`settings.boundary_stored`).
pub const BAND_STORED: f32 = 2.0;

/// How two selections overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overlap {
    /// Members of both.
    pub intersection: usize,
    /// Members of either.
    pub union: usize,
    /// Members of the reference (shadow) selection.
    pub reference_len: usize,
}

impl Overlap {
    /// |A ∩ B| / |A ∪ B|; 1 when both are empty (nothing to disagree on).
    #[must_use]
    pub fn jaccard(&self) -> f64 {
        if self.union == 0 {
            1.0
        } else {
            self.intersection as f64 / self.union as f64
        }
    }

    /// |A ∩ B| / |B|, B the reference: the share of the reference's keys the
    /// production path also selected; 1 when the reference is empty.
    #[must_use]
    pub fn recall(&self) -> f64 {
        if self.reference_len == 0 {
            1.0
        } else {
            self.intersection as f64 / self.reference_len as f64
        }
    }
}

/// Overlap of `prod` with the reference `shadow`, both sorted ascending;
/// negative entries (padding) are ignored.
#[must_use]
pub fn overlap(prod: &[i32], shadow: &[i32]) -> Overlap {
    overlap_with_and_without(prod, shadow, &[]).0
}

/// As [`overlap`], with the keys in `excluded` (sorted ascending) removed
/// from both selections first: the overlap without boundary churn.
#[must_use]
pub fn overlap_excluding(prod: &[i32], shadow: &[i32], excluded: &[i32]) -> Overlap {
    overlap_with_and_without(prod, shadow, excluded).1
}

/// [`overlap`] and [`overlap_excluding`] in one merge of the two selections:
/// the analyzer's hot loop, one pass per row and no allocation.
#[must_use]
pub fn overlap_with_and_without(
    prod: &[i32],
    shadow: &[i32],
    excluded: &[i32],
) -> (Overlap, Overlap) {
    let (mut all, mut clean) = (Overlap::default(), Overlap::default());
    let (mut i, mut j, mut e) = (0, 0, 0);
    loop {
        // Skip padding on either side.
        while i < prod.len() && prod[i] < 0 {
            i += 1;
        }
        while j < shadow.len() && shadow[j] < 0 {
            j += 1;
        }
        let (p, s) = (prod.get(i).copied(), shadow.get(j).copied());
        let (key, in_prod, in_shadow) = match (p, s) {
            (None, None) => break,
            (Some(p), None) => (p, true, false),
            (None, Some(s)) => (s, false, true),
            (Some(p), Some(s)) => (p.min(s), p <= s, s <= p),
        };
        i += usize::from(in_prod);
        j += usize::from(in_shadow);
        // Both ascend, so the excluded cursor only moves forward.
        while e < excluded.len() && excluded[e] < key {
            e += 1;
        }
        let churn = excluded.get(e) == Some(&key);
        for (counts, counted) in [(&mut all, true), (&mut clean, !churn)] {
            if counted {
                counts.union += 1;
                counts.intersection += usize::from(in_prod && in_shadow);
                counts.reference_len += usize::from(in_shadow);
            }
        }
    }
    (all, clean)
}

/// Keys of a boundary list whose score lies within `margin` of the k-th
/// score: the members whose selection is a coin toss at this precision.
pub fn churn<'a>(
    boundary_indices: &'a [i32],
    boundary_scores: &'a [f32],
    kth_score: f32,
    margin: f32,
) -> impl Iterator<Item = i32> + 'a {
    boundary_indices
        .iter()
        .zip(boundary_scores)
        .filter(move |&(_, &score)| (score - kth_score).abs() <= margin)
        .map(|(&i, _)| i)
}

/// [`churn`] collected, sorted and deduplicated.
#[must_use]
pub fn churn_keys(
    boundary_indices: &[i32],
    boundary_scores: &[f32],
    kth_score: f32,
    margin: f32,
) -> Vec<i32> {
    let mut keys: Vec<i32> = churn(boundary_indices, boundary_scores, kth_score, margin).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// One path's side of a query row, as the analyzer reads it from a `topk`
/// row: the selection (ascending), the k-th score, and the boundary keys the
/// producer listed within its band, with their scores (`None`: not listed).
#[derive(Debug, Clone, Copy)]
pub struct RowSide<'a> {
    /// Selected keys, ascending; negative entries are padding.
    pub indices: &'a [i32],
    /// The k-th score; `None` for a dense row.
    pub kth_score: Option<f32>,
    /// Boundary keys and their scores.
    pub boundary: Option<(&'a [i32], &'a [f32])>,
}

/// One row's overlap of `prod` with the reference `shadow`, churn included
/// and excluded: churn is the keys of either side's boundary list within
/// `margin` of that side's k-th score (a side without a k-th score has none).
/// The analyzer's per-row definition (`metrics::topk_overlap`), for a
/// producer that holds both selections in memory. `excluded` is scratch,
/// left holding the churn keys.
#[must_use]
pub fn row_overlap(
    prod: RowSide<'_>,
    shadow: RowSide<'_>,
    margin: f32,
    excluded: &mut Vec<i32>,
) -> (Overlap, Overlap) {
    excluded.clear();
    for side in [prod, shadow] {
        let (keys, scores) = side.boundary.unwrap_or((&[], &[]));
        excluded.extend(churn(
            keys,
            scores,
            side.kth_score.unwrap_or(f32::NAN),
            margin,
        ));
    }
    excluded.sort_unstable();
    excluded.dedup();
    overlap_with_and_without(prod.indices, shadow.indices, excluded)
}

/// A sorted key list gap-coded: the first key, then each key's distance to
/// the previous one.
#[must_use]
pub fn gaps(keys: &[i32]) -> Vec<i32> {
    let mut previous = 0;
    keys.iter()
        .map(|&key| {
            let gap = key.wrapping_sub(previous);
            previous = key;
            gap
        })
        .collect()
}

/// Keys from a gap-coded list: the running sum of its gaps.
#[must_use]
pub fn keys_from_gaps(gaps: &[i32]) -> Vec<i32> {
    let mut out = Vec::with_capacity(gaps.len());
    extend_keys_from_gaps(gaps, &mut out);
    out
}

/// Appends the keys of a gap-coded list to `out` (no allocation when it has room).
pub fn extend_keys_from_gaps(gaps: &[i32], out: &mut Vec<i32>) {
    let mut key = 0_i32;
    out.extend(gaps.iter().map(|&gap| {
        key = key.wrapping_add(gap);
        key
    }));
}

/// Churn keys by which paths selected them: what a v2 row records of its
/// boundary churn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChurnCounts {
    /// Churn keys both paths selected.
    pub shared: usize,
    /// Churn keys only prod selected.
    pub prod_only: usize,
    /// Churn keys only the shadow selected.
    pub shadow_only: usize,
    /// Churn keys neither path selected.
    pub unselected: usize,
}

impl ChurnCounts {
    /// Every churn key.
    #[must_use]
    pub fn total(&self) -> usize {
        self.shared + self.prod_only + self.shadow_only + self.unselected
    }

    fn add(&mut self, in_prod: bool, in_shadow: bool) {
        match (in_prod, in_shadow) {
            (true, true) => self.shared += 1,
            (true, false) => self.prod_only += 1,
            (false, true) => self.shadow_only += 1,
            (false, false) => self.unselected += 1,
        }
    }
}

/// What one v2 row's summary holds: selection sizes, the keys both selected,
/// and the churn; Jaccard and recall, with and without churn, follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Keys prod selected (padding excluded).
    pub prod_selected: usize,
    /// Keys the shadow selected (padding excluded).
    pub shadow_selected: usize,
    /// Keys both selected.
    pub shared: usize,
    /// The churn keys, by who selected them.
    pub churn: ChurnCounts,
}

impl Counts {
    /// Counts of two sorted selections with the sorted, deduplicated churn
    /// keys `churn`: one merge, as [`overlap_with_and_without`].
    #[must_use]
    pub fn of(prod: &[i32], shadow: &[i32], churn: &[i32]) -> Counts {
        let (all, _) = overlap_with_and_without(prod, shadow, &[]);
        let mut counts = Counts {
            prod_selected: prod.iter().filter(|&&k| k >= 0).count(),
            shadow_selected: all.reference_len,
            shared: all.intersection,
            churn: ChurnCounts::default(),
        };
        for key in churn {
            counts.churn.add(
                prod.binary_search(key).is_ok(),
                shadow.binary_search(key).is_ok(),
            );
        }
        counts
    }

    /// Overlap with churn: |P ∩ S|, |P ∪ S|, |S|.
    #[must_use]
    pub fn overlap(&self) -> Overlap {
        Overlap {
            intersection: self.shared,
            union: (self.prod_selected + self.shadow_selected).saturating_sub(self.shared),
            reference_len: self.shadow_selected,
        }
    }

    /// Overlap with the churn keys removed from both selections.
    #[must_use]
    pub fn overlap_no_churn(&self) -> Overlap {
        let all = self.overlap();
        let c = &self.churn;
        Overlap {
            intersection: all.intersection.saturating_sub(c.shared),
            union: all
                .union
                .saturating_sub(c.shared + c.prod_only + c.shadow_only),
            reference_len: all.reference_len.saturating_sub(c.shared + c.shadow_only),
        }
    }

    /// Keys prod selected and the shadow did not.
    #[must_use]
    pub fn prod_only(&self) -> usize {
        self.prod_selected.saturating_sub(self.shared)
    }

    /// Keys the shadow selected and prod did not.
    #[must_use]
    pub fn shadow_only(&self) -> usize {
        self.shadow_selected.saturating_sub(self.shared)
    }
}

/// One path's boundary candidates as v2 stores them: keys (decoded from the
/// gaps), each key's score minus the path's k-th score, and whether the path
/// selected it.
#[derive(Debug, Clone, Copy)]
pub struct BoundaryView<'a> {
    /// Keys, ascending.
    pub keys: &'a [i32],
    /// Score minus the k-th score, same order.
    pub offsets: &'a [f32],
    /// Whether the path selected the key, same order.
    pub selected: &'a [bool],
}

/// The churn of a row within `margin` of each path's k-th score, from what
/// v2 stores: each path's boundary candidates and the keys only one path
/// selected (`prod_only`, `shadow_only`: keys, ascending). A prod candidate
/// the shadow also selected is one prod selected that is not prod-only (and
/// one prod did not select is shadow-only or unselected), and the other way
/// round, so the two lists and the differences decide every key's status.
#[must_use]
pub fn churn_from_boundaries(
    prod_only: &[i32],
    shadow_only: &[i32],
    prod: BoundaryView<'_>,
    shadow: BoundaryView<'_>,
    margin: f32,
) -> ChurnCounts {
    let mut counts = ChurnCounts::default();
    let within =
        |b: BoundaryView<'_>, i: usize| b.offsets.get(i).is_some_and(|o| o.abs() <= margin);
    // Every list is ascending and each loop asks in ascending key order, so
    // membership is one forward walk per list, not a search per key: the
    // summary check runs this on every row of a trace.
    let (mut in_prod_only, mut in_shadow_only) =
        (Ascending::of(prod_only), Ascending::of(shadow_only));
    // Keys in prod's list first; a shadow candidate also in prod's churn is counted once.
    for (i, &key) in prod.keys.iter().enumerate() {
        if !within(prod, i) {
            continue;
        }
        let in_prod = prod.selected.get(i).copied().unwrap_or(false);
        let in_shadow = if in_prod {
            !in_prod_only.holds(key)
        } else {
            in_shadow_only.holds(key)
        };
        counts.add(in_prod, in_shadow);
    }
    let (mut in_prod_only, mut in_shadow_only) =
        (Ascending::of(prod_only), Ascending::of(shadow_only));
    let mut in_prod_candidates = Ascending::of(prod.keys);
    for (i, &key) in shadow.keys.iter().enumerate() {
        if !within(shadow, i) {
            continue;
        }
        if let Some(j) = in_prod_candidates.position(key)
            && within(prod, j)
        {
            continue;
        }
        let in_shadow = shadow.selected.get(i).copied().unwrap_or(false);
        let in_prod = if in_shadow {
            !in_shadow_only.holds(key)
        } else {
            in_prod_only.holds(key)
        };
        counts.add(in_prod, in_shadow);
    }
    counts
}

/// Membership in an ascending list for keys asked in ascending order.
struct Ascending<'a> {
    keys: &'a [i32],
    at: usize,
}

impl<'a> Ascending<'a> {
    fn of(keys: &'a [i32]) -> Ascending<'a> {
        Ascending { keys, at: 0 }
    }

    /// Where `key` is, given every earlier question asked for a key no larger.
    fn position(&mut self, key: i32) -> Option<usize> {
        while self.keys.get(self.at).is_some_and(|&k| k < key) {
            self.at += 1;
        }
        (self.keys.get(self.at) == Some(&key)).then_some(self.at)
    }

    fn holds(&mut self, key: i32) -> bool {
        self.position(key).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_selections_overlap_fully() {
        let o = overlap(&[1, 5, 9], &[1, 5, 9]);
        assert_eq!(
            o,
            Overlap {
                intersection: 3,
                union: 3,
                reference_len: 3
            }
        );
        assert_eq!((o.jaccard(), o.recall()), (1.0, 1.0));
    }

    #[test]
    fn disjoint_selections_share_nothing() {
        let o = overlap(&[0, 2, 4], &[1, 3, 5]);
        assert_eq!((o.intersection, o.union), (0, 6));
        assert_eq!((o.jaccard(), o.recall()), (0.0, 0.0));
    }

    #[test]
    fn partial_overlap_counts_each_side() {
        // prod {1,2,3,4}, shadow {3,4,5}: 2 shared, 5 in all.
        let o = overlap(&[1, 2, 3, 4], &[3, 4, 5]);
        assert_eq!(
            o,
            Overlap {
                intersection: 2,
                union: 5,
                reference_len: 3
            }
        );
        assert_eq!(o.jaccard(), 2.0 / 5.0);
        assert_eq!(o.recall(), 2.0 / 3.0);
    }

    #[test]
    fn padding_is_not_a_member() {
        let o = overlap(&[-1, -1, 2, 7], &[-1, 2, 7, 8]);
        assert_eq!(
            o,
            Overlap {
                intersection: 2,
                union: 3,
                reference_len: 3
            }
        );
    }

    #[test]
    fn dense_rows_that_select_everything_agree_fully() {
        let all: Vec<i32> = (0..100).collect();
        assert_eq!(overlap(&all, &all).jaccard(), 1.0);
        assert_eq!(
            overlap(&[], &[]).jaccard(),
            1.0,
            "two empty selections do not disagree"
        );
    }

    #[test]
    fn churn_only_at_the_boundary_vanishes_once_excluded() {
        // Keys 0..6 clear the bar in both; prod took 8 where shadow took 9,
        // both scored within 1e-6 of the k-th score.
        let prod = [0, 1, 2, 3, 4, 5, 8];
        let shadow = [0, 1, 2, 3, 4, 5, 9];
        assert_eq!(overlap(&prod, &shadow).jaccard(), 6.0 / 8.0);
        let churn = churn_keys(&[9, 8, 3], &[0.7, 0.7000001, 0.9], 0.7, 1e-6);
        assert_eq!(churn, [8, 9], "key 3 is far from the k-th score");
        let o = overlap_excluding(&prod, &shadow, &churn);
        assert_eq!((o.jaccard(), o.recall()), (1.0, 1.0));
    }

    #[test]
    fn one_pass_gives_both_overlaps_of_the_separate_definitions() {
        // prod {1, 2, 3, 9}, shadow {2, 3, 4, 9}, churn {1, 4, 7}.
        let (all, clean) = overlap_with_and_without(&[-1, 1, 2, 3, 9], &[2, 3, 4, 9], &[1, 4, 7]);
        assert_eq!(
            all,
            Overlap {
                intersection: 3,
                union: 5,
                reference_len: 4
            }
        );
        assert_eq!(
            clean,
            Overlap {
                intersection: 3,
                union: 3,
                reference_len: 3
            }
        );
        assert_eq!(all, overlap(&[1, 2, 3, 9], &[2, 3, 4, 9]));
    }

    #[test]
    fn a_rows_overlap_removes_either_sides_churn_within_the_margin() {
        // prod {0, 1, 8}, shadow {0, 1, 9}: 8 and 9 sit at the k-th score of
        // their own side; 1 is far from it.
        let prod = RowSide {
            indices: &[0, 1, 8],
            kth_score: Some(0.5),
            boundary: Some((&[8, 1], &[0.5, 0.9])),
        };
        let shadow = RowSide {
            indices: &[0, 1, 9],
            kth_score: Some(0.25),
            boundary: Some((&[9], &[0.2500001])),
        };
        let mut scratch = Vec::new();
        let (all, clean) = row_overlap(prod, shadow, 1e-3, &mut scratch);
        assert_eq!((all.intersection, all.union), (2, 4));
        assert_eq!((clean.intersection, clean.union), (2, 2));
        assert_eq!(scratch, [8, 9]);
        let dense = RowSide {
            indices: &[0, 1, 8],
            kth_score: None,
            boundary: None,
        };
        let (_, no_churn) = row_overlap(dense, shadow, 1e-3, &mut scratch);
        assert_eq!(
            no_churn.union, 3,
            "only the shadow's churn key 9 is removed"
        );
    }

    #[test]
    fn excluding_churn_keeps_a_real_divergence() {
        let prod = [0, 1, 2, 50];
        let shadow = [0, 1, 2, 60];
        let o = overlap_excluding(&prod, &shadow, &[60]);
        assert_eq!(
            o,
            Overlap {
                intersection: 3,
                union: 4,
                reference_len: 3
            },
            "50 is still prod-only"
        );
    }

    #[test]
    fn gaps_round_trip_and_keep_the_count() {
        let keys = [0, 3, 4, 100, 8191];
        assert_eq!(gaps(&keys), [0, 3, 1, 96, 8091]);
        assert_eq!(keys_from_gaps(&gaps(&keys)), keys);
        assert!(gaps(&[]).is_empty());
    }

    #[test]
    fn counts_give_the_overlaps_of_the_full_lists() {
        // prod {1, 2, 3, 9}, shadow {2, 3, 4, 9}, churn {1, 4, 7}: as
        // one_pass_gives_both_overlaps_of_the_separate_definitions.
        let (prod, shadow, churn) = ([-1, 1, 2, 3, 9], [2, 3, 4, 9], [1, 4, 7]);
        let c = Counts::of(&prod, &shadow, &churn);
        assert_eq!((c.prod_selected, c.shadow_selected, c.shared), (4, 4, 3));
        assert_eq!(
            c.churn,
            ChurnCounts {
                shared: 0,
                prod_only: 1,
                shadow_only: 1,
                unselected: 1
            }
        );
        let (all, clean) = overlap_with_and_without(&prod, &shadow, &churn);
        assert_eq!((c.overlap(), c.overlap_no_churn()), (all, clean));
        assert_eq!(c.churn.total(), 3);
    }

    #[test]
    fn churn_from_boundaries_equals_a_set_recount_on_random_rows() {
        use std::collections::BTreeSet;
        // A splitmix64 stream: rows of 64 keys, each path selecting about
        // half, candidates drawn from every key with random offsets.
        let mut state = 0x5eed_u64;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        for row in 0..500 {
            let pick = |next: &mut dyn FnMut() -> u64, one_in: u64| -> BTreeSet<i32> {
                (0..64).filter(|_| next().is_multiple_of(one_in)).collect()
            };
            let prod = pick(&mut next, 2);
            let shadow = pick(&mut next, 2);
            let candidates = |next: &mut dyn FnMut() -> u64, selected: &BTreeSet<i32>| {
                let keys: Vec<i32> = pick(next, 3).into_iter().collect();
                let offsets: Vec<f32> = keys
                    .iter()
                    .map(|_| (next() % 9) as f32 / 8.0 - 0.5)
                    .collect();
                let flags: Vec<bool> = keys.iter().map(|k| selected.contains(k)).collect();
                (keys, offsets, flags)
            };
            let (pk, po, ps) = candidates(&mut next, &prod);
            let (sk, so, ss) = candidates(&mut next, &shadow);
            let prod_only: Vec<i32> = prod.difference(&shadow).copied().collect();
            let shadow_only: Vec<i32> = shadow.difference(&prod).copied().collect();
            for margin in [0.0_f32, 0.25, 0.5] {
                let mut churn = BTreeSet::new();
                for (keys, offsets) in [(&pk, &po), (&sk, &so)] {
                    for (k, o) in keys.iter().zip(offsets.iter()) {
                        if o.abs() <= margin {
                            churn.insert(*k);
                        }
                    }
                }
                let mut expected = ChurnCounts::default();
                for k in &churn {
                    expected.add(prod.contains(k), shadow.contains(k));
                }
                let got = churn_from_boundaries(
                    &prod_only,
                    &shadow_only,
                    BoundaryView {
                        keys: &pk,
                        offsets: &po,
                        selected: &ps,
                    },
                    BoundaryView {
                        keys: &sk,
                        offsets: &so,
                        selected: &ss,
                    },
                    margin,
                );
                assert_eq!(got, expected, "row {row}, margin {margin}");
            }
        }
    }

    #[test]
    fn churn_from_boundaries_matches_churn_from_full_lists() {
        // prod {0, 1, 2, 5}, shadow {0, 1, 3, 6}; prod's candidates 2, 3, 7
        // (2 selected), shadow's 2, 3, 5 (3 selected); offsets chosen so a
        // margin of 0.5 keeps 2, 3 of prod's and 3, 5 of the shadow's.
        let (prod, shadow) = ([0, 1, 2, 5], [0, 1, 3, 6]);
        let prod_b = BoundaryView {
            keys: &[2, 3, 7],
            offsets: &[0.25, -0.5, -0.75],
            selected: &[true, false, false],
        };
        let shadow_b = BoundaryView {
            keys: &[2, 3, 5],
            offsets: &[-0.625, 0.0, -0.125],
            selected: &[false, true, false],
        };
        let (prod_only, shadow_only) = ([2, 5], [3, 6]);
        for margin in [0.0_f32, 0.125, 0.5, 0.75, 1.0] {
            let from_lists = |b: BoundaryView<'_>| -> Vec<i32> {
                b.keys
                    .iter()
                    .zip(b.offsets)
                    .filter(|(_, o)| o.abs() <= margin)
                    .map(|(k, _)| *k)
                    .collect()
            };
            let mut churn = from_lists(prod_b);
            churn.extend(from_lists(shadow_b));
            churn.sort_unstable();
            churn.dedup();
            assert_eq!(
                churn_from_boundaries(&prod_only, &shadow_only, prod_b, shadow_b, margin),
                Counts::of(&prod, &shadow, &churn).churn,
                "margin {margin}"
            );
        }
    }
}
