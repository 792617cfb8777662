//! The tracer's command lines as a user meets them: flags that conflict are
//! refused in one line, each error says its cause once, and every program
//! exits 2 with `error:` on bad input.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The repository's trained checkpoints (models/README.md).
fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// One of the tracer's programs, with no SHADOWTRACE_* variable of the
/// caller's environment and no terminal, as CI runs it.
fn program(exe: &str) -> Command {
    let mut command = Command::new(exe);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("SHADOWTRACE") {
            command.env_remove(name);
        }
    }
    command
        .env("COLUMNS", "100")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn run(command: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().unwrap();
    (
        status.code().unwrap_or(-1),
        String::from_utf8(stdout).unwrap(),
        String::from_utf8(stderr).unwrap(),
    )
}

fn prompt(dir: &Path) -> PathBuf {
    let path = dir.join("p.json");
    std::fs::write(&path, "[1, 2, 3, 4, 5, 6, 7, 8]").unwrap();
    path
}

#[test]
fn run_refuses_path_in_a_traced_pass_instead_of_ignoring_it() {
    let tmp = tempfile::tempdir().unwrap();
    let p = prompt(tmp.path());
    let out = tmp.path().join("runs");
    let (code, _, stderr) = run(program(env!("CARGO_BIN_EXE_shadowtrace-run"))
        .arg("--model")
        .arg(models().join("glm5-tiny"))
        .arg(&p)
        .args(["--path", "fp32", "--out"])
        .arg(&out));
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(
            "error: --path fp32 sets an untraced pass's numerics, and --out makes this pass traced"
        ),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing was traced");
    // SHADOWTRACE=1 traces as --out does.
    let (code, _, stderr) = run(program(env!("CARGO_BIN_EXE_shadowtrace-run"))
        .arg("--model")
        .arg(models().join("glm5-tiny"))
        .arg(&p)
        .args(["--path", "bf16"])
        .env("SHADOWTRACE", "1")
        .env("SHADOWTRACE_DIR", &out));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("and SHADOWTRACE=1 makes this pass traced"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing was traced");
}

#[test]
fn a_missing_file_is_named_with_its_cause_said_once() {
    let tmp = tempfile::tempdir().unwrap();
    let p = prompt(tmp.path());
    let (code, _, stderr) = run(program(env!("CARGO_BIN_EXE_shadowtrace-bisect"))
        .args(["--model", "/nonexistent/model", "--threshold", "0.9"])
        .arg(&p));
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("/nonexistent/model/config.json"),
        "{stderr}"
    );
    let (code, _, stderr) = run(program(env!("CARGO_BIN_EXE_shadowtrace-bisect"))
        .arg("--model")
        .arg(models().join("glm5-tiny"))
        .args(["--threshold", "0.9"])
        .arg(tmp.path().join("nonexistent.txt")));
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("nonexistent.txt"), "{stderr}");
}

#[test]
fn demo_without_its_checkpoints_exits_2_with_error_as_every_tool_does() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, _, stderr) = run(program(env!("CARGO_BIN_EXE_shadowtrace-demo"))
        .arg("--out")
        .arg(tmp.path().join("out"))
        .arg("--models")
        .arg(tmp.path().join("none")));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.starts_with("error: no trained checkpoint at "),
        "{stderr}"
    );
}

/// `PROGRAM ARGS --help` at 100 columns: its exit status and text.
fn help(exe: &str, args: &[&str]) -> String {
    let (code, stdout, stderr) = run(program(exe).args(args).arg("--help"));
    assert_eq!(code, 0, "{stderr}");
    stdout
}

#[test]
fn every_help_wraps_to_the_terminal_width_and_spells_the_front_end_command() {
    for (exe, args, usage) in [
        (
            env!("CARGO_BIN_EXE_shadowtrace-run"),
            &[][..],
            "Usage: shadowtrace run ",
        ),
        (
            env!("CARGO_BIN_EXE_shadowtrace-bisect"),
            &[],
            "Usage: shadowtrace bisect ",
        ),
        (
            env!("CARGO_BIN_EXE_shadowtrace-suspects"),
            &[],
            "Usage: shadowtrace suspects ",
        ),
        (
            env!("CARGO_BIN_EXE_shadowtrace-suspects"),
            &["checkpoint"],
            "Usage: shadowtrace suspects checkpoint ",
        ),
        (
            env!("CARGO_BIN_EXE_shadowtrace-demo"),
            &[],
            "Usage: shadowtrace demo ",
        ),
    ] {
        let text = help(exe, args);
        let widest = text.lines().map(|l| l.chars().count()).max().unwrap_or(0);
        assert!(
            widest <= 100,
            "{exe} {args:?}: a line of {widest} columns\n{text}"
        );
        assert!(text.contains(usage), "{exe} {args:?}:\n{text}");
    }
}

#[test]
fn bisect_help_is_written_for_bisect_not_copied_from_run() {
    let text = help(env!("CARGO_BIN_EXE_shadowtrace-bisect"), &[]);
    for copied in ["traced pass", "(`run`:"] {
        assert!(!text.contains(copied), "{copied:?} in\n{text}");
    }
    insta::assert_snapshot!(text);
}

#[test]
fn the_fp8_indexer_defaults_differ_on_purpose_and_both_helps_say_so() {
    let run_help = help(env!("CARGO_BIN_EXE_shadowtrace-run"), &[]);
    let suspects_help = help(env!("CARGO_BIN_EXE_shadowtrace-suspects"), &[]);
    let flat = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat(&run_help).contains("`suspects` defaults to none instead, on purpose"),
        "{run_help}"
    );
    assert!(
        flat(&suspects_help).contains("none, unlike `run` and `bisect` (trtllm), on purpose"),
        "{suspects_help}"
    );
}

#[test]
fn suspects_names_the_churn_band_as_analyze_does_and_reads_the_old_name_with_a_warning() {
    let text = help(env!("CARGO_BIN_EXE_shadowtrace-suspects"), &[]);
    assert!(text.contains("--churn-band <BAND>"), "{text}");
    assert!(!text.contains("--band"), "the old name is hidden:\n{text}");
    insta::assert_snapshot!(text);
    let (code, _, stderr) = run(
        program(env!("CARGO_BIN_EXE_shadowtrace-suspects")).args(["--list", "--band", "0.001"])
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stderr,
        "warning: --band is renamed --churn-band, with the same meaning (relative to each row's \
         score scale); read as --churn-band 0.001\n"
    );
    let (code, _, stderr) = run(
        program(env!("CARGO_BIN_EXE_shadowtrace-suspects")).args(["--list", "--churn-band=-1"])
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.starts_with("error: --churn-band: expected a non-negative value"),
        "{stderr}"
    );
}
