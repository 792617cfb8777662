"""HF transformers `glm5_next`: GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, its text
decoder traced), transformers 5.24.0.

The decoder interleaves Kimi delta attention (KDA, recurrent state) with MLA layers whose
DSA indexer selects over k-pools: it scores pooled keys (each pool a learned softmax-weighted
mean of `index_kpool` consecutive tokens' keys), keeps the top `index_topk // index_kpool`
complete pools visible to the query, expands them to their tokens and appends the query's
incomplete pool. The residual stream is `hc_mult` hyper-connection streams
([B, S, streams, hidden]); a token's hidden vector is all of them. No RoPE anywhere
(`qk_rope_head_dim = 0`).

- hidden states at every site of every layer (KDA and MLA), the local and free shadows,
  the logits (the shadow through `hc_head`, the final norm and the LM head): `hf._Tracer`'s,
  through the generic adapter's structure;
- the indexer's selections in pool units: `unit` kpool, `unit_tokens` = index_kpool, `k` =
  index_topk // index_kpool, `visible` = complete pools the query sees, keys = pool
  indices. Production's pools are read from the indices it returned (its tail excluded);
  its scores for the k-th score and margins are HF's pooled keys (`get_pooled_states`, the
  module's own) against its query in production's precision; the shadow recomputes
  projections, pooling and scores in the shadow precision from the same inputs.
  Pools start at a row's first valid key, as HF's do.
- the KV sentinel watch on MLA layers (latents and the indexer's packed keys); KDA layers
  hold recurrent state, not slots.
"""

from typing import Any

import torch
import torch.nn.functional as F

from shadowtrace_hooks import dequant, numerics, shadow
from shadowtrace_hooks.adapters import hf, hf_prefix
from shadowtrace_hooks.adapters.hf_generic import GenericTracer
from shadowtrace_hooks.adapters.layout import Layout, Symbol, select

NAME = hf.NAME
MODULE = "transformers.models.glm5_next.modeling_glm5_next"
LAYOUTS = (
    Layout(
        name="cache=",
        source="transformers 5.24.0",
        symbols=(
            Symbol(MODULE, "Glm5NextForConditionalGeneration.forward",
                   ("self", "input_ids", "attention_mask", "position_ids", "cache"), leading=True),
            Symbol(MODULE, "Glm5NextTextDecoderLayer.forward",
                   ("self", "hidden_states", "attention_mask", "position_ids", "cache", "use_cache",
                    "position_embeddings", "prev_topk_indices"), leading=True),
            Symbol(MODULE, "Glm5NextTextIndexer.forward",
                   ("self", "hidden_states", "q_resid", "attention_mask", "cache")),
            Symbol(MODULE, "Glm5NextTextIndexer.get_pooled_states", ("self", "packed_states")),
            Symbol(MODULE, "Glm5NextTextHyperHead.forward", ("self", "hidden_streams")),
        ),
    ),
)  # fmt: skip
UNIT = "kpool"
# Where the capture self-check's production scores come from: the pools' keys production
# packed, scored as its indexer scores them (fp32, HF's order of operations).
SCORES_SOURCE = "recomputed: production's packed k-pool states and queries, in HF's order of operations"


def install(module: Any) -> None:
    cls = module.Glm5NextForConditionalGeneration
    if getattr(cls, "_shadowtrace_patched", False):
        return
    layout = select(LAYOUTS, {MODULE: module}, f"{NAME} {hf._version()}")
    hf.patch(cls, layout, Glm5NextTracer)
    module._shadowtrace_layout = layout


class Glm5NextTracer(GenericTracer):
    TRACES_INDEXERS = True

    def _indexer_module(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        return getattr(layer.self_attn, "indexer", None)

    def _head(self) -> list[torch.nn.Module]:
        return [self.inner.hc_head, self.inner.norm, self.model.lm_head]

    def _indexer(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.settings.layer(layer) or not self.settings.site("indexer"):
            return
        step = self.step
        assert step is not None
        names = ("hidden_states", "q_resid", "attention_mask", "cache")
        bound = dict(zip(names, args, strict=False)) | kwargs
        hidden, q_resid, mask = bound["hidden_states"], bound["q_resid"], bound["attention_mask"]
        pool = module.index_kpool
        k = module.index_topk // pool
        # Production's own per-token state, as its forward packs it (keys, gate, valid).
        prod_packed = torch.cat(
            [module.k_norm(module.wk(hidden)), F.linear(hidden, module.index_kpool_compress_gate),
             mask.to(hidden.dtype)[..., None]], dim=-1,
        )  # fmt: skip
        prod_q = module.wq_b(q_resid).view(*hidden.shape[:2], module.n_heads, module.head_dim)
        prod_w = (
            module.weights_proj(hidden.to(module.weights_proj.weight.dtype)).float() * module.n_heads**-0.5
        )
        shadows = {}
        if self.dtype is not None:
            shadows = self.sess.guarded(
                f"indexer_shadow:{layer}", self.runs[0], self._shadow, layer, module, hidden, q_resid, mask
            ) or {}  # fmt: skip
        prod_out = output.detach()
        for b, run in enumerate(self.runs):
            q_pos = step.positions[b]
            positions = step.positions_host[b]
            first = run.state.setdefault(("kpool_first", layer), _first_valid(mask[b]))
            visible = torch.div(q_pos + 1, pool, rounding_mode="floor")
            # Pools production selected: its token indices, grouped; its incomplete tail
            # pool (index == visible) is appended unscored and falls outside `visible`.
            tokens = prod_out[b].long()
            pools = torch.where(tokens >= first, torch.div(tokens - first, pool, rounding_mode="floor"), -1)
            scores = None
            if hf_prefix.CACHED_PREFIX in run.state:
                run.count("topk_scores_skipped_cached_prefix", len(q_pos))
            else:
                packs = run.state.setdefault(("kpool_packed", layer), [])
                packs.append(prod_packed[b])
                scores = _prod_scores(module, torch.cat(packs), prod_q[b], prod_w[b], visible)
                if scores is not None:
                    run.indexer_events(layer, scores, visible - 1, positions)
            row_shadows = {"raw": shadows[b]} if b in shadows else {}
            run.topk(layer, layer, k, positions, q_pos, pools, scores, row_shadows,
                     unit=UNIT, unit_tokens=pool, visible=(positions + 1) // pool,
                     check=SCORES_SOURCE,
                     check_tail=bool(getattr(module, "index_kpool_always_select_tail", False)))  # fmt: skip

    def _shadow(
        self,
        layer: int,
        module: torch.nn.Module,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        mask: torch.Tensor,
    ) -> dict[int, torch.Tensor]:
        """Each batch row's shadow scores over its complete pools: keys, pooling gate,
        query and head weights from the module's weights in the shadow precision."""
        step = self.step
        assert step is not None
        with shadow.full_fp32():  # no TF32 or reduced-precision sums, whatever the engine set
            dtype, pool = self.dtype, module.index_kpool
            norm = module.k_norm
            # FP8 projections on their codes times their scales (a raw gate parameter that is
            # not plain refused the shadow when the tracer attached: dequant.plan)
            keys = F.layer_norm(
                shadow.linear(hidden, dequant.weight(module.wk), dtype), norm.normalized_shape,
                norm.weight.to(dtype), norm.bias.to(dtype), norm.eps,
            )  # fmt: skip
            gate = shadow.linear(hidden, module.index_kpool_compress_gate, dtype)
            q = shadow.linear(q_resid, dequant.weight(module.wq_b), dtype).view(
                *hidden.shape[:2], module.n_heads, module.head_dim
            )
            w = shadow.linear(hidden, dequant.weight(module.weights_proj), dtype).float()
            w = w * module.n_heads**-0.5
            ape = module.index_kpool_compress_ape.to(dtype)
            out = {}
            how = shadow.projection_path(q_resid, module.wq_b, dtype)
            for b, run in enumerate(self.runs):
                shadow.record_kernel(run, "shadow_indexer_projections", how)
                if hf_prefix.CACHED_PREFIX in run.state:
                    continue
                state = run.state.setdefault(("kpool_shadow", layer), [[], []])
                state[0].append(keys[b])
                state[1].append(gate[b])
                first = run.state.setdefault(("kpool_first", layer), _first_valid(mask[b]))
                k_all, g_all = torch.cat(state[0])[first:], torch.cat(state[1])[first:]
                n = k_all.shape[0] // pool
                if n == 0:
                    continue
                logits = g_all[: n * pool].view(n, pool, -1) + ape
                pooled = (logits.softmax(dim=1) * k_all[: n * pool].view(n, pool, -1)).sum(dim=1)
                visible = torch.div(step.positions[b] + 1, pool, rounding_mode="floor")
                scores = shadow.indexer_scores(run, q[b], pooled, w[b], visible - 1, module.softmax_scale)
                out[b] = scores
            return out


def _first_valid(mask: torch.Tensor) -> int:
    """A row's first valid key (pools start there); 0 for an unpadded row."""
    valid = mask.bool()
    return int(valid.long().argmax()) if bool(valid.any()) else 0


def _prod_scores(
    module: Any, packed: torch.Tensor, q: torch.Tensor, w: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor | None:
    """Production's pool scores [S, pools] in HF's order of operations, from HF's own pooled
    keys of the row's packed states; -inf beyond the complete pools a query sees."""
    keys, _, valid = module.get_pooled_states(packed[None])
    keys = keys[0][valid[0]]
    if keys.shape[0] == 0:
        return None
    scores = torch.relu(torch.matmul(q.float(), keys.float().t()) * module.softmax_scale)  # [S, H, pools]
    index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [S, pools]
    return index.masked_fill(~numerics.causal_mask(visible - 1, keys.shape[0]), float("-inf"))
