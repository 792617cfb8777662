//! The metrics as Parquet: what notebooks and other tools read instead of
//! recomputing anything. One file per level: runs, top-k layers and rows,
//! hidden-state layers, and per-token hidden-state error at the site the
//! verdict reads.

use std::path::{Path, PathBuf};

use polars::prelude::{Column, DataFrame, ParquetWriter};

use crate::metrics::summary::Summary;
use crate::{Analysis, AnalyzeError};

pub(super) fn write_metrics(dir: &Path, a: &Analysis) -> Result<Vec<PathBuf>, AnalyzeError> {
    let mut written = Vec::new();
    for (name, frame) in [
        ("runs", runs(a)),
        ("topk_layers", topk_layers(a)),
        ("topk_rows", topk_rows(a)),
        ("hidden_layers", hidden_layers(a)),
        ("hidden_tokens", hidden_tokens(a)),
    ] {
        let path = dir.join(format!("{name}.parquet"));
        let fail = |detail: String| AnalyzeError::Write {
            path: path.clone(),
            detail,
        };
        let mut frame = frame.map_err(|e| fail(e.to_string()))?;
        let file = std::fs::File::create(&path).map_err(|e| fail(e.to_string()))?;
        ParquetWriter::new(file)
            .finish(&mut frame)
            .map_err(|e| fail(e.to_string()))?;
        written.push(path);
    }
    Ok(written)
}

type Frame = polars::prelude::PolarsResult<DataFrame>;

fn frame(columns: Vec<Column>) -> Frame {
    let height = columns.first().map_or(0, Column::len);
    DataFrame::new(height, columns)
}

fn col<T>(name: &str, values: Vec<T>) -> Column
where
    polars::prelude::Series: polars::prelude::NamedFrom<Vec<T>, [T]>,
{
    use polars::prelude::NamedFrom;
    polars::prelude::Series::new(name.into(), values).into()
}

fn runs(a: &Analysis) -> Frame {
    let r = &a.runs;
    let tag = |k: &'static str| {
        r.iter()
            .map(|x| x.tags.get(k).cloned().unwrap_or_default())
            .collect::<Vec<String>>()
    };
    frame(vec![
        col(
            "run_id",
            r.iter().map(|x| x.run_id.clone()).collect::<Vec<_>>(),
        ),
        col("model", tag("model")),
        col("engine", tag("engine")),
        col("prompt_kind", tag("prompt_kind")),
        col(
            "prompt_len",
            r.iter()
                .map(|x| x.tags.get("prompt_len").and_then(|v| v.parse::<i64>().ok()))
                .collect::<Vec<_>>(),
        ),
        col("length_bucket", tag("length_bucket")),
        col("complete", r.iter().map(|x| x.complete).collect::<Vec<_>>()),
        col(
            "onset_layer",
            r.iter()
                .map(|x| x.onset.as_ref().map(|o| o.layer))
                .collect::<Vec<_>>(),
        ),
        col(
            "onset_site",
            r.iter()
                .map(|x| x.onset.as_ref().map(|o| o.site.clone()))
                .collect::<Vec<_>>(),
        ),
        col(
            "onset_token",
            r.iter()
                .map(|x| x.onset.as_ref().and_then(|o| o.token))
                .collect::<Vec<_>>(),
        ),
        col(
            "onset_shadow_finite",
            r.iter()
                .map(|x| x.onset.as_ref().and_then(|o| o.shadow_finite))
                .collect::<Vec<_>>(),
        ),
        col(
            "hidden_verdict_layer",
            r.iter()
                .map(|x| x.hidden_verdict.as_ref().map(|v| v.layer))
                .collect::<Vec<_>>(),
        ),
        col(
            "topk_verdict_layer",
            r.iter()
                .map(|x| x.topk_verdict.as_ref().map(|v| v.layer))
                .collect::<Vec<_>>(),
        ),
        col(
            "argmax_agreement",
            r.iter()
                .map(|x| x.logits.as_ref().map(|l| l.argmax_agreement))
                .collect::<Vec<_>>(),
        ),
    ])
}

fn stat(s: Option<Summary>, f: fn(&Summary) -> f64) -> Option<f64> {
    s.as_ref().map(f)
}

fn topk_layers(a: &Analysis) -> Frame {
    let rows: Vec<(&str, &crate::metrics::topk_overlap::LayerOverlap)> = a
        .runs
        .iter()
        .flat_map(|r| r.topk.iter().map(move |l| (r.run_id.as_str(), l)))
        .collect();
    frame(vec![
        col(
            "run_id",
            rows.iter()
                .map(|(r, _)| (*r).to_owned())
                .collect::<Vec<_>>(),
        ),
        col(
            "layer",
            rows.iter().map(|(_, l)| l.layer).collect::<Vec<_>>(),
        ),
        col(
            "informative_rows",
            rows.iter()
                .map(|(_, l)| l.informative_rows as u64)
                .collect::<Vec<_>>(),
        ),
        col(
            "dense_rows",
            rows.iter()
                .map(|(_, l)| l.dense_rows as u64)
                .collect::<Vec<_>>(),
        ),
        col(
            "jaccard_mean",
            rows.iter()
                .map(|(_, l)| stat(l.jaccard, |s| s.mean))
                .collect::<Vec<_>>(),
        ),
        col(
            "jaccard_p5",
            rows.iter()
                .map(|(_, l)| stat(l.jaccard, |s| s.p5))
                .collect::<Vec<_>>(),
        ),
        col(
            "jaccard_min",
            rows.iter()
                .map(|(_, l)| stat(l.jaccard, |s| s.min))
                .collect::<Vec<_>>(),
        ),
        col(
            "recall_mean",
            rows.iter()
                .map(|(_, l)| stat(l.recall, |s| s.mean))
                .collect::<Vec<_>>(),
        ),
        col(
            "jaccard_no_churn_mean",
            rows.iter()
                .map(|(_, l)| stat(l.jaccard_no_churn, |s| s.mean))
                .collect::<Vec<_>>(),
        ),
        col(
            "jaccard_no_churn_p5",
            rows.iter()
                .map(|(_, l)| stat(l.jaccard_no_churn, |s| s.p5))
                .collect::<Vec<_>>(),
        ),
        col(
            "jaccard_no_churn_min",
            rows.iter()
                .map(|(_, l)| stat(l.jaccard_no_churn, |s| s.min))
                .collect::<Vec<_>>(),
        ),
        col(
            "recall_no_churn_mean",
            rows.iter()
                .map(|(_, l)| stat(l.recall_no_churn, |s| s.mean))
                .collect::<Vec<_>>(),
        ),
        col(
            "share_below_threshold",
            rows.iter().map(|(_, l)| l.share_below).collect::<Vec<_>>(),
        ),
        col(
            "churn_keys_mean",
            rows.iter()
                .map(|(_, l)| l.churn_keys_mean)
                .collect::<Vec<_>>(),
        ),
        col(
            "churn_share",
            rows.iter().map(|(_, l)| l.churn_share).collect::<Vec<_>>(),
        ),
    ])
}

fn topk_rows(a: &Analysis) -> Frame {
    let rows: Vec<(&str, &crate::metrics::topk_overlap::RowOverlap)> = a
        .runs
        .iter()
        .flat_map(|r| r.topk_rows.iter().map(move |x| (r.run_id.as_str(), x)))
        .collect();
    frame(vec![
        col(
            "run_id",
            rows.iter()
                .map(|(r, _)| (*r).to_owned())
                .collect::<Vec<_>>(),
        ),
        col("step", rows.iter().map(|(_, x)| x.step).collect::<Vec<_>>()),
        col(
            "layer",
            rows.iter().map(|(_, x)| x.layer).collect::<Vec<_>>(),
        ),
        col(
            "token",
            rows.iter().map(|(_, x)| x.token).collect::<Vec<_>>(),
        ),
        col(
            "jaccard",
            rows.iter().map(|(_, x)| x.jaccard).collect::<Vec<_>>(),
        ),
        col(
            "recall",
            rows.iter().map(|(_, x)| x.recall).collect::<Vec<_>>(),
        ),
        col(
            "jaccard_no_churn",
            rows.iter()
                .map(|(_, x)| x.jaccard_no_churn)
                .collect::<Vec<_>>(),
        ),
        col(
            "recall_no_churn",
            rows.iter()
                .map(|(_, x)| x.recall_no_churn)
                .collect::<Vec<_>>(),
        ),
        col(
            "churn_keys",
            rows.iter()
                .map(|(_, x)| x.churn_keys as u64)
                .collect::<Vec<_>>(),
        ),
        col(
            "differing_keys",
            rows.iter()
                .map(|(_, x)| x.differing_keys as u64)
                .collect::<Vec<_>>(),
        ),
        col(
            "differing_churn",
            rows.iter()
                .map(|(_, x)| x.differing_churn as u64)
                .collect::<Vec<_>>(),
        ),
    ])
}

fn hidden_layers(a: &Analysis) -> Frame {
    let rows: Vec<(&str, &crate::metrics::hidden_error::SiteError)> = a
        .runs
        .iter()
        .flat_map(|r| r.hidden.iter().map(move |x| (r.run_id.as_str(), x)))
        .collect();
    frame(vec![
        col(
            "run_id",
            rows.iter()
                .map(|(r, _)| (*r).to_owned())
                .collect::<Vec<_>>(),
        ),
        col(
            "layer",
            rows.iter().map(|(_, x)| x.layer).collect::<Vec<_>>(),
        ),
        col(
            "site",
            rows.iter().map(|(_, x)| x.site.clone()).collect::<Vec<_>>(),
        ),
        col(
            "shadow_mode",
            rows.iter()
                .map(|(_, x)| x.shadow_mode.clone())
                .collect::<Vec<_>>(),
        ),
        col(
            "tokens",
            rows.iter()
                .map(|(_, x)| x.tokens as u64)
                .collect::<Vec<_>>(),
        ),
        col(
            "nonfinite_tokens",
            rows.iter()
                .map(|(_, x)| x.nonfinite_tokens as u64)
                .collect::<Vec<_>>(),
        ),
        col(
            "rel_l2_err_mean",
            rows.iter()
                .map(|(_, x)| stat(x.rel_l2_err, |s| s.mean))
                .collect::<Vec<_>>(),
        ),
        col(
            "rel_l2_err_p50",
            rows.iter()
                .map(|(_, x)| stat(x.rel_l2_err, |s| s.p50))
                .collect::<Vec<_>>(),
        ),
        col(
            "rel_l2_err_p95",
            rows.iter()
                .map(|(_, x)| stat(x.rel_l2_err, |s| s.p95))
                .collect::<Vec<_>>(),
        ),
        col(
            "rel_l2_err_max",
            rows.iter()
                .map(|(_, x)| stat(x.rel_l2_err, |s| s.max))
                .collect::<Vec<_>>(),
        ),
        col(
            "cosine_min",
            rows.iter()
                .map(|(_, x)| stat(x.cosine, |s| s.min))
                .collect::<Vec<_>>(),
        ),
        col(
            "cosine_p5",
            rows.iter()
                .map(|(_, x)| stat(x.cosine, |s| s.p5))
                .collect::<Vec<_>>(),
        ),
        col(
            "max_abs_diff",
            rows.iter().map(|(_, x)| x.max_abs_diff).collect::<Vec<_>>(),
        ),
    ])
}

fn hidden_tokens(a: &Analysis) -> Frame {
    let rows: Vec<(&str, &crate::metrics::hidden_error::TokenError)> = a
        .runs
        .iter()
        .flat_map(|r| r.hidden_tokens.iter().map(move |x| (r.run_id.as_str(), x)))
        .collect();
    frame(vec![
        col(
            "run_id",
            rows.iter()
                .map(|(r, _)| (*r).to_owned())
                .collect::<Vec<_>>(),
        ),
        col("step", rows.iter().map(|(_, x)| x.step).collect::<Vec<_>>()),
        col(
            "layer",
            rows.iter().map(|(_, x)| x.layer).collect::<Vec<_>>(),
        ),
        col(
            "token",
            rows.iter().map(|(_, x)| x.token).collect::<Vec<_>>(),
        ),
        col(
            "rel_l2_err",
            rows.iter().map(|(_, x)| x.rel_l2_err).collect::<Vec<_>>(),
        ),
        col(
            "cosine",
            rows.iter().map(|(_, x)| x.cosine).collect::<Vec<_>>(),
        ),
    ])
}
