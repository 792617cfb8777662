//! `shadowtrace inspect`: one run's identity, tables, row counts and status,
//! as a person reads it.

use std::fmt::Write;

use shadowtrace_schemas::Table;
use shadowtrace_schemas::manifest::Status;

use crate::load::Run;

/// Renders a run for the terminal.
#[must_use]
pub fn render_run(run: &Run) -> String {
    let m = &run.manifest;
    let id = &m.identity;
    let mut out = String::new();
    let mut line = |label: &str, value: String| {
        let _ = writeln!(out, "{label:<11}{value}");
    };
    line("run", format!("{}  ({})", id.run_id, run.dir.display()));
    let status = match (m.status, m.closed_unix_ms) {
        (Status::Complete, Some(closed)) => {
            format!(
                "complete, closed {} after {}",
                utc(closed),
                duration(closed.saturating_sub(m.started_unix_ms))
            )
        }
        (Status::Complete, None) => "complete".to_owned(),
        // Closed by its producer, which lost rows it never sent (counters say which).
        (Status::Incomplete, Some(closed)) => format!(
            "INCOMPLETE (closed {} with rows its producer lost: see counters)",
            utc(closed)
        ),
        (Status::Incomplete, None) => format!(
            "INCOMPLETE (opened {}, never closed)",
            utc(m.started_unix_ms)
        ),
    };
    line("status", status);
    line(
        "format",
        format!(
            "v{}, written by {} {}",
            m.schema_version, m.tool.name, m.tool.version
        ),
    );
    line(
        "model",
        format!(
            "{} ({}), {} layers, index_topk {}, config sha256 {}",
            id.model.name,
            id.model.architecture,
            id.model.num_layers,
            id.model
                .index_topk
                .map_or_else(|| "-".to_owned(), |k| k.to_string()),
            short(&id.model.config_hash),
        ) + &id
            .model
            .revision
            .as_ref()
            .map(|r| format!(", revision {r}"))
            .unwrap_or_default(),
    );
    let engine_extras: Vec<String> = [
        id.engine
            .commit
            .as_ref()
            .map(|c| format!("commit {}", short(c))),
        id.engine.variant.as_ref().map(|v| format!("variant {v}")),
    ]
    .into_iter()
    .flatten()
    .collect();
    line(
        "engine",
        join_nonempty(
            &format!("{} {}", id.engine.name, id.engine.version),
            &engine_extras,
        ),
    );
    line(
        "device",
        if id.device.name == id.device.kind {
            id.device.kind.clone()
        } else {
            format!("{} ({})", id.device.name, id.device.kind)
        },
    );
    let mut dtypes = vec![
        format!("prod {}", id.dtypes.prod),
        format!("shadow {}", id.dtypes.shadow.as_deref().unwrap_or("-")),
    ];
    dtypes.extend(id.dtypes.other.iter().map(|(k, v)| format!("{k} {v}")));
    line("dtypes", dtypes.join(", "));
    let p = id.parallelism;
    line(
        "parallel",
        format!(
            "tp {}, pp {}, dp {}, ep {}, rank {} of {}",
            p.tp, p.pp, p.dp, p.ep, p.rank, p.world_size
        ),
    );
    line(
        "shadow",
        match &id.shadow.precision {
            Some(precision) => format!("{precision}, modes {}", id.shadow.modes.join(" + ")),
            None => "none".to_owned(),
        },
    );
    line(
        "prompt",
        format!(
            "{}, {} tokens, token sha256 {}{}",
            id.prompt.kind.as_deref().unwrap_or("-"),
            id.prompt.length,
            short(&id.prompt.token_hash),
            id.prompt
                .salt_id
                .as_ref()
                .map(|s| format!(" (salt {s})"))
                .unwrap_or_default(),
        ),
    );
    let tags: Vec<String> = id.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
    line(
        "tags",
        if tags.is_empty() {
            "-".to_owned()
        } else {
            tags.join(" ")
        },
    );
    if !id.settings.is_empty() {
        let settings: Vec<String> = id
            .settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        line("settings", settings.join(" "));
    }
    line(
        "injections",
        if id.injections.is_empty() {
            "none".to_owned()
        } else {
            format!("{}", id.injections.len())
        },
    );
    for injection in &id.injections {
        line("", format!("- {injection}"));
    }
    line(
        "deviations",
        if id.deviations.is_empty() {
            "none".to_owned()
        } else {
            format!("{}", id.deviations.len())
        },
    );
    for d in &id.deviations {
        let field = |k: &str| d.get(k).map(crate::verdict::convention_value);
        line(
            "",
            format!(
                "- {} (layers {}): {}",
                field("name").unwrap_or_default(),
                field("layers").unwrap_or_else(|| "all".to_owned()),
                field("effect").unwrap_or_else(|| "effect not recorded".to_owned())
            ),
        );
    }
    line(
        "convention",
        if id.conventions.is_empty() {
            "none recorded".to_owned()
        } else {
            format!("{} recorded (engine | model)", id.conventions.len())
        },
    );
    for c in &id.conventions {
        line(
            "",
            format!(
                "- {}{}: {} | {}",
                c.name,
                match (c.engine_assumed, c.mismatch()) {
                    (true, _) => " ASSUMED",
                    (false, true) => " MISMATCH",
                    (false, false) => "",
                },
                crate::verdict::convention_value(&c.engine),
                crate::verdict::convention_value(&c.model),
            ),
        );
    }

    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<8} {:<11} {:>10} {:>10} {:>6} {:>10}",
        "table", "status", "rows", "dropped", "files", "on disk"
    );
    for table in Table::ALL {
        let entry = m.table(table);
        let status = entry.map_or("absent", |e| e.status.as_str());
        let dropped = entry.map_or(0, |e| e.dropped_rows);
        let files = run.files.get(&table).map_or(0, Vec::len);
        let _ = writeln!(
            out,
            "{:<8} {:<11} {:>10} {:>10} {:>6} {:>10}",
            table.name(),
            status,
            run.rows(table),
            dropped,
            files,
            bytes(run.bytes(table)),
        );
    }
    let _ = writeln!(out);
    let counters: Vec<String> = m.counters.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(
        out,
        "{:<11}{}",
        "counters",
        if counters.is_empty() {
            "-".to_owned()
        } else {
            counters.join(" ")
        }
    );
    let (alarm, lines) = crate::capture_check::Recorded::of(m).report_lines();
    let label = if alarm { "CAPTURE" } else { "capture" };
    for (i, line) in lines.iter().enumerate() {
        let _ = writeln!(out, "{:<11}{line}", if i == 0 { label } else { "" });
    }
    // What the verdicts of `analyze` will not judge, from the manifest alone
    // (the summary check's disagreements are PROBLEMS below).
    let conventions = crate::analysis::recorded_conventions(m);
    let unmeasured =
        crate::judged::not_measured(m, &conventions, &crate::judged::run_counters(m), None);
    if unmeasured.is_empty() {
        let _ = writeln!(out, "{:<11}nothing", "unmeasured");
    }
    for (i, n) in unmeasured.iter().enumerate() {
        let questions: Vec<&str> = n.questions.iter().map(|q| q.name()).collect();
        let _ = writeln!(
            out,
            "{:<11}- {} (leaves not judged: {})",
            if i == 0 { "UNMEASURED" } else { "" },
            n.why,
            questions.join(", ")
        );
    }
    if run.notes.is_empty() {
        let _ = writeln!(out, "{:<11}none", "notes");
    } else {
        for (i, note) in run.notes.iter().enumerate() {
            let _ = writeln!(out, "{:<11}- {note}", if i == 0 { "notes" } else { "" });
        }
    }
    for (i, problem) in run.problems.iter().enumerate() {
        let _ = writeln!(
            out,
            "{:<11}- {problem}",
            if i == 0 { "PROBLEMS" } else { "" }
        );
    }
    out
}

fn join_nonempty(head: &str, rest: &[String]) -> String {
    if rest.is_empty() {
        head.to_owned()
    } else {
        format!("{head}, {}", rest.join(", "))
    }
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// Bytes in binary units, three significant figures.
#[must_use]
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {}", UNITS[unit])
}

fn duration(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

/// Unix milliseconds as an ISO 8601 UTC time, to the second.
#[must_use]
pub fn utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, mo, d) = civil_from_days(days);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant's
/// `civil_from_days`, restricted to dates after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        // 2000-02-29 is a leap day; 951782400 s after the epoch.
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_000_000_999), "2026-11-30T00:53:20Z");
    }

    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.00 KiB");
        assert_eq!(bytes(1536 * 1024), "1.50 MiB");
        assert_eq!(bytes(300 << 30), "300 GiB");
    }
}
