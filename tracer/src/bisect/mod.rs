//! Precision bisection (issue 30): which layers' shadow value, grafted into
//! production at one site, restores production's output.
//!
//! The output is judged against the reference, the shadow's own chain from
//! the embeddings (a traced run's free shadow), by argmax agreement over the
//! compared token rows ([`output::compare`]). "Restored" is an explicit
//! threshold on that agreement: given, or the clean noise floor, production
//! with nothing planted (no fault, no deviation) less a slack.
//!
//! For each site the search runs over contiguous layer ranges: the whole
//! model first (no graft at that site restores: said so, and the site is
//! done); then the latest first layer whose range to the last layer still
//! restores; then the earliest last layer from there. Both are binary
//! searches, so a site costs at most `1 + 2 ceil(log2 L)` grafted forwards.
//! They assume that grafting more layers never undoes a restoration; the
//! range reported is always one whose own forward restored.

pub mod demo;
pub mod output;

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::model::graft::{Graft, GraftSite};
use crate::model::{Model, ModelError};
use crate::trace::TraceOptions;
pub use output::{Chains, OutputMetrics, compare};

/// The output measure a bisection judges by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Argmax agreement with the reference: the tokens greedy decoding
    /// would emit. Restored at or above the threshold.
    Argmax,
    /// Mean Jensen-Shannon divergence from the reference, in bits: the whole
    /// next-token distribution, so it sees a shift that flips no argmax.
    /// Restored at or below the threshold.
    Js,
}

impl Metric {
    /// Its value in `m`.
    #[must_use]
    pub fn of(self, m: &OutputMetrics) -> f64 {
        match self {
            Metric::Argmax => m.argmax_agreement,
            Metric::Js => m.js_bits,
        }
    }

    /// How reports name it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Metric::Argmax => "argmax agreement",
            Metric::Js => "JS divergence (bits)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Metric::Argmax => "argmax agreement",
            Metric::Js => "JS divergence",
        }
    }

    fn format(self, v: f64) -> String {
        match self {
            Metric::Argmax => format!("{v:.3}"),
            Metric::Js => format!("{v:.2e}"),
        }
    }
}

/// What "restored" means: the metric with the reference on the good side of
/// `threshold`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Target {
    /// The measure.
    pub metric: Metric,
    /// The least argmax agreement, or the largest JS divergence, that counts
    /// as restored.
    pub threshold: f64,
    /// The most rows with a non-finite logit that count as restored: the
    /// clean production's (0 where the threshold is given). A non-finite
    /// row is never noise, so no slack covers it.
    pub max_nonfinite_rows: i64,
    /// Where the threshold comes from.
    pub source: TargetSource,
}

/// Where a bisection's threshold comes from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TargetSource {
    /// Given by the user.
    Given,
    /// The clean noise floor: production with nothing planted, with a slack
    /// (argmax: that agreement less `slack`; JS: that divergence times
    /// `1 + slack`).
    Clean {
        /// The unplanted production's value of the metric.
        value: f64,
        /// The slack.
        slack: f64,
    },
}

impl Target {
    /// The clean noise floor of `metric`: `clean`'s value, less `slack`
    /// (argmax agreement) or times `1 + slack` (JS divergence).
    #[must_use]
    pub fn clean(metric: Metric, clean: &OutputMetrics, slack: f64) -> Target {
        let value = metric.of(clean);
        let threshold = match metric {
            Metric::Argmax => value - slack,
            Metric::Js => value * (1.0 + slack),
        };
        Target {
            metric,
            threshold,
            max_nonfinite_rows: clean.nonfinite_rows,
            source: TargetSource::Clean { value, slack },
        }
    }

    /// A threshold given by the user.
    #[must_use]
    pub fn given(metric: Metric, threshold: f64) -> Target {
        Target {
            metric,
            threshold,
            max_nonfinite_rows: 0,
            source: TargetSource::Given,
        }
    }

    /// Whether `m` is restored.
    #[must_use]
    pub fn restored(&self, m: &OutputMetrics) -> bool {
        let v = self.metric.of(m);
        let met = match self.metric {
            Metric::Argmax => v >= self.threshold,
            Metric::Js => v <= self.threshold,
        };
        met && m.nonfinite_rows <= self.max_nonfinite_rows
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.metric;
        let side = if m == Metric::Argmax { ">=" } else { "<=" };
        write!(
            f,
            "restored = {} with the reference {side} {}",
            m.name(),
            m.format(self.threshold)
        )?;
        write!(
            f,
            " and at most {} non-finite rows",
            self.max_nonfinite_rows
        )?;
        match self.source {
            TargetSource::Given => write!(f, " (given)"),
            TargetSource::Clean { value, slack } => match m {
                Metric::Argmax => write!(
                    f,
                    " (production with nothing planted: {}, less a slack of {slack:.3})",
                    m.format(value)
                ),
                Metric::Js => write!(
                    f,
                    " (production with nothing planted: {}, times 1 + a slack of {slack:.3})",
                    m.format(value)
                ),
            },
        }
    }
}

/// One grafted forward of the search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    /// The graft, as `--graft` spells it.
    pub graft: String,
    /// Production's output with it.
    pub metrics: OutputMetrics,
    /// Whether that meets the target.
    pub restored: bool,
}

/// What the search found at one site.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SiteBisection {
    /// The site.
    pub site: &'static str,
    /// The smallest restoring layer range found; `None`: grafting the site
    /// at every layer does not restore.
    pub layers: Option<(i64, i64)>,
    /// The output with that range grafted, or with every layer grafted
    /// where none restores.
    pub after: OutputMetrics,
    /// Every grafted forward, in order.
    pub steps: Vec<Step>,
}

impl SiteBisection {
    fn len(&self) -> Option<i64> {
        self.layers.map(|(a, b)| b - a + 1)
    }
}

/// A whole bisection.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bisection {
    /// The shadow's precision, as grafted (`fp32`, `bf16`).
    pub shadow: &'static str,
    /// The target.
    pub target: Target,
    /// Production's output ungrafted.
    pub before: OutputMetrics,
    /// Per site searched, in the order given.
    pub sites: Vec<SiteBisection>,
}

/// The sites in the order a bisection names them: the narrowest first, so
/// a fault in the indexer's selection is named there and not at the
/// attention output or layer output it also reaches.
fn narrowness(site: &str) -> u8 {
    match site {
        "indexer" => 0,
        "attn_out" | "mlp_out" => 1,
        _ => 2,
    }
}

impl Bisection {
    /// Whether production already meets the target ungrafted: nothing to
    /// restore, and no site was searched.
    #[must_use]
    pub fn already_restored(&self) -> bool {
        self.target.restored(&self.before)
    }

    /// The answer: the site and layers of the smallest restoring graft
    /// (ties to the narrowest site).
    #[must_use]
    pub fn named(&self) -> Option<&SiteBisection> {
        self.sites
            .iter()
            .filter(|s| s.layers.is_some())
            .min_by_key(|s| (s.len(), narrowness(s.site)))
    }

    /// The answer in one line.
    #[must_use]
    pub fn summary(&self) -> String {
        let m = self.target.metric;
        let before = m.format(m.of(&self.before));
        let threshold = m.format(self.target.threshold);
        if self.already_restored() {
            return format!(
                "production already meets the target ungrafted ({} {before}, target {threshold}): \
                 nothing to bisect",
                m.short()
            );
        }
        let none: Vec<&str> = self
            .sites
            .iter()
            .filter(|s| s.layers.is_none())
            .map(|s| s.site)
            .collect();
        let none = match none.as_slice() {
            [] => String::new(),
            [one] => format!("; no {one} graft does"),
            [rest @ .., last] => format!("; no {} or {last} graft does", rest.join(", ")),
        };
        let Some(named) = self.named() else {
            return format!(
                "no graft of the {} {} restores {} {before} to {threshold}",
                self.shadow,
                self.sites
                    .iter()
                    .map(|s| s.site)
                    .collect::<Vec<_>>()
                    .join(", "),
                m.short()
            );
        };
        let wider: Vec<String> = self
            .sites
            .iter()
            .filter(|s| s.layers.is_some() && s.site != named.site)
            .map(|s| format!("{} at {}", s.site, layers_text(s.layers)))
            .collect();
        let wider = if wider.is_empty() {
            String::new()
        } else {
            format!("; also {}", wider.join(", "))
        };
        format!(
            "grafting the {} {} at {} restores {} {before} -> {}{wider}{none}",
            self.shadow,
            named.site,
            layers_text(named.layers),
            m.short(),
            m.format(m.of(&named.after)),
        )
    }
}

fn layers_text(layers: Option<(i64, i64)>) -> String {
    match layers {
        Some((a, b)) if a == b => format!("layer {a}"),
        Some((a, b)) => format!("layers {a}-{b}"),
        None => "no layer".to_owned(),
    }
}

/// The most grafted forwards a bisection over `layers` layers and `sites`
/// sites runs.
#[must_use]
pub fn max_forwards(layers: i64, sites: usize) -> u64 {
    let log = 64 - (layers.max(1) as u64 - 1).leading_zeros();
    sites as u64 * (1 + 2 * u64::from(log))
}

/// Searches each of `sites` for the smallest restoring layer range.
/// `on_step` sees every grafted forward as it finishes.
///
/// # Errors
/// A weight that cannot be loaded.
pub fn bisect(
    setup: &Setup<'_>,
    target: Target,
    sites: &[GraftSite],
    mut on_step: impl FnMut(&Step),
) -> Result<Bisection, ModelError> {
    let chains = &setup.chains;
    let layers = chains.layers();
    let mut bisection = Bisection {
        shadow: if chains.shadow_kind() == tch::Kind::BFloat16 {
            "bf16"
        } else {
            "fp32"
        },
        target,
        before: setup.before,
        sites: Vec::new(),
    };
    if bisection.already_restored() {
        return Ok(bisection);
    }
    for &site in sites {
        let mut seen: BTreeMap<(i64, i64), OutputMetrics> = BTreeMap::new();
        let mut steps = Vec::new();
        let mut eval = |a: i64, b: i64| -> Result<bool, ModelError> {
            if let Some(m) = seen.get(&(a, b)) {
                return Ok(target.restored(m));
            }
            let graft = Graft {
                site,
                layers: Some((a, b)),
            };
            let metrics = compare(&chains.grafted(&[graft])?, &setup.reference);
            let step = Step {
                graft: graft.to_string(),
                metrics,
                restored: target.restored(&metrics),
            };
            on_step(&step);
            steps.push(step);
            seen.insert((a, b), metrics);
            Ok(target.restored(&metrics))
        };
        let last = layers - 1;
        let found = if eval(0, last)? {
            // The latest first layer: ok(a, last) holds, b is past it or fails.
            let (mut a, mut b) = (0, layers);
            while b - a > 1 {
                let m = (a + b) / 2;
                if eval(m, last)? { a = m } else { b = m }
            }
            // The earliest last layer: ok(a, d) holds, c is before it or fails.
            let (mut c, mut d) = (a - 1, last);
            while d - c > 1 {
                let m = (c + d) / 2;
                if eval(a, m)? { d = m } else { c = m }
            }
            Some((a, d))
        } else {
            None
        };
        let after = seen[&found.unwrap_or((0, last))];
        bisection.sites.push(SiteBisection {
            site: site.name(),
            layers: found,
            after,
            steps,
        });
    }
    Ok(bisection)
}

/// Every step's inputs for a bisection: the chains, production's output
/// ungrafted, the reference's logits, and the clean noise floor's.
#[derive(Debug)]
pub struct Setup<'a> {
    /// Production's chains.
    pub chains: Chains<'a>,
    /// The reference's logits.
    pub reference: tch::Tensor,
    /// Production ungrafted against the reference.
    pub before: OutputMetrics,
    /// Production with nothing planted against the reference; `None` where
    /// nothing is planted (it is production itself) or it was not asked for.
    pub clean: Option<OutputMetrics>,
}

impl<'a> Setup<'a> {
    /// Runs the reference, production and (where anything is planted and
    /// `clean_floor` asks for it) the unplanted production once each.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn new(
        model: &'a Model,
        ids: &[i64],
        opts: &'a TraceOptions,
        clean_floor: bool,
    ) -> Result<Self, ModelError> {
        Self::sharing(model, ids, opts, clean_floor, &mut Unplanted::default())
    }

    /// As [`Setup::new`], taking the reference and the unplanted production
    /// from `unplanted` where an earlier setup over the same model, prompt
    /// and settings ran them, and leaving them there otherwise.
    ///
    /// # Errors
    /// A weight that cannot be loaded.
    pub fn sharing<'m: 'a>(
        model: &'m Model,
        ids: &[i64],
        opts: &'a TraceOptions,
        clean_floor: bool,
        unplanted: &mut Unplanted<'m>,
    ) -> Result<Self, ModelError> {
        let chains = Chains::new(model, ids, opts)?;
        unplanted.made_for(model, ids, opts);
        let reference = match &unplanted.reference {
            Some(r) => r.shallow_clone(),
            None => {
                let r = chains.reference(ids)?;
                unplanted.reference = Some(r.shallow_clone());
                r
            }
        };
        let before = compare(&chains.before, &reference);
        let planted = !opts.faults.is_empty() || !opts.deviations.is_empty();
        let clean = if planted && clean_floor {
            let logits = match &unplanted.clean {
                Some(c) => c.shallow_clone(),
                None => {
                    let c = chains.unplanted(ids)?;
                    unplanted.clean = Some(c.shallow_clone());
                    c
                }
            };
            Some(compare(&logits, &reference))
        } else {
            None
        };
        Ok(Setup {
            chains,
            reference,
            before,
            clean,
        })
    }
}

/// The two chains nothing planted changes: the reference's logits and
/// production's with no fault and no deviation, a full forward each. A
/// sweep that bisects several plantings of one prompt (the demo's faults, a
/// table of deviations) runs them once through [`Setup::sharing`]; a setup
/// whose model, prompt or settings differ runs them again.
#[derive(Debug, Default)]
pub struct Unplanted<'m> {
    made_for: Option<(&'m Model, UnplantedInputs)>,
    reference: Option<tch::Tensor>,
    clean: Option<tch::Tensor>,
}

/// What the unplanted chains read besides the model: the prompt, the
/// compared rows, the shadow's precision, production's numerics and FP8
/// indexer (faults and deviations are what they leave out).
#[derive(Debug, PartialEq)]
struct UnplantedInputs {
    ids: Vec<i64>,
    tokens: serde_json::Value,
    precision: tch::Kind,
    prod: crate::model::Numerics,
    fp8_indexer: Option<crate::indexer::Fp8Indexer>,
}

impl<'m> Unplanted<'m> {
    /// Forgets the chains when they were run for another model, prompt or
    /// settings.
    fn made_for(&mut self, model: &'m Model, ids: &[i64], opts: &TraceOptions) {
        let inputs = UnplantedInputs {
            ids: ids.to_vec(),
            tokens: opts.tokens_setting.clone(),
            precision: opts.precision,
            prod: opts.prod,
            fp8_indexer: opts.fp8_indexer,
        };
        let same = self
            .made_for
            .as_ref()
            .is_some_and(|(m, i)| std::ptr::eq(*m, model) && *i == inputs);
        if !same {
            *self = Unplanted {
                made_for: Some((model, inputs)),
                reference: None,
                clean: None,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(agreement: f64) -> OutputMetrics {
        OutputMetrics {
            argmax_agreement: agreement,
            js_bits: 0.0,
            nonfinite_rows: 0,
            rows: 100,
        }
    }

    fn site(name: &'static str, layers: Option<(i64, i64)>, after: f64) -> SiteBisection {
        SiteBisection {
            site: name,
            layers,
            after: metrics(after),
            steps: Vec::new(),
        }
    }

    fn bisection(sites: Vec<SiteBisection>) -> Bisection {
        Bisection {
            shadow: "fp32",
            target: Target::clean(Metric::Argmax, &metrics(0.99), 0.01),
            before: metrics(0.43),
            sites,
        }
    }

    #[test]
    fn the_answer_is_the_smallest_range_and_on_ties_the_narrowest_site() {
        let b = bisection(vec![
            site("indexer", Some((2, 2)), 0.99),
            site("attn_out", Some((2, 2)), 0.985),
            site("mlp_out", None, 0.5),
            site("layer_out", Some((2, 2)), 0.99),
        ]);
        assert_eq!(b.named().unwrap().site, "indexer");
        assert_eq!(
            b.summary(),
            "grafting the fp32 indexer at layer 2 restores argmax agreement 0.430 -> 0.990; \
             also attn_out at layer 2, layer_out at layer 2; no mlp_out graft does"
        );
        let b = bisection(vec![
            site("indexer", Some((20, 23)), 0.99),
            site("layer_out", Some((21, 21)), 0.99),
            site("attn_out", None, 0.5),
            site("mlp_out", None, 0.5),
        ]);
        assert_eq!(b.named().unwrap().site, "layer_out");
        assert!(b.summary().ends_with("no attn_out or mlp_out graft does"));
    }

    #[test]
    fn no_restoring_graft_and_nothing_to_restore_are_said_as_such() {
        let b = bisection(vec![site("indexer", None, 0.5), site("mlp_out", None, 0.6)]);
        assert_eq!(
            b.summary(),
            "no graft of the fp32 indexer, mlp_out restores argmax agreement 0.430 to 0.980"
        );
        let mut b = bisection(Vec::new());
        b.before = metrics(0.985);
        assert_eq!(
            b.summary(),
            "production already meets the target ungrafted (argmax agreement 0.985, target \
             0.980): nothing to bisect"
        );
        assert_eq!(
            b.target.to_string(),
            "restored = argmax agreement with the reference >= 0.980 and at most 0 non-finite \
             rows (production with nothing planted: 0.990, less a slack of 0.010)"
        );
    }

    #[test]
    fn a_divergence_target_is_met_at_or_below_its_threshold_and_says_so() {
        let mut clean = metrics(0.99);
        clean.js_bits = 2e-4;
        let target = Target::clean(Metric::Js, &clean, 0.5);
        assert!((target.threshold - 3e-4).abs() < 1e-15);
        let (mut ok, mut bad) = (metrics(0.5), metrics(0.99));
        ok.js_bits = 3e-4;
        bad.js_bits = 3.01e-4;
        assert!(target.restored(&ok) && !target.restored(&bad));
        assert_eq!(
            target.to_string(),
            "restored = JS divergence (bits) with the reference <= 3.00e-4 and at most 0 \
             non-finite rows (production with nothing planted: 2.00e-4, times 1 + a slack of \
             0.500)"
        );
        let given = Target::given(Metric::Argmax, 0.9);
        assert!(given.restored(&metrics(0.9)) && !given.restored(&metrics(0.89)));
        // One non-finite row is never within a floor, whatever the agreement.
        let mut one_nan = metrics(0.99);
        one_nan.nonfinite_rows = 1;
        assert!(!given.restored(&one_nan));
        assert!(
            given
                .to_string()
                .ends_with(">= 0.900 and at most 0 non-finite rows (given)")
        );
    }

    #[test]
    fn the_forward_budget_is_logarithmic_in_the_layer_count() {
        assert_eq!(max_forwards(1, 1), 1);
        assert_eq!(max_forwards(3, 4), 4 * 5);
        assert_eq!(max_forwards(78, 1), 1 + 2 * 7);
        assert_eq!(max_forwards(64, 2), 2 * (1 + 2 * 6));
    }
}
