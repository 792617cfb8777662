"""Per-token hidden-state statistics, non-finite events and logits summaries, computed on
the tensor's device and brought to the host as a few small arrays per capture.

Definitions are the columns' docs in schemas/v1/hidden.json, events.json and logits.json.
"""

import math

import numpy as np
import torch

_KINDS = ("nan", "pos_inf", "neg_inf")


def _counts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.isnan().sum(-1), (x == math.inf).sum(-1), (x == -math.inf).sum(-1)


def _finite_norms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    return finite.abs().amax(-1), finite.norm(dim=-1)


def hidden_columns(
    prod: torch.Tensor, shadow: torch.Tensor | None, tokens: torch.Tensor
) -> dict[str, np.ndarray]:
    """Statistics of rows `tokens` of prod [T, N] (and shadow [T, N]), as hidden-table columns."""
    p = prod.detach()[tokens].double()
    cols: dict[str, torch.Tensor] = {}
    cols["prod_nan"], cols["prod_pos_inf"], cols["prod_neg_inf"] = _counts(p)
    cols["prod_max_abs"], cols["prod_l2"] = _finite_norms(p)
    if shadow is not None:
        s = shadow.detach()[tokens].double()
        cols["shadow_nan"], cols["shadow_pos_inf"], cols["shadow_neg_inf"] = _counts(s)
        cols["shadow_max_abs"], cols["shadow_l2"] = _finite_norms(s)
        # Non-finite anywhere in either vector makes the comparison NaN, as the docs say.
        diff = p - s
        diff_norm, shadow_norm = diff.norm(dim=-1), s.norm(dim=-1)
        # Against a zero shadow: 0 when prod is zero too, +inf otherwise (never 0/0 = NaN,
        # which reads as a non-finite vector).
        against_zero = torch.where(diff_norm > 0, math.inf, 0.0).to(diff_norm.dtype)
        cols["rel_l2_err"] = torch.where(shadow_norm != 0, diff_norm / shadow_norm, against_zero)
        cols["cosine"] = (p * s).sum(-1) / (p.norm(dim=-1) * s.norm(dim=-1))
        cols["max_abs_diff"] = diff.abs().amax(-1)
        bad = ~(torch.isfinite(p).all(-1) & torch.isfinite(s).all(-1))
        for name in ("rel_l2_err", "cosine", "max_abs_diff"):
            cols[name] = torch.where(bad, torch.full_like(cols[name], math.nan), cols[name])
    out = {}
    for name, value in cols.items():
        host = value.cpu().numpy()
        out[name] = host.astype(np.int64) if host.dtype.kind in "iub" else host.astype(np.float32)
    out["numel"] = np.full(len(tokens), prod.shape[-1], dtype=np.int64)
    out["token"] = tokens.cpu().numpy().astype(np.int32)
    return out


def nonfinite_events(prod: torch.Tensor, shadow: torch.Tensor | None) -> list[dict]:
    """One event per non-finite kind present in prod [T, N]: its count over the whole tensor,
    the first (token, channel) holding it, and whether the shadow was finite at that token.
    Nothing is synchronised when the tensor is finite beyond one scalar check."""
    p = prod.detach()
    if bool(torch.isfinite(p).all()):
        return []
    events = []
    for kind, where in zip(_KINDS, (p.isnan(), p == math.inf, p == -math.inf), strict=True):
        count = int(where.sum())
        if count == 0:
            continue
        token, channel = (int(v) for v in where.nonzero()[0])
        shadow_finite = None if shadow is None else bool(torch.isfinite(shadow[token]).all())
        events.append(
            {"kind": kind, "token": token, "channel": channel, "count": count, "shadow_finite": shadow_finite}
        )
    return events


def indexer_events(
    scores: torch.Tensor, q_pos: torch.Tensor, shadow: torch.Tensor | None = None
) -> list[dict]:
    """`nonfinite_events` of an indexer score matrix [T, S] whose query t sees keys
    s <= q_pos[t]: the -inf beyond them is the mask, not a score. token is the first query
    row holding the kind, channel its first key, count over every visible score; with the
    shadow's scores, whether they were finite over that query's visible keys."""
    visible = torch.arange(scores.shape[1], device=scores.device)[None, :] <= q_pos[:, None]
    p = scores.detach()
    p = torch.where(visible, p, torch.zeros_like(p))
    events = nonfinite_events(p, None)
    for event in events:
        if shadow is not None:
            row = shadow.detach()[event["token"]][visible[event["token"]]]
            event["shadow_finite"] = bool(torch.isfinite(row).all())
    return events


def logits_columns(prod: torch.Tensor, shadow: torch.Tensor | None, top_n: int) -> dict:
    """Top-N ids and log-probabilities per position of prod logits [T, V] (and shadow), as
    flat list columns."""
    from shadowtrace_hooks.numerics import Lists

    def top(x: torch.Tensor) -> tuple[Lists, Lists]:
        logprobs = torch.log_softmax(x.detach().float(), dim=-1)
        n = min(top_n, x.shape[-1])
        values, ids = logprobs.topk(n, dim=-1)
        offsets = np.arange(0, (x.shape[0] + 1) * n, n, dtype=np.int32)
        return (
            Lists(ids.to(torch.int32).cpu().numpy().reshape(-1), offsets),
            Lists(values.cpu().numpy().reshape(-1), offsets.copy()),
        )

    out: dict = {"token": np.arange(prod.shape[0], dtype=np.int32)}
    out["prod_top_ids"], out["prod_top_logprobs"] = top(prod)
    if shadow is not None:
        out["shadow_top_ids"], out["shadow_top_logprobs"] = top(shadow)
    return out
