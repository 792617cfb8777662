"""SGLang: the DSA (formerly NSA) lightning indexer of GLM-5 and DeepSeek-V3.2.

Supported: sglang 0.5.8 through 0.5.23, read in the released wheels (`LAYOUTS`, checked at
install and against the wheels by tests/python/test_conformance_sglang.py). Paths are under
`python/sglang/srt/`.

What is hooked, per layout of `layers/attention/{dsa/dsa_indexer,nsa/nsa_indexer}.py` (the
module is `nsa/nsa_indexer.py` up to 0.5.10; from 0.5.13 it is `dsa/dsa_indexer.py` and the
nsa path re-exports the same class, patched once):

- `unfused` (0.5.8 to 0.5.13): `Indexer.forward_cuda(x, q_lora, positions, forward_batch,
  layer_id, return_indices)` -> int32 top-k [T, index_topk], -1 padded, or None;
  `Indexer._get_q_k_bf16(q_lora, x, positions, enable_dual_stream, forward_batch)` -> (query
  [T,H,D], key [T,D]) in bf16 after RoPE and the Hadamard rotation;
  `Indexer._get_logits_head_gate(x, q_scale)` -> weights [T,H,1] fp32 with H^-0.5, q_scale and
  D^-0.5 folded in; `Indexer.__init__` (its `prefix`, to tell the NextN draft layer apart);
- `fused_indexer` (0.5.15 to 0.5.22): the same, `_get_q_k_bf16` returning a third element,
  plus `Indexer._fused_q_prepare_and_store(x, q_lora, positions, forward_batch, layer_id,
  act_quant, ...)`, the path GLM-5 takes on CUDA (interleaved RoPE, no Hadamard, and from
  0.5.22 no Hadamard on its `_get_q_k_bf16` fallbacks either), which calls neither helper;
- `use_cuda_graph` (0.5.23): `forward_cuda` gains `use_cuda_graph: bool = True`.

And in every release: `model_executor/forward_batch_info.py` `ForwardBatch.init_new(batch,
model_runner)`, which on 0.5.8 (no `ForwardBatch.rids`) attaches the request ids of
`batch.reqs`; `models/deepseek_v2.py` `DeepseekV2ForCausalLM.__init__(config, ...)`, whose
`config` (the model's HF config) the indexers built inside it keep for the raw shadow's RoPE,
and `.forward(input_ids, positions, forward_batch, ...)`, watched so that a first real
forward that reaches no indexer hook says so. Both GlmMoeDsaForCausalLM (0.5.10+) and
DeepseekV32ForCausalLM subclass DeepseekV2ForCausalLM.

Requests are the engine's request ids (`forward_batch.rids`, 0.5.10+), never the reused
`req_pool_indices`; an engine step is one ForwardBatch object (its marker). Rows follow the
rids: `extend_seq_lens_cpu` / `extend_prefix_lens_cpu` for EXTEND and MIXED (running requests
last, one row each), one row per request for DECODE. A run closes when a DECODE or MIXED step,
which holds the whole running batch, lacks a request seen decoding before; absence from other
steps (prefill-only steps, chunked prefill) closes nothing.

Shadows: `dequant` scores the engine's own q and k, quantized as `act_quant(., 128, "ue8m0")`
does (amax clamp 1e-4), with the engine's own head gates; `raw` recomputes q, k and w in fp32
from the layer's inputs and the dequantized weights, with RoPE from the model's HF config
(`rope.indexer_rope`, never the engine's `rotary_emb`). The engine's RoPE convention
(`rotary_emb.is_neox_style`) and its Hadamard choice (per call: the fused writer never rotates,
`_maybe_rotate` skips it when fusion is on) are written beside the model's in the manifest's
`conventions`.

Not recorded, and counted (in the request's run, else in the session with one line):
- fused top-k (`envs.SGLANG_DSA_FUSE_TOPK`, `SGLANG_NSA_FUSE_TOPK` up to 0.5.10, true by
  default, unless the backend forces unfused top-k for the call): the indices are KV-pool
  slots, `topk_fused_not_recorded`; run with the variable set to 0;
- LiteTopK (main after 0.5.23, `SGLANG_ENABLE_DSA_LITETOPK`, SM100 extend batches: the hooked
  `Indexer._get_topk_ragged_litetopk` ran in the call): its indices are positions in the
  batch's gathered keys (request i's offset by the keys of the requests before it), not the
  request's own, whatever `SGLANG_DSA_FUSE_TOPK` says, `topk_litetopk_not_recorded`; the
  single-request `SGLANG_LITETOPK` path returns request positions and is recorded; the CP-v2
  fused prepare runs only under context parallelism, already
  `context_parallel_rows_not_recorded`;
- calls that return no top-k (dense MHA prefill, K-cache writes), `indexer_rows_without_topk`;
  speculative verify / draft-extend batches, `speculative_rows_not_recorded`; context-parallel
  prefill (key rows are not query rows), `context_parallel_rows_not_recorded`; NextN draft
  layers, `nextn_draft_rows_not_recorded` (their step not counted); two-batch-overlap halves,
  `tbo_split_rows_not_recorded`; batches with no request ids (warm-up, graph capture),
  `indexer_rows_without_request_ids`; batches whose rows do not split into their requests,
  `indexer_rows_unattributed`; steps under CUDA-graph capture, `captures_skipped_cuda_graph`;
  batches replayed from a CUDA graph (decode batches by default: no indexer Python runs in
  them), told by no indexer hook running between one `ForwardBatch.init_new` and the next
  (or the session's end), `indexer_steps_unseen` in each of their requests' runs (a
  speculative draft batch replayed so counts too);
- the prefill CUDA-graph split op (0.5.15+, on by default on CUDA) calls the helpers without
  `forward_cuda`, `indexer_graph_replay_not_recorded`: run with `--disable-cuda-graph`;
- the fused GLM-5 path has no dequant operands, `dequant_unavailable_fused_indexer` (another
  path without them: `dequant_unavailable`); a model config the hooks cannot reach or read,
  `shadow_skipped_no_model_config`; hidden states handed over as FP8 only (ROCm),
  `shadow_skipped_fp8_hidden_states`.

Not hooked: `IndexerKPool` (0.5.20+, `index_kpool > 1`), not an Indexer subclass, and GLM-5.2's
shared layers, which have no indexer (0.5.18+): a model running only those says so after its
first forward. In a MIXED batch a running request is told from a prefill by being a known
one-row request at the batch's tail; a prompt's last chunk of one token in that place would
pass for a decode row. Every attention-TP rank records its own runs (the indexer is
replicated; run ids carry the rank).
"""

import functools
import inspect
import sys
import weakref
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from shadowtrace_hooks import numerics, rope, session
from shadowtrace_hooks.adapters import engine
from shadowtrace_hooks.adapters.engine import (
    EngineTracer,
    Fp8Operands,
    IndexerCall,
    IndexerWeights,
    RawInputs,
    Request,
)
from shadowtrace_hooks.adapters.layout import Layout, Symbol, run_settings, select
from shadowtrace_hooks.rope import IndexerRope
from shadowtrace_hooks.session import Session

NAME = "sglang"
INDEXER_MODULES = (
    "sglang.srt.layers.attention.dsa.dsa_indexer",
    "sglang.srt.layers.attention.nsa.nsa_indexer",
)
BATCH_MODULE = "sglang.srt.model_executor.forward_batch_info"
MODEL_MODULE = "sglang.srt.models.deepseek_v2"
# The fused-top-k variable, newest name first: 0.5.13 renamed it (keeping the old one as an
# alias until 0.5.20); 0.5.8 and 0.5.10 know only the old one.
FUSE_TOPK = ("SGLANG_DSA_FUSE_TOPK", "SGLANG_NSA_FUSE_TOPK")

_FORWARD = ("self", "x", "q_lora", "positions", "forward_batch", "layer_id", "return_indices")
_QK = ("self", "q_lora", "x", "positions", "enable_dual_stream", "forward_batch")
_GATE = ("self", "x", "q_scale")
_FUSED = ("self", "x", "q_lora", "positions", "forward_batch", "layer_id", "act_quant")
_INIT = (
    "self", "hidden_size", "index_n_heads", "index_head_dim", "rope_head_dim", "index_topk",
    "q_lora_rank", "max_position_embeddings", "rope_theta", "layer_id", "scale_fmt", "block_size",
    "rope_scaling",
)  # fmt: skip


def _indexer_layouts(module: str) -> tuple[Layout, ...]:
    forward = Symbol(module, "Indexer.forward_cuda", _FORWARD)
    helpers = (
        Symbol(module, "Indexer._get_q_k_bf16", _QK),
        Symbol(module, "Indexer._get_logits_head_gate", _GATE),
        Symbol(module, "Indexer.__init__", _INIT, leading=True),
    )
    fused = Symbol(module, "Indexer._fused_q_prepare_and_store", _FUSED, leading=True)
    # Most specific first: `select` takes the first layout whose symbols all match.
    return (
        Layout(
            "use_cuda_graph",
            "sglang 0.5.23",
            (Symbol(module, "Indexer.forward_cuda", (*_FORWARD, "use_cuda_graph")), *helpers, fused),
        ),
        Layout("fused_indexer", "sglang 0.5.15 to 0.5.22", (forward, *helpers, fused)),
        Layout("unfused", "sglang 0.5.8 to 0.5.13", (forward, *helpers)),
    )


LAYOUTS = (
    *(layout for module in INDEXER_MODULES for layout in _indexer_layouts(module)),
    Layout(
        "init_new",
        "sglang 0.5.8 to 0.5.23",
        (Symbol(BATCH_MODULE, "ForwardBatch.init_new", ("cls", "batch", "model_runner"), leading=True),),
    ),
    Layout(
        "deepseek_v2",
        "sglang 0.5.8 to 0.5.23",
        (
            Symbol(
                MODEL_MODULE, "DeepseekV2ForCausalLM.__init__", ("self", "config", "quant_config", "prefix")
            ),
            Symbol(
                MODEL_MODULE,
                "DeepseekV2ForCausalLM.forward",
                ("self", "input_ids", "positions", "forward_batch"),
                leading=True,
            ),
        ),
    ),
)
# The architectures SGLang's registry (each models/ module's EntryClass) routes to the
# hooked DeepseekV2ForCausalLM, and the module defining each.
ARCHITECTURES = {
    "DeepseekV32ForCausalLM": MODEL_MODULE,
    "GlmMoeDsaForCausalLM": "sglang.srt.models.glm4_moe",  # 0.5.10 and later
}

_STASH = "_shadowtrace_operands"  # this forward_cuda call's q, k and head gates
_IN_FORWARD = "_shadowtrace_in_forward_cuda"
_ORIGIN = "_shadowtrace_origin"
_LITETOPK = "_shadowtrace_litetopk"  # this forward_cuda call's top-k went through LiteTopK
_RIDS = "_shadowtrace_rids"  # request ids attached by ForwardBatch.init_new (0.5.8)

# HF configs of the DeepseekV2ForCausalLM instances being built (their indexers keep theirs).
_BUILDING: list[Any] = []
# Whether the last model forward was a real step (request ids, not idle): the watch reads it.
_LAST_FORWARD = {"real": False}


def install(module: ModuleType) -> None:
    """Patches one SGLang module (the indexer, ForwardBatch or the DeepSeek model), or
    raises UnsupportedVersion naming every difference."""
    name = module.__name__
    layouts = tuple(layout for layout in LAYOUTS if name in layout.modules)
    where = f"{NAME} {_version()}"
    if name == BATCH_MODULE:
        layout = select(layouts, {name: _declared_batch(module)}, where)
        _install_batch(module.ForwardBatch)
    elif name == MODEL_MODULE:
        layout = select(layouts, {name: module}, where)
        _install_model(module.DeepseekV2ForCausalLM)
    else:
        layout = select(layouts, {name: module}, where)
        _install_indexer(module, module.Indexer, layout)
    module._shadowtrace_layout = layout  # type: ignore[attr-defined]


def _version() -> str:
    package = sys.modules.get("sglang")
    return str(getattr(package, "__version__", "unknown"))


def _declared_batch(module: ModuleType) -> SimpleNamespace:
    """ForwardBatch as the layouts (and the released source) spell it: `init_new` is a
    classmethod, whose bound signature would hide `cls`."""
    raw = inspect.getattr_static(module.ForwardBatch, "init_new", None)
    return SimpleNamespace(ForwardBatch=SimpleNamespace(init_new=getattr(raw, "__func__", raw)))


# --- ForwardBatch and the model ---------------------------------------------------------


def _install_batch(cls: type) -> None:
    if "_shadowtrace_patched" in cls.__dict__:
        return
    init_new = inspect.getattr_static(cls, "init_new").__func__

    @functools.wraps(init_new)
    def traced_init_new(klass: type, batch: Any, *args: Any, **kwargs: Any) -> Any:
        ret = init_new(klass, batch, *args, **kwargs)
        sess = session.current()
        if sess is not None and getattr(ret, "rids", None) is None:
            sess.guarded("sglang:request_ids", None, _attach_rids, ret, batch)
        if sess is not None:
            sess.guarded("sglang:step", None, _began, sess, ret)
        return ret

    cls.init_new = classmethod(traced_init_new)  # type: ignore[attr-defined]
    cls._shadowtrace_patched = True  # type: ignore[attr-defined]


def _attach_rids(forward_batch: Any, batch: Any) -> None:
    # 0.5.8's ForwardBatch has no rids, but the ModelWorkerBatch it is built from holds the
    # requests themselves.
    reqs = getattr(batch, "reqs", None)
    if reqs is not None:
        setattr(forward_batch, _RIDS, [str(req.rid) for req in reqs])


def _began(sess: Session, forward_batch: Any) -> None:
    """A batch is about to run: the one before it is settled (`EngineTracer.settle`), once an
    indexer call has been recorded in this process (a model without one has nothing to miss)."""
    tracer = sess.tracers.get(NAME)
    if tracer is None:
        return
    mode = getattr(forward_batch, "forward_mode", None)
    keys = [] if mode is None or _mode(mode, "is_idle") else (_request_ids(forward_batch) or [])
    tracer.step_began(
        keys,
        f"sglang {_version()}: engine steps whose indexer ran no Python (CUDA-graph replays of decode "
        f"batches) are not recorded; each request's run counts them ({engine.UNSEEN}): run the server "
        "with --disable-cuda-graph to record them",
    )


def _install_model(cls: type) -> None:
    if "_shadowtrace_patched" in cls.__dict__:
        return
    init, forward = cls.__init__, cls.forward  # type: ignore[misc]
    forward_signature = inspect.signature(forward)

    @functools.wraps(init)
    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        # Pushed before the original runs: the indexers are built inside it and take the
        # config from here (NextN draft models are built without this __init__).
        _BUILDING.append(args[0] if args else kwargs.get("config"))
        try:
            init(self, *args, **kwargs)
        finally:
            _BUILDING.pop()

    @functools.wraps(forward)
    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            sess.guarded("sglang:model_forward", None, _note_forward, forward_signature, self, args, kwargs)
        return out

    cls.__init__, cls.forward = traced_init, traced_forward  # type: ignore[misc]
    cls._shadowtrace_patched = True  # type: ignore[attr-defined]
    engine.watch_forward(cls, "forward", NAME, lambda: _LAST_FORWARD["real"])


def _note_forward(signature: inspect.Signature, model: Any, args: tuple, kwargs: dict) -> None:
    batch = signature.bind_partial(model, *args, **kwargs).arguments.get("forward_batch")
    mode = getattr(batch, "forward_mode", None)
    _LAST_FORWARD["real"] = bool(_request_ids(batch)) and not _mode(mode, "is_idle")


# --- the indexer ------------------------------------------------------------------------


@dataclass
class _Origin:
    """Where an indexer was built: its module prefix and its model's HF config."""

    prefix: str
    layer_id: int
    config: Any
    rope: IndexerRope | None = None
    rope_error: str | None = None

    @property
    def draft(self) -> bool:
        """The NextN (MTP) draft layer: built as layer 0 under `model.decoder` (or
        `model.layers.<num_hidden_layers>`), it would otherwise pass for target layer 0."""
        return bool(self.prefix) and f"layers.{self.layer_id}." not in f"{self.prefix}."


def _install_indexer(module: ModuleType, cls: type, layout: Layout) -> None:
    if "_shadowtrace_patched" in cls.__dict__:
        return
    init, forward_cuda = cls.__init__, cls.forward_cuda  # type: ignore[misc]
    get_q_k, head_gate = cls._get_q_k_bf16, cls._get_logits_head_gate  # type: ignore[attr-defined]
    init_signature = inspect.signature(init)

    @functools.wraps(init)
    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            sess.guarded("sglang:indexer_init", None, _remember_origin, init_signature, self, args, kwargs)

    @functools.wraps(forward_cuda)
    def traced_forward_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        if sess is None:
            return forward_cuda(self, *args, **kwargs)
        engine.reached(sess, NAME)
        state = self.__dict__
        state.pop(_STASH, None)
        state.pop(_LITETOPK, None)
        state[_IN_FORWARD] = state.get(_IN_FORWARD, 0) + 1
        try:
            out = forward_cuda(self, *args, **kwargs)
        finally:
            state[_IN_FORWARD] -= 1
        sess.guarded(
            "sglang:indexer", None, _capture, sess, module, layout, forward_cuda, (self, *args), kwargs, out
        )
        return out

    @functools.wraps(get_q_k)
    def traced_get_q_k(self: Any, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        if sess is not None:
            engine.reached(sess, NAME)
        out = get_q_k(self, *args, **kwargs)
        if sess is not None:
            sess.guarded("sglang:operands", None, _stash_q_k, sess, self, out)
        return out

    @functools.wraps(head_gate)
    def traced_head_gate(self: Any, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        if sess is not None:
            engine.reached(sess, NAME)
        out = head_gate(self, *args, **kwargs)
        if sess is not None:
            sess.guarded("sglang:operands", None, _stash_gate, self, out)
        return out

    cls.__init__ = traced_init  # type: ignore[misc]
    cls.forward_cuda = traced_forward_cuda  # type: ignore[attr-defined]
    cls._get_q_k_bf16 = traced_get_q_k  # type: ignore[attr-defined]
    cls._get_logits_head_gate = traced_head_gate  # type: ignore[attr-defined]
    fused = getattr(cls, "_fused_q_prepare_and_store", None)
    if fused is not None:

        @functools.wraps(fused)
        def traced_fused(self: Any, *args: Any, **kwargs: Any) -> Any:
            sess = session.current()
            if sess is not None:
                engine.reached(sess, NAME)
            out = fused(self, *args, **kwargs)
            if sess is not None:
                sess.guarded("sglang:operands", None, _mark_fused, sess, self, args, kwargs)
            return out

        cls._fused_q_prepare_and_store = traced_fused  # type: ignore[attr-defined]
    litetopk = getattr(cls, "_get_topk_ragged_litetopk", None)
    if litetopk is not None:

        @functools.wraps(litetopk)
        def traced_litetopk(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.__dict__[_LITETOPK] = True
            return litetopk(self, *args, **kwargs)

        cls._get_topk_ragged_litetopk = traced_litetopk  # type: ignore[attr-defined]
    cls._shadowtrace_patched = True  # type: ignore[attr-defined]


def _remember_origin(signature: inspect.Signature, indexer: Any, args: tuple, kwargs: dict) -> None:
    bound = signature.bind_partial(indexer, *args, **kwargs).arguments
    # The config of the DeepseekV2ForCausalLM being built (every release); 0.5.18+ also
    # hands its own `config` to the indexer, which other models (dots3, glm5_next) use.
    config = _BUILDING[-1] if _BUILDING else bound.get("config")
    indexer.__dict__[_ORIGIN] = _Origin(str(bound.get("prefix") or ""), int(bound["layer_id"]), config)


def _in_forward(indexer: Any) -> bool:
    return bool(indexer.__dict__.get(_IN_FORWARD))


def _graph_replay(sess: Session, rows: int) -> None:
    """The helpers ran outside forward_cuda: the prefill CUDA graph's split op at replay,
    which the hooks cannot attribute to requests."""
    sess.count("indexer_graph_replay_not_recorded", rows)
    sess.warn_once(
        "sglang:graph_replay",
        f"sglang {_version()}: the indexer ran inside a prefill CUDA graph (split op), which the hooks "
        "cannot record (counted as indexer_graph_replay_not_recorded): run the server with "
        "--disable-cuda-graph",
    )


def _stash_q_k(sess: Session, indexer: Any, out: Any) -> None:
    if session.capturing():
        return
    if not _in_forward(indexer):
        _graph_replay(sess, int(out[0].shape[0]))
        return
    # out[0], out[1] whether the release returns (query, key) or (query, key, weights_raw)
    indexer.__dict__[_STASH] = {"query": out[0].detach().clone(), "key": out[1].detach().clone()}


def _stash_gate(indexer: Any, out: torch.Tensor) -> None:
    stash = indexer.__dict__.get(_STASH)
    if stash is not None and _in_forward(indexer) and not session.capturing():
        stash["weights"] = out.detach().clone()


def _mark_fused(sess: Session, indexer: Any, args: tuple, kwargs: dict) -> None:
    if session.capturing():
        return
    if not _in_forward(indexer):
        q_lora = kwargs.get("q_lora", args[1] if len(args) > 1 else None)
        _graph_replay(sess, int(q_lora.shape[0]) if isinstance(q_lora, torch.Tensor) else 0)
        return
    indexer.__dict__[_STASH] = {"fused": True}


# --- one forward_cuda call -----------------------------------------------------------------


@dataclass
class _Steps:
    """The engine steps one tracer has seen: the current ForwardBatch (kept, so its id cannot
    be reused) and the requests seen decoding."""

    batch: Any = None
    decoding: set[str] = field(default_factory=set)


_STEPS: "weakref.WeakKeyDictionary[EngineTracer, _Steps]" = weakref.WeakKeyDictionary()


def _mode(mode: Any, name: str) -> bool:
    method = getattr(mode, name, None)
    return bool(method()) if callable(method) else False


def _request_ids(batch: Any) -> list[str] | None:
    if batch is None:
        return None
    rids = getattr(batch, "rids", None)
    if rids is None:
        rids = getattr(batch, _RIDS, None)
    return None if rids is None else [str(r) for r in rids]


def _ints(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return [int(v) for v in values]


def _requests(batch: Any, keys: list[str], tracer: EngineTracer, rows: int) -> list[Request] | None:
    """Each request's rows, in the order of the batch's rids; None when the batch does not
    say how its rows split."""
    mode = batch.forward_mode
    news, prefixes = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
    if news is not None and prefixes is not None and len(news) == len(keys):
        out, start = [], 0
        for key, new, prefix in zip(keys, _ints(news), _ints(prefixes), strict=True):
            out.append(Request(key, start, new, prefix))
            start += new
        if _mode(mode, "is_mixed"):
            # ScheduleBatch.mix_with_running appends the running (decoding) requests after
            # the prefill ones, one row each: the tail of known one-row requests.
            for req in reversed(out):
                if req.rows != 1 or req.key not in tracer.open:
                    break
                req.prefill = False
        return out
    if _mode(mode, "is_decode"):
        totals = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        return [
            Request(key, i, 1, total - 1, prefill=False)
            for i, (key, total) in enumerate(zip(keys, _ints(totals), strict=True))
        ]
    if keys and rows % len(keys) == 0:  # speculative verify: draft_token_num rows each
        each = rows // len(keys)
        return [Request(key, i * each, each, 0, prefill=False) for i, key in enumerate(keys)]
    return None


def _count_open(tracer: EngineTracer, keys: list[str], name: str, rows: int) -> None:
    """Counts rows of a call that is no engine step of the traced model (a NextN draft, a
    two-batch-overlap half) in the runs of its requests, without advancing their steps."""
    for i, key in enumerate(keys):
        tracer.count(key, name, rows // len(keys) + (1 if i < rows % len(keys) else 0))


def _step(tracer: EngineTracer, batch: Any, requests: list[Request]) -> None:
    """Closes the runs of requests the engine no longer runs: a DECODE or MIXED step holds
    the whole running batch, so a request seen decoding before and absent from it finished
    (or was retracted; it then comes back as a new segment of its run)."""
    steps = _STEPS.setdefault(tracer, _Steps())
    if batch is steps.batch:
        return
    steps.batch = batch
    mode = batch.forward_mode
    if not (_mode(mode, "is_decode") or _mode(mode, "is_mixed")):
        return
    present = {req.key for req in requests}
    tracer.finish(sorted(steps.decoding - present))
    steps.decoding = {req.key for req in requests if not req.prefill}


def _capture(
    sess: Session,
    module: ModuleType,
    layout: Layout,
    forward_cuda: Any,
    args: tuple,
    kwargs: dict,
    out: torch.Tensor | None,
) -> None:
    indexer = args[0]
    stash = indexer.__dict__.pop(_STASH, None)
    litetopk = bool(indexer.__dict__.pop(_LITETOPK, False))
    bound = engine.bind(forward_cuda, args, kwargs)
    batch, layer = bound["forward_batch"], int(bound["layer_id"])
    x, q_lora, positions = bound["x"], bound["q_lora"], bound["positions"]
    rows = int(q_lora.shape[0])
    if session.capturing():
        sess.count("captures_skipped_cuda_graph")
        return
    if _mode(batch.forward_mode, "is_idle") or rows == 0:
        return
    keys = _request_ids(batch)
    if not keys:
        sess.count("indexer_rows_without_request_ids", rows)
        sess.warn_once(
            "sglang:no_rids",
            f"sglang {_version()}: an indexer call in a batch without request ids (warm-up or graph "
            "capture) was not recorded (counted as indexer_rows_without_request_ids)",
        )
        return
    origin: _Origin | None = indexer.__dict__.get(_ORIGIN)
    config = origin.config if origin is not None else None
    tracer = engine.tracer_for(sess, NAME, NAME, int(indexer.index_topk), config)
    if origin is not None and origin.draft:
        _count_open(tracer, keys, "nextn_draft_rows_not_recorded", rows)
        return
    if getattr(batch, "tbo_parent_token_range", None) is not None:
        _count_open(tracer, keys, "tbo_split_rows_not_recorded", rows)
        return
    requests = _requests(batch, keys, tracer, rows)
    if requests is None or sum(r.rows for r in requests) > rows:
        sess.count("indexer_rows_unattributed", rows)
        sess.warn_once(
            "sglang:unattributed",
            f"sglang {_version()}: a {batch.forward_mode} batch whose rows do not split into its "
            "requests was not recorded (counted as indexer_rows_unattributed)",
        )
        return
    rows = sum(r.rows for r in requests)
    _step(tracer, batch, requests)
    k = int(indexer.index_topk)
    reason = _unrecordable(sess, module, indexer, batch, layer, out, litetopk)
    if reason is not None:
        for req in requests:
            req.skipped[reason] = req.rows
        empty = torch.empty(0, k, dtype=torch.int32, device=q_lora.device)
        tracer.record(IndexerCall(batch, layer, k, empty if out is None else out, requests))
        return
    assert out is not None
    raw = fp8 = None
    # Shadows score a request's rows against keys of this call only: a prompt from its
    # start (decode rows and later chunks have their keys in the engine's FP8 cache).
    fresh = [r for r in requests if r.prefix == 0]
    if sess.settings.precision is not None and fresh:
        raw, why = _raw_inputs(sess, indexer, origin, x, q_lora, positions, rows)
        for req in fresh if why is not None else []:
            req.counts[why] = req.rows
        fp8, why = _fp8_operands(indexer, stash, rows)
        # A prompt no longer than index_topk selects every key (the engine's K-only path
        # exposes no operands, and needs none).
        long = [r for r in fresh if r.rows > k]
        if why is not None and long:
            for req in long:
                req.counts[why] = req.counts.get(why, 0) + req.rows
            sess.warn_once(
                f"sglang:{why}",
                f"sglang {_version()}: the indexer took a path that exposes no FP8 operands; the dequant "
                f"shadow is skipped (counted as {why})",
            )
    settings = run_settings(layout, NAME, _version())
    conventions = [
        _convention(indexer, origin),
        engine.hadamard_convention(*_hadamard(indexer, stash), config),
        engine.head_weight_scale_convention(
            engine.folded_scale(indexer, "softmax_scale", "n_heads"),
            f"sglang {_version()} Indexer.softmax_scale x n_heads^-0.5 (_get_logits_head_gate)",
            config,
        ),
        engine.weights_proj_convention(
            None, f"not read: sglang {_version()} picks the weights_proj GEMM's dtypes by path"
        ),
    ]
    call = IndexerCall(batch, layer, k, out[:rows], requests, raw=raw, fp8=fp8, settings=settings)
    call.conventions = conventions
    tracer.record(call)


def _unrecordable(
    sess: Session, module: ModuleType, indexer: Any, batch: Any, layer: int, out: torch.Tensor | None,
    litetopk: bool = False,
) -> str | None:  # fmt: skip
    """Why none of the call's rows can be recorded, or None."""
    mode = batch.forward_mode
    if out is None:
        return "indexer_rows_without_topk"
    if litetopk:
        sess.warn_once(
            "sglang:litetopk",
            f"sglang {_version()}: the indexer's top-k ran through LiteTopK (SGLANG_ENABLE_DSA_LITETOPK), "
            "whose indices are positions in the batch's gathered keys, not each request's own: its rows "
            "are not recorded (counted as topk_litetopk_not_recorded): set SGLANG_ENABLE_DSA_LITETOPK=0 "
            "to record them",
        )
        return "topk_litetopk_not_recorded"
    if _mode(mode, "is_target_verify") or _mode(mode, "is_draft_extend") or _mode(mode, "is_draft_extend_v2"):
        return "speculative_rows_not_recorded"
    if (
        getattr(batch, "attn_cp_metadata", None) is not None
        or getattr(batch, "nsa_cp_metadata", None) is not None
    ):
        return "context_parallel_rows_not_recorded"
    fused, variable = _fused_topk(sess, module, indexer, batch, layer)
    if fused:
        sess.warn_once(
            "sglang:fused_topk",
            f"sglang {_version()}: the indexer returns KV-pool slots, not positions (fused top-k); its "
            f"rows are not recorded (counted as topk_fused_not_recorded): set {variable}=0 to record them",
        )
        return "topk_fused_not_recorded"
    return None


def _fused_topk(sess: Session, module: ModuleType, indexer: Any, batch: Any, layer: int) -> tuple[bool, str]:
    """Whether this call's top-k went through the fused transform (KV-pool slots), as the
    engine decides it: its own `envs` (the version's variable name, alias and parsing), then
    the backend's per-call `force_unfused_topk` (0.5.15+)."""
    environ = sys.modules.get("sglang.srt.environ")
    envs = getattr(environ, "envs", None)
    for name in FUSE_TOPK:
        variable = getattr(envs, name, None)
        if variable is not None:
            break
    else:  # no definition found: the engine's default in every release is fused
        return True, FUSE_TOPK[0]
    if not variable.get():
        return False, name
    backend = getattr(batch, "attn_backend", None)
    if backend is None:
        getter = getattr(module, "get_attn_backend", None)
        backend = getter() if callable(getter) else None
    if backend is None:
        return True, name
    metadata = sess.guarded("sglang:indexer_metadata", None, backend.get_indexer_metadata, layer, batch)
    return not bool(getattr(metadata, "force_unfused_topk", False)), name


def _model_rope(sess: Session, origin: _Origin | None) -> IndexerRope | None:
    if origin is None or origin.config is None:
        why = "the indexer was not built inside DeepseekV2ForCausalLM after the hooks were installed"
    else:
        if origin.rope is None and origin.rope_error is None:
            try:
                origin.rope = rope.indexer_rope(origin.config)
            except (rope.UnknownModel, KeyError, TypeError, ValueError) as e:
                origin.rope_error = f"{type(e).__name__}: {e}"
        if origin.rope is not None:
            return origin.rope
        why = f"its config does not define the indexer RoPE ({origin.rope_error})"
    sess.warn_once(
        "sglang:no_model_config",
        f"sglang {_version()}: the model's HF config is not known to the hooks ({why}); the raw shadow "
        "is skipped (counted as shadow_skipped_no_model_config)",
    )
    return None


def _raw_inputs(
    sess: Session,
    indexer: Any,
    origin: _Origin | None,
    x: Any,
    q_lora: torch.Tensor,
    positions: torch.Tensor,
    rows: int,
) -> tuple[RawInputs | None, str | None]:
    """The raw shadow's inputs, or why there are none (the name it is counted under)."""
    if isinstance(x, tuple):  # ROCm hands (x_fp8, x_scale[, x_bf16]); only bf16 is usable
        if len(x) < 3:
            return None, "shadow_skipped_fp8_hidden_states"
        x = x[2]
    model_rope = _model_rope(sess, origin)
    if model_rope is None:
        return None, "shadow_skipped_no_model_config"
    inputs = RawInputs(
        x=x[:rows].detach(),
        qr=q_lora[:rows].detach(),
        positions=positions[:rows],
        weights=functools.cache(functools.partial(_weights, indexer)),
        rope=model_rope,
    )
    return inputs, None


def _weights(indexer: Any) -> IndexerWeights:
    """The indexer's weights in fp32 (FP8 blocks dequantized); the fused GLM-5 layer holds wk
    and weights_proj stacked in one bf16 matrix."""
    heads, dim = int(indexer.n_heads), int(indexer.head_dim)
    stacked = getattr(indexer, "wk_weights_proj", None)
    if stacked is not None:
        both = numerics.dense_weight(stacked)
        wk, weights_proj = both[:dim], both[dim:]
    else:
        wk, weights_proj = numerics.dense_weight(indexer.wk), numerics.dense_weight(indexer.weights_proj)
    return engine.weights_of(
        heads, dim, numerics.dense_weight(indexer.wq_b), wk, weights_proj, indexer.k_norm
    )


def _fp8_operands(indexer: Any, stash: dict | None, rows: int) -> tuple[Fp8Operands | None, str | None]:
    """The engine's own q, k (quantized as its act_quant does) and head gates, or why there
    are none (the name it is counted under)."""
    if stash is not None and "weights" in stash:
        fmt = "ue8m0" if getattr(indexer, "scale_fmt", None) is not None else "fp32"
        q8, _ = numerics.quantize_rows(stash["query"][:rows], scale_format=fmt, amax_clamp=1e-4)
        k8, k_scale = numerics.quantize_rows(stash["key"][:rows], scale_format=fmt, amax_clamp=1e-4)
        weights = stash["weights"][:rows].reshape(rows, -1)
        return Fp8Operands(q8=q8, weights=weights, k8=k8, k_scale=k_scale.reshape(-1)), None
    if (stash is not None and stash.get("fused")) or getattr(indexer, "use_dsa_indexer_fusion", False):
        return None, "dequant_unavailable_fused_indexer"
    return None, "dequant_unavailable"


def _hadamard(indexer: Any, stash: dict | None) -> tuple[bool, str]:
    """Whether this call rotated q and k before FP8 quantization, and where that was read:
    the fused writer never does; 0.5.20+ `_maybe_rotate` skips it whenever fusion (or the
    aiter fused writer) is on, fallbacks included; before, `_get_q_k_bf16` always did."""
    where = f"sglang {_version()} Indexer"
    if stash is not None and stash.get("fused"):
        return False, f"{where}._fused_q_prepare_and_store: the fused FP8 writer does not rotate"
    if hasattr(type(indexer), "_maybe_rotate"):
        fusion = bool(getattr(indexer, "use_dsa_indexer_fusion", False))
        aiter = bool(getattr(indexer, "use_aiter_fused_fp8_writer", False))
        return not (fusion or aiter), (
            f"{where}._maybe_rotate: use_dsa_indexer_fusion={fusion}, use_aiter_fused_fp8_writer={aiter}"
        )
    return True, f"{where}._get_q_k_bf16: rotate_activation on q and k"


def _convention(indexer: Any, origin: _Origin | None) -> dict:
    """The indexer RoPE convention, the engine's beside the model's."""
    neox = getattr(getattr(indexer, "rotary_emb", None), "is_neox_style", None)
    return engine.rope_convention(
        None if neox is None else bool(neox), origin.rope if origin is not None else None,
        f"sglang {_version()} Indexer.rotary_emb.is_neox_style", "model config not reached",
    )  # fmt: skip
