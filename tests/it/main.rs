//! Cross-component tests: runs written by the tracer, read by the analyzer.

// Test helpers, not only #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod analyze_verdicts;
mod bad_input;
mod bisection;
mod cache_pairs;
mod capture_self_check;
mod ci_verdicts;
mod deviations;
mod encodings;
mod export_lists;
mod fuzzed_inputs;
mod fuzzed_parts;
mod grafts;
mod indexer_nonfinite;
mod inspect_output;
mod killed_writer;
mod nan_provenance;
mod outcomes;
mod queue_modes;
mod ranks;
mod report_output;
mod roundtrip;
mod summary_check;
mod support;
mod v1_and_v2;
