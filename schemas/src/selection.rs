//! Top-k Jaccard and boundary churn as the vocabulary defines them
//! (DESIGN.md): overlap between two selections over their valid entries
//! (padding, any negative index, excluded), and the same with boundary churn
//! removed. Defined once here, beside the format that stores selections, so
//! the tracer and the analyzer compute the same thing.
//!
//! Inputs are sorted ascending (the stored form); merging two sorted lists
//! needs no allocation and no hashing.

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
}
