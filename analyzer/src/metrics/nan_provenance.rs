//! NaN provenance.
//!
//! ## What it measures
//! For the non-finite onset: where the value was **produced**, which later
//! non-finite values it **spread** to, which it does not explain, and
//! whether an unexplained set shares a masked or reserved read (a
//! **masked-operand leak**).
//!
//! ## Definition
//! Captures are (step, layer, site) in execution order (`seq`). A token is
//! non-finite at a capture when its `hidden` row counts a prod NaN or ±Inf,
//! or an `events` row names it as the first non-finite token there.
//! - **produced**: the first capture holding a non-finite value, with its
//!   tokens. Its inputs are checked: `layer_in` reads the previous
//!   `layer_out`; `indexer` and `attn_out` read `layer_in`; `mlp_out` reads
//!   `layer_in` and `attn_out`; `layer_out` all three. An input that was not
//!   captured leaves "produced" not known. Since the producer writes an
//!   `events` row for any non-finite value in the whole tensor, a captured
//!   input without one was finite.
//! - **operand**: a failed KV sentinel at the produced step and layer: the
//!   reserved slot 0 (`kv_slot0_finite`), or the first non-finite slot
//!   (`kv_slots_finite`), which is a token position only for the reference
//!   engine (`engine.name = shadowtrace-reference`).
//! - **spread**: in the produced step, the source's tokens are followed
//!   forward. `mlp_out`, `layer_out` and `layer_in` keep a token's own
//!   stream; attention (`attn_out`) lets query q read key t when t <= q and
//!   the indexer selected t: a dense row (visible <= k) selects every
//!   visible key; a sparse row's full list (`prod_gaps`) says it, else
//!   `prod_only_gaps` (selected) and `shadow_only_gaps` (not selected) do,
//!   else more tainted visible keys than unselected ones (visible −
//!   prod_selected) force one into the selection. The indexer's score of q
//!   reads every visible key. A non-finite value at q is **explained** when
//!   q's stream was tainted or q read a tainted key; **not explained** when
//!   every read is known to be masked; **not known** otherwise.
//! - **masked-operand leak**: the unexplained tokens of one attention that
//!   share a masked read: the reserved slot, through unused top-k entries
//!   (prod_selected < k), or tainted keys hidden from all of them.
//!
//! The trace marks no padding rows, so whether a token is one is always
//! printed as not known ([`PADDING_NOT_KNOWN`]).
//!
//! ## Why it matters
//! A NaN the layer made and a NaN it merely received need different fixes;
//! a NaN that reached tokens which could not see it came through a mask.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::metrics::nan_reads::{Read, Selections};
use crate::metrics::nan_trace::{Capture, Captures, KvOperand};

/// Where the onset was produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Produced {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Site.
    pub site: String,
    /// Non-finite tokens there.
    pub tokens: Vec<i32>,
    /// Why "its inputs were finite" is not known; `None`: checked.
    pub inputs_not_known: Option<String>,
}

/// The non-finite tokens of one later capture, by what explains them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SiteSpread {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Site.
    pub site: String,
    /// Tokens the source explains.
    pub explained: Vec<i32>,
    /// Tokens that follow from an earlier value the source does not explain
    /// (one not explained, or one whose reads were not known).
    pub follow_unexplained: Vec<i32>,
    /// Tokens nothing recorded explains.
    pub unexplained: Vec<i32>,
    /// Tokens whose reads the trace does not tell.
    pub not_known: Vec<i32>,
}

/// Unexplained tokens of one attention that share a masked read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leak {
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Site.
    pub site: String,
    /// The tokens.
    pub tokens: Vec<i32>,
    /// What they share.
    pub shares: String,
}

/// NaN provenance of a run's onset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Provenance {
    /// Where it was produced.
    pub produced: Produced,
    /// A non-finite KV operand at the produced layer, as the sentinel names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operand: Option<KvOperand>,
    /// Later captures holding non-finite values, and what explains them.
    pub spread: Vec<SiteSpread>,
    /// Masked-operand leaks.
    pub leaks: Vec<Leak>,
    /// What the trace could not tell.
    pub not_known: Vec<String>,
}

/// Said with every provenance: no token is told to be a padding row.
pub const PADDING_NOT_KNOWN: &str =
    "padding rows: the trace format marks no padding rows, so no token here is told to be one";

/// Which tainted set a token's value comes from.
#[derive(Default)]
struct Taint {
    source: BTreeSet<i32>,
    other: BTreeSet<i32>,
    unknown: BTreeSet<i32>,
}

/// Follows the first non-finite capture of `captures` through
/// `selections`; `None` when no capture holds a non-finite value.
#[must_use]
pub fn provenance(captures: &Captures, selections: &Selections) -> Option<Provenance> {
    let (first, source) = captures.first_nonfinite()?;
    let mut not_known: Vec<String> = captures.notes().to_vec();
    not_known.extend(selections.notes().iter().cloned());
    let operand = captures.kv_operand(source.step, source.layer);
    let produced = Produced {
        step: source.step,
        layer: source.layer,
        site: source.site.clone(),
        tokens: source.bad.iter().copied().collect(),
        inputs_not_known: captures.inputs_not_known(source),
    };
    let mut taint = Taint::default();
    let mut spread = Vec::new();
    let mut leaks = Vec::new();
    for capture in captures.all()[first..]
        .iter()
        .filter(|c| c.step == source.step)
    {
        let is_source = std::ptr::eq(capture, source);
        let op = captures.kv_operand(capture.step, capture.layer);
        let mut row = SiteSpread {
            step: capture.step,
            layer: capture.layer,
            site: capture.site.clone(),
            explained: Vec::new(),
            follow_unexplained: Vec::new(),
            unexplained: Vec::new(),
            not_known: Vec::new(),
        };
        let mut masked: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for &q in &capture.bad {
            if is_source && !(capture.site == "attn_out" && op.is_some()) {
                row.explained.push(q);
                continue;
            }
            match classify(capture, q, &taint, op.as_ref(), is_source, selections) {
                Class::Explained => row.explained.push(q),
                Class::Follows => row.follow_unexplained.push(q),
                Class::NotKnown => row.not_known.push(q),
                Class::Unexplained(None) => row.unexplained.push(q),
                Class::Unexplained(Some(shares)) => {
                    row.unexplained.push(q);
                    masked.entry(shares).or_default().push(q);
                }
            }
        }
        leaks.extend(masked.into_iter().map(|(shares, tokens)| Leak {
            step: capture.step,
            layer: capture.layer,
            site: capture.site.clone(),
            tokens,
            shares,
        }));
        if capture.site != "indexer" {
            taint.source.extend(&row.explained);
            taint.other.extend(&row.follow_unexplained);
            taint.other.extend(&row.unexplained);
            taint.unknown.extend(&row.not_known);
        }
        // The source's own row only where an operand splits it.
        if !is_source || (capture.site == "attn_out" && op.is_some()) {
            spread.push(row);
        }
    }
    not_known.push(PADDING_NOT_KNOWN.to_owned());
    if let Some(later) = captures.later_steps(source.step) {
        not_known.push(later);
    }
    Some(Provenance {
        produced,
        operand,
        spread,
        leaks,
        not_known,
    })
}

enum Class {
    Explained,
    Follows,
    NotKnown,
    /// With what the token shares through a mask, where known.
    Unexplained(Option<String>),
}

fn classify(
    capture: &Capture,
    q: i32,
    taint: &Taint,
    op: Option<&KvOperand>,
    is_source: bool,
    selections: &Selections,
) -> Class {
    if taint.source.contains(&q) {
        return Class::Explained;
    }
    if taint.other.contains(&q) {
        return Class::Follows;
    }
    if taint.unknown.contains(&q) {
        return Class::Follows;
    }
    let reads = |keys: &BTreeSet<i32>| match capture.site.as_str() {
        "attn_out" => selections.reads(capture.step, capture.layer, q, keys),
        // The indexer scores every visible key.
        "indexer" if keys.iter().any(|&t| t <= q) => Read::Yes,
        _ => Read::No,
    };
    let on_source = reads(&taint.source);
    if on_source == Read::Yes {
        return Class::Explained;
    }
    let on_other = reads(&taint.other);
    if on_other == Read::Yes {
        return Class::Follows;
    }
    let on_unknown = reads(&taint.unknown);
    if on_unknown == Read::Yes {
        return Class::Follows;
    }
    // The non-finite KV operand the sentinel found at this layer.
    let mut op_read = Read::No;
    if capture.site == "attn_out"
        && let Some(op) = op
    {
        match (op.reserved, op.token) {
            (true, _) => match selections.unused_entries(capture.step, capture.layer, q) {
                Some(true) => {
                    return Class::Unexplained(Some(format!(
                        "the reserved KV slot {} ({} failed), read through unused top-k entries \
                         (prod_selected < k)",
                        op.slot, op.check
                    )));
                }
                Some(false) => {}
                None => op_read = Read::Unknown,
            },
            (false, Some(t)) => {
                let key = BTreeSet::from([t]);
                op_read = selections.reads(capture.step, capture.layer, q, &key);
                if op_read == Read::Yes {
                    return if is_source {
                        Class::Explained
                    } else {
                        Class::Unexplained(None)
                    };
                }
                if op_read == Read::No {
                    return Class::Unexplained(Some(format!(
                        "key {t} (KV slot {}, {} failed), masked for them",
                        op.slot, op.check
                    )));
                }
            }
            (false, None) => op_read = Read::Unknown,
        }
    }
    if [on_source, on_other, on_unknown, op_read].contains(&Read::Unknown) {
        return Class::NotKnown;
    }
    // Every tainted key is masked for q: in attention, they share the mask.
    let masked: BTreeSet<i32> = taint.source.union(&taint.other).copied().collect();
    if capture.site == "attn_out" && !masked.is_empty() {
        return Class::Unexplained(Some(format!(
            "non-finite key{} {}, masked for them",
            if masked.len() == 1 { "" } else { "s" },
            ranges(&masked.into_iter().collect::<Vec<_>>())
        )));
    }
    Class::Unexplained(None)
}

/// Tokens as ranges: `0-19, 25, 30-31`.
#[must_use]
pub fn ranges(tokens: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let mut j = i;
        while j + 1 < tokens.len() && tokens[j + 1] == tokens[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            tokens[i].to_string()
        } else {
            format!("{}-{}", tokens[i], tokens[j])
        });
        i = j + 1;
    }
    if out.is_empty() {
        "none".to_owned()
    } else {
        out.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::ranges;

    #[test]
    fn ranges_join_runs_of_tokens() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(ranges(&[]), "none");
    }
}
