//! What a run's verdicts could not look at.
//!
//! A reader takes "no verdict" for "clean". So every run analysis lists what
//! was not measured (a capture disabled, rows dropped or lost, a writer that
//! failed, a fallback that changed what production computed, summaries that
//! disagree with their lists), each with the verdicts it leaves not judged.
//! A verdict whose data is not whole is printed as `not judged: <why>`, and
//! `--fail-on` fails on it unless `--allow-partial` is given.
//!
//! The producer's counters are read by name. A counter this analyzer does
//! not know is taken as a loss of every verdict: a producer newer than the
//! analyzer must never look clean because its counters were not understood.

use std::collections::BTreeMap;

use serde::Serialize;
use shadowtrace_schemas::manifest::Status;
use shadowtrace_schemas::{Convention, Manifest};

use crate::RunProblem;
use crate::capture_check::CaptureCheck;
use crate::metrics::topk_check::SummaryCheck;

/// A question a run's verdicts answer (DESIGN.md, "The questions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Question {
    /// Where the first non-finite value appears, and the sentinels.
    Nonfinite,
    /// The first layer whose hidden state departs from the shadow.
    Hidden,
    /// The first layer whose top-k selection departs from the shadow's.
    Topk,
    /// Prod against shadow logits.
    Logits,
    /// A numerics convention the engine ran differently from the model: read
    /// from the manifest, so only an engine value the adapter assumed leaves
    /// it not judged.
    Convention,
    /// Whether the adapter read the engine right (the capture self-check):
    /// not judged where its record cannot be read. Like `capture
    /// inconsistent`, it bears on every verdict `--fail-on` asks for.
    Capture,
}

/// Every question answered from a run's rows, in the order the reports
/// print them: what a loss of rows or a failed capture leaves not judged.
pub const EVERY_QUESTION: [Question; 4] = [
    Question::Nonfinite,
    Question::Hidden,
    Question::Topk,
    Question::Logits,
];

impl Question {
    /// The question as the reports name it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Question::Nonfinite => "non-finite onset",
            Question::Hidden => "hidden divergence",
            Question::Topk => "top-k divergence",
            Question::Logits => "logits",
            Question::Convention => "convention",
            Question::Capture => "capture self-check",
        }
    }
}

/// One thing a run did not measure, and the verdicts it leaves not judged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotMeasured {
    /// The questions whose verdicts it leaves not judged.
    pub questions: Vec<Question>,
    /// Why, as a person reads it: the setting or counter and its value.
    pub why: String,
}

/// Counters that record how production ran, never a loss: the data they
/// describe is whole.
const INFORMATIONAL: [&str; 22] = [
    // Which kernel computed production's FP8 linears: the same math either way.
    "fp8_linears_tensor_cores",
    "fp8_linears_emulated",
    // `_scaled_mm` failed and the exact fp32 emulation of the same FP8 math ran.
    "fp8_scaled_mm_fallbacks",
    // Tensor-parallel expert shards upcast for the shadow's eager forward:
    // memory, not precision.
    "shadow_expert_bank_upcast",
    // The HF shadow re-runs layers on the prefill only, by design (a decode
    // step would need a shadow KV cache): decode rows carry no shadow, and
    // the metrics count them apart (rows without a shadow), so the verdicts
    // are whole over the prefill they judge.
    "shadow_skipped_decode_steps",
    "warnings",
    "closed_at_exit",
    "request_resumed",
    // Warm-up requests an engine runs for itself, not the user's.
    "rows_skipped_dummy_requests",
    // A model the hooks refused runs untraced and writes no run of its own.
    "models_refused",
    // Tokens of drafts that assisted or speculative decoding rejected: their
    // rows are production forwards, recorded at their own step, and the hooks
    // cut their keys out of the lists later steps score.
    "cache_rollback_tokens",
    // Rows TensorRT-LLM's short-sequence skip filled with every visible key:
    // dense rows (no request of the phase sees more than k keys), which carry
    // no selection to judge.
    "indexer_rows_dense_skip",
    // A shared indexer layer (GLM-5.2) reuses an earlier layer's selection: it
    // has none of its own to record, and the earlier layer's rows are whole.
    "indexer_calls_shared_layer",
    "indexer_layers_shared",
    // A blocking put that timed out drops its rows, and those are counted
    // (`dropped_rows`); the timeout itself loses nothing more.
    "queue_wait_timeouts",
    // The writer's total: the per-table `dropped_rows.<table>` say which
    // verdicts lost rows.
    "dropped_rows",
    // Grafts (SHADOWTRACE_GRAFT) change what production computes, on purpose,
    // and the run records what it computed: its data are whole. What a graft
    // that did not apply means for its pair is the pair's to say
    // (`graft_pair`); `grafted_<site>` counts the grafts taken (below).
    "graft_refused",
    "graft_skipped_cached_steps",
    // Parts the hooks closed without the `xxhash` package carry no content
    // hash: their rows are whole, only unverified, and the loader says so in
    // a note on the run.
    "parts_unhashed",
    "graft_not_applied",
    "graft_indexer_on_shared_layer",
    // A CUDA graph's replayed step records every token, whatever
    // SHADOWTRACE_TOKENS asked: more rows, none lost.
    "graph_skipped_token_selection",
];

/// Which questions a producer counter's loss leaves not judged; `None` when
/// the counter is no loss.
fn questions_of_counter(name: &str) -> Option<Vec<Question>> {
    use Question::{Hidden, Logits, Nonfinite, Topk};
    let name = name.strip_prefix("process.").unwrap_or(name);
    // A Triton kernel that raised: torch's ops computed the same statistics.
    if INFORMATIONAL.contains(&name)
        || name.starts_with("kernel_failed.")
        || name.starts_with("grafted_")
    {
        return None;
    }
    if let Some(table) = name.strip_prefix("dropped_rows.") {
        return Some(match table {
            "hidden" => vec![Nonfinite, Hidden],
            "topk" => vec![Topk],
            "events" => vec![Nonfinite],
            "logits" => vec![Logits],
            _ => EVERY_QUESTION.to_vec(),
        });
    }
    Some(match name {
        // Production's FP8 linears ran in fp32 unquantized: no FP8 to judge.
        "fp8_quantize_fallbacks" => vec![Hidden, Topk, Logits],
        // The KV cache could not be read back: no sentinel checked it.
        "kv_sentinel_read_failures" => vec![Nonfinite],
        "fp8_indexer_fallbacks" | "indexer_scores_recomputed" | "topk_lists_lost_rows" => {
            vec![Topk]
        }
        n if n.starts_with("topk_") || n.starts_with("indexer_") => vec![Topk],
        // What a CUDA graph's replayed steps could not hold (hooks/README.md,
        // "CUDA graphs"). The indexer's capture carries its selection and the
        // events of its non-finite scores, which no hidden row shows.
        "graph_skipped_indexer" | "graph_skipped_scorer" => vec![Nonfinite, Topk],
        // The prefix-cache free chain: those steps' rows have no shadow.
        "graph_skipped_free_chain" => vec![Hidden, Topk, Logits],
        // Whole steps with no rows: a replay of a graph whose capture traced
        // nothing, or a step the hooks stepped aside from under capture.
        "graph_replays_untraced" | "captures_skipped_cuda_graph" => EVERY_QUESTION.to_vec(),
        // A shadow missing for some rows: prod alone still shows its NaNs.
        n if n.starts_with("shadow_") => vec![Hidden, Topk, Logits],
        _ => EVERY_QUESTION.to_vec(),
    })
}

/// Which questions a capture disabled by the hooks (`settings.disabled_sites`)
/// leaves not judged. Capture keys are the adapters' own; a key that names
/// neither the logits nor the indexer may have carried any row.
fn questions_of_site(key: &str) -> Vec<Question> {
    if key == "logits" {
        vec![Question::Logits]
    } else if key == "hidden" {
        // The hidden-state rows: the non-finite onset and hidden verdicts'.
        vec![Question::Nonfinite, Question::Hidden]
    } else if key.contains("indexer") || key.contains("topk") {
        vec![Question::Topk]
    } else {
        EVERY_QUESTION.to_vec()
    }
}

/// A run's counters as verdicts read them: the producer's, and each table's
/// dropped rows as `dropped_rows.<table>`.
#[must_use]
pub fn run_counters(manifest: &Manifest) -> BTreeMap<String, u64> {
    let mut counters = manifest.counters.clone();
    for (table, entry) in &manifest.tables {
        if entry.dropped_rows > 0 {
            counters.insert(format!("dropped_rows.{table}"), entry.dropped_rows);
        }
    }
    counters
}

/// What `manifest`'s run did not measure. `conventions` are the ones it
/// recorded; `counters` the producer's with the per-table
/// `dropped_rows.<table>` added; `summary` the summary check of its top-k
/// rows, where it ran.
#[must_use]
pub fn not_measured(
    manifest: &Manifest,
    conventions: &[Convention],
    counters: &BTreeMap<String, u64>,
    summary: Option<&SummaryCheck>,
) -> Vec<NotMeasured> {
    let mut out = Vec::new();
    // An assumed engine value says nothing about the engine, whether it
    // agrees with the model's or not; one not read says nothing at all. A
    // model that defines no value has nothing to judge.
    for c in conventions.iter().filter(|c| !c.model.is_null()) {
        let name = c.name.replace('_', " ");
        let model = crate::verdict::convention_value(&c.model);
        let why = if c.engine.is_null() {
            format!(
                "{name}: the engine's value was not read ({}); the model's is {model}",
                c.engine_source
            )
        } else if c.engine_assumed {
            format!(
                "{name}: the engine's value ({}) is assumed ({}), not read from the engine; the model's is {model}",
                crate::verdict::convention_value(&c.engine),
                c.engine_source
            )
        } else {
            continue;
        };
        out.push(NotMeasured {
            questions: vec![Question::Convention],
            why,
        });
    }
    if manifest.status != Status::Complete {
        out.push(NotMeasured {
            questions: EVERY_QUESTION.to_vec(),
            why: if manifest.closed_unix_ms.is_some() {
                "the run is incomplete: its producer closed it with rows it lost (counted)"
            } else {
                "the run is incomplete: its producer never closed it"
            }
            .to_owned(),
        });
    }
    if let Some(sites) = manifest
        .identity
        .settings
        .get("disabled_sites")
        .and_then(|v| v.as_object())
    {
        for (key, reason) in sites {
            let reason = reason
                .as_str()
                .map_or_else(|| reason.to_string(), str::to_owned);
            out.push(NotMeasured {
                questions: questions_of_site(key),
                why: format!("capture {key} disabled in this process: {reason}"),
            });
        }
    }
    for (name, &value) in counters {
        if value == 0 {
            continue;
        }
        if let Some(questions) = questions_of_counter(name) {
            out.push(NotMeasured {
                questions,
                why: format!("counted {name} = {value}"),
            });
        }
    }
    if let Some(check) = summary.filter(|c| c.rows_disagreeing > 0) {
        out.push(NotMeasured {
            questions: vec![Question::Topk],
            why: check.text(),
        });
    }
    out.extend(capture_not_measured(
        CaptureCheck::of(manifest).as_ref().map(Option::as_ref),
    ));
    out
}

/// What the capture self-check leaves not judged: the top-k verdict of a
/// run where a layer's recorded selections contradict production's own
/// scores (the adapter misread the engine there), or whose check cannot be
/// read.
#[must_use]
fn capture_not_measured(check: Result<Option<&CaptureCheck>, &String>) -> Vec<NotMeasured> {
    match check {
        Err(why) => vec![NotMeasured {
            questions: vec![Question::Capture, Question::Topk],
            why: why.clone(),
        }],
        Ok(None) => Vec::new(),
        Ok(Some(c)) => c
            .inconsistent()
            .map(|l| NotMeasured {
                questions: vec![Question::Topk],
                why: format!(
                    "capture inconsistent at layer {} ({} of {} rows)",
                    l.layer, l.disagree, l.rows
                ),
            })
            .collect(),
    }
}

/// What a run's files contradict ([`RunProblem`]) leaves not judged: the
/// questions of the table concerned (its rows are not what the manifest
/// says), or every question where the run as a whole lost rows.
#[must_use]
pub fn problems_not_measured(problems: &[RunProblem]) -> Vec<NotMeasured> {
    problems
        .iter()
        .map(|p| {
            let table = match p {
                RunProblem::RowCount { table, .. } => Some((*table).to_owned()),
                RunProblem::UnlistedPart { path, .. } => path
                    .parent()
                    .and_then(|d| d.file_name())
                    .map(|d| d.to_string_lossy().into_owned()),
                RunProblem::SummaryDisagreement { .. } => Some("topk".to_owned()),
                RunProblem::Unaccounted { .. } => None,
                // Whether the adapter read the engine right is unknown: the
                // capture question, which bears on every verdict asked for.
                RunProblem::CaptureCheckUnreadable { .. } => {
                    return NotMeasured {
                        questions: vec![Question::Capture],
                        why: p.to_string(),
                    };
                }
            };
            let questions = table
                .and_then(|t| questions_of_counter(&format!("dropped_rows.{t}")))
                .unwrap_or_else(|| EVERY_QUESTION.to_vec());
            NotMeasured {
                questions,
                why: p.to_string(),
            }
        })
        .collect()
}

/// What a top-k part's rows whose stored counts contradict each other
/// leave not judged ([`crate::metrics::topk_v2::Contradictions`]): the top-k
/// verdict, with the part named relative to the run and the first such row.
#[must_use]
pub fn contradicting_counts(
    run_dir: &std::path::Path,
    part: &std::path::Path,
    c: &crate::metrics::topk_v2::Contradictions,
) -> NotMeasured {
    let name = part.strip_prefix(run_dir).unwrap_or(part).display();
    let first = c.first.as_ref().map_or_else(String::new, |(at, why)| {
        format!(
            "; the first at step {}, layer {}, token {}: {why}",
            at.step, at.layer, at.token
        )
    });
    NotMeasured {
        questions: vec![Question::Topk],
        why: format!(
            "{name}: {} top-k row{} whose counts contradict each other (damaged or miswritten; left out){first}",
            c.rows,
            if c.rows == 1 { "" } else { "s" }
        ),
    }
}

/// The reasons among `list` that leave `question` not judged, joined for a
/// report; `None` when its data is whole.
#[must_use]
pub fn why_not_judged(list: &[NotMeasured], question: Question) -> Option<String> {
    let reasons: Vec<&str> = list
        .iter()
        .filter(|n| n.questions.contains(&question))
        .map(|n| n.why.as_str())
        .collect();
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// A verdict cell: `found` where the data is whole; otherwise `not judged:
/// <why>`, followed by what the partial data showed when it showed
/// something (`none`, and `n/a` with its reason, are no finding).
#[must_use]
pub fn cell(list: &[NotMeasured], question: Question, found: &str) -> String {
    match why_not_judged(list, question) {
        None => found.to_owned(),
        Some(why) if found == "none" || found.starts_with("n/a") => format!("not judged: {why}"),
        Some(why) => format!("not judged: {why}; the partial data shows {found}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_the_analyzer_does_not_know_leaves_every_verdict_not_judged() {
        assert_eq!(
            questions_of_counter("some_future_loss"),
            Some(EVERY_QUESTION.to_vec())
        );
        assert_eq!(
            questions_of_counter("process.hook_errors"),
            Some(EVERY_QUESTION.to_vec())
        );
    }

    #[test]
    fn counters_that_only_say_how_production_ran_leave_every_verdict_judged() {
        for name in INFORMATIONAL {
            assert_eq!(questions_of_counter(name), None, "{name}");
        }
        assert_eq!(
            questions_of_counter("process.kernel_failed.row_stats"),
            None
        );
    }

    #[test]
    fn a_loss_of_one_table_leaves_only_its_verdicts_not_judged() {
        assert_eq!(
            questions_of_counter("dropped_rows.topk"),
            Some(vec![Question::Topk])
        );
        assert_eq!(
            questions_of_counter("dropped_rows.hidden"),
            Some(vec![Question::Nonfinite, Question::Hidden])
        );
        assert_eq!(
            questions_of_counter("topk_lists_lost_rows"),
            Some(vec![Question::Topk])
        );
        assert_eq!(questions_of_site("logits"), vec![Question::Logits]);
        assert_eq!(questions_of_site("vllm:indexer"), vec![Question::Topk]);
        assert_eq!(
            questions_of_site("hidden"),
            vec![Question::Nonfinite, Question::Hidden]
        );
        assert_eq!(
            questions_of_site("transformers:step"),
            EVERY_QUESTION.to_vec()
        );
    }

    #[test]
    fn what_a_cuda_graph_could_not_hold_leaves_only_the_verdicts_that_needed_it_not_judged() {
        use Question::{Hidden, Logits, Nonfinite, Topk};
        // The indexer's events are the only record of its non-finite scores.
        assert_eq!(
            questions_of_counter("graph_skipped_indexer"),
            Some(vec![Nonfinite, Topk])
        );
        assert_eq!(
            questions_of_counter("graph_skipped_scorer"),
            Some(vec![Nonfinite, Topk])
        );
        assert_eq!(
            questions_of_counter("graph_skipped_free_chain"),
            Some(vec![Hidden, Topk, Logits])
        );
        // Every token recorded where fewer were asked for: nothing lost.
        assert_eq!(questions_of_counter("graph_skipped_token_selection"), None);
        // Steps with no rows at all.
        assert_eq!(
            questions_of_counter("process.graph_replays_untraced"),
            Some(EVERY_QUESTION.to_vec())
        );
        assert_eq!(
            questions_of_counter("process.captures_skipped_cuda_graph"),
            Some(EVERY_QUESTION.to_vec())
        );
        // A serving engine's steps replayed from a FULL graph, no indexer call seen.
        assert_eq!(
            questions_of_counter("indexer_steps_unseen"),
            Some(vec![Topk])
        );
        // A graph_skipped_ kind this analyzer does not know stays a loss of every verdict.
        assert_eq!(
            questions_of_counter("graph_skipped_something_new"),
            Some(EVERY_QUESTION.to_vec())
        );
    }

    #[test]
    fn a_cell_says_not_judged_and_keeps_what_the_partial_data_showed() {
        let list = vec![NotMeasured {
            questions: vec![Question::Topk],
            why: "counted dropped_rows.topk = 3".to_owned(),
        }];
        assert_eq!(cell(&list, Question::Hidden, "none"), "none");
        assert_eq!(
            cell(&list, Question::Topk, "none"),
            "not judged: counted dropped_rows.topk = 3"
        );
        assert_eq!(
            cell(&list, Question::Topk, "layer 2"),
            "not judged: counted dropped_rows.topk = 3; the partial data shows layer 2"
        );
    }
}
