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
//! - **spread**: the source's tokens are followed forward, through the
//!   produced step and the run's later steps (a decode step reads the keys
//!   earlier steps cached). `mlp_out`, `layer_out` and `layer_in` keep a
//!   token's own stream; attention (`attn_out`) at layer l lets query q read
//!   key t when t <= q, the indexer selected t, and t's key at layer l is
//!   non-finite: its stream was tainted entering layer l (at its
//!   `layer_in`, or at any site of an earlier layer), since a layer's keys
//!   and values are computed from its input; a dense row (visible <= k) selects every
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

/// Which tainted set a token's value comes from: each token with the
/// first layer whose key and value it makes non-finite.
#[derive(Default)]
struct Taint {
    source: BTreeMap<i32, i32>,
    other: BTreeMap<i32, i32>,
    unknown: BTreeMap<i32, i32>,
}

/// Adds `tokens`, non-finite at `capture`, to `set`: a layer's keys and
/// values are computed from its input, so a token tainted at a layer's
/// `layer_in` taints that layer's keys, and at any later site the next
/// layer's.
fn add_taint(set: &mut BTreeMap<i32, i32>, tokens: &[i32], capture: &Capture) {
    let from = if capture.site == "layer_in" {
        capture.layer
    } else {
        capture.layer + 1
    };
    for &t in tokens {
        let kv = set.entry(t).or_insert(from);
        *kv = (*kv).min(from);
    }
}

/// The tokens of `set` whose key at `layer` is non-finite.
fn keys_at(set: &BTreeMap<i32, i32>, layer: i32) -> BTreeSet<i32> {
    set.iter()
        .filter(|&(_, &from)| from <= layer)
        .map(|(&t, _)| t)
        .collect()
}

/// The non-finite keys a capture's layer holds, per tainted set: made once
/// per capture, read for each of its tokens.
struct Keys {
    source: BTreeSet<i32>,
    other: BTreeSet<i32>,
    unknown: BTreeSet<i32>,
}

impl Keys {
    fn at(taint: &Taint, layer: i32) -> Keys {
        Keys {
            source: keys_at(&taint.source, layer),
            other: keys_at(&taint.other, layer),
            unknown: keys_at(&taint.unknown, layer),
        }
    }
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
    for capture in &captures.all()[first..] {
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
        let keys = Keys::at(&taint, capture.layer);
        for &q in &capture.bad {
            if is_source && !(capture.site == "attn_out" && op.is_some()) {
                row.explained.push(q);
                continue;
            }
            match classify(
                capture,
                q,
                &taint,
                &keys,
                op.as_ref(),
                is_source,
                selections,
            ) {
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
            add_taint(&mut taint.source, &row.explained, capture);
            add_taint(&mut taint.other, &row.follow_unexplained, capture);
            add_taint(&mut taint.other, &row.unexplained, capture);
            add_taint(&mut taint.unknown, &row.not_known, capture);
        }
        // The source's own row only where an operand splits it.
        if !is_source || (capture.site == "attn_out" && op.is_some()) {
            spread.push(row);
        }
    }
    not_known.push(PADDING_NOT_KNOWN.to_owned());
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
    keys: &Keys,
    op: Option<&KvOperand>,
    is_source: bool,
    selections: &Selections,
) -> Class {
    if taint.source.contains_key(&q) {
        return Class::Explained;
    }
    if taint.other.contains_key(&q) || taint.unknown.contains_key(&q) {
        return Class::Follows;
    }
    let reads = |keys: &BTreeSet<i32>| match capture.site.as_str() {
        "attn_out" => selections.reads(capture.step, capture.layer, q, keys),
        // The indexer scores every visible key.
        "indexer" if keys.iter().any(|&t| t <= q) => Read::Yes,
        _ => Read::No,
    };
    let on_source = reads(&keys.source);
    if on_source == Read::Yes {
        return Class::Explained;
    }
    let on_other = reads(&keys.other);
    if on_other == Read::Yes {
        return Class::Follows;
    }
    let on_unknown = reads(&keys.unknown);
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
    let masked: BTreeSet<i32> = keys.source.union(&keys.other).copied().collect();
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
    #![allow(clippy::unwrap_used)]

    use polars::prelude::{DataFrame, NamedFrom, Series};
    use shadowtrace_schemas::columns::{events as e, hidden as h};

    use super::{Captures, Selections, provenance, ranges};

    const SITES: [&str; 4] = ["layer_in", "attn_out", "mlp_out", "layer_out"];

    /// A dense model's run, 3 layers: step 0 holds tokens 0-4, each later
    /// step the next token; a row is non-finite where `bad` names it.
    fn run(steps: i32, bad: &[(i32, i32, &str, i32)]) -> Captures {
        let (mut seq, mut step, mut layer, mut site, mut token, mut nan) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut n = 0i64;
        for s in 0..steps {
            let tokens = if s == 0 { 0..5 } else { 4 + s..5 + s };
            for l in 0..3 {
                for name in SITES {
                    for t in tokens.clone() {
                        seq.push(n);
                        step.push(s);
                        layer.push(l);
                        site.push(name);
                        token.push(t);
                        nan.push(i64::from(bad.contains(&(s, l, name, t))));
                    }
                    n += 1;
                }
            }
        }
        let zeros = vec![0i64; seq.len()];
        let hidden = DataFrame::new(
            seq.len(),
            vec![
                Series::new(h::SEQ.into(), seq).into(),
                Series::new(h::STEP.into(), step).into(),
                Series::new(h::LAYER.into(), layer).into(),
                Series::new(h::SITE.into(), site).into(),
                Series::new(h::TOKEN.into(), token).into(),
                Series::new(h::PROD_NAN.into(), nan).into(),
                Series::new(h::PROD_POS_INF.into(), zeros.clone()).into(),
                Series::new(h::PROD_NEG_INF.into(), zeros).into(),
            ],
        )
        .unwrap();
        let none_i32: Vec<Option<i32>> = vec![];
        let none_str: Vec<Option<&str>> = vec![];
        let events = DataFrame::new(
            0,
            vec![
                Series::new(e::SEQ.into(), Vec::<i64>::new()).into(),
                Series::new(e::STEP.into(), Vec::<i32>::new()).into(),
                Series::new(e::LAYER.into(), Vec::<i32>::new()).into(),
                Series::new(e::SITE.into(), none_str.clone()).into(),
                Series::new(e::PATH.into(), none_str.clone()).into(),
                Series::new(e::KIND.into(), none_str.clone()).into(),
                Series::new(e::TOKEN.into(), none_i32).into(),
                Series::new(e::CHECK.into(), none_str).into(),
                Series::new(e::PASSED.into(), Vec::<Option<bool>>::new()).into(),
            ],
        )
        .unwrap();
        Captures::of(&hidden, &events, "transformers", 5).unwrap()
    }

    #[test]
    fn a_later_step_reads_a_tainted_key_only_from_the_layer_whose_input_was_tainted() {
        // Step 0: token 2's NaN made at layer 1's MLP; its stream carries it
        // on, and from layer 2 on every later token reads its key. Layer 1's
        // keys were computed from layer 1's input, which was finite.
        let mut bad = vec![
            (0, 1, "mlp_out", 2),
            (0, 1, "layer_out", 2),
            (0, 2, "layer_in", 2),
        ];
        for site in &SITES[1..] {
            bad.extend((2..5).map(|t| (0, 2, *site, t)));
        }
        // Step 1 (token 5) turns non-finite at layer 2's attention: it read
        // token 2's key there. Step 2 (token 6) at layer 1's, where no key is
        // non-finite: nothing recorded explains it.
        bad.extend(SITES[1..].iter().map(|&site| (1, 2, site, 5)));
        bad.extend(SITES[1..].iter().map(|&site| (2, 1, site, 6)));
        let p = provenance(&run(3, &bad), &Selections::dense()).unwrap();
        assert_eq!((p.produced.step, p.produced.layer), (0, 1));
        assert_eq!(p.produced.tokens, vec![2]);
        assert_eq!(p.produced.inputs_not_known, None);
        let at = |step: i32, layer: i32, site: &str| {
            p.spread
                .iter()
                .find(|s| (s.step, s.layer, s.site.as_str()) == (step, layer, site))
                .unwrap_or_else(|| panic!("no spread at {step} {layer} {site}: {p:#?}"))
        };
        assert_eq!(at(0, 2, "attn_out").explained, vec![2, 3, 4]);
        assert_eq!(at(1, 2, "attn_out").explained, vec![5]);
        assert_eq!(at(1, 2, "layer_out").explained, vec![5]);
        assert_eq!(at(2, 1, "attn_out").unexplained, vec![6]);
        assert!(at(2, 1, "attn_out").explained.is_empty());
        // Its own stream follows the value the source does not explain.
        assert_eq!(at(2, 1, "layer_out").follow_unexplained, vec![6]);
        assert!(
            p.not_known.iter().all(|n| !n.contains("step")),
            "every step followed: {:?}",
            p.not_known
        );
    }

    #[test]
    fn ranges_join_runs_of_tokens() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(ranges(&[]), "none");
    }
}
