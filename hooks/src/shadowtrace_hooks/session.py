"""One process's tracing: settings read once, a run per request, and the guard that keeps
every hook failure away from the traced engine.

Adapters (shadowtrace_hooks.adapters) decide where tensors come from; this module decides
what is recorded and how: which layers, sites and tokens, the run's identity, the rows.
"""

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shadowtrace_hooks import __version__, config, numerics, stats
from shadowtrace_hooks.writer import RunWriter

log = logging.getLogger("shadowtrace")

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
}


def capturing() -> bool:
    """True while a CUDA graph is being captured or torch.compile is tracing: Python hooks
    would run once at capture and never on replay, so they step aside."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class Settings:
    """The SHADOWTRACE_* variables as the hooks use them (definitions in schemas/v1/env.json)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.enabled: bool = values["SHADOWTRACE"]
        self.dir = Path(values["SHADOWTRACE_DIR"])
        self.layers = values["SHADOWTRACE_LAYERS"]
        self.sites = values["SHADOWTRACE_SITES"]
        precision = values["SHADOWTRACE_SHADOW"]
        self.precision: str | None = None if precision == "none" else precision
        self.modes: list[str] = values["SHADOWTRACE_MODE"] if self.precision else []
        self.tokens = values["SHADOWTRACE_TOKENS"]
        self.tags: dict[str, str] = values["SHADOWTRACE_TAGS"]
        self.queue: str = values["SHADOWTRACE_QUEUE"]
        self.queue_bytes: int = values["SHADOWTRACE_QUEUE_MB"] << 20
        self.queue_timeout_s: float = values["SHADOWTRACE_QUEUE_TIMEOUT_S"]
        self.flush_timeout_s: float = values["SHADOWTRACE_FLUSH_TIMEOUT_S"]
        self.band: float = values["SHADOWTRACE_BOUNDARY_BAND"]
        self.top_n: int = values["SHADOWTRACE_LOGITS_TOP_N"]

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "Settings":
        return cls(config.resolve(os.environ if environ is None else environ))

    @property
    def shadow_dtype(self) -> torch.dtype | None:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[self.precision]

    def layer(self, index: int) -> bool:
        return self.layers == "all" or any(a <= index <= b for a, b in self.layers)

    def site(self, name: str) -> bool:
        return self.sites == "all" or name in self.sites

    def token_rows(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Rows of `positions` (a forward's token positions) whose statistics are recorded."""
        kind = self.tokens["kind"]
        if kind == "all":
            keep = torch.ones_like(positions, dtype=torch.bool)
        elif kind == "every":
            keep = positions % self.tokens["n"] == 0
        else:
            keep = positions >= length - self.tokens["n"]
        return keep.nonzero().flatten()

    def recorded(self) -> dict[str, Any]:
        """The settings that shape a trace, for the manifest."""
        return {
            "layers": self.values["SHADOWTRACE_LAYERS"],
            "sites": self.values["SHADOWTRACE_SITES"],
            "tokens": self.tokens,
            "boundary_band": self.band,
            "logits_top_n": self.top_n,
        }


def _salt() -> bytes:
    """This installation's prompt-hash salt, created on first use; a per-process one when
    the cache directory cannot be written (its salt_id then differs per process).

    Ranks of one job start together: the salt is published with a hard link, which fails
    when the file exists, so every process reads the one salt that won."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "shadowtrace" / "salt"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"salt.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(secrets.token_bytes(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        salt = path.read_bytes()
        if len(salt) != 32:
            raise OSError(f"{path}: {len(salt)} bytes, expected 32")
        return salt
    except OSError:
        return secrets.token_bytes(32)


def token_hash(salt: bytes, ids: list[int]) -> str:
    """sha256 over the salt and the ids as little-endian u32, as the Rust tracer hashes them."""
    return hashlib.sha256(salt + np.asarray(ids, dtype="<u4").tobytes()).hexdigest()


def parallelism() -> dict[str, int]:
    """Rank and world size of this process: torch.distributed when initialised, else the
    launcher's RANK / WORLD_SIZE, else a single process."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return {"tp": world, "pp": 1, "dp": 1, "ep": 1, "rank": rank, "world_size": world}


def device_of(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.device.type == "cuda":
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        return {"kind": "cuda", "name": torch.cuda.get_device_name(index), "index": index}
    return {"kind": "cpu", "name": "cpu", "index": None}


class Run:
    """One request's run: rows go to its writer, each capture numbered in execution order."""

    def __init__(self, writer: RunWriter, settings: Settings) -> None:
        self.writer, self.settings = writer, settings
        self.seq = 0
        self.step = -1
        self.counters: dict[str, int] = {}
        self.state: dict[Any, Any] = {}  # adapter scratch: shadow chains, indexer key caches

    @property
    def run_id(self) -> str:
        return self.writer.manifest["run_id"]

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def hidden(
        self,
        layer: int,
        site: str,
        prod: torch.Tensor,
        shadows: dict[str, torch.Tensor],
        tokens: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rows of one site: per token statistics for each shadow mode (or prod only), and
        the site's non-finite events. `prod` and the shadows are [T, N] in `positions` order."""
        seq = self.next_seq()
        shadow_for_events = shadows.get("local", next(iter(shadows.values()), None))
        for kind in stats.nonfinite_events(prod, shadow_for_events):
            kind["token"] = int(positions[kind["token"]])
            row = {"seq": seq, "step": self.step, "layer": layer, "site": site, "path": "prod", **kind}
            self.writer.send("events", row)
        if len(tokens) == 0:
            return
        for mode, shadow in (shadows or {None: None}).items():
            cols = stats.hidden_columns(prod, shadow, tokens)
            cols["token"] = positions[tokens].cpu().numpy().astype(np.int32)
            cols.update(seq=seq, step=self.step, layer=layer, site=site, shadow_mode=mode)
            self.writer.send_columns("hidden", cols, len(tokens))

    def topk(
        self,
        layer: int,
        indexer_layer: int,
        k: int,
        q_pos: torch.Tensor,
        prod_indices: numerics.Lists,
        prod: numerics.Selection | None,
        shadows: dict[str, numerics.Selection],
        unit: str = "token",
        unit_tokens: int = 1,
        visible: torch.Tensor | None = None,
    ) -> None:
        """Rows of one indexer call: the production selection, and one row set per shadow
        input (raw, dequant), or prod alone. A selection over pooled or compressed keys
        names its `unit` (vocabulary `selection_units`), the tokens per key and each query
        token's `visible` keys in that unit (default: tokens, `q_pos + 1`); `k` and the key
        indices count that unit too."""
        band = self.settings.band
        for shadow_input, shadow in (shadows or {None: None}).items():
            cols: dict[str, Any] = {
                "step": self.step, "layer": layer, "token": q_pos.cpu().numpy().astype(np.int32),
                "shadow_input": shadow_input, "indexer_layer": indexer_layer, "k": k,
                "unit": unit, "unit_tokens": unit_tokens,
                "visible": (q_pos + 1 if visible is None else visible).cpu().numpy().astype(np.int32),
                "prod_indices": prod_indices,
            }  # fmt: skip
            if prod is not None:
                cols.update(
                    prod_kth_score=prod.kth_score, prod_kth_margin=prod.kth_margin,
                    prod_boundary_indices=prod.boundary_indices, prod_boundary_scores=prod.boundary_scores,
                )  # fmt: skip
            if shadow is not None:
                cols.update(
                    shadow_indices=shadow.indices, shadow_kth_score=shadow.kth_score,
                    shadow_kth_margin=shadow.kth_margin, shadow_boundary_indices=shadow.boundary_indices,
                    shadow_boundary_scores=shadow.boundary_scores, boundary_band=band,
                )  # fmt: skip
            self.writer.send_columns("topk", cols, len(q_pos))

    def logits(self, prod: torch.Tensor, shadow: torch.Tensor | None, positions: torch.Tensor) -> None:
        cols = stats.logits_columns(prod, shadow, self.settings.top_n)
        cols["token"] = positions.cpu().numpy().astype(np.int32)
        cols["step"] = self.step
        self.writer.send_columns("logits", cols, len(positions))


class Session:
    """Process-wide tracing state: settings, the open runs, and sites disabled by errors."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.salt = _salt()
        self.requests: dict[str, int] = {}
        self.disabled: dict[str, str] = {}
        self.errors = 0
        self.open_runs: list[Run] = []
        self.tracers: dict[str, Any] = {}  # engine name -> adapters.engine.EngineTracer
        self.warned: set[str] = set()
        self.hook_calls: dict[str, int] = {}  # engine -> indexer hook entries
        # Process-wide counts that belong to no run (captures skipped under CUDA-graph
        # capture or torch.compile, failed steps): every run closed afterwards carries the
        # totals so far as `process.<name>`, so that summing runs never double-counts them.
        self.counters: dict[str, int] = {}

    def open_run(
        self,
        *,
        token_ids: list[int],
        model: dict,
        engine: dict,
        device: dict,
        dtypes: dict,
        parallel: dict | None = None,
        request: str | None = None,
        segment: int = 0,
        prompt_length: int | None = None,
    ) -> Run:
        """Opens the run of one request. Its id names the prompt's hash, the request's
        number in this process, the rank and the process, so ranks and processes never
        collide; the `request` tag is the same on every rank of one request. Engines that
        hold no token ids at the hook name the request themselves (`request`); a request
        that continues after its run was closed opens `segment` 1, 2, ... of it."""
        s = self.settings
        parallel = parallel or parallelism()
        digest = token_hash(self.salt, token_ids)
        n = self.requests.get(digest, 0)
        self.requests[digest] = n + 1
        if request is None:
            request = f"{digest[:12]}-{n:03}"
        request = "".join(c if c.isalnum() or c in "._-" else "_" for c in request)
        if (launch := os.environ.get("TORCHELASTIC_RUN_ID", "none")) != "none":
            request = f"{request}-{launch}"
        part = f"-s{segment}" if segment else ""
        run_id = f"{request}{part}-rank{parallel['rank']}-pid{os.getpid()}"
        tags = {**s.tags, "request": request}
        identity = {
            "run_id": run_id,
            "model": model,
            "engine": engine,
            "device": device,
            "dtypes": dtypes,
            "parallelism": parallel,
            "shadow": {"precision": s.precision, "modes": s.modes},
            "prompt": {
                "kind": s.tags.get("prompt_kind"),
                "length": len(token_ids) if prompt_length is None else prompt_length,
                "token_hash": digest if token_ids else "",
                "salt_id": hashlib.sha256(self.salt).hexdigest()[:12],
            },
            "settings": s.recorded(),
            "tags": tags,
            "injections": [],
        }
        writer = RunWriter(
            s.dir / run_id,
            identity,
            queue_mode=s.queue,
            queue_bytes=s.queue_bytes,
            queue_timeout_s=s.queue_timeout_s,
            flush_timeout_s=s.flush_timeout_s,
            tool_version=__version__,
        )
        run = Run(writer, s)
        self.open_runs.append(run)
        return run

    def close_run(
        self, run: Run, *, interrupted: bool = False, at_exit: bool = False, timeout_s: float | None = None
    ) -> None:
        """Closes a run; a writer failure is counted, never raised into the engine. An
        `interrupted` run (its forward raised, the process was stopped half way) stays
        incomplete; a run closed `at_exit` says so."""
        if run in self.open_runs:
            self.open_runs.remove(run)
        run.writer.counters.update({f"process.{k}": v for k, v in self.counters.items()})
        run.writer.counters.update(run.counters)
        if at_exit:
            run.writer.counters["closed_at_exit"] = 1
        if self.disabled:
            run.writer.manifest["settings"]["disabled_sites"] = dict(self.disabled)
        try:
            run.writer.close(interrupted=interrupted, timeout_s=timeout_s)
        except Exception as e:  # the writer already counted it in the manifest
            self.errors += 1
            log.warning("shadowtrace: run %s: %s", run.run_id, e)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def warn_once(self, key: str, message: str) -> None:
        """One line on stderr (through the `shadowtrace` logger) the first time `key` is
        reported in this process, counted as `warnings`."""
        if key not in self.warned:
            self.warned.add(key)
            self.count("warnings")
            log.warning("shadowtrace: %s", message)

    def guarded(
        self,
        key: str,
        run: Run | None,
        fn: Callable[..., Any],
        *args: Any,
        disable: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Calls a capture; an exception is caught, counted in the run (or the process),
        reported once, and (unless `disable` is False: bookkeeping that the next call may
        get right) disables that capture for the rest of the process. Returns None when it
        failed or was disabled."""
        if key in self.disabled:
            return None
        try:
            with torch.no_grad():
                return fn(*args, **kwargs)
        except Exception as e:
            self.errors += 1
            reason = f"{type(e).__name__}: {e}"
            (run or self).count("hook_errors")
            if not disable:
                self.warn_once(
                    f"failed:{key}", f"capture {key} failed (counted, retried next time): {reason}"
                )
                return None
            self.disabled[key] = reason
            (run or self).count("sites_disabled")
            log.warning("shadowtrace: capture %s failed and is disabled: %s", key, reason)
            return None


_session: Session | None = None


def current() -> Session | None:
    """The process's session, or None when tracing is off."""
    return _session


def start(settings: Settings) -> Session:
    global _session
    if _session is None:
        _session = Session(settings)
    return _session


def stop() -> None:
    """Closes every open run within one flush deadline for all of them (at interpreter
    exit, after SIGTERM): a run is closed as it stands, `closed_at_exit`; one whose forward
    was cut short stays incomplete; rows that miss the deadline are counted unflushed."""
    global _session
    if _session is not None:
        sess, _session = _session, None
        deadline = time.monotonic() + sess.settings.flush_timeout_s
        for tracer in sess.tracers.values():
            tracer.close(at_exit=True, deadline=deadline)
        for run in list(sess.open_runs):
            sess.close_run(run, at_exit=True, timeout_s=deadline - time.monotonic())
