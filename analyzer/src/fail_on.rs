//! `analyze --fail-on`: which runs fail, which verdicts asked for are not
//! judged, and the exit status a CI reads.
//!
//! - 1: a run (or prefix-cache pair) has a verdict asked for; one line per
//!   such run names it and the verdicts that failed it. A run whose capture
//!   is inconsistent fails whatever was asked for.
//! - 2: nothing could be read (with or without `--fail-on`: as an empty
//!   directory); or, under `--fail-on`, no run could be judged, or a verdict
//!   asked for is not judged in some run and `--allow-partial` was not given.
//!   Data missing is not a pass.
//! - 0: otherwise.

use crate::Analysis;
use crate::judged::{Question, why_not_judged};
use crate::verdict::{EVERY_KIND, VerdictKind, found};

/// What `--fail-on` asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailOn {
    /// The verdict kinds; empty when `--fail-on` was not given.
    pub kinds: Vec<VerdictKind>,
    /// The values as the user wrote them (`any`, `topk`), for the lines.
    pub label: String,
    /// `--allow-partial`: runs whose verdicts are not judged are accepted.
    pub allow_partial: bool,
}

impl FailOn {
    /// `values` as `--fail-on` names them (`any` for every kind).
    ///
    /// # Errors
    /// A value that names no verdict kind.
    pub fn parse(values: &[&str], allow_partial: bool) -> Result<FailOn, String> {
        let mut kinds = Vec::new();
        for &v in values {
            if v == "any" {
                kinds.extend(EVERY_KIND);
            } else {
                let kind = EVERY_KIND
                    .into_iter()
                    .find(|k| k.name() == v)
                    .ok_or_else(|| format!("--fail-on {v}: no such verdict"))?;
                kinds.push(kind);
            }
        }
        kinds.sort_unstable();
        kinds.dedup();
        Ok(FailOn {
            kinds,
            label: values.join(","),
            allow_partial,
        })
    }
}

/// The exit status and the lines that say why, for stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exit {
    /// 0, 1 or 2 (module doc).
    pub code: u8,
    /// One line per failing run, or per verdict not judged, then the reason
    /// for a status 2.
    pub lines: Vec<String>,
}

/// The questions whose "not judged" a verdict kind cannot pass.
fn questions(kind: VerdictKind) -> &'static [Question] {
    match kind {
        VerdictKind::Convention => &[Question::Convention],
        VerdictKind::Nonfinite => &[Question::Nonfinite],
        VerdictKind::Hidden => &[Question::Hidden],
        VerdictKind::Topk => &[Question::Topk],
        // The capture check's own failures leave top-k not judged; cache
        // verdicts come from paired runs' own verdicts.
        VerdictKind::Capture | VerdictKind::Cache => &[],
    }
}

/// One line per run (and per prefix-cache pair) that fails, naming the
/// verdicts that fail it: `FAIL (--fail-on any): glm-tool-3k topk@L1 (J
/// 0.749 < 0.8); nonfinite@L2 mlp_out t2500`. Empty when none fails.
#[must_use]
pub fn failing_lines(a: &Analysis, asked: &FailOn) -> Vec<String> {
    if asked.kinds.is_empty() {
        return Vec::new();
    }
    let prefix = format!("FAIL (--fail-on {})", asked.label);
    let mut lines: Vec<String> = a
        .runs
        .iter()
        .filter_map(|run| {
            // A capture the adapter misread fails whatever verdict was asked
            // for: no verdict of that run can be trusted to mean what it says.
            let marks: Vec<String> = found(run, &a.thresholds.hidden_site)
                .into_iter()
                .filter(|f| f.kind == VerdictKind::Capture || asked.kinds.contains(&f.kind))
                .map(|f| f.mark)
                .collect();
            (!marks.is_empty()).then(|| format!("{prefix}: {} {}", run.run_id, marks.join("; ")))
        })
        .collect();
    if asked.kinds.contains(&VerdictKind::Cache)
        && let Some(cache) = &a.cache
    {
        lines.extend(
            cache
                .pairs
                .iter()
                .filter(|p| p.parted_or_flipped())
                .map(|p| format!("{prefix}: cache hit {} against miss {}", p.hit, p.miss)),
        );
    }
    lines
}

/// One line per run and question asked for whose verdict is not judged:
/// `run r1: top-k divergence not judged: <why>`.
#[must_use]
pub fn not_judged_lines(a: &Analysis, asked: &FailOn) -> Vec<String> {
    let mut qs: Vec<Question> = asked
        .kinds
        .iter()
        .flat_map(|&k| questions(k).to_vec())
        .collect();
    // A capture the adapter may have misread fails whatever is asked for
    // (`failing_lines`): one whose self-check cannot be read is not judged
    // for any of them.
    if !asked.kinds.is_empty() {
        qs.push(Question::Capture);
    }
    qs.sort_unstable();
    qs.dedup();
    a.runs
        .iter()
        .flat_map(|run| {
            qs.iter().filter_map(move |&q| {
                why_not_judged(&run.not_measured, q)
                    .map(|why| format!("run {}: {} not judged: {why}", run.run_id, q.name()))
            })
        })
        .collect()
}

/// Why no run could be judged, counted: `1 unreadable, 2 incomplete, ...`.
fn unjudged(a: &Analysis) -> String {
    let unreadable = a
        .skipped
        .iter()
        .filter(|s| !s.starts_with("baseline "))
        .count();
    let incomplete = a.runs.iter().filter(|r| !r.complete).count();
    let unmeasured = a
        .runs
        .iter()
        .filter(|r| r.complete && !r.can_be_judged())
        .count();
    let parts: Vec<String> = [
        (unreadable, "unreadable"),
        (incomplete, "incomplete"),
        (unmeasured, "with data not measured"),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    if parts.is_empty() {
        "no runs".to_owned()
    } else {
        parts.join(", ")
    }
}

/// The exit status of `analyze` over `a` with `asked`, and its lines.
#[must_use]
pub fn exit(a: &Analysis, asked: &FailOn) -> Exit {
    // Nothing read is no pass, whatever was asked: as an empty directory.
    if a.runs.is_empty() {
        return Exit {
            code: 2,
            lines: vec![format!(
                "error: no run could be read ({} skipped)",
                a.skipped.len()
            )],
        };
    }
    let failing = failing_lines(a, asked);
    if !failing.is_empty() {
        return Exit {
            code: 1,
            lines: failing,
        };
    }
    let not_judged = not_judged_lines(a, asked);
    let none_judged = !asked.kinds.is_empty() && !a.runs.iter().any(|r| r.can_be_judged());
    let mut lines = Vec::new();
    if none_judged || !asked.allow_partial {
        lines.extend(not_judged.iter().map(|l| format!("error: --fail-on: {l}")));
    }
    if none_judged {
        lines.push(format!(
            "error: --fail-on: no run could be judged: {}",
            unjudged(a)
        ));
        return Exit { code: 2, lines };
    }
    if !asked.allow_partial && !not_judged.is_empty() {
        lines.push(format!(
            "error: --fail-on: {} verdict{} not judged: data missing is not a pass (--allow-partial accepts it)",
            not_judged.len(),
            if not_judged.len() == 1 { "" } else { "s" }
        ));
        return Exit { code: 2, lines };
    }
    Exit { code: 0, lines }
}
