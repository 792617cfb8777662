"""The TensorRT-LLM, SGLang and vLLM adapters, installed on stand-ins with the upstream
signatures and fed synthetic tensors of the real shapes: the rows they record, their two
shadows, one run per request, and refusal of a layout they were not written for."""

import json
from pathlib import Path

import fake_engines as fe
import pyarrow.parquet as pq
import pytest
import torch
from shadowtrace_hooks import session, startup
from shadowtrace_hooks.adapters import sglang, trtllm, vllm
from shadowtrace_hooks.adapters.engine import UnsupportedVersion

LONG, SHORT = fe.TOPK + 52, 300


def start(tmp_path: Path) -> None:
    assert startup.activate(
        {"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path), "SHADOWTRACE_TAGS": "model=fake"}
    )


def runs(tmp_path: Path) -> dict[int, dict]:
    """Manifests and topk rows of every run, keyed by prompt length."""
    out = {}
    for manifest_path in tmp_path.glob("*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        files = manifest["tables"]["topk"]["files"]
        rows = pq.read_table([manifest_path.parent / f for f in files]).to_pylist() if files else []
        out[manifest["prompt"]["length"]] = {"manifest": manifest, "rows": rows}
    return out


def jaccard(a: list[int], b: list[int]) -> float:
    return len(set(a) & set(b)) / len(set(a) | set(b))


def check_shadows(rows: list[dict], layers: int, length: int) -> None:
    """Every query row once per shadow input; the dequant shadow reproduces production
    exactly (same FP8 operands, same fp32 product); the raw one stays close."""
    by_input: dict[str, list[dict]] = {}
    for row in rows:
        by_input.setdefault(row["shadow_input"], []).append(row)
    assert sorted(by_input) == ["dequant", "raw"]
    for shadow_input, group in by_input.items():
        assert len(group) == layers * length
        informative = [r for r in group if r["visible"] > r["k"]]
        assert len(informative) == layers * max(0, length - fe.TOPK)
        for r in group:
            assert r["prod_indices"] == sorted(r["prod_indices"])
            assert len(r["prod_indices"]) == min(r["visible"], r["k"])
        if not informative:
            continue
        if shadow_input == "dequant":
            # equal up to which of the keys tied at the k-th score each top-k kept
            for r in informative:
                differ = set(r["prod_indices"]) ^ set(r["shadow_indices"])
                assert differ <= set(r["shadow_boundary_indices"]), (r["layer"], r["token"], differ)
        else:
            mean = sum(jaccard(r["prod_indices"], r["shadow_indices"]) for r in informative) / len(
                informative
            )
            assert mean > 0.9, mean


def test_trtllm_records_each_request_as_a_run_with_both_shadows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fe.register(monkeypatch, "tensorrt_llm", __version__="1.3.0rc-test")
    fe.register(monkeypatch, trtllm.MODULE, Indexer=type("Indexer", (fe.TrtllmIndexer,), {}))
    start(tmp_path)
    try:
        indexers = [sys_indexer(trtllm.MODULE)(layer) for layer in range(2)]
        x, qr = fe.inputs(LONG + SHORT, seed=1)
        positions = torch.cat([torch.arange(LONG), torch.arange(SHORT)])
        context = fe.trtllm_metadata([(11, LONG, 0), (12, SHORT, 0)], contexts=2)
        for ix in indexers:
            inter = ix.pre_indexer_proj(qr, x, positions)
            ix.forward_from_projected(context, qr, list(inter), is_generation=False)
        for decode in ([(11, 1, LONG), (12, 1, SHORT)], [(11, 1, LONG + 1)]):
            meta = fe.trtllm_metadata(decode, contexts=0)
            xd, qd = fe.inputs(len(decode), seed=2)
            pos = torch.tensor([c for _, _, c in decode])
            for ix in indexers:
                ix.forward_from_projected(
                    meta, qd, list(ix.pre_indexer_proj(qd, xd, pos)), is_generation=True
                )
    finally:
        session.stop()
    got = runs(tmp_path)
    assert sorted(got) == [SHORT, LONG]
    for length, decode_steps in ((LONG, 2), (SHORT, 1)):
        manifest, rows = got[length]["manifest"], got[length]["rows"]
        assert manifest["status"] == "complete"
        assert manifest["engine"]["name"] == "tensorrt_llm"
        assert manifest["model"]["name"] == "fake"
        assert manifest["tags"]["request"] == f"trtllm-{11 if length == LONG else 12}"
        assert manifest["counters"]["shadow_skipped_rows_without_keys"] == 2 * decode_steps
        prefill = [r for r in rows if r["step"] == 0]
        check_shadows(prefill, layers=2, length=length)
        decode = [r for r in rows if r["step"] > 0]
        assert len(decode) == 2 * decode_steps
        assert all(r["shadow_input"] is None and r["token"] == r["visible"] - 1 for r in decode)


def sys_indexer(module: str) -> type:
    import sys

    return sys.modules[module].Indexer


def test_sglang_records_positions_only_when_fused_topk_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fe.register(monkeypatch, "sglang", __version__="0.5.23-test")
    fe.register(monkeypatch, sglang.MODULES[0], Indexer=type("Indexer", (fe.SglangIndexer,), {}))
    x, qr = fe.inputs(LONG + SHORT, seed=3)
    positions = torch.cat([torch.arange(LONG), torch.arange(SHORT)])
    batch = fe.sglang_batch([LONG, SHORT])

    monkeypatch.delenv("SGLANG_DSA_FUSE_TOPK", raising=False)
    monkeypatch.delenv("SGLANG_NSA_FUSE_TOPK", raising=False)
    start(tmp_path / "fused")
    try:
        sys_indexer(sglang.MODULES[0])(0).forward_cuda(x, qr, positions, batch, 0)
        assert session.current().counters == {"topk_fused_not_recorded": 1}
    finally:
        session.stop()
    assert not list((tmp_path / "fused").glob("*/manifest.json"))

    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    start(tmp_path / "positions")
    try:
        for layer in range(2):
            sys_indexer(sglang.MODULES[0])(layer).forward_cuda(x, qr, positions, batch, layer)
    finally:
        session.stop()
    got = runs(tmp_path / "positions")
    assert sorted(got) == [SHORT, LONG]
    for length in (SHORT, LONG):
        assert got[length]["manifest"]["engine"] == {
            "name": "sglang", "version": "0.5.23-test", "commit": None, "variant": "sglang",
        }  # fmt: skip
        check_shadows(got[length]["rows"], layers=2, length=length)


def test_vllm_records_prefill_requests_from_the_shared_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fe.register(monkeypatch, "vllm", __version__="0.11-test")
    fe.register(monkeypatch, "vllm.forward_context", get_forward_context=lambda: fe.FORWARD_CONTEXT)
    fe.register(
        monkeypatch, vllm.OP_MODULE, SparseAttnIndexer=type("SparseAttnIndexer", (fe.SparseAttnIndexer,), {})
    )
    fe.register(monkeypatch, vllm.MODEL_MODULE, Indexer=type("Indexer", (fe.VllmIndexer,), {}))
    buffer = torch.empty(LONG + SHORT + 16, fe.TOPK, dtype=torch.int32)
    x, qr = fe.inputs(LONG + SHORT, seed=4)
    positions = torch.cat([torch.arange(LONG), torch.arange(SHORT)])
    rope = fe.Rope(neox=False)
    start(tmp_path)
    try:
        for layer in range(2):
            ix = sys_indexer(vllm.MODEL_MODULE)(layer, buffer)
            ix.indexer_op = __import__(vllm.OP_MODULE, fromlist=["x"]).SparseAttnIndexer(ix.k_cache, buffer)
            fe.FORWARD_CONTEXT.attn_metadata = fe.vllm_metadata(ix.k_cache.prefix, [LONG, SHORT])
            ix(x, qr, positions, rope)
            buffer.fill_(-7)  # the next layer reuses the buffer: the capture must have cloned it
    finally:
        session.stop()
        fe.FORWARD_CONTEXT.attn_metadata = None
    got = runs(tmp_path)
    assert sorted(got) == [SHORT, LONG]
    for length in (SHORT, LONG):
        check_shadows(got[length]["rows"], layers=2, length=length)


def test_an_engine_layout_the_adapter_was_not_written_for_is_refused_with_the_difference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class Indexer(fe.TrtllmIndexer):
        def pre_indexer_proj(self, qr, hidden_states, position_ids, metadata):  # a newer layout
            return super().pre_indexer_proj(qr, hidden_states, position_ids)

    module = fe.register(monkeypatch, trtllm.MODULE, Indexer=Indexer)
    with pytest.raises(UnsupportedVersion) as err:
        trtllm.install(module)
    assert "Indexer.pre_indexer_proj: expected parameters (self, qr, hidden_states, position_ids)" in str(
        err.value
    )
    assert "got (self, qr, hidden_states, position_ids, metadata)" in str(err.value)
    start(tmp_path)  # through activation: reported, counted as a disabled capture, never raised
    try:
        assert "install:" + trtllm.MODULE in session.current().disabled
    finally:
        session.stop()
