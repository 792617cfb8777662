"""Running a module in the shadow precision: production weights come back bit for bit even
when the upcast fails half way, and the shadow call fires no hook but the tracer's own."""

import pytest
import torch
from shadowtrace_hooks import shadow
from torch import nn


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(torch.bfloat16)


def test_an_out_of_memory_error_during_the_upcast_leaves_every_production_weight_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = model()
    before = [(p.data_ptr(), p.dtype, p.detach().clone()) for p in m.parameters()]
    real_to = torch.Tensor.to
    upcasts = []

    def failing_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if args and args[0] is torch.float32:
            upcasts.append(1)
            if len(upcasts) == 3:  # the third parameter: two are already swapped
                raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", failing_to)
    with pytest.raises(torch.OutOfMemoryError), shadow.in_precision(m, torch.float32):
        pass
    monkeypatch.undo()
    assert len(upcasts) == 3
    for p, (ptr, dtype, values) in zip(m.parameters(), before, strict=True):
        assert (p.data_ptr(), p.dtype) == (ptr, dtype)
        assert torch.equal(p, values)


def test_the_upcast_is_undone_when_the_shadow_call_raises() -> None:
    m = model()
    seen = []

    def shadow_call() -> None:
        with shadow.in_precision(m, torch.float32):
            seen.extend(p.dtype for p in m.parameters())
            raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        shadow_call()
    assert seen == [torch.float32] * 4
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


def test_within_a_suspension_only_the_capture_hooks_fire_and_every_hook_comes_back() -> None:
    m = model()
    fired: list[str] = []
    m[0].register_forward_hook(lambda *a: fired.append("user linear"))
    m[2].register_forward_pre_hook(lambda *a: fired.append("user pre"))
    m.register_forward_hook(lambda *a: fired.append("user outer"))
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with shadow.hooks_suspended(m, {m[2]: lambda *a: fired.append("capture")}):
        m(x)
    assert fired == ["capture"]
    fired.clear()
    m(x)
    assert sorted(fired) == ["user linear", "user outer", "user pre"]


def test_full_fp32_turns_off_tf32_and_reduced_precision_sums_and_puts_back_what_the_engine_set() -> None:
    matmul = torch.backends.cuda.matmul
    names = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")

    def reductions() -> list[tuple[bool, bool]]:
        return [(getattr(matmul, n), getattr(matmul, f"{n}_split_k")) for n in names]

    saved = (reductions(), matmul.allow_tf32, matmul.allow_fp16_accumulation)
    try:
        # (False, False): reduced precision and split-K both off, which a bool written back
        # to the first flag would turn into (False, True).
        for engine in ((False, False), (True, True)):
            for n in names:
                setattr(matmul, n, engine)
            matmul.allow_tf32 = matmul.allow_fp16_accumulation = True
            with shadow.full_fp32():
                assert reductions() == [(False, True)] * 2
                assert (matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
                assert matmul.allow_fp16_accumulation is False
            assert reductions() == [engine] * 2
            assert (matmul.allow_tf32, matmul.allow_fp16_accumulation) == (True, True)
    finally:
        for n, value in zip(names, saved[0], strict=True):
            setattr(matmul, n, value)
        matmul.allow_tf32, matmul.allow_fp16_accumulation = saved[1], saved[2]


def test_a_shadow_projection_off_cuda_is_the_product_of_the_upcast_operands_and_says_so() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 16).bfloat16(), torch.randn(3, 16).bfloat16()
    got = shadow.linear(x, w, torch.float32)
    assert (got.dtype, tuple(got.shape)) == (torch.float32, (2, 5, 3))
    assert torch.equal(got, torch.nn.functional.linear(x.float(), w.float()))
    assert shadow.linear_path(x, w, torch.float32) == "fp32"
    assert shadow.linear_path(x, w, torch.float64) == "fp64"
    assert shadow.linear_path(x, w, torch.bfloat16) == "bf16"
