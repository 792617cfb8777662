//! Column names of the tables, for code that reads or writes them: [`topk`]
//! is v2's top-k table, [`topk_v1`] v1's; the other tables are the same in
//! both versions.
//!
//! The names are defined by the JSON files under `schemas/v1/` and
//! `schemas/v2/`; these constants exist so that a typo is a compile error.
//! `every_constant_names_a_column` checks each against the definitions.

/// Run identity; first column of every table.
pub const RUN_ID: &str = "run_id";
/// Capture sequence number (hidden, events).
pub const SEQ: &str = "seq";
/// Forward step (all tables).
pub const STEP: &str = "step";
/// Decoder layer (hidden, topk, events).
pub const LAYER: &str = "layer";
/// Capture site (hidden, events).
pub const SITE: &str = "site";
/// Token position (all tables).
pub const TOKEN: &str = "token";

/// Columns of the `hidden` table.
pub mod hidden {
    pub use super::{LAYER, RUN_ID, SEQ, SITE, STEP, TOKEN};
    /// Shadow mode of the row: local, free or null.
    pub const SHADOW_MODE: &str = "shadow_mode";
    /// Elements in the vector.
    pub const NUMEL: &str = "numel";
    /// NaN count, prod.
    pub const PROD_NAN: &str = "prod_nan";
    /// +Inf count, prod.
    pub const PROD_POS_INF: &str = "prod_pos_inf";
    /// -Inf count, prod.
    pub const PROD_NEG_INF: &str = "prod_neg_inf";
    /// Max |x| over finite elements, prod.
    pub const PROD_MAX_ABS: &str = "prod_max_abs";
    /// L2 norm over finite elements, prod.
    pub const PROD_L2: &str = "prod_l2";
    /// NaN count, shadow.
    pub const SHADOW_NAN: &str = "shadow_nan";
    /// +Inf count, shadow.
    pub const SHADOW_POS_INF: &str = "shadow_pos_inf";
    /// -Inf count, shadow.
    pub const SHADOW_NEG_INF: &str = "shadow_neg_inf";
    /// Max |x| over finite elements, shadow.
    pub const SHADOW_MAX_ABS: &str = "shadow_max_abs";
    /// L2 norm over finite elements, shadow.
    pub const SHADOW_L2: &str = "shadow_l2";
    /// Relative L2 error of prod against shadow.
    pub const REL_L2_ERR: &str = "rel_l2_err";
    /// Cosine similarity of prod and shadow.
    pub const COSINE: &str = "cosine";
    /// Max |prod - shadow|.
    pub const MAX_ABS_DIFF: &str = "max_abs_diff";
}

/// Columns of the v2 `topk` table (`schemas/v2/topk.json`).
pub mod topk {
    pub use super::{LAYER, RUN_ID, STEP, TOKEN};
    /// Which inputs the shadow indexer scored: raw, dequant or null.
    pub const SHADOW_INPUT: &str = "shadow_input";
    /// Layer whose indexer computed the selection.
    pub const INDEXER_LAYER: &str = "indexer_layer";
    /// What a key is (vocabulary `selection_units`).
    pub const UNIT: &str = "unit";
    /// Tokens per key.
    pub const UNIT_TOKENS: &str = "unit_tokens";
    /// index_topk.
    pub const K: &str = "k";
    /// Keys visible to the query.
    pub const VISIBLE: &str = "visible";
    /// Keys prod selected.
    pub const PROD_SELECTED: &str = "prod_selected";
    /// Prod k-th score.
    pub const PROD_KTH_SCORE: &str = "prod_kth_score";
    /// Prod k-th minus (k+1)-th score.
    pub const PROD_KTH_MARGIN: &str = "prod_kth_margin";
    /// Keys the shadow selected.
    pub const SHADOW_SELECTED: &str = "shadow_selected";
    /// Shadow k-th score.
    pub const SHADOW_KTH_SCORE: &str = "shadow_kth_score";
    /// Shadow k-th minus (k+1)-th score.
    pub const SHADOW_KTH_MARGIN: &str = "shadow_kth_margin";
    /// Keys both paths selected.
    pub const SHARED: &str = "shared";
    /// The band around each path's k-th score.
    pub const BOUNDARY_BAND: &str = "boundary_band";
    /// Churn keys both selected.
    pub const CHURN_SHARED: &str = "churn_shared";
    /// Churn keys only prod selected.
    pub const CHURN_PROD_ONLY: &str = "churn_prod_only";
    /// Churn keys only the shadow selected.
    pub const CHURN_SHADOW_ONLY: &str = "churn_shadow_only";
    /// Churn keys neither selected.
    pub const CHURN_UNSELECTED: &str = "churn_unselected";
    /// The producer's Jaccard.
    pub const JACCARD: &str = "jaccard";
    /// The producer's Jaccard without churn.
    pub const JACCARD_NO_CHURN: &str = "jaccard_no_churn";
    /// Keys only prod selected, gap-coded.
    pub const PROD_ONLY_GAPS: &str = "prod_only_gaps";
    /// Keys only the shadow selected, gap-coded.
    pub const SHADOW_ONLY_GAPS: &str = "shadow_only_gaps";
    /// Prod boundary candidates, gap-coded.
    pub const PROD_BOUNDARY_GAPS: &str = "prod_boundary_gaps";
    /// Their prod scores minus the prod k-th score.
    pub const PROD_BOUNDARY_OFFSETS: &str = "prod_boundary_offsets";
    /// Whether prod selected each.
    pub const PROD_BOUNDARY_SELECTED: &str = "prod_boundary_selected";
    /// Shadow boundary candidates, gap-coded.
    pub const SHADOW_BOUNDARY_GAPS: &str = "shadow_boundary_gaps";
    /// Their shadow scores minus the shadow k-th score.
    pub const SHADOW_BOUNDARY_OFFSETS: &str = "shadow_boundary_offsets";
    /// Whether the shadow selected each.
    pub const SHADOW_BOUNDARY_SELECTED: &str = "shadow_boundary_selected";
    /// The full prod selection, gap-coded, for sampled rows.
    pub const PROD_GAPS: &str = "prod_gaps";
}

/// Columns of the v1 `topk` table (`schemas/v1/topk.json`), read in old runs.
pub mod topk_v1 {
    pub use super::topk::{
        BOUNDARY_BAND, INDEXER_LAYER, K, PROD_KTH_MARGIN, PROD_KTH_SCORE, SHADOW_INPUT,
        SHADOW_KTH_MARGIN, SHADOW_KTH_SCORE, VISIBLE,
    };
    pub use super::{LAYER, RUN_ID, STEP, TOKEN};
    /// Prod selection, sorted.
    pub const PROD_INDICES: &str = "prod_indices";
    /// Keys within the band of the prod k-th score.
    pub const PROD_BOUNDARY_INDICES: &str = "prod_boundary_indices";
    /// Prod scores of those keys.
    pub const PROD_BOUNDARY_SCORES: &str = "prod_boundary_scores";
    /// Shadow selection, sorted.
    pub const SHADOW_INDICES: &str = "shadow_indices";
    /// Keys within the band of the shadow k-th score.
    pub const SHADOW_BOUNDARY_INDICES: &str = "shadow_boundary_indices";
    /// Shadow scores of those keys.
    pub const SHADOW_BOUNDARY_SCORES: &str = "shadow_boundary_scores";
}

/// Columns of the `events` table.
pub mod events {
    pub use super::{LAYER, RUN_ID, SEQ, SITE, STEP, TOKEN};
    /// prod or shadow.
    pub const PATH: &str = "path";
    /// nan, pos_inf, neg_inf or sentinel.
    pub const KIND: &str = "kind";
    /// First channel holding the value.
    pub const CHANNEL: &str = "channel";
    /// Elements of this kind in the tensor.
    pub const COUNT: &str = "count";
    /// Whether the shadow was finite at the same token.
    pub const SHADOW_FINITE: &str = "shadow_finite";
    /// Sentinel check name.
    pub const CHECK: &str = "check";
    /// Sentinel check result.
    pub const PASSED: &str = "passed";
    /// Observed sentinel value.
    pub const VALUE: &str = "value";
    /// Free text.
    pub const DETAIL: &str = "detail";
}

/// Columns of the `logits` table.
pub mod logits {
    pub use super::{RUN_ID, STEP, TOKEN};
    /// Prod top-N ids, best first.
    pub const PROD_TOP_IDS: &str = "prod_top_ids";
    /// Prod top-N log-probabilities.
    pub const PROD_TOP_LOGPROBS: &str = "prod_top_logprobs";
    /// Shadow top-N ids, best first.
    pub const SHADOW_TOP_IDS: &str = "shadow_top_ids";
    /// Shadow top-N log-probabilities.
    pub const SHADOW_TOP_LOGPROBS: &str = "shadow_top_logprobs";
}

#[cfg(test)]
mod tests {
    use crate::Table;

    fn assert_columns(table: Table, names: &[&str]) {
        assert_columns_of(table, 2, names);
    }

    fn assert_columns_of(table: Table, version: u32, names: &[&str]) {
        let spec = table.spec_for(version).unwrap();
        for name in names {
            assert!(
                spec.column(name).is_some(),
                "{table}: constant {name} names no column"
            );
        }
        assert_eq!(
            names.len(),
            spec.columns.len(),
            "{table}: a column has no constant"
        );
    }

    #[test]
    fn every_constant_names_a_column() {
        use super::{events as e, hidden as h, logits as l, topk as t, topk_v1 as t1};
        assert_columns(
            Table::Hidden,
            &[
                h::RUN_ID,
                h::SEQ,
                h::STEP,
                h::LAYER,
                h::SITE,
                h::TOKEN,
                h::SHADOW_MODE,
                h::NUMEL,
                h::PROD_NAN,
                h::PROD_POS_INF,
                h::PROD_NEG_INF,
                h::PROD_MAX_ABS,
                h::PROD_L2,
                h::SHADOW_NAN,
                h::SHADOW_POS_INF,
                h::SHADOW_NEG_INF,
                h::SHADOW_MAX_ABS,
                h::SHADOW_L2,
                h::REL_L2_ERR,
                h::COSINE,
                h::MAX_ABS_DIFF,
            ],
        );
        assert_columns(
            Table::Topk,
            &[
                t::RUN_ID,
                t::STEP,
                t::LAYER,
                t::TOKEN,
                t::SHADOW_INPUT,
                t::INDEXER_LAYER,
                t::UNIT,
                t::UNIT_TOKENS,
                t::K,
                t::VISIBLE,
                t::PROD_SELECTED,
                t::PROD_KTH_SCORE,
                t::PROD_KTH_MARGIN,
                t::SHADOW_SELECTED,
                t::SHADOW_KTH_SCORE,
                t::SHADOW_KTH_MARGIN,
                t::SHARED,
                t::BOUNDARY_BAND,
                t::CHURN_SHARED,
                t::CHURN_PROD_ONLY,
                t::CHURN_SHADOW_ONLY,
                t::CHURN_UNSELECTED,
                t::JACCARD,
                t::JACCARD_NO_CHURN,
                t::PROD_ONLY_GAPS,
                t::SHADOW_ONLY_GAPS,
                t::PROD_BOUNDARY_GAPS,
                t::PROD_BOUNDARY_OFFSETS,
                t::PROD_BOUNDARY_SELECTED,
                t::SHADOW_BOUNDARY_GAPS,
                t::SHADOW_BOUNDARY_OFFSETS,
                t::SHADOW_BOUNDARY_SELECTED,
                t::PROD_GAPS,
            ],
        );
        assert_columns_of(
            Table::Topk,
            1,
            &[
                t1::RUN_ID,
                t1::STEP,
                t1::LAYER,
                t1::TOKEN,
                t1::SHADOW_INPUT,
                t1::INDEXER_LAYER,
                t1::K,
                t1::VISIBLE,
                t1::PROD_INDICES,
                t1::PROD_KTH_SCORE,
                t1::PROD_KTH_MARGIN,
                t1::PROD_BOUNDARY_INDICES,
                t1::PROD_BOUNDARY_SCORES,
                t1::SHADOW_INDICES,
                t1::SHADOW_KTH_SCORE,
                t1::SHADOW_KTH_MARGIN,
                t1::SHADOW_BOUNDARY_INDICES,
                t1::SHADOW_BOUNDARY_SCORES,
                t1::BOUNDARY_BAND,
            ],
        );
        assert_columns(
            Table::Events,
            &[
                e::RUN_ID,
                e::SEQ,
                e::STEP,
                e::LAYER,
                e::SITE,
                e::PATH,
                e::KIND,
                e::TOKEN,
                e::CHANNEL,
                e::COUNT,
                e::SHADOW_FINITE,
                e::CHECK,
                e::PASSED,
                e::VALUE,
                e::DETAIL,
            ],
        );
        assert_columns(
            Table::Logits,
            &[
                l::RUN_ID,
                l::STEP,
                l::TOKEN,
                l::PROD_TOP_IDS,
                l::PROD_TOP_LOGPROBS,
                l::SHADOW_TOP_IDS,
                l::SHADOW_TOP_LOGPROBS,
            ],
        );
    }
}
