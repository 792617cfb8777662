"""How a run's manifest gathers the conventions its indexer calls report
(`engine.merge_conventions`): one entry per name, and a call that departs from the model
where earlier calls did not is the one kept, as the reference engine records a deviation
scoped to some layers (tracer/src/model/convention.rs)."""

import torch
from shadowtrace_hooks.adapters import engine


def hadamard(rotates: bool | None, where: str) -> dict:
    return engine.convention("indexer_hadamard", rotates, True, where, "reference")


def test_one_entry_per_name_in_the_order_first_reported() -> None:
    recorded: list[dict] = []
    rope = engine.convention("indexer_rope", "neox", "neox", "engine", "model")
    engine.merge_conventions(recorded, [rope, hadamard(True, "call 1")])
    engine.merge_conventions(recorded, [rope, hadamard(True, "call 2")])
    assert [(c["name"], c["engine_source"]) for c in recorded] == [
        ("indexer_rope", "engine"),
        ("indexer_hadamard", "call 1"),
    ]


def test_a_call_that_departs_from_the_model_replaces_an_agreeing_one_and_stays() -> None:
    recorded: list[dict] = []
    engine.merge_conventions(recorded, [hadamard(True, "unfused prefill")])
    engine.merge_conventions(recorded, [hadamard(False, "fused writer")])
    engine.merge_conventions(recorded, [hadamard(True, "unfused again")])
    assert [(c["engine"], c["engine_source"]) for c in recorded] == [(False, "fused writer")]


def test_an_unknown_engine_value_is_no_departure() -> None:
    recorded: list[dict] = []
    engine.merge_conventions(recorded, [hadamard(True, "read")])
    engine.merge_conventions(recorded, [hadamard(None, "not read")])
    assert recorded[0]["engine_source"] == "read"
    assert not engine.departs(hadamard(None, "not read"))
    assert not engine.departs(engine.convention("indexer_hadamard", False, None, "engine", "no reference"))


def test_the_weights_proj_dtype_is_spelled_as_the_reference_engine_spells_it() -> None:
    assert engine.weights_proj_convention(torch.bfloat16, "x")["engine"] == "bf16"
    assert engine.weights_proj_convention(torch.float32, "x")["engine"] == "fp32"
    assert engine.weights_proj_convention(torch.float8_e4m3fn, "x")["engine"] == "float8_e4m3fn"
    assert engine.weights_proj_convention(None, "not read")["engine"] is None


def test_a_head_weight_scale_folded_with_a_ranks_head_count_departs_from_the_models() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(index_head_dim=128, index_n_heads=32)
    model = 128**-0.5 * 32**-0.5
    right = SimpleNamespace(softmax_scale=128**-0.5, n_heads=32)
    rank = SimpleNamespace(softmax_scale=128**-0.5, n_heads=16)  # TP=2's local heads
    agreeing = engine.head_weight_scale_convention(
        engine.folded_scale(right, "softmax_scale", "n_heads"), "e", config
    )
    assert (agreeing["engine"], agreeing["model"]) == (model, model)
    assert not engine.departs(agreeing)
    wrong = engine.head_weight_scale_convention(
        engine.folded_scale(rank, "softmax_scale", "n_heads"), "e", config
    )
    assert wrong["engine"] == 128**-0.5 * 16**-0.5  # sqrt(2) times the model's
    assert engine.departs(wrong)
    unread = engine.head_weight_scale_convention(
        engine.folded_scale(right, "weight_scale_factor"), "e", config
    )
    assert unread["engine"] is None
    assert unread["engine_source"] == "not read: e"
    assert not engine.departs(unread)
