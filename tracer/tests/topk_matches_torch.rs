//! Top-k with margins: the tch path is torch.topk; the ndarray reference
//! must select the same keys except among scores tied at the k-th, which
//! the tests construct on purpose.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod common;

use std::collections::BTreeSet;

use common::{GOLDEN, floats};
use shadowtrace_tracer::indexer::{reference, topk_with_margin};
use tch::Tensor;

fn tch_row(scores: &[f32], k: usize, visible: usize) -> (Vec<i64>, f32, f32) {
    let t = Tensor::from_slice(scores).view([1, scores.len() as i64]);
    let sel = topk_with_margin(&t, k as i64, &Tensor::from_slice(&[visible as i64])).unwrap();
    let indices = Vec::<i64>::try_from(sel.indices.view([-1])).unwrap();
    (
        indices,
        sel.kth_score.double_value(&[0]) as f32,
        sel.kth_margin.double_value(&[0]) as f32,
    )
}

/// Keys scoring strictly above the k-th score: every correct top-k holds them.
fn above(scores: &[f32], kth: f32) -> BTreeSet<i64> {
    scores
        .iter()
        .enumerate()
        .filter(|(_, s)| **s > kth)
        .map(|(i, _)| i as i64)
        .collect()
}

#[test]
fn top_k_agrees_with_torch_topk_except_among_ties() {
    for case in &GOLDEN.topk {
        let scores = floats(&case.scores);
        let (tch_idx, tch_kth, tch_margin) = tch_row(&scores, case.k, case.visible);
        let (ref_idx, ref_kth, ref_margin) = reference::topk_row(&scores, case.k, case.visible);
        if case.visible <= case.k {
            let all: Vec<i64> = (0..case.visible as i64)
                .chain(std::iter::repeat_n(-1, case.k - case.visible))
                .collect();
            assert_eq!(
                tch_idx, all,
                "{}: dense rows list every visible key, then -1",
                case.name
            );
            assert_eq!(
                ref_idx,
                (0..case.visible as i64).collect::<Vec<_>>(),
                "{}",
                case.name
            );
            assert!(
                tch_kth.is_nan() && tch_margin.is_nan() && ref_kth.is_none(),
                "{}: no k-th score",
                case.name
            );
            continue;
        }
        let kth = f32::from_bits(case.kth_score);
        let margin = kth - f32::from_bits(case.next_score);
        assert_eq!(
            (tch_kth.to_bits(), tch_margin.to_bits()),
            (kth.to_bits(), margin.to_bits()),
            "{}",
            case.name
        );
        assert_eq!(
            (ref_kth, ref_margin),
            (Some(kth), Some(margin)),
            "{}",
            case.name
        );
        let torch_set: BTreeSet<i64> = case.torch_topk_indices.iter().copied().collect();
        let tch_set: BTreeSet<i64> = tch_idx.iter().copied().collect();
        let ref_set: BTreeSet<i64> = ref_idx.iter().copied().collect();
        assert_eq!(
            tch_set, torch_set,
            "{}: the tch path is torch.topk",
            case.name
        );
        let tied_at_kth = scores.iter().filter(|s| **s == kth).count();
        if tied_at_kth == 1 {
            assert_eq!(ref_set, torch_set, "{}: no ties, same keys", case.name);
        } else {
            // Both hold every key above the k-th score, and fill the rest
            // from the keys tied with it; which ones is the tie-break.
            let must = above(&scores, kth);
            assert!(
                must.is_subset(&ref_set) && must.is_subset(&torch_set),
                "{}",
                case.name
            );
            for i in ref_set.symmetric_difference(&torch_set) {
                assert_eq!(
                    scores[*i as usize], kth,
                    "{}: key {i} differs but is not tied",
                    case.name
                );
            }
        }
    }
}

#[test]
fn the_golden_rows_include_ties_across_the_boundary() {
    let case = GOLDEN
        .topk
        .iter()
        .find(|c| c.name == "boundary_ties")
        .unwrap();
    let scores = floats(&case.scores);
    let kth = f32::from_bits(case.kth_score);
    assert!(
        scores.iter().filter(|s| **s == kth).count() > 2,
        "ties straddle the k-th rank"
    );
    assert_eq!(f32::from_bits(case.next_score), kth, "margin zero");
}

#[test]
fn a_row_in_stored_form_is_sorted_with_its_boundary_band() {
    let scores = [0.1_f32, 0.9, 0.5, 0.52, 0.3, 0.49, 0.8];
    let t = Tensor::from_slice(&scores).view([1, 7]);
    let sel = topk_with_margin(&t, 3, &Tensor::from_slice(&[7_i64])).unwrap();
    let row = sel.row(0, &t, Some(0.05)).unwrap();
    assert_eq!(row.indices, [1, 3, 6]);
    assert_eq!(row.kth_score, Some(0.52));
    assert!((row.kth_margin.unwrap() - 0.02).abs() < 1e-6);
    let boundary = row.boundary.unwrap();
    assert_eq!(
        boundary.indices,
        [2, 3, 5],
        "0.5, 0.52 and 0.49 lie within 0.05 of 0.52"
    );
    assert_eq!(boundary.scores, [0.5, 0.52, 0.49]);
}

#[test]
fn the_score_scale_is_the_mean_magnitude_of_the_finite_top_k_scores() {
    // k = 3. Row 0: top 0.9, 0.8, 0.52; row 1: -3, -4, -5 (all negative);
    // row 2: NaN ranks first, then 3 and 1, and only the finite count;
    // row 3 sees 2 keys: dense, no scale.
    let ninf = f32::NEG_INFINITY;
    let scores = Tensor::from_slice(&[
        0.1_f32,
        0.9,
        0.5,
        0.52,
        0.3,
        0.49,
        0.8, //
        -3.0,
        -7.0,
        -4.0,
        -5.0,
        -6.0,
        -9.0,
        -8.0, //
        f32::NAN,
        1.0,
        0.5,
        3.0,
        -1.0,
        0.0,
        -2.0, //
        2.0,
        1.0,
        ninf,
        ninf,
        ninf,
        ninf,
        ninf,
    ])
    .view([4, 7]);
    let visible = Tensor::from_slice(&[7_i64, 7, 7, 2]);
    let sel = topk_with_margin(&scores, 3, &visible).unwrap();
    let scale = Vec::<f32>::try_from(&sel.score_scale).unwrap();
    let expected = [
        (0.9_f32 + 0.8 + 0.52) / 3.0,
        (3.0 + 4.0 + 5.0) / 3.0,
        (3.0 + 1.0) / 2.0,
    ];
    for (row, want) in expected.iter().enumerate() {
        assert!((scale[row] - want).abs() < 1e-6, "row {row}: {scale:?}");
    }
    assert!(scale[3].is_nan(), "a dense row has no scale: {scale:?}");
}

#[test]
fn all_rows_at_once_equal_each_row_taken_alone() {
    tch::manual_seed(11);
    let (t, s, k) = (40_i64, 64_i64, 8_i64);
    // Coarse values give exact ties at the boundary; rows 0..8 are dense.
    let mut scores = (Tensor::rand([t, s], (tch::Kind::Float, tch::Device::Cpu)) * 16.0).floor();
    let positions = Tensor::arange(t, (tch::Kind::Int64, tch::Device::Cpu));
    let visible = &positions + 24 - 16;
    let visible = visible.clamp_min(1);
    let keys = Tensor::arange(s, (tch::Kind::Int64, tch::Device::Cpu));
    let masked = keys.unsqueeze(0).ge_tensor(&visible.unsqueeze(1));
    scores = scores.masked_fill(&masked, f64::NEG_INFINITY);
    let sel = topk_with_margin(&scores, k, &visible).unwrap();
    let band = Tensor::full([t], 1.0, (tch::Kind::Float, tch::Device::Cpu));
    let all = sel.rows(&scores, Some(&band)).unwrap();
    assert_eq!(all.len(), t as usize);
    for (r, row) in all.iter().enumerate() {
        assert_eq!(
            row,
            &sel.row(r as i64, &scores, Some(1.0)).unwrap(),
            "row {r}"
        );
    }
    assert!(
        all.iter().any(|r| r.kth_score.is_none()),
        "dense rows are covered"
    );
}
