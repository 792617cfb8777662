//! Aligned text tables for a terminal, fitted to its width: the analyzer's
//! tables (`shadowtrace analyze`) and the tracer's (`shadowtrace suspects`,
//! the demo) print through [`table`], so that both leave out columns, and
//! say which, the same way. Here because both crates depend on this one and
//! the analyzer on nothing that needs libtorch.

use std::fmt::Write;

/// The widest a table is printed without `--wide`: the columns of a common
/// terminal. Wider tables leave out their least needed columns, and say
/// which ([`table`]).
pub const TABLE_COLUMNS: usize = 100;

/// How wide a table may be, and which of its columns it may leave out to
/// get there (headers equal to, or ending with, these words, in order).
#[derive(Debug, Clone, Copy)]
pub struct Fit<'a> {
    columns: Option<usize>,
    drops: &'a [&'a str],
}

impl<'a> Fit<'a> {
    /// Every column, whatever the width (`--wide`, or a table with nothing
    /// it can leave out).
    #[must_use]
    pub fn none() -> Fit<'static> {
        Fit {
            columns: None,
            drops: &[],
        }
    }

    /// At most `columns` wide (`None`: every column), leaving out `drops`
    /// in order until it fits.
    #[must_use]
    pub fn to(columns: Option<usize>, drops: &'a [&'a str]) -> Fit<'a> {
        Fit { columns, drops }
    }
}

/// The width [`table`] prints the columns `keep` at, its two-space indent
/// included.
fn printed_width(widths: &[usize], keep: &[usize]) -> usize {
    2 + keep.iter().map(|&i| widths[i]).sum::<usize>() + 2 * keep.len().saturating_sub(1)
}

/// Writes `header` and `rows` to `out` as aligned columns, indented two
/// spaces: text left, numbers (and `-`) right. Wider than `fit`'s columns,
/// it leaves out the droppable columns in order until it fits (or none is
/// left to drop), and says which in a line after it.
pub fn table(out: &mut String, header: &[String], rows: &[Vec<String>], fit: Fit<'_>) {
    let widths = column_widths(header, rows);
    let mut keep: Vec<usize> = (0..header.len()).collect();
    let mut dropped = Vec::new();
    if let Some(columns) = fit.columns {
        for word in fit.drops {
            if printed_width(&widths, &keep) <= columns {
                break;
            }
            if let Some(at) = keep
                .iter()
                .position(|&i| header[i] == *word || header[i].ends_with(word))
            {
                dropped.push(header[keep.remove(at)].clone());
            }
        }
    }
    let pick = |cells: &[String]| -> Vec<String> {
        keep.iter()
            .map(|&i| cells.get(i).cloned().unwrap_or_default())
            .collect()
    };
    let header: Vec<String> = pick(header);
    let rows: Vec<Vec<String>> = rows.iter().map(|r| pick(r)).collect();
    aligned(out, &header, &rows);
    if !dropped.is_empty() {
        let note = format!(
            "(left out to fit {} columns: {}; --wide shows every column)",
            fit.columns.unwrap_or_default(),
            dropped.join(", ")
        );
        out.push_str(&wrap(&note, fit.columns, "  "));
    }
}

/// `text` as lines of at most `columns` characters (`None`: one line), each
/// after `indent`, the lines after the first two spaces deeper, broken at
/// spaces (a word longer than a line stays whole). Ends with a newline.
#[must_use]
pub fn wrap(text: &str, columns: Option<usize>, indent: &str) -> String {
    let Some(columns) = columns else {
        return format!("{indent}{text}\n");
    };
    let mut out = String::new();
    let mut line = String::from(indent);
    let mut at_start = true;
    for word in text.split(' ') {
        let room = line.chars().count() + 1 + word.chars().count() <= columns;
        if !at_start && !room {
            let _ = writeln!(out, "{}", line.trim_end());
            line = format!("{indent}  ");
            at_start = true;
        }
        if !at_start {
            line.push(' ');
        }
        line.push_str(word);
        at_start = false;
    }
    let _ = writeln!(out, "{}", line.trim_end());
    out
}

fn column_widths(header: &[String], rows: &[Vec<String>]) -> Vec<usize> {
    (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
                .max(header[i].chars().count())
        })
        .collect()
}

fn aligned(out: &mut String, header: &[String], rows: &[Vec<String>]) {
    let widths = column_widths(header, rows);
    let numeric = |i: usize| {
        rows.iter().all(|r| {
            r.get(i)
                .is_none_or(|c| c == "-" || c.parse::<f64>().is_ok())
        })
    };
    let line = |cells: &[String]| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if numeric(i) {
                    format!("{c:>w$}", w = widths[i])
                } else {
                    format!("{c:<w$}", w = widths[i])
                }
            })
            .collect();
        parts.join("  ").trim_end().to_owned()
    };
    let _ = writeln!(out, "  {}", line(header));
    for row in rows {
        let _ = writeln!(out, "  {}", line(row));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(cells: &[&str]) -> Vec<String> {
        cells.iter().map(|c| (*c).to_owned()).collect()
    }

    /// This test table's columns it may leave out, in order: its own, not
    /// the analyzer's list (the analyzer's tables are pinned by its snapshots).
    const DROPPABLE: [&str; 6] = [
        "shadow-only NaN",
        "cos min",
        "J p5",
        "dense",
        "unit",
        "NaN tok",
    ];

    /// A header shaped like a layer table's, with cells as wide as their
    /// headers but a long marks cell: 124 columns printed, 107 without `shadow-only NaN`.
    fn wide_table() -> (Vec<String>, Vec<Vec<String>>) {
        let header = strings(&[
            "layer",
            "J",
            "J no churn",
            "J p5",
            "rows",
            "dense",
            "unit",
            "layer_out p95",
            "cos min",
            "NaN tok",
            "shadow-only NaN",
            "marks",
        ]);
        let mut row: Vec<String> = header.iter().map(|h| "x".repeat(h.len())).collect();
        row[11] = "topk@L3 hidden@L3 NaN@L3".to_owned();
        (header, vec![row])
    }

    fn longest(text: &str) -> usize {
        text.lines().map(|l| l.chars().count()).max().unwrap_or(0)
    }

    #[test]
    fn a_table_wider_than_its_fit_leaves_out_droppable_columns_in_order_and_names_them() {
        let (header, rows) = wide_table();
        let mut every = String::new();
        table(&mut every, &header, &rows, Fit::none());
        assert!(longest(&every) > TABLE_COLUMNS, "{every}");
        let mut narrow = String::new();
        table(
            &mut narrow,
            &header,
            &rows,
            Fit::to(Some(TABLE_COLUMNS), &DROPPABLE),
        );
        let mut lines = narrow.lines();
        let head = lines.next().unwrap();
        assert!(head.chars().count() <= TABLE_COLUMNS, "{narrow}");
        // The first two droppable columns go, in order, and no more than needed.
        assert!(
            !head.contains("shadow-only NaN") && !head.contains("cos min"),
            "{head}"
        );
        assert!(
            head.contains("J p5") && head.contains("layer_out p95"),
            "{head}"
        );
        assert_eq!(
            narrow.lines().last().unwrap(),
            "  (left out to fit 100 columns: shadow-only NaN, cos min; --wide shows every column)"
        );
    }

    #[test]
    fn a_table_that_fits_or_has_nothing_to_drop_is_printed_whole_without_a_note() {
        let (header, rows) = wide_table();
        let mut unfit = String::new();
        table(
            &mut unfit,
            &header,
            &rows,
            Fit::to(Some(TABLE_COLUMNS), &[]),
        );
        assert_eq!(unfit.lines().count(), 2, "{unfit}");
        let mut roomy = String::new();
        table(&mut roomy, &header, &rows, Fit::to(Some(400), &DROPPABLE));
        let mut every = String::new();
        table(&mut every, &header, &rows, Fit::none());
        assert_eq!(roomy, every);
    }

    #[test]
    fn a_header_ending_with_a_drop_word_is_dropped_as_that_word() {
        let header = strings(&["model", "worst attn_out p95", "verdicts"]);
        let rows = vec![strings(&[
            "m".repeat(60).as_str(),
            "1e-3",
            "v".repeat(40).as_str(),
        ])];
        let mut out = String::new();
        table(
            &mut out,
            &header,
            &rows,
            Fit::to(Some(TABLE_COLUMNS), &["NaN runs", " p95"]),
        );
        assert!(
            out.contains("left out to fit 100 columns: worst attn_out p95;"),
            "{out}"
        );
    }

    #[test]
    fn a_long_line_wraps_at_spaces_under_a_deeper_indent_and_a_short_one_is_kept() {
        let text = "top-k divergence: first layer whose mean Jaccard falls below 0.8";
        assert_eq!(
            wrap(text, Some(30), "  "),
            "  top-k divergence: first\n    layer whose mean Jaccard\n    falls below 0.8\n"
        );
        assert_eq!(wrap(text, None, "  "), format!("  {text}\n"));
        assert_eq!(wrap("short", Some(30), "  "), "  short\n");
        let long = "a ".to_owned() + &"x".repeat(40);
        assert_eq!(
            wrap(&long, Some(30), ""),
            format!("a\n  {}\n", "x".repeat(40))
        );
        for line in wrap(text, Some(30), "  ").lines() {
            assert!(line.chars().count() <= 30, "{line}");
        }
    }

    #[test]
    fn numbers_align_right_and_text_left() {
        let header = strings(&["name", "J"]);
        let rows = vec![strings(&["a", "0.5"]), strings(&["bcd", "-"])];
        let mut out = String::new();
        table(&mut out, &header, &rows, Fit::none());
        assert_eq!(out, "  name    J\n  a     0.5\n  bcd     -\n");
    }
}
