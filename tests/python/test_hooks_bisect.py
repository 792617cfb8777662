"""Precision bisection in transformers (issue 30): a fault the test plants with a forward hook
of its own on transformers' model, at a chosen site and layer, is named there by
`shadowtrace_hooks.bisect`; the divergence measure against a hand-computed case."""

import math

import pytest
import tiny_models
import torch
from shadowtrace_hooks import bisect

K, LENGTH = 16, 160


def test_the_divergence_is_the_hand_computed_one_and_a_non_finite_row_never_agrees() -> None:
    ln3 = math.log(3.0)
    m = bisect.compare(
        torch.tensor([[ln3, 0.0]], dtype=torch.float64), torch.tensor([[0.0, ln3]], dtype=torch.float64)
    )
    # p = (3/4, 1/4), q = (1/4, 3/4): JS = 1 - H(3/4) bits.
    h = 0.75 * math.log2(4 / 3) + 0.25 * 2
    assert m.js_bits == pytest.approx(1 - h, abs=1e-9)
    assert m.argmax_agreement == 0.0
    m = bisect.compare(torch.tensor([[1.0, 2.0], [math.nan, 2.0]]), torch.tensor([[1.0, 2.0], [0.0, 5.0]]))
    assert (m.argmax_agreement, m.nonfinite_rows) == (0.5, 1)
    assert m.js_bits == pytest.approx(0.5, abs=1e-12)


def scale_output(factor: float):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] * factor, *output[1:])
        return output * factor

    return hook


def wrong_selection(module, args, output):
    """The indexer's selection shifted by half the prompt, clamped: keys the scores did not
    choose."""
    return (output + LENGTH // 2).clamp(max=LENGTH - 1)


CASES = {
    # site, layer, where the test's hook goes, the hook
    "mlp_out": (1, lambda layer: layer.mlp, scale_output(4.0)),
    "attn_out": (2, lambda layer: layer.self_attn, scale_output(4.0)),
    "layer_out": (0, lambda layer: layer, scale_output(3.0)),
    "indexer": (1, lambda layer: layer.self_attn.indexer, wrong_selection),
}


@pytest.mark.parametrize("site", list(CASES))
def test_a_fault_the_test_plants_with_a_forward_hook_is_named_at_its_site_and_layer(site: str) -> None:
    layer, block, hook = CASES[site]
    model, ids = tiny_models.glm(index_topk=K), tiny_models.prompt(LENGTH)
    with torch.no_grad():
        clean = model(ids).logits
    handle = block(model.model.layers[layer]).register_forward_hook(hook)
    lines: list[str] = []
    try:
        # Judged by JS divergence: random weights leave the logits nearly flat, so bf16 rounding
        # alone flips argmaxes (the clean production agrees with the fp32 chain on 0.86 of rows,
        # and a healed one on 0.81 to 0.84), where JS divergence sees the distribution (clean
        # 2.0e-4, faulted 2.2e-3 to 4.4e-3, healed 5.7e-5 to 2.1e-4).
        result = bisect.bisect(model, ids, clean=clean, metric="js", progress=lines.append)
    finally:
        handle.remove()
    # The check can fail: production with the fault misses the target.
    assert not result.already_restored(), result.summary()
    named = result.named()
    assert named is not None, result.summary()
    assert (named.site, named.layers) == (site, (layer, layer)), result.summary()
    assert result.summary().startswith(f"grafting the fp32 {site} at layer {layer} restores JS divergence")
    assert lines[0].startswith("target: restored = JS divergence (bits) with the reference <=")
    budget = bisect.max_forwards(len(model.model.layers), 1)
    assert all(len(s.steps) <= budget for s in result.sites)
    assert sum(len(s.steps) for s in result.sites) == len(lines) - 1


def test_the_command_line_prints_the_table_and_the_answer_and_refuses_a_missing_target(tmp_path) -> None:
    import json
    import subprocess
    import sys

    tiny_models.glm(index_topk=K).save_pretrained(tmp_path / "model")
    (tmp_path / "prompt.json").write_text(json.dumps(tiny_models.prompt(100)[0].tolist()))
    command = [
        sys.executable,
        "-m",
        "shadowtrace_hooks",
        "bisect",
        tmp_path / "model",
        tmp_path / "prompt.json",
    ]
    done = subprocess.run(
        [*command, "--threshold", "0.95", "--sites", "layer_out"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("production ungrafted: argmax agreement ")
    assert lines[1].startswith("layer_out ")
    assert lines[-1].startswith(
        ("grafting the fp32 layer_out at ", "no graft of the fp32 layer_out restores")
    )
    assert "target: restored = argmax agreement with the reference >= 0.950" in done.stderr
    missing = subprocess.run(command, capture_output=True, text=True)
    assert missing.returncode == 2
    assert "--threshold" in missing.stderr


def test_bisect_refuses_a_model_whose_grafts_the_hooks_cannot_apply() -> None:
    """A model the generic adapter traces (no graft there): refused before any search, never
    "no graft restores"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 12))
    with pytest.raises(RuntimeError, match="the hooks cannot graft this model: grafts are implemented for"):
        bisect.bisect(model, ids, threshold=0.9, progress=lambda line: None)


def test_a_graft_that_silently_did_not_apply_stops_the_bisection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shadow's re-run fails (the guard counts it and disables it): the forward runs
    ungrafted, and bisect says so instead of reading it as "this graft does not heal"."""
    from shadowtrace_hooks.adapters import hf

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(hf._Tracer, "_shadow_layer", broken)
    model, ids = tiny_models.glm(index_topk=K), tiny_models.prompt(40)
    with pytest.raises(RuntimeError, match=r"0 of 3 grafted \(layer, site\) values were taken.*planted"):
        bisect.bisect(model, ids, threshold=1.0, sites=["layer_out"], progress=lambda line: None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sites": []}, "expected one or more of"),
        ({"sites": ["mlp_out", "mlp_out"]}, "each once"),
        ({"metric": "kl"}, "expected argmax or js"),
        ({"last": 0}, "expected at least 1 position"),
    ],
)
def test_bisect_refuses_bad_arguments_before_any_forward(kwargs: dict, message: str) -> None:
    model, ids = tiny_models.glm(index_topk=K), tiny_models.prompt(20)
    with pytest.raises(ValueError, match=message):
        bisect.bisect(model, ids, threshold=0.9, progress=lambda line: None, **kwargs)


def test_the_reference_is_the_models_own_fp32_chain_upcast_one_layer_at_a_time() -> None:
    """reference_logits against the test's own fp32 copy of transformers' model (every weight
    upcast at once): the same logits but for the routed experts' summation order; and the
    decoder layers' weights are upcast only while each runs."""
    import copy

    from shadowtrace_hooks import shadow

    model, ids = tiny_models.glm(index_topk=K), tiny_models.prompt(LENGTH)
    with torch.no_grad():
        theirs = copy.deepcopy(model).float()(ids).logits
    upcasts: list[str] = []
    real = shadow.in_precision

    def watched(module, dtype, keep=None):
        upcasts.append(type(module).__name__)
        return real(module, dtype, keep)

    shadow.in_precision = watched
    try:
        ours = bisect.reference_logits(model, ids)
    finally:
        shadow.in_precision = real
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5
    assert upcasts == ["GlmMoeDsaForCausalLM"] + ["GlmMoeDsaDecoderLayer"] * len(model.model.layers)
    assert next(model.parameters()).dtype == torch.bfloat16, "everything put back"


def test_the_command_line_refuses_a_missing_prompt_and_text_without_a_tokenizer_in_one_line(tmp_path) -> None:
    import subprocess
    import sys

    tiny_models.glm(index_topk=K).save_pretrained(tmp_path / "model")
    (tmp_path / "prompt.txt").write_text("def f(x):\n    return x\n")
    command = [sys.executable, "-m", "shadowtrace_hooks", "bisect", tmp_path / "model"]
    missing = subprocess.run(
        [*command, tmp_path / "none.txt", "--threshold", "0.9"], capture_output=True, text=True
    )
    assert missing.returncode == 2
    assert missing.stderr == f"error: prompt {tmp_path / 'none.txt'}: No such file or directory\n"
    text = subprocess.run(
        [*command, tmp_path / "prompt.txt", "--threshold", "0.9"], capture_output=True, text=True
    )
    assert text.returncode == 2
    assert text.stderr.count("\n") == 1, text.stderr
    prompt = tmp_path / "prompt.txt"
    assert text.stderr.startswith(f"error: prompt {prompt} is text, and this model has no tokenizer")
    assert text.stderr.endswith(": pass a JSON list of ids\n"), text.stderr
    rows = subprocess.run(
        [*command, tmp_path / "prompt.txt", "--threshold", "0.9", "--rows", "every:4"],
        capture_output=True,
        text=True,
    )
    assert rows.returncode == 2
    assert rows.stderr == (
        "error: --rows every:4: expected all or last:N with N >= 1 (every:N is not implemented here)\n"
    )
