"""Each layout's newest checked release, read off its source, and when a running release is
past it: the release numbers compared, pre-releases of a later release counted as later."""

import pytest
from shadowtrace_hooks.adapters import hf, sglang, trtllm, vllm
from shadowtrace_hooks.adapters.layout import Layout


def layout(source: str) -> Layout:
    return Layout(name="x", source=source, symbols=())


@pytest.mark.parametrize(
    ("source", "newest"),
    [
        ("vLLM 0.24.0 to 0.33.0: models/deepseek_v2.py", "0.33.0"),
        ("sglang 0.5.23", "0.5.23"),
        ("transformers 5.17.0 to 5.23.0", "5.23.0"),
        ("structure found at run time on transformers 5.26.0; checked on transformers 5.24.0", "5.24.0"),
        ("NVIDIA/TensorRT-LLM@0b228a79d04ae2f7de4b79db495f82dd8e3f7ee0 (main after PR #17968)", None),
    ],
)
def test_the_newest_release_is_the_last_its_source_names(source: str, newest: str | None) -> None:
    assert layout(source).newest == newest


@pytest.mark.parametrize(
    ("version", "untested"),
    [("0.33.0", False), ("0.33.0.dev4", False), ("0.29.1", False), ("0.33.1", True), ("0.34.0rc1", True),
     ("1.0", True), ("unknown version", True)],
)  # fmt: skip
def test_a_release_past_the_newest_checked_is_untested(version: str, untested: bool) -> None:
    why = layout("vLLM 0.24.0 to 0.33.0").untested("vllm", version)
    assert (why is not None) == untested, why
    if version == "unknown version":
        assert why.startswith("vllm version 'unknown version' names no release: not compared with 0.33.0")
    elif untested:
        assert why.startswith(f"vllm {version} is newer than 0.33.0, the newest release layout x was checked")


def test_every_release_layout_of_the_adapters_names_its_newest_and_commit_layouts_none() -> None:
    layouts = [*hf.LAYOUTS, *sglang.LAYOUTS, *vllm.LAYOUTS]
    assert all(entry.newest is not None for entry in layouts), [e.source for e in layouts if e.newest is None]
    assert {entry.newest for entry in hf.LAYOUTS} == {"5.23.0", "5.25.0"}
    assert all(entry.newest is None for entry in trtllm.LAYOUTS)
