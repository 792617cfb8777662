"""Tracing inside a real `torch.cuda.CUDAGraph` (issue 41, item 2), on the GPU machine.

transformers' Llama (random weights, bf16, sdpa attention) with its StaticCache; a decode
step captured into a CUDA graph and replayed, traced with SHADOWTRACE=1 in this process.
It checks, and prints:
1. the rows of replayed steps against the same steps run eagerly and traced (hidden-state
   statistics, logits top-N, the KV sentinel's events): equal, row for row;
2. production's logits bit-identical: replayed traced, replayed untraced and eager;
3. a NaN planted in one replay (a static factor the graph reads) recorded at that replay's
   position and layer, and the KV slot it poisoned named by the sentinel;
4. the overhead of a traced replayed decode step against an untraced replayed one (the
   baseline: the same captured graph, untraced; each step samples its token on the host),
   and, for reference, eager traced against eager untraced;
5. whether the trained GLM-5 checkpoint's decode step (models/glm5-tiny: MLA, the DSA indexer,
   MoE) can be captured at all, and what the trace holds if it can.
Exits 1 when a check fails. Usage (the hooks installed, from the repository root):
`python tests/gpu/cuda_graphs.py OUT_DIR [--steps N]`.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

failed: list[str] = []
PROMPT_LEN = 64


def check(ok: bool, what: str) -> None:
    print(("ok      " if ok else "FAILED  ") + what, flush=True)
    if not ok:
        failed.append(what)


def llama(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 256,
        max_position_embeddings=4096,
    )  # fmt: skip
    # sdpa: transformers 5.17's eager mask copies a host scalar to the device (torch.tensor(0.0,
    # device=...) in masking_utils.eager_mask), which a graph capture refuses.
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


class Decoder:
    """A prompt prefilled into a StaticCache, then decode steps: eager, or a captured graph
    replayed with the static inputs rewritten each step."""

    def __init__(self, model: torch.nn.Module, steps: int, poison: list[float] | None = None) -> None:
        from transformers import StaticCache

        self.model, self.steps, self.poison = model, steps, poison
        self.cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + steps + 8)
        g = torch.Generator().manual_seed(1)
        self.prompt = torch.randint(0, 32000, (1, PROMPT_LEN), generator=g).cuda()
        self.tokens = torch.randint(0, 32000, (steps,), generator=g).tolist()

    def prefill(self) -> None:
        positions = torch.arange(PROMPT_LEN, device="cuda")
        self.model(self.prompt, past_key_values=self.cache, cache_position=positions)

    def state(self) -> list[torch.Tensor]:
        return [t for layer in self.cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]

    def eager(self) -> list[torch.Tensor]:
        self.prefill()
        out = []
        for i, token in enumerate(self.tokens):
            self._poison(i)
            position = torch.tensor([PROMPT_LEN + i], device="cuda")
            ids = torch.tensor([[token]], device="cuda")
            out.append(self.model(ids, past_key_values=self.cache, cache_position=position).logits.clone())
        return out

    def capture(self) -> None:
        self.prefill()
        self.ids = torch.tensor([[self.tokens[0]]], device="cuda")
        self.position = torch.tensor([PROMPT_LEN], device="cuda")
        saved = [t.clone() for t in self.state()]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.model(self.ids, past_key_values=self.cache, cache_position=self.position)
        for t, s in zip(self.state(), saved, strict=True):
            t.copy_(s)

    def replay(self, i: int) -> torch.Tensor:
        self._poison(i)
        self.ids.fill_(self.tokens[i])
        self.position.fill_(PROMPT_LEN + i)
        self.graph.replay()
        return self.out.logits

    def replayed(self) -> list[torch.Tensor]:
        self.capture()
        return [self.replay(i).clone() for i in range(self.steps)]

    def sampled_replay(self, i: int) -> int:
        return int(self.replay(i).argmax(-1).item())

    def sampled_eager(self, i: int) -> int:
        ids = torch.tensor([[self.tokens[i]]], device="cuda")
        position = torch.tensor([PROMPT_LEN + i], device="cuda")
        out = self.model(ids, past_key_values=self.cache, cache_position=position)
        return int(out.logits.argmax(-1).item())

    def _poison(self, i: int) -> None:
        if self.poison is not None:
            self.model.poison.fill_(self.poison[i])


def traced(runs: Path):
    from shadowtrace_hooks import session, startup

    class On:
        def __enter__(self):
            assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs)}) is not None
            return runs

        def __exit__(self, *exc):
            session.stop()

    return On()


def read_runs(runs: Path) -> dict[str, tuple[dict, dict]]:
    out = {}
    for path in sorted(runs.glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        rows = {}
        for table in ("hidden", "logits", "events"):
            files = sorted((path.parent / table).glob("*.parquet"))
            data = [r for f in files for r in pq.read_table(f).to_pylist()]
            for r in data:
                r.pop("run_id", None)
            rows[table] = sorted(data, key=lambda r: (r.get("seq", 0), r.get("token") or 0))
        out[manifest["prompt"]["token_hash"]] = (manifest, rows)
    return out


def rows_agree(root: Path, model: torch.nn.Module, steps: int) -> None:
    print("\n== 1-2. replayed rows against eager rows; logits bit-identical", flush=True)
    with torch.no_grad():
        untraced_graph = Decoder(model, steps).replayed()
        untraced_eager = Decoder(model, steps).eager()
        with traced(root / "eager"):
            eager = Decoder(model, steps).eager()
        with traced(root / "graph"):
            graph = Decoder(model, steps).replayed()
    check(all(torch.equal(a, b) for a, b in zip(graph, untraced_graph, strict=True)),
          f"replayed logits traced == untraced, bit for bit ({steps} steps)")  # fmt: skip
    check(all(torch.equal(a, b) for a, b in zip(eager, untraced_eager, strict=True)),
          "eager logits traced == untraced, bit for bit")  # fmt: skip
    same = all(torch.equal(a, b) for a, b in zip(graph, eager, strict=True))
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(graph, eager, strict=True))
    print(f"        replayed logits == eager logits, bit for bit: {same} (max |diff| {worst:.3g})")
    e, g = read_runs(root / "eager"), read_runs(root / "graph")
    # Each eager decode call is a request (a bare forward); a graph's replays are one request.
    said = f"runs: {len(e)} eager (prefill, one per step), {len(g)} replayed (prefill, all replays)"
    check(len(e) == steps + 1 and len(g) == 2, said)
    mismatched = [f"run {key[:8]} {m['status']} {m['counters']}" for key, (m, _) in g.items()
                  if m["status"] != "complete" or m["counters"].get("hook_errors", 0)]  # fmt: skip
    counted = {}
    for table in ("hidden", "logits", "events"):
        er, gr = merged(e, table), merged(g, table)
        counted[table] = len(gr)
        if gr != er:
            if same or table == "events":
                mismatched.append(table)
            elif _keys(gr) != _keys(er):  # not bit-identical steps: equal in all but the values
                mismatched.append(f"{table} rows")
    said = "; ".join(mismatched[:4]) or "all equal"
    check(not mismatched, f"replayed rows == eager rows: {counted} ({said})")


def merged(runs: dict, table: str) -> list[dict]:
    """`table`'s rows of `runs` as production computed them: without their place in a run
    (a run per eager decode call, one for all of a graph's replays)."""
    place = ("seq", "step")
    rows = [{k: v for k, v in r.items() if k not in place} for _, t in runs.values() for r in t[table]]
    return sorted(rows, key=lambda r: (r.get("token") or 0, r.get("layer") or 0, str(r.get("site")), str(r)))


def _keys(rows: list[dict]) -> list[tuple]:
    return [(r.get("layer"), r.get("site"), r.get("token")) for r in rows]


def nan_through_replay(root: Path, model: torch.nn.Module) -> None:
    print("\n== 3. a NaN planted in the second of three replays", flush=True)
    model.poison = torch.ones((), device="cuda", dtype=torch.bfloat16)
    hook = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * model.poison)
    try:
        with torch.no_grad(), traced(root / "nan"):
            logits = Decoder(model, 3, poison=[1.0, float("nan"), 1.0]).replayed()
    finally:
        hook.remove()
        del model.poison
    only = bool(torch.isnan(logits[1]).all()) and not bool(torch.isnan(logits[0]).any())
    check(only, "the NaN reached step 2's logits, not step 1's")
    events = [r for _, rows in read_runs(root / "nan").values() for r in rows["events"]]
    onsets: dict[int, list] = {}
    for r in events:
        if r["kind"] != "sentinel":
            onsets.setdefault(r["token"], []).append((r["seq"], r["layer"], r["site"]))
    poisoned = PROMPT_LEN + 1
    first = {t: min(v)[1:] for t, v in onsets.items()}
    print(f"        first non-finite capture per token: {first}")
    check(first.get(poisoned) == (1, "mlp_out"), f"step at position {poisoned}: first NaN at layer 1 mlp_out")
    check(sorted(first) == [poisoned, poisoned + 1], "no earlier token holds one; the next step does")
    bad = sorted(
        {(r["layer"], r["check"], r["token"]) for r in events if r["kind"] == "sentinel" and not r["passed"]}
    )
    print(f"        failed sentinels (layer, check, slot): {bad}")
    check((2, "kv_new_slots_finite", poisoned) in bad, f"the sentinel names slot {poisoned} at layer 2")


def timed(step, n: int) -> list[float]:
    times = []
    for i in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    return times


def overhead(root: Path, model: torch.nn.Module, steps: int) -> None:
    print("\n== 4. overhead of a traced decode step", flush=True)
    table = []
    with torch.no_grad():
        for name, graphed in (("replayed graph", True), ("eager", False)):
            figures = {}
            for label in ("untraced", "traced", "untraced again"):
                d = Decoder(model, steps)
                on = traced(root / f"overhead-{name}-{label}") if label == "traced" else None
                if on is not None:
                    on.__enter__()
                try:
                    if graphed:
                        d.capture()
                    else:
                        d.prefill()
                    spent.clear()
                    times = timed(d.sampled_replay if graphed else d.sampled_eager, steps)
                finally:
                    if on is not None:
                        on.__exit__()
                figures[label] = statistics.median(times[2:])
                figures[label + " first"] = times[0]
                if label == "traced":
                    parts.append((name, {k: v / steps for k, v in spent.items()}))
            base = min(figures["untraced"], figures["untraced again"])
            table.append((name, figures, figures["traced"] / base))
    print(
        "| decode step (bf16 Llama, sdpa attention, host samples each token) | untraced | traced "
        "| traced / untraced | first traced step |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, f, ratio in table:
        print(f"| {name} | {f['untraced'] * 1e3:.2f} ms ({f['untraced again'] * 1e3:.2f} again) | "
              f"{f['traced'] * 1e3:.2f} ms | {ratio:.2f}x | {f['traced first'] * 1e3:.2f} ms |")  # fmt: skip
    print("        (median of steps 3 on; the goal for a replayed step is 1.10x, capture only)")
    print("        host time inside the traced steps, mean per step (a bare eager forward is a")
    print("        request, opening and closing its run; a graph's replays are one request):")
    for name, means in parts:
        said = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(means.items()))
        print(f"          {name}: {said}")


# Host seconds spent in the hooks' run bookkeeping and in a replay's shipment, per kind.
spent: dict[str, float] = {}
parts: list[tuple[str, dict[str, float]]] = []


def _timed(real, label: str):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

    return wrapper


def _timed_method(owner: type, name: str, label: str) -> None:
    setattr(owner, name, _timed(getattr(owner, name), label))


def time_the_hooks() -> None:
    """Host time per kind; `open the step` holds `open run` where a step opens one."""
    from shadowtrace_hooks import session
    from shadowtrace_hooks.adapters import hf

    _timed_method(session.Session, "open_run", "open run")
    _timed_method(session.Session, "close_run", "close run")
    _timed_method(session.Run, "replay", "ship a replay's rows")
    _timed_method(hf._Tracer, "_begin_step", "open the step")
    if hasattr(hf, "_ReplayInputs"):  # hooks that open a replay's step after its launch
        _timed_method(hf._ReplayInputs, "__init__", "queue the inputs' copy (before a replay's launch)")
    _timed_method(hf._Tracer, "_replayed", "a replay's rows and counters")
    _timed_method(hf._Tracer, "_logits", "logits (eager)")
    _timed_method(hf._Tracer, "_ship", "ship (eager)")
    hf.hf_prefix.remember = _timed(hf.hf_prefix.remember, "remember the cache's ids")


def trained_glm(root: Path) -> None:
    print("\n== 5. the trained GLM-5 checkpoint's decode step in a graph", flush=True)
    import trained
    from transformers import StaticCache

    model = trained.load("glm", torch.bfloat16).cuda().eval()
    try:
        model.set_attn_implementation("sdpa")
    except Exception as e:  # said, and the eager mask tried
        print(f"        sdpa refused ({type(e).__name__}: {e}); eager attention")
    cache = StaticCache(config=model.config, max_cache_len=160)
    prompt = trained.prompt(128).cuda()
    try:
        with torch.no_grad(), traced(root / "glm5"):
            model(prompt, past_key_values=cache, cache_position=torch.arange(128, device="cuda"))
            ids, position = prompt[:, -1:].clone(), torch.tensor([128], device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(ids, past_key_values=cache, cache_position=position)
            for i in range(3):
                position.fill_(128 + i)
                graph.replay()
            torch.cuda.synchronize()
        runs = read_runs(root / "glm5")
        counters = {k: v for m, _ in runs.values() for k, v in m["counters"].items() if "graph" in k}
        rows = sum(len(r["hidden"]) for _, r in runs.values())
        # The eager prefill's indexer scores every slot of the static cache (160), wider than
        # the 128 keys its queries see: its capture must still be recorded, not disabled.
        disabled = sorted({s for m, _ in runs.values() for s in m["settings"].get("disabled_sites") or []})
        print(f"        captured and replayed: {len(runs)} runs, {rows} hidden rows, counters {counters}")
        print(f"        disabled captures: {disabled or 'none'}")
        if disabled:
            failed.append(f"trained GLM-5 over a static cache: captures disabled {disabled}")
        del out
    except Exception as e:  # what transformers' GLM-5 cannot do in a graph: said, not a failure of ours
        print(f"        not capturable here: {type(e).__name__}: {str(e)[:300]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    model = llama(args.hidden, args.layers)
    with torch.no_grad():  # warm-up untraced: kernels loaded, a throwaway capture
        Decoder(model, 4).replayed()
        Decoder(model, 4).eager()
    time_the_hooks()
    rows_agree(args.out, model, args.steps)
    nan_through_replay(args.out, model)
    overhead(args.out, model, args.steps)
    trained_glm(args.out)
    print("\nFAILED: " + "; ".join(failed) if failed else "\nall checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
