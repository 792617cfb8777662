"""vLLM: the DSA indexer of GLM-5 (`GlmMoeDsaForCausalLM`) and DeepSeek-V3.2
(`DeepseekV32ForCausalLM`), on both of the routes vLLM's model registry gives them.

Supported: vLLM 0.24.0 through 0.34.0 (`LAYOUTS`, checked at install, and against the wheels
of 0.24.0, 0.28.0, 0.29.0, 0.33.0 and 0.34.0 by tests/python/test_conformance_vllm.py; 0.34
removed the v1 runner, v1/worker/gpu_model_runner.py, whose layout then hooks nothing). The 0.28
deepseek_v32 package (reached only through `model_class_overrides`; its
`_sparse_indexer_and_attn` has no `positions`) is refused.

Indexer, `deepseek_v32` layout (vllm/models/deepseek_v32/attention.py, 0.29.0 to 0.34.0):
the CUDA route of both architectures from 0.29 (`vllm.models.deepseek_v32` ->
`nvidia.model.DeepseekV32ForCausalLM`). `DeepseekV32Attention.forward(positions,
hidden_states)` computes the indexer's q and k with fused kernels (K is LayerNormed, roped
and quantized in registers straight into the FP8 cache, never materialized), then
`_sparse_indexer_and_attn(positions, q_c, ..., index_q_fp8, index_k, index_weights_out, ...)`
calls the function `sparse_attn_indexer`, imported into the module by name.

- `forward` is wrapped to keep a reference to `hidden_states` (the layer's normalized input)
  for the duration of the call;
- `_sparse_indexer_and_attn` is wrapped to record after the original returns. It is
  decorated `@eager_break_during_capture`: the wrapper is decorated again around the
  original's `__wrapped__`, so that a breakable CUDA-graph replay calls the wrapper (a plain
  wrapper would run once at capture and never on replay);
- `raw` shadow: q from `q_c` and the indexer's `wq_b` (FP8 blocks dequantized), k and w
  recomputed in fp32 from `hidden_states` with `wk_weights_proj`'s rows and `k_norm`, RoPE
  from the model's HF config (`self._vllm_config.model_config.hf_config`);
- `dequant` shadow: the engine's own `index_q_fp8` and `index_weights_out` (q_scale, D^-0.5
  and H^-0.5 folded in), against K recomputed as the cache writer `fused_norm_rope` holds it
  in fp32 (the bf16 `wk_weights_proj` GEMM, LayerNorm, the engine's RoPE convention and
  cos/sin table) and quantized as it quantizes it (1x128, ue8m0, amax clamp 1e-4). The FP8
  cache itself is not read. (0.33 on SM100 casts the weights to bf16 inside the op: the
  shadow scores the fp32 ones.)
- ShardQ (0.34, on by default: tensor parallelism, a prefill step of >= 1024 tokens after
  its decodes, the FlashInfer sparse backend or FlashMLA sparse with an FP8 DS-MLA cache
  and < 32 heads per rank): each rank scores only its zigzag share of the prefill tokens
  (per request, 2 W chunks; rank r takes chunks r and 2W - 1 - r) and writes their rows
  packed after the decode rows, and no rank gathers the others'. The adapter reads
  `shardq_gather_indices` from the indexer's prefill metadata during the call, puts each
  row back on its token, and records on each rank the rows it scored: a prefill request
  becomes at most two pieces of rows in its run, their shadows scored against the
  request's keys from position 0 (every rank holds every token's q, k and weights). The
  rows another rank scored are counted in the run (`topk_rows_on_other_ranks`): that
  rank's run of the request records them. Read in global order, as before 0.34, the rows
  would land on other tokens and requests; the capture self-check names that reading.

Indexer, `deepseek_v2` layout (vllm/model_executor/models/deepseek_v2.py and
layers/sparse_attn_indexer.py, 0.24.0 to 0.34.0): every platform up to 0.28, then CPU, XPU
and (0.29) ROCm; its Python runs per step only with `--enforce-eager` (with torch.compile
the wrappers step aside and the model forward's watch says that no hook fired).

- `Indexer.forward(hidden_states, qr, positions, rotary_emb)` returns the shared top-k
  buffer; wrapped to record after it returns;
- `SparseAttnIndexer.forward_cuda(hidden_states, q_quant, k, weights)`: the FP8 query, the
  bf16 key after LayerNorm and RoPE, fp32 weights with q_scale * D^-0.5 * H^-0.5 folded in;
  wrapped (a class patch, before CustomOp binds `_forward_method` at construction) to hand
  them to the `Indexer.forward` wrapper. DeepSeek-V4 calls the same op with k=None and
  maybe an FP4 (values, scales) tuple: it is not a DSA-V3.2 indexer and is left alone;
- `raw` shadow from `hidden_states`, `qr` and the weights, RoPE from `Indexer.config`;
  `dequant` shadow: `q_quant` and `weights` with k quantized as `indexer_k_quant_and_cache`
  does (ue8m0, amax clamp 1e-4).

Requests and steps (vllm/v1/worker): vLLM's indexer sees no request ids, so the model
runner publishes each engine step's request ids in row order, with row starts and prompt
lengths: `gpu_model_runner.GPUModelRunner._model_forward` (the default runner of these
models to 0.28; entered inside the step's forward context, after the batch is reordered)
and `gpu.model_runner.GPUModelRunner.prepare_inputs` (the default from 0.29; its returned
InputBatch). `execute_model` of both closes the runs of `scheduler_output.finished_req_ids`
(and of preempted requests, which restart from their first token) and ends the step. A
request's rows are [query_start_loc[i], query_start_loc[i+1]) of the call, decode rows
first; its prefix is the position of its first row (not the runner's count, which async
scheduling with drafts makes optimistic). The published step is the marker.

Not recorded, and counted as:
- calls outside an engine step (profile, warm-up, CUDA-graph capture, drafter/MTP runs),
  or with a runner layout that is not hooked (0.34's `StandaloneCPUModelRunner` on CPUs,
  named in the line): `indexer_calls_outside_engine_steps` (and one line);
- calls during CUDA-graph or torch.compile capture: `captures_skipped_cuda_graph`;
- calls of a shared indexer layer (GLM-5.2's `indexer_types`, honoured from 0.34: the layer
  reuses an earlier layer's selection and has no indexer of its own), per process:
  `indexer_calls_shared_layer` (no loss: the selection is the earlier layer's);
- micro-batched (DBO) calls, calls without indexer metadata, and calls whose metadata
  disagrees with the published step: `indexer_calls_microbatched`,
  `indexer_calls_without_metadata`, `indexer_calls_batch_mismatch`; steps under prefill
  context parallelism or adaptive draft verification: `engine_steps_not_traced`;
- rows of a short-prefill batch that vLLM serves with dense MHA (the indexer returns
  without writing: a stale buffer on `deepseek_v2`, all -1 on `deepseek_v32`), per run:
  `indexer_rows_dense_mha_prefill`;
- shadows, per run and row: rows whose keys are not in the call (decode, later prefill
  chunks, cached prefixes) `shadow_skipped_rows_without_keys` (production is recorded);
  no reachable HF config `shadow_skipped_no_model_config`; a RoPE the model config does not
  settle `shadow_skipped_unknown_rope`; an FP8 `wq_b` whose scales are not plain fp32
  blocks (DeepGEMM's packed ue8m0 layout) `shadow_skipped_wq_b_scale_layout`; no FP8
  operands reached (`deepseek_v2` on ROCm or 0.33's CPU, whose op does not go through
  `forward_cuda`) `shadow_skipped_no_fp8_operands`; a breakable CUDA-graph
  replay, where the layer input is not reachable (record prod only; run with
  --enforce-eager for shadows) `shadow_skipped_cudagraph_replay`;
- engine steps in which no indexer hook ran, though the runner published them
  (`EngineTracer.settle`): steps replayed as FULL CUDA graphs (uniform decode batches under
  the default FULL_AND_PIECEWISE mode run no Python), counted in each request's run as
  `indexer_steps_unseen` (with one line; run with --enforce-eager to record them);
- never seen, so not counted: the 0.33 ROCm `amd` model (a forward of its own calling
  `forward_hip`; the model forward's watch says that no hook fired).

Every tensor-parallel rank records its own runs: to 0.33 the indexer is replicated (0.33
scores rows per rank and gathers them back), and each rank's runs hold every row; under
0.34's ShardQ each holds the rows that rank scored (above).

The engine's indexer RoPE convention (`_index_rope_interleave`, or `rotary_emb.is_neox_style`
on `deepseek_v2`) is written beside the model's in each run's manifest `conventions`, with
its Hadamard choice (none) and the dtype of the `weights_proj` GEMM. Engine RoPE modules are
never called: `forward_native` would replace a shared bf16 cos/sin table with an fp32 copy.
"""

import functools
import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shadowtrace_hooks import numerics, rope, session
from shadowtrace_hooks.adapters import engine
from shadowtrace_hooks.adapters.engine import Fp8Operands, IndexerCall, RawInputs, Request
from shadowtrace_hooks.adapters.layout import Layout, Symbol, run_settings, select
from shadowtrace_hooks.session import Session

NAME = "vllm"
MODEL_MODULE = "vllm.model_executor.models.deepseek_v2"
OP_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
V32_MODULE = "vllm.models.deepseek_v32.attention"
NVIDIA_MODULE = "vllm.models.deepseek_v32.nvidia.model"
RUNNER_V1_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"

_SIA = ("self", "positions", "q_c", "q_nope", "q_pe", "index_q_fp8", "index_k", "index_weights_out",
        "kv_c", "k_pe", "ql_nope", "mqa_q", "output")  # fmt: skip
_OP = ("self", "hidden_states", "q_quant", "k", "weights")
_EXECUTE = ("self", "scheduler_output")


def _runner_v2(name: str, source: str, prepare: tuple[str, ...]) -> Layout:
    return Layout(name, source, (
        Symbol(RUNNER_V2_MODULE, "GPUModelRunner.prepare_inputs", prepare),
        Symbol(RUNNER_V2_MODULE, "GPUModelRunner.execute_model", _EXECUTE, leading=True),
    ))  # fmt: skip


LAYOUTS = (
    Layout("deepseek_v2", "vLLM 0.24.0 to 0.34.0: models/deepseek_v2.py", (
        Symbol(MODEL_MODULE, "Indexer.forward", ("self", "hidden_states", "qr", "positions", "rotary_emb")),
        Symbol(MODEL_MODULE, "DeepseekV2ForCausalLM.forward", ("self", "input_ids", "positions"),
               leading=True),
    )),
    Layout("sparse_attn_indexer", "vLLM 0.24.0 to 0.34.0: layers/sparse_attn_indexer.py", (
        Symbol(OP_MODULE, "SparseAttnIndexer.forward_cuda", _OP),
    )),
    Layout("deepseek_v32", "vLLM 0.29.0 to 0.34.0: models/deepseek_v32/attention.py", (
        Symbol(V32_MODULE, "DeepseekV32Attention.forward", ("self", "positions", "hidden_states")),
        Symbol(V32_MODULE, "DeepseekV32Attention._sparse_indexer_and_attn", _SIA),
    )),
    # The CUDA class the registry routes to from 0.29 (also present, unrouted, in 0.28): its
    # forward is DeepseekV2ForCausalLM's, watched from deepseek_v2; read here to watch it
    # should a release give it a forward of its own.
    Layout("deepseek_v32_nvidia", "vLLM 0.28.0 to 0.34.0: models/deepseek_v32/nvidia/model.py", (
        Symbol(NVIDIA_MODULE, "DeepseekV32ForCausalLM.__init__", ("self", "vllm_config", "prefix")),
    )),
    Layout("gpu_model_runner", "vLLM 0.24.0 to 0.33.0: v1/worker/gpu_model_runner.py", (
        Symbol(RUNNER_V1_MODULE, "GPUModelRunner._model_forward",
               ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs")),
        Symbol(RUNNER_V1_MODULE, "GPUModelRunner.execute_model", _EXECUTE, leading=True),
    )),
    _runner_v2("gpu.model_runner-0.24", "vLLM 0.24.0: v1/worker/gpu/model_runner.py",
               ("self", "scheduler_output", "batch_desc")),
    _runner_v2("gpu.model_runner-0.28", "vLLM 0.28.0 to 0.29.0: v1/worker/gpu/model_runner.py",
               ("self", "scheduler_output", "batch_req_state", "batch_desc")),
    _runner_v2("gpu.model_runner-0.33", "vLLM 0.33.0 to 0.34.0: v1/worker/gpu/model_runner.py",
               ("self", "scheduler_output", "batch_req_state", "batch_desc", "num_active_loras")),
)  # fmt: skip

# Counters (per run unless said otherwise; see the module docstring).
DENSE_MHA = "indexer_rows_dense_mha_prefill"
NO_CONFIG = "shadow_skipped_no_model_config"
UNKNOWN_ROPE = "shadow_skipped_unknown_rope"
WQ_B_LAYOUT = "shadow_skipped_wq_b_scale_layout"
NO_FP8 = "shadow_skipped_no_fp8_operands"
REPLAY = "shadow_skipped_cudagraph_replay"
OUTSIDE = "indexer_calls_outside_engine_steps"
# vLLM 0.34's model runner on CPUs without mature Triton (v1/worker/cpu_worker.py): not hooked.
CPU_RUNNER_MODULE = "vllm.v1.worker.cpu.standalone_model_runner"
SHARED_LAYER = "indexer_calls_shared_layer"

_HIDDEN = "_shadowtrace_hidden"  # DeepseekV32Attention: the layer input during its forward
_OPERANDS = "_shadowtrace_operands"  # SparseAttnIndexer: the FP8 operands of its last call
# vLLM renames a non-default rope_type of the HF config in place (deepseek_v32 attention.py,
# deepseek_v2.py); both names are YaRN frequencies, which the model's config calls `yarn`.


@dataclass(eq=False)
class Step:
    """One engine step as the model runner laid it out: the marker of its indexer calls."""

    runner: str
    req_ids: tuple[str, ...]
    starts: np.ndarray  # [n + 1]: request i owns rows [starts[i], starts[i + 1])
    prompt: np.ndarray | None  # [n]: prompt (prefill) length of each request
    tokens: int  # real rows of the step (the forward's rows beyond are padding)
    prefixes: list[int] | None = None  # each request's first position, read once per step


class _Published:
    """The step the runner published for the forward in progress: one forward at a time per
    process, the model running in the runner's thread."""

    def __init__(self) -> None:
        self.step: Step | None = None


_published = _Published()


# Model packages whose indexer no layout hooks (0.34): building one says so once.
UNTRACED = {
    "vllm.models.glm5next": (
        ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration"),
        "vllm:glm5next",
        "GLM-5.3-Flash's indexer (glm5next Indexer, SparseAttnIndexerKpool: pooled keys) is not hooked; "
        "no indexer row is recorded",
    ),
    "vllm.models.deepseek_v4": (
        ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM", "DeepseekV4ForConditionalGeneration"),
        "vllm:v4",
        "DeepSeek-V4's indexer (compressed keys, FP4 queries) is not a DSA-V3.2 indexer; no indexer row "
        "is recorded",
    ),
}


def install(module: Any) -> None:
    """Patches one vLLM module, at the layout it matches, or raises UnsupportedVersion."""
    if module.__name__ in UNTRACED:
        classes, key, why = UNTRACED[module.__name__]
        engine.watch_untraced(module, classes, key, f"vLLM {_version()}: {why}")
        return
    layouts = tuple(layout for layout in LAYOUTS if module.__name__ in layout.modules)
    if not layouts or getattr(module, "_shadowtrace_layout", None) is not None:
        return
    layout = select(layouts, {module.__name__: module}, f"{NAME} {_version()}")
    _INSTALL[module.__name__](module, layout)
    module._shadowtrace_layout = layout


def _hooked(module: str) -> Layout | None:
    """The layout an engine module was hooked at, None when it was not (or is not loaded)."""
    return getattr(sys.modules.get(module), "_shadowtrace_layout", None)


def _version() -> str:
    try:
        return str(importlib.import_module("vllm").__version__)
    except Exception:  # a vLLM whose package fails to import says nothing about its modules
        return "unknown version"


def _compiling() -> bool:
    """torch.compile is tracing: the wrappers stay out of the graph (Dynamo folds this)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _capturing() -> bool:
    """A CUDA graph is being captured, plain or breakable (vLLM's eager breaks run with the
    stream not capturing, so only the capture object tells)."""
    if session.capturing():
        return True
    breakable = sys.modules.get("vllm.compilation.breakable_cudagraph")
    capture = getattr(breakable, "BreakableCUDAGraphCapture", None)
    return capture is not None and capture.current() is not None


# === impl the model runners ===========================================================


def _install_runner_v1(module: Any, layout: Layout) -> None:
    cls = module.GPUModelRunner
    model_forward = cls._model_forward

    @functools.wraps(model_forward)
    def traced_model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        sess = session.current()
        if sess is not None:
            # Entered inside the step's forward context, after _update_states reordered the
            # batch (decodes first): the order the rows have.
            sess.guarded("vllm:step", None, _publish_v1, sess, self, layout)
        try:
            return model_forward(self, *args, **kwargs)
        finally:
            _step_ended(sess)

    cls._model_forward = traced_model_forward
    cls.execute_model = _traced_execute(cls.execute_model)


def _install_runner_v2(module: Any, layout: Layout) -> None:
    cls = module.GPUModelRunner
    prepare = cls.prepare_inputs

    @functools.wraps(prepare)
    def traced_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = prepare(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            sess.guarded("vllm:step", None, _publish_v2, sess, self, batch, layout)
        return batch

    cls.prepare_inputs = traced_prepare
    cls.execute_model = _traced_execute(cls.execute_model)


def _traced_execute(execute: Callable) -> Callable:
    """execute_model: one engine step. A step is published only between its entry and its
    return, so forwards outside it (dummy and profile runs, graph capture, the drafter after
    it) find none."""

    @functools.wraps(execute)
    def traced_execute(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        _published.step = None
        sess = session.current()
        if sess is not None:
            sess.guarded("vllm:finished", None, _finish, sess, scheduler_output)
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            _step_ended(sess)

    return traced_execute


def _publish(sess: Session, step: Step) -> None:
    """Publishes the step for its indexer calls, and begins it in the engine's tracer, once an
    indexer call has been recorded in this process (a model without a hooked indexer has no
    step to miss): one that runs no indexer hook (a FULL CUDA-graph replay) is counted in each
    of its requests' runs when it ends (`EngineTracer.settle`)."""
    _published.step = step
    tracer = sess.tracers.get(NAME)
    if tracer is not None:
        tracer.step_began(
            list(step.req_ids),
            f"vLLM {_version()}: engine steps whose indexer ran no Python (FULL CUDA-graph replays of "
            f"decode batches) are not recorded; each request's run counts them ({engine.UNSEEN}): run "
            "with --enforce-eager to record them",
        )


def _step_ended(sess: Session | None) -> None:
    """The published step is over (`_publish`)."""
    _published.step = None
    tracer = None if sess is None else sess.tracers.get(NAME)
    if tracer is not None:
        sess.guarded("vllm:unseen", None, tracer.settle)


def _finish(sess: Session, scheduler_output: Any) -> None:
    """Closes the runs of the requests the scheduler reports finished since the last step,
    and of preempted ones: they restart from their first token, in a run of their own."""
    tracer = sess.tracers.get(NAME)
    if tracer is None:
        return
    done = set(getattr(scheduler_output, "finished_req_ids", None) or ())
    done |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    tracer.finish(sorted(done))


def _publish_v1(sess: Session, runner: Any, layout: Layout) -> None:
    batch = runner.input_batch
    n = int(batch.num_reqs)
    starts = np.array(runner.query_start_loc.np[: n + 1], dtype=np.int64)
    step = Step(
        runner=f"{RUNNER_V1_MODULE} ({layout.source})",
        req_ids=tuple(batch.req_ids[:n]),
        starts=starts,
        prompt=np.array(batch.num_prompt_tokens[:n], dtype=np.int64),
        tokens=int(starts[n]),
    )
    _publish(sess, step)


def _publish_v2(sess: Session, runner: Any, batch: Any, layout: Layout) -> None:
    _published.step = None
    # A batch partitioned across prefill context-parallel ranks, or whose draft rows are
    # reallocated on the GPU after this (adaptive verification), has rows the CPU arrays do
    # not describe.
    partitioned = getattr(runner, "pcp_manager", None) is not None
    adaptive = getattr(runner, "adaptive_verification", None) is not None and batch.num_draft_tokens > 0
    if partitioned or adaptive:
        sess.count("engine_steps_not_traced")
        why = "prefill context parallelism" if partitioned else "adaptive draft verification"
        sess.warn_once(f"vllm:step:{why}", f"vLLM steps under {why} are not traced (engine_steps_not_traced)")
        return
    n = int(batch.num_reqs)
    step = Step(
        runner=f"{RUNNER_V2_MODULE} ({layout.source})",
        req_ids=tuple(batch.req_ids[:n]),
        starts=np.array(batch.query_start_loc_np[: n + 1], dtype=np.int64),
        prompt=np.array(batch.prefill_len_np[:n], dtype=np.int64),
        tokens=int(batch.num_tokens),
    )
    _publish(sess, step)


def _forward_context() -> Any:
    return importlib.import_module("vllm.forward_context").get_forward_context()


def _requests(
    sess: Session, k_cache_prefix: str, positions: torch.Tensor, dense_mha_layer: str
) -> tuple[Step, list[Request]] | None:
    """This call's requests from the published step, checked against the indexer's own
    metadata; None (counted) when the call belongs to no step that can be trusted."""
    step = _published.step
    if step is None:
        sess.count(OUTSIDE)
        if CPU_RUNNER_MODULE in sys.modules:
            # 0.34 on CPUs: StandaloneCPUModelRunner, no GPUModelRunner, though gpu/model_runner
            # is imported (and hooked) all the same.
            sess.warn_once(
                "vllm:cpu_runner",
                f"vLLM {_version()}: the standalone CPU model runner ({CPU_RUNNER_MODULE}) is not hooked: "
                f"request ids are unknown and no indexer row is recorded (counted as {OUTSIDE})",
            )
        elif _hooked(RUNNER_V1_MODULE) or _hooked(RUNNER_V2_MODULE):
            sess.warn_once(
                "vllm:outside_step",
                "vLLM indexer calls outside an engine step (profile, warm-up, CUDA-graph capture, "
                f"drafter) are not recorded; counted as {OUTSIDE}",
            )
        else:
            sess.warn_once(
                "vllm:no_runner",
                f"vLLM {_version()}: no model runner layout is hooked, so request ids are unknown and "
                f"no indexer row is recorded (counted as {OUTSIDE}); see python -m shadowtrace_hooks doctor",
            )
        return None
    fc = _forward_context()
    metadata = fc.attn_metadata
    if isinstance(metadata, list) or getattr(fc, "ubatch_slices", None) is not None:
        sess.count("indexer_calls_microbatched")
        sess.warn_once("vllm:ubatch", "vLLM micro-batched (DBO) steps are not traced")
        return None
    meta = metadata.get(k_cache_prefix) if isinstance(metadata, dict) else None
    if meta is None:
        sess.count("indexer_calls_without_metadata")
        return None
    if (
        meta.num_decodes + meta.num_prefills != len(step.req_ids)
        or meta.num_decode_tokens + meta.num_prefill_tokens != step.tokens
    ):
        sess.count("indexer_calls_batch_mismatch")
        sess.warn_once(
            "vllm:mismatch",
            f"vLLM indexer metadata ({meta.num_decodes + meta.num_prefills} requests, "
            f"{meta.num_decode_tokens + meta.num_prefill_tokens} rows) disagrees with the runner's step "
            f"({len(step.req_ids)} requests, {step.tokens} rows): not recorded "
            "(indexer_calls_batch_mismatch)",
        )
        return None
    if step.prefixes is None:
        # The first row's position, not the runner's count: under async scheduling with
        # drafts the CPU count assumes every draft was accepted.
        index = torch.as_tensor(step.starts[:-1], device=positions.device)
        step.prefixes = [int(p) for p in positions.index_select(0, index).tolist()]
    dense = _dense_mha(fc, metadata, dense_mha_layer)
    out = []
    for i, key in enumerate(step.req_ids):
        start, rows, prefix = int(step.starts[i]), int(step.starts[i + 1] - step.starts[i]), step.prefixes[i]
        prefill = prefix < int(step.prompt[i]) if step.prompt is not None else i >= meta.num_decodes
        req = Request(key=key, start=start, rows=rows, prefix=prefix, prefill=prefill)
        if dense:
            req.skipped[DENSE_MHA] = rows
        out.append(req)
    return step, out


def _dense_mha(fc: Any, metadata: dict, layer_name: str) -> bool:
    """vLLM's short-prefill skip, as sparse_attn_indexer decides it (0.28+): a pure-prefill
    batch the main MLA serves with dense MHA; the indexer then returns without writing."""
    if not layer_name or getattr(getattr(fc, "cudagraph_runtime_mode", None), "name", None) == "FULL":
        return False
    mla = metadata.get(layer_name)
    prefill = getattr(mla, "prefill", None)
    return bool(getattr(prefill, "use_dense_mha", False)) and getattr(mla, "num_decode_tokens", -1) == 0


# === impl the deepseek_v2 path ========================================================


def _install_model(module: Any, layout: Layout) -> None:
    cls = module.Indexer
    forward = cls.forward

    @functools.wraps(forward)
    def traced(self: Any, hidden_states: Any, qr: Any, positions: Any, rotary_emb: Any) -> Any:
        if _compiling():
            return forward(self, hidden_states, qr, positions, rotary_emb)
        sess = session.current()
        if sess is not None:
            engine.reached(sess, NAME)
        out = forward(self, hidden_states, qr, positions, rotary_emb)
        operands = _take_operands(self)
        if sess is not None:
            inputs = (hidden_states, qr, positions, rotary_emb, operands, out)
            sess.guarded("vllm:indexer", None, _record_v2, sess, self, *inputs)
        return out

    cls.forward = traced
    engine.watch_forward(module.DeepseekV2ForCausalLM, "forward", NAME, _real_forward)


def _install_op(module: Any, layout: Layout) -> None:
    cls = module.SparseAttnIndexer
    forward_cuda = cls.forward_cuda

    @functools.wraps(forward_cuda)
    def traced(self: Any, hidden_states: Any, q_quant: Any, k: Any, weights: Any) -> Any:
        if _compiling():
            return forward_cuda(self, hidden_states, q_quant, k, weights)
        out = forward_cuda(self, hidden_states, q_quant, k, weights)
        sess = session.current()
        if sess is not None:
            sess.guarded("vllm:operands", None, _keep_operands, sess, self, q_quant, k, weights)
        return out

    cls.forward_cuda = traced


def _take_operands(indexer: Any) -> tuple | None:
    """The operands the op kept in this call, taken whatever happens next: it keeps them
    for this call only, and a disabled capture must not leave them pinned."""
    op = getattr(indexer, "indexer_op", None)
    return None if op is None else vars(op).pop(_OPERANDS, None)


def _keep_operands(sess: Session, op: Any, q_quant: Any, k: Any, weights: Any) -> None:
    """The op's FP8 operands, for the Indexer.forward around it (which takes them at once):
    only a DSA-V3.2 indexer's, only when that wrapper will take them."""
    if _hooked(MODEL_MODULE) is None or "vllm:indexer" in sess.disabled:
        return
    # DeepSeek-V4 calls this op with k=None, an FP4 (values, scales) q and a compressed cache.
    if not isinstance(q_quant, torch.Tensor) or k is None or getattr(op, "compress_ratio", 1) != 1:
        sess.warn_once(
            "vllm:v4", "vLLM SparseAttnIndexer calls without a DSA-V3.2 key (DeepSeek-V4) are not traced"
        )
        return
    vars(op)[_OPERANDS] = (q_quant, k, weights)


def _record_v2(
    sess: Session, indexer: Any, hidden: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
    rotary_emb: Any, operands: tuple | None, out: torch.Tensor,
) -> None:  # fmt: skip
    if _capturing():
        sess.count("captures_skipped_cuda_graph")
        return
    layer = _layer(indexer.prefix)
    if not (sess.settings.layer(layer) and sess.settings.site("indexer")):
        return
    dense_name = getattr(indexer.indexer_op, "dense_mha_metadata_layer_name", "")
    batch = _requests(sess, indexer.k_cache.prefix, positions, dense_name)
    if batch is None:
        return
    step, requests = batch
    total = step.tokens
    config = getattr(indexer, "config", None)
    tracer = engine.tracer_for(sess, NAME, "vllm:deepseek_v2", indexer.topk_tokens, config)
    call = IndexerCall(
        marker=step, layer=layer, k=indexer.topk_tokens,
        prod_topk=out[:total, : indexer.topk_tokens].clone(), requests=requests,
    )  # fmt: skip
    notes: list[str] = []
    if _shadowed(sess, requests):
        call.raw = sess.guarded(
            "vllm:raw_inputs", None, _raw_inputs, sess, indexer, config, hidden, qr, positions, total, notes
        )
        if operands is None:
            notes.append(NO_FP8)
        else:
            call.fp8 = sess.guarded("vllm:dequant_operands", None, _fp8_v2, operands, total)
    neox = bool(getattr(rotary_emb, "is_neox_style", True))
    convention = _convention(neox, "Indexer rotary_emb.is_neox_style", config)
    _annotate(call, MODEL_MODULE, step, _conventions(convention, config, hidden.dtype, indexer), notes)
    tracer.record(call)


def _fp8_v2(operands: tuple, total: int) -> Fp8Operands:
    q8, k, weights = operands
    k8, k_scale = numerics.quantize_rows(k[:total], scale_format="ue8m0", amax_clamp=1e-4)
    return Fp8Operands(q8=q8[:total], weights=weights[:total], k8=k8, k_scale=k_scale.reshape(-1))


# === impl the deepseek_v32 path =======================================================


def _install_v32(module: Any, layout: Layout) -> None:
    cls = module.DeepseekV32Attention
    forward = cls.forward
    original = cls._sparse_indexer_and_attn
    inner = getattr(original, "__wrapped__", original)
    decorate = getattr(module, "eager_break_during_capture", None)
    # Decorated again around the undecorated body, so that a breakable CUDA-graph replay
    # (which calls what the decorator wrapped) runs the wrapper; without the decorator at
    # hand, around the decorated method (eager calls only, the eager break kept).
    redecorate = inner is not original and decorate is not None
    body = inner if redecorate else original
    names = _SIA[1:]

    @functools.wraps(forward)
    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return forward(self, *args, **kwargs)
        sess = session.current()
        kept = sess is not None and sess.guarded("vllm:layer_input", None, _keep_hidden, self, args, kwargs)
        try:
            return forward(self, *args, **kwargs)
        finally:
            if kept:
                vars(self).pop(_HIDDEN, None)

    @functools.wraps(body)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return body(self, *args, **kwargs)
        sess = session.current()
        if sess is not None:
            engine.reached(sess, NAME)
        out = body(self, *args, **kwargs)
        if sess is not None:
            bound = dict(zip(names, args, strict=False)) | kwargs
            sess.guarded("vllm:indexer", None, _record_v32, sess, self, bound)
        return out

    cls.forward = traced_forward
    cls._sparse_indexer_and_attn = decorate(traced) if redecorate and decorate is not None else traced


def _install_nvidia(module: Any, layout: Layout) -> None:
    engine.watch_forward(module.DeepseekV32ForCausalLM, "forward", NAME, _real_forward)


def _real_forward() -> bool:
    """A forward of a DSA model in an engine step (not a profile or warm-up run, and not a
    DeepSeek-V2/V3 model, which shares DeepseekV2ForCausalLM and has no indexer)."""
    if _published.step is None:
        return False
    metadata = _forward_context().attn_metadata
    return isinstance(metadata, dict) and any(str(name).endswith(".indexer.k_cache") for name in metadata)


def _keep_hidden(attn: Any, args: tuple, kwargs: dict) -> bool:
    # During a capture the data is a dummy batch; on replay forward does not run at all.
    if attn.indexer is None or _capturing():
        return False
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    vars(attn)[_HIDDEN] = hidden
    return True


def _record_v32(sess: Session, attn: Any, bound: dict) -> None:
    indexer = attn.indexer
    if indexer is None:
        # A shared layer (GLM-5.2's `indexer_types`, honoured from 0.34) reuses an earlier
        # layer's selection: nothing of its own to record, counted so it is never silent.
        sess.count(SHARED_LAYER)
        return
    if _capturing():
        sess.count("captures_skipped_cuda_graph")
        return
    layer = _layer(indexer.prefix)
    if not (sess.settings.layer(layer) and sess.settings.site("indexer")):
        return
    positions = bound["positions"]
    batch = _requests(sess, indexer.k_cache.prefix, positions, attn._dense_mha_metadata_layer_name)
    if batch is None:
        return
    step, requests = batch
    total = step.tokens
    config = _hf_config(attn)
    tracer = engine.tracer_for(sess, NAME, "vllm:deepseek_v32", indexer.topk_tokens, config)
    prod_topk = attn.topk_indices_buffer[:total, : indexer.topk_tokens].clone()
    gather = _shardq_gather(indexer.k_cache.prefix)
    if gather is not None:
        prod_topk, requests = _unshard_rows(prod_topk, gather, requests)
    call = IndexerCall(
        marker=step, layer=layer, k=indexer.topk_tokens, prod_topk=prod_topk, requests=requests
    )
    notes: list[str] = []
    hidden = vars(attn).get(_HIDDEN)
    if _shadowed(sess, requests):
        if hidden is None:
            notes.append(REPLAY)
            sess.warn_once(
                "vllm:replay",
                "vLLM breakable CUDA-graph replays record production rows only: the layer input is not "
                f"reachable (counted as {REPLAY}); run with --enforce-eager for the shadows",
            )
        else:
            call.raw = sess.guarded(
                "vllm:raw_inputs", None, _raw_inputs, sess, indexer, config, hidden, bound["q_c"],
                positions, total, notes,
            )  # fmt: skip
            call.fp8 = sess.guarded(
                "vllm:dequant_operands", None, _fp8_v32, attn, indexer, hidden, positions,
                bound["index_q_fp8"], bound["index_weights_out"], total,
            )  # fmt: skip
    interleave = bool(attn._index_rope_interleave)
    convention = _convention(not interleave, "DeepseekV32Attention._index_rope_interleave", config)
    conventions = _conventions(convention, config, _dtype(hidden), indexer)
    op = getattr(indexer, "indexer_op", None)
    if hasattr(op, "logits_dtype"):  # 0.34: the op's logits dtype and decode top-k backend
        conventions += [
            engine.logits_dtype_convention(
                op.logits_dtype, f"vllm {_version()} SparseAttnIndexer.logits_dtype", config
            ),
            engine.topk_backend_convention(
                getattr(op, "topk_backend", None), f"vllm {_version()} SparseAttnIndexer.topk_backend"
            ),
        ]
        if op.logits_dtype == torch.bfloat16:
            call.check_tolerance = engine.BF16_LOGITS_CHECK_TOLERANCE
    _annotate(call, V32_MODULE, step, conventions, notes)
    tracer.record(call)


def _shardq_gather(k_cache_prefix: str) -> torch.Tensor | None:
    """vLLM 0.34's ShardQ (tensor parallelism, a prefill step of >= 1024 tokens after its
    decodes): this rank scored only its zigzag share of the prefill tokens and wrote their
    rows packed after the decode rows, buffer row r holding global row gather[r]
    (`DeepseekV32IndexerPrefillMetadata.shardq_gather_indices`, v1/attention/backends/mla/
    indexer.py). A view into a buffer the next step overwrites: read during the call. None
    on a step that is not sharded, and on releases without ShardQ."""
    meta = _forward_context().attn_metadata.get(k_cache_prefix)
    return getattr(getattr(meta, "prefill", None), "shardq_gather_indices", None)


def _unshard_rows(
    packed: torch.Tensor, gather: torch.Tensor, requests: list[Request]
) -> tuple[torch.Tensor, list[Request]]:
    """The buffer's rows put back in the step's global order (rows this rank did not score
    stay -1), and each request cut to the rows this rank scored: at most two runs of rows
    for a prefill (its zigzag chunks), each a Request of its own that keeps the call row of
    the request's first token, so the shadows still see every key from position 0. The
    rows another rank scored are counted in the request's run (`topk_rows_on_other_ranks`):
    that rank's run of the same request records them."""
    index = gather.long()
    rows = torch.full_like(packed, -1)
    rows[index] = packed[: index.numel()]
    owned = torch.zeros(packed.shape[0], dtype=torch.bool, device=packed.device)
    owned[index] = True
    mine = owned.cpu().numpy()
    out: list[Request] = []
    for req in requests:
        spans = _runs(mine[req.start : req.start + req.rows])
        if len(spans) == 1 and spans[0] == (0, req.rows):
            out.append(req)
            continue
        # A skip reason counts the rows it covers: each piece its own.
        pieces = [
            Request(key=req.key, start=req.start + lo, rows=hi - lo, prefix=req.prefix + lo,
                    prefill=req.prefill, skipped=dict.fromkeys(req.skipped, hi - lo), first_row=req.start)
            for lo, hi in spans
        ]  # fmt: skip
        other = req.rows - sum(p.rows for p in pieces)
        if not pieces:  # every row on other ranks: the run still learns of the step
            pieces = [Request(key=req.key, start=req.start, rows=0, prefix=req.prefix, prefill=req.prefill,
                              skipped=dict.fromkeys(req.skipped, 0), first_row=req.start)]  # fmt: skip
        pieces[0].counts["topk_rows_on_other_ranks"] = other
        out += pieces
    return rows, out


def _runs(mask: Any) -> list[tuple[int, int]]:
    """The [lo, hi) runs of True in a 1-D bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def _hf_config(attn: Any) -> Any:
    model_config = getattr(getattr(attn, "_vllm_config", None), "model_config", None)
    return getattr(model_config, "hf_config", None)


def _fp8_v32(
    attn: Any, indexer: Any, hidden: torch.Tensor, positions: torch.Tensor, q8: torch.Tensor,
    weights: torch.Tensor, total: int,
) -> Fp8Operands:  # fmt: skip
    """The engine's q and weights, and K as fused_norm_rope computes it before writing the
    FP8 cache: LayerNorm of the bf16 GEMM output in fp32, the engine's RoPE convention and
    cos/sin table (read, never called), ue8m0 quantization with amax clamp 1e-4."""
    dim, rope_dim = indexer.head_dim, indexer.rope_dim
    x = hidden[:total]
    weight = indexer.wk_weights_proj.weight
    kw = torch.nn.functional.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
    key = kw[:, :dim].float()
    norm = indexer.k_norm
    mean = key.sum(-1, keepdim=True) / dim
    diff = key - mean
    rstd = torch.rsqrt((diff * diff).sum(-1, keepdim=True) / dim + norm.eps)
    normed = diff * rstd * norm.weight.float() + norm.bias.float()
    table = attn.indexer_rope_emb.cos_sin_cache.index_select(0, positions[:total].long()).float()
    cos, sin = table[:, : rope_dim // 2], table[:, rope_dim // 2 : rope_dim]
    rotated = numerics.rope(normed[:, :rope_dim], cos, sin, neox=not attn._index_rope_interleave)
    k8, k_scale = numerics.quantize_rows(
        torch.cat([rotated, normed[:, rope_dim:]], -1), scale_format="ue8m0", amax_clamp=1e-4
    )
    return Fp8Operands(q8=q8[:total], weights=weights[:total], k8=k8, k_scale=k_scale.reshape(-1))


# === impl shared ======================================================================


def _layer(prefix: str) -> int:
    found = re.search(r"layers\.(\d+)\.", prefix)
    return int(found.group(1)) if found else 0


def _shadowed(sess: Session, requests: list[Request]) -> bool:
    """Whether any request of the call gets a shadow (its keys all in the call)."""
    return sess.settings.precision is not None and any(
        r.key_rows() is not None and not r.skipped for r in requests
    )


def _raw_inputs(
    sess: Session, indexer: Any, config: Any, hidden: torch.Tensor, qr: torch.Tensor,
    positions: torch.Tensor, total: int, notes: list[str],
) -> RawInputs | None:  # fmt: skip
    """The raw shadow's inputs, or None with the reason in `notes`."""
    if config is None:
        notes.append(NO_CONFIG)
        sess.warn_once(
            "vllm:no_config", f"vLLM: the model's HF config is not reachable: no raw shadow ({NO_CONFIG})"
        )
        return None
    try:
        model_rope = rope.indexer_rope(config)
    except rope.UnknownModel as e:
        notes.append(UNKNOWN_ROPE)
        sess.warn_once("vllm:rope", f"vLLM: no raw shadow: {e} ({UNKNOWN_ROPE})")
        return None
    if not _dense_blocks(indexer.wq_b):
        notes.append(WQ_B_LAYOUT)
        sess.warn_once(
            "vllm:wq_b", f"vLLM: wq_b's FP8 scales are not fp32 128x128 blocks: no raw shadow ({WQ_B_LAYOUT})"
        )
        return None
    return RawInputs(
        x=hidden[:total], qr=qr[:total], positions=positions[:total],
        weights=functools.cache(lambda: _weights(indexer)), rope=model_rope,
    )  # fmt: skip


def _dense_blocks(linear: Any) -> bool:
    """Whether numerics.dense_weight can expand the layer's weight: unquantized, or FP8 with
    one fp32 scale per 128x128 block (DeepGEMM may repack scales as ue8m0 after loading)."""
    weight = linear.weight
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    scale = getattr(linear, "weight_scale_inv", None)
    rows, cols = weight.shape
    blocks = (-(-rows // 128), -(-cols // 128))
    return scale is not None and scale.dtype == torch.float32 and tuple(scale.shape) == blocks


def _weights(indexer: Any) -> engine.IndexerWeights:
    dim = indexer.head_dim
    kw = numerics.dense_weight(indexer.wk_weights_proj)
    wq_b = numerics.dense_weight(indexer.wq_b)
    return engine.weights_of(indexer.n_head, dim, wq_b, kw[:dim], kw[dim:], indexer.k_norm)


def _convention(engine_neox: bool, engine_source: str, config: Any) -> dict[str, Any]:
    model, missing = None, "the model's HF config is not reachable"
    if config is not None:
        try:
            model = rope.indexer_rope(config)
        except rope.UnknownModel as e:
            missing = str(e)
    source = f"{engine_source} (config indexer_rope_interleave, default False)"
    return engine.rope_convention(engine_neox, model, source, missing)


def _dtype(tensor: Any) -> torch.dtype | None:
    return tensor.dtype if isinstance(tensor, torch.Tensor) else None


def _conventions(
    rope_convention: dict, config: Any, hidden_dtype: torch.dtype | None, indexer: Any
) -> list[dict]:
    """The RoPE convention, and those every vLLM route shares: no Hadamard rotation before
    the FP8 cast (neither route's model code has one), the head-weight scale the indexer
    folds (softmax_scale x n_head^-0.5), and `weights_proj` fused with `wk` into one GEMM
    whose output has the hidden states' dtype."""
    where = f"vllm {_version()}"
    return [
        rope_convention,
        # Read from the route's model code, not observed at run time: assumed.
        engine.hadamard_convention(
            False,
            f"assumed from {where}: the indexer casts q and k to FP8 without rotate_activation",
            config,
            assumed=True,
        ),
        engine.head_weight_scale_convention(
            engine.folded_scale(indexer, "softmax_scale", "n_head"),
            f"{where} Indexer.softmax_scale x n_head^-0.5",
            config,
        ),
        engine.weights_proj_convention(
            hidden_dtype, f"{where} Indexer.wk_weights_proj(hidden_states): one GEMM with wk, input dtype"
        ),
    ]


def _annotate(call: IndexerCall, module: str, step: Step, conventions: list[dict], notes: list[str]) -> None:
    """The adapter's layouts and the conventions for each run's manifest, and the shadows
    skipped for each request's rows, counted in its run."""
    layout = _hooked(module)
    assert layout is not None
    call.settings = run_settings(layout, NAME, _version(), f"; runner {step.runner}")
    call.conventions = conventions
    for req in call.requests:
        if req.key_rows() is not None and not req.skipped:
            for name in notes:
                req.counts[name] = req.rows


_INSTALL: dict[str, Callable[[Any, Layout], None]] = {
    MODEL_MODULE: _install_model,
    OP_MODULE: _install_op,
    V32_MODULE: _install_v32,
    NVIDIA_MODULE: _install_nvidia,
    RUNNER_V1_MODULE: _install_runner_v1,
    RUNNER_V2_MODULE: _install_runner_v2,
}
