"""Tracing inside CUDA graphs (issue 41): the captures a graph's capture enqueued, shipped
after every replay.

Python hooks run once, while a graph is captured; a replay reruns only the device work they
enqueued. So while a `torch.cuda.CUDAGraph` captures a traced forward, each request's
captures go to a `Recorder`, which stands in for its run: their statistics are computed on
the device as in eager mode, into tensors of the graph's own memory, which every replay
rewrites in place. What the host needs per step (the run, its step, the tokens' positions)
it reads from the graph's static inputs before each replay, as an eager forward reads its
inputs (`Capture`). After the replay, the held tensors are shipped for the real runs with
their rows renumbered: the recorded token indices become the replay's positions, and seq
and step the run's own (`Run.replay`).

Captures that need the host inside the forward (the indexer's top-k lists, whose sizes the
device decides; a prefix-cache hit's free shadow chain) cannot run in a graph. The adapter
leaves them out of the capture, and each replayed step counts them per kind
(`graph_skipped_<kind>`) in its runs, with one printed line per kind. The KV sentinel reads
its slots at the step's positions on the device, inside the graph.

`torch.cuda.CUDAGraph` is patched once (`install`): `capture_begin`/`capture_end` say which
graph is being captured, `replay` hands its captures to the adapter before and after the
replay's work is launched. A capture outside this class (torch.compile's cudagraph trees)
is not followed: the hooks step aside there and count it (`captures_skipped_cuda_graph`).
"""

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from shadowtrace_hooks import session

# Decoders as session.Run keeps them: the packet's arrays -> (table, columns, rows) batches.
Decode = Callable[[list[np.ndarray]], list[tuple[str, dict, int]]]


@dataclass
class Held:
    """One request's captures in a captured forward: the device tensors they made, in packet
    order, how those become rows, and what the capture counted or set on its run."""

    tensors: list[torch.Tensor]
    # The tensors packed into one buffer by a copy the graph holds too: a replay ships it in
    # one device-to-host copy (transfer.pack; None when the captures made no tensor).
    packed: tuple[torch.Tensor, list] | None
    decoders: list[Decode]
    counted: dict[str, int]
    seqs: int  # seq numbers the captures took, from 0
    counters: dict[str, int]
    settings: dict[str, Any]
    losses: list[tuple[str, str]]


@dataclass
class Capture:
    """A traced forward captured into a graph: the tracer that replays it, the static inputs
    it was called with (read again before each replay) and its static output, the captures
    of each batch row, and the kinds of capture left out because a graph cannot hold them."""

    replay: "Replayer"
    args: tuple
    kwargs: dict
    held: list[Held]
    skipped: list[str] = field(default_factory=list)
    out: Any = None
    # The adapter's reading of the static inputs, made once at the capture: a replay reads the
    # same tensors, so it binds no arguments again (the values are read at each replay).
    given: dict[str, Any] = field(default_factory=dict)


class Replayer(Protocol):
    """What an adapter gives a graph's replays: called before the replay's work is launched
    (the step opens, reading the static inputs) and after it (the held rows ship)."""

    def before_replay(self, capture: Capture) -> None: ...

    def after_replay(self, capture: Capture) -> None: ...


_state = threading.local()
# graph -> its traced forwards, in capture order; dropped with the graph.
_captures: "weakref.WeakKeyDictionary[Any, list[Capture]]" = weakref.WeakKeyDictionary()


def current() -> Any:
    """The graph this thread is capturing through `torch.cuda.CUDAGraph` (or a stand-in
    `capturing_into`), or None."""
    return getattr(_state, "graph", None)


def keep(capture: Capture) -> None:
    """Attaches a traced forward to the graph being captured: its replays ship it."""
    graph = current()
    if graph is None:
        raise RuntimeError("graphs.keep: no graph is being captured on this thread")
    _captures.setdefault(graph, []).append(capture)


def captures(graph: Any) -> list[Capture]:
    return list(_captures.get(graph, []))


@contextlib.contextmanager
def capturing_into(graph: Any) -> Iterator[Any]:
    """Marks `graph` as the one this thread captures (what the patched `capture_begin` does).
    The CPU tests' capture/replay stand-in uses it directly."""
    outer = current()
    _state.graph = graph
    _captures[graph] = []  # a graph captured again holds only its new capture
    try:
        yield graph
    finally:
        _state.graph = outer


def before_replay(graph: Any) -> list[Capture]:
    """Each traced forward of `graph` opens its step (never raises: the adapter guards). A
    graph replayed while tracing is on, whose capture traced nothing (captured before the
    session started, or its model untraced), is counted: `graph_replays_untraced`."""
    held = captures(graph)
    sess = session.current()
    if not held and sess is not None:
        sess.count("graph_replays_untraced")
    for capture in held:
        capture.replay.before_replay(capture)
    return held


def after_replay(held: list[Capture]) -> None:
    for capture in held:
        capture.replay.after_replay(capture)


def _caught(error: Exception) -> None:
    sess = session.current()
    if sess is not None:
        sess.caught("graphs:replay", None, error, disable=False)


_installed = False


def install() -> None:
    """Patches `torch.cuda.CUDAGraph` once: capture_begin/capture_end mark the graph being
    captured, replay ships its traced forwards. Each wrapper calls torch's own method first
    or last exactly as before; a failure of ours never reaches the caller."""
    global _installed
    if _installed or not hasattr(torch.cuda, "CUDAGraph"):
        return
    graph_class = torch.cuda.CUDAGraph
    begin, end, replay = graph_class.capture_begin, graph_class.capture_end, graph_class.replay

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
        begin(self, *args, **kwargs)
        _captures[self] = []
        _state.graph = self

    def capture_end(self: Any) -> None:
        _state.graph = None
        end(self)

    def traced_replay(self: Any) -> None:
        try:
            held = before_replay(self)
        except Exception as e:  # the adapter's guards count their own; this is the net
            held = []
            _caught(e)
        replay(self)
        try:
            after_replay(held)
        except Exception as e:
            _caught(e)

    graph_class.capture_begin = capture_begin
    graph_class.capture_end = capture_end
    graph_class.replay = traced_replay
    _installed = True
