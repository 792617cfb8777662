"""TensorRT-LLM's DSA lightning indexer (PyTorch backend), for GLM-5 and DeepSeek-V3.2.

Layouts (`LAYOUTS`, checked at install; the upstream signatures they rely on are recorded,
with the commit each was read at, in tests/python/upstream_data/tensorrt_llm.json):

- `attention_backend`: `tensorrt_llm/_torch/attention_backend/sparse/dsa/indexer.py` at
  NVIDIA/TensorRT-LLM 047098b74c51f488abcfcd72f7d4a988a56442f6 (the previous adapter's target);
- `attention.backends`: `tensorrt_llm/_torch/attention/backends/sparse/dsa/indexer.py` at
  0b228a79d04ae2f7de4b79db495f82dd8e3f7ee0 (main, after PR #17968 moved the module; the
  hooked signatures are the same, `sparse_attn_indexer` lost `use_custom_topk`);
- `model`: `tensorrt_llm/_torch/models/modeling_deepseekv3.py` at 047098b7 and at
  2d7f402ef0d4a86ef6686651b007af82ca98865e: `DeepseekV3ForCausalLM`, which the model
  registry names for DeepseekV32ForCausalLM and, through its subclass
  GlmMoeDsaForCausalLM, for GLM-5.

What is hooked, per indexer layout (production never calls `Indexer.forward`):

- `Indexer.pre_indexer_proj(qr, hidden_states, position_ids)`, called by `dsa/module.py`
  `forward_dsa_proj` on the whole padded batch (position_ids `[1, T_pad]`): its inputs are
  kept, flattened, for the `raw` shadow of the same engine step (one layer's at a time);
- `Indexer.forward_from_projected(metadata, hidden_states, indexer_intermediates,
  is_generation)`, called through `DSATrtllmAttention.sparse_attn_predict` once per phase:
  in a mixed batch, a context call (`is_generation=False`, batch rows [0, num_ctx_tokens))
  and then a generation call (`True`, rows [num_ctx_tokens, num_tokens), its output rows
  starting at 0). Both receive the whole batch's FP8 operands, sliced to num_tokens.

And on the model: `DeepseekV3ForCausalLM.__init__(model_config)` keeps
`model_config.pretrained_config` (the model's HF config: the indexer holds none), and
`DeepseekV3ForCausalLM.forward(attn_metadata, ...)` tells the indexer hooks which model and
engine step are running; it is watched, so a first real forward that reaches no indexer hook
prints one line.

Steps and requests come from the engine: `metadata` is one object reused for every step, but
the model engine assigns `metadata.kv_cache_params` a new `KVCacheParams` every step before
`metadata.prepare()`; that object is the step marker. Requests are `metadata.request_ids`
(the engines' `py_request_id`), context requests first; new tokens `metadata.seq_lens`,
earlier tokens `kv_cache_params.num_cached_tokens_per_seq`.

Shadows: `dequant` scores the engine's own FP8 operands; `raw` recomputes q, k and w in fp32
from the stashed qr and hidden states, with `wq_b` dequantized from its `weight_scale`
(TensorRT-LLM's name; 128x128 blocks), `wk` and `weights_proj` (fp32, or the model dtype
under TRTLLM_DSA_INDEXER_BF16=1), `k_norm` (TensorRT-LLM's LayerNorm: `variance_epsilon`)
and the RoPE of the model's HF config (`rope.indexer_rope`), never the engine's in-place
flashinfer `rotary_emb`. The engine's own convention (`rotary_emb.is_neox`) is written next
to the model's in the manifest's `conventions`, with its Hadamard choice (none, in both layouts)
and the dtype of `weights_proj`: a wrong one is named before any metric.

What it cannot record (counted, under these names):

- steps under CUDA-graph capture or replay, or torch.compile: `captures_skipped_cuda_graph`
  (session; run with `cuda_graph_config=None`);
- beam search (`request_ids` has one entry per request, `seq_lens` one per beam):
  `rows_skipped_beam_search` (session); CUDA-graph padding requests
  (CUDA_GRAPH_DUMMY_REQUEST_ID): `rows_skipped_dummy_requests` (session);
- MTP draft-loop calls (they reuse the target step's metadata): `rows_skipped_mtp_draft`;
- rows whose earlier keys live in the engine's FP8 cache (decode, later prefill chunks,
  block-reuse prefix hits): production only, `shadow_skipped_rows_without_keys`;
- the `raw` shadow when the model's config was not reached
  (`shadow_skipped_no_model_config`), when pre_indexer_proj did not run eagerly in this
  step (`shadow_skipped_stale_stash`: piecewise CUDA graphs), when `wq_b` is neither bf16 nor
  FP8 with [N/128, K/128] fp32 scales (`shadow_skipped_weight_layout`: SM100 resmoothed
  scales, NVFP4), or for a model the reference definitions do not settle
  (`shadow_skipped_unknown_model`);
- the `dequant` shadow of the FP4 indexer (`indexer_k_dtype="fp4"`):
  `shadow_skipped_fp4_indexer`;
- GLM-5.2's shared layers (`index_topk_pattern` "S": built without an indexer, they reuse
  the last full layer's top-k and run no hook of ours): counted when the model is built,
  `indexer_layers_shared` (session);
- GLM-5.3-Flash (`modeling_glm5_next`: the glm_kpool sparse attention, not this indexer) and
  DeepSeek-V4 (`modeling_deepseekv4`: `DeepseekV4Indexer.forward` calls neither hooked
  method): building one says so once, `models_refused` (session).

What ran instead of the indexer's own top-k is recorded, not hidden: rows the short-sequence
skip (`skip_indexer_for_short_seqs`, on by default) filled with every visible key are
counted `indexer_rows_dense_skip` (they are dense rows, kept) and the skip is the convention
`indexer_short_seq_skip`; the top-k implementation of the call's phase (`Indexer.top_k`:
radix, or Guess-Verify-Refine with `enable_heuristic_topk`) is the convention
`indexer_topk_backend` (the model defines none: recorded, never judged).

The engine does not tell the indexer when a request finishes: a run closes after
`engine.IDLE_STEPS` steps without its request, or at exit. Engine warm-up requests are traced
like any other.
"""

import functools
import sys
from typing import Any

import torch

from shadowtrace_hooks import numerics, rope, session
from shadowtrace_hooks.adapters import engine
from shadowtrace_hooks.adapters.layout import Layout, Symbol, run_settings, select
from shadowtrace_hooks.session import Session

NAME = "tensorrt_llm"
VARIANT = "trtllm"
# Rows the engine's short-sequence skip filled with every visible key (its indexer did not run).
DENSE_SKIP = "indexer_rows_dense_skip"
# Layers built without an indexer of their own (shared: they reuse an earlier layer's top-k).
SHARED_LAYERS = "indexer_layers_shared"
OLD = "tensorrt_llm._torch.attention_backend.sparse.dsa.indexer"
NEW = "tensorrt_llm._torch.attention.backends.sparse.dsa.indexer"
MODELING = "tensorrt_llm._torch.models.modeling_deepseekv3"
# tensorrt_llm/_torch/pyexecutor: the request id of CUDA-graph padding sequences.
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1

# What the hooks read besides the hooked signatures (checked against the recorded upstream
# classes by tests/python/test_conformance_trtllm.py).
INDEXER_ATTRIBUTES = (
    "layer_idx", "index_topk", "n_heads", "head_dim", "wq_b", "wk", "k_norm", "weights_proj",
    "rotary_emb", "use_fp4",
)  # fmt: skip
METADATA_ATTRIBUTES = (
    "request_ids", "seq_lens", "num_contexts", "num_seqs", "num_ctx_tokens", "num_tokens",
    "kv_cache_params", "is_cuda_graph",
)  # fmt: skip
KV_CACHE_PARAMS_ATTRIBUTES = ("num_cached_tokens_per_seq",)
ROTARY_ATTRIBUTES = ("is_neox",)


def _indexer_symbols(module: str) -> tuple[Symbol, ...]:
    return (
        Symbol(module, "Indexer.pre_indexer_proj", ("self", "qr", "hidden_states", "position_ids")),
        Symbol(module, "Indexer.forward_from_projected",
               ("self", "metadata", "hidden_states", "indexer_intermediates", "is_generation")),
    )  # fmt: skip


LAYOUTS = (
    Layout(
        name="attention_backend",
        source="NVIDIA/TensorRT-LLM@047098b74c51f488abcfcd72f7d4a988a56442f6 (the module's old path)",
        symbols=_indexer_symbols(OLD),
    ),
    Layout(
        name="attention.backends",
        source="NVIDIA/TensorRT-LLM@0b228a79d04ae2f7de4b79db495f82dd8e3f7ee0 (main after PR #17968)",
        symbols=_indexer_symbols(NEW),
    ),
    Layout(
        name="model",
        source="NVIDIA/TensorRT-LLM@047098b74c51f488abcfcd72f7d4a988a56442f6 and "
        "@2d7f402ef0d4a86ef6686651b007af82ca98865e",
        symbols=(
            Symbol(MODELING, "DeepseekV3ForCausalLM.__init__", ("self", "model_config")),
            Symbol(MODELING, "DeepseekV3ForCausalLM.forward", ("self", "attn_metadata"), leading=True),
        ),
    ),
)
_CONFIG = "_shadowtrace_pretrained_config"


class _Forward:
    """The model forward in progress: its engine step (marker) and the model's HF config."""

    def __init__(self, marker: Any, config: Any, previous: "_Forward | None") -> None:
        self.marker, self.config, self.previous = marker, config, previous


class _Stash:
    """pre_indexer_proj's inputs for the raw shadow, with the step they were taken in."""

    def __init__(
        self, indexer: Any, marker: Any, qr: torch.Tensor, x: torch.Tensor, pos: torch.Tensor
    ) -> None:
        self.indexer, self.marker, self.qr, self.x, self.positions = indexer, marker, qr, x, pos


class _State:
    """Process-wide: the engine runs its model on one thread per process."""

    def __init__(self) -> None:
        self.forward: _Forward | None = None
        self.last_metadata: Any = None
        # One layer's inputs at a time: a stash per layer would keep every layer's hidden
        # states alive for the whole step.
        self.stash: _Stash | None = None


_state = _State()


# Model modules whose attention no layout hooks: building one says so once.
UNTRACED = {
    "tensorrt_llm._torch.models.modeling_glm5_next": (
        ("Glm5NextForCausalLM",),
        f"{NAME}:glm5next",
        "GLM-5.3-Flash's sparse attention (the glm_kpool backend: pooled keys) is not the DSA indexer; "
        "no indexer row is recorded",
    ),
    "tensorrt_llm._torch.models.modeling_deepseekv4": (
        ("DeepseekV4ForCausalLM",),
        f"{NAME}:v4",
        "DeepSeek-V4's indexer (DeepseekV4Indexer.forward, compressed keys) calls neither hooked method; "
        "no indexer row is recorded",
    ),
}


def install(module: Any) -> None:
    """Patches the indexer class of either module path, or the model class."""
    if module.__name__ in UNTRACED:
        classes, key, why = UNTRACED[module.__name__]
        engine.watch_untraced(module, classes, key, f"{NAME} {_version()}: {why}")
        return
    if module.__name__ == MODELING:
        _install_model(module)
    else:
        _install_indexer(module)


def _select(module: Any) -> Layout:
    layouts = tuple(layout for layout in LAYOUTS if module.__name__ in layout.modules)
    return select(layouts, {module.__name__: module}, f"{NAME} {_version()}")


def _version() -> str:
    return str(getattr(sys.modules.get(NAME), "__version__", "unknown"))


def _install_indexer(module: Any) -> None:
    cls = module.Indexer
    if "_shadowtrace_patched" in vars(cls):
        return
    layout = _select(module)
    project, predict = cls.pre_indexer_proj, cls.forward_from_projected

    @functools.wraps(project)
    def traced_project(self: Any, qr: Any, hidden_states: Any, position_ids: Any) -> Any:
        out = project(self, qr, hidden_states, position_ids)
        sess = session.current()
        if sess is not None:
            engine.reached(sess, NAME)
            sess.guarded(
                f"{NAME}:pre_indexer_proj", None, _stash, sess, self, qr, hidden_states, position_ids
            )
        return out

    @functools.wraps(predict)
    def traced_predict(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = predict(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            engine.reached(sess, NAME)
            sess.guarded(f"{NAME}:indexer", None, _record, sess, layout, self, predict, args, kwargs, out)
        return out

    cls.pre_indexer_proj, cls.forward_from_projected = traced_project, traced_predict
    cls._shadowtrace_patched = True
    cls._shadowtrace_layout = module._shadowtrace_layout = layout


def _install_model(module: Any) -> None:
    cls = module.DeepseekV3ForCausalLM
    if "_shadowtrace_patched" in vars(cls):
        return
    layout = _select(module)
    init, forward = cls.__init__, cls.forward

    @functools.wraps(init)
    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            sess.guarded(f"{NAME}:model_config", None, _keep_config, self, init, args, kwargs)

    @functools.wraps(forward)
    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        frame = None
        if sess is not None:
            # Entered before the engine's forward: the indexer hooks inside it need its step.
            frame = sess.guarded(f"{NAME}:forward", None, _enter, self, forward, args, kwargs)
        try:
            return forward(self, *args, **kwargs)
        finally:
            if frame is not None:
                _state.forward = frame.previous
                if frame.previous is None:
                    # No stash outlives its step (nor keeps a layer's activations alive).
                    _state.stash = None

    cls.__init__, cls.forward = traced_init, traced_forward
    cls._shadowtrace_patched = True
    engine.watch_forward(cls, "forward", NAME, _real_forward)
    cls._shadowtrace_layout = module._shadowtrace_layout = layout


# --- the model -------------------------------------------------------------------------


def _keep_config(model: torch.nn.Module, init: Any, args: tuple, kwargs: dict) -> None:
    model_config = engine.bind(init, (model, *args), kwargs)["model_config"]
    # The engine rewrites this config's model_type (glm_moe_dsa -> deepseek_v32) in place;
    # `architectures`, which rope.indexer_rope reads first, stays the checkpoint's.
    model.__dict__[_CONFIG] = model_config.pretrained_config
    # GLM-5.2's shared layers (DeepSeekSparseAttentionConfig._is_full_indexer_layer False:
    # `index_topk_pattern` "S") build their DSATrtllmAttention without an indexer and reuse
    # an earlier layer's selection: no hook of ours runs there, so they are counted here.
    shared = sum(1 for m in model.modules() if getattr(m, "is_full_indexer_layer", True) is False)
    if shared:
        session.current().count(SHARED_LAYERS, shared)  # type: ignore[union-attr]


def _enter(model: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> _Forward:
    metadata = engine.bind(forward, (model, *args), kwargs)["attn_metadata"]
    _state.last_metadata = metadata
    # A model built before tracing started still holds its config as `config`.
    config = model.__dict__.get(_CONFIG) or getattr(model, "config", None)
    frame = _Forward(getattr(metadata, "kv_cache_params", None), config, _state.forward)
    _state.forward = frame
    return frame


def _real_forward() -> bool:
    """A serving forward, not a CUDA-graph warm-up or an empty batch."""
    metadata = _state.last_metadata
    if metadata is None or getattr(metadata, "is_cuda_graph", False):
        return False
    return int(getattr(metadata, "num_tokens", 0) or 0) > 0


# --- the indexer -----------------------------------------------------------------------


def _stash(sess: Session, indexer: Any, qr: torch.Tensor, hidden: Any, position_ids: torch.Tensor) -> None:
    if sess.settings.precision is None or session.capturing():
        return
    # An Fp4QuantizedTensor carries the bf16 normalized hidden states the indexer used.
    hidden = getattr(hidden, "unquantized_hidden_states", hidden)
    frame = _state.forward
    _state.stash = _Stash(
        indexer,
        None if frame is None else frame.marker,
        qr.detach(),
        hidden.detach(),
        # [1, T_pad] from the model engine; flashinfer's RoPE reads it as view(-1) too.
        position_ids.detach().reshape(-1),
    )


def _record(
    sess: Session, layout: Layout, indexer: Any, predict: Any, args: tuple, kwargs: dict, out: torch.Tensor
) -> None:
    s = sess.settings
    layer = int(indexer.layer_idx)
    if not (s.layer(layer) and s.site("indexer")):
        return
    bound = engine.bind(predict, (indexer, *args), kwargs)
    metadata = bound["metadata"]
    if session.capturing() or getattr(metadata, "is_cuda_graph", False):
        sess.count("captures_skipped_cuda_graph")
        sess.warn_once(
            f"{NAME}:cuda_graph",
            f"{NAME}: CUDA-graph steps run as replays and are not traced (counted as "
            "captures_skipped_cuda_graph); run with cuda_graph_config=None to trace every step",
        )
        return
    marker = metadata.kv_cache_params
    if marker is None:
        raise ValueError(f"{NAME}: metadata.kv_cache_params is None: no engine step to record")
    phase = bound["is_generation"]
    phase = None if phase is None else bool(phase)
    contexts, seqs = int(metadata.num_contexts), int(metadata.num_seqs)
    ctx_tokens, tokens = int(metadata.num_ctx_tokens), int(metadata.num_tokens)
    first, last, r0, r1 = {
        None: (0, seqs, 0, tokens),
        False: (0, contexts, 0, ctx_tokens),
        True: (contexts, seqs, ctx_tokens, tokens),
    }[phase]
    request_ids = list(metadata.request_ids or [])
    if len(request_ids) != seqs:
        sess.count("rows_skipped_beam_search", r1 - r0)
        sess.warn_once(
            f"{NAME}:beam_search",
            f"{NAME}: {len(request_ids)} request ids for {seqs} sequences (beam search): those rows "
            "are not traced (counted as rows_skipped_beam_search)",
        )
        return
    requests = _requests(sess, metadata, request_ids, first, last, phase)
    if sum(r.rows for r in requests) + _dummy_rows(metadata, request_ids, first, last) != r1 - r0:
        raise ValueError(f"{NAME}: seq_lens of requests {first}..{last} do not add up to rows {r0}..{r1}")
    if getattr(metadata, "in_mtp_draft_loop", False):
        for req in requests:
            req.skipped["rows_skipped_mtp_draft"] = req.rows
    # skip_indexer_for_short_seqs (on by default): a phase whose every request sees at most
    # k keys gets every visible key copied in, and its indexer does not run. The rows are
    # right as a set (dense rows), but not the indexer's: counted, and a convention.
    dense_ctx = bool(getattr(metadata, "skip_indexer_for_ctx_reqs", False))
    dense_gen = bool(getattr(metadata, "skip_indexer_for_gen_reqs", False))
    for i, req in enumerate(requests):
        if not req.skipped and (dense_gen if first + i >= contexts else dense_ctx):
            req.counts[DENSE_SKIP] = req.rows

    if out.shape[0] < r1 - r0:
        raise ValueError(f"{NAME}: the indexer returned {out.shape[0]} rows for {r1 - r0} tokens")

    frame = _state.forward
    config = None if frame is None else frame.config
    model_rope = _model_rope(config)
    shadowed = [r for r in requests if r.prefix == 0 and not r.skipped] if s.precision else []
    raw = None
    if shadowed:
        got = sess.guarded(
            f"{NAME}:raw_inputs", None, _raw_inputs, sess, indexer, marker, r0, r1, config, model_rope
        )
        raw, reason = got if got is not None else (None, None)
        for req in shadowed if reason else []:
            req.counts[reason] = req.rows
    q8, k8, k_scale, weights, _ = bound["indexer_intermediates"]
    fp8 = engine.Fp8Operands(
        q8=q8[r0:r1], weights=weights[r0:r1], k8=k8, k_scale=k_scale.reshape(-1), k_offset=r0
    )
    if getattr(indexer, "use_fp4", False):
        # Packed E2M1 codes with int32 UE8M0 scales: not the FP8 product folded_scores computes.
        fp8 = None
        for req in shadowed:
            req.counts["shadow_skipped_fp4_indexer"] = req.rows
    convention = engine.rope_convention(
        bool(indexer.rotary_emb.is_neox), model_rope,
        f"{type(indexer).__module__}.Indexer.rotary_emb.is_neox (DSAParams.indexer_rope_interleave)",
        "the model's HF config was not reached",
    )  # fmt: skip
    call = engine.IndexerCall(
        marker=marker,
        layer=layer,
        k=int(indexer.index_topk),
        # The engine's output buffer is reused by every layer.
        prod_topk=out[: r1 - r0].clone(),
        requests=requests,
        raw=raw,
        fp8=fp8,
        settings=run_settings(layout, NAME, _version()),
        conventions=[
            convention,
            # Neither checked layout rotates: PR #11899 fused the FP8 cast and dropped
            # rotate_activation, which the module still defines but never calls. Nothing at
            # run time shows it: a release that calls it again under the same signatures
            # would keep the layout, so the value is recorded as assumed.
            engine.hadamard_convention(
                False,
                f"assumed from {NAME} layout {layout.name} ({layout.source}): pre_indexer_proj "
                "quantizes q and k without rotate_activation (dropped by PR #11899)",
                config,
                assumed=True,
            ),
            engine.head_weight_scale_convention(
                engine.folded_scale(indexer, "weight_scale_factor"),
                f"{type(indexer).__module__}.Indexer.weight_scale_factor",
                config,
            ),
            engine.weights_proj_convention(
                _weight_dtype(indexer.weights_proj),
                f"{type(indexer).__module__}.Indexer.weights_proj.weight.dtype (TRTLLM_DSA_INDEXER_BF16)",
            ),
            engine.convention(
                "indexer_short_seq_skip",
                getattr(metadata, "enable_indexer_skip", None),
                None,
                "DSAtrtllmAttentionMetadata.enable_indexer_skip (skip_indexer_for_short_seqs)",
                "none: the model defines no skip",
            ),
            engine.topk_backend_convention(*_topk_backend(indexer, phase)),
        ],
    )
    engine.tracer_for(sess, NAME, VARIANT, int(indexer.index_topk), config).record(call)


def _topk_backend(indexer: Any, phase: bool | None) -> tuple[str | None, str]:
    """The indexer's top-k implementation for the call's phase (`Indexer.top_k`, main after
    PR #17968: radix, or the Guess-Verify-Refine heuristic with `enable_heuristic_topk` on
    SM100), as the engine names it; None before `top_k` existed."""
    top_k = getattr(indexer, "top_k", None)
    heuristic = getattr(indexer, "_enable_heuristic_topk", None)
    source = f"{type(indexer).__module__}.Indexer.top_k (enable_heuristic_topk={heuristic})"
    if top_k is None:
        return None, f"not read: {source} absent"

    def name(which: str) -> str:
        value = getattr(top_k, f"{which}_implementation", None)
        return str(getattr(value, "value", value))

    if phase is None:
        return f"prefill={name('prefill')},decode={name('decode')}", source
    return name("decode" if phase else "prefill"), source


def _weight_dtype(linear: Any) -> torch.dtype | None:
    weight = getattr(linear, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def _requests(
    sess: Session, metadata: Any, request_ids: list, first: int, last: int, phase: bool | None
) -> list[engine.Request]:
    seq_lens = [int(n) for n in metadata.seq_lens[first:last]]
    cached_all = metadata.kv_cache_params.num_cached_tokens_per_seq
    if cached_all is None:
        raise ValueError(f"{NAME}: kv_cache_params.num_cached_tokens_per_seq is None")
    cached = [int(n) for n in cached_all[first:last]]
    contexts = int(metadata.num_contexts)
    out, start = [], 0
    for i, (rid, rows, prefix) in enumerate(zip(request_ids[first:last], seq_lens, cached, strict=True)):
        if int(rid) == CUDA_GRAPH_DUMMY_REQUEST_ID:
            sess.count("rows_skipped_dummy_requests", rows)
        else:
            out.append(
                engine.Request(
                    key=f"trtllm-{int(rid)}", start=start, rows=rows, prefix=prefix,
                    prefill=phase is not True and first + i < contexts,
                )
            )  # fmt: skip
        start += rows
    return out


def _dummy_rows(metadata: Any, request_ids: list, first: int, last: int) -> int:
    lens = metadata.seq_lens[first:last]
    return sum(int(n) for rid, n in zip(request_ids[first:last], lens, strict=True)
               if int(rid) == CUDA_GRAPH_DUMMY_REQUEST_ID)  # fmt: skip


_SKIP_MESSAGES = {
    "shadow_skipped_no_model_config": "the model's HF config was not reached (DeepseekV3ForCausalLM was "
    "not built or run under tracing): the raw indexer shadow is skipped",
    "shadow_skipped_stale_stash": "pre_indexer_proj did not run eagerly in this engine step (piecewise "
    "CUDA graphs or torch.compile): the raw indexer shadow is skipped for its rows",
    "shadow_skipped_weight_layout": "wq_b holds neither bf16 nor FP8 weights with [N/128, K/128] fp32 "
    "scales (SM100 resmoothed scales, NVFP4): the raw indexer shadow is skipped",
    "shadow_skipped_unknown_model": "the model's indexer RoPE is not settled by its config: the raw "
    "indexer shadow is skipped",
}


def _model_rope(config: Any) -> rope.IndexerRope | None:
    if config is None:
        return None
    try:
        return rope.indexer_rope(config)
    except rope.UnknownModel:
        return None


def _raw_inputs(
    sess: Session,
    indexer: Any,
    marker: Any,
    r0: int,
    r1: int,
    config: Any,
    model_rope: rope.IndexerRope | None,
) -> tuple[engine.RawInputs | None, str | None]:
    """The call's raw-shadow inputs, or why there are none."""
    stash = _state.stash
    if config is None:
        reason = "shadow_skipped_no_model_config"
    elif (
        stash is None
        or stash.indexer is not indexer
        or stash.marker is None
        or stash.marker is not marker
        or min(stash.positions.shape[0], stash.qr.shape[0], stash.x.shape[0]) < r1
    ):
        reason = "shadow_skipped_stale_stash"
    elif not _dense_layout(indexer.wq_b):
        reason = "shadow_skipped_weight_layout"
    elif model_rope is None:
        reason = "shadow_skipped_unknown_model"
    else:
        reason = None
    if reason is not None or stash is None or model_rope is None:
        sess.warn_once(f"{NAME}:{reason}", f"{NAME}: {_SKIP_MESSAGES[str(reason)]} (counted as {reason})")
        return None, reason

    @functools.cache
    def weights() -> engine.IndexerWeights:
        return engine.weights_of(
            int(indexer.n_heads), int(indexer.head_dim), numerics.dense_weight(indexer.wq_b),
            indexer.wk.weight.float(), indexer.weights_proj.weight.float(), indexer.k_norm,
        )  # fmt: skip

    raw = engine.RawInputs(
        x=stash.x[r0:r1],
        qr=stash.qr[r0:r1],
        positions=stash.positions[r0:r1],
        weights=weights,
        rope=model_rope,
    )
    return raw, None


def _dense_layout(linear: Any) -> bool:
    """Whether numerics.dense_weight reads this wq_b right: a bf16/fp32 weight, or an FP8
    one with TensorRT-LLM's `weight_scale` as checkpoints hold it (one fp32 per 128x128)."""
    weight = linear.weight
    if weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return True
    if weight.dtype != torch.float8_e4m3fn:
        return False
    scale = getattr(linear, "weight_scale", None)
    rows, cols = weight.shape
    expected = ((rows + 127) // 128, (cols + 127) // 128)
    return scale is not None and scale.dtype == torch.float32 and tuple(scale.shape) == expected
