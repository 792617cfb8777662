//! Which keys a query read, as far as the `topk` table tells: the reads NaN
//! provenance ([`super::nan_provenance`]) follows through attention.

use std::collections::{BTreeMap, BTreeSet};

use polars::prelude::DataFrame;
use shadowtrace_schemas::columns::topk as c;
use shadowtrace_schemas::selection::keys_from_gaps;

use crate::AnalyzeError;
use crate::frame::{i32s, list};

/// Columns read from a v2 `topk` table.
pub const COLUMNS: [&str; 10] = [
    c::STEP,
    c::LAYER,
    c::TOKEN,
    c::K,
    c::VISIBLE,
    c::PROD_SELECTED,
    c::UNIT_TOKENS,
    c::PROD_ONLY_GAPS,
    c::SHADOW_ONLY_GAPS,
    c::PROD_GAPS,
];

/// Whether a query read one of some keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// It did.
    Yes,
    /// Every one was masked for it (causally or unselected).
    No,
    /// The trace does not tell.
    Unknown,
}

#[derive(Debug, Clone, Default)]
struct Row {
    k: i32,
    visible: i32,
    prod_selected: i32,
    unit_tokens: i32,
    /// The full prod selection, where sampled.
    full: Option<BTreeSet<i32>>,
    /// Keys known selected by prod.
    selected: BTreeSet<i32>,
    /// Keys known not selected by prod.
    unselected: BTreeSet<i32>,
}

/// The recorded selections of a run.
#[derive(Debug, Clone, Default)]
pub struct Selections {
    rows: BTreeMap<(i32, i32, i32), Row>,
    /// A model without an indexer: every query reads every visible key.
    dense_model: bool,
    notes: Vec<String>,
}

impl Selections {
    /// A model without an indexer (`index_topk` null): causal attention.
    #[must_use]
    pub fn dense() -> Selections {
        Selections {
            dense_model: true,
            ..Selections::default()
        }
    }

    /// No selection read, and why: every read of a key a query could see
    /// causally is unknown.
    #[must_use]
    pub fn not_read(why: String) -> Selections {
        Selections {
            notes: vec![why],
            ..Selections::default()
        }
    }

    /// From a v2 `topk` frame ([`COLUMNS`]).
    ///
    /// # Errors
    /// When a column is missing or of another type.
    pub fn of(topk: &DataFrame) -> Result<Selections, AnalyzeError> {
        let (step, layer, token) = (
            i32s(topk, c::STEP)?,
            i32s(topk, c::LAYER)?,
            i32s(topk, c::TOKEN)?,
        );
        let (k, visible, selected, unit) = (
            i32s(topk, c::K)?,
            i32s(topk, c::VISIBLE)?,
            i32s(topk, c::PROD_SELECTED)?,
            i32s(topk, c::UNIT_TOKENS)?,
        );
        let prod_only = list::<i32>(topk, c::PROD_ONLY_GAPS)?;
        let shadow_only = list::<i32>(topk, c::SHADOW_ONLY_GAPS)?;
        let full = list::<i32>(topk, c::PROD_GAPS)?;
        let mut rows: BTreeMap<(i32, i32, i32), Row> = BTreeMap::new();
        for i in 0..topk.height() {
            // Rows of one query differ only in their shadow (raw, dequant).
            let row = rows.entry((step[i], layer[i], token[i])).or_default();
            row.k = k[i];
            row.visible = visible[i];
            row.prod_selected = selected[i];
            row.unit_tokens = unit[i];
            if let Some(gaps) = full.get(i) {
                row.full = Some(keys_from_gaps(gaps).into_iter().collect());
            }
            row.selected
                .extend(keys_from_gaps(prod_only.get(i).unwrap_or(&[])));
            row.unselected
                .extend(keys_from_gaps(shadow_only.get(i).unwrap_or(&[])));
        }
        Ok(Selections {
            rows,
            dense_model: false,
            notes: Vec::new(),
        })
    }

    /// What the selections could not tell.
    #[must_use]
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Whether query `q` of (step, layer) read one of `keys`.
    #[must_use]
    pub fn reads(&self, step: i32, layer: i32, q: i32, keys: &BTreeSet<i32>) -> Read {
        let visible: BTreeSet<i32> = keys.range(..=q).copied().collect();
        if visible.is_empty() {
            return Read::No;
        }
        if self.dense_model {
            return Read::Yes;
        }
        let Some(row) = self.rows.get(&(step, layer, q)) else {
            return Read::Unknown;
        };
        if row.unit_tokens != 1 {
            return Read::Unknown;
        }
        if row.visible <= row.k {
            return Read::Yes;
        }
        if let Some(full) = &row.full {
            return if full.intersection(&visible).next().is_some() {
                Read::Yes
            } else {
                Read::No
            };
        }
        let unselected = i64::from(row.visible) - i64::from(row.prod_selected);
        if row.selected.intersection(&visible).next().is_some() || visible.len() as i64 > unselected
        {
            return Read::Yes;
        }
        if visible.is_subset(&row.unselected) {
            return Read::No;
        }
        Read::Unknown
    }

    /// Whether query `q`'s top-k list at (step, layer) has unused entries
    /// (prod_selected < k: padding −1, which engines send to the reserved
    /// slot through the mask); `None` when the trace has no row for it.
    #[must_use]
    pub fn unused_entries(&self, step: i32, layer: i32, q: i32) -> Option<bool> {
        self.rows
            .get(&(step, layer, q))
            .map(|r| r.prod_selected < r.k)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::{Read, Row, Selections};

    fn with(row: Row) -> Selections {
        let mut s = Selections::default();
        s.rows.insert((0, 1, 10), row);
        s
    }

    #[test]
    fn reads_follow_causality_density_and_what_the_lists_say() {
        let keys = BTreeSet::from([4]);
        assert_eq!(Selections::dense().reads(0, 1, 3, &keys), Read::No);
        assert_eq!(Selections::dense().reads(0, 1, 10, &keys), Read::Yes);
        assert_eq!(Selections::default().reads(0, 1, 10, &keys), Read::Unknown);
        let sparse = Row {
            k: 4,
            visible: 11,
            prod_selected: 4,
            unit_tokens: 1,
            ..Row::default()
        };
        assert_eq!(with(sparse.clone()).reads(0, 1, 10, &keys), Read::Unknown);
        let mut out = sparse.clone();
        out.unselected.insert(4);
        assert_eq!(with(out).reads(0, 1, 10, &keys), Read::No);
        let mut full = sparse.clone();
        full.full = Some(BTreeSet::from([0, 4, 9, 10]));
        assert_eq!(with(full).reads(0, 1, 10, &keys), Read::Yes);
        // Eight tainted keys, seven unselected: one is selected.
        let many: BTreeSet<i32> = (0..8).collect();
        assert_eq!(with(sparse).reads(0, 1, 10, &many), Read::Yes);
    }
}
