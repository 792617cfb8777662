"""HF transformers: `glm_moe_dsa` (GLM-5 / 5.1 / 5.2) and `deepseek_v32` (DeepSeek-V3.2).

Supported: transformers 5.x with the module layout of 5.17.0 (checked against that release's
modeling_glm_moe_dsa.py and modeling_deepseek_v32.py):

- `*ForCausalLM.forward(input_ids, ..., logits_to_keep)` and `.generate`: a run per batch row
  (per request), opened at the first forward of a request and closed when it returns;
- `*DecoderLayer.forward(hidden_states, attention_mask, position_ids, past_key_values,
  use_cache, position_embeddings[, prev_topk_indices])` returns `(hidden_states, topk)` for
  GLM and `hidden_states` for DeepSeek: sites `layer_in`, `layer_out`; `self_attn` output[0]
  is `attn_out`, `mlp` output is `mlp_out`;
- `*Indexer.forward(hidden_states, q_resid, position_embeddings, attention_mask,
  position_ids, past_key_values)` returns int32 top-k [B, S, topk]: site `indexer`.
  GLM-5.2's shared layers (`indexer_types == "shared"`) have no indexer and are not recorded.

The shadow recomputes the indexer from the same hidden_states and q_resid with the module's
weights upcast (shadow_input `raw`; HF has no FP8 q/k, so there is no `dequant` row), and
re-runs each decoder layer in the shadow precision on the production input (`local`) and
on its own chain from the embeddings (`free`). Shadow layers run on the prefill only: a
decode step would need a shadow KV cache (counted as `shadow_skipped_decode_steps`).
"""

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from shadowtrace_hooks import numerics, session, shadow
from shadowtrace_hooks.session import Run, Session

NAME = "transformers"
SUPPORTED = "transformers 5.x (module layout of 5.17.0)"
# module -> (causal LM class, indexer RoPE function in that module)
MODULES = {
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa": (
        "GlmMoeDsaForCausalLM",
        "apply_rotary_pos_emb_interleave",
    ),
    "transformers.models.deepseek_v32.modeling_deepseek_v32": (
        "DeepseekV32ForCausalLM",
        "apply_rotary_pos_emb",
    ),
}
_LOGITS_CHUNK = 1024


def install(module: Any) -> None:
    """Wraps the module's causal LM class so every instance traces itself when called."""
    cls_name, rope_name = MODULES[module.__name__]
    cls = getattr(module, cls_name)
    if getattr(cls, "_shadowtrace_patched", False):
        return
    rope = getattr(module, rope_name)
    forward, generate = cls.forward, cls.generate

    @functools.wraps(forward)
    def traced_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        if sess is None:
            return forward(self, *args, **kwargs)
        tracer = sess.guarded("transformers:attach", None, _Tracer.attach, self, sess, rope)
        if tracer is None:
            return forward(self, *args, **kwargs)
        if session.capturing():
            sess.count("captures_skipped_cuda_graph")
            return forward(self, *args, **kwargs)
        return tracer.forward(forward, self, args, kwargs)

    @functools.wraps(generate)
    def traced_generate(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        tracer = (
            None
            if sess is None
            else sess.guarded("transformers:attach", None, _Tracer.attach, self, sess, rope)
        )
        if tracer is None:
            return generate(self, *args, **kwargs)
        tracer.in_generate += 1
        try:
            return generate(self, *args, **kwargs)
        finally:
            tracer.in_generate -= 1
            if tracer.in_generate == 0:
                tracer.close_runs()

    cls.forward, cls.generate = traced_forward, traced_generate
    cls._shadowtrace_patched = True


def _model_identity(config: Any) -> dict:
    path = Path(str(getattr(config, "_name_or_path", "") or "")) / "config.json"
    try:
        data = path.read_bytes() if path.is_file() else config.to_json_string().encode()
    except Exception:
        data = json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
    return {
        "name": getattr(config, "_name_or_path", "") or config.model_type,
        "architecture": config.model_type,
        "config_hash": hashlib.sha256(data).hexdigest(),
        "revision": getattr(config, "_commit_hash", None),
        "num_layers": config.num_hidden_layers,
        "index_topk": getattr(config, "index_topk", None),
    }


class _Step:
    """What one forward call shares between its hooks."""

    def __init__(self, positions: torch.Tensor, decode: bool) -> None:
        self.positions = positions  # [B, S] absolute positions of this forward's tokens
        self.decode = decode
        self.layer_input: torch.Tensor | None = None
        self.layer_kwargs: dict = {}
        self.prod_sites: dict[str, torch.Tensor] = {}
        self.shadow_sites: dict[str, dict[str, torch.Tensor]] = {}
        self.shadowing: str | None = None  # the mode whose shadow layer is running
        self.free: torch.Tensor | None = None  # the free chain's stream
        self.final_stream: torch.Tensor | None = None
        self.shadow_pe: tuple[torch.Tensor, torch.Tensor] | None = None


class _Tracer:
    """Hooks of one model instance, registered on its first traced call."""

    @classmethod
    def attach(cls, model: torch.nn.Module, sess: Session, rope: Any) -> "_Tracer":
        tracer = model.__dict__.get("_shadowtrace")
        if tracer is None:
            tracer = cls(model, sess, rope)
            model.__dict__["_shadowtrace"] = tracer
        return tracer

    def __init__(self, model: torch.nn.Module, sess: Session, rope: Any) -> None:
        self.model, self.sess, self.rope = model, sess, rope
        self.settings = sess.settings
        self.config = model.config
        self.identity = _model_identity(self.config)
        self.runs: list[Run] = []
        self.in_generate = 0
        self.step: _Step | None = None
        self.dtype = self.sess.settings.shadow_dtype
        inner = model.model
        self.rotary = inner.rotary_emb
        for i, layer in enumerate(inner.layers):
            layer.register_forward_pre_hook(functools.partial(self._layer_in, i), with_kwargs=True)
            layer.register_forward_hook(functools.partial(self._layer_out, i), with_kwargs=True)
            layer.self_attn.register_forward_hook(functools.partial(self._site, "attn_out"))
            layer.mlp.register_forward_hook(functools.partial(self._site, "mlp_out"))
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                indexer.register_forward_hook(functools.partial(self._indexer, i), with_kwargs=True)
        inner.norm.register_forward_pre_hook(self._final_norm)

    # --- requests and steps ---------------------------------------------------------

    def forward(self, forward: Any, model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self.sess.guarded("transformers:step", None, self._begin_step, args, kwargs)
        try:
            out = forward(model, *args, **kwargs)
        finally:
            step, self.step = self.step, None
        if step is not None:
            self.sess.guarded("logits", self.runs[0] if self.runs else None, self._logits, step, out)
        if not self.in_generate:
            self.close_runs()
        return out

    def _begin_step(self, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("past_key_values")
        past_len = int(past.get_seq_length()) if past is not None else 0
        if input_ids is None:
            embeds = kwargs["inputs_embeds"]
            batch, seq = embeds.shape[:2]
            ids = [[] for _ in range(batch)]
            device = embeds.device
        else:
            batch, seq = input_ids.shape
            ids = input_ids.tolist()
            device = input_ids.device
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + seq, device=device).expand(batch, seq)
        if not self.runs or past_len == 0:
            self.close_runs()
            for row in ids:
                self.runs.append(self._open(row, device))
        for run in self.runs:
            run.step += 1
        self.step = _Step(position_ids.to(device), decode=past_len > 0)
        if self.step.decode and self.settings.modes:
            for run in self.runs:
                run.count("shadow_skipped_decode_steps")

    def _open(self, ids: list[int], device: torch.device) -> Run:
        dtype = next(self.model.parameters()).dtype
        run = self.sess.open_run(
            token_ids=ids,
            model=self.identity,
            engine={"name": NAME, "version": _version(), "commit": None, "variant": None},
            device=session.device_of(torch.empty(0, device=device)),
            dtypes={"prod": session.dtype_name(dtype), "shadow": self.settings.precision},
        )
        run.writer.manifest["settings"]["adapter"] = f"{NAME}: {SUPPORTED}"
        return run

    def close_runs(self) -> None:
        runs, self.runs = self.runs, []
        for run in runs:
            self.sess.close_run(run)

    # --- hooks ----------------------------------------------------------------------

    def _active(self) -> _Step | None:
        step = self.step
        if step is None or step.shadowing is not None or not self.runs:
            return None
        return step

    def _layer_in(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        step = self._active()
        if step is None:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        step.layer_input = hidden.detach().clone()
        step.layer_kwargs = dict(kwargs)
        step.prod_sites, step.shadow_sites = {}, {}
        if layer == 0 and "free" in self.settings.modes and not step.decode:
            step.free = hidden.detach().to(self.dtype)

    def _site(self, site: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        step = self.step
        if step is None or not self.runs:
            return
        tensor = output[0] if isinstance(output, tuple) else output
        if step.shadowing is not None:
            step.shadow_sites.setdefault(step.shadowing, {})[site] = tensor.detach()
        else:
            step.prod_sites[site] = tensor.detach().clone()

    def _layer_out(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        step = self._active()
        if step is None or step.layer_input is None:
            return
        prod_out = (output[0] if isinstance(output, tuple) else output).detach()
        shadows: dict[str, torch.Tensor] = {}
        if self.settings.modes and not step.decode:
            shadows = (
                self.sess.guarded(f"shadow_layer:{layer}", self.runs[0], self._shadow_layer, layer, module)
                or {}
            )
        if self.settings.layer(layer):
            self.sess.guarded("hidden", self.runs[0], self._record_layer, layer, prod_out, shadows)
        step.layer_input = None

    def _shadow_layer(self, layer: int, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The layer re-run in the shadow precision: on the production input (local) and on
        the free chain (free). Returns each mode's layer output; site outputs land in
        step.shadow_sites through the same hooks."""
        step = self.step
        assert step is not None
        assert step.layer_input is not None
        dtype = self.dtype
        kwargs = dict(step.layer_kwargs)
        kwargs.update(past_key_values=None, use_cache=False, position_embeddings=self._shadow_pe(step))
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            kwargs["attention_mask"] = mask.to(dtype)
        inputs = {}
        if "local" in self.settings.modes:
            inputs["local"] = step.layer_input.to(dtype)
        if "free" in self.settings.modes and step.free is not None:
            inputs["free"] = step.free
        outputs = {}
        with shadow.in_precision(module, dtype), torch.no_grad():
            for mode, x in inputs.items():
                step.shadowing = mode
                try:
                    # forward, not __call__: hooks on the layer itself (ours, a user's, a
                    # test's planted fault) belong to the production call only.
                    out = module.forward(x, **kwargs)
                finally:
                    step.shadowing = None
                outputs[mode] = out[0] if isinstance(out, tuple) else out
        if "free" in outputs:
            step.free = outputs["free"]
        return outputs

    def _shadow_pe(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this step's positions in the shadow precision, computed once per step
        for every layer's shadow re-run and indexer recompute."""
        if step.shadow_pe is None:
            like = torch.empty(0, dtype=self.dtype, device=step.positions.device)
            step.shadow_pe = self.rotary(like, step.positions)
        return step.shadow_pe

    def _record_layer(self, layer: int, prod_out: torch.Tensor, shadows: dict[str, torch.Tensor]) -> None:
        step = self.step
        assert step is not None
        assert step.layer_input is not None
        s = self.settings
        length = int(step.positions.max()) + 1
        # layer_in is the local shadow's own input, and the free chain's is the previous
        # layer's free layer_out: recorded for prod only.
        sites = [("layer_in", step.layer_input, {})]
        sites += [
            (name, step.prod_sites[name], {}) for name in ("attn_out", "mlp_out") if name in step.prod_sites
        ]
        sites.append(("layer_out", prod_out, shadows))
        for b, run in enumerate(self.runs):
            positions = step.positions[b]
            tokens = s.token_rows(positions, length)
            for site, prod, layer_shadows in sites:
                if not s.site(site):
                    continue
                if site in ("attn_out", "mlp_out"):
                    layer_shadows = {m: v[site] for m, v in step.shadow_sites.items() if site in v}
                run.hidden(
                    layer, site, prod[b], {m: v[b] for m, v in layer_shadows.items()}, tokens, positions
                )

    def _indexer(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        step = self._active()
        if step is None or not self.settings.layer(layer) or not self.settings.site("indexer"):
            return
        self.sess.guarded("indexer", self.runs[0], self._record_indexer, layer, module, args, kwargs, output)

    def _record_indexer(
        self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> None:
        step = self.step
        assert step is not None
        names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
        bound = dict(zip(names, args, strict=False)) | kwargs
        hidden, q_resid = bound["hidden_states"], bound["q_resid"]
        prod_topk = output.detach().clone()
        cos, sin = bound["position_embeddings"]
        prod_q, prod_k, prod_w = _indexer_qkw(module, hidden, q_resid, cos, sin, self.rope, None)
        shadow_qkw = None
        if self.dtype is not None:
            scos, ssin = self._shadow_pe(step)
            shadow_qkw = _indexer_qkw(module, hidden, q_resid, scos, ssin, self.rope, self.dtype)
        band = self.settings.band
        for b, run in enumerate(self.runs):
            q_pos = step.positions[b]
            keys = run.state.setdefault(("indexer_keys", layer), {"prod": [], "shadow": []})
            keys["prod"].append(prod_k[b])
            prod_keys = torch.cat(keys["prod"])
            prod_scores = _hf_scores(prod_q[b], prod_keys, prod_w[b], q_pos, module.softmax_scale)
            prod = numerics.select(prod_scores, module.index_topk, q_pos, band)
            shadows = {}
            if shadow_qkw is not None:
                q, k, w = (t[b] for t in shadow_qkw)
                keys["shadow"].append(k)
                shadows["raw"] = shadow.indexer_selection(
                    q, torch.cat(keys["shadow"]), w, q_pos, module.index_topk, band
                )
            prod_indices = numerics.members(prod_topk[b], q_pos + 1)
            run.topk(layer, layer, module.index_topk, q_pos, prod_indices, prod, shadows)

    def _final_norm(self, module: torch.nn.Module, args: tuple) -> None:
        step = self._active()
        if step is not None:
            step.final_stream = args[0].detach()

    def _logits(self, step: _Step, out: Any) -> None:
        if not self.settings.site("logits") or step.final_stream is None:
            return
        logits = out.logits if hasattr(out, "logits") else out[0]
        kept = logits.shape[1]
        mode = "free" if "free" in self.settings.modes and step.free is not None else "local"
        stream = step.free if mode == "free" else step.final_stream
        want_shadow = self.dtype is not None and bool(self.settings.modes) and not step.decode
        for b, run in enumerate(self.runs):
            positions = step.positions[b][-kept:]
            for start in range(0, kept, _LOGITS_CHUNK):
                rows = slice(start, start + _LOGITS_CHUNK)
                shadow_logits = None
                if want_shadow and stream is not None:
                    x = stream[b, -kept:][rows]
                    inner = self.model.model
                    with (
                        shadow.in_precision(inner.norm, self.dtype),
                        shadow.in_precision(self.model.lm_head, self.dtype),
                    ):
                        shadow_logits = self.model.lm_head(inner.norm(x.to(self.dtype)))
                run.logits(logits[b][rows], shadow_logits, positions[rows])
            run.writer.manifest["settings"]["logits_shadow_mode"] = mode if want_shadow else None


def _indexer_qkw(
    module: Any,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope: Any,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,S,H,D], k [B,S,D] after RoPE and w [B,S,H] (with H^-0.5, without D^-0.5), as the
    HF indexer computes them; with `dtype`, every projection in that precision instead."""
    batch, seq, _ = hidden.shape
    heads, dim, rope_dim = module.n_heads, module.head_dim, module.qk_rope_head_dim
    if dtype is None:
        q = module.wq_b(q_resid)
        k = module.k_norm(module.wk(hidden))
        w = module.weights_proj(hidden.to(module.weights_proj.weight.dtype)).float()
    else:
        q = shadow.linear(q_resid, module.wq_b.weight, dtype)
        norm = module.k_norm
        k = torch.nn.functional.layer_norm(
            shadow.linear(hidden, module.wk.weight, dtype), norm.normalized_shape,
            norm.weight.to(dtype), norm.bias.to(dtype), norm.eps,
        )  # fmt: skip
        w = shadow.linear(hidden, module.weights_proj.weight, dtype).float()
    q = q.view(batch, seq, heads, dim)
    k = k.unsqueeze(2)
    q_rot, q_pass = torch.split(q, [rope_dim, dim - rope_dim], dim=-1)
    k_rot, k_pass = torch.split(k, [rope_dim, dim - rope_dim], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    return q, k, w * heads**-0.5


def _hf_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """The production scores in HF's own order of operations (relu after the softmax scale,
    then the head-weighted sum as a matmul), so its k-th score and margin are the ones the
    production top-k saw."""
    scores = torch.relu(
        torch.matmul(q.float().transpose(0, 1), k.float().t().unsqueeze(0)) * scale
    )  # [H,S,T]
    index = torch.matmul(w.unsqueeze(-2), scores.transpose(0, 1)).squeeze(-2)  # [S,T]
    return index.masked_fill(~numerics.causal_mask(q_pos, k.shape[0]), float("-inf"))


def _version() -> str:
    import transformers

    return transformers.__version__
