"""One process's tracing: settings read once, a run per request, and the guard that keeps
every hook failure away from the traced engine.

Adapters (shadowtrace_hooks.adapters) decide where tensors come from; this module decides
what is recorded and how: which layers, sites and tokens, the run's identity, the rows.
"""

import contextlib
import hashlib
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shadowtrace_hooks import __version__, config, kernels, selection, shadow, stats, transfer
from shadowtrace_hooks.transfer import Packet
from shadowtrace_hooks.writer import ByteBudget, RunWriter

log = logging.getLogger("shadowtrace")

# Guard keys of the captures that open a forward's step (`transformers:step`, `vllm:step`):
# their failure loses the whole step of every open run (`Session._step_open_failed`).
STEP_OPEN_SUFFIX = ":step"

# The counters of a run that lost rows of a forward to a hook's exception before the run's
# first row of that forward: the step could not open, or a later hook failed first
# (`Forward`). Either leaves the run incomplete, its first reason in `settings.rows_lost_reason`.
STEP_OPEN_FAILED = "step_open_failed"
FAILED_BEFORE_ROWS = "forward_failed_before_rows"


def capturing() -> bool:
    """True while a CUDA graph is being captured or torch.compile is tracing: Python hooks
    would run once at capture and never on replay, so they step aside."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


@dataclass
class TokenRows:
    """The rows of one forward's tensor for one request: their absolute positions, and which
    of them get hidden-state rows (SHADOWTRACE_TOKENS), on the host and on the device."""

    positions: np.ndarray  # [T] int32
    index: np.ndarray | None  # rows recorded; None: every row
    device_index: torch.Tensor | None

    @property
    def count(self) -> int:
        return len(self.positions) if self.index is None else len(self.index)

    @property
    def recorded(self) -> np.ndarray:
        return self.positions if self.index is None else self.positions[self.index]


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
        # `modes`: the shadow modes the run records; `layer_modes`: those the decoder layers
        # are re-run in (none with scope indexer, whose one shadow is the local indexer's).
        self.scope: str = values["SHADOWTRACE_SHADOW_SCOPE"]
        modes = values["SHADOWTRACE_MODE"] if self.precision else []
        self.layer_modes: list[str] = modes if self.scope == "layer" else []
        self.modes: list[str] = modes if self.scope == "layer" or not modes else ["local"]
        self.tokens = values["SHADOWTRACE_TOKENS"]
        self.tags: dict[str, str] = values["SHADOWTRACE_TAGS"]
        self.queue: str = values["SHADOWTRACE_QUEUE"]
        self.queue_bytes: int = values["SHADOWTRACE_QUEUE_MB"] << 20
        self.queue_timeout_s: float = values["SHADOWTRACE_QUEUE_TIMEOUT_S"]
        self.flush_timeout_s: float = values["SHADOWTRACE_FLUSH_TIMEOUT_S"]
        self.band: float = values["SHADOWTRACE_BOUNDARY_BAND"]
        self.top_n: int = values["SHADOWTRACE_LOGITS_TOP_N"]
        self.topk_lists: dict[str, Any] = values["SHADOWTRACE_TOPK_LISTS"]
        # Where production takes the local shadow's value: [{"site", "layers": [a, b] | "all"}].
        self.grafts: list[dict[str, Any]] = values["SHADOWTRACE_GRAFT"]

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "Settings":
        return cls(config.resolve(dict(os.environ if environ is None else environ)))

    @property
    def shadow_dtype(self) -> torch.dtype | None:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[self.precision]

    def layer(self, index: int) -> bool:
        return self.layers == "all" or any(a <= index <= b for a, b in self.layers)

    def graft_sites(self, layer: int) -> set[str]:
        """The sites SHADOWTRACE_GRAFT grafts at `layer`."""
        return {
            g["site"]
            for g in self.grafts
            if g["layers"] == "all" or g["layers"][0] <= layer <= g["layers"][1]
        }

    @property
    def graft_spec(self) -> str:
        """SHADOWTRACE_GRAFT written back, as the manifest's `tags.graft` holds it."""
        parts = []
        for g in self.grafts:
            layers = g["layers"]
            at = (
                ""
                if layers == "all"
                else f"@{layers[0]}"
                if layers[0] == layers[1]
                else f"@{layers[0]}-{layers[1]}"
            )
            parts.append(g["site"] + at)
        return ",".join(parts)

    def site(self, name: str) -> bool:
        return self.sites == "all" or name in self.sites

    def token_rows(self, positions: np.ndarray, length: int, device: torch.device) -> TokenRows:
        """The rows of `positions` (a forward's token positions, on the host) whose
        statistics are recorded, for a sequence of `length` tokens so far."""
        kind = self.tokens["kind"]
        positions = np.asarray(positions, dtype=np.int32)
        if kind == "all":
            return TokenRows(positions, None, None)
        keep = (
            positions % self.tokens["n"] == 0 if kind == "every" else positions >= length - self.tokens["n"]
        )
        if keep.all():
            return TokenRows(positions, None, None)
        index = np.flatnonzero(keep)
        return TokenRows(positions, index, torch.as_tensor(index, device=device))

    def topk_sampled(self, positions: np.ndarray) -> np.ndarray | None:
        """Which query rows keep their full production list (SHADOWTRACE_TOPK_LISTS); None
        for none."""
        kind = self.topk_lists["kind"]
        if kind == "none":
            return None
        if kind == "all":
            return np.ones(len(positions), dtype=bool)
        return np.asarray(positions) % self.topk_lists["n"] == 0

    def recorded(self) -> dict[str, Any]:
        """The settings that shape a trace, for the manifest."""
        return {
            "layers": self.values["SHADOWTRACE_LAYERS"],
            "shadow_scope": self.scope,
            "sites": self.values["SHADOWTRACE_SITES"],
            "tokens": self.tokens,
            "boundary_band": self.band,
            "boundary_band_scale": selection.BAND_SCALE,
            "boundary_stored": self.band * selection.STORED,
            "logits_top_n": self.top_n,
            "topk_lists": self.topk_lists,
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


Decode = Callable[[list[np.ndarray]], list[tuple[str, dict, int]]]


class Run:
    """One request's run, each capture numbered in execution order. Captures compute their
    rows on the device into the run's packet; `ship` sends what they added to the writer in
    one copy, which the writer's thread turns into rows."""

    def __init__(self, writer: RunWriter, settings: Settings) -> None:
        self.writer, self.settings = writer, settings
        self.seq = 0
        self.step = -1
        self.counters: dict[str, int] = {}
        # Set when an exit (SIGTERM's SystemExit) landed while the run was being closed: the
        # exit flush closes it once more, interrupted.
        self.cut = False
        self.state: dict[Any, Any] = {}  # adapter scratch: shadow chains, indexer key caches
        self._packet = Packet()
        self._device: torch.device | None = None
        self._decoders: list[Decode] = []
        self._counted: dict[str, int] = {}
        # Rows (of counted tables) registered since the forward in flight began to serve this
        # run (`Forward.serve`): until there is one, a hook's exception is this run's loss.
        self.forward_rows = 0
        self._lost_in: object | None = None  # the Forward whose loss this run counted last
        self.opened = -1  # its number among the session's runs

    @property
    def run_id(self) -> str:
        return self.writer.manifest["run_id"]

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def lose(self, counter: str, reason: str, forward: object | None = None) -> None:
        """This run lost rows to a hook's exception (`reason`) before it held any row of the
        forward: counted once per `forward` (`counter`: STEP_OPEN_FAILED or
        FAILED_BEFORE_ROWS), the first reason kept, and the run closes incomplete."""
        if forward is not None and self._lost_in is forward:
            return
        self._lost_in = forward
        self.count(counter)
        self.writer.lose_rows(f"{counter}: {reason}")

    # --- the packet -------------------------------------------------------------------

    def add(self, tensor: torch.Tensor) -> int:
        """Adds a device tensor to the packet; its index in the arrays decoders receive."""
        self._use(tensor.device)
        return self._packet.add(tensor)

    def _use(self, device: torch.device) -> None:
        """One packet holds one device's tensors: a capture on another ships the packet first."""
        if self._device is not None and device != self._device:
            self.ship()
        self._device = device

    def defer(self, decode: Decode, counted: dict[str, int]) -> None:
        """Registers how the packet's arrays become rows; `counted`: the rows per table it
        makes, known now (tables left out, such as events, are counted when decoded)."""
        self._decoders.append(decode)
        for table, n in counted.items():
            self._counted[table] = self._counted.get(table, 0) + n
            self.forward_rows += n

    def ship(self) -> None:
        """Sends every capture since the last ship in one device-to-host copy."""
        if not self._decoders:
            # Tensors of captures that failed before registering a decoder, and their put-off
            # work: nothing would read them, and the work would hold its inputs for good.
            self._packet.discard()
            self._device = None
            return
        decoders, counted = self._decoders, self._counted
        self._decoders, self._counted, self._device = [], {}, None
        shipment = self._packet.ship()

        def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
            return [batch for d in decoders for batch in d(arrays)]

        self.writer.send_shipment(shipment, decode, counted)

    def replay(self, held: Any, positions: np.ndarray) -> None:
        """Ships a graph replay's rows of this run (`graphs.Held`): the held tensors, which
        the replay rewrote, and their decoders' rows renumbered for this step. The capture
        recorded token indices into the forward's rows, which `positions` (this request's
        positions in the replayed step) turn into positions; its seq numbers, from 0, follow
        the run's own."""
        self.ship()  # what this run holds goes first, in its own shipment
        for name, n in held.counters.items():
            self.count(name, n)
        for key, value in held.settings.items():
            self.writer.set_setting(key, value)
        for counter, reason in held.losses:
            self.lose(counter, reason)
        first, step = self.seq, self.step
        self.seq += held.seqs
        positions = np.asarray(positions, dtype=np.int32)
        decoders = held.decoders

        def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
            out = []
            for d in decoders:
                absolute = getattr(d, "absolute_tokens", False)  # a decoder naming slots itself
                for table, cols, n in d(arrays):
                    cols = dict(cols)
                    if "token" in cols and not absolute:
                        cols["token"] = positions[np.asarray(cols["token"], dtype=np.int64)]
                    if "seq" in cols:
                        seq = cols["seq"]
                        cols["seq"] = seq + first if np.isscalar(seq) else [s + first for s in seq]
                    if "step" in cols:
                        cols["step"] = step
                    out.append((table, cols, n))
            return out

        self.forward_rows += sum(held.counted.values())
        if held.packed is not None:
            shipment = transfer.copy_packed(*held.packed, reused=True)
            self.writer.send_shipment(shipment, decode, dict(held.counted))

    # --- captures -------------------------------------------------------------------

    def hidden(
        self, layer: int, site: str, prod: torch.Tensor, shadows: dict[str, torch.Tensor], rows: TokenRows
    ) -> None:
        """Rows of one site: per token statistics for each shadow mode (or prod only), and
        the site's non-finite events. `prod` and the shadows are [T, N] in `rows` order."""
        seq, step = self.next_seq(), self.step
        work = stats.site_device(prod, shadows, rows.device_index, rows.index)
        shadow.record_kernel(self, "hidden_stats", work.how)
        slots = [self.add(t) for t in work.tensors]
        modes = len(shadows) or 1
        numel = prod.shape[-1]
        where = {"seq": seq, "step": step, "layer": layer, "site": site}

        def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
            events, hidden = work.rows([arrays[slot] for slot in slots])
            out = _events(events, rows.positions, where)
            for mode, statistics in hidden.items():
                cols = stats.hidden_from_host(statistics, numel)
                cols.update(token=rows.recorded, shadow_mode=mode, **where)
                out.append(("hidden", cols, rows.count))
            return out

        self.defer(decode, {"hidden": rows.count * modes})

    def indexer_events(
        self, layer: int, scores: torch.Tensor, q_pos: torch.Tensor, positions: np.ndarray
    ) -> None:
        """Events of production's indexer scores [T, S] (query t sees keys s <= q_pos[t]): a
        NaN or Inf among the visible scores, which the top-k rows alone cannot show."""
        visible = q_pos + 1
        summary = self.add(stats.events_device(scores, stats.counts_device(scores, visible), None, visible))
        where = {"seq": self.next_seq(), "step": self.step, "layer": layer, "site": "indexer"}
        self.defer(lambda arrays: _events(arrays[summary], positions, where), {})

    def topk(
        self,
        layer: int,
        indexer_layer: int,
        k: int,
        positions: np.ndarray,
        q_pos: torch.Tensor,
        prod_topk: torch.Tensor,
        prod_scores: torch.Tensor | None,
        shadows: dict[str, torch.Tensor],
        *,
        unit: str = "token",
        unit_tokens: int = 1,
        visible: np.ndarray | None = None,
        prod_top_values: torch.Tensor | None = None,
        check: str | None = None,
        check_tolerance: float = selection.CHECK_TOLERANCE,
        check_tail: bool = False,
    ) -> None:
        """Rows of one indexer call: production's selection `prod_topk` [T, n] (with its
        recomputed scores when known) against each shadow input's scores [T, keys] (raw,
        dequant), or prod alone. `positions` [T] (host) and `q_pos` [T] (device) are the
        queries' positions. Keys are tokens 0 .. max(positions) by default; a selection over
        pooled or compressed keys names its `unit` (vocabulary `selection_units`), the tokens
        per key, and each query's `visible` keys in that unit [T] (host), which `k`, the
        indices and the scores' columns count too. `prod_top_values` [T, k]: what
        production's top-k returned with `prod_topk`, where `prod_scores` were its input
        (`selection.compare`). `check` says where `prod_scores` came from when they are
        production's own (captured from its top-k call, or recomputed from its operands):
        the capture self-check then runs on them (with `check_tolerance`), and its counts per
        layer go into the manifest (`settings.capture_check`)."""
        rows = len(positions)
        if rows == 0:
            return
        if visible is None:
            visible = np.asarray(positions, dtype=np.int32) + 1
            q_key = q_pos
        else:
            visible = np.asarray(visible, dtype=np.int32)
            q_key = torch.as_tensor(visible - 1, device=q_pos.device)
        widths = {t.shape[-1] for t in (prod_scores, *shadows.values()) if t is not None}
        keys = max(widths) if widths else max(1, int(visible.max()))
        if len(widths) > 1:
            # An indexer over a static cache scores every slot of the cache, the shadow only
            # the keys seen so far: the narrower scores gain the columns no query sees.
            prod_scores = _widened(prod_scores, keys, visible)
            shadows = {name: _widened(scores, keys, visible) for name, scores in shadows.items()}
        sampled = self.settings.topk_sampled(positions)
        on_device = None if sampled is None else torch.as_tensor(sampled, device=q_pos.device)
        self._use(q_pos.device)
        specs = {}
        checked = check is not None and prod_scores is not None
        for i, (shadow_input, scores) in enumerate((shadows or {None: None}).items()):
            band = self.settings.band if (prod_scores is not None or scores is not None) else None
            specs[shadow_input] = selection.compare(
                self._packet, prod_topk, q_key, keys, k, prod_scores=prod_scores, shadow_scores=scores,
                band=band, sampled=on_device, prod_top_values=prod_top_values, check=checked and i == 0,
                check_tolerance=check_tolerance, check_tail=check_tail,
            )  # fmt: skip
        fixed = {"step": self.step, "layer": layer, "token": np.asarray(positions, dtype=np.int32),
                 "indexer_layer": indexer_layer, "unit": unit, "unit_tokens": unit_tokens, "k": k,
                 "visible": visible}  # fmt: skip

        def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
            out = []
            first = next(iter(specs.values()))
            contradicting = selection.check_counts(first, arrays)
            figures = selection.check_figures(first, arrays)
            if contradicting is not None and figures is not None:
                sparse = visible > k
                unchecked = sparse & (contradicting == selection.UNCHECKED)
                bad = sparse & (contradicting > 0)
                short = sparse & selection.short_of_winners(contradicting, figures, k)
                self.writer.capture_check(
                    layer, str(check), check_tolerance, int((sparse & ~unchecked).sum()), int(bad.sum()),
                    int(np.asarray(positions)[bad][0]) if bad.any() else None, unchecked=int(unchecked.sum()),
                    short=_short_figures(figures[:, short], k), short_rule=SHORT_OF_WINNERS_RULE,
                )  # fmt: skip
            for shadow_input, spec in specs.items():
                try:
                    cols = selection.columns(spec, arrays, visible, k, sampled)
                except selection.ListsLost as e:
                    # The writer counts the rows dropped (fewer than counted); this says why,
                    # in the manifest (the first reason) and once in the process's log.
                    self.writer.count("topk_lists_lost_rows", rows)
                    self.writer.set_setting("topk_lists_lost_reason", str(e), keep=True)
                    warn_once("topk_lists_lost", f"run {self.run_id}: top-k rows lost (counted): {e}")
                    continue
                out.append(("topk", {**cols, **fixed, "shadow_input": shadow_input}, rows))
            return out

        self.defer(decode, {"topk": rows * len(specs)})

    def logits(self, prod: torch.Tensor, shadow: torch.Tensor | None, positions: np.ndarray) -> None:
        top_n = self.settings.top_n
        slots = [self.add(t) for t in stats.logits_device(prod, top_n)]
        if shadow is not None:
            slots += [self.add(t) for t in stats.logits_device(shadow, top_n)]
        step = self.step

        def decode(arrays: list[np.ndarray]) -> list[tuple[str, dict, int]]:
            cols: dict[str, Any] = {"token": np.asarray(positions, dtype=np.int32), "step": step}
            cols["prod_top_ids"], cols["prod_top_logprobs"] = stats.logits_lists(
                arrays[slots[0]], arrays[slots[1]]
            )
            if len(slots) > 2:
                cols["shadow_top_ids"], cols["shadow_top_logprobs"] = stats.logits_lists(
                    arrays[slots[2]], arrays[slots[3]]
                )
            return [("logits", cols, len(positions))]

        self.defer(decode, {"logits": len(positions)})


# The rule a disagreeing row of the capture self-check is short of winners by (a top-k kernel
# that drops winners, not a misread; selection.short_of_winners), as settings.capture_check
# records it: the least shares of k a short row keeps.
SHORT_OF_WINNERS_RULE = {"kept_top": selection.SHORT_KEPT_SHARE, "recall": selection.SHORT_RECALL}


def _widened(scores: torch.Tensor | None, keys: int, visible: np.ndarray) -> torch.Tensor | None:
    """`scores` [T, n] with -inf (masked, as the topk table defines them) in columns n .. keys;
    only columns beyond every query's visible keys may be added."""
    if scores is None or scores.shape[-1] == keys:
        return scores
    seen = int(visible.max())
    if scores.shape[-1] < seen:
        raise ValueError(
            f"topk: scores of {scores.shape[-1]} keys beside scores of {keys}, and a query sees {seen}"
        )
    return torch.nn.functional.pad(scores, (0, keys - scores.shape[-1]), value=-math.inf)


class _HeldSettings:
    """A `Recorder`'s stand-in for its writer: the settings a capture sets are kept for the
    real runs; anything else a capture asks of a writer fails (and its guard counts it)."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}
        self.manifest = {"run_id": "graph-capture"}

    def set_setting(self, key: str, value: Any) -> None:
        self.settings[key] = value


class Recorder(Run):
    """Stands in for one request's run while a CUDA graph is captured (`graphs`): captures
    add their device tensors and decoders as to a run, but nothing ships: the tensors are
    the graph's memory, rewritten by each replay, and `held` hands them to the replays.
    Counters, settings and losses are kept for the real run of each replayed step."""

    def __init__(self, settings: Settings) -> None:
        self._held_settings = _HeldSettings()
        super().__init__(self._held_settings, settings)  # type: ignore[arg-type]
        self.step = 0
        self._losses: list[tuple[str, str]] = []

    def ship(self) -> None:
        """Nothing leaves during a capture: the replays ship."""

    def lose(self, counter: str, reason: str, forward: object | None = None) -> None:
        if (counter, reason) not in self._losses:
            self._losses.append((counter, reason))

    def held(self) -> Any:
        from shadowtrace_hooks.graphs import Held  # graphs imports this module

        tensors = list(self._packet.tensors)
        return Held(
            tensors=tensors,
            packed=transfer.pack(tensors) if tensors else None,
            decoders=list(self._decoders),
            counted=dict(self._counted),
            seqs=self.seq,
            counters=dict(self.counters),
            settings=dict(self._held_settings.settings),
            losses=list(self._losses),
        )


def _short_figures(figures: np.ndarray, k: int) -> dict[str, Any]:
    """The capture self-check's short-of-winners rows of one call as the manifest records them
    per layer (`Writer.capture_check`): their count, and the figures that decided them at their
    least telling: the lowest share of production's top-k keys kept whole and of its top-k
    selected, and the worst rank a selected key holds, beyond k."""
    kept_top, hits, worst_rank, _ = figures.astype(np.int64)
    if kept_top.size == 0:
        return {"rows": 0}
    return {
        "rows": int(kept_top.size),
        "kept_top": float(kept_top.min()) / k,
        "recall": float(hits.min()) / k,
        "worst_rank_beyond_k": int(worst_rank.max()) - k,
    }


_warned: set[str] = set()  # keys `warn_once` reported
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """One line through the `shadowtrace` logger the first time `key` is reported in this
    process, from any thread: the writer's thread runs the decoders, and it must not touch
    the session's counters, which the forward's thread iterates."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("shadowtrace: %s", message)


def _events(summary: np.ndarray, positions: np.ndarray, where: dict) -> list[tuple[str, dict, int]]:
    """The events table's batch of one capture's `stats.events_device` summary (none when
    the capture was finite); token is a position."""
    rows = stats.event_rows(summary)
    if not rows:
        return []
    cols = {name: [r[name] for r in rows] for name in ("kind", "channel", "count", "shadow_finite")}
    cols["token"] = [int(positions[r["token"]]) for r in rows]
    return [("events", {**cols, **where, "path": "prod"}, len(rows))]


class Forward:
    """One traced forward, from its entry to its return (issue 42): the runs it serves, and
    the first exception a hook caught in it. An exception before a run's first row of the
    forward is that run's loss (`Run.lose`), whichever hook raised and whichever run its
    guard named: the run then says what it lacks and stays incomplete. Runs served after an
    exception (opened by the same forward) take it too. With no run served, the runs still
    open (a decode step of theirs) or else the process count it, as a step that could not
    open (`Session._step_open_failed`)."""

    def __init__(self, sess: "Session") -> None:
        self.sess = sess
        self.runs: list[Run] = []
        self.first = sess.opened  # runs opened from here on are this forward's, served or not
        # How many runs the forward opens for its requests, once the adapter knows (a
        # prefill): those it could not open are the process's loss.
        self.requests = 0
        self.failure: tuple[str, str] | None = None  # (counter, reason) of the first exception
        self._counted_open = False  # a failure before any run: counted once
        self._counted_missing = 0  # requests without a run, counted by the process

    def serve(self, run: Run) -> None:
        """`run` takes rows of this forward: none so far."""
        if run in self.runs:
            return
        self.runs.append(run)
        run.forward_rows = 0
        if self.failure is not None:
            run.lose(*self.failure, forward=self)

    def mine(self) -> list[Run]:
        """The runs this forward serves, and those it opened whose serving failed."""
        opened = [r for r in self.sess.open_runs if r.opened >= self.first and r not in self.runs]
        return self.runs + opened

    def ended(self) -> None:
        """The forward ends: a run opened after its failure, and never served, takes it too."""
        if self.failure is not None:
            for run in self.mine():
                if run.forward_rows == 0:
                    run.lose(*self.failure, forward=self)

    def failed(self, key: str, reason: str) -> None:
        counter = STEP_OPEN_FAILED if key.endswith(STEP_OPEN_SUFFIX) else FAILED_BEFORE_ROWS
        why = f"{key}: {reason}"
        if self.failure is None:
            self.failure = (counter, why)
        runs = self.mine()
        if not runs and not self.requests:
            if not self._counted_open:
                self._counted_open = True
                self.sess._step_open_failed(counter, why)
            return
        for run in runs:
            if run.forward_rows == 0:
                run.lose(counter, why, forward=self)
        missing = self.requests - len(runs)
        if missing > self._counted_missing:
            self.sess.count(counter, missing - self._counted_missing)
            self._counted_missing = missing


class Session:
    """Process-wide tracing state: settings, the open runs, and sites disabled by errors."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.salt = _salt()
        self.requests: dict[str, int] = {}
        self.disabled: dict[str, str] = {}
        self.errors = 0
        self.open_runs: list[Run] = []
        # Runs closed and handed to their writers, still being written: waited for at exit.
        self.closing: list[RunWriter] = []
        # Bytes queued for writing, bounded over every run of the process.
        self.budget = ByteBudget(settings.queue_bytes)
        self.tracers: dict[str, Any] = {}  # engine name -> adapters.engine.EngineTracer
        self.warned: set[str] = set()
        self.hook_calls: dict[str, int] = {}  # engine -> indexer hook entries
        # Process-wide counts that belong to no run (captures skipped under CUDA-graph
        # capture or torch.compile, failed steps): every run closed afterwards carries the
        # totals so far as `process.<name>`, so that summing runs never double-counts them.
        self.counters: dict[str, int] = {}
        # The traced forward in flight (adapters that call `begin_forward`), innermost last.
        self.forwards: list[Forward] = []
        self.opened = 0  # runs opened so far, each numbered (`Run.opened`)

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
        grafts: str | None = "not implemented by this adapter",
    ) -> Run:
        """Opens the run of one request. Its id names the prompt's hash, the request's
        number in this process, the rank and the process, so ranks and processes never
        collide; the `request` tag is the same on every rank of one request. Engines that
        hold no token ids at the hook name the request themselves (`request`); a request
        that continues after its run was closed opens `segment` 1, 2, ... of it.

        With SHADOWTRACE_GRAFT set, `grafts` is None where the adapter grafts (the run is
        tagged `graft`), else why it does not: the run counts `graft_refused`, the process
        says why in one line, and production runs ungrafted."""
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
        if s.grafts and grafts is None:
            tags["graft"] = s.graft_spec
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
            budget=self.budget,
        )
        try:
            run = Run(writer, s)
            run.opened, self.opened = self.opened, self.opened + 1
            if s.grafts and grafts is not None:
                run.count("graft_refused")
                name = engine.get("name")
                self.warn_once(
                    f"graft_refused:{name}",
                    f"SHADOWTRACE_GRAFT={s.graft_spec}: {name}: {grafts}; production runs ungrafted",
                )
            self.open_runs.append(run)
        except BaseException as e:
            # The run's directory holds a manifest: it says why it holds nothing (the caller's
            # guard counts the failure), and its writer is closed, never left open unseen.
            with contextlib.suppress(Exception):
                writer.count(STEP_OPEN_FAILED)
                writer.lose_rows(f"{STEP_OPEN_FAILED}: the run could not open: {type(e).__name__}: {e}")
                writer.close(wait=False)
            raise
        return run

    def close_run(
        self, run: Run, *, interrupted: bool = False, at_exit: bool = False, timeout_s: float | None = None
    ) -> None:
        """Closes a run: hands what it captured to its writer and returns, the writer's
        thread finishing the files (at exit, waits at most `timeout_s` for it). A writer
        failure is counted, never raised into the engine. An `interrupted` run (its forward
        raised, the process was stopped half way) stays incomplete; a run closed `at_exit`
        says so.

        The run stays in `open_runs` until its writer holds it: an exit that lands half way
        (a serving engine's SIGTERM handler raises SystemExit between any two bytecodes)
        leaves it to the exit flush, which closes it `interrupted`, never unreachable."""
        try:
            self._close_run(run, interrupted=interrupted, at_exit=at_exit, timeout_s=timeout_s)
        except BaseException:
            run.cut = True
            raise
        if run in self.open_runs:
            self.open_runs.remove(run)
        if not at_exit:
            self.closing.append(run.writer)

    def _close_run(self, run: Run, *, interrupted: bool, at_exit: bool, timeout_s: float | None) -> None:
        try:
            run.ship()
        except Exception as e:
            run.count("hook_errors")
            self.warn_once(f"ship:{type(e).__name__}", f"rows of a capture could not be sent: {e}")
        run.writer.set_counters({f"process.{k}": v for k, v in self.counters.items()})
        # a Triton kernel that raised in this process: torch's ops ran instead from then on
        run.writer.set_counters({f"process.kernel_failed.{name}": 1 for name in kernels.failed})
        run.writer.set_counters(run.counters)
        if at_exit:
            run.writer.set_counters({"closed_at_exit": 1})
        if self.disabled:
            run.writer.set_setting("disabled_sites", dict(self.disabled))
        # A dead writer stays: the exit flush writes its manifest once more, off the forward's path.
        self.closing = [w for w in self.closing if not w.finished or w.died]
        try:
            run.writer.close(interrupted=interrupted or run.cut, wait=at_exit, timeout_s=timeout_s)
        except Exception as e:  # the writer already counted it in the manifest
            self.errors += 1
            log.warning("shadowtrace: run %s: %s", run.run_id, e)

    def wait_closed(self, deadline: float) -> None:
        """Waits until every closed run is written, or the monotonic `deadline`: what is not
        written by then stays counted (`unflushed_rows`) in a run left incomplete."""
        closing, self.closing = self.closing, []
        for writer in closing:
            try:
                writer.wait_closed(deadline - time.monotonic())
            except Exception as e:  # counted in its manifest
                self.errors += 1
                log.warning("shadowtrace: run %s: %s", writer.manifest["run_id"], e)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def begin_forward(self) -> Forward:
        """A traced forward begins: until it ends, an exception any guard catches is the
        loss of the runs it serves that hold no row of it yet (`Forward`)."""
        forward = Forward(self)
        self.forwards.append(forward)
        return forward

    def end_forward(self, forward: Forward) -> None:
        if forward in self.forwards:
            forward.ended()
            self.forwards.remove(forward)

    def _step_open_failed(
        self, counter: str = STEP_OPEN_FAILED, reason: str = "the step could not open"
    ) -> None:
        """A forward's step could not open (`<engine>:step` raised, or a hook before any run
        of the forward was served): the captures of that forward do not run, so every run
        open now (the runs of the forward's requests, opened by the step or earlier) misses
        its rows. Each counts it (`counter`) and stays incomplete: a run that would otherwise
        read complete with none of the step's rows says what it lacks. With no run open, the
        forward's request has no manifest, and the process counts it (`process.<counter>` in
        every run closed afterwards)."""
        if self.open_runs:
            for run in self.open_runs:
                run.lose(counter, reason)
        else:
            self.count(counter)

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
            self.caught(key, run, e, disable=disable)
            return None

    def caught(self, key: str, run: Run | None, error: Exception, *, disable: bool) -> None:
        """A capture's exception (`guarded`'s, or one an adapter caught around its guards):
        counted in the run (or the process), the loss of the forward in flight's runs that
        hold no row of it yet (`Forward`), reported once, and with `disable` the capture
        switched off for the rest of the process."""
        self.errors += 1
        reason = f"{type(error).__name__}: {error}"
        (run or self).count("hook_errors")
        if self.forwards:
            self.forwards[-1].failed(key, reason)
        elif run is None and key.endswith(STEP_OPEN_SUFFIX):
            self._step_open_failed(STEP_OPEN_FAILED, f"{key}: {reason}")
        if not disable:
            self.warn_once(f"failed:{key}", f"capture {key} failed (counted, retried next time): {reason}")
            return
        self.disabled[key] = reason
        (run or self).count("sites_disabled")
        log.warning("shadowtrace: capture %s failed and is disabled: %s", key, reason)


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
        sess.wait_closed(deadline)
