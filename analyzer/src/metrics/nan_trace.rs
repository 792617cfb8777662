//! The captures NaN provenance follows ([`super::nan_provenance`]): each
//! (step, layer, site) of a run's `hidden` and `events` tables in execution
//! order, with its recorded and non-finite tokens, and the KV sentinels that
//! failed.

use std::collections::{BTreeMap, BTreeSet};

use polars::prelude::DataFrame;
use serde::Serialize;
use shadowtrace_schemas::columns::{events as e, hidden as h};

use crate::AnalyzeError;
use crate::frame::{i32s, i64s, opt_bools, opt_i32s, opt_strs};

/// The sentinel check of the slot engines reserve for padding rows.
pub const RESERVED_SLOT_CHECK: &str = "kv_slot0_finite";
/// The sentinel check of every written slot, naming the first non-finite.
pub const SLOTS_CHECK: &str = "kv_slots_finite";
/// The engine whose KV slot is the token position.
pub const REFERENCE_ENGINE: &str = "shadowtrace-reference";

/// One capture: a site of a layer in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    /// Capture sequence number (the smallest of its rows).
    pub seq: i64,
    /// Forward step.
    pub step: i32,
    /// Layer.
    pub layer: i32,
    /// Site.
    pub site: String,
    /// Tokens with a `hidden` row.
    pub recorded: BTreeSet<i32>,
    /// Tokens holding a prod NaN or ±Inf.
    pub bad: BTreeSet<i32>,
}

/// A non-finite KV cache operand, as a failed sentinel names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvOperand {
    /// The slot.
    pub slot: i32,
    /// The sentinel check that failed.
    pub check: String,
    /// Whether the slot is the one engines reserve for padding rows, which
    /// no token reads causally.
    pub reserved: bool,
    /// The token whose key the slot holds, where the trace knows it.
    pub token: Option<i32>,
}

/// Failed KV sentinels by (step, layer): each check's name and slot.
type FailedSentinels = BTreeMap<(i32, i32), Vec<(String, Option<i32>)>>;

/// A run's captures in execution order.
#[derive(Debug, Clone, Default)]
pub struct Captures {
    captures: Vec<Capture>,
    /// Failed KV sentinels by (step, layer): (check, slot).
    sentinels: FailedSentinels,
    slot_is_token: bool,
    notes: Vec<String>,
}

impl Captures {
    /// From a run's `hidden` and `events` frames (the non-finite onset's
    /// columns); `engine` names the producer's engine, `prompt_len` the
    /// prefill's tokens.
    ///
    /// # Errors
    /// When a column is missing or of another type.
    pub fn of(
        hidden: &DataFrame,
        events: &DataFrame,
        engine: &str,
        prompt_len: u64,
    ) -> Result<Captures, AnalyzeError> {
        let mut by_key: BTreeMap<(i32, i32, String), Capture> = BTreeMap::new();
        let (seq, step, layer, token) = (
            i64s(hidden, h::SEQ)?,
            i32s(hidden, h::STEP)?,
            i32s(hidden, h::LAYER)?,
            i32s(hidden, h::TOKEN)?,
        );
        let site = opt_strs(hidden, h::SITE)?;
        let counts = [
            i64s(hidden, h::PROD_NAN)?,
            i64s(hidden, h::PROD_POS_INF)?,
            i64s(hidden, h::PROD_NEG_INF)?,
        ];
        let mut rows: Vec<(i64, i32, i32, String, i32, bool)> = Vec::new();
        for i in 0..hidden.height() {
            let bad = counts.iter().any(|c| c[i] > 0);
            let s = site[i].clone().unwrap_or_default();
            rows.push((seq[i], step[i], layer[i], s, token[i], bad));
        }
        let mut notes = Vec::new();
        let mut unnamed = 0usize;
        let (eseq, estep, elayer) = (
            i64s(events, e::SEQ)?,
            i32s(events, e::STEP)?,
            i32s(events, e::LAYER)?,
        );
        let (esite, path, kind) = (
            opt_strs(events, e::SITE)?,
            opt_strs(events, e::PATH)?,
            opt_strs(events, e::KIND)?,
        );
        let (etoken, check, passed) = (
            opt_i32s(events, e::TOKEN)?,
            opt_strs(events, e::CHECK)?,
            opt_bools(events, e::PASSED)?,
        );
        let mut sentinels = FailedSentinels::new();
        let mut event_rows: Vec<(i64, i32, i32, String, Option<i32>)> = Vec::new();
        for i in 0..events.height() {
            let kind_i = kind[i].as_deref().unwrap_or_default();
            if kind_i == "sentinel" {
                if passed[i] == Some(false) {
                    let check = check[i].clone().unwrap_or_default();
                    sentinels
                        .entry((estep[i], elayer[i]))
                        .or_default()
                        .push((check, etoken[i]));
                }
                continue;
            }
            let site_i = esite[i].clone().unwrap_or_default();
            if path[i].as_deref() != Some("prod")
                || !matches!(kind_i, "nan" | "pos_inf" | "neg_inf")
                || site_i == "logits"
            {
                continue;
            }
            unnamed += usize::from(etoken[i].is_none());
            event_rows.push((eseq[i], estep[i], elayer[i], site_i, etoken[i]));
        }
        for (seq, step, layer, site, token, bad) in rows {
            let c = entry(&mut by_key, seq, step, layer, &site);
            c.recorded.insert(token);
            if bad {
                c.bad.insert(token);
            }
        }
        for (seq, step, layer, site, token) in event_rows {
            let c = entry(&mut by_key, seq, step, layer, &site);
            c.bad.extend(token);
        }
        if unnamed > 0 {
            notes.push(format!(
                "{unnamed} non-finite events name no token: their tokens are not classified"
            ));
        }
        let mut captures: Vec<Capture> = by_key.into_values().collect();
        captures.sort_by_key(|c| c.seq);
        let sampled = captures
            .iter()
            .filter(|c| c.step == 0 && c.site != "indexer" && !c.recorded.is_empty())
            .any(|c| (c.recorded.len() as u64) < prompt_len);
        if sampled {
            notes.push(format!(
                "hidden rows sample the prompt's {prompt_len} tokens: a non-finite value at a token \
                 without a row is seen only as an events row's first token"
            ));
        }
        Ok(Captures {
            captures,
            sentinels,
            slot_is_token: engine == REFERENCE_ENGINE,
            notes,
        })
    }

    /// Every capture, in execution order.
    #[must_use]
    pub fn all(&self) -> &[Capture] {
        &self.captures
    }

    /// What the trace could not tell about its captures.
    #[must_use]
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The first capture holding a non-finite value, and its index.
    #[must_use]
    pub fn first_nonfinite(&self) -> Option<(usize, &Capture)> {
        self.captures
            .iter()
            .enumerate()
            .find(|(_, c)| !c.bad.is_empty())
    }

    fn captured(&self, step: i32, layer: i32, site: &str) -> bool {
        self.captures
            .iter()
            .any(|c| c.step == step && c.layer == layer && c.site == site)
    }

    /// Why the inputs of `capture` are not known to be finite; `None` when
    /// every input was captured (and, coming earlier, was finite).
    #[must_use]
    pub fn inputs_not_known(&self, capture: &Capture) -> Option<String> {
        let (step, layer) = (capture.step, capture.layer);
        let inputs: Vec<(i32, &str)> = match capture.site.as_str() {
            "layer_in" if layer == 0 => {
                return Some("its input, the embeddings, is not captured".to_owned());
            }
            "layer_in" => vec![(layer - 1, "layer_out")],
            "indexer" | "attn_out" => vec![(layer, "layer_in")],
            "mlp_out" => vec![(layer, "layer_in"), (layer, "attn_out")],
            "layer_out" => vec![(layer, "layer_in"), (layer, "attn_out"), (layer, "mlp_out")],
            other => return Some(format!("the inputs of site {other} are not known")),
        };
        let missing: Vec<String> = inputs
            .into_iter()
            .filter(|(l, s)| !self.captured(step, *l, s))
            .map(|(l, s)| format!("layer {l} {s}"))
            .collect();
        (!missing.is_empty()).then(|| format!("input not captured: {}", missing.join(", ")))
    }

    /// The non-finite KV operand a failed sentinel names at (step, layer):
    /// the reserved slot first, else the first non-finite slot.
    #[must_use]
    pub fn kv_operand(&self, step: i32, layer: i32) -> Option<KvOperand> {
        let failed = self.sentinels.get(&(step, layer))?;
        if failed.iter().any(|(c, _)| c == RESERVED_SLOT_CHECK) {
            return Some(KvOperand {
                slot: 0,
                check: RESERVED_SLOT_CHECK.to_owned(),
                reserved: true,
                token: None,
            });
        }
        let (check, slot) = failed
            .iter()
            .find(|(c, s)| c == SLOTS_CHECK && s.is_some())?;
        let slot = (*slot)?;
        Some(KvOperand {
            slot,
            check: check.clone(),
            reserved: false,
            token: self.slot_is_token.then_some(slot),
        })
    }
}

/// The capture of (step, layer, site), made on first sight; its `seq` is the
/// smallest of its rows'.
fn entry<'a>(
    by_key: &'a mut BTreeMap<(i32, i32, String), Capture>,
    seq: i64,
    step: i32,
    layer: i32,
    site: &str,
) -> &'a mut Capture {
    let c = by_key
        .entry((step, layer, site.to_owned()))
        .or_insert_with(|| Capture {
            seq,
            step,
            layer,
            site: site.to_owned(),
            recorded: BTreeSet::new(),
            bad: BTreeSet::new(),
        });
    c.seq = c.seq.min(seq);
    c
}
