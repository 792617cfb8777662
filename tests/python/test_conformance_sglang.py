"""The SGLang adapter against released sglang wheels (fetched once, read without importing):
each release gets the layout the adapter was written for it, the request ids and the
fused-top-k variable the adapter reads are where it reads them, and SGLang's model registry
routes GLM-5 and DeepSeek-V3.2 through DeepseekV2ForCausalLM to the hooked Indexer, whose
CUDA dispatch reaches the hooked forward_cuda."""

import ast

import pytest
from conformance import calls, mapping, selected
from shadowtrace_hooks.adapters import TARGETS
from shadowtrace_hooks.adapters import sglang as adapter
from upstream import Source, source

DSA, NSA = adapter.INDEXER_MODULES
# release -> (the module defining Indexer, the layout the adapter must pick there)
RELEASES = {
    "0.5.8": (NSA, "unfused"),
    "0.5.10": (NSA, "unfused"),
    "0.5.13": (DSA, "unfused"),
    "0.5.15": (DSA, "fused_indexer"),
    "0.5.18": (DSA, "fused_indexer"),
    "0.5.20": (DSA, "fused_indexer"),
    "0.5.22": (DSA, "fused_indexer"),
    "0.5.23": (DSA, "use_cuda_graph"),
}
VERSIONS = sorted(RELEASES, key=lambda v: tuple(int(p) for p in v.split(".")))
MLA_FORWARD = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla"


def sglang(version: str) -> Source:
    return source("sglang", version)


def class_def(src: Source, module: str, name: str) -> ast.ClassDef:
    node = src.definition(module, name)
    assert isinstance(node, ast.ClassDef), f"{module}.{name} in sglang {src.path.name}"
    return node


def origin(src: Source, module: str, name: str) -> str:
    """The module that defines `name` as `module` sees it (following `from X import name`)."""
    tree = src.tree(module)
    assert tree is not None, module
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return origin(src, src.absolute(module, node), name)
    raise AssertionError(f"{name} is not defined in or imported into {module}")


def class_fields(node: ast.ClassDef) -> set[str]:
    """Names a class body assigns or annotates (dataclass fields, class attributes)."""
    out = set()
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            out |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return out


def entry_classes(src: Source, module: str) -> list[str]:
    """The class names of a models/ module's `EntryClass` (a class or a list of them)."""
    tree = src.tree(module)
    assert tree is not None, module
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
        ):
            value = node.value
            items = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
            return [ast.unparse(item) for item in items]
    return []


def inherits(src: Source, module: str, name: str, ancestor: str) -> bool:
    """Whether class `name` (as `module` sees it) is `ancestor` of MODEL_MODULE or derives
    from it, bases resolved through each defining module's imports."""
    where = origin(src, module, name)
    if where == adapter.MODEL_MODULE and name == ancestor:
        return True
    node = class_def(src, where, name)
    return any(
        inherits(src, where, ast.unparse(base), ancestor)
        for base in node.bases
        if isinstance(base, ast.Name) and base.id not in ("object",)
        and src.definition(where, base.id) is not None
    )  # fmt: skip


def indexer_calls(node: ast.AST) -> list[ast.Call]:
    """`self.indexer(...)` calls in a class or function."""
    return [
        sub
        for sub in ast.walk(node)
        if isinstance(sub, ast.Call)
        and isinstance(sub.func, ast.Attribute)
        and sub.func.attr == "indexer"
        and isinstance(sub.func.value, ast.Name)
        and sub.func.value.id == "self"
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_hooked_symbol_exists_with_the_parameters_the_adapter_expects(version: str) -> None:
    src = sglang(version)
    module, expected = RELEASES[version]
    layout, reasons = selected(src, adapter.LAYOUTS, module)
    assert layout is not None, reasons
    assert layout.name == expected, reasons
    if module == DSA:  # the nsa path re-exports the same Indexer
        shim, reasons = selected(src, adapter.LAYOUTS, NSA)
        assert shim is not None, reasons
        assert shim.name == expected, reasons
    else:
        assert src.file(DSA) is None
    for other, name in ((adapter.BATCH_MODULE, "init_new"), (adapter.MODEL_MODULE, "deepseek_v2")):
        layout, reasons = selected(src, adapter.LAYOUTS, other)
        assert layout is not None, reasons
        assert layout.name == name, reasons
    for hooked in (*adapter.INDEXER_MODULES, adapter.BATCH_MODULE, adapter.MODEL_MODULE):
        assert TARGETS[hooked] == "sglang"


@pytest.mark.parametrize("version", VERSIONS)
def test_request_ids_are_on_the_forward_batch_or_on_the_worker_batch_it_is_built_from(version: str) -> None:
    src = sglang(version)
    forward_batch = class_def(src, adapter.BATCH_MODULE, "ForwardBatch")
    if version != "0.5.8":
        assert "rids" in class_fields(forward_batch)
        return
    # 0.5.8: ForwardBatch.init_new(batch: ModelWorkerBatch, ...) and ModelWorkerBatch.reqs
    assert "rids" not in class_fields(forward_batch)
    init_new = src.definition(adapter.BATCH_MODULE, "ForwardBatch.init_new")
    assert isinstance(init_new, ast.FunctionDef)
    assert ast.unparse(init_new.args.args[1].annotation) == "ModelWorkerBatch"
    worker_batch = class_def(src, "sglang.srt.managers.schedule_batch", "ModelWorkerBatch")
    assert "reqs" in class_fields(worker_batch)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_fused_topk_variable_the_adapter_reads_first_is_the_one_the_release_defines(version: str) -> None:
    src = sglang(version)
    envs = class_def(src, "sglang.srt.environ", "Envs")
    defined = [name for name in adapter.FUSE_TOPK if name in class_fields(envs)]
    # the name each release reads; 0.5.13-0.5.20 also read the old one through an alias
    assert defined[:1] == (
        ["SGLANG_NSA_FUSE_TOPK"] if version in ("0.5.8", "0.5.10") else ["SGLANG_DSA_FUSE_TOPK"]
    )
    tree = src.tree("sglang.srt.environ")
    assert tree is not None
    assert any(isinstance(n, ast.Assign) and ast.unparse(n) == "envs = Envs()" for n in tree.body), (
        "the adapter reads sglang.srt.environ.envs"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_the_registry_routes_glm5_and_deepseek_v32_to_the_hooked_indexer_forward_cuda(version: str) -> None:
    src = sglang(version)
    registry = src.text("sglang.srt.models.registry")
    assert registry is not None
    assert "EntryClass" in registry
    routed = []
    for arch, module in adapter.ARCHITECTURES.items():
        if arch not in entry_classes(src, module):
            continue  # GLM-5 arrives in 0.5.10
        assert inherits(src, module, arch, "DeepseekV2ForCausalLM"), arch
        routed.append(arch)
    assert routed == list(adapter.ARCHITECTURES)[: len(routed)]
    assert "DeepseekV32ForCausalLM" in routed
    assert ("GlmMoeDsaForCausalLM" in routed) == (version != "0.5.8")

    # DeepseekV2ForCausalLM -> DeepseekV2Model -> DeepseekV2DecoderLayer -> DeepseekV2AttentionMLA
    model = adapter.MODEL_MODULE
    assert calls(src, model, "DeepseekV2ForCausalLM.__init__", "DeepseekV2Model")
    assert calls(src, model, "DeepseekV2Model.__init__", "DeepseekV2DecoderLayer")
    assert calls(src, model, "DeepseekV2DecoderLayer.__init__", "DeepseekV2AttentionMLA")
    mla_init = src.definition(model, "DeepseekV2AttentionMLA.__init__")
    assert mla_init is not None
    assert any(isinstance(n, ast.Name) and n.id == "Indexer" for n in ast.walk(mla_init))
    hooked, _ = RELEASES[version]
    assert origin(src, model, "Indexer") == origin(src, hooked, "Indexer")

    # the attention (or a forward mixin it inherits) calls self.indexer(x=..., ...)
    mla = class_def(src, model, "DeepseekV2AttentionMLA")
    bodies = [mla] + [
        node
        for base in mla.bases
        if isinstance(node := src.definition(model, ast.unparse(base)), ast.ClassDef)
    ]
    keywords = [{k.arg for k in call.keywords} for body in bodies for call in indexer_calls(body)]
    assert {"x", "q_lora", "positions", "forward_batch", "layer_id"} in [
        k & {"x", "q_lora", "positions", "forward_batch", "layer_id"} for k in keywords
    ]

    # nn.Module.__call__ -> forward -> the method the platform dispatch picks on CUDA
    indexer = class_def(src, origin(src, hooked, "Indexer"), "Indexer")
    where = origin(src, hooked, "Indexer")
    bases = [ast.unparse(b) for b in indexer.bases]
    if "MultiPlatformOp" in bases:
        dispatch = src.definition(origin(src, where, "MultiPlatformOp"), "MultiPlatformOp.dispatch_forward")
        assert dispatch is not None
        cuda = [n for n in ast.walk(dispatch) if isinstance(n, ast.If) and ast.unparse(n.test) == "_is_cuda"]
        assert cuda
        assert ast.unparse(cuda[0].body[0]) == "return self.forward_cuda"
        assert calls(src, origin(src, where, "MultiPlatformOp"), "MultiPlatformOp.forward", "_forward_method")
    else:
        assert "BaseFusedOp" in bases, bases
        fused_op = origin(src, where, "BaseFusedOp")
        assert mapping(src, fused_op, "_PLATFORM_METHODS")["cuda"] == ("forward_cuda",)
        # no kernel backend the op declares comes before the platform forward
        assert "capabilities" not in class_fields(indexer)
