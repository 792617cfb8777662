//! Outcomes beside numerics (issue 40): the user's own judgement of a
//! request's answer, recorded as the run tag `outcome`.
//!
//! ## What it records
//! Whether the answer was right, as the user judged it with their own check
//! (an exact tool call, a unit test, a person reading it): `correct` or
//! `corrupted`, or a score, any finite number (`outcome=0.73`). It is set like
//! any run tag: `SHADOWTRACE_TAGS=outcome=correct` for the hooks and
//! `shadowtrace run`, or the reference engine's `TraceOptions::tags`.
//!
//! ## Definition
//! Read from the tag alone: the tool never infers an outcome. A run without
//! the tag shows `-`, and nothing is judged from it. A value that is none of
//! these is `malformed`: shown loudly, never read as either label or as a
//! score. A group of runs counts its labels (`2/3 correct`), averages its
//! scores (`mean score 0.730 of 2`), and says how many runs recorded none.
//!
//! ## Why it matters
//! A numerics verdict says where production departs from the shadow; the
//! outcome says whether the answer broke. Beside each other they show which
//! departures matter (issue 40: a fault that moves the Jaccard but not the
//! answer, or the answer at 6k tokens but not at 3k).

use std::fmt::Write;

use serde::Serialize;

/// The run tag holding the outcome.
pub const TAG: &str = "outcome";

/// What a tag value says the outcome is.
const EXPECTED: &str = "correct, corrupted or a finite number (a score)";

/// One run's outcome, as its tag says.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The user judged the answer right.
    Correct,
    /// The user judged the answer wrong.
    Corrupted,
    /// A score the user gave.
    Score(f64),
    /// A value that is none of the above: never read as one.
    Malformed {
        /// The tag's value.
        value: String,
        /// What it should have been.
        expected: &'static str,
    },
}

impl Outcome {
    /// The outcome a tag value says.
    #[must_use]
    pub fn parse(value: &str) -> Outcome {
        match value {
            "correct" => Outcome::Correct,
            "corrupted" => Outcome::Corrupted,
            _ => match value.parse::<f64>() {
                Ok(score) if score.is_finite() => Outcome::Score(score),
                _ => Outcome::Malformed {
                    value: value.to_owned(),
                    expected: EXPECTED,
                },
            },
        }
    }

    /// The outcome among a run's tags; `None` where it has no `outcome` tag.
    #[must_use]
    pub fn of(tags: &std::collections::BTreeMap<String, String>) -> Option<Outcome> {
        tags.get(TAG).map(|v| Outcome::parse(v))
    }

    /// As a table cell: `correct`, `corrupted`, the score, or `MALFORMED`.
    #[must_use]
    pub fn cell(&self) -> String {
        match self {
            Outcome::Correct => "correct".to_owned(),
            Outcome::Corrupted => "corrupted".to_owned(),
            Outcome::Score(s) => format!("{s}"),
            Outcome::Malformed { .. } => "MALFORMED".to_owned(),
        }
    }

    /// The run's line in a report.
    #[must_use]
    pub fn line(&self) -> String {
        match self {
            Outcome::Malformed { value, expected } => format!(
                "OUTCOME MALFORMED: tag outcome={value:?} is not {expected}; nothing is read from it"
            ),
            _ => format!("outcome: {} (the user's tag)", self.cell()),
        }
    }

    /// Why the tag is not an outcome; `None` where it is one.
    #[must_use]
    pub fn problem(&self) -> Option<String> {
        match self {
            Outcome::Malformed { value, expected } => {
                Some(format!("tag outcome={value:?} is not {expected}"))
            }
            _ => None,
        }
    }
}

/// The outcomes of a group of runs.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Outcomes {
    /// Runs tagged `correct`.
    pub correct: usize,
    /// Runs tagged `corrupted`.
    pub corrupted: usize,
    /// Runs tagged with a score.
    pub scored: usize,
    /// The mean of their scores.
    pub mean_score: Option<f64>,
    /// Runs without the tag.
    pub unrecorded: usize,
    /// Runs whose tag is no outcome.
    pub malformed: usize,
}

impl Outcomes {
    /// The outcomes of `runs` (each run's [`Outcome::of`]).
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // run counts far below 2^52
    pub fn of<'a>(runs: impl IntoIterator<Item = Option<&'a Outcome>>) -> Outcomes {
        let mut out = Outcomes::default();
        let mut sum = 0.0;
        for outcome in runs {
            match outcome {
                None => out.unrecorded += 1,
                Some(Outcome::Correct) => out.correct += 1,
                Some(Outcome::Corrupted) => out.corrupted += 1,
                Some(Outcome::Score(s)) => {
                    out.scored += 1;
                    sum += s;
                }
                Some(Outcome::Malformed { .. }) => out.malformed += 1,
            }
        }
        out.mean_score = (out.scored > 0).then(|| sum / out.scored as f64);
        out
    }

    /// Whether any run has the tag (well formed or not).
    #[must_use]
    pub fn any_tagged(&self) -> bool {
        self.correct + self.corrupted + self.scored + self.malformed > 0
    }

    /// As a table cell: `2/3 correct`, `mean score 0.730 of 2`, how many runs
    /// recorded none beside those, how many are malformed; `-` where no run
    /// has the tag.
    #[must_use]
    pub fn cell(&self) -> String {
        if !self.any_tagged() {
            return "-".to_owned();
        }
        let mut parts = Vec::new();
        let labelled = self.correct + self.corrupted;
        if labelled > 0 {
            parts.push(format!("{}/{labelled} correct", self.correct));
        }
        if let Some(mean) = self.mean_score {
            let mut score = String::new();
            if self.scored == 1 {
                let _ = write!(score, "score {mean:.3}");
            } else {
                let _ = write!(score, "mean score {mean:.3} of {}", self.scored);
            }
            parts.push(score);
        }
        if self.unrecorded > 0 {
            parts.push(format!("{} unrecorded", self.unrecorded));
        }
        if self.malformed > 0 {
            parts.push(format!("{} MALFORMED", self.malformed));
        }
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_finite_numbers_are_outcomes_anything_else_is_malformed() {
        assert_eq!(Outcome::parse("correct"), Outcome::Correct);
        assert_eq!(Outcome::parse("corrupted"), Outcome::Corrupted);
        assert_eq!(Outcome::parse("0.73"), Outcome::Score(0.73));
        assert_eq!(Outcome::parse("-2"), Outcome::Score(-2.0));
        for bad in ["Correct", "pass", "", "nan", "inf", "0.7 ", "1,5"] {
            let parsed = Outcome::parse(bad);
            assert!(
                matches!(&parsed, Outcome::Malformed { value, .. } if value == bad),
                "{bad:?}: {parsed:?}"
            );
            assert!(parsed.problem().is_some());
        }
        assert_eq!(
            Outcome::parse("maybe").line(),
            "OUTCOME MALFORMED: tag outcome=\"maybe\" is not correct, corrupted or a finite number (a score); nothing is read from it"
        );
    }

    #[test]
    fn the_tags_analyze_reads_are_in_the_vocabulary() {
        let words = &shadowtrace_schemas::vocabulary().run_tags;
        for tag in [
            TAG,
            crate::cache_pair::CACHE_TAG,
            crate::graft_pair::GRAFT_TAG,
        ] {
            assert!(words.contains_key(tag), "{tag}");
        }
    }

    #[test]
    fn a_group_counts_labels_averages_scores_and_says_what_is_missing() {
        let (c, x) = (Outcome::Correct, Outcome::Corrupted);
        assert_eq!(
            Outcomes::of([Some(&c), Some(&x), Some(&c)]).cell(),
            "2/3 correct"
        );
        let (a, b) = (Outcome::Score(0.5), Outcome::Score(1.0));
        assert_eq!(
            Outcomes::of([Some(&a), Some(&b)]).cell(),
            "mean score 0.750 of 2"
        );
        assert_eq!(Outcomes::of([Some(&a)]).cell(), "score 0.500");
        let bad = Outcome::parse("maybe");
        assert_eq!(
            Outcomes::of([Some(&c), None, Some(&bad), Some(&a)]).cell(),
            "1/1 correct, score 0.500, 1 unrecorded, 1 MALFORMED"
        );
        assert_eq!(Outcomes::of([None, None]).cell(), "-");
        assert!(!Outcomes::of([None]).any_tagged());
        assert!(Outcomes::of([Some(&bad)]).any_tagged());
    }
}
