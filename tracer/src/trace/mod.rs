//! The reference engine traced: the production pass (FP8 linears, the FP8
//! indexer of a chosen engine variant, planted faults) and its shadows run
//! layer by layer on one layer's weights, and every hook site of DESIGN.md is
//! recorded as trace format v1.
//!
//! Shadow modes: `local` re-runs each layer in the shadow precision on the
//! production input of that layer; `free` runs the shadow's own chain from
//! the embeddings. The indexer's shadow scores the pre-quantization q and k
//! the local shadow computes from the production input (`shadow_input` raw).

mod glm5_next;
pub mod options;
pub mod production_args;
pub mod stats;

use std::path::Path;
use std::sync::atomic::Ordering;

use tch::{Kind, Tensor};

pub use glm5_next::trace_glm5_next;
pub use options::{Mode, TraceOptions};
use shadowtrace_schemas::manifest::{
    Dtypes, Engine, Manifest, Model as ModelId, Parallelism, Prompt, RunIdentity, Shadow,
};

use shadowtrace_schemas::Convention;
use shadowtrace_schemas::selection::{BAND_SCALE, BAND_STORED};

use crate::fp8::ScaleFormat;
use crate::identity::{config_hash, default_device, directory_salt, salt_id, token_hash};
use crate::indexer::topk_with_margin;
use crate::model::convention::reference_conventions;
use crate::model::graft::{self, GraftError, GraftSites, Grafted};
use crate::model::layer::Fallbacks;
use crate::model::{LayerOutput, Model, ModelError, Numerics};
use crate::record::{EventRow, HiddenRow, HiddenShadow, LogitsRow, SelectionUnit, TopkRow};
use crate::{RunWriter, TraceError};

/// A trace that could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceRunError {
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The run could not be written.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A graft the model or the options cannot run; refused before the run
    /// is created.
    #[error(transparent)]
    Graft(#[from] GraftError),
    /// A model whose trace has no grafts.
    #[error("graft {spec}: not implemented for {model_type}")]
    GraftNotImplemented {
        /// The grafts, as written.
        spec: String,
        /// The model's type.
        model_type: &'static str,
    },
    /// A graft without the local shadow it takes its values from.
    #[error(
        "graft {spec}: production takes the local shadow's values, and this trace runs no local shadow"
    )]
    GraftWithoutLocalShadow {
        /// The grafts, as written.
        spec: String,
    },
    /// Stopped before `layer` ([`TraceOptions::stop`]); the run was closed
    /// `incomplete`, with `counters.interrupted`.
    #[error(
        "interrupted before layer {layer}: the run is closed incomplete (counters.interrupted)"
    )]
    Interrupted {
        /// The first layer not traced.
        layer: i64,
    },
}

/// Traces one prompt into `run_dir`; returns the closed run's manifest.
/// (Rows go through the writer's blocking queue; a row it ever drops is
/// counted in the manifest, so `send`'s receipt is not needed here.)
///
/// # Errors
/// A weight that cannot be loaded, or a run that cannot be written.
pub fn trace(
    model: &Model,
    ids: &[i64],
    run_id: &str,
    run_dir: &Path,
    opts: &TraceOptions,
) -> Result<Manifest, TraceRunError> {
    if !opts.grafts.is_empty() && !opts.modes.contains(&Mode::Local) {
        return Err(TraceRunError::GraftWithoutLocalShadow {
            spec: graft::spec(&opts.grafts),
        });
    }
    for g in &opts.grafts {
        g.check(model.config.num_hidden_layers)?;
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
    let rope = model.rope(s);
    let tokens = opts.token_rows(s);
    let tokens_t = Tensor::from_slice(&tokens).to_device(model.device);
    let mut seq = 0_i64;
    let fallbacks = Fallbacks::default();
    let (mut prev_prod, mut prev_free): (Option<Tensor>, Option<Tensor>) = (None, None);
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
        let weights = model.load(&format!("model.layers.{i}."))?;
        let layer = |numerics, planted, fallbacks, graft| {
            opts.decoder_layer(model, i, &weights, numerics, planted, fallbacks, graft)
        };
        let shadow = Numerics::Plain(kind);
        // The local shadow first: a graft hands its values to production.
        let local = (opts.modes.contains(&Mode::Local)).then(|| {
            layer(shadow, false, None, None).forward(
                &h_prod.to_kind(kind),
                &rope,
                prev_prod.as_ref(),
            )
        });
        let sites = GraftSites::at(&opts.grafts, i);
        let graft = local
            .as_ref()
            .filter(|_| sites.any())
            .map(|source| Grafted { source, sites });
        let prod = layer(opts.prod, true, Some(&fallbacks), graft).forward(
            &h_prod,
            &rope,
            prev_prod.as_ref(),
        );
        let free = (opts.modes.contains(&Mode::Free))
            .then(|| layer(shadow, false, None, None).forward(&h_free, &rope, prev_free.as_ref()));
        if opts.layer(i) {
            // layer_in has no shadow: it is the local shadow's own input.
            type Pick = Option<fn(&LayerOutput) -> &Tensor>;
            let sites: [(&str, &Tensor, Pick); 4] = [
                ("layer_in", &h_prod, None),
                ("attn_out", &prod.attn_out, Some(|o| &o.attn_out)),
                ("mlp_out", &prod.mlp_out, Some(|o| &o.mlp_out)),
                ("layer_out", &prod.layer_out, Some(|o| &o.layer_out)),
            ];
            for (site, tensor, pick) in sites {
                // The indexer runs inside attention: its capture (selections,
                // and any non-finite production score) comes before attn_out.
                if site == "attn_out"
                    && opts.site("indexer")
                    && let Some(prod_scores) = prod.index_scores.as_ref()
                {
                    let shadow = local
                        .as_ref()
                        .and_then(|o| o.index_scores.as_ref().map(|s| (s, &o.topk)));
                    let scores = IndexerScores {
                        prod: prod_scores,
                        // What production's own indexer chose, under an indexer graft too.
                        prod_topk: prod.own_topk.as_ref().unwrap_or(&prod.topk),
                        shadow,
                    };
                    record_topk(
                        &writer,
                        seq,
                        i,
                        (c.index_topk, SelectionUnit::TOKEN),
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
                    shadows.extend(free.as_ref().map(|o| ("free", pick(o))));
                }
                record_site(&writer, seq, i, site, tensor, &shadows, &tokens_t, &tokens);
                seq += 1;
            }
        }
        if opts.layer(i) {
            record_kv_sentinels(&writer, seq, i, &prod.kv_latent);
            seq += 1;
        }
        prev_prod = Some(prod.topk.shallow_clone());
        h_prod = prod.layer_out;
        if let Some(free) = free {
            prev_free = Some(free.topk.shallow_clone());
            h_free = free.layer_out;
        }
    }
    if opts.site("logits") {
        let head = model.head()?;
        let logits = |h: &Tensor, kind: Kind| head.logits(h, kind);
        // Logits rows are the recorded tokens.
        let (rows, rows_t) = (&tokens, &tokens_t);
        let prod = stats::top_logits(
            &logits(&h_prod.index_select(0, rows_t), Kind::BFloat16),
            opts.top_n,
        );
        let shadow_stream = if opts.modes.contains(&Mode::Free) {
            &h_free
        } else {
            &h_prod
        };
        let shadow = (!opts.modes.is_empty()).then(|| {
            stats::top_logits(
                &logits(&shadow_stream.index_select(0, rows_t), kind),
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

/// The KV sentinel watch (contexts 000 and 001): production's cache entries
/// of one layer, checked where engines have gone wrong. `kv_slot0_finite`:
/// slot 0, the slot engines reserve for padding rows and a padding row's NaN
/// poisons; `kv_slots_finite`: every slot written, the first non-finite one
/// named. A cache that cannot be read back writes no check, never a pass: it
/// is counted (`kv_sentinel_read_failures`), and leaves the non-finite
/// verdict not judged.
fn record_kv_sentinels(writer: &RunWriter, seq: i64, layer: i64, kv: &Tensor) {
    let read = kv
        .f_isfinite()
        .and_then(|finite| finite.f_logical_not())
        .and_then(|bad| bad.f_sum_dim_intlist(1, false, Kind::Int64))
        .and_then(|per_slot| Vec::<i64>::try_from(&per_slot));
    let Ok(slots) = read else {
        writer.add_counters(&[("kv_sentinel_read_failures", 1)]);
        return;
    };
    let first_bad = slots.iter().position(|&n| n > 0);
    let total: i64 = slots.iter().sum();
    let checks = [
        (
            "kv_slot0_finite",
            slots.first().copied().unwrap_or(0),
            (slots.first().copied().unwrap_or(0) > 0).then_some(0),
            "slot 0 (reserved for padding rows in paged engines)".to_owned(),
        ),
        (
            "kv_slots_finite",
            total,
            first_bad,
            format!(
                "slots 0..{} of the latent cache",
                slots.len().saturating_sub(1)
            ),
        ),
    ];
    for (check, bad, slot, detail) in checks {
        let detail = match slot {
            Some(slot) => format!("{detail}: first non-finite at slot {slot}"),
            None => detail,
        };
        let _ = writer.send(EventRow {
            seq,
            step: 0,
            layer: layer as i32,
            site: "layer_out".to_owned(),
            path: "prod".to_owned(),
            kind: "sentinel".to_owned(),
            token: slot.map(|s| s as i32),
            channel: None,
            count: 1,
            shadow_finite: None,
            check: Some(check.to_owned()),
            passed: Some(bad == 0),
            value: Some(bad as f32),
            detail: Some(detail),
        });
    }
}

#[allow(
    clippy::too_many_arguments,
    reason = "one site's capture: all of it is needed"
)]
fn record_site(
    writer: &RunWriter,
    seq: i64,
    layer: i64,
    site: &str,
    prod: &Tensor,
    shadows: &[(&str, &Tensor)],
    tokens_t: &Tensor,
    tokens: &[i64],
) {
    let first_shadow = shadows.first().map(|(_, t)| *t);
    for (kind, token, channel, count) in stats::nonfinite(prod) {
        let shadow_finite =
            first_shadow.map(|s| s.get(token).isfinite().all().int64_value(&[]) == 1);
        let _ = writer.send(EventRow {
            seq,
            step: 0,
            layer: layer as i32,
            site: site.to_owned(),
            path: "prod".to_owned(),
            kind: kind.to_owned(),
            token: Some(token as i32),
            channel: Some(channel as i32),
            count,
            shadow_finite,
            check: None,
            passed: None,
            value: None,
            detail: None,
        });
    }
    let p = prod.index_select(0, tokens_t);
    let prod_stats = stats::vector_stats(&p);
    let numel = prod.size()[1];
    let per_mode: Vec<(&str, Vec<_>, Vec<_>)> = shadows
        .iter()
        .map(|(mode, s)| {
            let s = s.index_select(0, tokens_t);
            (*mode, stats::vector_stats(&s), stats::comparisons(&p, &s))
        })
        .collect();
    for (j, &token) in tokens.iter().enumerate() {
        let row = |shadow: Option<HiddenShadow>| HiddenRow {
            seq,
            step: 0,
            layer: layer as i32,
            site: site.to_owned(),
            token: token as i32,
            numel,
            prod: prod_stats[j],
            shadow,
        };
        if per_mode.is_empty() {
            let _ = writer.send(row(None));
        }
        for (mode, s_stats, cmp) in &per_mode {
            let _ = writer.send(row(Some(HiddenShadow {
                mode: (*mode).to_owned(),
                stats: s_stats[j],
                comparison: cmp[j],
            })));
        }
    }
}

/// One layer's indexer scores `[S, S]` (query t sees keys s <= t, the rest
/// -inf) and the top-k the layer attended to: production's, and the local
/// shadow's where it ran.
struct IndexerScores<'a> {
    prod: &'a Tensor,
    prod_topk: &'a Tensor,
    shadow: Option<(&'a Tensor, &'a Tensor)>,
}

/// The `indexer` capture `seq` of one layer: a `topk` row per query, and an
/// `events` row per non-finite kind among production's visible scores
/// (token: the first query holding it; channel: its first key), so that a
/// NaN made in the indexer is an onset like any other. `k` and the keys are
/// in `unit`s: query t sees `(t + 1) / unit.tokens` keys (complete k-pools).
fn record_topk(
    writer: &RunWriter,
    seq: i64,
    layer: i64,
    (k, unit): (i64, SelectionUnit),
    scores: &IndexerScores<'_>,
    band: f32,
) -> Result<(), TraceError> {
    let (prod_scores, shadow_scores) = (scores.prod, scores.shadow.map(|(s, _)| s));
    let per_key = i64::from(unit.tokens);
    for (kind, token, key, count) in stats::pooled_indexer_nonfinite(prod_scores, per_key) {
        let shadow_finite = shadow_scores.map(|s| {
            s.get(token)
                .narrow(0, 0, (token + 1) / per_key)
                .isfinite()
                .all()
                .int64_value(&[])
                == 1
        });
        let _ = writer.send(EventRow {
            seq,
            step: 0,
            layer: layer as i32,
            site: "indexer".to_owned(),
            path: "prod".to_owned(),
            kind: kind.to_owned(),
            token: Some(token as i32),
            channel: Some(key as i32),
            count,
            shadow_finite,
            check: None,
            passed: None,
            value: None,
            detail: None,
        });
    }
    let s = prod_scores.size()[0];
    let visible = Tensor::arange_start(1, s + 1, (Kind::Int64, prod_scores.device()))
        .floor_divide_scalar(i64::from(unit.tokens));
    let prod = topk_with_margin(prod_scores, k, &visible)?.attended(scores.prod_topk);
    let shadow = scores
        .shadow
        .map(|(sc, topk)| topk_with_margin(sc, k, &visible).map(|sel| sel.attended(topk)))
        .transpose()?;
    // The relative band in scores, row by row: times the reference's score
    // scale (the shadow's where there is one: production's own, scaled or NaN
    // by the fault being traced, must not widen its band).
    let scale = &shadow.as_ref().unwrap_or(&prod).score_scale;
    let (bands, reach) = (|| -> Result<(Vec<f32>, Tensor), tch::TchError> {
        let bands = scale.f_mul_scalar(f64::from(band))?;
        let reach = bands.f_mul_scalar(f64::from(BAND_STORED))?;
        Ok((
            Vec::<f32>::try_from(bands.f_to_device(tch::Device::Cpu)?)?,
            reach,
        ))
    })()
    .map_err(|source| TraceError::Torch {
        op: "boundary band",
        source,
    })?;
    let prod_rows = prod.rows(prod_scores, Some(&reach))?;
    let mut shadow_rows = match (&shadow, shadow_scores) {
        (Some(sel), Some(sc)) => sel.rows(sc, Some(&reach))?.into_iter().map(Some).collect(),
        _ => vec![None; prod_rows.len()],
    };
    for (t, prod_row) in prod_rows.into_iter().enumerate() {
        let shadow_row = shadow_rows[t].take().map(|sel| ("raw".to_owned(), sel));
        let t = t as i64;
        let _ = writer.send(TopkRow {
            step: 0,
            layer: layer as i32,
            token: t as i32,
            indexer_layer: layer as i32,
            unit,
            k: k as i32,
            visible: ((t + 1) / i64::from(unit.tokens)) as i32,
            prod: prod_row,
            shadow: shadow_row,
            // a dense row, or no finite score to scale by: no band, churn unknown
            boundary_band: Some(bands[t as usize]).filter(|b| b.is_finite()),
        });
    }
    Ok(())
}

/// The manifest's record of a relative boundary band `band`: the band, what
/// it is relative to, and how far the boundary lists reach (relative too).
pub(crate) fn band_settings(settings: &mut serde_json::Map<String, serde_json::Value>, band: f32) {
    settings.insert("boundary_band".to_owned(), f64::from(band).into());
    settings.insert("boundary_band_scale".to_owned(), BAND_SCALE.into());
    settings.insert(
        "boundary_stored".to_owned(),
        (f64::from(band) * f64::from(BAND_STORED)).into(),
    );
}

/// The manifest's `settings.capture_check` of a reference-engine run: not
/// run, and why. The capture self-check catches an adapter that misread an
/// engine's selection; this engine selects from the scores it records
/// itself, so nothing was read. The fields of a check that ran are there,
/// empty, so that a reader of those reads this one (`run` false says it is
/// none).
pub(crate) fn capture_check_not_run(settings: &mut serde_json::Map<String, serde_json::Value>) {
    settings.insert(
        "capture_check".to_owned(),
        serde_json::json!({
            "run": false,
            "why": "the reference engine selects from the scores it records itself: no engine's selection was read, so there is no capture to check",
            "tolerance": 0.0,
            "sources": [],
            "layers": {},
        }),
    );
}

/// The prompt-hash salt of the directory `run_dir` lies in
/// ([`directory_salt`]).
pub(crate) fn runs_dir_salt(run_dir: &Path) -> Vec<u8> {
    directory_salt(run_dir.parent().unwrap_or_else(|| Path::new(".")))
}

/// What production's linears computed, for the manifest's `settings.prod_linears`:
/// the counters that say how each ran follow, the caller closes the list.
pub(crate) fn prod_linears(prod: Numerics) -> String {
    let how = match prod {
        Numerics::Fp8Checkpoint {
            activations,
            scales: ScaleFormat::Fp32,
        } => format!(
            "as the FP8 checkpoint stores them (transformers' fine-grained FP8): the linears it \
             holds in fp8 e4m3 on their stored codes and 128x128 block scales, never \
             re-quantized, times 1x128 activation blocks with fp32 scales (transformers' kernel \
             on Hopper); every other linear in {activations:?}"
        ),
        Numerics::Fp8Checkpoint {
            activations,
            scales: ScaleFormat::Ue8m0,
        } => format!(
            "as the FP8 checkpoint stores them (scale_fmt ue8m0, DeepSeek's reference linear): \
             the linears it holds in fp8 e4m3 on their stored codes and 128x128 block scales, \
             never re-quantized, times 1x128 activation blocks with power-of-two scales \
             2^ceil(log2(max(amax, 1e-4) / 448)) (inference/kernel.py act_quant with scale_fmt \
             set); every other linear in {activations:?}"
        ),
        Numerics::Plain(kind) => format!("{kind:?}, no fp8"),
        Numerics::Fp8 | Numerics::Fp8Emulated => {
            "fp8 e4m3, 1x128 activation and 128x128 weight blocks, ue8m0 scales, every weight \
             re-quantized"
                .to_owned()
        }
    };
    format!(
        "{how}: on CUDA the tensor cores' _scaled_mm, else the exact fp32 emulation (counters \
         fp8_linears_tensor_cores, fp8_linears_emulated; fallbacks fp8_scaled_mm_fallbacks, \
         fp8_quantize_fallbacks,"
    )
}

fn identity(
    model: &Model,
    ids: &[i64],
    run_id: &str,
    salt: &[u8],
    opts: &TraceOptions,
) -> RunIdentity {
    let c = &model.config;
    let mut settings = serde_json::Map::new();
    settings.insert(
        "fp8_indexer".to_owned(),
        opts.fp8_indexer_name.clone().into(),
    );
    band_settings(&mut settings, opts.band);
    capture_check_not_run(&mut settings);
    settings.insert("tokens".to_owned(), opts.tokens_setting.clone());
    settings.insert(
        "prod_linears".to_owned(),
        format!("{} fp8_indexer_fallbacks)", prod_linears(opts.prod)).into(),
    );
    let model_id = ModelId {
        name: opts.model_name.clone(),
        architecture: c.model_type.clone(),
        config_hash: config_hash(&model.config_bytes),
        revision: None,
        num_layers: u32::try_from(c.num_hidden_layers).unwrap_or(0),
        index_topk: u32::try_from(c.index_topk).ok(),
    };
    let conventions = reference_conventions(c, model.arch, opts.fp8_indexer, &opts.deviations);
    let deviations = opts
        .deviations
        .iter()
        .map(|d| {
            let fp8_linears = !matches!(opts.prod, crate::model::Numerics::Plain(_));
            d.manifest_entry(&d.effect(c, opts.fp8_indexer, fp8_linears, &opts.deviations))
        })
        .collect();
    reference_identity(
        run_id,
        model_id,
        &opts.fp8_indexer_name,
        settings,
        (ids, salt),
        opts,
        (conventions, deviations),
    )
}

/// The identity of a reference-engine run: what GLM-5, DeepSeek-V3.2 and
/// GLM-5.3-Flash traces share, around the model, the engine variant, the
/// settings and the conventions and deviations each engine derives.
fn reference_identity(
    run_id: &str,
    model: ModelId,
    variant: &str,
    settings: serde_json::Map<String, serde_json::Value>,
    (ids, salt): (&[i64], &[u8]),
    opts: &TraceOptions,
    (conventions, deviations): (Vec<Convention>, Vec<serde_json::Value>),
) -> RunIdentity {
    let ids_u32: Vec<u32> = ids.iter().map(|&i| u32::try_from(i).unwrap_or(0)).collect();
    RunIdentity {
        run_id: run_id.to_owned(),
        model,
        engine: Engine {
            name: "shadowtrace-reference".to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            commit: None,
            variant: Some(variant.to_owned()),
        },
        device: default_device(),
        dtypes: Dtypes {
            prod: "fp8_e4m3".to_owned(),
            shadow: (!opts.modes.is_empty()).then(|| opts.precision_name().to_owned()),
            other: std::collections::BTreeMap::new(),
        },
        parallelism: Parallelism::SINGLE,
        shadow: Shadow {
            precision: (!opts.modes.is_empty()).then(|| opts.precision_name().to_owned()),
            modes: opts.modes.iter().map(|m| m.name().to_owned()).collect(),
        },
        prompt: Prompt {
            kind: opts.prompt_kind.clone(),
            length: ids.len() as u64,
            token_hash: token_hash(salt, &ids_u32),
            salt_id: Some(salt_id(salt)),
        },
        settings,
        tags: {
            let mut tags = opts.tags.clone();
            if !opts.grafts.is_empty() {
                tags.insert("graft".to_owned(), graft::spec(&opts.grafts));
            }
            tags
        },
        injections: opts
            .faults
            .iter()
            .filter_map(|f| serde_json::to_value(f).ok())
            .collect(),
        conventions,
        deviations,
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::record_kv_sentinels;
    use crate::synth::SynthSpec;
    use crate::writer::{RunWriter, WriterOptions};

    fn sentinels_of(kv: &Tensor) -> shadowtrace_schemas::Manifest {
        let tmp = tempfile::tempdir().unwrap();
        let spec = SynthSpec::demo("sentinels");
        let writer = RunWriter::create(
            &tmp.path().join("run"),
            spec.identity(),
            WriterOptions::default(),
        )
        .unwrap();
        record_kv_sentinels(&writer, 0, 0, kv);
        writer.close().unwrap()
    }

    #[test]
    fn a_cache_that_cannot_be_read_is_counted_and_writes_no_passed_check() {
        // One dimension where the cache has two: the per-slot count cannot be taken.
        let manifest = sentinels_of(&Tensor::zeros([8], (Kind::Float, Device::Cpu)));
        assert_eq!(manifest.counters.get("kv_sentinel_read_failures"), Some(&1));
        assert_eq!(manifest.tables["events"].rows, 0, "no check is written");
    }

    #[test]
    fn a_readable_cache_writes_both_checks_and_counts_no_failure() {
        let kv = Tensor::zeros([4, 8], (Kind::Float, Device::Cpu));
        let _ = kv.get(2).get(3).fill_(f64::NAN);
        let manifest = sentinels_of(&kv);
        assert!(!manifest.counters.contains_key("kv_sentinel_read_failures"));
        assert_eq!(manifest.tables["events"].rows, 2);
    }
}
