//! GLM-5.3-Flash traced: the production pass (FP8 linears, bf16
//! activations) and its fp32 (or bf16) shadows through
//! [`crate::model::glm5_next`], recorded at the same sites as the GLM-5
//! engine's. A token's hidden vector at `layer_in` and `layer_out` is its
//! `hc_mult` hyper-connection streams end to end (`numel` = hc_mult x
//! hidden), as the HF hooks record them; `attn_out` and `mlp_out` are the
//! blocks' outputs before they are spread over the streams. The k-pool
//! indexer's selections are recorded in pool units (`unit` kpool,
//! `unit_tokens` = index_kpool, `k` = index_topk / index_kpool, `visible` =
//! the complete pools a query sees, keys = pool indices), as the HF hooks
//! record them; KDA layers have neither indexer nor KV slots.
//!
//! Faults: `non_finite` ones only, planted in production and listed in the
//! manifest. Not run here: the other fault kinds and engine deviations (the
//! command line refuses them for this model), and an FP8 indexer variant
//! (the indexer runs in the path's numerics, as transformers computes it).

use std::path::Path;
use std::sync::atomic::Ordering;

use tch::{Kind, Tensor};

use shadowtrace_schemas::Convention;
use shadowtrace_schemas::manifest::{Manifest, Model as ModelId, RunIdentity};

use super::{
    IndexerScores, Mode, TraceOptions, TraceRunError, record_kv_sentinels, record_site,
    record_topk, reference_identity, runs_dir_salt, stats,
};
use crate::RunWriter;
use crate::identity::config_hash;
use crate::model::glm5_next::{Glm5Next, LayerOutput, Pass};
use crate::model::layer::{Fallbacks, Numerics};
use crate::record::{LogitsRow, SelectionUnit};

/// Traces one prompt through GLM-5.3-Flash into `run_dir`; returns the
/// closed run's manifest.
///
/// # Errors
/// A weight that cannot be loaded, or a run that cannot be written.
pub fn trace_glm5_next(
    model: &Glm5Next,
    ids: &[i64],
    run_id: &str,
    run_dir: &Path,
    opts: &TraceOptions,
) -> Result<Manifest, TraceRunError> {
    if !opts.grafts.is_empty() {
        return Err(TraceRunError::GraftNotImplemented {
            spec: crate::model::graft::spec(&opts.grafts),
            model_type: "glm5_next",
        });
    }
    let writer = RunWriter::create(
        run_dir,
        identity(model, ids, run_id, &runs_dir_salt(run_dir), opts),
        opts.writer.clone(),
    )?;
    let c = &model.config;
    let s = ids.len() as i64;
    let kind = opts.precision;
    let emb = model.embed(ids)?;
    let mut h_prod = emb.to_kind(Kind::BFloat16);
    let mut h_free = emb.to_kind(kind);
    let tokens = opts.token_rows(s);
    let tokens_t = Tensor::from_slice(&tokens).to_device(model.device);
    let unit = SelectionUnit {
        name: "kpool",
        tokens: i32::try_from(c.index_kpool).unwrap_or(i32::MAX),
    };
    let mut seq = 0_i64;
    let fallbacks = Fallbacks::default();
    let (mut prev_prod, mut prev_free): (Option<Tensor>, Option<Tensor>) = (None, None);
    let flat = |streams: &Tensor| streams.reshape([s, -1]);
    for i in 0..c.num_hidden_layers {
        if opts
            .stop
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed))
        {
            writer.add_counters(&fallbacks.counters());
            writer.close_interrupted()?;
            return Err(TraceRunError::Interrupted { layer: i });
        }
        let weights = model.load_layer(i)?;
        let production = Pass {
            numerics: Numerics::Fp8,
            fallbacks: Some(&fallbacks),
            faults: &opts.faults,
        };
        let shadow = Pass::plain(Numerics::Plain(kind));
        let (next_prod, prod) = model.layer(i, &weights, &production, &h_prod, prev_prod.as_ref());
        let local = (opts.modes.contains(&Mode::Local)).then(|| {
            let input = h_prod.to_kind(kind);
            model
                .layer(i, &weights, &shadow, &input, prev_prod.as_ref())
                .1
        });
        let free = (opts.modes.contains(&Mode::Free))
            .then(|| model.layer(i, &weights, &shadow, &h_free, prev_free.as_ref()));
        if opts.layer(i) {
            type Pick = Option<fn(&LayerOutput) -> &Tensor>;
            let layer_in = flat(&h_prod);
            let sites: [(&str, &Tensor, Pick); 4] = [
                ("layer_in", &layer_in, None),
                ("attn_out", &prod.attn_out, Some(|o| &o.attn_out)),
                ("mlp_out", &prod.mlp_out, Some(|o| &o.mlp_out)),
                ("layer_out", &prod.layer_out, Some(|o| &o.layer_out)),
            ];
            for (site, tensor, pick) in sites {
                if site == "attn_out"
                    && opts.site("indexer")
                    && let Some(sel) = prod.selection.as_ref()
                {
                    let shadow = local
                        .as_ref()
                        .and_then(|o| o.selection.as_ref().map(|l| (&l.scores, &l.pools)));
                    let scores = IndexerScores {
                        prod: &sel.scores,
                        prod_topk: &sel.pools,
                        shadow,
                    };
                    record_topk(
                        &writer,
                        seq,
                        i,
                        (c.pools_per_query(), unit),
                        &scores,
                        opts.band,
                    )?;
                    seq += 1;
                }
                if !opts.site(site) {
                    continue;
                }
                let mut shadows: Vec<(&str, &Tensor)> = Vec::new();
                if let Some(pick) = pick {
                    shadows.extend(local.as_ref().map(|o| ("local", pick(o))));
                    shadows.extend(free.as_ref().map(|(_, o)| ("free", pick(o))));
                }
                record_site(&writer, seq, i, site, tensor, &shadows, &tokens_t, &tokens);
                seq += 1;
            }
            if let Some(kv) = prod.kv_latent.as_ref() {
                record_kv_sentinels(&writer, seq, i, kv);
                seq += 1;
            }
        }
        prev_prod = prod.tokens;
        h_prod = next_prod;
        if let Some((next_free, free)) = free {
            prev_free = free.tokens;
            h_free = next_free;
        }
    }
    if opts.site("logits") {
        let head = model.head()?;
        let (rows, rows_t) = (&tokens, &tokens_t);
        let prod = stats::top_logits(
            &head.logits(&h_prod.index_select(0, rows_t), Kind::BFloat16),
            opts.top_n,
        );
        let shadow_stream = if opts.modes.contains(&Mode::Free) {
            &h_free
        } else {
            &h_prod
        };
        let shadow = (!opts.modes.is_empty()).then(|| {
            stats::top_logits(
                &head.logits(&shadow_stream.index_select(0, rows_t), kind),
                opts.top_n,
            )
        });
        for (j, top) in prod.into_iter().enumerate() {
            let _ = writer.send(LogitsRow {
                step: 0,
                token: rows[j] as i32,
                prod: top,
                shadow: shadow.as_ref().map(|s| s[j].clone()),
            });
        }
    }
    writer.add_counters(&fallbacks.counters());
    Ok(writer.close()?)
}

fn identity(
    model: &Glm5Next,
    ids: &[i64],
    run_id: &str,
    salt: &[u8],
    opts: &TraceOptions,
) -> RunIdentity {
    let c = &model.config;
    let mut settings = serde_json::Map::new();
    settings.insert("fp8_indexer".to_owned(), "none".into());
    super::band_settings(&mut settings, opts.band);
    super::capture_check_not_run(&mut settings);
    settings.insert("tokens".to_owned(), opts.tokens_setting.clone());
    settings.insert(
        "prod_linears".to_owned(),
        "fp8 e4m3, 1x128 activation and 128x128 weight blocks, ue8m0 scales: on CUDA the tensor \
         cores' _scaled_mm, else the exact fp32 emulation (counters fp8_linears_tensor_cores, \
         fp8_linears_emulated; fallbacks fp8_scaled_mm_fallbacks, fp8_quantize_fallbacks); \
         the hyper-connection weights, the MoE router and the KDA state in fp32, the indexer's \
         k-pool gate and head weights in bf16 and its scores in fp32: not FP8, as in transformers"
            .into(),
    );
    let layer_types: Vec<&str> = (0..c.num_hidden_layers)
        .map(|i| match c.mixer(i) {
            crate::model::glm5_next::Mixer::Kda => "linear_attention",
            crate::model::glm5_next::Mixer::Mla => "indexed_attention",
        })
        .collect();
    settings.insert("layer_types".to_owned(), layer_types.into());
    let model_id = ModelId {
        name: opts.model_name.clone(),
        architecture: "glm5_next".to_owned(),
        config_hash: config_hash(&model.config_bytes),
        revision: None,
        num_layers: u32::try_from(c.num_hidden_layers).unwrap_or(0),
        index_topk: u32::try_from(c.index_topk).ok(),
    };
    reference_identity(
        run_id,
        model_id,
        "none",
        settings,
        (ids, salt),
        opts,
        (conventions(model), Vec::new()),
    )
}

/// The indexer conventions GLM-5.3-Flash defines; production takes the
/// model's (this engine runs no deviation on it).
fn conventions(model: &Glm5Next) -> Vec<Convention> {
    use crate::model::convention::{
        INDEXER_HEAD_WEIGHT_SCALE, INDEXER_WEIGHTS_PROJ_DTYPE, head_weight_scale_of,
    };
    const ENGINE: &str = "shadowtrace-reference production";
    let c = &model.config;
    let scale = head_weight_scale_of(c.index_head_dim, c.index_n_heads);
    vec![
        Convention {
            name: INDEXER_HEAD_WEIGHT_SCALE.to_owned(),
            engine: scale.into(),
            model: scale.into(),
            engine_source: format!("{ENGINE}: index_head_dim and index_n_heads of config.json"),
            model_source: "transformers Glm5NextTextIndexer: softmax_scale = head_dim^-0.5, \
                           weights * n_heads^-0.5"
                .to_owned(),
            engine_assumed: false,
        },
        Convention {
            name: INDEXER_WEIGHTS_PROJ_DTYPE.to_owned(),
            engine: "bf16".into(),
            model: "bf16".into(),
            engine_source: format!("{ENGINE}: a GEMM in the activations' kind (bf16)"),
            model_source:
                "transformers Glm5NextTextIndexer: weights_proj(x.to(its dtype)).float(), \
                           weights_proj not in _keep_in_fp32_modules_strict"
                    .to_owned(),
            engine_assumed: false,
        },
    ]
}
