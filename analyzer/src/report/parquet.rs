//! The metrics as Parquet: what notebooks and other tools read instead of
//! recomputing anything. One file per level: runs, top-k layers and rows,
//! hidden-state layers, and per-token hidden-state error at the site the
//! verdict reads.

use std::path::{Path, PathBuf};

use polars::prelude::{Column, DataFrame, ParquetWriter};

use crate::judged::{Question, why_not_judged};
use crate::metrics::summary::Summary;
use crate::outcome::{Outcome, TAG};
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

/// A column of `f` applied to each row.
fn col_map<R, T>(name: &str, rows: &[R], f: impl Fn(&R) -> T) -> Column
where
    polars::prelude::Series: polars::prelude::NamedFrom<Vec<T>, [T]>,
{
    col(name, rows.iter().map(f).collect())
}

fn runs(a: &Analysis) -> Frame {
    let r = &a.runs;
    let tag =
        |k: &'static str| move |x: &crate::RunAnalysis| x.tags.get(k).cloned().unwrap_or_default();
    frame(vec![
        col_map("run_id", r, |x| x.run_id.clone()),
        col_map("model", r, tag("model")),
        col_map("engine", r, tag("engine")),
        col_map("prompt_kind", r, tag("prompt_kind")),
        col_map("prompt_len", r, |x| {
            x.tags.get("prompt_len").and_then(|v| v.parse::<i64>().ok())
        }),
        col_map("length_bucket", r, tag("length_bucket")),
        col_map("complete", r, |x| x.complete),
        // The user's outcome (never inferred): the tag as written, then read.
        col_map("outcome", r, |x| x.tags.get(TAG).cloned()),
        col_map("outcome_correct", r, |x| match x.outcome {
            Some(Outcome::Correct) => Some(true),
            Some(Outcome::Corrupted) => Some(false),
            _ => None,
        }),
        col_map("outcome_score", r, |x| match x.outcome {
            Some(Outcome::Score(s)) => Some(s),
            _ => None,
        }),
        col_map("outcome_malformed", r, |x| {
            x.outcome.as_ref().and_then(Outcome::problem)
        }),
        col_map("onset_layer", r, |x| x.onset.as_ref().map(|o| o.layer)),
        col_map("onset_site", r, |x| {
            x.onset.as_ref().map(|o| o.site.clone())
        }),
        col_map("onset_token", r, |x| x.onset.as_ref().and_then(|o| o.token)),
        col_map("onset_shadow_finite", r, |x| {
            x.onset.as_ref().and_then(|o| o.shadow_finite)
        }),
        col_map("hidden_verdict_layer", r, |x| {
            x.hidden_verdict.as_ref().map(|v| v.layer)
        }),
        col_map("topk_verdict_layer", r, |x| {
            x.topk_verdict.as_ref().map(|v| v.layer)
        }),
        // Null where none: the verdicts a reader of this file must not miss.
        col_map("convention_mismatches", r, |x| {
            (!x.convention_mismatches.is_empty()).then(|| {
                x.convention_mismatches
                    .iter()
                    .map(crate::verdict::ConventionMismatch::line)
                    .collect::<Vec<_>>()
                    .join("; ")
            })
        }),
        // consistent, inconsistent or short of winners (with the layers' lines), or null where
        // the producer ran no capture self-check.
        col_map("capture_check", r, |x| {
            x.capture_check.as_ref().map(|c| {
                let (_, lines) = c.report_lines();
                if c.inconsistent().next().is_some() {
                    format!("inconsistent: {}", lines.join("; "))
                } else if c.short_of_winners().next().is_some() {
                    format!("short of winners: {}", lines.join("; "))
                } else {
                    format!("consistent: {}", lines.join("; "))
                }
            })
        }),
        col_map("argmax_agreement", r, |x| {
            x.logits.as_ref().and_then(|l| l.argmax_agreement)
        }),
        // Null where the question's data is whole; else why it is not judged.
        col_map("onset_not_judged", r, |x| {
            why_not_judged(&x.not_measured, Question::Nonfinite)
        }),
        col_map("hidden_not_judged", r, |x| {
            why_not_judged(&x.not_measured, Question::Hidden)
        }),
        col_map("topk_not_judged", r, |x| {
            why_not_judged(&x.not_measured, Question::Topk)
        }),
        col_map("logits_not_judged", r, |x| {
            why_not_judged(&x.not_measured, Question::Logits)
        }),
    ])
}

fn stat(s: Option<Summary>, f: fn(&Summary) -> f64) -> Option<f64> {
    s.as_ref().map(f)
}

/// Each run's items, tagged with the run id.
fn per_run<'a, T: 'a, I: IntoIterator<Item = &'a T>>(
    a: &'a Analysis,
    items: impl Fn(&'a crate::RunAnalysis) -> I,
) -> Vec<(&'a str, &'a T)> {
    a.runs
        .iter()
        .flat_map(|r| items(r).into_iter().map(move |x| (r.run_id.as_str(), x)))
        .collect()
}

fn topk_layers(a: &Analysis) -> Frame {
    let rows = per_run(a, |r| &r.topk);
    frame(vec![
        col_map("run_id", &rows, |(r, _)| (*r).to_owned()),
        col_map("layer", &rows, |(_, l)| l.layer),
        col_map("informative_rows", &rows, |(_, l)| {
            l.informative_rows as u64
        }),
        col_map("dense_rows", &rows, |(_, l)| l.dense_rows as u64),
        col_map("churn_unknown_rows", &rows, |(_, l)| {
            l.churn_unknown_rows as u64
        }),
        col_map("jaccard_mean", &rows, |(_, l)| stat(l.jaccard, |s| s.mean)),
        col_map("jaccard_p5", &rows, |(_, l)| stat(l.jaccard, |s| s.p5)),
        col_map("jaccard_min", &rows, |(_, l)| stat(l.jaccard, |s| s.min)),
        col_map("recall_mean", &rows, |(_, l)| stat(l.recall, |s| s.mean)),
        col_map("jaccard_no_churn_mean", &rows, |(_, l)| {
            stat(l.jaccard_no_churn, |s| s.mean)
        }),
        col_map("jaccard_no_churn_p5", &rows, |(_, l)| {
            stat(l.jaccard_no_churn, |s| s.p5)
        }),
        col_map("jaccard_no_churn_min", &rows, |(_, l)| {
            stat(l.jaccard_no_churn, |s| s.min)
        }),
        col_map("recall_no_churn_mean", &rows, |(_, l)| {
            stat(l.recall_no_churn, |s| s.mean)
        }),
        col_map("share_below_threshold", &rows, |(_, l)| l.share_below),
        col_map("churn_keys_mean", &rows, |(_, l)| l.churn_keys_mean),
        col_map("churn_share", &rows, |(_, l)| l.churn_share),
    ])
}

fn topk_rows(a: &Analysis) -> Frame {
    let rows = per_run(a, |r| &r.topk_rows);
    frame(vec![
        col_map("run_id", &rows, |(r, _)| (*r).to_owned()),
        col_map("step", &rows, |(_, x)| x.step),
        col_map("layer", &rows, |(_, x)| x.layer),
        col_map("token", &rows, |(_, x)| x.token),
        col_map("jaccard", &rows, |(_, x)| x.jaccard()),
        col_map("recall", &rows, |(_, x)| x.recall()),
        col_map("jaccard_no_churn", &rows, |(_, x)| x.jaccard_no_churn()),
        col_map("recall_no_churn", &rows, |(_, x)| x.recall_no_churn()),
        col_map("churn_keys", &rows, |(_, x)| x.churn_keys() as u64),
        col_map("differing_keys", &rows, |(_, x)| x.differing_keys() as u64),
        col_map("differing_churn", &rows, |(_, x)| {
            x.differing_churn() as u64
        }),
        col_map("churn_unknown", &rows, |(_, x)| x.churn_unknown),
    ])
}

fn hidden_layers(a: &Analysis) -> Frame {
    let rows = per_run(a, |r| &r.hidden);
    frame(vec![
        col_map("run_id", &rows, |(r, _)| (*r).to_owned()),
        col_map("layer", &rows, |(_, x)| x.layer),
        col_map("site", &rows, |(_, x)| x.site.clone()),
        col_map("shadow_mode", &rows, |(_, x)| x.shadow_mode.clone()),
        col_map("tokens", &rows, |(_, x)| x.tokens as u64),
        col_map("nonfinite_tokens", &rows, |(_, x)| {
            x.nonfinite_tokens as u64
        }),
        col_map("shadow_nonfinite_tokens", &rows, |(_, x)| {
            x.shadow_nonfinite_tokens as u64
        }),
        col_map("rel_l2_err_mean", &rows, |(_, x)| {
            stat(x.rel_l2_err, |s| s.mean)
        }),
        col_map("rel_l2_err_p50", &rows, |(_, x)| {
            stat(x.rel_l2_err, |s| s.p50)
        }),
        col_map("rel_l2_err_p95", &rows, |(_, x)| {
            stat(x.rel_l2_err, |s| s.p95)
        }),
        col_map("rel_l2_err_max", &rows, |(_, x)| {
            stat(x.rel_l2_err, |s| s.max)
        }),
        col_map("cosine_min", &rows, |(_, x)| stat(x.cosine, |s| s.min)),
        col_map("cosine_p5", &rows, |(_, x)| stat(x.cosine, |s| s.p5)),
        col_map("max_abs_diff", &rows, |(_, x)| x.max_abs_diff),
    ])
}

fn hidden_tokens(a: &Analysis) -> Frame {
    let rows = per_run(a, |r| &r.hidden_tokens);
    frame(vec![
        col_map("run_id", &rows, |(r, _)| (*r).to_owned()),
        col_map("step", &rows, |(_, x)| x.step),
        col_map("layer", &rows, |(_, x)| x.layer),
        col_map("token", &rows, |(_, x)| x.token),
        col_map("rel_l2_err", &rows, |(_, x)| x.rel_l2_err),
        col_map("cosine", &rows, |(_, x)| x.cosine),
    ])
}
