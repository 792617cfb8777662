"""Exact-call accuracy of a model on held-out tool-call prompts (toolcall.py), by length.

A prompt's answer is judged by one forward over the prompt and its expected answer, through
transformers' forward as it runs (eager, attention over the indexer's top-k): the call is
exact when the argmax at every answer position is the expected next byte, the END byte
included. That is exactly greedy decoding's verdict: greedy decoding reproduces the expected
answer if and only if each of its steps, given the expected bytes so far, picks the next one.

For the answer's queries (the ANSWER byte up to the byte before END, the positions that
predict the answer), per layer: the share of their attention mass (heads averaged) on the
schema span, and the share of the schema span's keys in their indexer top-k.

    python models/train/toolcall_eval.py --model DIR --corpus DIR [--count 32] [--dtypes fp32,bf16]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import toolcall
import torch

BUCKETS = (1024, 2048, 3072, 4096, 6144, 8192)
# Evaluation prompt i of bucket b has seed EVAL_SEED + b * SEEDS_PER_BUCKET + i; the no-tool
# control's prompts use the same seeds (the same filler, no schema).
EVAL_SEED = toolcall.HELDOUT_SEED_BASE
SEEDS_PER_BUCKET = 100_000
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts(text: dict, length: int, count: int, tools: bool = True) -> list[toolcall.Example]:
    bucket = BUCKETS.index(length) if length in BUCKETS else len(BUCKETS)
    seeds = [EVAL_SEED + bucket * SEEDS_PER_BUCKET + i for i in range(count)]
    assert all(toolcall.split_of(s) == "heldout" for s in seeds)
    return [toolcall.example(s, length, text, tools) for s in seeds]


class Probe:
    """Per layer, for the answer's query rows of the last forward: attention mass on the
    schema span, and the share of the schema's keys in the indexer's top-k."""

    def __init__(self, model):
        self.rows = self.span = None
        self.mass, self.in_topk = {}, {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self.handles.append(attn.register_forward_hook(self._attention(i)))
            if attn.indexer is not None:
                self.handles.append(attn.indexer.register_forward_hook(self._indexer(i)))

    def _attention(self, i):
        def hook(module, args, out):
            probs = out[1]
            if probs is None:
                raise RuntimeError("toolcall_eval: attention probabilities need eager attention")
            (s0, s1), rows = self.span, self.rows
            p = probs[0][:, rows].float()
            self.mass[i] = float((p[..., s0:s1].sum(-1) / p.sum(-1)).mean())

        return hook

    def _indexer(self, i):
        def hook(module, args, out):
            (s0, s1), rows = self.span, self.rows
            chosen = out[0][rows].long()
            self.in_topk[i] = float(((chosen >= s0) & (chosen < s1)).sum(-1).float().mean() / (s1 - s0))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def judge(model, ex: toolcall.Example, device, probe: Probe | None) -> dict:
    start, end = ex.answers[0]
    ids = torch.tensor(list(ex.ids[:end]), dtype=torch.long, device=device)[None]
    if probe is not None:
        probe.rows = torch.arange(start - 1, end - 1, device=device)
        probe.span = ex.schema_span
    with torch.no_grad():
        logits = model(ids).logits[0, start - 1 : end - 1]
    got = logits.argmax(-1)
    want = ids[0, start:end]
    wrong = (got != want).nonzero()
    out = {"exact": not len(wrong), "first_wrong": int(wrong[0]) if len(wrong) else None}
    if probe is not None:
        out["schema_mass"], out["schema_in_topk"] = dict(probe.mass), dict(probe.in_topk)
    return out


def evaluate(model, text: dict, device, count: int, buckets=BUCKETS, control: int | None = None) -> dict:
    """Per bucket: exact calls of `count` tool prompts, the probe's per-layer means over
    them, and exact replies of `control` no-tool prompts (default `count`)."""
    model.eval()
    model.set_attn_implementation("eager")
    control = count if control is None else control
    result = {}
    for length in buckets:
        probe = Probe(model)
        judged = [judge(model, ex, device, probe) for ex in prompts(text, length, count)]
        probe.remove()
        layers = sorted(judged[0]["schema_mass"])
        controls = [judge(model, ex, device, None) for ex in prompts(text, length, control, tools=False)]
        result[str(length)] = {
            "prompts": count,
            "exact": sum(j["exact"] for j in judged),
            "accuracy": sum(j["exact"] for j in judged) / count,
            "first_wrong": [j["first_wrong"] for j in judged],
            "schema_mass": [round(sum(j["schema_mass"][i] for j in judged) / count, 4) for i in layers],
            "schema_in_topk": [
                round(sum(j["schema_in_topk"].get(i, 0.0) for j in judged) / count, 4) for i in layers
            ],
            "control_prompts": control,
            "control_exact": sum(c["exact"] for c in controls),
        }
    return result


def table(results: dict[str, dict]) -> str:
    """Accuracy per bucket and dtype, with the fp32 run's per-layer schema figures."""
    names = list(results)
    lines = [
        "length  "
        + "  ".join(f"{n:>11}" for n in names)
        + "  no-tool  schema mass per layer    schema keys in top-k per layer"
    ]
    first = results[names[0]]
    for length, row in first.items():
        cells = "  ".join(
            f"{results[n][length]['exact']}/{results[n][length]['prompts']} "
            f"{results[n][length]['accuracy']:.2f}".rjust(11)
            for n in names
        )
        ctl = f"{row['control_exact']}/{row['control_prompts']}"
        mass = " ".join(f"{m:.3f}" for m in row["schema_mass"])
        topk = " ".join(f"{m:.3f}" for m in row["schema_in_topk"])
        lines.append(f"{length:>6}  {cells}  {ctl:>7}  {mass:<24} {topk}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--corpus", type=Path, required=True, help="folder written by corpus.py")
    parser.add_argument("--count", type=int, default=32, help="tool prompts per length bucket")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    text = toolcall.load_text(args.corpus)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    results = {}
    for name in args.dtypes.split(","):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[name]).to(args.device)
        t0 = time.perf_counter()
        results[name] = evaluate(model, text, args.device, args.count, buckets)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
