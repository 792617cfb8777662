"""Train a small GLM-5- or DeepSeek-V3.2-shaped model with transformers' own modeling code,
following the DSA recipe of DeepSeek-V3.2's report, on the byte-level corpus of `corpus.py`.

Stages (each one's step count is fixed by `--steps`, or calibrated once from `--budget-s`
and then fixed; the record keeps the counts, so `--steps` from a record reruns it; the
calibration's 7 timed steps run at learning rate 0, though the routers' balancing bias
moves in them):

1. dense: language modelling at 2048 tokens, where the indexer's top-2048 holds every visible
   key, so attention is dense by construction (transformers' forward on SDPA, the indexer's
   selection given as every key, which at this length it is);
2. warmup: the indexer alone learns the main attention's distribution at 8192 tokens.
   Attention is dense (the indexer's selection replaced by every key); the target of query t
   is the main attention's probabilities summed over heads and L1-normalised, the loss
   KL(target || softmax(indexer scores)). The rest of the model is frozen;
3. sparse: at 8192 tokens through transformers' forward as it runs, attention over the
   indexer's top-2048. The model learns from the language-modelling loss; the indexer, its
   input detached, from the KL over its own selection only.

The MoE routers keep their loads balanced as DeepSeek-V3 does, without an auxiliary loss:
after each step a router's correction bias moves by `BIAS_RATE` toward underloaded experts.

The indexer's scores are computed here (transformers' indexer returns indices only, under
no_grad); `check_indexer_scores` proves on the first batch that their top-k is the indexer's
own selection.

    python models/train/train_dsa.py --model glm --corpus DIR --out DIR [--budget-s 420]

Writes `model.safetensors` and `config.json` (bf16, `save_pretrained`) and
`training_record.json` (configuration, corpus hashes, seed, steps per stage, the loss curve,
held-out bits per byte and the indexer's attention-mass figures).
"""

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.deepseek_v32 import modeling_deepseek_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

# Every projection's dimensions are multiples of 128 (FP8 128x128 blocks fit whole) but
# kv_a_proj_with_mqa's output, kv_lora_rank + qk_rope_head_dim = 192: 1.5 blocks, as the
# real models' 576 is 4.5. 3 layers (dense, MoE, MoE) keep the bf16 weights under 8 MB.
COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    index_topk=2048,
    index_head_dim=128,
    first_k_dense_replace=1,
    tie_word_embeddings=False,
)
MODELS = {
    "glm": dict(
        cls=GlmMoeDsaForCausalLM,
        config=GlmMoeDsaConfig,
        modeling=modeling_glm_moe_dsa,
        rope="apply_rotary_pos_emb_interleave",
        overrides=dict(
            index_n_heads=4,
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
            max_position_embeddings=202752,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
    "deepseek": dict(
        cls=DeepseekV32ForCausalLM,
        config=DeepseekV32Config,
        modeling=modeling_deepseek_v32,
        rope="apply_rotary_pos_emb",
        overrides=dict(
            index_n_heads=8,  # twice GLM's, as the real models have 64 against 32
            n_group=4,
            topk_group=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=163840,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
}
STAGES = ("dense", "warmup", "sparse")
# (sequence length, batch, learning rate) per stage.
SHAPES = {"dense": (2048, 16, 3e-3), "warmup": (8192, 1, 1e-3), "sparse": (8192, 1, 1e-3)}
# Share of --budget-s per stage.
BUDGET_SHARE = {"dense": 0.55, "warmup": 0.1, "sparse": 0.35}
BIAS_RATE = 1e-3
LOG_EVERY = 10
CUT_FACTOR = 1.3
COMMITTED_WINDOWS = 2


def build(name: str, seed: int, **overrides) -> torch.nn.Module:
    spec = MODELS[name]
    config = spec["config"](**{**COMMON, **spec["overrides"], **overrides})
    torch.manual_seed(seed)
    model = spec["cls"](config)
    model.set_attn_implementation("eager")
    return model


def rope_of(name: str):
    spec = MODELS[name]
    return getattr(spec["modeling"], spec["rope"])


def attentions(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def routers(model) -> list:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def indexer_params(model) -> list:
    return [p for attn in attentions(model) if attn.indexer is not None for p in attn.indexer.parameters()]


class Taps:
    """Each attention's input, position embeddings and probabilities, and each router's choice,
    as the last forward saw them."""

    def __init__(self, model):
        self.inputs, self.probs, self.routes = {}, {}, {}
        self.handles = []
        for i, attn in enumerate(attentions(model)):
            self.handles.append(attn.register_forward_pre_hook(self._input(i), with_kwargs=True))
            self.handles.append(attn.register_forward_hook(self._probs(i)))
        for i, gate in enumerate(routers(model)):
            self.handles.append(gate.register_forward_hook(self._route(i)))

    def _input(self, i):
        def hook(module, args, kwargs):
            self.inputs[i] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])

        return hook

    def _probs(self, i):
        def hook(module, args, out):
            self.probs[i] = out[1]

        return hook

    def _route(self, i):
        def hook(module, args, out):
            self.routes[i] = out[2].detach()

        return hook

    def clear(self) -> None:
        self.inputs.clear()
        self.probs.clear()
        self.routes.clear()


def causal_bias(length: int, device) -> torch.Tensor:
    return torch.full((length, length), float("-inf"), device=device).triu(1)


def indexer_scores(attn, hidden: torch.Tensor, position_embeddings, rope) -> torch.Tensor:
    """transformers' indexer score `[B, S, T]`, causal keys only (-inf elsewhere), with
    gradients to the indexer's parameters and none to its input."""
    ix = attn.indexer
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    b, s, _ = hidden.shape
    cos, sin = position_embeddings
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    # transformers' matmul of [B,S,H,D] by [B,1,D,T], as an einsum: the same products, whose
    # backward does not expand k per query ([S, D, T] floats, 32 GiB at 8192 tokens).
    scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * ix.softmax_scale)
    weights = ix.weights_proj(hidden).float() * (ix.n_heads**-0.5)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    return index + causal_bias(s, hidden.device)


def kl_to_attention(probs: torch.Tensor, scores: torch.Tensor, selected: torch.Tensor | None) -> torch.Tensor:
    """Mean over queries of KL(p || softmax(scores)), p the attention probabilities summed
    over heads and L1-normalised; over the `selected` keys only where given."""
    target = probs.float().sum(dim=1)
    if selected is not None:
        target = target * selected
        scores = scores.masked_fill(~selected, float("-inf"))
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logq = torch.log_softmax(scores, dim=-1)
    kl = torch.xlogy(target, target) - torch.where(target > 0, target * logq, torch.zeros_like(logq))
    return kl.sum(-1).mean()


def selection_mask(topk: torch.Tensor, length: int) -> torch.Tensor:
    mask = torch.zeros(*topk.shape[:-1], length, dtype=torch.bool, device=topk.device)
    return mask.scatter(-1, topk.long(), True)


class DenseSelection:
    """Replaces every indexer's selection by every key (dense attention above 2048 tokens)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        for attn in attentions(self.model):
            if attn.indexer is not None:
                attn.indexer.forward = _every_key
        return self

    def __exit__(self, *exc):
        for attn in attentions(self.model):
            if attn.indexer is not None:
                del attn.indexer.forward


def _every_key(
    hidden_states, q_resid, position_embeddings, attention_mask, position_ids, past_key_values=None
):
    b, s = hidden_states.shape[:2]
    return torch.arange(s, device=hidden_states.device, dtype=torch.int32).expand(b, s, s)


class Corpus:
    def __init__(self, folder: Path, seed: int):
        self.train = torch.frombuffer(bytearray((folder / "train.bin").read_bytes()), dtype=torch.uint8)
        self.heldout = torch.frombuffer(bytearray((folder / "heldout.bin").read_bytes()), dtype=torch.uint8)
        self.record = json.loads((folder / "corpus.json").read_text())
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, length: int, batch: int, device) -> torch.Tensor:
        starts = torch.randint(0, len(self.train) - length, (batch,), generator=self.gen)
        return torch.stack([self.train[s : s + length] for s in starts.tolist()]).long().to(device)

    def heldout_windows(self, length: int, count: int) -> torch.Tensor:
        """`count` consecutive windows from the held-out text's start (the same for every run)."""
        need = length * count
        if len(self.heldout) < need:
            raise ValueError(f"corpus: held-out text has {len(self.heldout)} bytes, {need} needed")
        return self.heldout[:need].view(count, length).long()


def check_indexer_scores(model, ids: torch.Tensor, rope) -> dict:
    """The top-k of `indexer_scores` is transformers' own selection (rows with more visible
    keys than k; keys tied with the k-th score at 1e-6 relative excepted)."""
    taps, chosen = Taps(model), {}
    handles = [
        attn.indexer.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out))
        for i, attn in enumerate(attentions(model))
        if attn.indexer is not None
    ]
    with torch.no_grad():
        model(ids)
        checked = mismatched = 0
        for i, want in chosen.items():
            hidden, pe = taps.inputs[i]
            scores = indexer_scores(attentions(model)[i], hidden, pe, rope)
            k = want.shape[-1]
            rows = torch.arange(scores.shape[1], device=ids.device) + 1 > k
            top = scores.topk(k, dim=-1)
            kth = top.values[..., -1:]
            got = selection_mask(top.indices, scores.shape[-1])
            ref = selection_mask(want, scores.shape[-1])
            tied = (scores - kth).abs() <= 1e-6 * kth.abs().clamp_min(1e-12)
            differ = ((got ^ ref) & ~tied).any(-1)[:, rows]
            checked += int(rows.sum()) * ids.shape[0]
            mismatched += int(differ.sum())
    for h in taps.handles + handles:
        h.remove()
    if mismatched:
        raise AssertionError(
            f"indexer scores: {mismatched} of {checked} rows select other keys than transformers"
        )
    return {"rows_checked": checked, "rows_mismatched": mismatched}


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 50)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def balance_routers(model, taps: Taps) -> None:
    with torch.no_grad():
        for i, gate in enumerate(routers(model)):
            if i in taps.routes:
                load = torch.bincount(taps.routes[i].flatten(), minlength=gate.num_experts).float()
                gate.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)


class Trainer:
    # Stages trained on the language-modelling loss with every key attended (SDPA, no indexer).
    DENSE_STAGES = ("dense",)

    def __init__(self, name: str, model, corpus: Corpus, device, log):
        self.name, self.model, self.corpus, self.device, self.log = name, model, corpus, device, log
        self.rope = rope_of(name)
        self.taps = Taps(model)
        ix = {id(p) for p in indexer_params(model)}
        self.main_params = [p for p in model.parameters() if id(p) not in ix]
        self.curve: list[dict] = []
        self.cuts: dict = {}

    def next_batch(self, stage: str, length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step's ids and the weight of each next-byte target (None: every target alike)."""
        return self.corpus.batch(length, batch, self.device), None

    def lm_loss(self, ids: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The language-modelling loss to train on, and the figures to log beside it."""
        loss = self.model(ids, labels=ids).loss
        return loss, {"lm": loss.item()}

    def step(self, stage: str, batch: tuple, opt, lr: float) -> dict:
        ids, weights = batch
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        self.taps.clear()
        out = {}
        if stage in self.DENSE_STAGES:
            # At 2048 tokens the indexer's top-2048 is every key; skipping its scores saves
            # their [B, S, H, T] product (transformers' matmul expands it per query for B > 1).
            with DenseSelection(self.model):
                loss, figures = self.lm_loss(ids, weights)
            loss.backward()
            out.update(figures)
        elif stage == "warmup":
            with torch.no_grad(), DenseSelection(self.model):
                self.model(ids)
            out["kl"] = self._indexer_kl(selected=False)
        else:
            loss, figures = self.lm_loss(ids, weights)
            loss.backward()
            out.update(figures)
            out["kl"] = self._indexer_kl(selected=True)
        torch.nn.utils.clip_grad_norm_(self.main_params, 1.0)
        torch.nn.utils.clip_grad_norm_(indexer_params(self.model), 1.0)
        opt.step()
        if stage != "warmup":
            balance_routers(self.model, self.taps)
        return out

    def _indexer_kl(self, selected: bool) -> float:
        """The indexer's KL loss, layer by layer (each layer's graph freed before the next)."""
        total, layers = 0.0, 0
        for i, attn in enumerate(attentions(self.model)):
            if attn.indexer is None:
                continue
            hidden, pe = self.taps.inputs[i]
            scores = indexer_scores(attn, hidden, pe, self.rope)
            mask = None
            if selected:
                k = min(attn.indexer.index_topk, scores.shape[-1])
                top = scores.detach().topk(k, dim=-1).indices
                mask = selection_mask(top, scores.shape[-1]) & torch.isfinite(scores.detach())
            loss = kl_to_attention(self.taps.probs[i].detach(), scores, mask)
            loss.backward()
            total, layers = total + loss.item(), layers + 1
        return total / max(layers, 1)

    def run_stage(self, stage: str, steps: int | None, budget_s: float) -> int:
        length, batch, peak = SHAPES[stage]
        self.model.set_attn_implementation("sdpa" if stage in self.DENSE_STAGES else "eager")
        self.model.train()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # dense: the indexer gets no gradient (its forward is no_grad); warmup: the indexer
        # alone; sparse: both, the indexer from its KL loss only.
        params = indexer_params(self.model) if stage == "warmup" else list(self.model.parameters())
        for p in params:
            p.requires_grad_(True)
        opt = optimizer(params, peak)
        if steps is None:  # calibrate: time a few steps, then fix the count
            for _ in range(2):
                self.step(stage, self.next_batch(stage, length, batch), opt, 0.0)
            sync(self.device)
            t0, probe = time.perf_counter(), 5
            for _ in range(probe):
                self.step(stage, self.next_batch(stage, length, batch), opt, 0.0)
            sync(self.device)
            per_step = (time.perf_counter() - t0) / probe
            steps = max(1, int(budget_s / per_step))
            self.log(f"{stage}: {per_step * 1000:.0f} ms a step; {steps} steps in {budget_s:.0f} s")
            opt = optimizer(params, peak)
        t0, tokens = time.perf_counter(), 0
        for step in range(steps):
            # A calibration that ran while the GPU was less shared can overshoot: stop at
            # CUT_FACTOR times the stage's budget and record the steps taken.
            if budget_s and time.perf_counter() - t0 > CUT_FACTOR * budget_s and step < steps:
                self.log(
                    f"{stage}: cut at step {step} of {steps} ({CUT_FACTOR}x its {budget_s:.0f} s budget)"
                )
                self.cuts[stage] = {"planned": steps, "taken": step}
                steps = step
                break
            ids, weights = self.next_batch(stage, length, batch)
            out = self.step(stage, (ids, weights), opt, lr_at(step, steps, peak))
            tokens += ids.numel()
            if step % LOG_EVERY == 0 or step == steps - 1:
                self.curve.append({"stage": stage, "step": step, "tokens": tokens, **out})
                if step % (LOG_EVERY * 20) == 0 or step == steps - 1:
                    self.log(f"{stage} {step + 1}/{steps} {json.dumps(out)} {time.perf_counter() - t0:.0f} s")
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(True)
        return steps


def optimizer(params: list, lr: float) -> torch.optim.Optimizer:
    """AdamW; norms' weights (1-D) without weight decay."""
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def heldout_loss(model, windows: torch.Tensor, device, dense: bool = False) -> float:
    """Mean next-byte cross-entropy (nats) over the windows, as the model runs (sparse above
    2048 tokens) or with every key attended (`dense`)."""
    model.eval()
    model.set_attn_implementation("eager")
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            ids = ids.unsqueeze(0).to(device)
            if dense:
                with DenseSelection(model):
                    loss = model(ids, labels=ids).loss
            else:
                loss = model(ids, labels=ids).loss
            total += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def attention_mass(model, name: str, windows: torch.Tensor, device, seed: int, at=(4096, 8192)) -> dict:
    """Share of the main attention's mass (summed over heads, dense attention) that the
    indexer's top-k holds, for the 512 queries (a quarter, if fewer) before each position of
    `at`, per layer, beside a random selection of as many visible keys and the most recent
    ones."""
    rope, taps = rope_of(name), Taps(model)
    gen = torch.Generator().manual_seed(seed)
    sums: dict = {}
    model.eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for ids in windows:
            ids = ids.unsqueeze(0).to(device)
            with DenseSelection(model):
                model(ids)
            for i, attn in enumerate(attentions(model)):
                if attn.indexer is None:
                    continue
                hidden, pe = taps.inputs[i]
                scores = indexer_scores(attn, hidden, pe, rope)[0]
                probs = taps.probs[i][0].float().sum(0)
                probs = probs / probs.sum(-1, keepdim=True)
                k = attn.indexer.index_topk
                for end in at:
                    rows = torch.arange(end - min(512, end // 4), end, device=device)
                    p, s = probs[rows], scores[rows]
                    top = selection_mask(s.topk(k, dim=-1).indices, s.shape[-1])
                    top = top & (torch.arange(s.shape[-1], device=device) <= rows[:, None])
                    noise = torch.rand(s.shape, generator=gen).to(device).masked_fill(torch.isinf(s), -1.0)
                    rand = selection_mask(noise.topk(k, dim=-1).indices, s.shape[-1]) & ~torch.isinf(s)
                    recent = (torch.arange(s.shape[-1], device=device) > rows[:, None] - k) & ~torch.isinf(s)
                    key = (i, end)
                    acc = sums.setdefault(key, {"indexer": 0.0, "random": 0.0, "recent": 0.0, "n": 0})
                    for what, sel in (("indexer", top), ("random", rand), ("recent", recent)):
                        acc[what] += float((p * sel).sum(-1).sum())
                    acc["n"] += len(rows)
    for h in taps.handles:
        h.remove()
    return {
        f"layer{i}@{end}": {w: round(v[w] / v["n"], 4) for w in ("indexer", "random", "recent")}
        for (i, end), v in sorted(sums.items())
    }


def parse_steps(text: str | None, stages: tuple = STAGES) -> dict:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        stage, _, count = part.partition("=")
        if stage not in stages or not count.isdigit():
            raise SystemExit(f"train: --steps wants stage=count among {stages}, got {part!r}")
        out[stage] = int(count)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="folder written by corpus.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=420.0, help="training time to calibrate steps from")
    parser.add_argument("--steps", help="fixed steps per stage, e.g. dense=2000,warmup=100,sparse=400")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-windows", type=int, default=32, help="held-out windows of 8192 bytes")
    parser.add_argument("--shrink", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test
    args = parser.parse_args()

    def log(msg: str) -> None:
        print(f"[{args.model} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    overrides = {}
    if args.shrink:  # the same code on a CPU in seconds: short windows, a small top-k
        for stage in STAGES:
            SHAPES[stage] = (256 if stage != "dense" else 96, 2, SHAPES[stage][2])
        overrides = {"index_topk": 64}
    corpus = Corpus(args.corpus, args.seed)
    model = build(args.model, args.seed, **overrides).to(args.device)
    log(f"{sum(p.numel() for p in model.parameters())} parameters on {args.device}")
    trainer = Trainer(args.model, model, corpus, args.device, log)
    check = check_indexer_scores(model, corpus.batch(SHAPES["sparse"][0], 1, args.device), trainer.rope)
    log(f"indexer scores checked against transformers' selection: {check}")

    fixed = parse_steps(args.steps)
    started = time.perf_counter()
    steps = {}
    for stage in STAGES:
        budget = 0.0 if stage in fixed else args.budget_s * BUDGET_SHARE[stage]
        steps[stage] = trainer.run_stage(stage, fixed.get(stage), budget)
    train_s = time.perf_counter() - started

    # What is recorded is what is saved: the bf16 weights, evaluated in fp32 without TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The routers' correction biases stay fp32, as the published checkpoints keep them.
    biases = {id(g): g.e_score_correction_bias.detach().clone() for g in routers(model)}
    model = model.to(torch.bfloat16)
    for gate in routers(model):
        gate.e_score_correction_bias = biases[id(gate)]
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    model = model.float()
    length = SHAPES["sparse"][0]
    windows = corpus.heldout_windows(length, args.eval_windows)
    sparse = heldout_loss(model, windows, args.device)
    dense = heldout_loss(model, windows, args.device, dense=True)
    committed = heldout_loss(model, windows[:COMMITTED_WINDOWS], args.device)
    mass = attention_mass(model, args.model, windows[:2], args.device, args.seed, at=(length // 2, length))
    log(f"held-out {sparse / math.log(2):.3f} bits/byte (dense attention {dense / math.log(2):.3f})")
    record = {
        "model": args.model,
        "architecture": type(model).__name__,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
        "seed": args.seed,
        "steps": steps,
        "steps_cut": trainer.cuts,
        "shapes": {s: dict(zip(("length", "batch", "lr"), SHAPES[s], strict=True)) for s in STAGES},
        "router_bias_rate": BIAS_RATE,
        "train_seconds": round(train_s, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {k: corpus.record[k] for k in ("source", "python", "tokenizer", "held_out", "splits")},
        "indexer_score_check": check,
        "heldout": {
            "windows": args.eval_windows,
            "length": length,
            "loss_nats": sparse,
            "bits_per_byte": sparse / math.log(2),
            "dense_attention_bits_per_byte": dense / math.log(2),
            # The first windows ship with the checkpoints (models/corpus/heldout_head.bin): the
            # CPU test recomputes this loss from them.
            "committed_windows": COMMITTED_WINDOWS,
            "committed_windows_loss_nats": committed,
            "committed_windows_sha256": hashlib.sha256(
                bytes(windows[:COMMITTED_WINDOWS].flatten().to(torch.uint8).tolist())
            ).hexdigest(),
        },
        "attention_mass": mass,
        "curve": trainer.curve,
    }
    (args.out / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"attention mass of the top-{model.config.index_topk}: {json.dumps(mass)}")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
