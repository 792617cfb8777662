//! Prefix-cache pairs as a table and notes, for the terminal and Markdown.

use super::sci;
use crate::cache_pair::CachePairs;

/// The pairs table: header, then one row per pair.
pub(crate) fn cache_table(c: &CachePairs) -> (Vec<String>, Vec<Vec<String>>) {
    let header = [
        "hit",
        "miss",
        "token",
        "parted at",
        "gap",
        "first token (hit, miss)",
        "JS (bits)",
    ]
    .map(str::to_owned)
    .to_vec();
    let id = |t: Option<i32>| t.map_or_else(|| "-".to_owned(), |t| t.to_string());
    let rows = c
        .pairs
        .iter()
        .map(|p| {
            let (parted, gap) = p.parted.as_ref().map_or_else(
                || ("-".to_owned(), "-".to_owned()),
                |w| {
                    let how = w
                        .nonfinite
                        .map_or_else(String::new, |n| format!(" (non-finite {n})"));
                    (
                        format!("layer {} {}{how}", w.layer, w.site),
                        format!("{:.3} > {}", w.gap, w.limit),
                    )
                },
            );
            let same = p.first_token.as_ref().and_then(|a| a.argmax_agreement);
            let first = match same {
                Some(share) if share >= 1.0 => format!("same ({})", id(p.argmax.0)),
                Some(_) => format!("DIFFER ({}, {})", id(p.argmax.0), id(p.argmax.1)),
                None => "-".to_owned(),
            };
            let js = p
                .first_token
                .as_ref()
                .and_then(|a| a.js_divergence.as_ref())
                .map(|s| s.max);
            vec![
                p.hit.clone(),
                p.miss.clone(),
                p.token.to_string(),
                parted,
                gap,
                first,
                sci(js),
            ]
        })
        .collect();
    (header, rows)
}

/// What a reader must know beside the table: each pair's notes and the
/// hits left unpaired.
pub(crate) fn cache_notes(c: &CachePairs) -> Vec<String> {
    let mut out: Vec<String> = c
        .pairs
        .iter()
        .flat_map(|p| {
            p.notes
                .iter()
                .map(move |n| format!("{} vs {}: {n}", p.hit, p.miss))
        })
        .collect();
    out.extend(c.unpaired.iter().map(|u| format!("unpaired hit {u}")));
    out
}
