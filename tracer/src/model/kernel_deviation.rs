//! The mechanisms of the kernel deviations (`super::deviation`): engine
//! kernels that compute the indexer's logits, its top-k or a block-FP8 GEMM
//! wrongly, each reduced to the op its upstream report root-caused. Pure
//! functions of tensors, so a test can give them inputs whose answer is
//! known by construction.
//!
//! - [`lowprec_scores`]: `fp8_mqa_logits` whose per-head products and head
//!   sum are held in bf16 or fp16 instead of fp32;
//! - [`paged_past_len`]: the paged-logits kernel returning near-random
//!   scores for keys past a context length (vLLM #39303, #47827);
//! - [`drop_overflowed_candidates`]: the radix top-k whose fp16 coarse key
//!   puts more candidates in the threshold bucket than its buffer holds,
//!   silently dropping the later ones (SGLang #37591, #36807);
//! - [`mtile_rows`]: block-FP8 GEMM rows wrong next to 16-row M-tile
//!   boundaries (SGLang #28685);
//! - [`trailing_topk`]: the selection of a reduction that returned zeros
//!   (mlx-lm #1454).

use tch::{Kind, Tensor};

/// A low-precision accumulator of the indexer logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LowPrecision {
    /// bfloat16: 8 significand bits.
    Bf16,
    /// float16: 11 significand bits.
    Fp16,
}

impl LowPrecision {
    /// The torch kind.
    #[must_use]
    pub fn kind(self) -> Kind {
        match self {
            LowPrecision::Bf16 => Kind::BFloat16,
            LowPrecision::Fp16 => Kind::Half,
        }
    }
}

/// Query rows scored at once by [`lowprec_scores`]: `[rows, H, keys]` fp32
/// intermediates within 64 MiB.
fn chunk_rows(heads: i64, keys: i64) -> i64 {
    ((16 << 20) / (heads * keys).max(1)).max(1)
}

/// Indexer scores `[T, S]` (fp32 values, -inf where masked) of q `[T, H, D]`
/// and k `[S, D]` (fp32, as the dot products see them: dequantized where
/// production quantizes) with head weights `w` `[T, H]` (H^-1/2 folded in),
/// computed as a logits kernel that accumulates in `low`: each head's
/// weighted term `w[t, h] * D^-1/2 * relu(q[t, h] . k[s])` rounded to `low`,
/// then summed over heads in order 0..H with the running sum rounded to
/// `low` after every addition. The dot products themselves stay fp32 (the
/// tensor cores' accumulator); what departs is the epilogue's precision.
pub fn lowprec_scores(
    q: &Tensor,
    k: &Tensor,
    w: &Tensor,
    query_positions: &Tensor,
    low: LowPrecision,
) -> Tensor {
    let (t, heads, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let s = k.size()[0];
    let kind = low.kind();
    let step = chunk_rows(heads, s);
    let mut parts = Vec::new();
    let mut start = 0;
    while start < t {
        let n = step.min(t - start);
        let dots = q
            .narrow(0, start, n)
            .reshape([n * heads, d])
            .matmul(&k.tr())
            .view([n, heads, s]);
        let terms = (dots.relu() * (d as f64).powf(-0.5)) * w.narrow(0, start, n).unsqueeze(2);
        let terms = terms.to_kind(kind);
        let mut acc = terms.select(1, 0);
        for h in 1..heads {
            // bf16 + bf16 in torch rounds the exact sum once: an accumulator
            // of that precision.
            acc = &acc + terms.select(1, h);
        }
        parts.push(acc.to_kind(Kind::Float));
        start += n;
    }
    let scores = Tensor::cat(&parts, 0);
    let keys = Tensor::arange(s, (Kind::Int64, q.device()));
    let visible = keys.unsqueeze(0).le_tensor(&query_positions.unsqueeze(1));
    scores.masked_fill(&visible.logical_not(), f64::NEG_INFINITY)
}

/// A value in `[0, 1)` per (layer, query, key) that looks random and is the
/// same on every run and device: the paged kernel's garbage, reproducible.
fn garbage(layer: i64, rows: i64, keys: i64, device: tch::Device) -> Tensor {
    let q = Tensor::arange(rows, (Kind::Double, device)).view([rows, 1]);
    let k = Tensor::arange(keys, (Kind::Double, device)).view([1, keys]);
    ((q * 78.233 + k * 12.9898 + layer as f64 * 37.719).sin() * 43_758.545_3)
        .frac()
        .abs()
        .to_kind(Kind::Float)
}

/// `scores` `[T, S]` (fp32, -inf where masked) as a paged-logits kernel that
/// is wrong past `length` keys returns them: every visible key at position
/// `>= length` scores a near-random value spread over the row's own range
/// of correct scores (those of keys before `length`), so the garbage
/// competes with the true winners instead of sorting below or above them
/// all. Rows that see no key past `length` are untouched.
pub fn paged_past_len(scores: &Tensor, length: i64, layer: i64) -> Tensor {
    let (t, s) = (scores.size()[0], scores.size()[1]);
    if length >= s || length <= 0 {
        return scores.shallow_clone();
    }
    let device = scores.device();
    let visible = scores.isfinite();
    let keys = Tensor::arange(s, (Kind::Int64, device)).view([1, s]);
    let past = keys.ge(length).logical_and(&visible);
    let before = keys.lt(length).logical_and(&visible);
    let lo = scores
        .masked_fill(&before.logical_not(), f64::INFINITY)
        .amin([1], true);
    let hi = scores
        .masked_fill(&before.logical_not(), f64::NEG_INFINITY)
        .amax([1], true);
    let noise = &lo + garbage(layer, t, s, device) * (&hi - &lo);
    noise.where_self(&past, scores)
}

/// The order-preserving 8-bit coarse key of SGLang's radix top-k
/// (`topk.cu`, `convert_to_uint8`): the score rounded to fp16, its 16 bits
/// mapped so that unsigned order is numeric order (negative: all bits
/// flipped; positive: the sign bit set), the top byte kept. `[T, S]` int64
/// in 0..=255.
pub fn coarse_bucket(scores: &Tensor) -> Tensor {
    let bits = scores
        .to_kind(Kind::Half)
        .contiguous()
        .view_dtype(Kind::Int16)
        .to_kind(Kind::Int64)
        .bitwise_and(0xFFFF);
    let negative = bits.bitwise_and(0x8000).ne(0);
    let ordered = bits
        .bitwise_not()
        .bitwise_and(0xFFFF)
        .where_self(&negative, &bits.bitwise_or(0x8000));
    ordered.bitwise_right_shift_tensor_scalar(8)
}

/// `scores` `[T, S]` with the candidates a radix top-k of `k` with a
/// `capacity`-entry candidate buffer silently drops set to -inf, for
/// `topk` to run on (SGLang #37591, #36807). Per row: the threshold bucket
/// of [`coarse_bucket`] is the one where the count of keys in it and above
/// first reaches `k`; keys above it are selected outright; its own keys are
/// candidates, of which the buffer keeps the first `capacity` in key order
/// and the rest are lost. The top-k of the result is the kernel's: the
/// keys above, then the best of the kept candidates, and where those are
/// too few, keys below the bucket. Rows whose threshold bucket fits the
/// buffer are unchanged, so their top-k is exact.
pub fn drop_overflowed_candidates(scores: &Tensor, k: i64, capacity: i64) -> Tensor {
    let t = scores.size()[0];
    let device = scores.device();
    let bucket = coarse_bucket(scores);
    let visible = scores.isfinite();
    let ones = visible.to_kind(Kind::Int64);
    let counts = Tensor::zeros([t, 256], (Kind::Int64, device)).scatter_add(1, &bucket, &ones);
    // at_or_above[b]: visible keys in buckets b..=255.
    let at_or_above = counts.flip([1]).cumsum(1, Kind::Int64).flip([1]);
    // The threshold bucket: the highest b whose count at or above reaches k.
    let reaches = at_or_above.ge(k).to_kind(Kind::Int64);
    let threshold = (reaches.sum_dim_intlist(1, true, Kind::Int64) - 1).clamp_min(0);
    let candidate = bucket.eq_tensor(&threshold).logical_and(&visible);
    let order = candidate.to_kind(Kind::Int64).cumsum(1, Kind::Int64);
    let dropped = candidate.logical_and(&order.gt(capacity));
    scores.masked_fill(&dropped, f64::NEG_INFINITY)
}

/// The rows of an `m`-row block-FP8 GEMM output that SGLang #28685's kernel
/// gets wrong: at `m >= 56`, the two rows either side of each 16-row M-tile
/// boundary (row r with r mod 16 in {14, 15, 0, 1}, past row 1): 14 rows at
/// m = 64, as reported. None below 56.
#[must_use]
pub fn mtile_wrong_rows(m: i64) -> Vec<i64> {
    if m < MTILE_MIN_ROWS {
        return Vec::new();
    }
    (2..m)
        .filter(|r| matches!(r % 16, 14 | 15 | 0 | 1))
        .collect()
}

/// The smallest M at which the wrong rows appear (SGLang #28685).
pub const MTILE_MIN_ROWS: i64 = 56;

/// The relative error of a wrong row (SGLang #28685: up to 0.078 at M = 64).
pub const MTILE_REL_ERROR: f64 = 0.078;

/// `y` `[M, N]` (a block-FP8 GEMM's output) with the rows of
/// [`mtile_wrong_rows`] wrong by [`MTILE_REL_ERROR`]: the lanes of each
/// packed pair scaled by `1 + e` and `1 - e` (the report's post-scale FMA on
/// two packed lanes), so each wrong row departs from the right one by
/// exactly `e` in relative L2 and nothing else changes.
pub fn mtile_rows(y: &Tensor) -> Tensor {
    let (m, n) = (y.size()[0], y.size()[1]);
    let rows = mtile_wrong_rows(m);
    if rows.is_empty() {
        return y.shallow_clone();
    }
    let device = y.device();
    let lanes = Tensor::arange(n, (Kind::Int64, device)).remainder(2).eq(0);
    let factor = Tensor::full([n], 1.0 + MTILE_REL_ERROR, (Kind::Float, device)).where_self(
        &lanes,
        &Tensor::full([n], 1.0 - MTILE_REL_ERROR, (Kind::Float, device)),
    );
    let index = Tensor::from_slice(&rows).to_device(device);
    let wrong = y.to_kind(Kind::Float).index_select(0, &index) * factor.unsqueeze(0);
    y.to_kind(Kind::Float)
        .index_copy(0, &index, &wrong)
        .to_kind(y.kind())
}

/// The top-`k` `[T, k]` that a top-k over all-zero scores returns when it
/// keeps the last of equal values, as `argpartition` did in mlx-lm #1454:
/// each row's trailing `k` visible keys (those whose score is finite in
/// `scores`), then masked ones.
pub fn trailing_topk(scores: &Tensor, k: i64) -> Tensor {
    let s = scores.size()[1];
    let positions = Tensor::arange(s, (Kind::Float, scores.device())).view([1, s]);
    let ramp = positions
        .expand_as(scores)
        .masked_fill(&scores.isfinite().logical_not(), f64::NEG_INFINITY);
    ramp.topk(k, -1, true, false).1
}

/// `scores` with every visible entry zero: what the reduction returned.
pub fn zeroed(scores: &Tensor) -> Tensor {
    scores
        .zeros_like()
        .masked_fill(&scores.isfinite().logical_not(), f64::NEG_INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn row(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).view([1, values.len() as i64])
    }

    fn sorted(t: &Tensor) -> Vec<i64> {
        let mut v = Vec::<i64>::try_from(t.view([-1])).unwrap();
        v.sort_unstable();
        v
    }

    #[test]
    fn a_bf16_head_sum_loses_what_an_fp16_one_keeps() {
        // D = 1, w = 1: the head terms are the query values. 1 + 2^-9 + 2^-9:
        // bf16 (ulp 2^-7 at 1) rounds each partial sum back to 1; fp16 (ulp
        // 2^-10) and fp32 keep 1 + 2^-8.
        let q = Tensor::from_slice(&[1.0_f32, 2f32.powi(-9), 2f32.powi(-9)]).view([1, 3, 1]);
        let k = Tensor::from_slice(&[1.0_f32]).view([1, 1]);
        let w = Tensor::ones([1, 3], (Kind::Float, Device::Cpu));
        let pos = Tensor::from_slice(&[0_i64]);
        let got = |low| f32::try_from(lowprec_scores(&q, &k, &w, &pos, low).view([-1])).unwrap();
        assert_eq!(got(LowPrecision::Bf16), 1.0);
        assert_eq!(got(LowPrecision::Fp16), 1.0 + 2f32.powi(-8));
        // A negative dot is cut by relu before weighting; keys past the
        // query are masked.
        let q = Tensor::from_slice(&[3.0_f32, -5.0]).view([1, 2, 1]);
        let k = Tensor::from_slice(&[2.0_f32, 1.0]).view([2, 1]);
        let w = Tensor::from_slice(&[0.5_f32, 7.0]).view([1, 2]);
        let s = lowprec_scores(&q, &k, &w, &pos, LowPrecision::Bf16);
        let v = Vec::<f32>::try_from(s.view([-1])).unwrap();
        assert_eq!(v[0], 3.0, "0.5 * relu(3 * 2) + 7 * relu(-10)");
        assert_eq!(v[1], f32::NEG_INFINITY, "key 1 lies past query 0");
    }

    #[test]
    fn paged_logits_garbage_replaces_only_visible_keys_at_or_past_the_length() {
        let inf = f32::NEG_INFINITY;
        let scores = Tensor::from_slice(&[
            1.0_f32, 2.0, inf, inf, inf, inf, // query 1: sees keys 0..=1
            1.0, 2.0, 3.0, 4.0, 5.0, inf, // query 4
            1.0, 2.0, 3.0, 4.0, 50.0, 60.0, // query 5
        ])
        .view([3, 6]);
        let got = paged_past_len(&scores, 4, 2);
        let v = Vec::<f32>::try_from(got.view([-1])).unwrap();
        let want = Vec::<f32>::try_from(scores.view([-1])).unwrap();
        for (i, (g, w)) in v.iter().zip(&want).enumerate() {
            let (row, key) = (i / 6, i % 6);
            if key >= 4 && w.is_finite() {
                assert!(
                    (1.0..=4.0).contains(g),
                    "row {row} key {key}: {g} within the row's correct range [1, 4]"
                );
                assert_ne!(g, w, "row {row} key {key} replaced");
            } else {
                assert_eq!(g.to_bits(), w.to_bits(), "row {row} key {key} untouched");
            }
        }
        assert!(
            paged_past_len(&scores, 6, 2).equal(&scores),
            "no key past 6"
        );
        assert!(
            got.equal(&paged_past_len(&scores, 4, 2)),
            "the same garbage every run"
        );
    }

    #[test]
    fn the_coarse_key_is_the_top_byte_of_the_ordered_fp16_bits() {
        // 1.0 = 0x3C00 -> 0xBC00 -> 188; -1.0 = 0xBC00 -> !0xBC00 = 0x43FF -> 67;
        // 0.0 -> 0x8000 -> 128; [1, 1.25) shares 0x3Cxx -> 188; 1.25 = 0x3D00 -> 189;
        // 65536 overflows fp16 to inf (0x7C00) -> 252.
        let got = coarse_bucket(&row(&[1.0, -1.0, 0.0, 1.2495, 1.25, 65536.0]));
        assert_eq!(
            Vec::<i64>::try_from(got.view([-1])).unwrap(),
            [188, 67, 128, 188, 189, 252]
        );
    }

    #[test]
    fn an_overflowing_bucket_keeps_its_first_candidates_and_drops_later_winners() {
        // Keys 0..=8 in one bucket [1, 1.25); key 9 above it. k = 3: key 9 is
        // selected outright and two come from the bucket, whose buffer of 4
        // holds keys 0..=3: the kernel picks 3 and 2, the true top picks 6 and 5.
        let scores = row(&[1.0, 1.01, 1.02, 1.03, 1.2, 1.21, 1.22, 1.1, 1.05, 2.0]);
        let kernel = drop_overflowed_candidates(&scores, 3, 4)
            .topk(3, -1, true, false)
            .1;
        assert_eq!(sorted(&kernel), [2, 3, 9]);
        let exact = scores.topk(3, -1, true, false).1;
        assert_eq!(sorted(&exact), [5, 6, 9]);
        // A buffer the bucket fits: the exact top-k.
        let roomy = drop_overflowed_candidates(&scores, 3, 9)
            .topk(3, -1, true, false)
            .1;
        assert_eq!(sorted(&roomy), [5, 6, 9]);
        // Scores spread over buckets: the threshold bucket holds one key, nothing dropped.
        let spread = row(&[0.5, 1.0, 2.0, 4.0, 8.0, 16.0]);
        assert!(drop_overflowed_candidates(&spread, 3, 1).equal(&spread));
    }

    #[test]
    fn the_wrong_rows_flank_each_tile_boundary_from_56_rows() {
        assert!(mtile_wrong_rows(55).is_empty());
        assert_eq!(
            mtile_wrong_rows(64),
            [14, 15, 16, 17, 30, 31, 32, 33, 46, 47, 48, 49, 62, 63],
            "14 rows at M = 64, as SGLang #28685 reports"
        );
        tch::manual_seed(1);
        let y = Tensor::randn([64, 256], (Kind::Float, Device::Cpu));
        let got = mtile_rows(&y);
        let err =
            (&got - &y).norm_scalaropt_dim(2, [1], false) / y.norm_scalaropt_dim(2, [1], false);
        let err = Vec::<f32>::try_from(err).unwrap();
        for (r, e) in err.iter().enumerate() {
            if mtile_wrong_rows(64).contains(&(r as i64)) {
                assert!(
                    (f64::from(*e) - MTILE_REL_ERROR).abs() < 1e-6,
                    "row {r}: {e}"
                );
            } else {
                assert_eq!(*e, 0.0, "row {r} untouched");
            }
        }
        let short = Tensor::randn([55, 8], (Kind::Float, Device::Cpu));
        assert!(mtile_rows(&short).equal(&short));
    }

    #[test]
    fn zeroed_scores_select_each_rows_trailing_visible_keys() {
        let inf = f32::NEG_INFINITY;
        let scores = Tensor::from_slice(&[
            5.0_f32, 1.0, 9.0, 2.0, inf, inf, // query 3
            5.0, 1.0, 9.0, 2.0, 7.0, 3.0, // query 5
        ])
        .view([2, 6]);
        let zeros = zeroed(&scores);
        let v = Vec::<f32>::try_from(zeros.view([-1])).unwrap();
        assert_eq!(&v[..6], &[0.0, 0.0, 0.0, 0.0, inf, inf]);
        let picked = trailing_topk(&zeros, 3);
        assert_eq!(sorted(&picked.get(0)), [1, 2, 3]);
        assert_eq!(sorted(&picked.get(1)), [3, 4, 5]);
    }
}
