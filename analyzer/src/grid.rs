//! The grid: runs grouped by tags, one summary row per group, and a
//! side-by-side comparison along the first grouping tag (for example GLM
//! against DeepSeek at each prompt kind and length).

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde::Serialize;

use crate::analysis::{MANIFEST_TAG_PREFIX, RunAnalysis, identity_tag};
use crate::outcome::Outcomes;
use crate::verdict::{Thresholds, hidden_series, topk_series};

/// One group of runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupRow {
    /// The group's tag values, in `group_by` order.
    pub key: Vec<String>,
    /// Runs in the group.
    pub runs: usize,
    /// Informative top-k rows over all runs and layers.
    pub informative_rows: usize,
    /// Mean churn-free Jaccard over those rows.
    pub jaccard_no_churn: Option<f64>,
    /// The layer with the lowest mean churn-free Jaccard, and that mean.
    pub worst_topk_layer: Option<(i32, f64)>,
    /// Largest p95 relative L2 error at any layer (at the verdict's site), and where.
    pub worst_hidden_layer: Option<(i32, f64)>,
    /// Runs with a non-finite onset.
    pub nonfinite_runs: usize,
    /// Runs whose capture self-check found a layer inconsistent.
    pub capture_runs: usize,
    /// Runs with a convention the engine ran differently from the model.
    pub convention_runs: usize,
    /// The onset layer of each run that has one.
    pub nonfinite_layers: Vec<i32>,
    /// Runs with a failed sentinel check.
    pub sentinel_runs: usize,
    /// First hidden-divergence layer of each run that has one.
    pub hidden_verdicts: Vec<i32>,
    /// First top-k divergence layer of each run that has one.
    pub topk_verdicts: Vec<i32>,
    /// Runs with a verdict not judged: data that was not measured
    /// ([`crate::judged`]).
    pub not_judged_runs: usize,
    /// The runs' outcomes, as their users tagged them ([`crate::outcome`]).
    pub outcomes: Outcomes,
}

/// The grid.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Grid {
    /// Tags grouped by.
    pub group_by: Vec<String>,
    /// Per grouping tag that some run's user tag supplied in place of the
    /// manifest identity's value: which runs, and both values.
    pub user_tags: Vec<UserTag>,
    /// One row per group, sorted by key ([`tag_value_order`]).
    pub groups: Vec<GroupRow>,
    /// The site whose error [`GroupRow::worst_hidden_layer`] is, as the
    /// hidden verdict reads it (`--hidden-site`).
    pub hidden_site: String,
}

impl Grid {
    /// Whether any run has an `outcome` tag: the reports then show the
    /// outcomes beside the numerics, `-` where a group has none.
    #[must_use]
    pub fn has_outcomes(&self) -> bool {
        self.groups.iter().any(|g| g.outcomes.any_tagged())
    }

    /// The comparison along the first grouping tag: its values as columns,
    /// the other tags' value combinations as rows.
    #[must_use]
    pub fn comparison(&self) -> Comparison {
        let mut columns: Vec<String> = self
            .groups
            .iter()
            .filter_map(|g| g.key.first().cloned())
            .collect();
        columns.sort_by(|a, b| tag_value_order(a, b));
        columns.dedup();
        let mut rows: BTreeMap<Vec<String>, Vec<Option<GroupRow>>> = BTreeMap::new();
        for g in &self.groups {
            let (Some(first), rest) = (g.key.first(), g.key.get(1..).unwrap_or_default().to_vec())
            else {
                continue;
            };
            let slot = columns.iter().position(|c| c == first).unwrap_or(0);
            rows.entry(rest)
                .or_insert_with(|| vec![None; columns.len()])[slot] = Some(g.clone());
        }
        let mut rows: Vec<(Vec<String>, Vec<Option<GroupRow>>)> = rows.into_iter().collect();
        rows.sort_by(|a, b| key_order(&a.0, &b.0));
        Comparison {
            by: self.group_by.first().cloned().unwrap_or_default(),
            rest: self.group_by.get(1..).unwrap_or_default().to_vec(),
            columns,
            rows,
        }
    }
}

/// A grouping tag some runs took from their user's tags, not the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UserTag {
    /// The tag.
    pub tag: String,
    /// Runs grouped by.
    pub runs: usize,
    /// (run id, the user's value, the manifest's value) of each run whose
    /// user tag was used.
    pub overrides: Vec<(String, String, String)>,
}

impl UserTag {
    /// One line for a report, naming up to three of the runs.
    #[must_use]
    pub fn line(&self) -> String {
        let shown: Vec<String> = self
            .overrides
            .iter()
            .take(3)
            .map(|(run, user, manifest)| format!("{run}: {user}, manifest {manifest}"))
            .collect();
        let more = self.overrides.len().saturating_sub(shown.len());
        format!(
            "{}: the user's tag on {} of {} runs ({}{})",
            self.tag,
            self.overrides.len(),
            self.runs,
            shown.join("; "),
            if more > 0 {
                format!("; {more} more")
            } else {
                String::new()
            }
        )
    }
}

/// Groups side by side.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// The tag whose values are the columns.
    pub by: String,
    /// The tags whose values label the rows.
    pub rest: Vec<String>,
    /// The column values.
    pub columns: Vec<String>,
    /// Row label values, and each column's group (if any).
    pub rows: Vec<(Vec<String>, Vec<Option<GroupRow>>)>,
}

/// Groups runs by the values of `group_by` tags (a missing tag reads `-`;
/// `manifest.<name>` reads the identity's value whatever a user tag says).
#[must_use]
pub fn group_runs(runs: &[RunAnalysis], group_by: &[String], t: &Thresholds) -> Grid {
    let mut groups: BTreeMap<Vec<String>, Vec<&RunAnalysis>> = BTreeMap::new();
    for run in runs {
        let key = group_by
            .iter()
            .map(|t| {
                let identity = t
                    .strip_prefix(MANIFEST_TAG_PREFIX)
                    .and_then(|name| identity_tag(&run.tags, name));
                run.tags
                    .get(t)
                    .or(identity)
                    .cloned()
                    .unwrap_or_else(|| "-".to_owned())
            })
            .collect();
        groups.entry(key).or_default().push(run);
    }
    let user_tags = group_by
        .iter()
        .filter_map(|tag| {
            let overrides: Vec<(String, String, String)> = runs
                .iter()
                .filter_map(|r| {
                    let manifest = r.tags.get(&format!("{MANIFEST_TAG_PREFIX}{tag}"))?;
                    Some((r.run_id.clone(), r.tags.get(tag)?.clone(), manifest.clone()))
                })
                .collect();
            (!overrides.is_empty()).then(|| UserTag {
                tag: tag.clone(),
                runs: runs.len(),
                overrides,
            })
        })
        .collect();
    let mut rows: Vec<GroupRow> = groups
        .into_iter()
        .map(|(key, runs)| {
            let mut rows_total = 0;
            let mut weighted = 0.0;
            let mut worst_topk: Option<(i32, f64)> = None;
            let mut worst_hidden: Option<(i32, f64)> = None;
            for run in &runs {
                for layer in &run.topk {
                    if let Some(j) = layer.jaccard_no_churn {
                        rows_total += layer.informative_rows;
                        weighted += j.mean * layer.informative_rows as f64;
                    }
                }
                for (layer, j) in topk_series(&run.topk) {
                    if worst_topk.is_none_or(|(_, w)| j < w) {
                        worst_topk = Some((layer, j));
                    }
                }
                // The site and mode the hidden verdict reads.
                for (layer, p95) in hidden_series(&run.hidden, t) {
                    if worst_hidden.is_none_or(|(_, w)| p95 > w) {
                        worst_hidden = Some((layer, p95));
                    }
                }
            }
            GroupRow {
                key,
                runs: runs.len(),
                informative_rows: rows_total,
                jaccard_no_churn: (rows_total > 0).then(|| weighted / rows_total as f64),
                worst_topk_layer: worst_topk,
                worst_hidden_layer: worst_hidden,
                nonfinite_runs: runs.iter().filter(|r| r.onset.is_some()).count(),
                capture_runs: runs.iter().filter(|r| r.capture_inconsistent()).count(),
                convention_runs: runs
                    .iter()
                    .filter(|r| !r.convention_mismatches.is_empty())
                    .count(),
                nonfinite_layers: runs
                    .iter()
                    .filter_map(|r| r.onset.as_ref().map(|o| o.layer))
                    .collect(),
                sentinel_runs: runs
                    .iter()
                    .filter(|r| !r.failed_sentinels.is_empty())
                    .count(),
                hidden_verdicts: runs
                    .iter()
                    .filter_map(|r| r.hidden_verdict.as_ref().map(|v| v.layer))
                    .collect(),
                topk_verdicts: runs
                    .iter()
                    .filter_map(|r| r.topk_verdict.as_ref().map(|v| v.layer))
                    .collect(),
                not_judged_runs: runs.iter().filter(|r| !r.not_measured.is_empty()).count(),
                outcomes: Outcomes::of(runs.iter().map(|r| r.outcome.as_ref())),
            }
        })
        .collect();
    rows.sort_by(|a, b| key_order(&a.key, &b.key));
    Grid {
        group_by: group_by.to_vec(),
        user_tags,
        groups: rows,
        hidden_site: t.hidden_site.clone(),
    }
}

/// The order of tag values in the grid, its tables and plots: length
/// buckets by the lengths they hold (`<=2048`, `2049-4096`, `>4096`; as
/// text, `2049-4096` would come first), integers by value, then any other
/// value as text.
#[must_use]
pub fn tag_value_order(a: &str, b: &str) -> Ordering {
    match (length_span(a), length_span(b)) {
        (Some(x), Some(y)) => x.cmp(&y).then_with(|| a.cmp(b)),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => a.cmp(b),
    }
}

/// Group keys compared value by value with [`tag_value_order`].
fn key_order(a: &[String], b: &[String]) -> Ordering {
    a.iter()
        .zip(b)
        .map(|(x, y)| tag_value_order(x, y))
        .find(|o| o.is_ne())
        .unwrap_or_else(|| a.len().cmp(&b.len()))
}

/// The lengths a value names, as (first, last): a length bucket of
/// [`crate::analysis::length_bucket`] (`<=K`, `A-B`, `>B`) or an integer.
fn length_span(v: &str) -> Option<(u64, u64)> {
    if let Some(k) = v.strip_prefix("<=") {
        return Some((0, k.parse().ok()?));
    }
    if let Some(b) = v.strip_prefix('>') {
        return Some((b.parse::<u64>().ok()?.saturating_add(1), u64::MAX));
    }
    if let Some((a, b)) = v.split_once('-') {
        return Some((a.parse().ok()?, b.parse().ok()?));
    }
    v.parse().ok().map(|n| (n, n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::length_bucket;

    #[test]
    fn length_buckets_sort_by_length_not_by_text() {
        let k = Some(2048);
        let mut buckets: Vec<String> = [6144, 1024, 3072, 100_000, 2048, 2049]
            .map(|n| length_bucket(n, k))
            .to_vec();
        buckets.push(length_bucket(10, None));
        buckets.sort_by(|a, b| tag_value_order(a, b));
        buckets.dedup();
        assert_eq!(buckets, ["<=2048", "2049-4096", ">4096", "no indexer"]);
        let mut text = buckets.clone();
        text.sort();
        assert_eq!(text[0], "2049-4096", "what text order would do");
    }

    #[test]
    fn integers_sort_by_value_and_text_after_them() {
        let mut v = ["12288", "tool", "1024", "no_tool", "3072"];
        v.sort_by(|a, b| tag_value_order(a, b));
        assert_eq!(v, ["1024", "3072", "12288", "no_tool", "tool"]);
    }

    #[test]
    fn group_keys_order_by_their_first_differing_value() {
        let key = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            key_order(
                &key(&["glm", "tool", "<=2048"]),
                &key(&["glm", "tool", "2049-4096"])
            ),
            Ordering::Less
        );
        assert_eq!(
            key_order(
                &key(&["ds", "tool", ">4096"]),
                &key(&["glm", "no_tool", "<=2048"])
            ),
            Ordering::Less
        );
    }
}
