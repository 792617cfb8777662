"""What the serving-engine adapters (TensorRT-LLM, SGLang, vLLM) share: one run per engine
request, steps from the engine's own batches, and the indexer capture with its two shadows.

An adapter turns one indexer call into an `IndexerCall`:

- `marker`: an object the engine makes anew for every engine step (a batch, its metadata
  or its forward context). Calls with the same marker belong to one step; the tracer keeps
  a reference to it, so its identity cannot be reused;
- `requests`: the engine's own request ids and where each request's rows lie in the call;
- `prod_topk`: production's selection, request-local positions, -1 padded;
- `raw`: the pre-quantization inputs (hidden states, q LoRA, positions) and the indexer's
  weights, from which `raw_qkw` recomputes q, k and w in fp32 with the model's RoPE;
- `fp8`: the engine's own FP8 operands, scored in fp32 for the `dequant` shadow (the fp32
  recompute of what the production kernel multiplied; an engine that reduces and ranks its
  logits in bf16, vLLM 0.34 for DeepSeek-V3.2 on SM100, rounds them, which its
  `indexer_logits_dtype` convention says). These scores are also production's own: they give
  its k-th score, margin and boundary (so churn is known) and the capture self-check, which
  holds the recorded selection to their top-k (`session.Run.topk`'s `check`).

Production rows are recorded whatever happens to the shadows: each shadow runs in a guard
of its own. Rows of a request whose earlier keys are not in this call (decode steps, later
prefill chunks, cached prefixes) are recorded for production only and counted: their keys
live in the engine's FP8 cache, which the hooks do not read.

A request first seen in its prompt is tagged `cache=miss` when its first rows start at
position 0 and `cache=hit` when they start later (its earlier tokens came from the engine's
prefix cache; `settings.cached_prefix_tokens`).

A run stays open while its request is live: engines leave running requests out of many
steps (prefill-only steps, chunked prefill), so absence from one step proves nothing. A run
closes when the adapter learns that its request finished, when it has been absent for
`IDLE_STEPS` engine steps, when more than `MAX_OPEN_RUNS` are open (the least recently seen
first), or at exit. A request seen again after its run closed continues in a new run (its
run id carries `-s<N>`, the `request` tag stays), counted as `request_resumed`.
"""

import functools
import importlib
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shadowtrace_hooks import numerics, rope, selection, session, shadow
from shadowtrace_hooks.rope import IndexerRope
from shadowtrace_hooks.session import Run, Session

log = logging.getLogger("shadowtrace")

# Why each serving engine's adapter runs production ungrafted under SHADOWTRACE_GRAFT (issue 30).
# These adapters shadow the indexer alone: attn_out, mlp_out and layer_out have no shadow value
# to graft. An indexer graft must hand the shadow's selection to attention before it reads it.
_INDEXER_ONLY = (
    "the engine adapters shadow the indexer alone (no attn_out, mlp_out or layer_out value to graft)"
)
GRAFT_REFUSED = {
    "vllm": f"{_INDEXER_ONLY}; vLLM selects and attends inside one hooked call "
    "(`_sparse_indexer_and_attn`), recorded after it returns, so the hook point cannot hand "
    "attention the shadow's selection",
    "sglang": f"{_INDEXER_ONLY}; `Indexer.forward_cuda` returns the selection attention reads, so "
    "the hook point allows an indexer graft, but the adapter scores its shadow after that call "
    "returns: not implemented",
    "tensorrt_llm": f"{_INDEXER_ONLY}; `Indexer.forward_from_projected` returns the selection "
    "attention reads, so the hook point allows an indexer graft, but the adapter scores its "
    "shadow after that call returns: not implemented",
}

# Engine steps a request may be absent before its run is closed.
IDLE_STEPS = 256
# An engine step whose indexer ran no Python (a CUDA-graph replay), counted per request.
UNSEEN = "indexer_steps_unseen"
# Runs open at once, each with its writer thread; beyond this the least recently seen closes.
MAX_OPEN_RUNS = 256


def bind(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@dataclass
class Request:
    """One request's rows in an indexer call."""

    key: str  # the engine's request id
    start: int  # first row of the call
    rows: int  # rows (query tokens) of this request in the call
    prefix: int  # tokens of the request before these rows (cached or earlier chunks)
    prefill: bool = True  # prompt tokens (a prefill or one of its chunks), not generated ones
    # rows of this request the call could not record, by reason (fused top-k, a stale
    # buffer): counted in its run, and none of its rows are recorded
    skipped: dict[str, int] = field(default_factory=dict)
    # anything else to count in its run (a shadow the call could not compute for its rows);
    # its rows are recorded
    counts: dict[str, int] = field(default_factory=dict)
    # the call row of the request's first token in this step, where these rows are only part
    # of them (vLLM 0.34's ShardQ: another tensor-parallel rank scored the rest); None: start
    first_row: int | None = None

    @property
    def call_prefix(self) -> int:
        """Tokens of the request before its first row in this call (its rows here or not)."""
        return self.prefix if self.first_row is None else self.prefix - (self.start - self.first_row)

    def key_rows(self) -> slice | None:
        """The call rows holding this request's keys, from its position 0 to its last row
        here; None when earlier keys are not in the call (a later chunk, a cached prefix)."""
        if self.call_prefix != 0:
            return None
        return slice(self.start if self.first_row is None else self.first_row, self.start + self.rows)


@dataclass
class IndexerWeights:
    """An indexer's weights in fp32, as its model defines them (FP8 weights dequantized)."""

    heads: int
    dim: int
    wq_b: torch.Tensor  # [heads * dim, q_lora]
    wk: torch.Tensor  # [dim, hidden]
    weights_proj: torch.Tensor  # [heads, hidden]
    norm: str  # "layer" (LayerNorm with bias) or "rms"
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None
    eps: float


@dataclass
class RawInputs:
    """The call's pre-quantization indexer inputs, row for row with `prod_topk`."""

    x: torch.Tensor  # [rows, hidden]: the layer's normalized hidden states
    qr: torch.Tensor  # [rows, q_lora]: the normalized q LoRA
    positions: torch.Tensor  # [rows]: absolute positions
    weights: Callable[[], IndexerWeights]  # built only when a shadow needs them
    rope: IndexerRope


@dataclass
class Fp8Operands:
    """The engine's FP8 indexer operands. q rows follow `prod_topk`; key rows of the call's
    row r are `k8[k_offset + r]` (engines that score a phase of a mixed batch keep the
    whole batch's keys)."""

    q8: torch.Tensor  # [rows, H, D] e4m3
    weights: torch.Tensor  # [rows, H] fp32, q_scale * D^-0.5 * H^-0.5 folded in
    k8: torch.Tensor  # [N, D] e4m3
    k_scale: torch.Tensor  # [N] fp32
    k_offset: int = 0


@dataclass
class IndexerCall:
    marker: Any
    layer: int
    k: int
    prod_topk: torch.Tensor  # [rows, k] int32, request-local positions, -1 padded
    requests: list[Request]
    raw: RawInputs | None = None
    fp8: Fp8Operands | None = None
    # manifest settings of every run the call touches, kept once set: the adapter's layout
    settings: dict[str, Any] = field(default_factory=dict)
    # the numerics conventions the engine ran this call with, beside the model's (`convention`)
    conventions: list[dict[str, Any]] = field(default_factory=list)
    # the capture self-check's tolerance: wider where production ranked rounded scores
    check_tolerance: float = selection.CHECK_TOLERANCE


def raw_qkw(raw: RawInputs, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T,H,D], k [T,D] after the model's RoPE and w [T,H] (with H^-0.5, without D^-0.5),
    in fp32, from the pre-quantization inputs of `rows`."""
    w8 = raw.weights()
    x, qr, pos = raw.x[rows].float(), raw.qr[rows].float(), raw.positions[rows]
    q = torch.nn.functional.linear(qr, w8.wq_b).view(-1, w8.heads, w8.dim)
    key = torch.nn.functional.linear(x, w8.wk)
    if w8.norm == "layer":
        k = torch.nn.functional.layer_norm(key, (w8.dim,), w8.norm_weight, w8.norm_bias, w8.eps)
    else:
        k = key * torch.rsqrt(key.pow(2).mean(-1, keepdim=True) + w8.eps) * w8.norm_weight
    w = torch.nn.functional.linear(x, w8.weights_proj) * w8.heads**-0.5
    return raw.rope.apply(q, pos), raw.rope.apply(k, pos), w


class _Open:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.serial = -1  # the engine step it last appeared in


class EngineTracer:
    """Runs of one engine in this process, one per request."""

    def __init__(self, sess: Session, engine: dict, model: dict, dtypes: dict) -> None:
        self.sess, self.engine, self.model, self.dtypes = sess, engine, model, dtypes
        self.name = engine["name"]
        self.open: dict[str, _Open] = {}
        self.segments: dict[str, int] = {}  # closed request -> runs it has had
        self.marker: Any = None
        self.serial = -1
        # The step the engine began last: its requests, the indexer hook calls before it, and
        # the line that says what its requests miss when it runs none (`step_began`).
        self.pending: tuple[list[str], int, str] | None = None

    # --- steps and runs ---------------------------------------------------------------

    def advance(self, marker: Any) -> None:
        """Enters the engine step `marker` belongs to (a no-op within the same step)."""
        if marker is self.marker:
            return
        self.marker, self.serial = marker, self.serial + 1
        for key in [k for k, o in self.open.items() if self.serial - o.serial > IDLE_STEPS]:
            self._close(key)

    def runs(self, requests: Iterable[Request], device: torch.device) -> list[Run]:
        """The run of each request, opened on first sight, its step advanced once per engine
        step it appears in."""
        out = []
        for req in requests:
            entry = self.open.get(req.key)
            if entry is None:
                entry = self.open[req.key] = _Open(self._open_run(req, device))
                if len(self.open) > MAX_OPEN_RUNS:
                    self._close(min(self.open, key=lambda k: self.open[k].serial))
            if entry.serial != self.serial:
                entry.serial = self.serial
                entry.run.step += 1
            if req.prefill:
                entry.run.writer.prompt_length_at_least(req.prefix + req.rows)
            out.append(entry.run)
        return out

    def count(self, key: str, name: str, n: int) -> None:
        """Counts in the open run of request `key` (its step unchanged), or in the session
        when the request has no open run."""
        entry = self.open.get(key)
        (entry.run if entry is not None else self.sess).count(name, n)

    def finish(self, keys: Iterable[str]) -> None:
        """Closes the runs of requests the engine reports finished."""
        for key in keys:
            if key in self.open:
                self._close(key)

    def step_began(self, keys: list[str], why: str) -> None:
        """The engine began a step of requests `keys`; the step before it is over (`settle`).
        `why` is the line said once if this one runs no indexer hook."""
        self.settle()
        self.pending = (keys, self.sess.hook_calls.get(self.name, 0), why)

    def settle(self) -> None:
        """The step the engine began last is over. If no indexer hook ran in it, its Python
        did not run (a CUDA-graph replay): each of its requests counts it in its run
        (`indexer_steps_unseen`, in the session when the request has none), with one line."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        keys, calls, why = pending
        if not keys or self.sess.hook_calls.get(self.name, 0) != calls:
            return
        for key in keys:
            self.count(key, UNSEEN, 1)
        self.sess.warn_once(f"{self.name}:unseen", why)

    def close(self, *, at_exit: bool = False, deadline: float | None = None) -> None:
        """Closes every open run (at exit: within the session's flush `deadline`), the last
        step settled first."""
        self.settle()
        for key in list(self.open):
            self._close(key, at_exit=at_exit, deadline=deadline)

    def _open_run(self, req: Request, device: torch.device) -> Run:
        segment = self.segments.get(req.key, 0)
        run = self.sess.open_run(
            token_ids=[],
            request=req.key,
            segment=segment,
            prompt_length=0,
            model=self.model,
            engine=self.engine,
            device=session.device_of(torch.empty(0, device=device)),
            dtypes=self.dtypes,
            grafts=GRAFT_REFUSED.get(self.name, "not implemented by this adapter"),
        )
        if segment:
            run.count("request_resumed")
        elif req.prefill:
            # First sight of a request in its prompt: rows past position 0 mean the engine
            # served its first tokens from its prefix cache (context 004). Engines hand the
            # hooks no token ids, so `analyze` cannot pair these runs by prompt: it lists
            # the hits as unpaired, saying why. Rows another rank scored are no cache hit.
            run.writer.tag("cache", "hit" if req.call_prefix else "miss")
            if req.call_prefix:
                run.writer.set_setting("cached_prefix_tokens", req.call_prefix)
        return run

    def _close(self, key: str, *, at_exit: bool = False, deadline: float | None = None) -> None:
        entry = self.open.pop(key)
        self.segments[key] = self.segments.get(key, 0) + 1
        timeout = None if deadline is None else deadline - time.monotonic()
        self.sess.close_run(entry.run, at_exit=at_exit, timeout_s=timeout)

    # --- the indexer capture ----------------------------------------------------------

    def record(self, call: IndexerCall) -> None:
        """Records one indexer call: production rows of every request, then each shadow in
        a guard of its own, so a shadow failure leaves production's rows."""
        s = self.sess.settings
        if not (s.layer(call.layer) and s.site("indexer")):
            return
        self.advance(call.marker)
        device = call.prod_topk.device
        runs = self.runs(call.requests, device)
        for req, run in zip(call.requests, runs, strict=True):
            for key, value in call.settings.items():
                run.writer.set_setting(key, value, keep=True)
            run.writer.add_conventions(call.conventions, merge_conventions)
            for name, n in {**req.counts, **req.skipped}.items():
                run.count(name, n)
            if req.skipped:
                continue
            rows = slice(req.start, req.start + req.rows)
            positions = np.arange(req.prefix, req.prefix + req.rows, dtype=np.int32)
            q_pos = torch.arange(req.prefix, req.prefix + req.rows, device=device)
            shadows: dict[str, torch.Tensor] = {}
            prod_scores, source = None, None
            keys = req.key_rows()
            if s.precision is not None and keys is not None:
                if call.raw is not None:
                    scores = self.sess.guarded(
                        f"{self.name}:shadow_raw", run, self._raw, run, call, rows, keys, q_pos
                    )
                    if scores is not None:
                        shadows["raw"] = scores
                if call.fp8 is not None:
                    scores = self.sess.guarded(
                        f"{self.name}:shadow_dequant", run, self._dequant, call, rows, keys, q_pos
                    )
                    if scores is not None:
                        shadows["dequant"] = scores
                        # Production's own FP8 operands, scored: its selection should be their
                        # top-k. They give production's k-th score, margin and boundary (so
                        # churn is known), and the capture self-check.
                        prod_scores, source = scores, DEQUANT_SOURCE
            elif s.precision is not None:
                run.count("shadow_skipped_rows_without_keys", req.rows)
            run.topk(call.layer, call.layer, call.k, positions, q_pos, call.prod_topk[rows], prod_scores,
                     shadows, check=source, check_tolerance=call.check_tolerance)  # fmt: skip
            run.ship()

    def _raw(
        self, run: Run, call: IndexerCall, rows: slice, keys: slice, q_pos: torch.Tensor
    ) -> torch.Tensor:
        """The raw shadow's scores [T, keys]: the fp32 recompute from pre-quantization
        inputs, the queries of `rows` against the keys of `keys` (the call rows from the
        request's position 0)."""
        assert call.raw is not None
        q, k, w = raw_qkw(call.raw, keys)
        first = rows.start - keys.start
        return shadow.indexer_scores(run, q[first:], k, w[first:], q_pos)

    def _dequant(self, call: IndexerCall, rows: slice, keys: slice, q_pos: torch.Tensor) -> torch.Tensor:
        """The dequant shadow's scores [T, keys]: production's own FP8 operands scored in
        fp32, the queries of `rows` against the keys of `keys`."""
        op = call.fp8
        assert op is not None
        keys = slice(op.k_offset + keys.start, op.k_offset + keys.stop)
        return numerics.folded_scores(
            op.q8[rows], op.k8[keys], op.k_scale[keys].reshape(-1), op.weights[rows], q_pos
        )


# Where a serving engine's production scores come from when the adapter has them.
DEQUANT_SOURCE = "recomputed: production's FP8 q, k and scales with its head weights, scored in fp32"


def convention(
    name: str, engine: Any, model: Any, engine_source: str, model_source: str, *, assumed: bool = False
) -> dict[str, Any]:
    """One numerics convention as the manifest records it (top-level `conventions`, the
    shape and names of `tracer/src/model/convention.rs`): the engine's value beside the
    model's, and where each was read; None where a value was not read. A mismatch is the kind
    of engine bug a shadow that copied the engine's convention could never show. `assumed`:
    the engine's value is the adapter's prior for the engine version it recognised, not read
    from the running engine (`engine_assumed`), and the analyzer does not judge it."""
    out = {
        "name": name, "engine": engine, "model": model,
        "engine_source": engine_source, "model_source": model_source,
    }  # fmt: skip
    if assumed:
        out["engine_assumed"] = True
    return out


def merge_conventions(recorded: list[dict[str, Any]], new: Iterable[dict[str, Any]]) -> None:
    """Adds the conventions of one call to a run's: one entry per name, the first kept unless
    a later call departs from the model where it did not (the departing value is the one a
    reader must see, as the reference engine records a layer-scoped deviation)."""
    by_name = {c["name"]: i for i, c in enumerate(recorded)}
    for c in new:
        at = by_name.get(c["name"])
        if at is None:
            by_name[c["name"]] = len(recorded)
            recorded.append(dict(c))
        elif departs(c) and not departs(recorded[at]):
            recorded[at] = dict(c)


def departs(c: dict[str, Any]) -> bool:
    """Both values known and different: what `shadowtrace analyze` names as a mismatch."""
    return c["engine"] is not None and c["model"] is not None and c["engine"] != c["model"]


def rope_convention(
    engine_neox: bool | None, model: IndexerRope | None, engine_source: str, missing: str
) -> dict:
    """The indexer RoPE convention: the engine's pairs (`engine_neox`, None when unknown)
    beside the model's (`model`, None when its config was not reached, for `missing`)."""
    return convention(
        "indexer_rope",
        None if engine_neox is None else ("neox" if engine_neox else "interleaved"),
        None if model is None else model.layout,
        engine_source,
        missing if model is None else model.source,
    )


# The model family's reference for the Hadamard rotation before FP8 quantization
# (tracer/src/model/convention.rs says the same for the reference engine).
_MODEL_HADAMARD = {
    "deepseek_v32": (
        True,
        "DeepSeek-V3.2 reference inference/model.py Indexer.forward: rotate_activation before act_quant",
    ),
    "glm_moe_dsa": (
        None,
        "none: no reference FP8 indexer is published for glm_moe_dsa (transformers scores "
        "without FP8, where the rotation changes nothing)",
    ),
}


def hadamard_convention(
    engine_rotates: bool | None, engine_source: str, config: Any, *, assumed: bool = False
) -> dict:
    """Whether the engine Hadamard-rotates q and k before FP8 quantization, beside what the
    model family's reference does (`config`: the model's HF config, None when not reached).
    `assumed`: the engine's value was not observed, only known of the layout (`convention`)."""
    family = rope.family(config) if config is not None else None
    model, source = _MODEL_HADAMARD.get(family, (None, "model config not reached or not a DSA family"))
    return convention("indexer_hadamard", engine_rotates, model, engine_source, source, assumed=assumed)


# The model family's reference for the dtype the indexer's logits are reduced and ranked in.
_MODEL_LOGITS = {
    "deepseek_v32": (
        "fp32",
        "DeepSeek-V3.2 reference inference/kernel.py fp8_index: logits accumulated and returned in fp32",
    ),
    "glm_moe_dsa": (None, "none: no reference FP8 indexer is published for glm_moe_dsa"),
}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# The capture self-check's tolerance where production ranks bf16 logits reduced in bf16
# (vLLM 0.34, DeepSeek-V3.2 on SM100): the sum over heads may round at every head, so a
# selected key's fp32 score can lie below the fp32 k-th score by a few bf16 ulps of the scores
# summed. Relative to the row's score scale (the mean |score| of the keys selected, as every
# tolerance of the check), 2^-4 is sixteen bf16 unit roundoffs (2^-8) of it. Calibrated on an
# emulation that rounds at every one of 64 heads (DeepSeek-V3.2's index_n_heads), more
# pessimistic than one rounding: its largest shortfall is 3.6e-2 of the mean (8.4e-3 of the
# row's largest score, the scale before issue 42, under which 2^-5 of the largest excused
# shortfalls four times this), and 1e-3 flags a quarter of the rows and more
# (hooks/tests/test_capture_check.py).
BF16_LOGITS_CHECK_TOLERANCE = 2.0**-4


def logits_dtype_convention(dtype: torch.dtype | None, engine_source: str, config: Any) -> dict:
    """The dtype the engine reduces and ranks the indexer's logits in, beside the model
    family's reference: bf16 logits tie and swap keys near the k-th score that fp32 keeps
    apart."""
    family = rope.family(config) if config is not None else None
    model, source = _MODEL_LOGITS.get(family, (None, "model config not reached or not a DSA family"))
    engine_value = None if dtype is None else _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return convention("indexer_logits_dtype", engine_value, model, engine_source, source)


def topk_backend_convention(backend: str | None, engine_source: str) -> dict:
    """The engine's top-k implementation for the indexer (its selection among tied scores,
    and approximate backends, differ): the model defines none, so it is recorded, never
    judged."""
    return convention(
        "indexer_topk_backend",
        backend,
        None,
        engine_source,
        "none: the model defines no top-k implementation",
    )


def folded_scale(indexer: Any, scale: str, heads: str | None = None) -> float | None:
    """The head-weight scale an engine's `indexer` module holds: attribute `scale`, times
    attribute `heads` ** -0.5 where the engine multiplies the two at the call (None when
    either is missing or not a number)."""
    value = getattr(indexer, scale, None)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if heads is None:
        return float(value)
    count = getattr(indexer, heads, None)
    return float(value) * count**-0.5 if isinstance(count, int) and count > 0 else None


def head_weight_scale_convention(engine_scale: float | None, engine_source: str, config: Any) -> dict:
    """The scale the engine folds into the indexer's head weights (softmax_scale x
    heads^-0.5, `folded_scale`), beside the model's index_head_dim^-0.5 x
    index_n_heads^-0.5 from `config`. A wrong head count (a rank's instead of the model's)
    or head size scales every score: top-k keeps its order, but the scores' range, and every
    finite-precision step after them, change."""
    dim, n_heads = getattr(config, "index_head_dim", None), getattr(config, "index_n_heads", None)
    model = dim**-0.5 * n_heads**-0.5 if isinstance(dim, int) and isinstance(n_heads, int) else None
    return convention(
        "indexer_head_weight_scale", engine_scale, model,
        engine_source if engine_scale is not None else f"not read: {engine_source}",
        "transformers GlmMoeDsaIndexer / DeepseekV32Indexer: softmax_scale = index_head_dim^-0.5, "
        "weights * index_n_heads^-0.5 (config.json)",
    )  # fmt: skip


def weights_proj_convention(dtype: torch.dtype | None, engine_source: str) -> dict:
    """The dtype the engine computes `weights_proj(x)` in (None when not read), beside the
    model's fp32 (`_keep_in_fp32_modules`): bf16 head weights flip top-k near the k-th score."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return convention(
        "indexer_weights_proj_dtype",
        None if dtype is None else names.get(dtype, str(dtype).removeprefix("torch.")),
        "fp32",
        engine_source,
        "transformers _keep_in_fp32_modules weights_proj; DeepSeek-V3.2 reference fp32 "
        "weights_proj on x.float()",
    )


def reached(sess: Session, engine: str) -> None:
    """Notes that an indexer hook of `engine` was entered (whatever it then recorded)."""
    sess.hook_calls[engine] = sess.hook_calls.get(engine, 0) + 1


def watch_untraced(module: Any, classes: tuple[str, ...], key: str, why: str) -> None:
    """Wraps `__init__` of each model class `module` holds among `classes`, an engine path no
    adapter hooks (a model whose indexer runs code of its own): building one counts it
    (`models_refused`) and says once, under `key`, that it is not traced and `why`. On
    construction, not import: an engine's registry inspects modules it never builds."""
    for name in classes:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and not getattr(cls.__init__, "_shadowtrace_untraced", False):
            cls.__init__ = _said_untraced(cls.__init__, f"{module.__name__}.{name} is not traced: {why}", key)


def _said_untraced(init: Callable, line: str, key: str) -> Callable:
    @functools.wraps(init)
    def watched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            sess.count("models_refused")
            sess.warn_once(key, line)

    watched._shadowtrace_untraced = True  # type: ignore[attr-defined]
    return watched


def watch_forward(cls: type, method: str, engine: str, real: Callable[[], bool]) -> None:
    """Wraps `cls.method`, the model's forward, so that after the process's first real
    forward (`real()` is true: not a profiling or warm-up run) one line says so if no
    indexer hook of `engine` was entered: the layout runs code the adapter does not reach,
    and without the line it would trace nothing without a word."""
    forward = getattr(cls, method)
    if getattr(forward, "_shadowtrace_watch", False):
        return
    checked: list[bool] = []

    @functools.wraps(forward)
    def watched(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        sess = session.current()
        if sess is not None and not checked:
            sess.guarded(f"{engine}:watch", None, _check_first_forward, sess, cls, engine, real, checked)
        return out

    watched._shadowtrace_watch = True  # type: ignore[attr-defined]
    setattr(cls, method, watched)


def _check_first_forward(
    sess: Session, cls: type, engine: str, real: Callable[[], bool], checked: list[bool]
) -> None:
    if session.capturing() or not real():
        return
    checked.append(True)
    if not sess.hook_calls.get(engine):
        sess.count("indexer_hooks_never_fired")
        version = getattr(importlib.import_module(engine), "__version__", "unknown")
        sess.warn_once(
            f"{engine}:never_fired",
            f"{engine} {version}: {cls.__name__} ran a forward and no indexer hook fired; this "
            "layout is not traced (python -m shadowtrace_hooks doctor says what was hooked)",
        )


def engine_model(sess: Session, index_topk: int, config: Any = None) -> dict:
    """What an engine hook knows of the model: its HF config when the adapter reached it,
    else the user's `model` tag."""
    name = sess.settings.tags.get("model")
    if config is not None:
        name = name or getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
        return {
            "name": name or "unnamed DSA model",
            "architecture": rope.family(config) or getattr(config, "model_type", None) or "dsa",
            "config_hash": "",
            "revision": None,
            "num_layers": int(getattr(config, "num_hidden_layers", 0) or 0),
            "index_topk": index_topk,
        }
    return {
        "name": name or "unnamed DSA model",
        "architecture": sess.settings.tags.get("architecture", "dsa"),
        "config_hash": "",
        "revision": None,
        "num_layers": 0,
        "index_topk": index_topk,
    }


def tracer_for(sess: Session, engine: str, variant: str, index_topk: int, config: Any = None) -> EngineTracer:
    """The session's tracer of `engine` (its package name, the engine's name in the
    manifest; `variant` names its FP8 indexer), made on first use."""
    tracer = sess.tracers.get(engine)
    if tracer is None:
        version = getattr(importlib.import_module(engine), "__version__", "unknown")
        tracer = EngineTracer(
            sess,
            engine={"name": engine, "version": version, "commit": None, "variant": variant},
            model=engine_model(sess, index_topk, config),
            dtypes={"prod": "fp8_e4m3", "shadow": sess.settings.precision},
        )
        sess.tracers[engine] = tracer
    return tracer


def weights_of(
    heads: int, dim: int, wq_b: torch.Tensor, wk: torch.Tensor, weights_proj: torch.Tensor, norm: Any
) -> IndexerWeights:
    """IndexerWeights from fp32 projection weights and an engine's norm module: a LayerNorm
    (weight and bias, `eps` or `variance_epsilon`) or an RMSNorm (weight alone)."""
    eps = getattr(norm, "eps", None)
    if eps is None:
        eps = norm.variance_epsilon
    layer = "RMS" not in type(norm).__name__
    # SGLang's LayerNorm always holds a bias parameter and says with `use_bias` whether it applies.
    bias = getattr(norm, "bias", None) if layer and getattr(norm, "use_bias", True) else None
    return IndexerWeights(
        heads=heads, dim=dim, wq_b=wq_b, wk=wk, weights_proj=weights_proj,
        norm="layer" if layer else "rms", norm_weight=norm.weight.float(),
        norm_bias=None if bias is None else bias.float(), eps=float(eps),
    )  # fmt: skip
