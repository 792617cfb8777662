//! Top-k Jaccard and boundary churn as the vocabulary defines them
//! (DESIGN.md): overlap between two selections over their valid entries
//! (padding, any negative index, excluded), and the same with boundary churn
//! removed. Defined once here, beside the format that stores selections, so
//! the tracer and the analyzer compute the same thing.
//!
//! Inputs are sorted ascending (the stored form); merging two sorted lists
//! needs no allocation and no hashing.

/// How two selections overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    overlap_excluding(prod, shadow, std::iter::empty())
}

/// As [`overlap`], with the keys `excluded` yields (ascending) removed from
/// both selections first: the overlap without boundary churn.
#[must_use]
pub fn overlap_excluding<I>(prod: &[i32], shadow: &[i32], excluded: I) -> Overlap
where
    I: IntoIterator<Item = i32>,
    I::IntoIter: Clone,
{
    let excluded = excluded.into_iter();
    let mut a = Members::new(prod, excluded.clone());
    let mut b = Members::new(shadow, excluded);
    let (mut intersection, mut union, mut reference_len) = (0, 0, 0);
    let (mut x, mut y) = (a.next(), b.next());
    loop {
        match (x, y) {
            (None, None) => break,
            (Some(_), None) => {
                union += 1;
                x = a.next();
            }
            (None, Some(_)) => {
                union += 1;
                reference_len += 1;
                y = b.next();
            }
            (Some(p), Some(s)) if p == s => {
                intersection += 1;
                union += 1;
                reference_len += 1;
                x = a.next();
                y = b.next();
            }
            (Some(p), Some(s)) if p < s => {
                union += 1;
                x = a.next();
            }
            (Some(_), Some(_)) => {
                union += 1;
                reference_len += 1;
                y = b.next();
            }
        }
    }
    Overlap {
        intersection,
        union,
        reference_len,
    }
}

/// Keys of a boundary list (ascending) whose score lies within `margin` of
/// the k-th score: the members whose selection is a coin toss at this
/// precision. Lazy and allocation-free.
pub fn churn<'a>(
    boundary_indices: &'a [i32],
    boundary_scores: &'a [f32],
    kth_score: f32,
    margin: f32,
) -> impl Iterator<Item = i32> + Clone + 'a {
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

/// The ascending union of two ascending key sequences, each key once: the
/// churn seen from prod's scores merged with the churn seen from the shadow's.
pub fn union_sorted<A, B>(a: A, b: B) -> impl Iterator<Item = i32> + Clone
where
    A: Iterator<Item = i32> + Clone,
    B: Iterator<Item = i32> + Clone,
{
    UnionSorted {
        a: a.peekable(),
        b: b.peekable(),
        last: None,
    }
}

#[derive(Clone)]
struct UnionSorted<A: Iterator<Item = i32>, B: Iterator<Item = i32>> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
    last: Option<i32>,
}

impl<A: Iterator<Item = i32>, B: Iterator<Item = i32>> Iterator for UnionSorted<A, B> {
    type Item = i32;

    fn next(&mut self) -> Option<i32> {
        loop {
            let next = match (self.a.peek(), self.b.peek()) {
                (None, None) => return None,
                (Some(&x), Some(&y)) if x <= y => self.a.next(),
                (Some(_), None) => self.a.next(),
                _ => self.b.next(),
            };
            if next != self.last {
                self.last = next;
                return next;
            }
        }
    }
}

/// Valid members of a sorted selection, skipping padding and excluded keys.
struct Members<'a, E: Iterator<Item = i32>> {
    keys: std::slice::Iter<'a, i32>,
    excluded: std::iter::Peekable<E>,
}

impl<'a, E: Iterator<Item = i32>> Members<'a, E> {
    fn new(keys: &'a [i32], excluded: E) -> Members<'a, E> {
        Members {
            keys: keys.iter(),
            excluded: excluded.peekable(),
        }
    }
}

impl<E: Iterator<Item = i32>> Iterator for Members<'_, E> {
    type Item = i32;

    fn next(&mut self) -> Option<i32> {
        for &key in self.keys.by_ref() {
            if key < 0 {
                continue;
            }
            // Both sequences ascend, so the excluded cursor only moves forward.
            while self.excluded.next_if(|&e| e < key).is_some() {}
            if self.excluded.peek() != Some(&key) {
                return Some(key);
            }
        }
        None
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
        let o = overlap_excluding(&prod, &shadow, churn.iter().copied());
        assert_eq!((o.jaccard(), o.recall()), (1.0, 1.0));
    }

    #[test]
    fn churn_seen_from_either_path_is_merged_once_and_in_order() {
        let from_prod = churn(&[2, 5, 9], &[1.0, 1.0005, 3.0], 1.0, 1e-3);
        let from_shadow = churn(&[1, 5, 7], &[0.9995, 1.0, 1.0], 1.0, 1e-3);
        assert_eq!(
            union_sorted(from_prod, from_shadow).collect::<Vec<_>>(),
            [1, 2, 5, 7]
        );
    }

    #[test]
    fn excluding_churn_keeps_a_real_divergence() {
        let prod = [0, 1, 2, 50];
        let shadow = [0, 1, 2, 60];
        let o = overlap_excluding(&prod, &shadow, [60]);
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
