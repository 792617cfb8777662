//! What a top-k selection is over: its unit.
//!
//! ## What it checks
//! A selection's key indices count entries of one key cache: tokens
//! (GLM-5, DeepSeek-V3.2), entries of a pooled key cache (GLM-5.3-Flash's
//! k-pool, `index_kpool` tokens each) or of a compressed one (DeepSeek-V4,
//! the compress rate in tokens each). The v2 `topk` table names it per row
//! (`unit`, `unit_tokens`; schemas/v2/topk.json); v1 rows are over tokens.
//!
//! ## Definition
//! Rows are grouped by layer before their overlaps are summarised. Every row
//! of a layer must share one (unit, unit_tokens); a layer that mixes them
//! is refused with the layer and both units ([`AnalyzeError::MixedUnits`]),
//! never averaged.
//!
//! ## Why it matters
//! Jaccard and churn between a selection of 64 pool entries and one of 64
//! tokens count different things: the same number would mean a sixteenth of
//! the context in one and all of it in the other.
//!
//! ## References
//! schemas/v2/topk.json; vocabulary.json `selection_units`; issue 17.

use std::collections::BTreeMap;
use std::fmt;

use polars::prelude::DataFrame;
use serde::Serialize;
use shadowtrace_schemas::columns::topk as c;

use crate::AnalyzeError;
use crate::frame::{i32s, null_view, str_refs};

/// The v2 column naming a selection's unit.
pub const UNIT: &str = "unit";
/// The v2 column: tokens per key of that unit.
pub const UNIT_TOKENS: &str = "unit_tokens";

/// What one selection's keys are.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct SelectionUnit {
    /// `token`, `kpool` or `compressed` (vocabulary `selection_units`).
    pub unit: String,
    /// Tokens per key: 1 for `token`, the pool or compression ratio otherwise.
    pub tokens: i32,
}

impl SelectionUnit {
    /// One token per key: what every v1 row is over.
    #[must_use]
    pub fn token() -> SelectionUnit {
        SelectionUnit {
            unit: "token".to_owned(),
            tokens: 1,
        }
    }
}

impl fmt::Display for SelectionUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.tokens == 1 {
            write!(f, "{}", self.unit)
        } else {
            write!(f, "{} of {} tokens", self.unit, self.tokens)
        }
    }
}

/// Each layer's one unit among the rows of a `topk` frame (its `layer`
/// column, and `unit`/`unit_tokens` when the frame holds them: rows of a
/// frame without them are over tokens).
///
/// # Errors
/// A layer whose rows are over different units ([`AnalyzeError::MixedUnits`]),
/// or a column of another type.
pub fn per_layer(frame: &DataFrame) -> Result<BTreeMap<i32, SelectionUnit>, AnalyzeError> {
    let layers = i32s(frame, c::LAYER)?;
    let has = |name: &str| frame.get_column_names().iter().any(|n| n.as_str() == name);
    // Borrowed, not a String per row: this runs over every top-k row.
    let units: Vec<Option<&str>> = if has(UNIT) {
        str_refs(frame, UNIT)?
    } else {
        vec![None; frame.height()]
    };
    let tokens = if has(UNIT_TOKENS) {
        Some(null_view::<i32>(frame, UNIT_TOKENS)?)
    } else {
        None
    };
    let mut out: BTreeMap<i32, SelectionUnit> = BTreeMap::new();
    for (i, &layer) in layers.iter().enumerate() {
        add_row(&mut out, layer, units[i], tokens.and_then(|t| t.get(i)))?;
    }
    Ok(out)
}

/// Adds one row's unit to `out` under the rule of [`per_layer`]: `unit`
/// absent is `token`, `tokens` absent is 1.
///
/// # Errors
/// A layer whose unit in `out` differs ([`AnalyzeError::MixedUnits`]).
pub fn add_row(
    out: &mut BTreeMap<i32, SelectionUnit>,
    layer: i32,
    unit: Option<&str>,
    tokens: Option<i32>,
) -> Result<(), AnalyzeError> {
    let (unit, tokens) = (unit.unwrap_or("token"), tokens.unwrap_or(1));
    match out.get(&layer) {
        Some(first) if first.unit != unit || first.tokens != tokens => {
            Err(AnalyzeError::MixedUnits {
                layer,
                first: first.to_string(),
                other: SelectionUnit {
                    unit: unit.to_owned(),
                    tokens,
                }
                .to_string(),
            })
        }
        Some(_) => Ok(()),
        None => {
            out.insert(
                layer,
                SelectionUnit {
                    unit: unit.to_owned(),
                    tokens,
                },
            );
            Ok(())
        }
    }
}

/// Merges one frame's units into a run's, with the same rule across frames.
///
/// # Errors
/// A layer over one unit in `acc` and another in `more`.
pub fn merge(
    acc: &mut BTreeMap<i32, SelectionUnit>,
    more: BTreeMap<i32, SelectionUnit>,
) -> Result<(), AnalyzeError> {
    for (layer, unit) in more {
        match acc.get(&layer) {
            Some(first) if *first != unit => {
                return Err(AnalyzeError::MixedUnits {
                    layer,
                    first: first.to_string(),
                    other: unit.to_string(),
                });
            }
            Some(_) => {}
            None => {
                acc.insert(layer, unit);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use polars::prelude::{DataFrame, NamedFrom, Series};

    use super::*;

    fn frame(layers: &[i32], units: Option<(&[&str], &[i32])>) -> DataFrame {
        let mut columns = vec![Series::new(c::LAYER.into(), layers).into()];
        if let Some((names, tokens)) = units {
            columns.push(Series::new(UNIT.into(), names).into());
            columns.push(Series::new(UNIT_TOKENS.into(), tokens).into());
        }
        DataFrame::new(layers.len(), columns).unwrap()
    }

    #[test]
    fn rows_without_unit_columns_are_over_tokens() {
        let units = per_layer(&frame(&[0, 0, 2], None)).unwrap();
        assert_eq!(units.len(), 2);
        assert!(units.values().all(|u| *u == SelectionUnit::token()));
    }

    #[test]
    fn each_layer_may_have_its_own_unit() {
        // DeepSeek-V4: compressed every 4 tokens in one layer, 128 in another
        let f = frame(
            &[1, 1, 3],
            Some((&["compressed", "compressed", "compressed"], &[4, 4, 128])),
        );
        let units = per_layer(&f).unwrap();
        assert_eq!(units[&1].to_string(), "compressed of 4 tokens");
        assert_eq!(units[&3].tokens, 128);
    }

    #[test]
    fn a_layer_mixing_units_is_refused_with_both() {
        let f = frame(&[2, 2], Some((&["kpool", "token"], &[4, 1])));
        let err = per_layer(&f).unwrap_err().to_string();
        assert!(err.contains("layer 2"), "{err}");
        assert!(
            err.contains("kpool of 4 tokens") && err.contains("over token"),
            "{err}"
        );
        // same unit name, another ratio: still another unit
        let f = frame(&[0, 0], Some((&["kpool", "kpool"], &[4, 8])));
        assert!(per_layer(&f).is_err());
    }

    #[test]
    fn frames_of_one_run_must_agree_per_layer() {
        let mut acc = per_layer(&frame(&[0], Some((&["kpool"], &[4])))).unwrap();
        merge(&mut acc, per_layer(&frame(&[1], None)).unwrap()).unwrap();
        let err = merge(&mut acc, per_layer(&frame(&[0], None)).unwrap()).unwrap_err();
        assert!(err.to_string().contains("layer 0"), "{err}");
    }
}
