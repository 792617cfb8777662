//! Kimi delta attention (`Glm5NextTextLinearAttention`, a prefill without a
//! cache): q, k, v projections through a causal depthwise convolution and
//! SiLU, a per-channel forget gate and a per-head write strength, then the
//! delta rule over a `[heads, dk, dv]` state in fp32, a gated RMSNorm and
//! the output projection.
//!
//! The state is run token by token (transformers' `recurrent_kimi_delta_attention`
//! update). Its prefill uses the chunked form of the same recurrence
//! (`chunk_kimi_delta_attention`, chunks of 64): equal in exact arithmetic,
//! not in rounding, so the two agree within the per-layer tolerance, not bitwise.

use tch::{Kind, Tensor};

use super::ops::Ops;

/// KDA on the normalised block input `x` `[S, hidden]`; `[S, hidden]` out.
pub fn forward(ops: &Ops<'_>, x: &Tensor) -> Tensor {
    let c = ops.config;
    let s = x.size()[0];
    let (heads, dim) = (c.linear_num_heads, c.linear_head_dim);
    let kind = ops.kind();
    let project = |name: &str| {
        let y = ops.linear(x, &format!("self_attn.{name}_proj"));
        conv_silu(&y, ops.w(&format!("self_attn.{name}_conv1d.weight"))).view([s, heads, dim])
    };
    let (q, k, v) = (project("q"), project("k"), project("v"));
    let g = forget_gate(ops, x); // [S, H, dk] fp32, log decay
    let beta = ops.linear(x, "self_attn.b_proj").sigmoid(); // [S, H]
    let out = delta_rule(&q, &k, &v, &g, &beta).to_kind(kind); // [S, H, dv]
    let gate = ops
        .linear(&ops.linear(x, "self_attn.g_a_proj"), "self_attn.g_b_proj")
        .view([s, heads, dim]);
    // Gated RMSNorm per head, strictly fp32, back to the activations' kind.
    let of = out.to_kind(Kind::Float);
    let normed = &of * (of.square().mean_dim(-1, true, Kind::Float) + c.rms_norm_eps).rsqrt();
    let normed = ops.w("self_attn.o_norm.weight") * normed * gate.to_kind(Kind::Float).sigmoid();
    ops.linear(
        &normed.to_kind(kind).reshape([s, heads * dim]),
        "self_attn.o_proj",
    )
}

/// The causal depthwise convolution (weight `[C, 1, K]`, kept in fp32 by
/// transformers) over `y` `[S, C]`, then SiLU in fp32, back to `y`'s kind.
fn conv_silu(y: &Tensor, weight: &Tensor) -> Tensor {
    let (s, width) = (y.size()[0], weight.size()[2]);
    let input = y.to_kind(Kind::Float).tr().unsqueeze(0); // [1, C, S]
    let channels = input.size()[1];
    input
        .conv1d(weight, None::<Tensor>, [1], [width - 1], [1], channels)
        .narrow(2, 0, s)
        .silu()
        .squeeze_dim(0)
        .tr()
        .to_kind(y.kind())
}

/// `Glm5NextTextForgetGate`: the per-channel log decay `[S, H, dk]` (fp32),
/// bounded below by `linear_lower_bound` when set (the shipped default),
/// else `-exp(A_log) * softplus`.
fn forget_gate(ops: &Ops<'_>, x: &Tensor) -> Tensor {
    let c = ops.config;
    let s = x.size()[0];
    let (heads, dim) = (c.linear_num_heads, c.linear_head_dim);
    let f = ops.linear(&ops.linear(x, "self_attn.f_a_proj"), "self_attn.f_b_proj");
    let g =
        (f.to_kind(Kind::Float) + ops.w("self_attn.dt_bias").view([1, -1])).view([s, heads, dim]);
    let decay = ops.w("self_attn.A_log").exp().view([1, heads, 1]);
    match c.linear_lower_bound {
        Some(bound) => (decay * g).sigmoid() * bound,
        None => {
            // softplus, linear past 20 as transformers writes it
            let soft = g.where_self(&g.gt(20.0), &(g.exp() + 1.0).log());
            -(decay * soft)
        }
    }
}

/// The delta rule in fp32 with q and k L2-normalised (FLA's `+ eps` inside
/// the root) and q scaled by `dk^-1/2`; returns `[S, H, dv]` fp32.
fn delta_rule(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor) -> Tensor {
    let l2 = |t: &Tensor| {
        let t = t.to_kind(Kind::Float);
        &t / (t.square().sum_dim_intlist(-1, true, Kind::Float) + 1e-6).sqrt()
    };
    let dk = q.size()[2];
    let q = l2(q) * (dk as f64).powf(-0.5);
    let k = l2(k);
    let v = v.to_kind(Kind::Float);
    let beta = beta.to_kind(Kind::Float);
    let (s, heads, dv) = (v.size()[0], v.size()[1], v.size()[2]);
    let mut state = Tensor::zeros([heads, dk, dv], (Kind::Float, v.device()));
    let mut outs = Vec::with_capacity(s as usize);
    for t in 0..s {
        let (q_t, k_t, v_t) = (q.get(t), k.get(t), v.get(t)); // [H, d]
        state *= g.get(t).exp().unsqueeze(-1);
        let remembered = (&state * k_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float);
        let delta = (v_t - remembered) * beta.get(t).unsqueeze(-1);
        state += k_t.unsqueeze(-1) * delta.unsqueeze(-2);
        outs.push((&state * q_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float));
    }
    Tensor::stack(&outs, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delta_rule_overwrites_what_a_key_held_instead_of_adding_to_it() {
        // One head, dk = dv = 4, no decay (g = 0), full write strength (beta = 1).
        // Tokens 0 and 1 write values under one-hot keys e0 and e1; token 2 writes
        // a new value under e0 again. Each token queries with its own key, so it
        // reads back exactly what it wrote (scaled by dk^-1/2 and the L2 norm's eps).
        let key = |i: usize| {
            let mut v = [0.0_f32; 4];
            v[i] = 1.0;
            v
        };
        let keys: Vec<f32> = [key(0), key(1), key(0)].concat();
        let values: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0, 7.0, -3.0, 1.0, 0.0];
        let k = Tensor::from_slice(&keys).view([3, 1, 4]);
        let v = Tensor::from_slice(&values).view([3, 1, 4]);
        let g = Tensor::zeros([3, 1, 4], (Kind::Float, tch::Device::Cpu));
        let beta = Tensor::ones([3, 1], (Kind::Float, tch::Device::Cpu));
        let out = delta_rule(&k, &k, &v, &g, &beta).view([3, 4]);
        let unit = 1.0 / (1.0_f64 + 1e-6).sqrt(); // l2norm's `+ eps` inside the root
        // A key of norm `unit` writes `v - unit * held`, read back times `unit / 2`.
        let expected = Tensor::from_slice(&values).view([3, 4]) * (unit * unit * 0.5);
        // Token 2 replaced token 0's value: it reads 7, -3, 1, 0, not their sum with 1, 2, 3, 4
        // (up to the eps of the key's norm, which leaves 1e-6 of the old value).
        assert!(out.allclose(&expected, 1e-5, 1e-5, false), "{out}");
    }
}
