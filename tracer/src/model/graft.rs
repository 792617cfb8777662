//! Grafts: production takes the shadow's value at one site of chosen layers
//! and goes on from there, to see whether the output heals (issue 30).
//!
//! - `indexer`: production attends over the shadow's top-k (its own
//!   selection and scores are what the trace records: what it would have
//!   chosen, as the HF hooks record it);
//! - `attn_out`, `mlp_out`, `layer_out`: production continues from the
//!   shadow's tensor, cast to production's activation kind.
//!
//! The shadow is the local one: the same layer in the shadow's precision on
//! production's own layer input, so a graft at layer L changes nothing before
//! L and hands production exactly the shadow's value at L. A graft changes
//! production's output on purpose: the run's manifest says so (`tags.graft`).
//!
//! Written `SITE[@LAYERS][,SITE[@LAYERS]...]`, LAYERS one layer `N` or an
//! inclusive range `N-M`; without `@`, every layer.

use std::fmt;

use shadowtrace_schemas::env::layer_range;

use super::layer::LayerOutput;

/// A site production can take from the shadow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum GraftSite {
    /// The indexer's top-k selection.
    Indexer,
    /// The attention block's output.
    AttnOut,
    /// The MLP or MoE block's output.
    MlpOut,
    /// The layer's output (the residual stream).
    LayerOut,
}

impl GraftSite {
    /// Every site, in the order reports list them.
    pub const ALL: [GraftSite; 4] = [
        GraftSite::Indexer,
        GraftSite::AttnOut,
        GraftSite::MlpOut,
        GraftSite::LayerOut,
    ];

    /// The site `name` stands for.
    #[must_use]
    pub fn named(name: &str) -> Option<GraftSite> {
        GraftSite::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Its name, as the trace's sites are named.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            GraftSite::Indexer => "indexer",
            GraftSite::AttnOut => "attn_out",
            GraftSite::MlpOut => "mlp_out",
            GraftSite::LayerOut => "layer_out",
        }
    }
}

/// One graft: a site at a range of layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Graft {
    /// Where production takes the shadow's value.
    pub site: GraftSite,
    /// Inclusive layer range; `None`: every layer.
    pub layers: Option<(i64, i64)>,
}

/// A graft written wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraftError {
    /// An unknown site.
    #[error("graft {got:?}: expected a site among indexer, attn_out, mlp_out, layer_out")]
    Site {
        /// What was given.
        got: String,
    },
    /// Layers that are not `N` or `N-M` with N <= M.
    #[error("graft {got:?}: expected layers as N or N-M (0 <= N <= M)")]
    Layers {
        /// What was given.
        got: String,
    },
    /// Layers past the model's last.
    #[error("graft {graft}: the model has {layers} layers (0 to {last})", last = .layers - 1)]
    OutOfRange {
        /// The graft, as written back.
        graft: String,
        /// The model's layer count.
        layers: i64,
    },
}

impl Graft {
    /// Every graft of `spec`.
    ///
    /// # Errors
    /// An empty part, an unknown site or layers written wrong.
    pub fn parse_all(spec: &str) -> Result<Vec<Graft>, GraftError> {
        // The grammar of `SHADOWTRACE_GRAFT` (env.json's `grafts`): items and their parts
        // lose ASCII whitespace, empty items are skipped, layers are ASCII digits that fit
        // an unsigned 32-bit integer.
        spec.split(',')
            .map(trim)
            .filter(|part| !part.is_empty())
            .map(Graft::parse)
            .collect()
    }

    fn parse(part: &str) -> Result<Graft, GraftError> {
        let (site, layers) = part
            .split_once('@')
            .map_or((part, None), |(s, l)| (s, Some(l)));
        let site = GraftSite::named(trim(site)).ok_or_else(|| GraftError::Site {
            got: part.to_owned(),
        })?;
        let layers = match layers {
            None => None,
            Some(text) => {
                let [a, b] = layer_range(text).ok_or_else(|| GraftError::Layers {
                    got: part.to_owned(),
                })?;
                Some((i64::from(a), i64::from(b)))
            }
        };
        Ok(Graft { site, layers })
    }

    /// Whether it acts at `layer`.
    #[must_use]
    pub fn at(&self, layer: i64) -> bool {
        self.layers.is_none_or(|(a, b)| (a..=b).contains(&layer))
    }

    /// Refuses layers past a `layers`-layer model's last.
    ///
    /// # Errors
    /// [`GraftError::OutOfRange`].
    pub fn check(&self, layers: i64) -> Result<(), GraftError> {
        match self.layers {
            Some((_, b)) if b >= layers => Err(GraftError::OutOfRange {
                graft: self.to_string(),
                layers,
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Graft {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layers {
            None => write!(f, "{}", self.site.name()),
            Some((a, b)) if a == b => write!(f, "{}@{a}", self.site.name()),
            Some((a, b)) => write!(f, "{}@{a}-{b}", self.site.name()),
        }
    }
}

/// `s` without leading and trailing ASCII whitespace, as the environment's values lose it.
fn trim(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_ascii_whitespace())
}

/// `grafts` written back as one spec (the manifest's `tags.graft`).
#[must_use]
pub fn spec(grafts: &[Graft]) -> String {
    grafts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The sites grafted at one layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraftSites {
    /// The indexer's selection.
    pub indexer: bool,
    /// attn_out.
    pub attn_out: bool,
    /// mlp_out.
    pub mlp_out: bool,
    /// layer_out.
    pub layer_out: bool,
}

impl GraftSites {
    /// The sites of `grafts` acting at `layer`.
    #[must_use]
    pub fn at(grafts: &[Graft], layer: i64) -> GraftSites {
        let on = |site| grafts.iter().any(|g| g.site == site && g.at(layer));
        GraftSites {
            indexer: on(GraftSite::Indexer),
            attn_out: on(GraftSite::AttnOut),
            mlp_out: on(GraftSite::MlpOut),
            layer_out: on(GraftSite::LayerOut),
        }
    }

    /// Whether any site is grafted.
    #[must_use]
    pub fn any(&self) -> bool {
        self.indexer || self.attn_out || self.mlp_out || self.layer_out
    }
}

/// What production takes at one layer: the shadow's output of that layer and
/// the sites taken from it.
#[derive(Debug, Clone, Copy)]
pub struct Grafted<'a> {
    /// The local shadow's output of this layer.
    pub source: &'a LayerOutput,
    /// The sites taken.
    pub sites: GraftSites,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_parses_to_its_sites_and_layer_ranges_and_writes_back_the_same() {
        let grafts = Graft::parse_all("indexer@20-23, attn_out@ 3 ,,layer_out,").unwrap();
        assert_eq!(
            grafts,
            vec![
                Graft {
                    site: GraftSite::Indexer,
                    layers: Some((20, 23))
                },
                Graft {
                    site: GraftSite::AttnOut,
                    layers: Some((3, 3))
                },
                Graft {
                    site: GraftSite::LayerOut,
                    layers: None
                },
            ]
        );
        assert_eq!(spec(&grafts), "indexer@20-23,attn_out@3,layer_out");
        let at21 = GraftSites::at(&grafts, 21);
        assert!(at21.indexer && !at21.attn_out && at21.layer_out);
        assert!(!GraftSites::at(&grafts[..2], 5).any());
    }

    #[test]
    fn a_spec_written_wrong_is_refused_with_what_was_expected() {
        let err = |s: &str| Graft::parse_all(s).unwrap_err().to_string();
        assert_eq!(
            err("kv@1"),
            "graft \"kv@1\": expected a site among indexer, attn_out, mlp_out, layer_out"
        );
        assert_eq!(
            err("indexer@3-1"),
            "graft \"indexer@3-1\": expected layers as N or N-M (0 <= N <= M)"
        );
        assert!(err("mlp_out@x").contains("expected layers as N or N-M"));
        assert!(err("mlp_out@+3").contains("expected layers as N or N-M"));
        assert!(err("mlp_out@4294967296").contains("expected layers as N or N-M"));
        assert!(
            Graft::parse_all(" , ").unwrap().is_empty(),
            "empty items are skipped"
        );
        let g = Graft::parse_all("mlp_out@2-4").unwrap()[0];
        assert_eq!(
            g.check(4).unwrap_err().to_string(),
            "graft mlp_out@2-4: the model has 4 layers (0 to 3)"
        );
        assert!(g.check(5).is_ok());
    }
}
