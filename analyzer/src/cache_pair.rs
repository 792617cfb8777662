//! Prefix-cache pairs (context 004): a request served from a cache hit
//! against the same request computed from scratch.
//!
//! ## What it measures
//! Whether reusing cached state (KV entries, a linear-attention layer's
//! recurrent state) gives the first generated token what computing the whole
//! prompt gives, and if not, the first layer where the two part.
//!
//! ## Definition
//! Runs are paired by prompt: the same model, engine, production dtype and
//! token hash, one tagged `cache=hit` and one `cache=miss` (the producer tags
//! them; each hit is paired with the first miss in path order). Both are
//! read at the first generated position: step 0, token `prompt length − 1`.
//! - First token: argmax agreement and Jensen–Shannon divergence (bits) of
//!   the two production top-N there ([`crate::metrics::logits`]).
//! - Hidden states: the trace keeps statistics, not vectors, so the two runs
//!   are compared through one reference both measured: the free shadow, the
//!   shadow's own chain from the embeddings over the whole prompt, which is
//!   the same computation in both runs (a producer computes it from scratch
//!   for a hit). Per (layer, site), `gap = |e_hit − e_miss|` with `e` each
//!   run's relative L2 error to that chain; by the triangle inequality
//!   ‖h_hit − h_miss‖ / ‖s‖ ≥ gap, so a gap is a lower bound of how far the
//!   two part. A production vector non-finite in one run only parts them
//!   (gap +inf). They part at the first (layer, site) in execution order whose
//!   gap exceeds the hidden-state threshold (`--hidden-threshold`, printed).
//!
//! ## Why it matters
//! A cache hit must be invisible. Context 004: a hybrid Gated-DeltaNet model
//! returned a wrong first token on prefix-cache hits whose recompute tail was
//! one token; the prompt computed from scratch was right.
//!
//! ## References
//! `../shared/context/004`; DESIGN.md, shadow modes.

use std::collections::BTreeMap;

use polars::prelude::DataFrame;
use serde::Serialize;
use shadowtrace_schemas::columns::hidden as c;

use crate::AnalyzeError;
use crate::analysis::{RunAnalysis, identity_tag};
use crate::frame::{i32s, i64s, opt_f32s, opt_strs};
use crate::metrics::logits::{self, Agreement, TopN};
use crate::verdict::Thresholds;

/// The tag a producer puts on runs: `hit` or `miss`.
pub const CACHE_TAG: &str = "cache";

/// Hidden columns read at the first generated position.
pub const COLUMNS: [&str; 9] = [
    c::STEP,
    c::TOKEN,
    c::LAYER,
    c::SITE,
    c::SHADOW_MODE,
    c::PROD_NAN,
    c::PROD_POS_INF,
    c::PROD_NEG_INF,
    c::REL_L2_ERR,
];

/// One capture at the first generated position.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Capture {
    /// Relative L2 error to the free shadow, when recorded and finite.
    pub free_err: Option<f64>,
    /// The production vector held NaN or ±Inf.
    pub prod_nonfinite: bool,
}

/// What a run recorded at its first generated position.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FirstPosition {
    /// The position: prompt length − 1, at step 0.
    pub token: i32,
    /// Per (layer, site rank in execution order, site).
    pub hidden: BTreeMap<(i32, usize, String), Capture>,
    /// Production's top-N there.
    pub logits: TopN,
}

impl FirstPosition {
    /// The captures of a `hidden` frame ([`COLUMNS`]) and the production
    /// top-N at step 0, token `prompt_len − 1`.
    ///
    /// # Errors
    /// When a column is missing or of another type.
    pub fn of(frame: &DataFrame, prod: &TopN, prompt_len: u64) -> Result<Self, AnalyzeError> {
        let token = i32::try_from(prompt_len.saturating_sub(1)).unwrap_or(i32::MAX);
        let step = i32s(frame, c::STEP)?;
        let tokens = i32s(frame, c::TOKEN)?;
        let layer = i32s(frame, c::LAYER)?;
        let site = opt_strs(frame, c::SITE)?;
        let mode = opt_strs(frame, c::SHADOW_MODE)?;
        let counts = [
            i64s(frame, c::PROD_NAN)?,
            i64s(frame, c::PROD_POS_INF)?,
            i64s(frame, c::PROD_NEG_INF)?,
        ];
        let err = opt_f32s(frame, c::REL_L2_ERR)?;
        let vocabulary = shadowtrace_schemas::vocabulary();
        let mut hidden: BTreeMap<(i32, usize, String), Capture> = BTreeMap::new();
        for i in 0..frame.height() {
            if step[i] != 0 || tokens[i] != token {
                continue;
            }
            let name = site[i].clone().unwrap_or_default();
            let rank = vocabulary.site_rank(&name).unwrap_or(usize::MAX);
            let capture = hidden.entry((layer[i], rank, name)).or_default();
            capture.prod_nonfinite |= counts.iter().any(|col| col[i] > 0);
            if mode[i].as_deref() == Some("free") {
                capture.free_err = err[i].map(f64::from).filter(|e| e.is_finite());
            }
        }
        let logits = prod
            .get(&(0, token))
            .map(|top| BTreeMap::from([((0, token), top.clone())]))
            .unwrap_or_default();
        Ok(FirstPosition {
            token,
            hidden,
            logits,
        })
    }
}

/// One (layer, site) of a pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairSite {
    /// Layer.
    pub layer: i32,
    /// Site.
    pub site: String,
    /// The hit's relative L2 error to the free shadow.
    pub hit_err: Option<f64>,
    /// The miss's.
    pub miss_err: Option<f64>,
    /// `|hit_err − miss_err|`, +inf where one production vector is
    /// non-finite (JSON has no infinity: `null` there).
    pub gap: Option<f64>,
}

/// Where a pair parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Parting {
    /// Layer.
    pub layer: i32,
    /// Site.
    pub site: String,
    /// The gap there; +inf (JSON: `null`) where `nonfinite` says which
    /// run's production vector was non-finite.
    pub gap: f64,
    /// The threshold it exceeded.
    pub limit: f64,
    /// Production non-finite in the hit only (or in the miss only).
    pub nonfinite: Option<&'static str>,
}

/// A cache hit against a miss of the same prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CachePair {
    /// The hit run.
    pub hit: String,
    /// The miss run.
    pub miss: String,
    /// The first generated position (token, step 0).
    pub token: i32,
    /// First-token agreement (one position); `None` when either run has no
    /// logits there.
    pub first_token: Option<Agreement>,
    /// Best first token of the hit and of the miss.
    pub argmax: (Option<i32>, Option<i32>),
    /// Per (layer, site) in execution order.
    pub sites: Vec<PairSite>,
    /// The first (layer, site) where they part.
    pub parted: Option<Parting>,
    /// What could not be compared, and why.
    pub notes: Vec<String>,
}

/// Every pair of an analysis, and the hits without a miss.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CachePairs {
    /// Pairs.
    pub pairs: Vec<CachePair>,
    /// Hit runs with no miss of their prompt.
    pub unpaired: Vec<String>,
    /// The rule, with its threshold.
    pub rule: String,
}

impl CachePairs {
    /// Whether any pair parted or disagreed on its first token.
    #[must_use]
    pub fn any_parted(&self) -> bool {
        self.pairs.iter().any(CachePair::parted_or_flipped)
    }
}

impl CachePair {
    /// Whether the pair parted in hidden states or its first tokens differ.
    #[must_use]
    pub fn parted_or_flipped(&self) -> bool {
        self.parted.is_some()
            || self
                .first_token
                .as_ref()
                .and_then(|a| a.argmax_agreement)
                .is_some_and(|share| share < 1.0)
    }
}

/// The rule of the pair verdict.
#[must_use]
pub fn rule(t: &Thresholds) -> String {
    format!(
        "prefix-cache pairs part at the first layer and site where |err(hit) - err(miss)| > {} \
         at the first generated position (err: each run's relative L2 error to the free shadow, \
         the same from-scratch chain in both; a lower bound of their distance; not calibrated \
         by --baseline); a first token that differs is flagged",
        t.hidden_rel_err
    )
}

/// Pairs the hits among `runs` with misses of the same prompt; `None` when
/// no run is a hit.
#[must_use]
pub fn pairs(runs: &[RunAnalysis], t: &Thresholds) -> Option<CachePairs> {
    fn tag(r: &RunAnalysis) -> Option<&str> {
        r.tags.get(CACHE_TAG).map(String::as_str)
    }
    if !runs.iter().any(|r| tag(r) == Some("hit")) {
        return None;
    }
    let key = |r: &RunAnalysis| -> Vec<String> {
        ["model", "engine", "prod_dtype", "token_hash"]
            .iter()
            .map(|k| identity_tag(&r.tags, k).cloned().unwrap_or_default())
            .collect()
    };
    let mut out = CachePairs {
        pairs: Vec::new(),
        unpaired: Vec::new(),
        rule: rule(t),
    };
    for hit in runs.iter().filter(|r| tag(r) == Some("hit")) {
        let prompt_known = identity_tag(&hit.tags, "token_hash").is_some_and(|h| !h.is_empty());
        let miss = runs
            .iter()
            .find(|r| tag(r) == Some("miss") && prompt_known && key(r) == key(hit));
        match (miss, &hit.first_position, miss.and_then(|m| m.first_position.as_ref())) {
            (Some(miss), Some(h), Some(m)) => out.pairs.push(compare(hit, miss, h, m, t)),
            _ => out.unpaired.push(format!(
                "{}: no cache=miss run of its prompt (same model, engine, prod dtype and token hash){}",
                hit.run_id,
                if prompt_known {
                    ""
                } else {
                    "; its run has no token hash (serving engines give the hooks no token ids)"
                }
            )),
        }
    }
    Some(out)
}

fn compare(
    hit: &RunAnalysis,
    miss: &RunAnalysis,
    h: &FirstPosition,
    m: &FirstPosition,
    t: &Thresholds,
) -> CachePair {
    let mut notes = Vec::new();
    if h.token != m.token {
        notes.push(format!(
            "first generated positions differ: {} and {}",
            h.token, m.token
        ));
    }
    let mut sites = Vec::new();
    let mut parted = None;
    for (key, hc) in &h.hidden {
        let Some(mc) = m.hidden.get(key) else {
            continue;
        };
        let (layer, _, site) = key;
        let nonfinite = match (hc.prod_nonfinite, mc.prod_nonfinite) {
            (true, false) => Some("in the hit only"),
            (false, true) => Some("in the miss only"),
            _ => None,
        };
        let gap = if nonfinite.is_some() {
            Some(f64::INFINITY)
        } else if hc.prod_nonfinite {
            None
        } else {
            hc.free_err.zip(mc.free_err).map(|(a, b)| (a - b).abs())
        };
        if parted.is_none()
            && let Some(g) = gap.filter(|g| *g > t.hidden_rel_err)
        {
            parted = Some(Parting {
                layer: *layer,
                site: site.clone(),
                gap: g,
                limit: t.hidden_rel_err,
                nonfinite,
            });
        }
        sites.push(PairSite {
            layer: *layer,
            site: site.clone(),
            hit_err: hc.free_err,
            miss_err: mc.free_err,
            gap,
        });
    }
    if sites.is_empty() {
        notes.push(format!(
            "no hidden rows at token {} in both runs: hidden states not compared",
            h.token
        ));
    } else if sites.iter().all(|s| s.gap.is_none()) {
        notes.push(
            "no free-shadow error in both runs (trace with SHADOWTRACE_MODE=free or local,free): \
             hidden states not compared"
                .to_owned(),
        );
    }
    let first_token = logits::agreement(&h.logits, &m.logits);
    if first_token.is_none() {
        notes.push(format!(
            "no logits at token {} in both runs: first token not compared",
            h.token
        ));
    }
    let best = |top: &TopN| {
        top.values()
            .next()
            .and_then(|(ids, _)| ids.first().copied())
    };
    CachePair {
        hit: hit.run_id.clone(),
        miss: miss.run_id.clone(),
        token: h.token,
        first_token,
        argmax: (best(&h.logits), best(&m.logits)),
        sites,
        parted,
        notes,
    }
}
