"""HF transformers `deepseek_v4`: DeepSeek-V4 (`DeepseekV4ForCausalLM`), transformers 5.24.0.

Every layer attends over a sliding window of raw keys plus, in compressed layers, keys
compressed `compress_rate` tokens to one: heavily compressed attention (HCA) attends to
all of its compressed entries, compressed sparse attention (CSA) to the `index_topk`
entries its Lightning Indexer selects. The residual stream is `hc_mult` hyper-connection
streams ([B, S, streams, hidden]); a token's hidden vector is all of them.

- hidden states at every site of every layer, the local and free shadows, the logits (the
  shadow through `hc_head`, the final norm and the LM head): `hf._Tracer`'s, through the
  generic adapter's structure; position embeddings (the `main` and `compress` RoPE of the
  model's rotary module) recomputed in the shadow precision;
- the CSA indexer's selections in compressed units: `unit` compressed, `unit_tokens` = the
  CSA compress rate, `k` = index_topk, `visible` = entries whose window closed at or before
  the query, keys = entry indices. Production's scores are its scorer's own output (a
  hook on `indexer.scorer`: the same compressed keys, cached prefix included); the shadow
  recomputes the indexer's compressor (both overlapping series, the gate softmax, the
  norm, RoPE at each window's first position), its query and its head weights in the
  shadow precision from the layer's hidden states;
- no KV sentinel watch: a sliding window's slots are not positions.
"""

from typing import Any

import torch

from shadowtrace_hooks import dequant, numerics, shadow
from shadowtrace_hooks.adapters import hf, hf_prefix
from shadowtrace_hooks.adapters.hf_generic import GenericTracer
from shadowtrace_hooks.adapters.layout import Layout, Symbol, select

NAME = hf.NAME
MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"
LAYOUTS = (
    Layout(
        name="cache=",
        source="transformers 5.24.0",
        symbols=(
            Symbol(MODULE, "DeepseekV4ForCausalLM.forward",
                   ("self", "input_ids", "attention_mask", "position_ids", "cache"), leading=True),
            Symbol(MODULE, "DeepseekV4DecoderLayer.forward",
                   ("self", "hidden_states", "input_ids", "kwargs")),
            Symbol(MODULE, "DeepseekV4Indexer.forward",
                   ("self", "hidden_states", "q_residual", "position_ids", "cache", "layer_idx")),
            Symbol(MODULE, "DeepseekV4IndexerScorer.forward",
                   ("self", "q", "compressed_kv", "hidden_states")),
            Symbol(MODULE, "DeepseekV4RotaryEmbedding.forward", ("self", "x", "position_ids", "layer_type")),
            Symbol(MODULE, "apply_rotary_pos_emb", ("x", "cos", "sin", "unsqueeze_dim")),
            Symbol(MODULE, "DeepseekV4HyperHead.forward", ("self", "x")),
        ),
    ),
)  # fmt: skip
UNIT = "compressed"


def install(module: Any) -> None:
    cls = module.DeepseekV4ForCausalLM
    if getattr(cls, "_shadowtrace_patched", False):
        return
    layout = select(LAYOUTS, {MODULE: module}, f"{NAME} {hf._version()}")
    hf.patch(cls, layout, DeepseekV4Tracer, module.apply_rotary_pos_emb)
    module._shadowtrace_layout = layout


class DeepseekV4Tracer(GenericTracer):
    TRACES_INDEXERS = True
    CAPTURE_CHECK_NOT_RUN = (
        "not calibrated on DeepSeek-V4's CSA selection in compressed units: production's scorer "
        "scores are recorded, never checked against its selection"
    )

    def __init__(self, model: torch.nn.Module, sess: Any, rope: Any, inputs: Any) -> None:
        super().__init__(model, sess, rope, inputs)
        self.scores: dict[int, torch.Tensor] = {}  # layer -> production's scores of this call
        for i, layer in enumerate(self.inner.layers):
            indexer = self._indexer_module(layer)
            if indexer is not None:
                indexer.scorer.register_forward_hook(
                    lambda m, a, out, i=i: self._hook("scorer", self._scorer, i, out)
                )

    def _indexer_module(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        return getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)

    def _head(self) -> list[torch.nn.Module]:
        return [self.inner.hc_head, self.inner.norm, self.model.lm_head]

    def _record_sentinels(self, layer: int, step: hf._Step) -> None:
        return

    def _shadow_pe(self, step: hf._Step) -> Any:
        """The `main` and `compress` RoPE tables of this step's positions in the shadow
        precision, as the model hands them to its layers."""
        if step.shadow_pe is None:
            like = torch.empty(0, dtype=self.dtype, device=step.positions.device)
            with shadow.hooks_suspended(self.rotary):
                step.shadow_pe = {
                    kind: self.rotary.forward(like, step.positions, layer_type=kind)
                    for kind in ("main", "compress")
                }  # type: ignore[assignment]
        return step.shadow_pe

    def _scorer(self, layer: int, output: torch.Tensor) -> None:
        self.scores[layer] = output.detach()

    def _indexer(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        scores = self.scores.pop(layer, None)
        if not self.settings.layer(layer) or not self.settings.site("indexer"):
            return
        step = self.step
        assert step is not None
        names = ("hidden_states", "q_residual", "position_ids", "cache", "layer_idx")
        bound = dict(zip(names, args, strict=False)) | kwargs
        ratio, k = module.compress_rate, module.index_topk
        shadows = {}
        if self.dtype is not None:
            shadows = self.sess.guarded(
                f"indexer_shadow:{layer}", self.runs[0], self._shadow, layer, module,
                bound["hidden_states"], bound["q_residual"],
            ) or {}  # fmt: skip
        selected = output.detach()
        for b, run in enumerate(self.runs):
            q_pos = step.positions[b]
            positions = step.positions_host[b]
            visible = torch.div(q_pos + 1, ratio, rounding_mode="floor")
            row = None
            if scores is not None and scores.shape[-1] > 0:
                row = (
                    scores[b]
                    .float()
                    .masked_fill(~numerics.causal_mask(visible - 1, scores.shape[-1]), float("-inf"))
                )
                run.indexer_events(layer, row, visible - 1, positions)
            row_shadows = {"raw": shadows[b]} if b in shadows else {}
            run.topk(layer, layer, k, positions, q_pos, selected[b], row, row_shadows,
                     unit=UNIT, unit_tokens=ratio, visible=(positions + 1) // ratio)  # fmt: skip

    def _shadow(
        self, layer: int, module: torch.nn.Module, hidden: torch.Tensor, q_residual: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """Each batch row's shadow scores: the indexer's compressed keys over every token
        of the request so far, its query and head weights, in the shadow precision."""
        step = self.step
        assert step is not None
        with shadow.full_fp32():  # no TF32 or reduced-precision sums, whatever the engine set
            dtype, ratio, dim = self.dtype, module.compress_rate, module.head_dim
            # FP8 projections on their codes times their scales (dequant.weight)
            kv = shadow.linear(hidden, dequant.weight(module.kv_proj), dtype)
            gate = shadow.linear(hidden, dequant.weight(module.gate_proj), dtype)
            q = shadow.linear(q_residual, dequant.weight(module.q_b_proj), dtype)
            q = q.view(*hidden.shape[:2], -1, dim)
            w = (
                shadow.linear(hidden, dequant.weight(module.scorer.weights_proj), dtype).float()
                * module.scorer.weights_scaling
            )
            out = {}
            with shadow.hooks_suspended(module.rotary_emb):
                how = shadow.projection_path(q_residual, module.q_b_proj, dtype)
                for b, run in enumerate(self.runs):
                    shadow.record_kernel(run, "shadow_indexer_projections", how)
                    if hf_prefix.CACHED_PREFIX in run.state:
                        continue  # the prefix's hidden states were never seen
                    state = run.state.setdefault(("compressed_shadow", layer), [[], []])
                    state[0].append(kv[b])
                    state[1].append(gate[b])
                    keys = self._compress(module, torch.cat(state[0]), torch.cat(state[1]))
                    if keys.shape[0] == 0:
                        continue
                    positions = step.positions[b][None]
                    cos, sin = module.rotary_emb.forward(q[b], positions, layer_type=module.rope_layer_type)
                    q_rot = self.rope(q[b][None].transpose(1, 2), cos, sin).transpose(1, 2)[0]
                    visible = torch.div(step.positions[b] + 1, ratio, rounding_mode="floor")
                    scores = shadow.indexer_scores(
                        run, q_rot, keys, w[b], visible - 1, module.scorer.softmax_scale
                    )
                    out[b] = scores
            return out

    def _compress(self, module: Any, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The indexer's compressed keys [windows, D] of one row's projected kv and gate
        [T, 2D]: window w mixes the previous window's first series with its own second one
        by a per-channel softmax of the gates (plus the position bias), then the norm and
        RoPE at the window's first token."""
        ratio, dim = module.compress_rate, module.head_dim
        n = kv.shape[0] // ratio
        if n == 0:
            return kv.new_zeros(0, dim)
        chunk_kv = kv[: n * ratio].view(n, ratio, 2 * dim)
        chunk_gate = gate[: n * ratio].view(n, ratio, 2 * dim) + module.position_bias.to(gate.dtype)
        mixed_kv = chunk_kv.new_zeros(n, 2 * ratio, dim)
        mixed_gate = chunk_gate.new_full((n, 2 * ratio, dim), float("-inf"))
        mixed_kv[:, ratio:], mixed_gate[:, ratio:] = chunk_kv[..., dim:], chunk_gate[..., dim:]
        mixed_kv[1:, :ratio], mixed_gate[1:, :ratio] = chunk_kv[:-1, :, :dim], chunk_gate[:-1, :, :dim]
        pooled = (mixed_kv * mixed_gate.softmax(dim=1)).sum(dim=1)
        norm = module.kv_norm
        pooled = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        pooled = pooled * norm.weight.to(pooled.dtype)
        positions = (torch.arange(n, device=kv.device) * ratio)[None]
        cos, sin = module.rotary_emb.forward(pooled, positions, layer_type=module.rope_layer_type)
        return self.rope(pooled[None, None], cos, sin)[0, 0]
