//! Per-token statistics of captured tensors, as the `hidden`, `events` and
//! `logits` column docs define them, computed on the tensor's device and
//! brought to the host as a few vectors per capture.

use tch::{Device, Kind, Tensor};

use crate::record::{Comparison, TopLogits, VectorStats};

/// A tensor's values on the host, flattened (tch converts 1-D tensors only).
fn host_f32(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).to_device(Device::Cpu).flatten(0, -1))
        .unwrap_or_default()
}

fn host_i64(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.to_kind(Kind::Int64).to_device(Device::Cpu).flatten(0, -1))
        .unwrap_or_default()
}

/// Statistics of each row of `x` `[S, N]`.
#[must_use]
pub fn vector_stats(x: &Tensor) -> Vec<VectorStats> {
    let x = x.to_kind(Kind::Double);
    let finite = x.isfinite();
    let clean = x.where_self(&finite, &x.zeros_like());
    let nan = host_i64(&x.isnan().sum_dim_intlist(-1, false, Kind::Int64));
    let pos = host_i64(&x.isposinf().sum_dim_intlist(-1, false, Kind::Int64));
    let neg = host_i64(&x.isneginf().sum_dim_intlist(-1, false, Kind::Int64));
    let max_abs = host_f32(&clean.abs().amax(-1, false));
    let l2 = host_f32(&clean.norm_scalaropt_dim(2, -1, false));
    (0..nan.len())
        .map(|i| VectorStats {
            nan: nan[i],
            pos_inf: pos[i],
            neg_inf: neg[i],
            max_abs: max_abs[i],
            l2: l2[i],
        })
        .collect()
}

/// prod against shadow for each row of two `[S, N]` tensors; NaN where
/// either row holds a non-finite value. Against a zero shadow the relative
/// error is 0 when prod is zero too and +inf otherwise (never 0/0 = NaN,
/// which would read as a non-finite vector).
#[must_use]
pub fn comparisons(prod: &Tensor, shadow: &Tensor) -> Vec<Comparison> {
    let (p, s) = (prod.to_kind(Kind::Double), shadow.to_kind(Kind::Double));
    let diff = &p - &s;
    let bad = p
        .isfinite()
        .all_dim(-1, false)
        .logical_and(&s.isfinite().all_dim(-1, false))
        .logical_not();
    let nan = |t: Tensor| t.masked_fill(&bad, f64::NAN);
    let (diff_norm, shadow_norm) = (
        diff.norm_scalaropt_dim(2, -1, false),
        s.norm_scalaropt_dim(2, -1, false),
    );
    let against_zero = diff_norm
        .zeros_like()
        .masked_fill(&diff_norm.gt(0.0), f64::INFINITY);
    let rel = host_f32(&nan(
        (&diff_norm / &shadow_norm).where_self(&shadow_norm.ne(0.0), &against_zero)
    ));
    let cos = host_f32(&nan((&p * &s).sum_dim_intlist(-1, false, Kind::Double)
        / (p.norm_scalaropt_dim(2, -1, false)
            * s.norm_scalaropt_dim(2, -1, false))));
    let max = host_f32(&nan(diff.abs().amax(-1, false)));
    (0..rel.len())
        .map(|i| Comparison {
            rel_l2_err: rel[i],
            cosine: cos[i],
            max_abs_diff: max[i],
        })
        .collect()
}

/// Per non-finite kind present in `x` `[S, N]`: (kind, first token, first
/// channel, count over the whole tensor).
#[must_use]
pub fn nonfinite(x: &Tensor) -> Vec<(&'static str, i64, i64, i64)> {
    if x.isfinite().all().int64_value(&[]) == 1 {
        return Vec::new();
    }
    let x = x.to_kind(Kind::Float);
    [
        ("nan", x.isnan()),
        ("pos_inf", x.isposinf()),
        ("neg_inf", x.isneginf()),
    ]
    .into_iter()
    .filter_map(|(kind, mask)| {
        let count = mask.sum(Kind::Int64).int64_value(&[]);
        (count > 0).then(|| {
            let first = mask.nonzero().get(0);
            (
                kind,
                first.int64_value(&[0]),
                first.int64_value(&[1]),
                count,
            )
        })
    })
    .collect()
}

/// [`nonfinite`] over the visible scores of a causal indexer score matrix
/// `[T, S]`: query t sees keys s <= t, and the -inf beyond them is the mask,
/// not a score. (kind, first query, first key, count over the visible scores.)
#[must_use]
pub fn indexer_nonfinite(scores: &Tensor) -> Vec<(&'static str, i64, i64, i64)> {
    pooled_indexer_nonfinite(scores, 1)
}

/// [`indexer_nonfinite`] where a key is a pool of `tokens_per_key`
/// consecutive tokens, visible once the query sees its last token.
#[must_use]
pub fn pooled_indexer_nonfinite(
    scores: &Tensor,
    tokens_per_key: i64,
) -> Vec<(&'static str, i64, i64, i64)> {
    let size = scores.size();
    let device = scores.device();
    let last = (Tensor::arange(size[1], (Kind::Int64, device)) + 1) * tokens_per_key - 1;
    let queries = Tensor::arange(size[0], (Kind::Int64, device)).unsqueeze(1);
    let visible = last.unsqueeze(0).le_tensor(&queries);
    nonfinite(&scores.where_self(&visible, &scores.zeros_like()))
}

/// Top-`n` ids and log-probabilities of each row of `logits` `[S, V]`.
#[must_use]
pub fn top_logits(logits: &Tensor, n: i64) -> Vec<TopLogits> {
    let logprobs = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let (values, ids) = logprobs.topk(n.min(logits.size()[1]), -1, true, true);
    let (values, ids) = (host_f32(&values), host_i64(&ids));
    let n = usize::try_from(n.min(logits.size()[1])).unwrap_or(0);
    values
        .chunks(n.max(1))
        .zip(ids.chunks(n.max(1)))
        .map(|(v, i)| TopLogits {
            ids: i
                .iter()
                .map(|&id| i32::try_from(id).unwrap_or(i32::MAX))
                .collect(),
            logprobs: v.to_vec(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_of_known_vectors() {
        let x = Tensor::from_slice(&[3.0_f32, 4.0, 0.0, 1.0, f32::NAN, f32::INFINITY]).view([2, 3]);
        let s = vector_stats(&x);
        assert_eq!((s[0].l2, s[0].max_abs, s[0].nan), (5.0, 4.0, 0));
        assert_eq!((s[1].nan, s[1].pos_inf, s[1].neg_inf), (1, 1, 0));
        assert_eq!(
            (s[1].l2, s[1].max_abs),
            (1.0, 1.0),
            "over the finite elements"
        );
    }

    #[test]
    fn comparisons_of_known_pairs_and_nan_where_either_is_non_finite() {
        let p = Tensor::from_slice(&[3.0_f32, 4.0, 1.0, 1.0, 1.0, f32::NAN]).view([3, 2]);
        let s = Tensor::from_slice(&[3.0_f32, 4.0, 1.0, 0.0, 1.0, 1.0]).view([3, 2]);
        let c = comparisons(&p, &s);
        assert_eq!(
            (c[0].rel_l2_err, c[0].cosine, c[0].max_abs_diff),
            (0.0, 1.0, 0.0)
        );
        assert_eq!(c[1].rel_l2_err, 1.0);
        assert!((c[1].cosine - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert!(c[2].rel_l2_err.is_nan() && c[2].cosine.is_nan() && c[2].max_abs_diff.is_nan());
    }

    #[test]
    fn the_relative_error_against_a_zero_shadow_is_zero_or_infinite() {
        let p = Tensor::from_slice(&[0.0_f32, 0.0, 1.0, 0.0]).view([2, 2]);
        let s = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu));
        let c = comparisons(&p, &s);
        assert_eq!(c[0].rel_l2_err, 0.0, "both zero: no error");
        assert_eq!(
            c[1].rel_l2_err,
            f32::INFINITY,
            "prod moved off a zero shadow"
        );
    }

    #[test]
    fn non_finite_values_are_found_first_in_token_order_and_counted() {
        let mut x = Tensor::zeros([4, 3], (Kind::Float, Device::Cpu));
        let _ = x.get(2).get(1).fill_(f64::NAN);
        let _ = x.get(3).get(0).fill_(f64::NAN);
        let _ = x.get(1).get(2).fill_(f64::NEG_INFINITY);
        let found = nonfinite(&x);
        assert_eq!(found, vec![("nan", 2, 1, 2), ("neg_inf", 1, 2, 1)]);
        x = x.zeros_like();
        assert!(nonfinite(&x).is_empty());
    }

    #[test]
    fn indexer_scores_are_non_finite_only_among_visible_keys() {
        let ninf = f32::NEG_INFINITY;
        // Three queries over three keys; -inf above the diagonal is the mask.
        let scores =
            Tensor::from_slice(&[1.0_f32, ninf, ninf, 2.0, f32::NAN, ninf, ninf, 0.5, 1.0])
                .view([3, 3]);
        assert_eq!(
            indexer_nonfinite(&scores),
            vec![("nan", 1, 1, 1), ("neg_inf", 2, 0, 1)]
        );
    }

    #[test]
    fn top_logits_are_the_best_ids_with_their_log_probabilities() {
        let logits = Tensor::from_slice(&[0.0_f32, 2.0, 1.0, 5.0, 0.0, 0.0]).view([2, 3]);
        let top = top_logits(&logits, 2);
        assert_eq!(top[0].ids, vec![1, 2]);
        assert_eq!(top[1].ids[0], 0);
        let expected = 2.0 - (1.0_f32 + 2.0_f32.exp() + 1.0_f32.exp()).ln();
        assert!((top[0].logprobs[0] - expected).abs() < 1e-6);
    }
}
