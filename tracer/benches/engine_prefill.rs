//! Reference-engine prefill time: seconds per 1k prompt tokens for the
//! production path (FP8 linears, FP8 indexer) and the fp32 shadow, on a
//! GLM-5.1-shaped config at full width with a few layers (the first dense,
//! the others MoE with 256 experts), random weights generated on the device
//! one layer at a time. On CUDA production runs twice, its FP8 GEMMs (linears
//! and indexer) emulated in fp32 and on the tensor cores (`_scaled_mm`), and
//! their ratio is printed: all figures from one run.
//!
//! On CUDA it also attributes the difference between the two production
//! GEMMs, layer by layer from the same input: how far attention and MLP
//! outputs move, how many query rows' indexer top-k and how many tokens'
//! MoE routing the tiny GEMM differences flip.
//!
//! Run (release, without the demo's polars):
//! `cargo bench -p shadowtrace-tracer --no-default-features --bench engine_prefill`
//! Environment: `SHADOWTRACE_BENCH_TOKENS` (default 8192), `SHADOWTRACE_BENCH_LAYERS`
//! (default 3), `SHADOWTRACE_BENCH_SMALL=1` for the demo's small widths (a CPU check).

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]
#![allow(
    clippy::expect_used,
    reason = "a benchmark with a fixed, valid configuration"
)]

use std::time::Instant;

use serde_json::json;
use shadowtrace_tracer::indexer::{DotProduct, Fp8Indexer};
use shadowtrace_tracer::model::layer::Weights;
use shadowtrace_tracer::model::rope::Rope;
use shadowtrace_tracer::model::{Architecture, Layer, ModelConfig, Numerics, synthetic};
use tch::{Device, Kind, Tensor};

fn env(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(layers: i64, small: bool) -> ModelConfig {
    let mut c = synthetic::glm51_config(layers);
    if !small {
        // GLM-5.1's widths (transformers' GlmMoeDsaConfig defaults).
        let full = json!({
            "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
            "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 256,
            "num_experts_per_tok": 8, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
            "qk_rope_head_dim": 64, "v_head_dim": 256, "index_n_heads": 32, "vocab_size": 154880,
        });
        for (k, v) in full.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
    }
    serde_json::from_value(c).expect("a valid config")
}

/// One layer's weights, fp32 normal(0, 0.02) on the device (shapes as
/// `synthetic::write` writes them).
fn weights(c: &ModelConfig, layer: i64, device: Device) -> Weights {
    let n = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, device)) * 0.02;
    let ones = |k: i64| Tensor::ones([k], (Kind::Float, device));
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let mut w = Weights::new();
    let mut put = |name: &str, t: Tensor| {
        w.insert(name.to_owned(), t);
    };
    put("input_layernorm.weight", ones(h));
    put("post_attention_layernorm.weight", ones(h));
    put("self_attn.q_a_proj.weight", n(&[c.q_lora_rank, h]));
    put("self_attn.q_a_layernorm.weight", ones(c.q_lora_rank));
    put(
        "self_attn.q_b_proj.weight",
        n(&[heads * c.qk_head_dim(), c.q_lora_rank]),
    );
    put(
        "self_attn.kv_a_proj_with_mqa.weight",
        n(&[c.kv_lora_rank + c.qk_rope_head_dim, h]),
    );
    put("self_attn.kv_a_layernorm.weight", ones(c.kv_lora_rank));
    put(
        "self_attn.kv_b_proj.weight",
        n(&[heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank]),
    );
    put("self_attn.o_proj.weight", n(&[h, heads * c.v_head_dim]));
    put(
        "self_attn.indexer.wq_b.weight",
        n(&[c.index_n_heads * c.index_head_dim, c.q_lora_rank]) * 8.0,
    );
    put(
        "self_attn.indexer.wk.weight",
        n(&[c.index_head_dim, h]) * 8.0,
    );
    put("self_attn.indexer.k_norm.weight", ones(c.index_head_dim));
    put(
        "self_attn.indexer.k_norm.bias",
        ones(c.index_head_dim) * 0.0,
    );
    put(
        "self_attn.indexer.weights_proj.weight",
        n(&[c.index_n_heads, h]),
    );
    let mut mlp = |prefix: String, inter: i64| {
        put(&format!("{prefix}.gate_proj.weight"), n(&[inter, h]));
        put(&format!("{prefix}.up_proj.weight"), n(&[inter, h]));
        put(&format!("{prefix}.down_proj.weight"), n(&[h, inter]));
    };
    if c.is_moe(layer) {
        for e in 0..c.n_routed_experts {
            mlp(format!("mlp.experts.{e}"), c.moe_intermediate_size);
        }
        mlp(
            "mlp.shared_experts".to_owned(),
            c.moe_intermediate_size * c.n_shared_experts,
        );
        w.insert("mlp.gate.weight".to_owned(), n(&[c.n_routed_experts, h]));
        w.insert(
            "mlp.gate.e_score_correction_bias".to_owned(),
            n(&[c.n_routed_experts]),
        );
    } else {
        mlp("mlp".to_owned(), c.intermediate_size);
    }
    w
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn main() {
    let device = Device::cuda_if_available();
    let (tokens, layers) = (
        env("SHADOWTRACE_BENCH_TOKENS", 8192),
        env("SHADOWTRACE_BENCH_LAYERS", 3),
    );
    let small = env("SHADOWTRACE_BENCH_SMALL", 0) == 1;
    let c = config(layers, small);
    tch::manual_seed(0);
    let positions = Tensor::arange(tokens, (Kind::Int64, device));
    let rope = Rope::new(&c.rope(), c.qk_rope_head_dim, 202_752.0, &positions, device);
    let x = Tensor::randn([tokens, c.hidden_size], (Kind::Float, device));
    let mut variants = vec![(
        "fp8 prod, emulated",
        Numerics::Fp8Emulated,
        DotProduct::Emulated,
    )];
    if device.is_cuda() {
        variants.push((
            "fp8 prod, _scaled_mm linears",
            Numerics::Fp8,
            DotProduct::Emulated,
        ));
        variants.push((
            "fp8 prod, _scaled_mm all",
            Numerics::Fp8,
            DotProduct::ScaledMm,
        ));
    }
    variants.push((
        "fp32 shadow",
        Numerics::Plain(Kind::Float),
        DotProduct::Emulated,
    ));
    variants.push((
        "bf16 shadow",
        Numerics::Plain(Kind::BFloat16),
        DotProduct::Emulated,
    ));
    let mut seconds = vec![0.0_f64; variants.len()];
    // The last layer's output of each production variant, to compare.
    let mut outputs: Vec<Option<Tensor>> = (0..variants.len()).map(|_| None).collect();
    // Per layer, the emulated and the _scaled_mm-linears outputs, to attribute.
    let mut attribution: Vec<Attribution> = Vec::new();
    tch::no_grad(|| {
        for i in 0..layers {
            let w = weights(&c, i, device);
            for (j, (_, numerics, dot)) in variants.iter().enumerate() {
                let mut indexer = Fp8Indexer::trtllm();
                indexer.dot = *dot;
                let layer = Layer {
                    config: &c,
                    arch: Architecture::Glm,
                    index: i,
                    weights: &w,
                    numerics: *numerics,
                    fp8_indexer: Some(indexer),
                    faults: &[],
                    deviations: &[],
                    fallbacks: None,
                    graft: None,
                };
                // One warm-up pass, then the median of three timed passes.
                let _ = layer.forward(&x, &rope, None);
                let mut times = Vec::new();
                for _ in 0..3 {
                    sync(device);
                    let started = Instant::now();
                    let out = layer.forward(&x, &rope, None);
                    sync(device);
                    times.push(started.elapsed().as_secs_f64());
                    outputs[j] = Some(out.layer_out.to_kind(Kind::Float));
                }
                times.sort_by(f64::total_cmp);
                seconds[j] += times[1];
                if device.is_cuda() && j <= 1 {
                    let out = layer.forward(&x, &rope, None);
                    if j == 0 {
                        // The control: the emulation itself on an input moved by one GEMM's
                        // accumulation error (per-row relative 1.3e-4, measured on the H200
                        // by cuda_matches_cpu). If it moves the layer as far as the tensor
                        // cores do, the layer amplifies any such error: no scale bug needed.
                        let noise = Tensor::randn_like(&x)
                            * (1.3e-4 / (c.hidden_size as f64).sqrt())
                            * x.norm_scalaropt_dim(2, [-1], true);
                        let nudged = layer.forward(&(&x + noise), &rope, None);
                        let mut a = Attribution::new(i, out);
                        a.control = Some(rel_l2(&nudged.layer_out, &a.emulated.layer_out));
                        attribution.push(a);
                    } else if let Some(a) = attribution.last_mut() {
                        a.compare(&out);
                    }
                }
            }
        }
    });
    let widths = if small {
        "the demo's small widths"
    } else {
        "GLM-5.1 widths"
    };
    println!(
        "reference engine prefill, {widths}, {layers} layers ({} MoE), {tokens} tokens, {device:?}",
        layers - 1
    );
    for ((name, ..), s) in variants.iter().zip(&seconds) {
        println!(
            "  {name:32} {:8.3} s per 1k tokens  ({s:.2} s)",
            s / tokens as f64 * 1000.0
        );
    }
    if device.is_cuda() {
        println!(
            "  production through _scaled_mm (linears and indexer) against emulation: {:.2}x the speed",
            seconds[0] / seconds[2]
        );
        // Per token: a token whose MoE routing or top-k flips dominates a max.
        let rel = |a: &Tensor, b: &Tensor| {
            let per_token =
                (a - b).norm_scalaropt_dim(2, [-1], false) / b.norm_scalaropt_dim(2, [-1], false);
            (
                per_token.median().double_value(&[]),
                per_token.max().double_value(&[]),
            )
        };
        println!(
            "  where the linears' difference goes (per layer, same input; _scaled_mm linears against emulation):"
        );
        for a in &attribution {
            println!("    {}", a.line.as_deref().unwrap_or("-"));
        }
        if let (Some(emulated), Some(linears), Some(all)) = (&outputs[0], &outputs[1], &outputs[2])
        {
            for (name, out) in [
                ("_scaled_mm linears", linears),
                ("_scaled_mm linears and indexer", all),
            ] {
                let (median, max) = rel(out, emulated);
                println!(
                    "  last layer, {name} against emulation: per-token relative L2 median {median:.2e}, max {max:.2e}"
                );
            }
        }
    }
}

/// Per-token relative L2 of `a` against `b` `[S, N]`: median and max.
fn rel_l2(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
    let per_token =
        (&a - &b).norm_scalaropt_dim(2, [-1], false) / b.norm_scalaropt_dim(2, [-1], false);
    (
        per_token.median().double_value(&[]),
        per_token.max().double_value(&[]),
    )
}

/// One layer's emulated outputs, then the line comparing the other path's.
struct Attribution {
    layer: i64,
    emulated: shadowtrace_tracer::model::LayerOutput,
    /// The emulation's layer_out moved by a GEMM-sized nudge of its input.
    control: Option<(f64, f64)>,
    line: Option<String>,
}

impl Attribution {
    fn new(layer: i64, emulated: shadowtrace_tracer::model::LayerOutput) -> Attribution {
        Attribution {
            layer,
            emulated,
            control: None,
            line: None,
        }
    }

    fn compare(&mut self, other: &shadowtrace_tracer::model::LayerOutput) {
        let e = &self.emulated;
        let (attn, _) = rel_l2(&other.attn_out, &e.attn_out);
        let (mlp, _) = rel_l2(&other.mlp_out, &e.mlp_out);
        let (out, out_max) = rel_l2(&other.layer_out, &e.layer_out);
        // Rows whose selected key set differs, and the mean share of keys kept.
        let rows = e.topk.size()[0];
        let sorted = |t: &Tensor| t.sort(-1, false).0;
        let same_rows = sorted(&other.topk)
            .eq_tensor(&sorted(&e.topk))
            .all_dim(-1, false)
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        let routing = match (&other.experts, &e.experts) {
            (Some(a), Some(b)) => {
                let flipped = sorted(a)
                    .eq_tensor(&sorted(b))
                    .all_dim(-1, false)
                    .logical_not()
                    .to_kind(Kind::Float)
                    .mean(Kind::Float)
                    .double_value(&[]);
                format!("MoE routing changed for {:.2}% of tokens", 100.0 * flipped)
            }
            _ => "dense MLP".to_owned(),
        };
        self.line = Some(format!(
            "layer {}: attn_out {attn:.2e}, mlp_out {mlp:.2e}, layer_out {out:.2e} (max {out_max:.2e}); \
             indexer top-k changed on {:.2}% of {rows} rows; {routing}; the emulation alone with its \
             input nudged by 1.3e-4: layer_out {:.2e} (max {:.2e})",
            self.layer,
            100.0 * (1.0 - same_rows),
            self.control.map_or(f64::NAN, |c| c.0),
            self.control.map_or(f64::NAN, |c| c.1),
        ));
    }
}
