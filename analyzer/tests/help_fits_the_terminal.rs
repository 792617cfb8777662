//! `shadowtrace`'s help as a user meets it in a terminal of 100 columns:
//! wrapped to it, and naming every command there is.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::process::{Command, Stdio};

/// `shadowtrace ARGS` as CI runs it: no terminal, 100 columns, nothing of
/// the caller's PATH (so no tracer program is found beside a stray one).
fn shadowtrace(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shadowtrace"))
        .args(args)
        .env("COLUMNS", "100")
        .env("PATH", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn every_help_wraps_to_the_terminal_width() {
    for command in [
        &[][..],
        &["schema"],
        &["inspect"],
        &["analyze"],
        &["env"],
        &["export"],
    ] {
        for flag in ["-h", "--help"] {
            let args: Vec<&str> = command.iter().copied().chain([flag]).collect();
            let (code, stdout, stderr) = shadowtrace(&args);
            assert_eq!(code, 0, "{args:?}: {stderr}");
            let widest = stdout.lines().map(|l| l.chars().count()).max().unwrap_or(0);
            assert!(
                widest <= 100,
                "shadowtrace {}: a line of {widest} columns\n{stdout}",
                args.join(" ")
            );
        }
    }
}

#[test]
fn the_top_level_help_is_pinned() {
    let (code, stdout, _) = shadowtrace(&["--help"]);
    assert_eq!(code, 0);
    insta::assert_snapshot!(stdout);
}

#[test]
fn an_unknown_command_lists_every_command_there_is() {
    let (code, _, stderr) = shadowtrace(&["nosuchcmd"]);
    assert_eq!(code, 2);
    assert!(
        stderr.starts_with("error: unknown command \"nosuchcmd\""),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "(commands: schema, inspect, analyze, env, export; the tracer's: demo, run, bisect, \
             suspects)"
        ),
        "{stderr}"
    );
}
