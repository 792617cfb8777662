//! Rows of the four tables, as producers hand them to the writer.
//!
//! A row is plain data: the writer owns the conversion to Arrow. Fields follow
//! the column definitions in `schemas/v1/`, except the top-k row: producers
//! hand over both paths' full selections and boundary candidates, and the
//! writer derives v2's summary, differences and sampled lists from them
//! (`writer/topk.rs`). `every_row_kind_round_trips` in the tests fails when
//! rows and definitions drift apart.

use shadowtrace_schemas::Table;

/// Statistics of one path's vector at one (step, layer, site, token).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct VectorStats {
    /// NaN elements.
    pub nan: i64,
    /// +Inf elements.
    pub pos_inf: i64,
    /// -Inf elements.
    pub neg_inf: i64,
    /// Max |x| over the finite elements.
    pub max_abs: f32,
    /// L2 norm over the finite elements.
    pub l2: f32,
}

/// Comparison of prod against shadow at one (step, layer, site, token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comparison {
    /// ||prod - shadow|| / ||shadow||.
    pub rel_l2_err: f32,
    /// Cosine similarity.
    pub cosine: f32,
    /// max |prod - shadow|.
    pub max_abs_diff: f32,
}

/// The shadow side of a hidden row.
#[derive(Debug, Clone, PartialEq)]
pub struct HiddenShadow {
    /// `local` or `free`.
    pub mode: String,
    /// The shadow vector's statistics.
    pub stats: VectorStats,
    /// prod against shadow.
    pub comparison: Comparison,
}

/// One row of the `hidden` table.
#[derive(Debug, Clone, PartialEq)]
pub struct HiddenRow {
    /// Capture sequence number: execution order.
    pub seq: i64,
    /// Forward step.
    pub step: i32,
    /// Decoder layer.
    pub layer: i32,
    /// Capture site.
    pub site: String,
    /// Token position.
    pub token: i32,
    /// Elements in the vector.
    pub numel: i64,
    /// The prod vector's statistics.
    pub prod: VectorStats,
    /// The shadow, where one ran.
    pub shadow: Option<HiddenShadow>,
}

/// One path's selection in a `topk` row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Selection {
    /// Selected key positions; the writer sorts them and drops padding (-1).
    pub indices: Vec<i32>,
    /// k-th largest score; `None` for a dense row.
    pub kth_score: Option<f32>,
    /// k-th minus (k+1)-th score; `None` for a dense row.
    pub kth_margin: Option<f32>,
    /// Keys whose score lies within the band of the k-th score, with their scores.
    pub boundary: Option<Boundary>,
}

/// Keys near the k-th score, for telling boundary churn from real divergence.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Boundary {
    /// Key positions; the writer sorts them, keeping scores aligned.
    pub indices: Vec<i32>,
    /// Scores of those keys.
    pub scores: Vec<f32>,
}

/// What a key of a selection stands for (vocabulary `selection_units`) and
/// how many tokens one key covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectionUnit {
    /// `token`, `kpool` or `compressed`.
    pub name: &'static str,
    /// Tokens per key: 1 for `token`.
    pub tokens: i32,
}

impl SelectionUnit {
    /// A key is one token: DSA's top-k over the full key cache.
    pub const TOKEN: SelectionUnit = SelectionUnit {
        name: "token",
        tokens: 1,
    };
}

/// One row of the `topk` table.
#[derive(Debug, Clone, PartialEq)]
pub struct TopkRow {
    /// Forward step.
    pub step: i32,
    /// Decoder layer using the selection.
    pub layer: i32,
    /// Query token position.
    pub token: i32,
    /// Layer whose indexer computed the selection.
    pub indexer_layer: i32,
    /// What a key is.
    pub unit: SelectionUnit,
    /// index_topk.
    pub k: i32,
    /// Keys visible to the query.
    pub visible: i32,
    /// The production selection.
    pub prod: Selection,
    /// The shadow selection and which inputs it scored (`raw` or `dequant`).
    pub shadow: Option<(String, Selection)>,
    /// Band used for the boundary lists.
    pub boundary_band: Option<f32>,
}

/// One row of the `events` table.
#[derive(Debug, Clone, PartialEq)]
pub struct EventRow {
    /// Capture sequence number, shared with `hidden`.
    pub seq: i64,
    /// Forward step.
    pub step: i32,
    /// Decoder layer.
    pub layer: i32,
    /// Capture site.
    pub site: String,
    /// `prod` or `shadow`.
    pub path: String,
    /// `nan`, `pos_inf`, `neg_inf` or `sentinel`.
    pub kind: String,
    /// First token holding the value.
    pub token: Option<i32>,
    /// First channel within that token.
    pub channel: Option<i32>,
    /// Elements of this kind in the tensor.
    pub count: i64,
    /// For a prod event: whether the shadow was finite at that token.
    pub shadow_finite: Option<bool>,
    /// Sentinel check name.
    pub check: Option<String>,
    /// Sentinel check result.
    pub passed: Option<bool>,
    /// Observed sentinel value.
    pub value: Option<f32>,
    /// Free text.
    pub detail: Option<String>,
}

/// Top-N of one path's next-token distribution.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TopLogits {
    /// Token ids, best first.
    pub ids: Vec<i32>,
    /// Their log-probabilities.
    pub logprobs: Vec<f32>,
}

/// One row of the `logits` table.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsRow {
    /// Forward step.
    pub step: i32,
    /// Position whose next-token distribution this is.
    pub token: i32,
    /// Production top-N.
    pub prod: TopLogits,
    /// Shadow top-N, where one ran.
    pub shadow: Option<TopLogits>,
}

/// A row of any table.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// A `hidden` row.
    Hidden(HiddenRow),
    /// A `topk` row.
    Topk(TopkRow),
    /// An `events` row.
    Event(EventRow),
    /// A `logits` row.
    Logits(LogitsRow),
}

impl Record {
    /// The table the row belongs to.
    #[must_use]
    pub fn table(&self) -> Table {
        match self {
            Record::Hidden(_) => Table::Hidden,
            Record::Topk(_) => Table::Topk,
            Record::Event(_) => Table::Events,
            Record::Logits(_) => Table::Logits,
        }
    }

    /// What the row holds in memory while it waits in the writer's queue, which is
    /// bounded in bytes: its fixed fields and its lists' elements.
    #[must_use]
    pub fn approx_bytes(&self) -> usize {
        const FIXED: usize = std::mem::size_of::<Record>();
        let selection = |s: &Selection| {
            4 * s.indices.len()
                + s.boundary
                    .as_ref()
                    .map_or(0, |b| 4 * (b.indices.len() + b.scores.len()))
        };
        FIXED
            + match self {
                Record::Hidden(_) => 0,
                Record::Topk(row) => {
                    selection(&row.prod) + row.shadow.as_ref().map_or(0, |(_, s)| selection(s))
                }
                Record::Event(row) => row.detail.as_ref().map_or(0, String::len),
                Record::Logits(row) => {
                    let top = |t: &TopLogits| 4 * (t.ids.len() + t.logprobs.len());
                    top(&row.prod) + row.shadow.as_ref().map_or(0, top)
                }
            }
    }
}

impl From<HiddenRow> for Record {
    fn from(row: HiddenRow) -> Record {
        Record::Hidden(row)
    }
}

impl From<TopkRow> for Record {
    fn from(row: TopkRow) -> Record {
        Record::Topk(row)
    }
}

impl From<EventRow> for Record {
    fn from(row: EventRow) -> Record {
        Record::Event(row)
    }
}

impl From<LogitsRow> for Record {
    fn from(row: LogitsRow) -> Record {
        Record::Logits(row)
    }
}
