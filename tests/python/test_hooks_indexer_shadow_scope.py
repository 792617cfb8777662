"""SHADOWTRACE_SHADOW_SCOPE=indexer: the shadow recomputes only the indexer, in fp32, from
production's input of the indexer. Tiny random GLM-5 and DeepSeek-V3.2 models of transformers
traced in-process: its selections against the full-layer shadow's and against transformers'
own indexer module run in fp32 on the same input."""

import json
import struct
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import tiny_models
import torch
from shadowtrace_hooks import session, startup

K, LENGTH = 16, 80  # most rows see more than k keys: sparse rows


def trace(out: Path, model: torch.nn.Module, **env: str) -> tuple[dict, Path]:
    environ = {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(out), "SHADOWTRACE_TOPK_LISTS": "all", **env}
    assert startup.activate(environ) is not None
    try:
        with torch.no_grad():
            model(tiny_models.prompt(LENGTH))
    finally:
        session.stop()
    (run,) = out.iterdir()
    return json.loads((run / "manifest.json").read_text()), run


def table(run: Path, name: str) -> list[dict[str, Any]]:
    return pq.read_table(run / name).to_pylist()


def keys(gaps: list[int] | None) -> list[int]:
    out, at = [], 0
    for i, gap in enumerate(gaps or []):
        at = gap if i == 0 else at + gap
        out.append(at)
    return out


def shadow_selection(row: dict) -> list[int]:
    """The shadow's selected keys: production's, less the keys only production selected,
    plus those only the shadow selected."""
    return sorted(
        (set(keys(row["prod_gaps"])) - set(keys(row["prod_only_gaps"]))) | set(keys(row["shadow_only_gaps"]))
    )


def fp32_copy(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    fresh = type(module)(*args, **kwargs)
    for name, buffer in module.named_buffers():
        setattr(fresh, name, buffer.float())
    fresh.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    return fresh.float().eval()


def topk_rows(run: Path) -> list[dict]:
    return sorted(table(run, "topk"), key=lambda r: (r["layer"], r["token"]))


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_the_indexer_scope_selects_what_the_full_layer_shadow_selects(tmp_path: Path, family: str) -> None:
    build = getattr(tiny_models, family)
    layer_manifest, layer_run = trace(tmp_path / "layer", build(index_topk=K))
    manifest, run = trace(tmp_path / "indexer", build(index_topk=K), SHADOWTRACE_SHADOW_SCOPE="indexer")
    layers = build(index_topk=K).config.num_hidden_layers

    assert layer_manifest["settings"]["shadow_scope"] == "layer"
    assert manifest["settings"]["shadow_scope"] == "indexer"
    assert manifest["shadow"] == {"precision": "fp32", "modes": ["local"]}
    assert manifest["settings"].get("disabled_sites") is None
    assert manifest["counters"].get("hook_errors", 0) == 0
    # no layer was re-run: every site's statistics are production's alone, and so are the logits
    hidden = table(run, "hidden")
    assert len(hidden) == layers * 4 * LENGTH
    assert {r["shadow_mode"] for r in hidden} == {None}
    assert {r["shadow_mode"] for r in table(layer_run, "hidden")} == {None, "local"}
    assert manifest["settings"]["logits_shadow_mode"] is None
    assert all(r["shadow_top_ids"] is None for r in table(run, "logits"))

    rows, layer_rows = topk_rows(run), topk_rows(layer_run)
    assert len(rows) == len(layer_rows) == layers * LENGTH
    assert sum(r["visible"] > K for r in rows) == layers * (LENGTH - K)
    for a, b in zip(rows, layer_rows, strict=True):
        assert (a["layer"], a["token"]) == (b["layer"], b["token"])
        assert a["shadow_selected"] == b["shadow_selected"] > 0
        assert shadow_selection(a) == shadow_selection(b)
        for name in ("shadow_kth_score", "shadow_kth_margin", "jaccard", "jaccard_no_churn"):
            pack = [None if r[name] is None else struct.pack("<f", r[name]) for r in (a, b)]
            assert pack[0] == pack[1], (name, a["layer"], a["token"])


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_the_indexer_scope_selects_what_transformers_indexer_selects_in_fp32(
    tmp_path: Path, family: str
) -> None:
    model = getattr(tiny_models, family)(index_topk=K)
    seen: dict[int, tuple[tuple, dict]] = {}
    for i, layer in enumerate(model.model.layers):

        def keep(module: torch.nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            seen[i] = (args, dict(kwargs))

        layer.self_attn.indexer.register_forward_pre_hook(keep, with_kwargs=True)
    _, run = trace(tmp_path, model, SHADOWTRACE_SHADOW_SCOPE="indexer")

    # Fresh modules of transformers' own classes holding the model's weights and buffers in
    # fp32 (a deep copy would drag the tracer's hooks along).
    rotary = fp32_copy(model.model.rotary_emb, config=model.config)
    names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
    expected: dict[int, torch.Tensor] = {}
    for i, (args, kwargs) in seen.items():
        given = dict(zip(names, args, strict=False)) | kwargs
        hidden, q_resid = given["hidden_states"].float(), given["q_resid"].float()
        positions = torch.arange(LENGTH)[None]
        indexer = fp32_copy(model.model.layers[i].self_attn.indexer, model.config, i)
        with torch.no_grad():
            expected[i] = indexer(
                hidden, q_resid, rotary(hidden, positions), given["attention_mask"], positions
            )[0]
    rows = topk_rows(run)
    # bf16 production selects otherwise somewhere: what matches here is the fp32 shadow
    assert any(row["prod_only_gaps"] for row in rows)
    checked = 0
    for row in rows:
        visible = row["visible"]
        want = sorted(s for s in expected[row["layer"]][row["token"]].tolist() if 0 <= s < visible)
        assert shadow_selection(row) == want, (row["layer"], row["token"])
        checked += visible > K
    assert checked == model.config.num_hidden_layers * (LENGTH - K)
