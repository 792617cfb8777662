//! Metrics: one per file, each with its definition in the module docs.
//! Producers record raw facts; every derived number is computed here.

pub mod check_memo;
pub mod hidden_error;
pub mod logits;
pub mod nan_provenance;
pub mod nan_reads;
pub mod nan_trace;
pub mod nonfinite;
pub mod selection_unit;
pub mod summary;
pub mod topk_check;
pub mod topk_overlap;
pub mod topk_v2;
