"""Precision bisection in transformers (issue 30): which layers' local shadow value, grafted into
production at one site (SHADOWTRACE_GRAFT), restores its output.

The same search and answer as the reference engine's `shadowtrace bisect`
(tracer/src/bisect/): production's logits at the compared rows are judged against a reference
(by default the model's own fp32 chain: every weight upcast, FP8 ones dequantized, no hook)
by argmax agreement or mean Jensen-Shannon divergence in bits. Restored means the metric on
the good side of the threshold and no more non-finite rows than the target allows. For each
site: every layer grafted first (no restoration: that site cannot heal it); then the latest
first layer whose range to the last still restores and the earliest last layer from there,
both binary searches: at most 1 + 2 ceil(log2 L) grafted forwards a site. The search assumes
grafting more layers never undoes a restoration; the range reported is one whose own forward
met the target. The answer is the smallest range, ties to the narrowest site.

Each grafted forward is a traced forward of the hooks (a run written under a temporary
directory and removed): tracing must be off when `bisect` is called, as it runs its own
session.
"""

import argparse
import contextlib
import dataclasses
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from shadowtrace_hooks import config, session, shadow, startup

SITES = config.GRAFT_SITES
_NARROWNESS = {"indexer": 0, "attn_out": 1, "mlp_out": 1, "layer_out": 2}


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Production's output against the reference over the compared rows."""

    argmax_agreement: float
    js_bits: float
    nonfinite_rows: int
    rows: int


def compare(prod: torch.Tensor, reference: torch.Tensor) -> Metrics:
    """`prod` against `reference`, both [rows, vocab] logits: the share of rows whose argmax
    is the reference's, and the mean JS divergence in bits; a row with a non-finite logit (in
    either) never agrees and counts 1 bit."""
    if prod.shape != reference.shape:
        raise ValueError(
            f"compare: production {tuple(prod.shape)} against reference {tuple(reference.shape)}"
        )
    prod, reference = prod.double(), reference.double()
    finite = prod.isfinite().all(-1) & reference.isfinite().all(-1)
    rows = finite.shape[0]
    agree = (prod.argmax(-1) == reference.argmax(-1)) & finite
    bad = ~finite[:, None]
    lp = prod.masked_fill(bad, 0.0).log_softmax(-1)
    lq = reference.masked_fill(bad, 0.0).log_softmax(-1)
    lm = torch.logaddexp(lp, lq) - math.log(2)
    kl = lambda log: (log.exp() * (log - lm)).sum(-1)  # noqa: E731
    js = ((kl(lp) + kl(lq)) * (0.5 / math.log(2))).clamp(0, 1).masked_fill(~finite, 1.0)
    return Metrics(
        argmax_agreement=float(agree.double().mean()) if rows else 0.0,
        js_bits=float(js.mean()) if rows else 0.0,
        nonfinite_rows=int((~finite).sum()),
        rows=rows,
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """What restored means: `metric` ("argmax" or "js") on the good side of `threshold`, and
    at most `max_nonfinite_rows` non-finite rows; `source` says where the threshold is from."""

    metric: str
    threshold: float
    max_nonfinite_rows: int
    source: str

    @classmethod
    def clean(cls, metric: str, clean: Metrics, slack: float | None = None) -> "Target":
        """The clean noise floor: a clean production's value less `slack` (argmax, default
        0.01) or times 1 + `slack` (js, default 0.5)."""
        value = _value(metric, clean)
        if metric == "argmax":
            slack = 0.01 if slack is None else slack
            threshold, how = value - slack, f"less a slack of {slack:.3f}"
        else:
            slack = 0.5 if slack is None else slack
            threshold, how = value * (1 + slack), f"times 1 + a slack of {slack:.3f}"
        source = f"production with nothing planted: {_format(metric, value)}, {how}"
        return cls(metric, threshold, clean.nonfinite_rows, source)

    @classmethod
    def given(cls, metric: str, threshold: float) -> "Target":
        return cls(metric, threshold, 0, "given")

    def restored(self, m: Metrics) -> bool:
        v = _value(self.metric, m)
        met = v >= self.threshold if self.metric == "argmax" else v <= self.threshold
        return met and m.nonfinite_rows <= self.max_nonfinite_rows

    def __str__(self) -> str:
        side = ">=" if self.metric == "argmax" else "<="
        name = "argmax agreement" if self.metric == "argmax" else "JS divergence (bits)"
        return (
            f"restored = {name} with the reference {side} {_format(self.metric, self.threshold)} and at "
            f"most {self.max_nonfinite_rows} non-finite rows ({self.source})"
        )


def _value(metric: str, m: Metrics) -> float:
    if metric not in ("argmax", "js"):
        raise ValueError(f"metric {metric!r}: expected argmax or js")
    return m.argmax_agreement if metric == "argmax" else m.js_bits


def _format(metric: str, v: float) -> str:
    return f"{v:.3f}" if metric == "argmax" else f"{v:.2e}"


@dataclasses.dataclass
class Step:
    graft: str
    metrics: Metrics
    restored: bool


@dataclasses.dataclass
class SiteBisection:
    site: str
    layers: tuple[int, int] | None  # the smallest restoring range; None: none restores
    after: Metrics  # with that range grafted, or every layer where none restores
    steps: list[Step]


@dataclasses.dataclass
class Bisection:
    shadow: str
    target: Target
    before: Metrics
    sites: list[SiteBisection]

    def already_restored(self) -> bool:
        return self.target.restored(self.before)

    def named(self) -> SiteBisection | None:
        found = [s for s in self.sites if s.layers is not None]
        if not found:
            return None
        return min(found, key=lambda s: (s.layers[1] - s.layers[0], _NARROWNESS[s.site]))

    def summary(self) -> str:
        """The answer in one line (the reference engine's wording)."""
        m = self.target.metric
        short = "argmax agreement" if m == "argmax" else "JS divergence"
        before, threshold = _format(m, _value(m, self.before)), _format(m, self.target.threshold)
        if self.already_restored():
            return (
                f"production already meets the target ungrafted ({short} {before}, target {threshold}): "
                "nothing to bisect"
            )
        none = [s.site for s in self.sites if s.layers is None]
        none_text = ""
        if len(none) == 1:
            none_text = f"; no {none[0]} graft does"
        elif none:
            none_text = f"; no {', '.join(none[:-1])} or {none[-1]} graft does"
        named = self.named()
        if named is None:
            sites = ", ".join(s.site for s in self.sites)
            return f"no graft of the {self.shadow} {sites} restores {short} {before} to {threshold}"
        wider = [f"{s.site} at {_layers(s.layers)}" for s in self.sites if s.layers and s.site != named.site]
        wider_text = f"; also {', '.join(wider)}" if wider else ""
        after = _format(m, _value(m, named.after))
        return (
            f"grafting the {self.shadow} {named.site} at {_layers(named.layers)} restores {short} "
            f"{before} -> {after}{wider_text}{none_text}"
        )


def _layers(layers: tuple[int, int] | None) -> str:
    if layers is None:
        return "no layer"
    a, b = layers
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def max_forwards(layers: int, sites: int) -> int:
    """The most grafted forwards a bisection over `layers` layers and `sites` sites runs."""
    return sites * (1 + 2 * math.ceil(math.log2(max(layers, 1))))


def reference_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32, **kwargs: Any
) -> torch.Tensor:
    """The model's own chain in `dtype`: every bf16/fp16 weight upcast, FP8 linears and expert
    banks on their codes times their scales (the shadow's machinery), TF32 off, no hook of
    anyone's firing. [batch, seq, vocab] fp32; `kwargs` go to the model (`logits_to_keep`).

    A decoder layer's weights are upcast only while that layer runs, and routed experts one
    at a time, as the shadow does: the copies held at once are one layer's (the embeddings,
    final norm and head are upcast for the whole call)."""
    if session.current() is not None:
        raise RuntimeError("reference_logits: tracing is on; call it with no shadowtrace session")
    layers = list(model.model.layers)
    in_layers = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    banks = shadow.expert_banks(model)
    in_banks = shadow.bank_tensors(banks)
    upcast: dict[int, contextlib.ExitStack] = {}

    def enter(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(shadow.in_precision(module, dtype, keep=lambda t: id(t) in in_banks))
            upcast[i] = stack

        return hook

    def leave(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            upcast.pop(i).close()

        return hook

    outside_layers = lambda t: id(t) in in_banks or id(t) in in_layers  # noqa: E731
    with (
        shadow.full_fp32(),
        shadow.in_precision(model, dtype, keep=outside_layers),
        shadow.routed_experts(banks, dtype),
        shadow.hooks_suspended(model),
        torch.no_grad(),
    ):
        # Registered inside hooks_suspended: gone with it.
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(enter(i))
            layer.register_forward_hook(leave(i), always_call=True)
        try:
            return model(input_ids, **kwargs).logits.float()
        finally:
            for stack in upcast.values():
                stack.close()


def bisect(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    threshold: float | None = None,
    clean: torch.Tensor | None = None,
    metric: str = "argmax",
    slack: float | None = None,
    sites: Sequence[str] = SITES,
    last: int | None = None,
    reference: torch.Tensor | None = None,
    progress: Callable[[str], None] | None = None,
) -> Bisection:
    """Bisects `model` (transformers' glm_moe_dsa or deepseek_v32, production as loaded, any
    fault a user's forward hook plants included) on one prompt `input_ids` [1, S].

    The target: `threshold`, or the clean noise floor of `clean` (a clean production's logits
    [1, S, vocab] or its last `last` positions, for example before the fault was planted)
    with `slack`. `last` compares the last N positions only (and has the model compute no
    other logits: `logits_to_keep`); `reference` replaces the fp32 chain. `progress` gets one
    line per forward (default: stderr)."""
    if session.current() is not None:
        raise RuntimeError("bisect runs its own tracing session: call it with tracing off")
    unknown = [s for s in sites if s not in SITES]
    if unknown or not sites or len(set(sites)) != len(sites):
        raise ValueError(f"sites {list(sites)}: expected one or more of {', '.join(SITES)}, each once")
    _value(metric, Metrics(0.0, 0.0, 0, 0))  # an unknown metric is refused before any forward
    if last is not None and last < 1:
        raise ValueError(f"last {last}: expected at least 1 position")
    if (threshold is None) == (clean is None):
        raise ValueError("give exactly one of threshold and clean (the clean noise floor's logits)")
    say = progress or (lambda line: print(line, file=sys.stderr))
    keep = {"logits_to_keep": last} if last else {}
    if reference is None:
        reference = reference_logits(model, input_ids, **keep)
    pick = slice(-last, None) if last else slice(None)
    ref = reference[0, pick]
    layers = len(model.model.layers)
    with tempfile.TemporaryDirectory(prefix="shadowtrace-bisect-") as runs:
        environ = {
            "SHADOWTRACE": "1",
            "SHADOWTRACE_DIR": runs,
            # Only layer_in, which has no shadow: no layer is re-run but the grafted ones, and
            # no shadow logits are computed (the search reads production's logits alone).
            "SHADOWTRACE_SITES": "layer_in",
            # Every site at every layer: the tracer registers its graft hooks when it attaches;
            # each forward below then says which it takes.
            "SHADOWTRACE_GRAFT": ",".join(sites),
        }
        sess = startup.activate(environ)
        if sess is None:
            raise RuntimeError("bisect: the tracing session did not start")
        try:
            return _search(
                model, input_ids, keep, sess, ref, pick, layers, sites, threshold, clean, metric, slack, say
            )
        finally:
            session.stop()


def _search(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    keep: dict,
    sess: Any,
    ref: torch.Tensor,
    pick: slice,
    layers: int,
    sites: Sequence[str],
    threshold: float | None,
    clean: torch.Tensor | None,
    metric: str,
    slack: float | None,
    say: Callable[[str], None],
) -> Bisection:
    # The tracer registers its graft hooks when it attaches, at its first forward, if grafts
    # are set then: a one-token forward with the session's grafts attaches it.
    with torch.no_grad():
        model(input_ids[:, :1])
    tracer = model.__dict__.get("_shadowtrace")
    if tracer is None or tracer.sess is not sess:
        raise RuntimeError(
            f"bisect: no shadowtrace adapter traces {type(model).__name__} "
            "(grafts: transformers' glm_moe_dsa and deepseek_v32)"
        )
    if tracer.graft_refused is not None:
        raise RuntimeError(f"bisect: the hooks cannot graft this model: {tracer.graft_refused}")
    decoder = tracer._decoder().layers

    def forward(grafts: list[dict]) -> Metrics:
        sess.settings.grafts = grafts
        tracer.grafts_applied = 0
        with torch.no_grad():
            logits = model(input_ids, **keep).logits
        # Every graft asked for must have been taken: one that silently did not (a shadow
        # re-run that failed and was disabled) would read as "this graft does not heal".
        wanted = sum(
            1
            for i, layer in enumerate(decoder)
            for site in sess.settings.graft_sites(i)
            if site != "indexer" or tracer._indexer_module(layer) is not None
        )
        if tracer.grafts_applied != wanted:
            failed = "; ".join(f"{k}: {v}" for k, v in sess.disabled.items()) or "none disabled"
            raise RuntimeError(
                f"bisect: {tracer.grafts_applied} of {wanted} grafted (layer, site) values were taken "
                f"(captures disabled: {failed})"
            )
        return compare(logits[0, pick].float(), ref)

    before = forward([])
    if threshold is not None:
        target = Target.given(metric, threshold)
    else:
        assert clean is not None
        target = Target.clean(metric, compare(clean[0, pick].float(), ref), slack)
    say(f"target: {target}")
    result = Bisection(shadow.dtype_name(sess.settings.shadow_dtype), target, before, [])
    if result.already_restored():
        return result
    budget = max_forwards(layers, len(sites))
    done = [0]
    for site in sites:
        seen: dict[tuple[int, int], Metrics] = {}
        steps: list[Step] = []

        def ok(a: int, b: int, site: str = site, seen: dict = seen, steps: list = steps) -> bool:
            if (a, b) not in seen:
                graft = f"{site}@{a}" if a == b else f"{site}@{a}-{b}"
                m = forward([{"site": site, "layers": [a, b]}])
                seen[(a, b)] = m
                steps.append(Step(graft, m, target.restored(m)))
                done[0] += 1
                word = "restores" if target.restored(m) else "does not"
                say(f"  bisect [{done[0]}/{budget}] {graft} {word}")
            return target.restored(seen[(a, b)])

        last = layers - 1
        found = None
        if ok(0, last):
            a, b = 0, layers
            while b - a > 1:
                m = (a + b) // 2
                a, b = (m, b) if ok(m, last) else (a, m)
            c, d = a - 1, last
            while d - c > 1:
                m = (c + d) // 2
                c, d = (c, m) if ok(a, m) else (m, d)
            found = (a, d)
        result.sites.append(SiteBisection(site, found, seen[found or (0, last)], steps))
    return result


# Files a model directory holds its tokenizer in, any of which AutoTokenizer reads.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def main(args: argparse.Namespace) -> int:
    """`python -m shadowtrace_hooks bisect` with its parsed arguments (__main__.py): bad input
    is one `error:` line and exit status 2, never a traceback."""
    import json

    import transformers

    last = _last_rows(args.rows, args.last)
    if last == 0:
        return 2
    # A hub id is no local path; a path that says it is one must exist.
    local = args.model.is_absolute() or args.model.parts[:1] == ("..",)
    if local and not args.model.is_dir():
        print(f"error: model {args.model}: no such directory", file=sys.stderr)
        return 2
    try:
        text = args.prompt.read_text()
    except OSError as e:
        print(f"error: prompt {args.prompt}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        ids = [int(i) for i in json.loads(text)]
    except (ValueError, TypeError):
        ids = _tokenize(args.model, args.prompt, text)
        if ids is None:
            return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    except (OSError, ValueError) as e:
        print(f"error: model {args.model}: {_first_line(e)}", file=sys.stderr)
        return 2
    model = model.to(device).eval()
    input_ids = torch.tensor([ids], device=device)
    try:
        result = bisect(
            model, input_ids, threshold=args.threshold, metric=args.metric,
            sites=[s.strip() for s in args.sites.split(",") if s.strip()], last=last,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    b = result.before
    print(
        f"production ungrafted: argmax agreement {b.argmax_agreement:.3f}, JS divergence {b.js_bits:.2e} "
        f"bits, {b.nonfinite_rows} non-finite rows of {b.rows}"
    )
    for s in result.sites:
        layers = "none" if s.layers is None else _layers(s.layers)
        print(f"{s.site:<10} {layers:<14} argmax {s.after.argmax_agreement:.3f}  JS {s.after.js_bits:.2e}  "
              f"{len(s.steps)} forwards")  # fmt: skip
    print(result.summary())
    return 0


def _last_rows(rows: str, last: int | None) -> int | None:
    """How many last rows `--rows` (or the old `--last N`) compares: None for all; 0 after
    saying in one line why the value cannot be read."""
    if last is not None:
        print(
            f"warning: --last {last} is renamed --rows last:{last}, as `shadowtrace bisect` spells it",
            file=sys.stderr,
        )
        rows = f"last:{last}"
    if rows == "all":
        return None
    kind, _, n = rows.partition(":")
    if kind == "last" and n.isascii() and n.isdigit() and int(n) >= 1:
        return int(n)
    print(
        f"error: --rows {rows}: expected all or last:N with N >= 1 (every:N is not implemented here)",
        file=sys.stderr,
    )
    return 0


def _tokenize(model: Path, prompt: Path, text: str) -> list[int] | None:
    """`text` through `model`'s tokenizer, or None after saying in one line why it cannot be."""
    import transformers

    if model.is_dir() and not any((model / name).is_file() for name in _TOKENIZER_FILES):
        print(
            f"error: prompt {prompt} is text, and this model has no tokenizer ({model} holds none of "
            f"{', '.join(_TOKENIZER_FILES)}): pass a JSON list of ids",
            file=sys.stderr,
        )
        return None
    try:
        return list(transformers.AutoTokenizer.from_pretrained(model)(text)["input_ids"])
    except Exception as e:  # transformers raises many kinds for a tokenizer it cannot load
        print(
            f"error: prompt {prompt} is text, and the tokenizer of {model} did not load "
            f"({type(e).__name__}: {_first_line(e)}): pass a JSON list of ids",
            file=sys.stderr,
        )
        return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
