//! Cross-component tests: runs written by the tracer, read by the analyzer.

// Test helpers, not only #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bad_input;
mod encodings;
mod inspect_output;
mod killed_writer;
mod queue_modes;
mod roundtrip;
mod support;
