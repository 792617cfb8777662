"""The capture self-check tells a top-k kernel that drops winners from an adapter misreading
the engine, on transformers' own trained models traced through the HF hooks.

Layer 0's indexer is patched (deviation_patches.py, written from the upstream reports): once
with the radix top-k whose overflowing candidate buffer drops winners (`drops_winners`), once
with a selection read one query late (each row gets the exact top-k of the query before it,
what an adapter reading rows against the wrong tokens records). Both leave production's
selection contradicting production's own scores, which the hooks capture from the top-k
call. The first must read `TOP-K SHORT OF WINNERS` at layer 0, a top-k verdict; the second
must stay `CAPTURE INCONSISTENT`. Layers 1 and 2 select exactly and agree (layer 0 is the
one whose rows test_deviation_patches.py shows overflowing a 256-entry buffer)."""

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import trained
from conftest import binary
from deviation_patches import drops_winners, exact, selecting

T, K, LAYER = 3072, 2048, 0
# The candidate buffer of test_deviation_patches: some rows of these models overflow it.
CAPACITY = 256


def at_layer(select: Callable[[torch.Tensor, int, int], torch.Tensor]) -> Callable:
    def only(scores: torch.Tensor, k: int, layer: int) -> torch.Tensor:
        return select(scores, k, layer) if layer == LAYER else exact(scores, k, layer)

    return only


def one_query_late(scores: torch.Tensor, k: int, layer: int) -> torch.Tensor:
    """Each row the exact top-k of the row before it (the first row its own)."""
    top = exact(scores, k, layer)
    return torch.cat([top[:, :1], top[:, :-1]], dim=1)


def traced(root: Path, family: str, select: Callable) -> dict:
    """One forward of `family` at T tokens with layer 0's top-k `select`, traced into `root`
    (indexer site only), and `shadowtrace analyze` of it: its JSON and its text."""
    from shadowtrace_hooks import session, startup

    model = trained.load(family)
    env = {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(root), "SHADOWTRACE_SITES": "indexer"}
    assert startup.activate(env) is not None
    try:
        with selecting(model, at_layer(select)), torch.no_grad():
            model(trained.prompt(T))
    finally:
        session.stop()
    out = {}
    for fmt in ("json", "text"):
        done = subprocess.run([binary("shadowtrace"), "analyze", root, "--format", fmt],
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        out[fmt] = done.stdout
    topk = subprocess.run([binary("shadowtrace"), "analyze", root, "--fail-on", "topk"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    (manifest,) = [json.loads(p.read_text()) for p in root.glob("*/manifest.json")]
    return {"json": json.loads(out["json"]), "text": out["text"], "fail_topk": topk, "manifest": manifest}


@pytest.mark.parametrize("family", list(trained.NAMES))
def test_a_top_k_that_drops_winners_is_a_top_k_verdict_and_a_misread_stays_capture_inconsistent(
    tmp_path: Path, family: str
) -> None:
    drops = traced(tmp_path / "drops", family, drops_winners(CAPACITY))
    check = drops["manifest"]["settings"]["capture_check"]
    assert check["short_of_winners_rule"] == {"kept_top": 0.25, "recall": 0.5}
    layers = check["layers"]
    assert layers["1"]["disagree"] == layers["2"]["disagree"] == 0
    dropped = layers[str(LAYER)]
    assert dropped["disagree"] > 0, (family, "some row overflows the buffer and loses a winner")
    assert dropped["short_of_winners"] == dropped["disagree"], (family, dropped)
    assert dropped["short_recall"] >= 0.5
    assert dropped["short_kept_top"] >= 0.25
    text = drops["text"]
    assert f"TOP-K SHORT OF WINNERS at layer {LAYER}: " in text, text
    assert "the top-k kernel drops winners; the adapter reads the engine" in text
    assert "CAPTURE INCONSISTENT" not in text
    (run,) = drops["json"]["runs"]
    assert run["capture_check"]["short_of_winners_rule"] == {"kept_top": 0.25, "recall": 0.5}
    assert run["capture_check"]["layers"][LAYER]["short_of_winners"] == dropped["disagree"]
    # A numerics finding, judged: --fail-on topk fails the run on it.
    assert drops["fail_topk"].returncode == 1, drops["fail_topk"].stderr
    assert f"topk short of winners@L{LAYER}" in drops["fail_topk"].stdout + drops["fail_topk"].stderr

    late = traced(tmp_path / "late", family, one_query_late)
    misread = late["manifest"]["settings"]["capture_check"]["layers"][str(LAYER)]
    assert misread["disagree"] > 0.9 * misread["rows"], misread
    assert misread["short_of_winners"] < 0.5 * misread["disagree"], misread
    assert f"CAPTURE INCONSISTENT at layer {LAYER}: " in late["text"], late["text"]
    assert "TOP-K SHORT OF WINNERS" not in late["text"]
