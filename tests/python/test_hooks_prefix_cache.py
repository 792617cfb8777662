"""The prefix-cache hit/miss pair (context 004) on transformers 5.24's `qwen3_5_moe`, whose
Gated DeltaNet layers carry recurrent state: one process computes a prompt from scratch
(a cache miss), fills a cache with all of it but its last token, and serves the prompt
again from copies of that cache (hits that recompute one token, the tail of context 004):
once as it is, and once with layer 1's recurrent state stale (as it was 32 tokens
earlier). `shadowtrace analyze` pairs the hits with the miss by prompt and names the layer
where the stale one parts; the clean one is not flagged."""

import json
import subprocess
from pathlib import Path

import torch
from conftest import binary
from test_hooks_family import bitwise, run_family
from test_hooks_transformers import assert_nothing_disabled, manifests

LENGTH, PREFIX, STALE_LAYER = 100, 99, 1
ARGS = ("--generate", "2", "--prefix", str(PREFIX), "--stale-layer", str(STALE_LAYER), "--stale-by", "32")


def test_a_stale_recurrent_state_in_a_reused_cache_is_named_and_a_clean_reuse_is_not(tmp_path: Path) -> None:
    untraced, _ = run_family(tmp_path, "qwen3_5_moe", LENGTH, *ARGS)
    traced, runs = run_family(
        tmp_path, "qwen3_5_moe", LENGTH, *ARGS, SHADOWTRACE="1", SHADOWTRACE_MODE="local,free"
    )
    for name in ("miss", "hit", "stale_hit"):
        assert torch.equal(traced[name]["ids"], untraced[name]["ids"]), name
        assert bitwise(traced[name]["logits"], untraced[name]["logits"]), name

    by_request = {m["tags"]["request"]: m for m in manifests(runs)}
    hashes = {m["prompt"]["token_hash"] for m in by_request.values() if m["prompt"]["length"] == LENGTH}
    assert len(hashes) == 1  # the hits name the whole prompt, as the miss does
    for m in by_request.values():
        assert m["status"] == "complete"
        assert_nothing_disabled(m)
    hits = [m for m in by_request.values() if m["tags"]["cache"] == "hit"]
    assert len(hits) == 2
    for m in hits:
        assert m["prompt"]["length"] == LENGTH
        assert m["settings"]["cached_prefix_tokens"] == PREFIX
        # the local shadow of the one recomputed token needs the prefix's state: counted
        assert m["counters"]["shadow_skipped_cached_prefix"] == 1

    out = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    cache = json.loads(out.stdout)["cache"]
    assert cache["unpaired"] == []
    assert "|err(hit) - err(miss)| > 0.1" in cache["rule"]
    clean, stale = cache["pairs"]  # in path order: the clean hit was served first
    for pair in (clean, stale):
        assert pair["token"] == LENGTH - 1
        assert pair["notes"] == []
    assert clean["parted"] is None
    assert max(s["gap"] for s in clean["sites"] if s["gap"] is not None) < 1e-3
    assert clean["first_token"]["argmax_agreement"] == 1.0
    assert (stale["parted"]["layer"], stale["parted"]["site"]) == (STALE_LAYER, "attn_out")
    assert stale["parted"]["gap"] > 0.5
    # layers before the stale one are computed alike from the cache and from scratch
    assert all(s["gap"] < 1e-3 for s in stale["sites"] if s["layer"] < STALE_LAYER and s["gap"] is not None)

    fail = subprocess.run(
        [binary("shadowtrace"), "analyze", runs, "--fail-on", "cache"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert fail.returncode == 1, fail.stdout + fail.stderr
    assert f"layer {STALE_LAYER} attn_out" in fail.stdout
