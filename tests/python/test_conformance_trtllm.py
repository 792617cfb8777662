"""The TensorRT-LLM adapter against upstream TensorRT-LLM, which publishes no wheel with its
PyTorch-backend DSA code: upstream_data/tensorrt_llm.json records, with the full commit of
each file, the signatures, attributes, call chains and model registry the adapter relies on,
read from the upstream files (old module path `_torch/attention_backend/` at 047098b7, new
path `_torch/attention/backends/` at 0b228a79 and neighbouring commits). The tests check the
adapter's declarations against that record: the layout install would pick at each commit,
the calls from `dsa/module.py` that reach the hooked methods, and the registry entries of
GLM-5 and DeepSeek-V3.2 that reach the hooked model class."""

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from conformance import mismatches, selected
from shadowtrace_hooks.adapters import TARGETS, trtllm
from shadowtrace_hooks.adapters.layout import Layout

DATA = json.loads((Path(__file__).parent / "upstream_data" / "tensorrt_llm.json").read_text())
OLD_COMMIT = "047098b74c51f488abcfcd72f7d4a988a56442f6"
NEW_COMMIT = "0b228a79d04ae2f7de4b79db495f82dd8e3f7ee0"
NEW_MODULE_COMMIT = "2d7f402ef0d4a86ef6686651b007af82ca98865e"
# (commit, module) -> the layout an install on that module must pick there
EXPECTED = {
    (OLD_COMMIT, trtllm.OLD): "attention_backend",
    (NEW_COMMIT, trtllm.NEW): "attention.backends",
    (OLD_COMMIT, trtllm.MODELING): "model",
    (NEW_MODULE_COMMIT, trtllm.MODELING): "model",
}


class Recorded:
    """The recorded upstream symbols of one commit, answering as upstream.Source does."""

    def __init__(self, commit: str) -> None:
        self.rows = {
            (r["module"], r["qualname"]): r["params"] for r in DATA["symbols"] if r["commit"] == commit
        }

    def parameters(self, module: str, qualname: str) -> list[str] | None:
        return self.rows.get((module, qualname))


def commits(source: str) -> list[str]:
    return re.findall(r"\b[0-9a-f]{40}\b", source)


def reaches(package: str, start: str, goal: str) -> bool:
    """Whether the recorded calls lead from `start` to a call of `goal`, through the
    functions and methods recorded in `package` (by name, as conformance.calls matches)."""
    edges: dict[str, set[str]] = {}
    for row in DATA["calls"]:
        if row["module"].startswith(package):
            edges.setdefault(row["caller"].rpartition(".")[2], set()).update(row["callees"])
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(edges.get(name, ()))
    return False


def hooked(module: str) -> Iterable[str]:
    """Method names the adapter patches in `module`."""
    for layout in trtllm.LAYOUTS:
        for symbol in layout.symbols:
            if symbol.module == module:
                yield symbol.qualname.rpartition(".")[2]


def test_every_recorded_row_names_the_full_commit_it_was_read_at() -> None:
    for table in ("symbols", "attributes", "calls", "registry"):
        for row in DATA[table]:
            assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row
            assert row["path"] == row["module"].replace(".", "/") + ".py", row


def test_both_indexer_module_paths_and_the_model_module_are_targets() -> None:
    for module in (trtllm.OLD, trtllm.NEW, trtllm.MODELING):
        assert TARGETS[module] == "trtllm"
    assert {m for layout in trtllm.LAYOUTS for m in layout.modules} == {
        trtllm.OLD,
        trtllm.NEW,
        trtllm.MODELING,
    }


@pytest.mark.parametrize("layout", trtllm.LAYOUTS, ids=lambda layout: layout.name)
def test_each_layout_matches_the_upstream_signatures_recorded_at_its_commits(layout: Layout) -> None:
    named = commits(layout.source)
    assert named, f"{layout.name} names no commit in its source"
    for commit in named:
        assert mismatches(Recorded(commit), layout) == [], commit  # type: ignore[arg-type]


@pytest.mark.parametrize(("commit", "module"), sorted(EXPECTED), ids=lambda v: v[:8] if len(v) == 40 else v)
def test_install_picks_the_layout_written_for_each_commit(commit: str, module: str) -> None:
    layout, reasons = selected(Recorded(commit), trtllm.LAYOUTS, module)  # type: ignore[arg-type]
    assert layout is not None, reasons
    assert layout.name == EXPECTED[(commit, module)]
    assert commit in layout.source


def test_the_old_layout_is_refused_on_the_new_commit_and_the_new_one_on_the_old() -> None:
    for commit, module in ((NEW_COMMIT, trtllm.OLD), (OLD_COMMIT, trtllm.NEW)):
        layout, reasons = selected(Recorded(commit), trtllm.LAYOUTS, module)  # type: ignore[arg-type]
        assert layout is None
        assert any("does not exist" in reason for reason in reasons), reasons


@pytest.mark.parametrize("module", [trtllm.OLD, trtllm.NEW])
def test_the_recorded_call_chain_from_dsa_module_reaches_the_hooked_indexer_methods(module: str) -> None:
    package = module.rpartition(".")[0]  # ...sparse.dsa
    methods = set(hooked(module))
    assert methods == {"pre_indexer_proj", "forward_from_projected"}
    # Op 1 (forward_dsa_proj) projects, Op 2 (_forward_dsa_attn) predicts each phase.
    assert reaches(package, "forward_dsa_proj", "pre_indexer_proj")
    assert reaches(package, "_forward_dsa_attn", "forward_from_projected")
    # Both are what the MLA layer's DSA hooks run, eagerly or as the two custom ops.
    assert reaches(package, "forward_sparse_attn", "pre_indexer_proj")
    assert reaches(package, "forward_sparse_attn", "forward_from_projected")
    assert not reaches(package, "forward_dsa_proj", "forward_from_projected")


def test_the_registry_routes_glm5_and_deepseek_v32_to_the_hooked_model_class() -> None:
    model_layout = next(layout for layout in trtllm.LAYOUTS if trtllm.MODELING in layout.modules)
    assert {s.qualname for s in model_layout.symbols} == {
        "DeepseekV3ForCausalLM.__init__",
        "DeepseekV3ForCausalLM.forward",
    }
    assert {row["commit"] for row in DATA["registry"]} == set(commits(model_layout.source))
    for row in DATA["registry"]:
        assert row["module"] == trtllm.MODELING
        for architecture in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
            cls = row["architectures"][architecture]
            # The class itself, or a subclass that inherits the patched __init__ and forward.
            assert cls == "DeepseekV3ForCausalLM" or "DeepseekV3ForCausalLM" in row["bases"][cls], row


def test_the_attributes_the_adapter_reads_are_set_upstream() -> None:
    def names(qualname: str, commit: str | None = None) -> set[str]:
        rows = [r for r in DATA["attributes"] if r["qualname"] == qualname and commit in (None, r["commit"])]
        assert rows, qualname
        return set.intersection(*(set(r["names"]) for r in rows))

    for commit in (OLD_COMMIT, NEW_COMMIT):
        assert set(trtllm.INDEXER_ATTRIBUTES) <= names("Indexer", commit)
    assert set(trtllm.ROTARY_ATTRIBUTES) <= names("RotaryEmbedding")
    assert set(trtllm.METADATA_ATTRIBUTES) <= names("AttentionMetadata")
    assert set(trtllm.KV_CACHE_PARAMS_ATTRIBUTES) <= names("KVCacheParams")
    # k_norm is TensorRT-LLM's LayerNorm: the shadow must not read an `eps` it lacks.
    assert "variance_epsilon" in names("LayerNorm")
    assert "eps" not in names("LayerNorm")
