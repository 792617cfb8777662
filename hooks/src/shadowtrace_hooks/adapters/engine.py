"""What the serving-engine adapters (TensorRT-LLM, SGLang, vLLM) share: checking the hooked
methods against the upstream signatures an adapter was written for, one run per engine
request, and the indexer capture with its two shadows.

An adapter turns one indexer call into an `IndexerCall`: the production top-k rows, how they
split into requests, the engine's own FP8 operands (for the `dequant` shadow: the fp32
recompute of exactly what the production kernel multiplied) and a way to recompute q, k and
w in fp32 from the pre-quantization inputs (the `raw` shadow). Rows of a request whose
earlier keys are not in this call (decode steps, cached prefixes) are recorded for
production only and counted: their keys live in the engine's FP8 cache, which the hooks do
not read.
"""

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shadowtrace_hooks import numerics, session
from shadowtrace_hooks.session import Run, Session


class UnsupportedVersion(RuntimeError):
    """The engine's method does not have the signature the adapter was written against."""


def check_signature(
    cls: type, method: str, expected: list[str], where: str, *, leading: bool = False
) -> None:
    """Raises UnsupportedVersion unless `cls.method` takes exactly these parameters (with
    `leading`, these first, and anything after them)."""
    fn = getattr(cls, method, None)
    if fn is None:
        raise UnsupportedVersion(f"{where}: {cls.__name__}.{method} does not exist")
    got = list(inspect.signature(fn).parameters)
    if (got[: len(expected)] if leading else got) != expected:
        raise UnsupportedVersion(
            f"{where}: {cls.__name__}.{method}: expected parameters ({', '.join(expected)}), "
            f"got ({', '.join(got)})"
        )


def bind(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@dataclass
class Request:
    """One request's rows in an indexer call."""

    key: str  # the engine's request id, or a stand-in
    start: int  # first row of the call
    rows: int  # rows (query tokens) of this request in the call
    prefix: int  # tokens of the request before these rows (cached or earlier chunks)
    prompt_length: int


@dataclass
class IndexerCall:
    layer: int
    k: int
    prod_topk: torch.Tensor  # [rows, k] int32, request-local positions, -1 padded
    requests: list[Request]
    fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = (
        None  # q8, k8, k_scale, weights
    )
    raw: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = (
        None  # fp32 q, k, w (with H^-0.5)
    )
    counters: dict[str, int] = field(default_factory=dict)


class EngineTracer:
    """Runs of one engine in this process, one per request, closed when a new engine step
    no longer contains the request (or at exit)."""

    def __init__(self, sess: Session, engine: dict, model: dict, dtypes: dict) -> None:
        self.sess, self.engine, self.model, self.dtypes = sess, engine, model, dtypes
        self.runs: dict[str, Run] = {}
        self.in_step: set[str] = set()
        self.last_layer = -1

    def record(self, call: IndexerCall) -> None:
        s = self.sess.settings
        if not (s.layer(call.layer) and s.site("indexer")):
            return
        if call.layer <= self.last_layer:
            self._next_step()
        self.last_layer = call.layer
        raw = call.raw() if call.raw is not None and s.precision is not None else None
        for req in call.requests:
            run = self._run(req, call.prod_topk.device)
            rows = slice(req.start, req.start + req.rows)
            q_pos = torch.arange(req.prefix, req.prefix + req.rows, device=call.prod_topk.device)
            prod = numerics.members(call.prod_topk[rows], q_pos + 1)
            shadows: dict[str, numerics.Selection] = {}
            if req.prefix == 0 and s.precision is not None:
                if raw is not None:
                    q, k, w = (t[rows] for t in raw)
                    shadows["raw"] = numerics.select(
                        numerics.index_scores(q, k, w, q_pos), call.k, q_pos, s.band
                    )
                if call.fp8 is not None:
                    q8, k8, ks, w8 = (t[rows] for t in call.fp8)
                    scores = numerics.folded_scores(q8, k8, ks, w8, q_pos)
                    shadows["dequant"] = numerics.select(scores, call.k, q_pos, s.band)
            elif s.precision is not None:
                run.count("shadow_skipped_rows_without_keys", req.rows)
            for name, n in call.counters.items():
                run.count(name, n)
            run.topk(call.layer, call.layer, call.k, q_pos, prod, None, shadows)

    def _run(self, req: Request, device: torch.device) -> Run:
        self.in_step.add(req.key)
        run = self.runs.get(req.key)
        if run is None:
            run = self.sess.open_run(
                token_ids=[],
                request=req.key,
                prompt_length=req.prompt_length,
                model=self.model,
                engine=self.engine,
                device=session.device_of(torch.empty(0, device=device)),
                dtypes=self.dtypes,
            )
            run.step = 0
            self.runs[req.key] = run
        return run

    def _next_step(self) -> None:
        for key in [k for k in self.runs if k not in self.in_step]:
            self.sess.close_run(self.runs.pop(key))
        for key in self.in_step:
            self.runs[key].step += 1
        self.in_step = set()

    def close(self) -> None:
        for run in self.runs.values():
            self.sess.close_run(run)
        self.runs = {}


def engine_model(sess: Session, index_topk: int) -> dict:
    """What an engine hook knows of the model: the user's `model` tag names it."""
    return {
        "name": sess.settings.tags.get("model", "unnamed DSA model"),
        "architecture": sess.settings.tags.get("architecture", "dsa"),
        "config_hash": "",
        "revision": None,
        "num_layers": 0,
        "index_topk": index_topk,
    }


def tracer_for(sess: Session, engine: str, variant: str, index_topk: int) -> EngineTracer:
    """The session's tracer of `engine` (its package name, the engine's name in the
    manifest; `variant` names its FP8 indexer), made on first use."""
    key = f"_engine_{engine}"
    tracer = sess.__dict__.get(key)
    if tracer is None:
        version = getattr(importlib.import_module(engine), "__version__", "unknown")
        tracer = EngineTracer(
            sess,
            engine={"name": engine, "version": version, "commit": None, "variant": variant},
            model=engine_model(sess, index_topk),
            dtypes={"prod": "fp8_e4m3", "shadow": sess.settings.precision},
        )
        sess.__dict__[key] = tracer
    return tracer


def requests_from_lengths(keys: list[str], new: list[int], cached: list[int]) -> list[Request]:
    """Consecutive rows per request, as every engine lays out a batch."""
    out, start = [], 0
    for key, n, c in zip(keys, new, cached, strict=True):
        out.append(Request(key=key, start=start, rows=n, prefix=c, prompt_length=c + n))
        start += n
    return out
