"""Tracing a decode step captured into a CUDA graph (issue 41), on the CPU through a capture/
replay stand-in; tests/gpu/cuda_graphs.py runs the same on a real `torch.cuda.CUDAGraph`.

The stand-in keeps the two facts a real graph imposes on the hooks: they run once, at the
capture, and every replay rewrites, in place, the tensors the capture computed (their packed
copy included). Its replay therefore runs the forward again with the hooks capturing into a
scratch graph (the device's work) and copies what they computed into the tensors the real
capture holds; the rows must come from that held memory alone. The oracle is the same step
run eagerly and traced, a path the graph code does not touch: transformers' own Llama, its
own StaticCache.
"""

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import binary

PROMPT = [5, 17, 42, 7, 99, 3]
DECODED = [11, 64, 23]  # one token per decode step
MAX_CACHE = 16


class StandInGraph:
    """`torch.cuda.CUDAGraph`'s capture and replay on the CPU (see the module docstring)."""

    def capture(self, fn) -> None:
        from shadowtrace_hooks import graphs

        self.fn = fn
        with graphs.capturing_into(self):
            self.out = fn()

    def replay(self) -> None:
        from shadowtrace_hooks import graphs

        held = graphs.before_replay(self)  # the host opens the step, as before a launch
        scratch = _Scratch()
        with graphs.capturing_into(scratch):
            out = self.fn()  # the device's work ...
        for capture, again in zip(graphs.captures(self), graphs.captures(scratch), strict=True):
            for mine, theirs in zip(capture.held, again.held, strict=True):
                for tensor, value in zip(mine.tensors, theirs.tensors, strict=True):
                    tensor.copy_(value)  # ... rewrites the capture's memory in place,
                if mine.packed is not None:  # the packing copy included
                    mine.packed[0].copy_(theirs.packed[0])
        self.out.logits.copy_(out.logits)
        graphs.after_replay(held)


class _Scratch:
    pass


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def cache_arg(model: torch.nn.Module) -> str:
    """The cache argument's name in this transformers release (5.24 renamed past_key_values
    to cache, and 5.25 warns on the old name)."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def forward(model: torch.nn.Module, ids: torch.Tensor, cache, position: torch.Tensor | None = None):
    """One forward over the cache, `position` its cache_position (None: not given)."""
    given = {} if position is None else {"cache_position": position}
    return model(ids, **{cache_arg(model): cache}, **given, use_cache=True)


def cache_for(model: torch.nn.Module):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=MAX_CACHE)


def prefill(model: torch.nn.Module, cache) -> None:
    ids = torch.tensor([PROMPT])
    forward(model, ids, cache, torch.arange(len(PROMPT)))


def eager_decode(model: torch.nn.Module, poison: list[float] | None = None) -> list[torch.Tensor]:
    cache = cache_for(model)
    prefill(model, cache)
    logits = []
    for i, token in enumerate(DECODED):
        if poison is not None:
            model.poison.fill_(poison[i])
        position = torch.tensor([len(PROMPT) + i])
        out = forward(model, torch.tensor([[token]]), cache, position)
        logits.append(out.logits.clone())
    return logits


def captured(model: torch.nn.Module, cache) -> tuple[StandInGraph, torch.Tensor, torch.Tensor]:
    """A decode step over `cache` captured: the graph, and its static ids and position."""
    ids, position = torch.tensor([[DECODED[0]]]), torch.tensor([len(PROMPT)])
    state = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in state]
    graph = StandInGraph()
    graph.capture(lambda: forward(model, ids, cache, position))
    # A real capture writes nothing; the stand-in's did (the CPU ran it): the cache as it was
    # (keys, values and the length it counts).
    for t, saved in zip(state, before, strict=True):
        t.copy_(saved)
    return graph, ids, position


def replay_steps(graph: StandInGraph, ids: torch.Tensor, position: torch.Tensor, steps: range) -> None:
    """The captured decode step replayed for each step i of `steps`: DECODED[i] at its position."""
    for i in steps:
        ids.fill_(DECODED[i])
        position.fill_(len(PROMPT) + i)
        graph.replay()


def graph_decode(model: torch.nn.Module, poison: list[float] | None = None) -> list[torch.Tensor]:
    cache = cache_for(model)
    prefill(model, cache)
    graph, ids, position = captured(model, cache)
    logits = []
    for i, token in enumerate(DECODED):
        if poison is not None:
            model.poison.fill_(poison[i])
        ids.fill_(token)
        position.fill_(len(PROMPT) + i)
        graph.replay()
        logits.append(graph.out.logits.clone())
    return logits


def tables(runs: Path) -> list[dict]:
    """Each run, by its order: manifest, and its rows per table sorted for comparison. Read
    after the session stopped: a graph's replays leave their runs open until then."""
    out = []
    for manifest_path in sorted(runs.glob("*/manifest.json")):
        manifest = json.loads(manifest_path.read_text())
        rows = {}
        for table in ("hidden", "logits", "events"):
            files = sorted((manifest_path.parent / table).glob("*.parquet"))
            data = [pq.read_table(f).to_pylist() for f in files]
            rows[table] = sorted(
                (r for part in data for r in part),
                key=lambda r: (r.get("seq", 0), r.get("token", 0), r.get("layer", 0), str(r.get("site"))),
            )
        out.append((manifest, rows))
    return sorted(out, key=lambda mr: mr[0]["started_unix_ms"])


# What names a row's place in its run, not its content: a run per eager decode call, one for
# all of a graph's replays.
RUN_PLACE = ("run_id", "seq", "step")


def merged(runs: list, table: str) -> list[dict]:
    """`table`'s rows of `runs`, as production computed them: without their place in a run."""
    rows = [{k: v for k, v in r.items() if k not in RUN_PLACE} for _, tables in runs for r in tables[table]]
    return sorted(rows, key=lambda r: (r.get("token", 0), r.get("layer", 0), str(r.get("site")), str(r)))


def eager_and_graph(tmp_path: Path) -> dict[str, tuple[list[torch.Tensor], list]]:
    """The same decode steps traced eagerly and replayed from a graph: each one's logits and
    runs, by name."""
    from shadowtrace_hooks import session, startup

    model = llama()
    results = {}
    for name, decode in (("eager", eager_decode), ("graph", graph_decode)):
        runs = tmp_path / name
        assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs)}) is not None
        try:
            with torch.no_grad():
                logits = decode(model)
        finally:
            session.stop()
        results[name] = (logits, tables(runs))
    return results


def test_a_replayed_graph_step_writes_the_rows_the_same_step_writes_eagerly(tmp_path: Path) -> None:
    results = eager_and_graph(tmp_path)
    (eager_logits, eager_runs), (graph_logits, graph_runs) = results["eager"], results["graph"]
    for a, b in zip(eager_logits, graph_logits, strict=True):
        assert torch.equal(a, b)
    # The prefill is a request of its own either way. Each eager decode call is one (a bare
    # forward); a graph's replays are one in all: each continues the runs the last left open.
    assert len(eager_runs) == 1 + len(DECODED)
    assert len(graph_runs) == 2
    assert eager_runs[0][0]["prompt"] == graph_runs[0][0]["prompt"]
    (graph_manifest, graph_rows) = graph_runs[1]
    assert graph_manifest["prompt"] == eager_runs[1][0]["prompt"]  # the prompt, then the first token
    assert graph_rows["hidden"][-1]["step"] == len(DECODED) - 1
    for manifest, _ in eager_runs + graph_runs:
        assert manifest["status"] == "complete", manifest["counters"]
        assert manifest["counters"].get("hook_errors", 0) == 0
        assert manifest["settings"].get("disabled_sites") is None
    # Nothing of a Llama decode step is beyond a graph: the KV sentinel included. The graph's
    # run is closed by the session's stop, as it stands.
    assert not [c for c in graph_manifest["counters"] if c.startswith("graph_skipped")]
    assert graph_manifest["counters"].get("closed_at_exit") == 1
    # Its steps after the first are decode steps of a request, as in `generate`: no layer
    # shadow, counted. Each eager decode call is a prefix-cache hit instead.
    assert graph_manifest["counters"]["shadow_skipped_decode_steps"] == len(DECODED) - 1
    decoded = {c for m, _ in eager_runs[1:] for c in m["counters"]} | {"shadow_skipped_decode_steps"}
    assert set(graph_manifest["counters"]) - {"closed_at_exit"} == decoded - {"closed_at_exit"}
    for table in ("hidden", "logits", "events"):
        assert merged(graph_runs, table) == merged(eager_runs, table), table
    assert len(merged(graph_runs, "hidden")) > 0
    # Two sentinel checks per layer and step, passed, with the same slots named.
    events = merged(graph_runs[1:], "events")
    assert len(events) == 2 * 3 * len(DECODED)
    assert all(r["kind"] == "sentinel" and r["passed"] for r in events)


def test_a_replay_given_position_ids_counts_the_cache_before_its_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given position_ids, a replay's step learns what the cache held by counting it, which
    the replay's own work then grows by one: counted after the launch, each step would look
    like a new request on a cache one token longer, and close the runs."""

    def with_position_ids(model, ids, cache, position=None):
        given = {} if position is None else {"cache_position": position, "position_ids": position[None, :]}
        return model(ids, **{cache_arg(model): cache}, **given, use_cache=True)

    monkeypatch.setitem(globals(), "forward", with_position_ids)
    (_, eager_runs), (_, graph_runs) = eager_and_graph(tmp_path).values()
    assert len(graph_runs) == 2  # the prefill, then one request for every replay
    assert graph_runs[1][1]["hidden"][-1]["step"] == len(DECODED) - 1
    for table in ("hidden", "logits", "events"):
        assert merged(graph_runs, table) == merged(eager_runs, table), table


def test_a_graphs_replays_are_one_request_until_another_forward_runs_on_the_model(traced: Path) -> None:
    """The replays continue one run per request; an eager forward closes it (complete, not at
    exit) and is a request of its own; a replay after it opens a new run, which the session's
    stop closes as it stands."""
    from shadowtrace_hooks import session

    model = llama()
    cache = cache_for(model)
    with torch.no_grad():
        prefill(model, cache)
        graph, ids, position = captured(model, cache)
        replay_steps(graph, ids, position, range(2))
        forward(model, torch.tensor([[DECODED[2]]]), cache, torch.tensor([len(PROMPT) + 2]))
        ids.fill_(7)
        position.fill_(len(PROMPT) + 3)
        graph.replay()
    session.stop()
    runs = tables(traced)
    steps = [sorted({r["step"] for r in rows["hidden"]}) for _, rows in runs]
    assert steps == [[0], [0, 1], [0], [0]]  # prefill, two replays, the eager call, one replay
    tokens = [sorted({r["token"] for r in rows["hidden"]}) for _, rows in runs]
    p = len(PROMPT)
    assert tokens == [list(range(p)), [p, p + 1], [p + 2], [p + 3]]
    at_exit = [m["counters"].get("closed_at_exit", 0) for m, _ in runs]
    assert at_exit == [0, 0, 0, 1]
    # Each later request knows the ids the cache holds: the graph's request left them at its close.
    assert [m["settings"].get("cached_prefix_tokens") for m, _ in runs] == [None, p, p + 2, p + 3]
    assert not [m for m, _ in runs if "cache_hit_prefix_ids_unknown" in m["counters"]]
    assert all(m["status"] == "complete" for m, _ in runs)


def test_a_replay_of_another_graph_closes_the_request_leaving_the_ids_its_cache_held(traced: Path) -> None:
    """Two graphs of one cache: the second's replay closes the first's request after its own
    launch (its step opens while the device runs it), when the cache already holds its token.
    The closed request leaves the ids the cache held before, so the new one knows its prefix."""
    from shadowtrace_hooks import session

    model = llama()
    cache = cache_for(model)
    with torch.no_grad():
        prefill(model, cache)
        replay_steps(*captured(model, cache), range(2))
        replay_steps(*captured(model, cache), range(2, 3))
    session.stop()
    runs = tables(traced)
    p = len(PROMPT)
    tokens = [sorted({r["token"] for r in rows["hidden"]}) for _, rows in runs]
    assert tokens == [list(range(p)), [p, p + 1], [p + 2]]
    assert [m["settings"].get("cached_prefix_tokens") for m, _ in runs] == [None, p, p + 2]
    assert not [m for m, _ in runs if "cache_hit_prefix_ids_unknown" in m["counters"]]


def test_a_nan_planted_in_one_replay_is_recorded_at_that_replays_token_and_layer(traced: Path) -> None:
    """The NaN enters at layer 1's MLP in the second replay only (a static factor the graph
    reads: 1, NaN, 1). That step's rows say so from layer 1 on; the KV sentinel sees layer 2
    write it into slot 7; the third step, which reads slot 7, turns non-finite from layer 2's
    attention on. Each fact at the replay's own position, as an eager run records it."""
    model = llama()
    model.poison = torch.ones(())
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * model.poison)
    from shadowtrace_hooks import session

    with torch.no_grad():
        logits = graph_decode(model, poison=[1.0, float("nan"), 1.0])
    assert torch.isnan(logits[1]).all()
    assert not torch.isnan(logits[0]).any()
    session.stop()
    runs = tables(traced)
    assert len(runs) == 2  # the prefill's, and the replays' one
    poisoned = len(PROMPT) + 1
    events = [r for _, rows in runs for r in rows["events"]]
    onsets = {}
    for r in events:
        if r["kind"] != "sentinel":
            onsets.setdefault(r["token"], []).append((r["seq"], r["layer"], r["site"]))
    assert sorted(onsets) == [poisoned, poisoned + 1]
    assert min(onsets[poisoned])[1:] == (1, "mlp_out")  # the first capture holding a NaN
    assert min(onsets[poisoned + 1])[1:] == (2, "attn_out")
    sentinels = [r for r in events if r["kind"] == "sentinel"]
    failed = [(r["layer"], r["check"], r["token"]) for r in sentinels if not r["passed"]]
    # Layer 2's keys at slot 7 in its own step, then again when the next step wrote slot 8.
    assert (2, "kv_new_slots_finite", poisoned) in failed
    assert all(layer == 2 and check == "kv_new_slots_finite" for layer, check, _ in failed)
    hidden = [r for _, rows in runs for r in rows["hidden"] if r["prod_nan"]]
    assert {r["token"] for r in hidden} == {poisoned, poisoned + 1}
    assert min(r["layer"] for r in hidden if r["token"] == poisoned) == 1

    # The analyzer follows it across the replays, one request's steps: made at layer 1's MLP
    # in the second replay (the run's step 1); read by the third replay's token from layer 2's
    # attention on, where the poisoned token's key was computed from a non-finite input.
    manifests = traced.glob("*/manifest.json")
    (decode_run,) = [p.parent for p in manifests if "cached_prefix_tokens" in p.read_text()]
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", str(decode_run), "--format", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    provenance = json.loads(out.stdout)["runs"][0]["nan_provenance"]
    produced = provenance["produced"]
    assert (produced["step"], produced["layer"], produced["site"]) == (1, 1, "mlp_out")
    assert (produced["tokens"], produced["inputs_not_known"]) == ([poisoned], None)
    spread = {(s["step"], s["layer"], s["site"]): s for s in provenance["spread"] if s["explained"]}
    assert spread[(2, 2, "attn_out")]["explained"] == [poisoned + 1]
    assert min(key for key in spread if key[0] == 2) == (2, 2, "attn_out")
    assert not [s for s in provenance["spread"] if s["unexplained"] or s["not_known"]], provenance


def test_a_capture_without_static_positions_is_counted_and_said_not_traced_silently(
    traced: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from shadowtrace_hooks import graphs, session

    model = llama()
    cache = cache_for(model)
    with torch.no_grad():
        prefill(model, cache)
        graph = StandInGraph()
        graph.capture(lambda: forward(model, torch.tensor([[3]]), cache))
    assert graphs.captures(graph) == []
    sess = session.current()
    assert sess.errors >= 1
    assert any("position_ids or cache_position" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        graph.replay()
    assert sess.counters["graph_replays_untraced"] == 1  # each replay of it, counted


def test_rows_name_the_replayed_positions_not_the_captured_ones() -> None:
    """Run.replay's renumbering, on rows whose answer is known by construction."""
    from shadowtrace_hooks import graphs, session, transfer

    sent = []

    class Writer:
        def __init__(self) -> None:
            self.manifest = {"run_id": "r"}

        def send_shipment(self, shipment, decode, counted) -> None:
            sent.append((decode(shipment.arrays()), counted))

        def set_setting(self, key, value) -> None:
            pass

        def lose_rows(self, reason) -> None:
            pass

    settings = session.Settings.from_environ({"SHADOWTRACE": "1"})
    recorder = session.Recorder(settings)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    slot = recorder.add(t)
    seq = recorder.next_seq()

    def decode(arrays: list[np.ndarray]) -> list:
        return [("hidden", {"token": np.array([0, 1]), "seq": seq, "step": 0, "v": arrays[slot][:, 0]}, 2)]

    recorder.defer(decode, {"hidden": 2})
    held = recorder.held()
    run = session.Run(Writer(), settings)
    run.seq, run.step = 7, 3
    t.add_(100)  # the replay rewrote the held memory, and its packing copy reran
    held.packed[0].copy_(transfer.pack([t])[0])
    run.replay(held, np.array([40, 41]))
    ((table, cols, n),), counted = sent[0]
    assert (table, n, counted) == ("hidden", 2, {"hidden": 2})
    assert cols["token"].tolist() == [40, 41]
    assert (cols["seq"], cols["step"]) == (7, 3)
    assert cols["v"].tolist() == [100.0, 103.0]
    assert run.seq == 8
    assert isinstance(held, graphs.Held)


def test_a_graph_captured_in_an_earlier_session_replays_untraced_and_counted(tmp_path: Path) -> None:
    """Its recorders belong to a stopped session: the replays write nothing there or here,
    and the session in flight counts each one."""
    from shadowtrace_hooks import session, startup

    model = llama()
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path / "first")}) is not None
    try:
        with torch.no_grad():
            cache = cache_for(model)
            prefill(model, cache)
            ids, position = torch.tensor([[DECODED[0]]]), torch.tensor([len(PROMPT)])
            graph = StandInGraph()
            graph.capture(lambda: forward(model, ids, cache, position))
    finally:
        session.stop()
    first = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path / "second")}) is not None
    try:
        with torch.no_grad():
            graph.replay()
            graph.replay()
        assert session.current().counters["graph_replays_untraced"] == 2
    finally:
        session.stop()
    assert sorted(p.name for p in (tmp_path / "first").iterdir()) == first
    assert not (tmp_path / "second").exists()


def test_the_methods_graphs_wraps_are_the_ones_torchs_graph_context_calls() -> None:
    """graphs.install wraps torch.cuda.CUDAGraph's capture_begin, capture_end and replay; read
    from this torch's own source, torch.cuda.graph (which make_graphed_callables uses too)
    calls exactly those on its graph. A release that renamed them would leave every capture
    untraced, and this test names it."""
    import inspect

    from shadowtrace_hooks import graphs

    enter = inspect.getsource(torch.cuda.graphs.graph.__enter__)
    leave = inspect.getsource(torch.cuda.graphs.graph.__exit__)
    assert "self.cuda_graph.capture_begin(" in enter
    assert "self.cuda_graph.capture_end()" in leave
    assert "torch.cuda.graph(" in inspect.getsource(torch.cuda.graphs.make_graphed_callables)
    graph_class = torch.cuda.CUDAGraph
    for name in ("capture_begin", "capture_end", "replay"):
        assert name in vars(graph_class), f"torch.cuda.CUDAGraph.{name} is not a Python method here"
    graphs.install()
    graphs.install()  # once: a second call wraps nothing again
    assert graph_class.replay.__name__ == "traced_replay"
    assert graph_class.capture_begin.__name__ == "capture_begin"
