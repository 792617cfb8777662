//! The demo's bisection section: its planted faults bisected one by one and
//! together, and per model whether grafting the fp32 indexer heals the
//! output of the clean production path.

use std::fmt::Write as _;

use crate::bisect::{Bisection, Metric, OutputMetrics, Setup, Target, Unplanted, bisect, compare};
use crate::model::fault::Fault;
use crate::model::graft::{Graft, GraftSite};
use crate::model::{Model, ModelError};
use crate::trace::TraceOptions;

/// One bisection of the demo: what was planted, and what bisect said.
#[derive(Debug)]
pub struct FaultBisection {
    /// The faults, as the report names them.
    pub planted: String,
    /// The bisection.
    pub bisection: Bisection,
}

/// Whether grafting the fp32 indexer heals one model's clean production.
#[derive(Debug)]
pub struct IndexerHeal {
    /// The model.
    pub model: String,
    /// Production ungrafted against the reference.
    pub before: OutputMetrics,
    /// With the fp32 indexer grafted at every layer.
    pub indexer: OutputMetrics,
    /// With every layer's output grafted: what grafting can reach at most.
    pub every_layer: OutputMetrics,
}

impl IndexerHeal {
    /// The answer in one line.
    #[must_use]
    pub fn line(&self) -> String {
        let (b, i, e) = (
            self.before.argmax_agreement,
            self.indexer.argmax_agreement,
            self.every_layer.argmax_agreement,
        );
        // How much of what grafting can recover the indexer recovers, by JS.
        let gap = self.before.js_bits - self.every_layer.js_bits;
        let recovered = self.before.js_bits - self.indexer.js_bits;
        let share = if gap > 0.0 && recovered > 0.0 {
            format!("{:.0}%", 100.0 * recovered / gap)
        } else {
            "none".to_owned()
        };
        format!(
            "{}: grafting the fp32 indexer at every layer moves argmax agreement {b:.3} -> {i:.3} \
             and JS divergence {:.2e} -> {:.2e} bits ({share} of what grafting every layer's \
             output recovers: -> {e:.3}, {:.2e})",
            self.model, self.before.js_bits, self.indexer.js_bits, self.every_layer.js_bits
        )
    }
}

/// Bisects each of `faults` alone and all together on `model`, argmax
/// against the clean floor less `slack`; `on_forward` sees every forward.
/// The reference and the clean floor, the same for every set, are run once
/// (and kept in `unplanted`).
///
/// # Errors
/// A weight that cannot be loaded.
pub fn bisect_faults<'m>(
    model: &'m Model,
    ids: &[i64],
    base: &TraceOptions,
    faults: &[(String, Fault)],
    slack: f64,
    unplanted: &mut Unplanted<'m>,
    mut on_forward: impl FnMut(&str),
) -> Result<Vec<FaultBisection>, ModelError> {
    let mut sets: Vec<(String, Vec<Fault>)> = faults
        .iter()
        .map(|(name, f)| (name.clone(), vec![f.clone()]))
        .collect();
    if faults.len() > 1 {
        let names: Vec<&str> = faults.iter().map(|(n, _)| n.as_str()).collect();
        sets.push((
            format!("both: {}", names.join(" and ")),
            faults.iter().map(|(_, f)| f.clone()).collect(),
        ));
    }
    let mut out = Vec::new();
    for (planted, set) in sets {
        let mut opts = base.clone();
        opts.faults = set;
        let setup = Setup::sharing(model, ids, &opts, true, unplanted)?;
        on_forward(&planted);
        let clean = setup.clean.unwrap_or(setup.before);
        let target = Target::clean(Metric::Argmax, &clean, slack);
        let bisection = bisect(&setup, target, &GraftSite::ALL, |s| on_forward(&s.graft))?;
        out.push(FaultBisection { planted, bisection });
    }
    Ok(out)
}

/// Grafts the fp32 indexer, then every layer's output, at every layer of
/// `model`'s clean production; its reference from `unplanted` where the
/// faults' bisection ran it on the same model and prompt.
///
/// # Errors
/// A weight that cannot be loaded.
pub fn indexer_heal<'m>(
    name: &str,
    model: &'m Model,
    ids: &[i64],
    opts: &TraceOptions,
    unplanted: &mut Unplanted<'m>,
) -> Result<IndexerHeal, ModelError> {
    let setup = Setup::sharing(model, ids, opts, false, unplanted)?;
    let every = |site| {
        setup
            .chains
            .grafted(&[Graft { site, layers: None }])
            .map(|l| compare(&l, &setup.reference))
    };
    Ok(IndexerHeal {
        model: name.to_owned(),
        before: setup.before,
        indexer: every(GraftSite::Indexer)?,
        every_layer: every(GraftSite::LayerOut)?,
    })
}

/// The section as markdown.
#[must_use]
pub fn render_markdown(prompt: &str, faults: &[FaultBisection], heals: &[IndexerHeal]) -> String {
    let mut md = String::from("## Bisection (trained weights)\n\n");
    let _ = writeln!(
        md,
        "`shadowtrace bisect` on {prompt}: which layers' fp32 value, grafted into production at \
         one site, restores its output.\n"
    );
    for f in faults {
        let _ = writeln!(md, "- {}: {}", f.planted, f.bisection.summary());
    }
    if let Some(f) = faults.first() {
        let _ = writeln!(md, "\nTarget: {}.", f.bisection.target);
    }
    md.push_str("\nDoes grafting the fp32 indexer heal the clean production path?\n\n");
    for h in heals {
        let _ = writeln!(md, "- {}", h.line());
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(argmax: f64, js: f64) -> OutputMetrics {
        OutputMetrics {
            argmax_agreement: argmax,
            js_bits: js,
            nonfinite_rows: 0,
            rows: 1024,
        }
    }

    #[test]
    fn the_indexer_line_gives_its_share_of_what_grafting_every_layer_recovers() {
        let h = IndexerHeal {
            model: "glm".to_owned(),
            before: m(0.98, 6e-4),
            indexer: m(0.981, 5e-4),
            every_layer: m(1.0, 2e-4),
        };
        assert_eq!(
            h.line(),
            "glm: grafting the fp32 indexer at every layer moves argmax agreement 0.980 -> 0.981 \
             and JS divergence 6.00e-4 -> 5.00e-4 bits (25% of what grafting every layer's \
             output recovers: -> 1.000, 2.00e-4)"
        );
    }
}
