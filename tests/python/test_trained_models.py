"""The trained checkpoints (issue 29) are what their records say: the corpus they name, the
held-out loss they report (recomputed here by transformers on the committed held-out bytes),
the shapes the FP8 blocks need, and FP8 versions that are transformers' own conversion of
the bf16 ones. The layer-by-layer agreement of the reference engine with transformers on
them is in test_reference_engine.py and test_reference_fp8.py."""

import hashlib
import json
import math
import sys

import pytest
import tiny_fp8
import torch
import trained
from safetensors.torch import load_file

sys.path.insert(0, str(trained.MODELS / "train"))
import quantize_fp8

FAMILIES = list(trained.NAMES)
# The record's loss was measured on the H100 in fp32 without TF32; here on the CPU. Both
# sum the same products in other orders, and a key tied at the k-th indexer score may fall
# either side: measured 1.9e-4 (GLM) and 3.1e-5 (DeepSeek) relative; this allows 5x the
# larger. A checkpoint other than the recorded one is off by far more.
LOSS_REL_TOL = 1e-3
MAX_BF16_BYTES = 8 * 2**20


@pytest.mark.parametrize("family", FAMILIES)
def test_a_record_names_the_corpus_committed_beside_it(family: str) -> None:
    rec = trained.record(family)
    corpus = json.loads((trained.MODELS / "corpus" / "corpus.json").read_text())
    assert rec["corpus"]["splits"] == corpus["splits"]
    head = trained.HELDOUT_HEAD.read_bytes()
    n = rec["heldout"]["committed_windows"] * rec["heldout"]["length"]
    assert hashlib.sha256(head[:n]).hexdigest() == rec["heldout"]["committed_windows_sha256"]
    assert rec["indexer_score_check"]["rows_mismatched"] == 0 < rec["indexer_score_check"]["rows_checked"]
    assert set(rec["steps"]) == {"dense", "warmup", "sparse"}
    assert not rec["steps_cut"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_has_the_real_structure_in_at_most_8_mb_with_blocks_that_fit(family: str) -> None:
    config = json.loads((trained.folder(family) / "config.json").read_text())
    assert (config["index_topk"], config["index_head_dim"]) == (2048, 128)
    assert config["dtype"] == "bfloat16"
    tensors = load_file(trained.folder(family) / "model.safetensors")
    bf16 = sum(t.numel() * t.element_size() for t in tensors.values() if t.dtype == torch.bfloat16)
    assert bf16 <= MAX_BF16_BYTES, bf16
    # Projections' dimensions are whole 128-blocks; routers and weights_proj have one row per
    # expert or head and are never FP8.
    exempt = ("kv_a_proj_with_mqa.weight", "weights_proj.weight", "mlp.gate.weight")
    for name, t in tensors.items():
        if t.ndim == 2 and not name.endswith(exempt):
            assert (t.shape[0] % 128, t.shape[1] % 128) == (0, 0), (name, t.shape)
    # The one partial block: kv_lora_rank + qk_rope_head_dim rows, as the real models' 576.
    kv_a = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape == (config["kv_lora_rank"] + config["qk_rope_head_dim"], config["hidden_size"])
    # The routers' correction biases are fp32, as the published checkpoints keep them.
    assert all(t.dtype == torch.float32 for n, t in tensors.items() if n.endswith("e_score_correction_bias"))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reproduces_the_recorded_held_out_loss(family: str) -> None:
    rec = trained.record(family)["heldout"]
    model = trained.load(family)
    windows = trained.heldout_windows(rec["length"], rec["committed_windows"])
    total = 0.0
    with torch.no_grad():
        for ids in windows:
            total += float(model(ids[None], labels=ids[None]).loss)
    loss = total / len(windows)
    assert (
        abs(loss - rec["committed_windows_loss_nats"]) <= LOSS_REL_TOL * rec["committed_windows_loss_nats"]
    ), (
        loss,
        rec["committed_windows_loss_nats"],
    )
    # A model that learned the text: far below a byte's 8 bits.
    assert loss / math.log(2) < 2.5


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fp8_checkpoint_is_transformers_own_conversion_of_the_bf16_one(family: str, tmp_path) -> None:
    name = trained.NAMES[family]
    scale_fmt, skip = quantize_fp8.RECIPES[name]
    # The committed checkpoint is what the recipe's own run writes now (transformers'
    # conversion inside, models/train/quantize_fp8.py).
    quantize_fp8.quantize(trained.folder(family), tmp_path, scale_fmt, skip)
    want = load_file(tmp_path / "model.safetensors")
    got = load_file(trained.folder(family, fp8=True) / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
    fp8 = [k for k, v in got.items() if v.dtype == torch.float8_e4m3fn]
    assert any(".experts." in k for k in fp8)
    assert any("indexer.wq_b" in k for k in fp8)
    assert not [k for k in fp8 for module in skip if k.endswith(f"{module}.weight")]


def evenly_blocked(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes times scales with the weight cut into as many equal blocks as the grid has,
    rows / grid rows each: how transformers 5.17's `Fp8Dequantize._dequantize_one` blocks a
    weight. Right where blocks are whole; for a partial block, wrong."""
    rows, cols = codes.shape
    grid_r, grid_c = scale.shape
    q = codes.float().reshape(grid_r, rows // grid_r, grid_c, cols // grid_c)
    return (q * scale.float()[:, None, :, None]).reshape(rows, cols)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_fp8_checkpoint_dequantized_with_a_wrong_partial_block(family: str) -> None:
    """Without a GPU transformers loads an FP8 checkpoint dequantized to bf16. Each weight of
    whole 128x128 blocks is the test's own codes x block scales (tiny_fp8.reference_weight);
    kv_a_proj_with_mqa's 192 rows (1.5 blocks) are not: transformers takes its blocks as
    192 / 2 = 96 rows, so rows 96-127 get the second block's scale (GLM-5.1-FP8's 576 rows,
    576 / 5, fail to load there). Pinned so that a transformers that fixes it is noticed.
    The GPU path keeps the codes and is not affected."""
    from transformers import AutoModelForCausalLM

    stored = load_file(trained.folder(family, fp8=True) / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(trained.folder(family, fp8=True))
    params = dict(model.named_parameters())
    whole = partial = 0
    for key, codes in stored.items():
        if codes.dtype != torch.float8_e4m3fn or ".experts." in key:
            continue
        scale = stored[key + "_scale_inv"]
        right = tiny_fp8.reference_weight(codes, scale, (128, 128)).to(torch.bfloat16)
        if codes.shape[0] % 128 == 0 and codes.shape[1] % 128 == 0:
            assert torch.equal(params[key].detach(), right), key
            whole += 1
        else:
            assert "kv_a_proj_with_mqa" in key, key
            got = params[key].detach()
            assert torch.equal(got, evenly_blocked(codes, scale).to(torch.bfloat16)), key
            wrong_rows = (got != right).any(-1).nonzero().flatten()
            assert wrong_rows.tolist() == list(range(96, 128)), key
            partial += 1
    assert whole >= 10
    assert partial == 3  # one kv_a_proj_with_mqa per layer
