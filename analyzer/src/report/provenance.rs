//! NaN provenance as report lines, shared by the terminal and Markdown
//! reports: a label and its text each.

use crate::metrics::nan_provenance::{Provenance, ranges};

/// Captures with unexplained or not-known tokens listed in full.
pub(crate) const CAPTURE_LINES: usize = 3;

/// The lines of `p`, in order: produced, operand, spread, not explained,
/// masked-operand leaks, not known.
pub(crate) fn lines(p: &Provenance) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let d = &p.produced;
    out.push((
        "NaN produced",
        format!(
            "step {}, layer {}, {}, {} ({})",
            d.step,
            d.layer,
            d.site,
            tokens_text(&d.tokens),
            d.inputs_not_known.as_ref().map_or_else(
                || "its inputs finite".to_owned(),
                |why| format!("inputs not known: {why}")
            )
        ),
    ));
    if let Some(op) = &p.operand {
        out.push((
            "NaN operand",
            format!(
                "KV slot {} at layer {} ({} failed), {}",
                op.slot,
                d.layer,
                op.check,
                match (op.reserved, op.token) {
                    (true, _) => "reserved for padding rows: no token reads it causally".to_owned(),
                    (false, Some(t)) => format!("the key of token {t}"),
                    (false, None) =>
                        "its token not known: the trace does not map slots to tokens".to_owned(),
                }
            ),
        ));
    }
    let sum = |f: fn(&crate::metrics::nan_provenance::SiteSpread) -> usize| -> usize {
        p.spread.iter().map(f).sum()
    };
    let explained = sum(|s| s.explained.len());
    let follow = sum(|s| s.follow_unexplained.len());
    let last = p
        .spread
        .iter()
        .rev()
        .find(|s| !s.explained.is_empty())
        .map_or_else(String::new, |s| {
            if s.step == d.step {
                format!(", up to layer {} {}", s.layer, s.site)
            } else {
                format!(", up to step {}, layer {} {}", s.step, s.layer, s.site)
            }
        });
    let captures = p.spread.iter().filter(|s| !s.explained.is_empty()).count();
    let explains = if explained == 0 {
        "explains no later non-finite value".to_owned()
    } else {
        format!(
            "explains {explained} later non-finite token value{} at {captures} capture{}{last}",
            if explained == 1 { "" } else { "s" },
            if captures == 1 { "" } else { "s" },
        )
    };
    out.push((
        "NaN spread",
        format!("{explains}; {follow} follow values it does not explain"),
    ));
    let mut listed = 0;
    let mut more = 0;
    for s in &p.spread {
        for (label, tokens) in [
            ("not explained", &s.unexplained),
            ("NaN not known", &s.not_known),
        ] {
            if tokens.is_empty() {
                continue;
            }
            if listed < CAPTURE_LINES {
                listed += 1;
                let why = if label == "NaN not known" {
                    ": the trace does not record what they read"
                } else {
                    ""
                };
                out.push((
                    label,
                    format!(
                        "step {}, layer {}, {}, {}{why}",
                        s.step,
                        s.layer,
                        s.site,
                        tokens_text(tokens)
                    ),
                ));
            } else {
                more += 1;
            }
        }
    }
    if more > 0 {
        out.push((
            "not explained",
            format!("and {more} more captures with unexplained or not-known tokens"),
        ));
    }
    for leak in p.leaks.iter().take(CAPTURE_LINES) {
        out.push((
            "masked-operand leak",
            format!(
                "step {}, layer {}, {}, {} share {}",
                leak.step,
                leak.layer,
                leak.site,
                tokens_text(&leak.tokens),
                leak.shares
            ),
        ));
    }
    if p.leaks.len() > CAPTURE_LINES {
        out.push((
            "masked-operand leak",
            format!("and {} more", p.leaks.len() - CAPTURE_LINES),
        ));
    }
    for why in &p.not_known {
        out.push(("NaN not known", why.clone()));
    }
    out
}

/// `token 3` or `tokens 0-19, 25`.
fn tokens_text(tokens: &[i32]) -> String {
    format!(
        "token{} {}",
        if tokens.len() == 1 { "" } else { "s" },
        ranges(tokens)
    )
}
