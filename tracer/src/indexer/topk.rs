//! Top-k over indexer scores, with the k-th score and its margin to the
//! (k+1)-th, and rows with at most k visible keys marked dense.
//!
//! A row is dense because of how many keys it sees, never because of its
//! scores: a sparse row whose k-th score is NaN keeps that NaN (the trace
//! records the non-finite scores as an event), where a dense row has none.

use tch::{Kind, Tensor};

use crate::TraceError;
use crate::record::{Boundary, Selection};

const OP: &str = "topk_with_margin";

fn torch(source: tch::TchError) -> TraceError {
    TraceError::Torch { op: OP, source }
}

/// The top-k of each query row.
#[derive(Debug)]
pub struct TopkSelection {
    /// `[T, k]` int64 key positions, best first; a dense row lists its
    /// visible keys in order and pads with -1.
    pub indices: Tensor,
    /// `[T]` fp32 k-th largest score; NaN for a dense row (and for a sparse
    /// row whose scores are NaN: [`TopkSelection::dense`] tells them apart).
    pub kth_score: Tensor,
    /// `[T]` fp32 k-th minus (k+1)-th largest score; NaN for a dense row.
    pub kth_margin: Tensor,
    /// `[T]` bool: at most k visible keys, so the row selects all of them.
    pub dense: Tensor,
    /// `[T]` fp32 mean |score| of the row's top-k, finite scores only: what a
    /// relative band multiplies (`shadowtrace_schemas::selection::BAND_SCALE`);
    /// NaN for a dense row and where no top-k score is finite.
    pub score_scale: Tensor,
}

/// Selects the top `k` keys of each row of `scores` `[T, S]`, where row t
/// sees `visible[t]` keys (the rest are masked, -inf). Ties among equal
/// scores are broken as `torch.topk` breaks them, which PyTorch leaves
/// unspecified: compare selections as sets, and treat members tied with the
/// k-th score as boundary churn.
///
/// # Errors
/// Shapes that do not fit, `k < 1`, or a libtorch failure.
pub fn topk_with_margin(
    scores: &Tensor,
    k: i64,
    visible: &Tensor,
) -> Result<TopkSelection, TraceError> {
    let size = scores.size();
    if size.len() != 2 || scores.kind() != Kind::Float || k < 1 {
        return Err(TraceError::Shape {
            op: OP,
            what: "scores",
            expected: "fp32 [T, S] and k >= 1".to_owned(),
            got: format!("{:?} {size:?}, k = {k}", scores.kind()),
        });
    }
    let (t, s) = (size[0], size[1]);
    if visible.size() != [t] {
        return Err(TraceError::Shape {
            op: OP,
            what: "visible",
            expected: format!("[{t}]"),
            got: format!("{:?}", visible.size()),
        });
    }
    let options = (Kind::Int64, scores.device());
    let run = || -> Result<TopkSelection, tch::TchError> {
        let visible = visible.f_to_kind(Kind::Int64)?;
        let dense = visible.f_le(k)?;
        let positions = Tensor::f_arange(k, options)?
            .f_unsqueeze(0)?
            .f_expand([t, k], false)?;
        let dense_indices = positions.f_where_self(
            &positions.f_lt_tensor(&visible.f_unsqueeze(1)?)?,
            &positions.f_full_like(-1)?,
        )?;
        let nan = Tensor::f_full([t], f64::NAN, (Kind::Float, scores.device()))?;
        if s <= k {
            // Every row sees at most S <= k keys: all dense.
            return Ok(TopkSelection {
                indices: dense_indices,
                kth_score: nan.f_detach_copy()?,
                kth_margin: nan.f_detach_copy()?,
                score_scale: nan,
                dense,
            });
        }
        // Only the sparse rows are selected: a dense row's result is replaced
        // below, and each row's top-k depends on that row alone, so the
        // sparse rows come out as a top-k of every row gives them. At 3k
        // tokens and k = 2048 that is a third of the rows.
        let sparse = dense.f_logical_not()?.f_nonzero()?.f_view([-1])?;
        let n_sparse = sparse.size()[0];
        let (values, indices) = if n_sparse == t {
            scores.f_topk(k + 1, -1, true, true)?
        } else {
            let (v, i) = scores
                .f_index_select(0, &sparse)?
                .f_topk(k + 1, -1, true, true)?;
            let float = (Kind::Float, scores.device());
            (
                Tensor::f_full([t, k + 1], f64::NAN, float)?.f_index_copy(0, &sparse, &v)?,
                Tensor::f_full([t, k + 1], -1, options)?.f_index_copy(0, &sparse, &i)?,
            )
        };
        let kth = values.f_select(1, k - 1)?;
        let margin = kth.f_sub(&values.f_select(1, k)?)?;
        let sparse_indices = indices.f_narrow(1, 0, k)?;
        // A mean, not the largest: one sink key far above the rest would set
        // the band of the keys at the k-th score. Dense rows hold NaN: 0 / 0.
        let top = values.f_narrow(1, 0, k)?;
        let finite = top.f_isfinite()?;
        let scale = top
            .f_abs()?
            .f_where_self(&finite, &top.f_zeros_like()?)?
            .f_sum_dim_intlist(1, false, Kind::Float)?
            .f_div(&finite.f_sum_dim_intlist(1, false, Kind::Float)?)?;
        Ok(TopkSelection {
            indices: dense_indices.f_where_self(&dense.f_unsqueeze(1)?, &sparse_indices)?,
            kth_score: nan.f_where_self(&dense, &kth)?,
            kth_margin: nan.f_where_self(&dense, &margin)?,
            score_scale: nan.f_where_self(&dense, &scale)?,
            dense,
        })
    };
    run().map_err(torch)
}

impl TopkSelection {
    /// The selection with its sparse rows' keys replaced by the keys a layer
    /// attended to (`topk` `[T, k]`): the same set as `torch.topk` of the
    /// same scores except among exact ties, which a deviation may break its
    /// own way. A `topk` of another shape (every row dense) changes nothing.
    #[must_use]
    pub fn attended(mut self, topk: &Tensor) -> TopkSelection {
        if topk.size() == self.indices.size() {
            self.indices = self
                .indices
                .where_self(&self.dense.unsqueeze(1), &topk.to_kind(Kind::Int64));
        }
        self
    }

    /// Row `t` in the stored form: valid indices ascending; with `band`, the
    /// keys whose score in `scores` lies within `band` (in scores) of the
    /// k-th score.
    ///
    /// # Errors
    /// When `t` is out of range or libtorch fails.
    pub fn row(&self, t: i64, scores: &Tensor, band: Option<f32>) -> Result<Selection, TraceError> {
        let run = || -> Result<Selection, tch::TchError> {
            let mut indices: Vec<i32> =
                Vec::<i64>::try_from(self.indices.f_get(t)?.f_to_device(tch::Device::Cpu)?)?
                    .into_iter()
                    .filter(|&i| i >= 0)
                    .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
                    .collect();
            indices.sort_unstable();
            let kth = self.kth_score.f_double_value(&[t])? as f32;
            let margin = self.kth_margin.f_double_value(&[t])? as f32;
            let dense = self.dense.f_int64_value(&[t])? != 0;
            let boundary = match band {
                Some(band) if !dense => Some(boundary_keys(&scores.f_get(t)?, kth, band)?),
                _ => None,
            };
            Ok(Selection {
                indices,
                kth_score: (!dense).then_some(kth),
                kth_margin: (!dense).then_some(margin),
                boundary,
            })
        };
        run().map_err(torch)
    }
}

impl TopkSelection {
    /// Every row in the stored form, as [`TopkSelection::row`] gives them,
    /// with a handful of transfers instead of several per row; `band` `[T]`
    /// in scores, row by row (NaN: no key is near).
    ///
    /// # Errors
    /// When libtorch fails.
    pub fn rows(
        &self,
        scores: &Tensor,
        band: Option<&Tensor>,
    ) -> Result<Vec<Selection>, TraceError> {
        let run = || -> Result<Vec<Selection>, tch::TchError> {
            let cpu = tch::Device::Cpu;
            let size = self.indices.size();
            let (t, k) = (size[0] as usize, size[1] as usize);
            let flat = |x: &Tensor| x.f_to_device(cpu)?.f_flatten(0, -1);
            let indices = Vec::<i64>::try_from(flat(&self.indices)?)?;
            let kth = Vec::<f32>::try_from(flat(&self.kth_score)?)?;
            let margin = Vec::<f32>::try_from(flat(&self.kth_margin)?)?;
            let dense = Vec::<bool>::try_from(flat(&self.dense)?)?;
            let mut boundary: Vec<Boundary> = vec![Boundary::default(); t];
            if let Some(band) = band {
                // NaN k-th scores (dense rows, and sparse rows whose scores
                // are NaN) and NaN bands compare false: no key is near them.
                let near = scores
                    .f_sub(&self.kth_score.f_unsqueeze(1)?)?
                    .f_abs()?
                    .f_le_tensor(&band.f_unsqueeze(1)?)?;
                let at = Vec::<i64>::try_from(flat(&near.f_nonzero()?)?)?;
                let values = Vec::<f32>::try_from(flat(&scores.f_masked_select(&near)?)?)?;
                for (pair, value) in at.chunks(2).zip(values) {
                    let row = &mut boundary[pair[0] as usize];
                    row.indices.push(i32::try_from(pair[1]).unwrap_or(i32::MAX));
                    row.scores.push(value);
                }
            }
            Ok((0..t)
                .map(|r| {
                    let mut keys: Vec<i32> = indices[r * k..(r + 1) * k]
                        .iter()
                        .filter(|&&i| i >= 0)
                        .map(|&i| i32::try_from(i).unwrap_or(i32::MAX))
                        .collect();
                    keys.sort_unstable();
                    let dense = dense[r];
                    Selection {
                        indices: keys,
                        kth_score: (!dense).then_some(kth[r]),
                        kth_margin: (!dense).then_some(margin[r]),
                        boundary: (band.is_some() && !dense)
                            .then(|| std::mem::take(&mut boundary[r])),
                    }
                })
                .collect())
        };
        run().map_err(torch)
    }
}

/// Keys whose score lies within `band` of `kth` (inclusive), ascending.
fn boundary_keys(row: &Tensor, kth: f32, band: f32) -> Result<Boundary, tch::TchError> {
    let near = row
        .f_sub_scalar(f64::from(kth))?
        .f_abs()?
        .f_le(f64::from(band))?;
    let keys = near.f_nonzero()?.f_view([-1])?;
    let scores = row.f_index_select(0, &keys)?;
    Ok(Boundary {
        indices: Vec::<i64>::try_from(keys.f_to_device(tch::Device::Cpu)?)?
            .into_iter()
            .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
            .collect(),
        scores: Vec::<f32>::try_from(scores.f_to_device(tch::Device::Cpu)?)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_row_whose_kth_score_is_nan_stays_sparse() {
        let ninf = f32::NEG_INFINITY;
        // Row 0 sees one key (dense at k = 2); row 1 sees four, two of them NaN.
        let scores = Tensor::from_slice(&[1.0_f32, ninf, ninf, ninf, f32::NAN, f32::NAN, 2.0, 1.0])
            .view([2, 4]);
        let visible = Tensor::from_slice(&[1_i64, 4]);
        let selection = topk_with_margin(&scores, 2, &visible).unwrap();
        let rows = selection
            .rows(&scores, Some(&Tensor::from_slice(&[0.5_f32, 0.5])))
            .unwrap();
        let one = selection.row(1, &scores, Some(0.5)).unwrap();
        for (what, sparse) in [("rows", &rows[1]), ("row", &one)] {
            assert!(
                sparse.kth_score.is_some_and(f32::is_nan),
                "{what}: {sparse:?}"
            );
            assert!(sparse.kth_margin.is_some(), "{what}: {sparse:?}");
            assert_eq!(
                sparse.boundary,
                Some(Boundary::default()),
                "{what}: no key is within a band of NaN"
            );
        }
        assert_eq!(
            (rows[0].kth_score, rows[0].kth_margin, &rows[0].boundary),
            (None, None, &None),
            "the dense row"
        );
    }
}
