"""Train a GLM-5- or DeepSeek-V3.2-shaped model on the corpus and the tool-call task (issue 40).

train_dsa.py's models, recipe and code (dense, indexer warm-up, sparse; `train_dsa.py` says
how each stage is done), with three changes:

- a copy stage first (`--copy`, `--copy-s`): rows of corpus text in which random segments
  are written twice (`toolcall.copy_row`), trained as the dense stage, the second copies'
  bytes weighted as answers. Without it no copying circuit formed (models/README.md);

- the data: a mix of corpus windows and tool-call examples from `toolcall.py` (training
  seeds only, 1 to `MAX_REQUESTS` requests each, one in `CONTROL_EVERY` the no-tool control).
  Dense stage: 16 rows of 2048 bytes, `TASK_SHARE["dense"]` of them examples. Warm-up and
  sparse: each step draws a length from 1024 to 8192 bytes and takes 8192 // length rows of
  it, examples in `TASK_SHARE[stage]` of them;
- the loss: every answer byte's next-byte loss weighs `ANSWER_WEIGHT` times a corpus byte's
  (the mean is over the weights); the curve logs the answer bytes' own loss beside it.

Default size: 4 layers (the first dense), the rest as train_dsa.py's. After training, the
bf16 weights are saved and evaluated (toolcall_eval.py, fp32 and bf16) and the record keeps
the table.

    python models/train/train_toolcall.py --model glm --corpus DIR --out DIR [--budget-s 240]
"""

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import toolcall
import toolcall_eval
import torch
import torch.nn.functional as F
import train_dsa
from train_dsa import SHAPES, STAGES

TASK_SHARE = {"dense": 0.75, "warmup": 0.75, "sparse": 0.75}
TASK_LENGTHS = (1024, 8192)
ROW_TOKENS = 8192
MAX_REQUESTS = 8
CONTROL_EVERY = 8
ANSWER_WEIGHT = 10.0
LAYERS = 4
# The copy stage (toolcall.copy_row): LENGTH, BATCH, LR, and its training time.
COPY_SHAPE = (512, 32, 2e-3)
COPY_S = 120.0


class TaskTrainer(train_dsa.Trainer):
    DENSE_STAGES = ("copy", "dense")

    def __init__(self, name, model, corpus, text, seed: int, device, log):
        super().__init__(name, model, corpus, device, log)
        self.text = text
        self.rng = random.Random(seed)
        self.examples = {"tool": 0, "control": 0, "requests": 0, "copies": 0}

    def next_batch(self, stage: str, length: int, batch: int):
        if stage == "copy":
            return self.copy_batch(length, batch)
        if stage != "dense":
            length = self.rng.randint(*TASK_LENGTHS)
            batch = max(1, ROW_TOKENS // length)
        rows, weights = [], torch.ones(batch, length - 1)
        for r in range(batch):
            if self.rng.random() < TASK_SHARE[stage]:
                seed = self.rng.randrange(toolcall.HELDOUT_SEED_BASE)
                assert toolcall.split_of(seed) == "train"
                tools = self.rng.randrange(CONTROL_EVERY) != 0
                ex = toolcall.example(seed, length, self.text, tools, self.rng.randint(1, MAX_REQUESTS))
                self.examples["tool" if tools else "control"] += 1
                self.examples["requests"] += len(ex.answers)
                rows.append(torch.frombuffer(bytearray(ex.ids), dtype=torch.uint8))
                for start, end in ex.answers:
                    weights[r, start - 1 : end - 1] = ANSWER_WEIGHT
            else:
                rows.append(self.corpus.batch(length, 1, "cpu")[0])
        ids = torch.stack(rows).long().to(self.device)
        return ids, weights.to(self.device)

    def copy_batch(self, length: int, batch: int):
        rows, weights = [], torch.ones(batch, length - 1)
        for r in range(batch):
            window = self.corpus.batch(length, 1, "cpu")[0].to(torch.uint8).numpy().tobytes()
            row, copies = toolcall.copy_row(self.rng, length, window)
            rows.append(torch.frombuffer(bytearray(row), dtype=torch.uint8))
            for start, end in copies:
                weights[r, start - 1 : end - 1] = ANSWER_WEIGHT
            self.examples["copies"] += len(copies)
        return torch.stack(rows).long().to(self.device), weights.to(self.device)

    def lm_loss(self, ids, weights):
        logits = self.model(ids).logits[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        ce = ce.view_as(weights)
        loss = (ce * weights).sum() / weights.sum()
        answer, ce = weights > 1, ce.detach()
        figures = {"loss": loss.item(), "lm": float(ce[~answer].mean())}
        if answer.any():
            figures["answer"] = float(ce[answer].mean())
            hit = logits.detach().argmax(-1) == ids[:, 1:]
            figures["answer_acc"] = float(hit[answer].float().mean())
        return loss, figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(train_dsa.MODELS), required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="folder written by corpus.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=240.0, help="training time to calibrate steps from")
    parser.add_argument("--steps", help="fixed steps per stage, e.g. dense=900,warmup=100,sparse=300")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-count", type=int, default=32, help="held-out prompts per length bucket")
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out corpus windows of 8192 bytes")
    parser.add_argument("--dense", help=f"the dense stage's LENGTH,BATCH,LR (default {SHAPES['dense']})")
    parser.add_argument("--dense-task-share", type=float, help=f"default {TASK_SHARE['dense']}")
    parser.add_argument("--dense-only", action="store_true", help="no warm-up, no sparse stage")
    parser.add_argument(
        "--copy",
        default=",".join(str(v) for v in COPY_SHAPE),
        help="the copy stage's LENGTH,BATCH,LR before the dense stage (default %(default)s)",
    )
    parser.add_argument(
        "--copy-s", type=float, default=COPY_S, help="the copy stage's seconds (default %(default)s; 0: none)"
    )
    parser.add_argument("--buckets", help="evaluated lengths, e.g. 1024,2048 (default all)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="evaluated dtypes")
    parser.add_argument("--shrink", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test
    args = parser.parse_args()
    if args.dense:
        length, batch, lr = args.dense.split(",")
        SHAPES["dense"] = (int(length), int(batch), float(lr))
    length, batch, lr = args.copy.split(",")
    SHAPES["copy"] = (int(length), int(batch), float(lr))
    if args.dense_task_share is not None:
        TASK_SHARE["dense"] = args.dense_task_share

    def log(msg: str) -> None:
        print(f"[{args.model} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    overrides = {"num_hidden_layers": args.layers}
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else toolcall_eval.BUCKETS
    if args.shrink:  # the same code on a CPU in seconds: short examples, a small top-k
        global TASK_LENGTHS, ROW_TOKENS
        TASK_LENGTHS, ROW_TOKENS = (1024, 1100), 1024
        for stage in STAGES:
            SHAPES[stage] = (1024, 1, SHAPES[stage][2])
        SHAPES["copy"] = (256, 2, SHAPES["copy"][2])
        overrides["index_topk"] = 256
        buckets = (1024,)
    text = toolcall.load_text(args.corpus)
    corpus = train_dsa.Corpus(args.corpus, args.seed)
    model = train_dsa.build(args.model, args.seed, **overrides).to(args.device)
    log(f"{sum(p.numel() for p in model.parameters())} parameters on {args.device}")
    trainer = TaskTrainer(args.model, model, corpus, text, args.seed, args.device, log)
    check = train_dsa.check_indexer_scores(
        model, corpus.batch(max(TASK_LENGTHS), 1, args.device), trainer.rope
    )
    log(f"indexer scores checked against transformers' selection: {check}")

    fixed = train_dsa.parse_steps(args.steps, ("copy", *STAGES))
    started = time.perf_counter()
    steps = {}
    for stage in ("copy", *STAGES):
        if stage == "copy":
            steps[stage] = 0
            if stage in fixed:
                steps[stage] = trainer.run_stage(stage, fixed[stage], 0.0)
            elif args.copy_s > 0:
                steps[stage] = trainer.run_stage(stage, None, args.copy_s)
            continue
        if args.dense_only and stage != "dense":
            steps[stage] = 0
            continue
        share = 1.0 if args.dense_only else train_dsa.BUDGET_SHARE[stage]
        budget = 0.0 if stage in fixed else args.budget_s * share
        steps[stage] = trainer.run_stage(stage, fixed.get(stage), budget)
    train_s = time.perf_counter() - started

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    biases = {id(g): g.e_score_correction_bias.detach().clone() for g in train_dsa.routers(model)}
    model = model.to(torch.bfloat16)
    for gate in train_dsa.routers(model):
        gate.e_score_correction_bias = biases[id(gate)]
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)

    # What is evaluated is what is saved: the bf16 weights (and the fp32 router biases), in
    # fp32 without TF32, then in bf16.
    evaluation = {}
    length = max(TASK_LENGTHS)
    for name in args.dtypes.split(","):
        t0 = time.perf_counter()
        model = model.to(toolcall_eval.DTYPES[name])
        for gate in train_dsa.routers(model):
            gate.e_score_correction_bias = biases[id(gate)]
        evaluation[name] = toolcall_eval.evaluate(model, text, args.device, args.eval_count, buckets)
        log(f"tool-call evaluation in {name}: {time.perf_counter() - t0:.0f} s")
        if name == "fp32":
            windows = corpus.heldout_windows(length, args.eval_windows)
            heldout = train_dsa.heldout_loss(model, windows, args.device)
            log(f"held-out corpus {heldout / math.log(2):.3f} bits/byte")
    log("exact calls by length (schema figures of the fp32 run):\n" + toolcall_eval.table(evaluation))
    record = {
        "model": args.model,
        "architecture": type(model).__name__,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
        "seed": args.seed,
        "config": {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")},
        "steps": steps,
        "steps_cut": trainer.cuts,
        "shapes": {
            s: dict(zip(("length", "batch", "lr"), SHAPES[s], strict=True)) for s in ("copy", *STAGES)
        },
        "task": {
            "generator": "models/train/toolcall.py",
            "generator_version": toolcall.VERSION,
            "generator_sha256": toolcall.source_hash(),
            "share_of_rows": TASK_SHARE,
            "lengths_warmup_sparse": TASK_LENGTHS,
            "row_tokens_warmup_sparse": ROW_TOKENS,
            "max_requests": MAX_REQUESTS,
            "control_every": CONTROL_EVERY,
            "answer_loss_weight": ANSWER_WEIGHT,
            "train_seeds_below": toolcall.HELDOUT_SEED_BASE,
            "examples_trained": trainer.examples,
        },
        "router_bias_rate": train_dsa.BIAS_RATE,
        "train_seconds": round(train_s, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {k: corpus.record[k] for k in ("source", "python", "tokenizer", "held_out", "splits")},
        "indexer_score_check": check,
        "heldout": {
            "windows": args.eval_windows,
            "length": length,
            "loss_nats": heldout,
            "bits_per_byte": heldout / math.log(2),
        },
        "toolcall_eval": {
            "prompts": f"toolcall_eval.prompts: held-out seeds from {toolcall_eval.EVAL_SEED}",
            "method": "teacher-forced argmax over the answer span (greedy decoding's verdict), "
            "eager attention over the indexer's top-k; saved bf16 weights in fp32 and in bf16",
            **evaluation,
        },
        "curve": trainer.curve,
    }
    (args.out / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
