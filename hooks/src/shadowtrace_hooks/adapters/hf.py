"""HF transformers: `glm_moe_dsa` (GLM-5 / 5.1 / 5.2) and `deepseek_v32` (DeepSeek-V3.2).

Supported: transformers 5.17.0 through 5.24.0, in two layouts (`LAYOUTS`, checked at install
and against the released wheels by the conformance tests): the KV cache argument is
`past_key_values` up to 5.23 and `cache` from 5.24.

- `*ForCausalLM.forward(input_ids, attention_mask, position_ids, <cache>, ...)` and
  `.generate`: a run per batch row (per request), opened at the first forward of a request
  (no cache, or an empty one) and closed when it returns (for `generate`, when the whole
  generation returns); every forward is a step;
- `*DecoderLayer.forward(hidden_states, attention_mask, position_ids, <cache>, use_cache,
  position_embeddings[, prev_topk_indices])` returns `(hidden_states, topk)` for GLM and
  `hidden_states` for DeepSeek: sites `layer_in`, `layer_out`; `self_attn` output[0] is
  `attn_out`, `mlp` output is `mlp_out`;
- `*Indexer.forward(hidden_states, q_resid, position_embeddings, attention_mask,
  position_ids, <cache>)` returns int32 top-k [B, S, topk]: site `indexer`. GLM-5.2's shared
  layers (`indexer_types == "shared"`) have no indexer and are not recorded.

Production's indexer scores are captured, not recomputed: the indexer ends in
`index_scores.topk(...)` (5.17 to 5.24, both families), and a torch function mode entered for
the indexer's call (`_TopkInput`) keeps that call's input. Where the capture finds no single
top-k call of the expected shape, the scores are recomputed in HF's order of operations
instead, counted `indexer_scores_recomputed`.

The shadow recomputes the indexer from the same hidden_states and q_resid with the module's
weights upcast or dequantized (shadow_input `raw`; HF has no FP8 q/k, so there is no `dequant` row), and
re-runs each decoder layer in the shadow precision on the production input (`local`) and
on its own chain from the embeddings (`free`). The re-run is invisible to the model: no
cache (production's KV and indexer caches are never passed to it) and no forward hook of
the layer's modules fires, other than the tracer's own shadow site captures. Shadow layers
run on the prefill only: a decode step would need a shadow KV cache (counted as
`shadow_skipped_decode_steps`).

FP8 models (transformers' fine-grained FP8: FP8Linear, FP8Experts) are shadowed on their
weights' codes times their scales, never on production's FP8 kernel (shadowtrace_hooks.dequant).
Each run says what production ran: `dtypes.prod` (fp8_e4m3), `settings.prod_precision` per
module kind, `settings.quantization` (the model's config) and `settings.prod_fp8_kernel`
(DeepGEMM or the Triton kernel, and why, then what transformers loaded). A weight format the
shadow cannot dequantize refuses the whole run's shadow (a layer without one would break the
free chain): one line, `settings.shadow_refused`, counted `shadow_refused`; production is
still traced.
"""

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shadowtrace_hooks import dequant, graphs, numerics, session, shadow, stats
from shadowtrace_hooks.adapters import engine, hf_prefix
from shadowtrace_hooks.adapters.layout import Layout, Symbol, hub_kernel_layer, run_settings, select
from shadowtrace_hooks.session import Run, Session

log = logging.getLogger("shadowtrace")

NAME = "transformers"
# module -> (class name prefix, indexer RoPE function in that module)
MODULES = {
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa": ("GlmMoeDsa", "apply_rotary_pos_emb_interleave"),
    "transformers.models.deepseek_v32.modeling_deepseek_v32": ("DeepseekV32", "apply_rotary_pos_emb"),
}
_CACHE_NAMES = {"past_key_values": "5.17.0 to 5.23.0", "cache": "5.24.0 to 5.25.0"}
_LOGITS_CHUNK = 1024


def layouts(module: str) -> tuple[Layout, ...]:
    """The layouts of one modeling module: the symbols the adapter relies on, per release range."""
    prefix, rope = MODULES[module]
    rope_params = ("q", "k", "cos", "sin") + (("position_ids",) if rope.endswith("interleave") else ())
    out = []
    for cache, releases in _CACHE_NAMES.items():
        symbols = (
            Symbol(module, f"{prefix}ForCausalLM.forward",
                   ("self", "input_ids", "attention_mask", "position_ids", cache), leading=True),
            Symbol(module, f"{prefix}DecoderLayer.forward",
                   ("self", "hidden_states", "attention_mask", "position_ids", cache, "use_cache",
                    "position_embeddings"), leading=True),
            Symbol(module, f"{prefix}Indexer.forward",
                   ("self", "hidden_states", "q_resid", "position_embeddings", "attention_mask",
                    "position_ids", cache)),
            Symbol(module, f"{prefix}RotaryEmbedding.forward", ("self", "x", "position_ids")),
            Symbol(module, rope, (*rope_params, "unsqueeze_dim")),
        )  # fmt: skip
        out.append(Layout(name=f"{cache}=", source=f"transformers {releases}", symbols=symbols))
    return tuple(out)


LAYOUTS = tuple(layout for module in MODULES for layout in layouts(module))
# The models the registry routes to each modeling module (AutoModelForCausalLM's mapping).
ARCHITECTURES = {
    "glm_moe_dsa": "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
    "deepseek_v32": "transformers.models.deepseek_v32.modeling_deepseek_v32",
}


def install(module: Any) -> None:
    """Wraps the module's causal LM class so every instance traces itself when called."""
    prefix, rope_name = MODULES[module.__name__]
    cls = getattr(module, f"{prefix}ForCausalLM")
    if getattr(cls, "_shadowtrace_patched", False):
        return
    layout = select(layouts(module.__name__), {module.__name__: module}, f"{NAME} {_version()}")
    patch(cls, layout, _Tracer, getattr(module, rope_name))
    module._shadowtrace_layout = layout
    module._shadowtrace_scores = scores_source(getattr(module, f"{prefix}Indexer"))


# Per-run lists of per-token tensors (one per step) that a cache crop must cut back: the
# indexer's keys for production's recompute and the shadow, and glm5_next's k-pool states
# (its shadow's as a [keys, gates] pair of such lists).
_KEY_LISTS = {"indexer_keys", "indexer_shadow_keys", "kpool_packed", "kpool_shadow"}
_PAIRED_KEY_LISTS = {"kpool_shadow"}


def _drop_last_rows(steps: list[torch.Tensor], n: int) -> None:
    """Removes the last `n` token rows from a list of per-step [tokens, ...] tensors."""
    while n > 0 and steps:
        last = steps[-1]
        if last.shape[0] <= n:
            n -= last.shape[0]
            steps.pop()
        else:
            steps[-1] = last[: last.shape[0] - n]
            n = 0


def hub_rope_kernel(model: torch.nn.Module, rope: Any) -> dict | None:
    """Where the `kernels` package wrapped the indexer's RoPE function (transformers 5.25
    depends on it; DeepSeek-V3.2's `apply_rotary_pos_emb` is decorated
    `use_kernel_forward_from_hub("rotary_pos_emb")`): the convention of which code runs it.
    The wrapper calls transformers' own function unless a module of the model holds a copy
    that `kernelize` replaced (`use_kernelized_func` with `use_kernels=True`): a hub kernel
    then computes production's RoPE, chosen by the environment, not by the model. None where
    the function is not wrapped."""
    layer = hub_kernel_layer(rope)
    if layer is None:
        return None
    repos = sorted({
        str(f.__dict__["_kernel_repo"])
        for m in model.modules()
        for name, f in (getattr(m, "_kernel_funcs", None) or {}).items()
        if name == layer or getattr(type(f), "kernel_layer_name", None) == layer
        if "_kernel_repo" in getattr(f, "__dict__", {})
    })  # fmt: skip
    where = f"transformers {_version()}: {getattr(rope, '__module__', '?')}.{layer}, kernels hub wrapper"
    engine_value = f"hub kernel {', '.join(repos)}" if repos else "transformers"
    source = (
        f"{where}, replaced by kernelize"
        if repos
        else f"{where}, not kernelized: calls transformers' function"
    )
    return engine.convention(
        "indexer_rope_implementation", engine_value, "transformers", source,
        "the model's reference: its transformers modeling code",
    )  # fmt: skip


def scores_source(indexer: type) -> str:
    """Where production's indexer scores will come from, read off the indexer's source (for
    `doctor`): captured when its forward makes one top-k call, else recomputed (each forward
    then counts `indexer_scores_recomputed`)."""
    try:
        calls = inspect.getsource(indexer.forward).count(".topk(")
    except (OSError, TypeError):
        calls = -1
    if calls == 1:
        return "indexer scores captured from its top-k call"
    shows = f"{indexer.__name__}.forward shows {max(calls, 0)} top-k calls, expected 1"
    return f"indexer scores recomputed ({shows})"


def patch(cls: Any, layout: Layout, tracer: "type[_Tracer]", rope: Any = None) -> None:
    """Wraps `cls.forward` and `cls.generate` so that every instance is traced by a `tracer`
    (this module's, or a model-specific subclass of it) attached at its first traced call."""
    cache_name = layout.name.removesuffix("=")
    forward, generate = cls.forward, cls.generate
    graphs.install()
    inputs = _Inputs(forward, cache_name)
    attach = tracer.attach

    def begin(
        model: torch.nn.Module, sess: Session, window: session.Forward, args: tuple, kwargs: dict
    ) -> Any:
        """The tracer of `model`, its step open; None (the window ended) when untraced."""
        tracer = sess.guarded("transformers:attach", None, attach, model, sess, rope, inputs)
        if tracer is not None and graphs.current() is not None:
            tracer.begin_capture(window, model, args, kwargs)
            return tracer
        if tracer is not None and session.capturing():
            # torch.compile, or a graph captured outside torch.cuda.CUDAGraph: not followed
            sess.count("captures_skipped_cuda_graph")
            tracer = None
        if tracer is None:
            sess.end_forward(window)
            return None
        tracer.begin(window, model, args, kwargs)
        return tracer

    @functools.wraps(forward)
    def traced_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Every call the hooks make around the model's forward is inside a try (issue 42): an
        # exception there, guarded or not, is counted and is the loss of the forward's runs
        # (`session.Forward`), never the engine's. The model's own forward is called outside
        # them, so that its exceptions reach the caller unchanged.
        sess = window = tracer = None
        try:
            sess = session.current()
            if sess is not None:
                window = sess.begin_forward()
                tracer = begin(self, sess, window, args, kwargs)
        except Exception as e:
            tracer = None
            _escaped(sess, window, e, lost=True)
        if tracer is None:
            return forward(self, *args, **kwargs)
        try:
            out = forward(self, *args, **kwargs)
        except BaseException:
            try:
                tracer.forward_raised(window)
            except Exception as e:
                _escaped(sess, window, e)
            raise
        try:
            tracer.forward_returned(out, window)
        except Exception as e:
            _escaped(sess, window, e)
        return out

    @functools.wraps(generate)
    def traced_generate(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # As traced_forward: the hooks' calls in a try, the model's own outside it.
        sess = tracer = None
        try:
            sess = session.current()
            if sess is not None:
                tracer = sess.guarded("transformers:attach", None, attach, self, sess, rope, inputs)
            if tracer is not None:
                tracer.in_generate += 1
        except Exception as e:
            tracer = None
            _escaped(sess, None, e, lost=True)
        if tracer is None:
            return generate(self, *args, **kwargs)
        try:
            return generate(self, *args, **kwargs)
        except BaseException:
            tracer.interrupted = True
            raise
        finally:
            try:
                tracer.in_generate -= 1
                if tracer.in_generate == 0:
                    sess.guarded("transformers:close", None, tracer.close_runs)
            except Exception as e:
                _escaped(sess, None, e)

    cls.forward, cls.generate = traced_forward, traced_generate
    cls._shadowtrace_patched = True
    cls._shadowtrace_layout = layout


def _escaped(
    sess: Session | None, window: "session.Forward | None", error: Exception, *, lost: bool = False
) -> None:
    """An exception of the hooks' work around a forward that no guard caught: counted as a
    guard counts one, the loss of the forward's runs, and the forward's window ended. With
    no window to take it (the forward's began no window, or generate's entry failed) and
    `lost` (the forward goes on untraced), the runs open now, or else the process, count it."""
    # A second exception here has nowhere left to be counted: the engine must go on.
    with contextlib.suppress(Exception):
        sess = sess or session.current()  # the failure may have been the session's lookup
    if sess is None:
        return
    with contextlib.suppress(Exception):
        sess.caught("transformers:forward", None, error, disable=False)
        if window is None and lost:
            sess._step_open_failed(session.FAILED_BEFORE_ROWS, f"transformers:forward: {error}")
    if window is not None:
        with contextlib.suppress(Exception):
            sess.end_forward(window)


class _Inputs:
    """Reads a causal LM forward's inputs whether they came by position or by name, under
    either name of the cache argument."""

    def __init__(self, forward: Any, cache_name: str) -> None:
        self.signature = inspect.signature(forward)
        self.cache_name = cache_name

    def __call__(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = self.signature.bind_partial(model, *args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        cache = bound.get(self.cache_name)
        if cache is None:
            cache = extra.get("past_key_values", extra.get("cache"))
        return {
            "input_ids": bound.get("input_ids"),
            "inputs_embeds": bound.get("inputs_embeds"),
            "position_ids": bound.get("position_ids"),
            "cache_position": bound.get("cache_position", extra.get("cache_position")),
            "cache": cache,
        }


def _weights_proj(model: torch.nn.Module) -> tuple[str, torch.dtype] | None:
    """The first indexer's `weights_proj.weight` (its name and the dtype transformers holds it
    in) for the models whose reference computes it in fp32 (glm_moe_dsa, deepseek_v32): a bf16
    load keeps it bf16 (`_keep_in_fp32_modules` applies to fp16 only), which the reference
    engine runs only as a deviation. None for other models."""
    if getattr(model.config, "model_type", None) not in ARCHITECTURES:
        return None
    for name, module in model.named_modules():
        proj = getattr(module, "weights_proj", None)
        weight = getattr(proj, "weight", None)
        if name.endswith("indexer") and isinstance(weight, torch.Tensor):
            return f"{name}.weights_proj.weight", weight.dtype
    return None


def _model_identity(config: Any) -> dict:
    text = config.get_text_config()  # a multimodal model's decoder numbers are in its text config
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
        "num_layers": text.num_hidden_layers,
        "index_topk": getattr(text, "index_topk", None),
    }


class _Step:
    """What one forward call shares between its hooks."""

    def __init__(
        self,
        positions: torch.Tensor,
        decode: bool,
        capture: graphs.Capture | None = None,
        positions_host: np.ndarray | None = None,
    ) -> None:
        self.positions = positions  # [B, S] absolute positions of this forward's tokens
        # A graph capture cannot read the device: its rows name each token by its index in
        # the forward, which every replay turns into its positions (`Run.replay`).
        self.capture = capture
        if positions_host is not None:  # read already (a replay's, with its ids)
            self.positions_host = positions_host
        elif capture is None:
            self.positions_host = positions.cpu().numpy().astype(np.int32)  # one copy per forward
        else:
            batch, seq = positions.shape
            self.positions_host = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
        self.rows: dict[int, session.TokenRows] = {}  # batch row -> its recorded tokens
        self.decode = decode
        self.layer_input: torch.Tensor | None = None
        self.layer: int | None = None  # the decoder layer running now
        self.layer_kwargs: dict = {}
        self.prod_sites: dict[str, torch.Tensor] = {}
        self.shadow_sites: dict[str, dict[str, torch.Tensor]] = {}
        self.free: torch.Tensor | None = None  # the free chain's stream
        self.final_stream: torch.Tensor | None = None
        self.shadow_pe: tuple[torch.Tensor, torch.Tensor] | None = None
        # The first step of a request served from a cached prefix: its free chain
        # recomputed from the embeddings over the whole prompt (hf_prefix.Scratch).
        self.scratch: Any = None
        # The grafted layer's local shadow, run before production's layer: (layer, its output,
        # its site outputs and selection).
        self.graft: tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None = None


class _ReplayInputs:
    """A replay's token ids (None where the graph takes embeddings) and positions [B, S], as
    its static inputs hold them when the replay is launched: one device-to-host copy queued
    before the launch (into pinned memory, not waited for), read after it (`read`), so that
    the host opens the step while the device runs the replay. `past_len`: what the cache held
    before the step, where it cannot be told from the positions (position_ids given): counted
    before the launch, which appends to the cache."""

    def __init__(self, given: dict[str, Any]) -> None:
        positions, input_ids = given["positions"], given["input_ids"]
        self.shape = tuple(positions.shape)
        self.batch = None if input_ids is None else tuple(input_ids.shape)
        parts = [positions.reshape(-1).long()]
        if input_ids is not None:
            parts.insert(0, input_ids.reshape(-1).long())
        flat = torch.cat(parts)  # a tensor of its own: the static inputs are never held
        self.done: torch.cuda.Event | None = None
        self.host = flat
        if flat.is_cuda:
            # the copy and its event on the inputs' device, whose current stream runs the replay
            with torch.cuda.device(flat.device):
                try:
                    self.host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
                except RuntimeError:  # no pinned memory to be had: a plain (synchronous) copy
                    self.host = flat.cpu()
                else:
                    self.host.copy_(flat, non_blocking=True)
                    self.done = torch.cuda.Event()
                    self.done.record()
        cache = given["cache"]
        from_cache = given["position_ids"] is None and given["cache_position"] is not None
        self.past_len: int | None = None
        if cache is None:
            self.past_len = 0
        elif not from_cache:
            self.past_len = int(cache.get_seq_length())

    def read(self) -> tuple[list[list[int]] | None, np.ndarray, int]:
        """(ids, positions [B, S] int32, what the cache held before the step): waits for the
        copy alone, queued ahead of the replay."""
        if self.done is not None:
            self.done.synchronize()
        both = self.host.numpy()
        ids = None
        if self.batch is not None:
            n = self.batch[0] * self.batch[1]
            ids, both = both[:n].reshape(self.batch).tolist(), both[n:]
        positions = both.reshape(self.shape).astype(np.int32)
        # The step's first position is what the cache held before it, where the positions are
        # the cache's (no padding): no count of the cache's slots.
        past_len = int(positions[0, 0]) if self.past_len is None else self.past_len
        return ids, positions, past_len


class _TopkInput(torch.overrides.TorchFunctionMode):
    """Within one indexer call, keeps the input of its top-k call (production's scores) and
    the scores that call returned. Every other torch call passes through untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.calls = 0
        self.error: Exception | None = None  # what the keeping raised: nothing is kept

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))  # the indexer's own call: its errors are its own
        try:
            if func is torch.Tensor.topk or func is torch.topk:
                self.calls += 1
                self.scores = args[0] if args else (kwargs or {}).get("input")
                self.values = result[0] if isinstance(result, tuple) else None
        except Exception as e:
            # Never into the indexer: the capture is void (production's scores are then
            # recomputed, counted), the error counted when the mode leaves.
            self.error, self.calls = e, -1
        return result


class _Tracer:
    """Hooks of one model instance, registered on its first traced call."""

    # The indexers end in `index_scores.topk(...)`: production's scores are captured there.
    # Adapters whose indexers select otherwise (subclasses) say False.
    CAPTURES_TOPK_SCORES = True

    @classmethod
    def attach(cls, model: torch.nn.Module, sess: Session, rope: Any, inputs: _Inputs) -> "_Tracer":
        tracer = model.__dict__.get("_shadowtrace")
        # A tracer of an earlier session (one stopped since) serves that session's settings:
        # this session attaches its own. The old tracer's hooks stay, inert without its steps.
        if tracer is None or tracer.sess is not sess:
            tracer = cls(model, sess, rope, inputs)
            model.__dict__["_shadowtrace"] = tracer
        return tracer

    def __init__(self, model: torch.nn.Module, sess: Session, rope: Any, inputs: _Inputs) -> None:
        self.model, self.sess, self.rope, self.inputs = model, sess, rope, inputs
        self.settings = sess.settings
        self.config = model.config
        self.identity = _model_identity(self.config)
        self.runs: list[Run] = []
        self.in_generate = 0
        self.interrupted = False
        self.step: _Step | None = None
        self.window: session.Forward | None = None  # the traced forward in flight
        self.replaying: session.Forward | None = None  # a graph replay's, while it is launched
        self.replay_inputs: _ReplayInputs | None = None  # its inputs, read before the launch
        self.eager: tuple[list[Run], _Step | None] | None = None  # put aside by a graph capture
        self.looping: graphs.Capture | None = None  # the capture whose replays hold the runs open
        # What the cache held after its last replay (its last position + 1; None: unknown).
        self.looping_length: int | None = None
        self.forwards = 0
        self.fired: set[str] = set()
        self.inner = inner = self._decoder()
        self.rotary = getattr(inner, "rotary_emb", None)
        self.indexers = 0
        self._topk_input: _TopkInput | None = None  # entered for the indexer call running now
        self._captured: tuple[int, _TopkInput] | None = None  # (layer, mode) of the last call
        self.dtype = self.sess.settings.shadow_dtype
        self.quant = dequant.plan(model)
        kind = type(model).__name__
        self.shadow_refused = self._why_no_shadow(kind)
        if self.shadow_refused is not None:
            self.dtype = None
        # None: SHADOWTRACE_GRAFT is set and applied; else why production runs ungrafted.
        self.graft_refused = self._why_no_graft() if self.settings.grafts else None
        self.grafts_applied = 0  # (layer, site) grafts production took, for bisect's check
        grafting = bool(self.settings.grafts) and self.graft_refused is None
        for i, layer in enumerate(inner.layers):
            layer.register_forward_pre_hook(
                functools.partial(self._hook, "layer_in", self._layer_in, i), with_kwargs=True
            )
            if grafting:
                # After layer_in (its input kept), before the layer runs: the local shadow
                # first, so production can take its values (graft.py's order).
                layer.register_forward_pre_hook(
                    functools.partial(self._hook, "graft_shadow", self._graft_shadow, i), with_kwargs=True
                )
                # Before the recording hooks: what is recorded is what production goes on with.
                layer.register_forward_hook(functools.partial(self._graft, "layer_out", i))
                for site, block in self._sites(layer).items():
                    block.register_forward_hook(functools.partial(self._graft, site, i))
            layer.register_forward_hook(
                functools.partial(self._hook, "layer_out", self._layer_out, i), with_kwargs=True
            )
            for site, block in self._sites(layer).items():
                block.register_forward_hook(functools.partial(self._hook, "site", self._site, site))
            indexer = self._indexer_module(layer)
            if indexer is not None:
                self.indexers += 1
                if self.CAPTURES_TOPK_SCORES:
                    # Registered before the recording hook, so the mode is gone when it runs;
                    # always called, so an indexer that raises leaves no mode behind.
                    indexer.register_forward_pre_hook(functools.partial(self._guard_enter, i))
                    indexer.register_forward_hook(functools.partial(self._scores_exit, i), always_call=True)
                indexer.register_forward_hook(
                    functools.partial(self._hook, "indexer", self._indexer, i), with_kwargs=True
                )
                if grafting:
                    # After the recording hook: the selection recorded is the one production's
                    # own indexer made (its capture self-check holds); attention then reads
                    # the shadow's.
                    indexer.register_forward_hook(functools.partial(self._graft, "indexer", i))
        self._head()[0].register_forward_pre_hook(
            functools.partial(self._hook, "final_norm", self._final_norm)
        )
        self._prod_kernel: str | None = None
        if self.shadow_refused is not None:
            sess.warn_once(f"{NAME}:no_shadow:{kind}", f"{NAME} {_version()}: {self.shadow_refused}")
        elif grafting:
            sess.warn_once(
                f"{NAME}:graft",
                f"SHADOWTRACE_GRAFT={self.settings.graft_spec}: production takes the local shadow's "
                "value there, so its output changes on purpose (tags.graft); prefill steps only",
            )

    # Whether this adapter's layers can take the shadow's values (subclasses whose layers
    # differ say why not).
    GRAFTS_REFUSED: str | None = None
    # Why this adapter runs no capture self-check on its indexers' selections (None: it runs
    # one): recorded in each run (`settings.capture_check`, `run` false), never left unsaid.
    CAPTURE_CHECK_NOT_RUN: str | None = None

    def _why_no_graft(self) -> str | None:
        """Why SHADOWTRACE_GRAFT is not applied (None: it is): a graft takes the local
        shadow's values, so it needs that shadow."""
        if self.GRAFTS_REFUSED is not None:
            return self.GRAFTS_REFUSED
        if self.dtype is None:
            return self.shadow_refused or "SHADOWTRACE_SHADOW=none: no shadow to take values from"
        layers = len(self._decoder().layers)
        past = [g for g in self.settings.grafts if g["layers"] != "all" and g["layers"][1] >= layers]
        if past:
            return f"SHADOWTRACE_GRAFT names layer {past[0]['layers'][1]}; the model has {layers} layers"
        if "local" not in self.settings.layer_modes:
            return (
                "a graft takes the local layer shadow's values: set SHADOWTRACE_MODE to include "
                "local and SHADOWTRACE_SHADOW_SCOPE=layer"
            )
        return None

    def _why_no_shadow(self, kind: str) -> str | None:
        """Why this model gets no shadow (None: it gets one): a weight it cannot dequantize."""
        if self.settings.precision is None or self.quant.refused is None:
            return None
        return f"{kind}: {self.quant.refused}; production is traced alone"

    # --- where the model keeps what is traced (model-specific adapters override) ----

    def _decoder(self) -> torch.nn.Module:
        """The decoder: its `layers` are traced."""
        return self.model.model

    def _sites(self, layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The blocks of a decoder layer whose outputs are the sites attn_out and mlp_out."""
        return {"attn_out": layer.self_attn, "mlp_out": layer.mlp}

    def _indexer_module(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        return getattr(layer.self_attn, "indexer", None)

    def _head(self) -> list[torch.nn.Module]:
        """What turns the last layer's stream into logits, in order: its first module's input
        is the stream the logits shadow starts from."""
        return [self.inner.norm, self.model.lm_head]

    def _hook(self, kind: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Every hook body runs inside the guard: a failure is counted and disables that
        capture, and never reaches the model's forward (the guard's own call included)."""
        try:
            if self.step is None or not self.runs:
                return
            self.fired.add(kind)
            if kind in GRAPH_SKIPPED and self.step.capture is not None:
                _skip(self.step.capture, kind)
                return
            self.sess.guarded(f"transformers:{kind}", self.runs[0], fn, *args, **kwargs)
        except Exception as e:
            self._unguarded(e)

    def _unguarded(self, error: Exception) -> None:
        """An exception a hook's own bookkeeping raised around its guard: counted as the
        guard would, never raised into the model."""
        with contextlib.suppress(Exception):
            self.sess.caught("transformers:hook", self.runs[0] if self.runs else None, error, disable=False)

    # --- requests and steps ---------------------------------------------------------

    def begin(self, window: session.Forward, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Opens the forward's step. A step that fails to open (an out-of-memory error) is
        counted and retried at the next forward: it must not switch tracing off for the
        process."""
        self.window = window
        self.sess.guarded("transformers:step", None, self._begin_step, model, args, kwargs, disable=False)

    # --- CUDA graphs (`graphs`) -----------------------------------------------------

    def begin_capture(
        self, window: session.Forward, model: torch.nn.Module, args: tuple, kwargs: dict
    ) -> None:
        """The forward is being captured into a CUDA graph: its captures go to a recorder per
        batch row, and each replay ships them for the runs of its step. Nothing here reads
        the device (a capture cannot wait for it)."""
        self.window = window
        self.sess.guarded("transformers:graph_capture", None, self._begin_capture, model, args, kwargs)

    def _begin_capture(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        given = self.inputs(model, args, kwargs)
        source = given["input_ids"] if given["input_ids"] is not None else given["inputs_embeds"]
        batch, seq = source.shape[:2]
        positions = given["position_ids"]
        if positions is None and given["cache_position"] is not None:
            positions = given["cache_position"].reshape(1, seq).expand(batch, seq)
        if positions is None:
            raise ValueError(
                "a forward captured into a CUDA graph is traced when it is given position_ids "
                "or cache_position (static inputs the replays rewrite); it was given neither"
            )
        if positions.dim() == 3:  # multimodal RoPE: the text positions lead
            positions = positions[0]
        capture = graphs.Capture(self, args, kwargs, [], given={**given, "positions": positions})
        recorders = [session.Recorder(self.settings) for _ in range(batch)]
        # What was open before comes back when the capture ends (`_end_capture`).
        self.eager = (self.runs, self.step)
        self.runs, self.step = list(recorders), _Step(positions, decode=True, capture=capture)

    def _keep(self, capture: graphs.Capture, out: Any) -> None:
        capture.held = [run.held() for run in self.runs]
        capture.out = out  # the static output: its cache is the one each replay writes
        graphs.keep(capture)

    def _end_capture(self) -> None:
        eager = self.eager
        if eager is not None:
            (self.runs, self.step), self.eager = eager, None

    def before_replay(self, capture: graphs.Capture) -> None:
        """A replay of a captured forward is about to be launched: its step opens as an
        eager forward's would, from the static inputs (which hold the replay's values)."""
        self.replaying = None
        if session.current() is not self.sess:
            # A graph captured in an earlier session: its recorders write nowhere now.
            if session.current() is not None:
                session.current().count("graph_replays_untraced")
            return
        window = self.sess.begin_forward()
        self.window = self.replaying = window
        self.replay_inputs = self.sess.guarded(
            "transformers:step", None, _ReplayInputs, capture.given, disable=False
        )

    def after_replay(self, capture: graphs.Capture) -> None:
        """The replay's work is launched: its step opens from the inputs read before the
        launch (the host's bookkeeping runs while the device runs the replay), its rows ship
        (copies queued after it), and the captures a graph could not hold are counted in each
        run of the step. Outside `generate`, the runs stay open for the graph's next replay
        (`_begin_step`)."""
        window, self.replaying = self.replaying, None
        inputs, self.replay_inputs = self.replay_inputs, None
        if window is None:
            return
        if inputs is not None:
            self.sess.guarded(
                "transformers:step", None, self._begin_step, self.model, capture.args, capture.kwargs,
                replay=capture, inputs=inputs, disable=False,
            )  # fmt: skip
        step, self.step = self.step, None
        if step is not None:
            self.sess.guarded("transformers:graph_replay", None, self._replayed, capture, step)
            if self.in_generate:  # else at the request's close (`close_runs`)
                self.sess.guarded("transformers:cache_ids", None, hf_prefix.remember, capture.out, self.runs)
        self.sess.end_forward(window)
        if not self.in_generate:
            self.looping = capture
            self.looping_length = None if step is None else int(step.positions_host.max()) + 1

    def _replayed(self, capture: graphs.Capture, step: "_Step") -> None:
        if len(capture.held) != len(self.runs):
            raise ValueError(
                f"graph replay: {len(self.runs)} requests in the step, the capture held {len(capture.held)}"
            )
        for b, run in enumerate(self.runs):
            run.replay(capture.held[b], step.positions_host[b])
            for kind in capture.skipped:
                run.count(f"graph_skipped_{kind}")
            if self.settings.tokens["kind"] != "all":
                run.count("graph_skipped_token_selection")
        for kind in capture.skipped:
            self.sess.warn_once(
                f"{NAME}:graph:{kind}",
                f"{NAME} {_version()}: {kind} is not captured inside a CUDA graph; each replayed "
                f"step counts graph_skipped_{kind} (run eagerly to record it)",
            )

    def forward_raised(self, window: session.Forward) -> None:
        """The model's forward raised: SystemExit from a serving engine's SIGTERM handler,
        an out-of-memory error. The request's rows stop half way, and its runs must say so."""
        self.interrupted = True
        self.step = None
        self._end_capture()
        for run in self.runs:
            run.cut = True  # closed interrupted by the exit flush if not here
        self.sess.end_forward(window)
        if not self.in_generate:
            self.sess.guarded("transformers:close", None, self.close_runs)

    def forward_returned(self, out: Any, window: session.Forward) -> None:
        try:
            self._end_step(out, window)
        except BaseException:
            # SystemExit landing in the bookkeeping after the forward: as if the forward raised.
            self.forward_raised(window)
            raise

    def _end_step(self, out: Any, window: session.Forward) -> None:
        step, self.step = self.step, None
        if step is not None and step.capture is not None:
            self.sess.guarded("logits", self.runs[0], self._logits, step, out)
            self.sess.guarded("transformers:graph_capture", None, self._keep, step.capture, out)
            self._end_capture()
            self.sess.end_forward(window)
            return
        if step is not None:
            self.sess.guarded("logits", self.runs[0] if self.runs else None, self._logits, step, out)
            self.sess.guarded("transformers:ship", self.runs[0] if self.runs else None, self._ship)
            self.sess.guarded("transformers:first_forward", None, self._check_first_forward)
            self.sess.guarded("transformers:fp8_kernel", None, self._record_kernel_loaded)
            self.sess.guarded("transformers:cache_ids", None, hf_prefix.remember, out, self.runs)
        # Before the runs close: a loss counted after would miss their final manifest.
        self.sess.end_forward(window)
        if not self.in_generate:
            self.sess.guarded("transformers:close", None, self.close_runs)

    def _ship(self) -> None:
        """Sends each run's captures since the last ship in one device-to-host copy."""
        for run in self.runs:
            run.ship()

    def _check_first_forward(self) -> None:
        """After the model's first traced forward, one line if a hook it needs never fired:
        a layout the signature check could not tell apart, tracing nothing without a word."""
        self.forwards += 1
        if self.forwards != 1:
            return
        wanted = {"layer_in", "layer_out", "site", "final_norm"} | ({"indexer"} if self.indexers else set())
        missing = sorted(wanted - self.fired)
        if missing:
            self.sess.count("hooks_never_fired")
            self.sess.warn_once(
                f"{NAME}:{type(self.model).__name__}:never_fired",
                f"{NAME} {_version()}: {type(self.model).__name__}: hooks that never fired in the first "
                f"forward: {', '.join(missing)}; those sites are not traced",
            )

    def _begin_step(
        self,
        model: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        replay: graphs.Capture | None = None,
        inputs: _ReplayInputs | None = None,
    ) -> None:
        """Opens a forward's step (`replay`: the capture a graph replay launches, whose
        captures are held: no prefix-cache shadow chain starts, as none could be recorded;
        `inputs`: its static inputs as read before the launch).
        A graph's replays are one request: a replay continues the runs its graph's last
        replay left open when their tokens are exactly what the cache holds; any other
        forward, or a replay that does not continue them, closes them first."""
        if inputs is not None:  # a replay's: read as its capture bound them (the same static tensors)
            assert replay is not None
            given = replay.given
            ids, positions_host, past_len = inputs.read()
            cache = given["cache"]
        else:
            given = self.inputs(model, args, kwargs)
            cache = given["cache"]
            past_len = int(cache.get_seq_length()) if cache is not None else 0
            ids = positions_host = None
        looping = self.looping
        if looping is not None and (
            looping is not replay or any(len(run.state.get("ids", [])) != past_len for run in self.runs)
        ):
            self.close_runs()
        self.looping = None
        input_ids = given["input_ids"]
        if input_ids is None:
            embeds = given["inputs_embeds"]
            batch, seq = embeds.shape[:2]
            ids = [[] for _ in range(batch)]
            device = embeds.device
        else:
            batch, seq = input_ids.shape
            ids = input_ids.tolist() if ids is None else ids
            device = input_ids.device
        if inputs is not None:
            position_ids = given["positions"]
        else:
            position_ids = given["position_ids"]
            if position_ids is None:
                position_ids = torch.arange(past_len, past_len + seq, device=device).expand(batch, seq)
            elif position_ids.dim() == 3:  # multimodal RoPE (t, h, w, ...): the text positions lead
                position_ids = position_ids[0]
        hit = False
        if self.runs and past_len > 0:
            self._crop_to_cache(past_len)
        if not self.runs or past_len == 0:
            self.close_runs()
            # A request that starts on a cache holding a prefix is a prefix-cache hit: its run
            # names the whole prompt (the prefix's ids, remembered on the cache) and says so.
            prefixes = hf_prefix.cached_ids(cache, past_len, batch)
            hit = past_len > 0
            if self.window is not None:
                self.window.requests = batch
            for b, row in enumerate(ids):
                prefix = None if prefixes is None else prefixes[b]
                run = self._open(row if prefix is None else prefix + row, device)
                hf_prefix.tag(run, past_len, prefix)
        for run, row in zip(self.runs, ids, strict=False):
            self._serve(run)
            run.step += 1
            run.state.setdefault("ids", run.state.pop("prompt_ids", [])).extend(row)
        self.step = _Step(position_ids.to(device), decode=past_len > 0, positions_host=positions_host)
        if hit:
            self.step.scratch = hf_prefix.start(self, cache, past_len, seq, device, replay is not None)
        elif self.step.decode and self.settings.layer_modes:
            for run in self.runs:
                run.count("shadow_skipped_decode_steps")

    def _serve(self, run: Run) -> None:
        """`run` takes rows of the forward in flight: a hook's exception before its first
        row of it is its loss (`session.Forward`)."""
        if self.window is not None:
            self.window.serve(run)

    def _crop_to_cache(self, past_len: int) -> None:
        """A cache shorter than the tokens a run has seen was cropped by `generate`: assisted
        or speculative decoding rejected drafted tokens (transformers allows it on these
        models; 5.25 on glm5_next too). Each run's per-token key lists are cut back to the
        cache, so later steps score the kept keys only. The rows already written for the
        rejected tokens stay (production computed them, at their own step) and the run
        counts the tokens (`cache_rollback_tokens`)."""
        for run in self.runs:
            ids = run.state.get("ids")
            if ids is None or len(ids) <= past_len:
                continue
            excess = len(ids) - past_len
            del ids[past_len:]
            for key, value in run.state.items():
                if isinstance(key, tuple) and key[0] in _KEY_LISTS:
                    for rows in value if key[0] in _PAIRED_KEY_LISTS else [value]:
                        _drop_last_rows(rows, excess)
            run.count("cache_rollback_tokens", excess)

    def _open(self, ids: list[int], device: torch.device) -> Run:
        # Read off the weights: an FP8 model's first parameter (the embedding) is bf16.
        prod = self.quant.prod(next(self.model.parameters()).dtype)
        layout = type(self.model)._shadowtrace_layout
        run = self.sess.open_run(
            token_ids=ids,
            model=self.identity,
            engine={"name": NAME, "version": _version(), "commit": None, "variant": None},
            device=session.device_of(torch.empty(0, device=device)),
            dtypes={"prod": prod, "shadow": self.settings.precision},
            grafts=self.graft_refused,
        )
        # The tracer holds it at once: whatever fails next, it is closed with the others.
        self.runs.append(run)
        self._serve(run)
        writer = run.writer
        for key, value in run_settings(layout, NAME, _version()).items():
            writer.set_setting(key, value)
        if self.CAPTURE_CHECK_NOT_RUN is not None:
            writer.capture_check_not_run(self.CAPTURE_CHECK_NOT_RUN)
        self.sess.guarded("transformers:production", run, self._record_production, run)
        if self.shadow_refused is not None:
            writer.refuse_shadow(self.shadow_refused)
            run.count("shadow_refused")
        return run

    def _record_production(self, run: Run) -> None:
        """What production runs, read off the model: its precision per module kind, its
        quantization config, and for FP8 models the kernels and how the shadow dequantizes."""
        writer = run.writer
        writer.set_setting("prod_precision", dequant.precision(self.model, self.quant))
        quantization = dequant.quantization(self.model)
        if quantization is not None:
            writer.set_setting("quantization", quantization)
        weights_proj = _weights_proj(self.model)
        if weights_proj is not None:
            name, dtype = weights_proj
            source = f"transformers {_version()}: {name}.dtype, read from the loaded model"
            writer.add_conventions([engine.weights_proj_convention(dtype, source)], engine.merge_conventions)
        rope_kernel = hub_rope_kernel(self.model, self.rope)
        if rope_kernel is not None:
            writer.add_conventions([rope_kernel], engine.merge_conventions)
        if self.quant.fp8:
            if self._prod_kernel is None:  # the dispatch rule, once (it may look for nvcc)
                self._prod_kernel = dequant.kernel(self.model, self.quant)
            writer.set_setting("prod_fp8_kernel", f"{self._prod_kernel}; loaded: {dequant.loaded()}")
            if self.dtype is not None:
                writer.set_setting("shadow_dequant", dequant.HOW)

    def _record_kernel_loaded(self) -> None:
        """After a forward: which FP8 kernels transformers has loaded by now (what the
        dispatch rule cannot see: a DeepGEMM fallback, a kernel put in place by hand)."""
        if self._prod_kernel is None:
            return
        how = f"{self._prod_kernel}; loaded: {dequant.loaded()}"
        for run in self.runs:
            run.writer.set_setting("prod_fp8_kernel", how)

    def close_runs(self) -> None:
        if self.looping is not None and self.runs:
            # A graph's request leaves the cache's ids for a later prefix hit at its close: read
            # after each replay, the cache's length would wait for the replay to finish. Its
            # length is the one its last replay left, known on the host: a replay that closes
            # the request opens its step after its own launch, which grows the cache.
            self.sess.guarded(
                "transformers:cache_ids", None, hf_prefix.remember, self.looping.out, self.runs,
                self.looping_length,
            )  # fmt: skip
        runs, self.runs, self.looping = self.runs, [], None
        interrupted, self.interrupted = self.interrupted, False
        for run in runs:
            self.sess.close_run(run, interrupted=interrupted)

    # --- hooks ----------------------------------------------------------------------

    def _layer_in(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        step = self.step
        assert step is not None
        # By name, whichever way the model passed them: the shadow re-run replaces some.
        bound = _signature(type(module).forward).bind_partial(module, *args, **kwargs).arguments
        bound.update(bound.pop("kwargs", {}))
        del bound["self"]
        hidden = bound.pop("hidden_states")
        step.layer, step.layer_kwargs = layer, bound
        step.prod_sites, step.shadow_sites = {}, {}
        if _records_as_made(step):
            step.layer_input = hidden.detach()
            self.sess.guarded(
                "hidden", self.runs[0], self._record_sites, layer, [("layer_in", step.layer_input, {})]
            )
        else:
            step.layer_input = hidden.detach().clone()
        if layer == 0 and "free" in self.settings.layer_modes and not step.decode:
            step.free = hidden.detach().to(self.dtype)

    def _site(self, site: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        step = self.step
        assert step is not None
        tensor = output[0] if isinstance(output, tuple) else output
        if _records_as_made(step) and step.layer is not None:
            self.sess.guarded(
                "hidden", self.runs[0], self._record_sites, step.layer, [(site, tensor.detach(), {})]
            )
            return
        step.prod_sites[site] = tensor.detach().clone()

    def _layer_out(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        step = self.step
        assert step is not None
        if step.layer_input is None:
            return
        prod_out = (output[0] if isinstance(output, tuple) else output).detach()
        shadows: dict[str, torch.Tensor] = {}
        if step.graft is not None and step.graft[0] == layer:
            # Run before the layer for its graft: the same re-run, not repeated.
            shadows, step.graft = {"local": step.graft[1]}, None
            if "free" in self.settings.layer_modes:
                free = self.sess.guarded(
                    f"shadow_layer:{layer}", self.runs[0], self._shadow_layer, layer, module, ("free",)
                )  # fmt: skip
                shadows.update(free or {})
        elif self.settings.layer_modes and not step.decode and self._shadow_recorded():
            shadows = (
                self.sess.guarded(f"shadow_layer:{layer}", self.runs[0], self._shadow_layer, layer, module)
                or {}
            )
        elif step.scratch is not None:
            shadows = step.scratch.layer(layer, step)
        if self.settings.layer(layer):
            self.sess.guarded("hidden", self.runs[0], self._record_layer, layer, prod_out, shadows)
            self.sess.guarded("kv_sentinel", self.runs[0], self._record_sentinels, layer, step)
        # One copy per layer: the layer's rows leave the device while the next layer runs.
        self.sess.guarded("transformers:ship", self.runs[0], self._ship)
        step.layer_input = None

    def _graft_shadow(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a grafted layer runs: its local shadow on production's input (kept by
        layer_in), whose values the graft hooks hand production."""
        step = self.step
        assert step is not None
        if not self.settings.graft_sites(layer):
            return
        if step.decode:
            # The shadow re-runs layers on steps without a cache only: a decode step, or a
            # prefill after a prefix-cache hit, goes on ungrafted.
            for run in self.runs:
                if run.state.get("graft_cached_step") != run.step:
                    run.state["graft_cached_step"] = run.step
                    run.count("graft_skipped_cached_steps")
            return
        if self.settings.graft_sites(layer) == {"indexer"} and self._indexer_module(module) is None:
            # A layer reusing an earlier layer's selection (GLM-5.2 `shared`): nothing to graft.
            for run in self.runs:
                run.count("graft_indexer_on_shared_layer")
            return
        outputs = self._shadow_layer(layer, module, ("local",))
        if "local" not in outputs:
            raise RuntimeError(f"graft at layer {layer}: the local shadow produced no output")
        step.graft = (layer, outputs["local"], step.shadow_sites.get("local", {}))

    def _graft(self, site: str, layer: int, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """A graft: the block's output replaced by the local shadow's, in production's dtype.
        In a guard: a failure is counted, disables the graft and leaves production's output."""
        try:
            if self.step is None or not self.runs or site not in self.settings.graft_sites(layer):
                return None
            return self.sess.guarded(f"graft:{site}", self.runs[0], self._grafted, site, layer, output)
        except Exception as e:
            self._unguarded(e)
            return None

    def _grafted(self, site: str, layer: int, output: Any) -> Any:
        step = self.step
        assert step is not None
        if step.graft is None or step.graft[0] != layer:
            if not step.decode:
                # A prefill step whose grafted layer had no shadow (its re-run failed: counted
                # and disabled by its guard): production went on ungrafted there.
                for run in self.runs:
                    run.count("graft_not_applied")
            return None  # a step over a cache: counted by _graft_shadow
        _, out, sites = step.graft
        value = out if site == "layer_out" else sites.get(site)
        if value is None:
            raise RuntimeError(f"graft {site}@{layer}: the local shadow recorded no {site}")
        prod = output[0] if isinstance(output, tuple) else output
        if value.shape != prod.shape:
            raise RuntimeError(
                f"graft {site}@{layer}: shadow {tuple(value.shape)}, production {tuple(prod.shape)}"
            )
        value = value.to(prod.dtype)
        self.grafts_applied += 1
        for run in self.runs:
            run.count(f"grafted_{site}")
        return (value, *output[1:]) if isinstance(output, tuple) else value

    def _shadow_recorded(self) -> bool:
        """Whether a layer's shadow re-run is recorded anywhere: a hidden site, or the free
        chain the logits' shadow continues. (A bisection's forwards record layer_in only.)"""
        hidden = any(self.settings.site(s) for s in ("attn_out", "mlp_out", "layer_out"))
        return hidden or "free" in self.settings.layer_modes

    def _record_sentinels(self, layer: int, step: _Step) -> None:
        """The KV sentinel watch (contexts 000 and 001: a padding row's NaN written into a
        slot that valid rows read later). Each step, for this layer's cache entries (keys,
        values, indexer keys; compressed latents from 5.24): slot 0, which a later write
        may poison after it was read finite, and the slots this step wrote. A failed check
        is a `sentinel` event with the non-finite count and the first slot holding one. HF
        keeps no reserved padding slot and promises no zeros, so no zero-content check."""
        cache = step.layer_kwargs.get(self.inputs.cache_name) or step.layer_kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        if layers is None or layer >= len(layers):
            return
        tensors = {
            name: t for name, t in vars(layers[layer]).items() if isinstance(t, torch.Tensor) and t.dim() >= 3
        }
        if not tensors:
            return
        seq = step.positions.shape[1]
        names = list(tensors)
        if step.capture is not None:
            self._record_sentinels_graphed(layer, step, tensors)
            return
        for b, run in enumerate(self.runs):
            end = int(step.positions_host[b].max()) + 1
            for check, first, last in (("kv_slot0_finite", 0, 1), ("kv_new_slots_finite", end - seq, end)):
                parts = []
                for t in tensors.values():
                    window = t[b].narrow(-2, first, max(0, min(last, t.shape[-2]) - first))
                    if window.shape[-2] == 0:
                        parts.append(torch.zeros(2, dtype=torch.int64, device=t.device))
                        continue
                    per_slot = stats.slot_nonfinite_device(window)
                    parts.append(torch.stack([per_slot.sum(), (per_slot > 0).to(torch.int8).argmax()]))
                slot = run.add(torch.stack(parts))
                row = {"seq": run.next_seq(), "step": run.step, "layer": layer, "site": "layer_out",
                       "path": "prod", "kind": "sentinel", "count": 1, "check": check}  # fmt: skip
                detail = f"slots {first}..{last - 1} of {', '.join(names)}"
                run.defer(functools.partial(_sentinel_rows, slot, names, first, row, detail), {})

    def _record_sentinels_graphed(self, layer: int, step: _Step, tensors: dict[str, torch.Tensor]) -> None:
        """The sentinel's two checks inside a CUDA graph: the new slots are read at the
        step's positions on the device (the static input each replay rewrites), and the
        summary names absolute slots, so its rows need no host positions. The same rows as
        the eager checks for a step whose positions are contiguous (every HF step's). Every
        request's reads of every cache come from one launch a cache (`stats.sentinel_device`):
        each replay reruns them."""
        names = list(tensors)
        n = len(self.runs)
        reads = stats.sentinel_device([t[:n] for t in tensors.values()], step.positions[:n])
        for b, run in enumerate(self.runs):
            for i, check in enumerate(("kv_slot0_finite", "kv_new_slots_finite")):
                slot = run.add(reads[b, i])
                row = {"seq": run.next_seq(), "step": run.step, "layer": layer, "site": "layer_out",
                       "path": "prod", "kind": "sentinel", "count": 1, "check": check}  # fmt: skip
                decode = functools.partial(_sentinel_rows, slot, names, None, row, None)
                decode.absolute_tokens = True  # type: ignore[attr-defined]  # slots, not row indices
                run.defer(decode, {})

    def _shadow_layer(
        self, layer: int, module: torch.nn.Module, modes: tuple[str, ...] = ("local", "free")
    ) -> dict[str, torch.Tensor]:
        """The layer re-run in the shadow precision: on the production input (local) and on
        the free chain (free). Returns each mode's layer output; site outputs land in
        step.shadow_sites. The re-run gets no cache (it must neither read production's
        keys nor append its own) and fires no hook but the site captures below."""
        step = self.step
        assert step is not None
        assert step.layer_input is not None
        dtype = self.dtype
        if dtype is None:
            # A refused shadow must leave no row claiming one: re-running the layer in
            # production's own precision would record a shadow equal to production.
            return {}
        kwargs = self._shadow_kwargs(step)
        inputs = {}
        if "local" in self.settings.layer_modes and "local" in modes:
            inputs["local"] = step.layer_input.to(dtype)
        if "free" in self.settings.layer_modes and "free" in modes and step.free is not None:
            inputs["free"] = step.free
        outputs = {}
        mode = [""]

        def site(name: str) -> Any:
            def capture(module: torch.nn.Module, args: tuple, output: Any) -> None:
                tensor = output[0] if isinstance(output, tuple) else output
                step.shadow_sites.setdefault(mode[0], {})[name] = tensor.detach()

            return capture

        capture = {block: site(name) for name, block in self._sites(module).items()}
        indexer = self._indexer_module(module)
        if indexer is not None and self.settings.grafts:
            capture[indexer] = site("indexer")  # its selection, for an indexer graft
        # The expert bank stays as it is: only routed experts run, upcast one at a time.
        banks = shadow.expert_banks(module)
        if shadow.sharded(banks):
            # Tensor-parallel experts (DTensor shards) take their inputs and collectives
            # from transformers' TP hooks, which the shadow suspends: their eager forward
            # runs with each rank's shard upcast instead, counted per layer.
            banks = []
            self.runs[0].count("shadow_expert_bank_upcast")
        bank = shadow.bank_tensors(banks)
        with (
            shadow.full_fp32(),
            shadow.in_precision(module, dtype, keep=lambda t: id(t) in bank),
            shadow.routed_experts(banks, dtype),
            shadow.hooks_suspended(module, capture),
            torch.no_grad(),
        ):
            for mode[0], x in inputs.items():
                # forward, not __call__: hooks on the layer itself (ours, a user's, a
                # test's planted fault) belong to the production call only.
                out = module.forward(x, **kwargs)
                outputs[mode[0]] = out[0] if isinstance(out, tuple) else out
        if "free" in outputs:
            step.free = outputs["free"]
        return outputs

    def _shadow_kwargs(self, step: _Step) -> dict[str, Any]:
        """The layer's arguments for the shadow re-run: no cache, position embeddings and
        a float mask in the shadow precision."""
        kwargs = {k: v for k, v in step.layer_kwargs.items() if k not in ("past_key_values", "cache")}
        kwargs.update({self.inputs.cache_name: None, "use_cache": False})
        kwargs["position_embeddings"] = self._shadow_pe(step)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            seq = step.positions.shape[1]
            if mask.dim() >= 2 and mask.shape[-1] > seq:
                # A static cache's mask spans all its slots; the re-run's keys are this
                # step's tokens alone, which (a step from an empty cache) fill its first slots.
                mask = mask[..., :seq]
            if mask.is_floating_point():
                mask = mask.to(self.dtype)
            kwargs["attention_mask"] = mask
        return kwargs

    def _shadow_pe(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this step's positions in the shadow precision, computed once per step
        for every layer's shadow re-run and indexer recompute."""
        if step.shadow_pe is None:
            like = torch.empty(0, dtype=self.dtype, device=step.positions.device)
            with shadow.hooks_suspended(self.rotary):
                step.shadow_pe = self.rotary.forward(like, step.positions)
        return step.shadow_pe

    def _record_layer(self, layer: int, prod_out: torch.Tensor, shadows: dict[str, torch.Tensor]) -> None:
        step = self.step
        assert step is not None
        assert step.layer_input is not None
        # layer_in is the local shadow's own input, and the free chain's is the previous
        # layer's free layer_out: recorded for prod only.
        sites = []
        if not _records_as_made(step):  # else recorded at their hooks already
            sites = [("layer_in", step.layer_input, {})]
            sites += [
                (name, step.prod_sites[name], {})
                for name in ("attn_out", "mlp_out")
                if name in step.prod_sites
            ]
        sites.append(("layer_out", prod_out, shadows))
        self._record_sites(layer, sites)

    def _record_sites(
        self, layer: int, sites: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]
    ) -> None:
        """Rows of one layer's `sites` (name, prod, its shadows by mode) for every request."""
        step = self.step
        assert step is not None
        s = self.settings
        if not s.layer(layer):
            return
        length = int(step.positions_host.max()) + 1
        for b, run in enumerate(self.runs):
            rows = step.rows.get(b)
            if rows is None and step.capture is not None:
                # Positions are known at each replay only: every row is recorded.
                rows = step.rows[b] = session.TokenRows(step.positions_host[b], None, None)
            elif rows is None:
                rows = step.rows[b] = s.token_rows(step.positions_host[b], length, sites[0][1].device)
            for site, prod, layer_shadows in sites:
                if not s.site(site):
                    continue
                if site in ("attn_out", "mlp_out"):
                    layer_shadows = {m: v[site] for m, v in step.shadow_sites.items() if site in v}
                # a token's vector: [B, S, hidden], or [B, S, streams, hidden] (hyper-connections)
                site_shadows = {m: v[b].flatten(1) for m, v in layer_shadows.items()}
                run.hidden(layer, site, prod[b].flatten(1), site_shadows, rows)

    def _guard_enter(self, layer: int, module: torch.nn.Module, args: tuple) -> None:
        try:
            self._captured = None
            if self.step is not None and self.step.capture is not None:
                return  # no top-k lists in a graph (`_indexer`)
            if self.step is not None and self.runs:
                self.sess.guarded("transformers:indexer_capture", self.runs[0], self._scores_enter, layer)
        except Exception as e:
            self._unguarded(e)

    def _scores_enter(self, layer: int) -> None:
        """Before a traced indexer call: the mode that keeps its top-k input."""
        if self._topk_input is not None:
            return
        if not self.settings.layer(layer) or not self.settings.site("indexer"):
            return
        if "transformers:indexer" in self.sess.disabled:  # nothing would read the scores kept
            return
        mode = _TopkInput()
        mode.__enter__()
        self._topk_input = mode

    def _scores_exit(self, layer: int, module: torch.nn.Module, args: tuple, output: Any) -> None:
        """After the indexer call (also when it raised): the mode leaves, what it kept stays
        for the recording hook that follows."""
        mode, self._topk_input = self._topk_input, None
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
        except Exception as e:  # a mode stack another mode left unbalanced: no capture
            self._unguarded(e)
            return
        try:
            if mode.error is not None:
                self._unguarded(mode.error)
            self._captured = (layer, mode)
        except Exception as e:
            self._unguarded(e)

    def _captured_scores(
        self, layer: int, batch: int, seq: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Production's scores [B, S, keys] of this layer's indexer call, as its top-k saw
        them, and the scores that top-k returned [B, S, k] (None unless it returned k of
        them: a prompt shorter than k); None when the call did not show exactly one top-k
        over fp32 [B, S, keys]."""
        captured, self._captured = self._captured, None
        if captured is None or captured[0] != layer or captured[1].calls != 1:
            return None
        scores, values = captured[1].scores, captured[1].values
        if (
            not isinstance(scores, torch.Tensor)
            or scores.dtype != torch.float32
            or scores.dim() != 3
            or tuple(scores.shape[:2]) != (batch, seq)
        ):
            return None
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (batch, seq, k):
            values = None
        return scores.detach(), None if values is None else values.detach()

    def _indexer(self, layer: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.settings.layer(layer) or not self.settings.site("indexer"):
            return
        names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
        bound = dict(zip(names, args, strict=False)) | kwargs
        shadows = {}
        if self.dtype is not None:
            # The shadow in a guard of its own: its failure leaves production's rows.
            shadows = self.sess.guarded(
                f"indexer_shadow:{layer}", self.runs[0], self._indexer_shadow, layer, module, bound
            ) or {}  # fmt: skip
        self._record_indexer(layer, module, bound, output, shadows)

    def _indexer_shadow(self, layer: int, module: torch.nn.Module, bound: dict) -> dict[int, torch.Tensor]:
        """Each batch row's shadow scores, from the same hidden_states and q_resid with every
        projection in the shadow precision; its keys accumulate per run for decode."""
        step = self.step
        assert step is not None
        scos, ssin = self._shadow_pe(step)
        with shadow.full_fp32():
            q, k, w = _indexer_qkw(
                module, bound["hidden_states"], bound["q_resid"], scos, ssin, self.rope, self.dtype
            )
            how = ", ".join(sorted({
                shadow.projection_path(bound["q_resid"], module.wq_b, self.dtype),
                shadow.projection_path(bound["hidden_states"], module.wk, self.dtype),
            }))  # fmt: skip
            out = {}
            for b, run in enumerate(self.runs):
                shadow.record_kernel(run, "shadow_indexer_projections", how)
                if hf_prefix.CACHED_PREFIX in run.state:  # the prefix's keys were never seen
                    continue
                keys = run.state.setdefault(("indexer_shadow_keys", layer), [])
                keys.append(k[b])
                out[b] = shadow.indexer_scores(
                    run, q[b], torch.cat(keys), w[b], step.positions[b], q_pos_host=step.positions_host[b]
                )
        return out

    def _record_indexer(
        self, layer: int, module: torch.nn.Module, bound: dict, output: Any, shadows: dict[int, torch.Tensor]
    ) -> None:
        step = self.step
        assert step is not None
        hidden, q_resid = bound["hidden_states"], bound["q_resid"]
        captured = self._captured_scores(layer, hidden.shape[0], hidden.shape[1], module.index_topk)
        recomputed = None
        for b, run in enumerate(self.runs):
            q_pos = step.positions[b]
            positions = step.positions_host[b]
            if hf_prefix.CACHED_PREFIX in run.state:
                # Keys of a cached prefix were computed before this request: production's
                # selection is recorded, its scores (k-th score, margins) cannot be.
                run.topk(layer, layer, module.index_topk, positions, q_pos, output[b], None, {})
                run.count("topk_scores_skipped_cached_prefix", len(q_pos))
                continue
            top_values = None
            if captured is not None:
                # Masked keys read -inf whatever HF's mask added (a float mask adds a finite
                # minimum), as the topk table's scores are defined.
                scores = captured[0][b]
                prod_scores = scores.masked_fill(~numerics.causal_mask(q_pos, scores.shape[-1]), -math.inf)
                top_values = None if captured[1] is None else captured[1][b]
                source = "captured: the scores production's top-k call ranked"
                # This step's keys join no recomputation's key list: a later step whose
                # capture fails finds none and is counted, never scored against keys
                # shifted by the ones missing here.
                run.state.pop(("indexer_keys", layer), None)
            else:
                keys = run.state.get(("indexer_keys", layer))
                if keys is None and run.step > 0:
                    # Earlier steps' scores were captured and their keys not kept: this
                    # step's selection is recorded without scores.
                    run.topk(layer, layer, module.index_topk, positions, q_pos, output[b], None, {})
                    run.count("topk_scores_skipped_capture_failed", len(q_pos))
                    continue
                if recomputed is None:
                    cos, sin = bound["position_embeddings"]
                    recomputed = _indexer_qkw(module, hidden, q_resid, cos, sin, self.rope, None)
                prod_q, prod_k, prod_w = recomputed
                keys = run.state.setdefault(("indexer_keys", layer), [])
                keys.append(prod_k[b])
                prod_scores = _hf_scores(prod_q[b], torch.cat(keys), prod_w[b], q_pos, module.softmax_scale)
                run.count("indexer_scores_recomputed")
                source = "recomputed: production's indexer modules re-run in production's dtype"
            # A NaN or Inf among production's visible scores is an event of its own, so that
            # it can be the onset (the top-k rows alone cannot say it). The shadow's finiteness
            # there is unknown: only its selection is kept.
            run.indexer_events(layer, prod_scores, q_pos, positions)
            row_shadows = {"raw": shadows[b]} if b in shadows else {}
            run.topk(
                layer, layer, module.index_topk, positions, q_pos, output[b], prod_scores, row_shadows,
                prod_top_values=top_values, check=source,
            )  # fmt: skip

    def _final_norm(self, module: torch.nn.Module, args: tuple) -> None:
        step = self.step
        assert step is not None
        step.final_stream = args[0].detach()

    def _logits(self, step: _Step, out: Any) -> None:
        if not self.settings.site("logits") or step.final_stream is None:
            return
        logits = out.logits if hasattr(out, "logits") else out[0]
        kept = logits.shape[1]
        mode = "free" if "free" in self.settings.layer_modes and step.free is not None else "local"
        stream = step.free if mode == "free" else step.final_stream
        want_shadow = (
            self.dtype is not None
            and bool(self.settings.layer_modes)
            and (not step.decode or step.scratch is not None)
        )
        head = self._head()
        for b, run in enumerate(self.runs):
            positions = step.positions_host[b][-kept:]
            for start in range(0, kept, _LOGITS_CHUNK):
                rows = slice(start, start + _LOGITS_CHUNK)
                shadow_logits = None
                if want_shadow and stream is not None:
                    x = stream[b : b + 1, -kept:][:, rows].to(self.dtype)
                    with contextlib.ExitStack() as stack:
                        stack.enter_context(shadow.full_fp32())
                        for block in head:
                            stack.enter_context(shadow.in_precision(block, self.dtype))
                            stack.enter_context(shadow.hooks_suspended(block))
                        for block in head:
                            x = block(x)
                    shadow_logits = x[0]
                run.logits(logits[b][rows], shadow_logits, positions[rows])
            run.writer.set_setting("logits_shadow_mode", mode if want_shadow else None)


# Hooks whose captures cannot run inside a CUDA graph: the indexer's top-k lists, whose sizes
# only the device knows, and which the host must wait for.
GRAPH_SKIPPED = ("indexer", "scorer")


def _records_as_made(step: _Step) -> bool:
    """Whether the step records its production-only sites (layer_in, attn_out, mlp_out) at
    their hooks, from the tensors as they are then, rather than from copies at the layer's
    end: inside a CUDA graph, where no shadow re-runs the layer (a prefix hit's scratch
    would) and every copy is a kernel each replay reruns."""
    return step.capture is not None and step.scratch is None


def _skip(capture: graphs.Capture, kind: str) -> None:
    """A kind of capture a graph cannot hold, counted by each replayed step."""
    if kind not in capture.skipped:
        capture.skipped.append(kind)


def _sentinel_rows(
    slot: int, names: list[str], first: int | None, row: dict, detail: str | None, arrays: list[np.ndarray]
) -> list[tuple[str, dict, int]]:
    """The events row of one sentinel check, from its [tensors, (count, first slot)] summary
    (`first` None: [tensors, (count, absolute slot, first and last slot read)], a graph's)."""
    summary = arrays[slot]
    if first is None:
        first, detail = 0, f"slots {int(summary[0, 2])}..{int(summary[0, 3])} of {', '.join(names)}"
    assert detail is not None
    bad = int(summary[:, 0].sum())
    where = next(((names[i], int(summary[i, 1]) + first) for i in range(len(names)) if summary[i, 0]), None)
    if where is not None:
        detail += f": first non-finite at {where[0]} slot {where[1]}"
    row = {**row, "passed": bad == 0, "value": float(bad), "token": None if where is None else where[1],
           "detail": detail}  # fmt: skip
    return [("events", {name: [value] for name, value in row.items()}, 1)]


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
    HF indexer computes them; with `dtype`, every projection in that precision instead, on
    FP8 weights' codes times their scales (`dequant.weight`)."""
    batch, seq, _ = hidden.shape
    heads, dim, rope_dim = module.n_heads, module.head_dim, module.qk_rope_head_dim
    if dtype is None:
        q = module.wq_b(q_resid)
        k = module.k_norm(module.wk(hidden))
        w = module.weights_proj(hidden.to(module.weights_proj.weight.dtype)).float()
    else:
        q = shadow.linear(q_resid, dequant.weight(module.wq_b), dtype)
        norm = module.k_norm
        k = torch.nn.functional.layer_norm(
            shadow.linear(hidden, dequant.weight(module.wk), dtype), norm.normalized_shape,
            norm.weight.to(dtype), norm.bias.to(dtype), norm.eps,
        )  # fmt: skip
        w = shadow.linear(hidden, dequant.weight(module.weights_proj), dtype).float()
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
    """The production scores of one batch row as HF's indexer computes them, with its very
    operand shapes ([1, S, H, D] @ [1, 1, D, T], relu after the softmax scale, then the
    head-weighted sum as a matmul), so that the kernels sum in its order and the k-th score
    and margin are bit for bit the ones the production top-k saw. The fallback of a failed
    capture."""
    scores = torch.relu(torch.matmul(q.float()[None], k.t().float()[None, None]) * scale)  # [1,S,H,T]
    index = torch.matmul(w[None].unsqueeze(-2), scores).squeeze(-2)[0]  # [S,T]
    return index.masked_fill(~numerics.causal_mask(q_pos, k.shape[0]), float("-inf"))


@functools.cache
def _signature(fn: Any) -> inspect.Signature:
    return inspect.signature(fn)


def _version() -> str:
    import transformers

    return transformers.__version__
