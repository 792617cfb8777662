"""The vLLM adapter against released vLLM wheels (fetched once, read without importing):
every symbol it hooks exists with the parameters it expects, in the layout the adapter picks
for that release; the model registry routes GLM-5 and DeepSeek-V3.2 on CUDA, through the
platform dispatch and the model's own classes, to a method the adapter hooks; and the
runner, forward-context and metadata attributes the hooks read are where they look."""

import ast

import pytest
from conformance import calls, mapping, selected
from shadowtrace_hooks.adapters import TARGETS, vllm
from upstream import Source, source

RELEASES = ("0.24.0", "0.28.0", "0.29.0", "0.33.0", "0.34.0")
MODEL, OP, V32, NVIDIA = vllm.MODEL_MODULE, vllm.OP_MODULE, vllm.V32_MODULE, vllm.NVIDIA_MODULE
RUNNER_V1, RUNNER_V2 = vllm.RUNNER_V1_MODULE, vllm.RUNNER_V2_MODULE
ABSENT = "absent"
REFUSED = "refused"
# release -> module -> the layout the adapter must pick there
_V2_ONLY = {MODEL: "deepseek_v2", OP: "sparse_attn_indexer", RUNNER_V1: "gpu_model_runner"}
EXPECTED = {
    "0.24.0": {**_V2_ONLY, V32: ABSENT, NVIDIA: ABSENT, RUNNER_V2: "gpu.model_runner-0.24"},
    # 0.28's deepseek_v32 package is reached only through model_class_overrides, and its
    # _sparse_indexer_and_attn has no positions: refused, with the difference named.
    "0.28.0": {**_V2_ONLY, V32: REFUSED, NVIDIA: "deepseek_v32_nvidia", RUNNER_V2: "gpu.model_runner-0.28"},
    "0.29.0": {
        **_V2_ONLY,
        V32: "deepseek_v32",
        NVIDIA: "deepseek_v32_nvidia",
        RUNNER_V2: "gpu.model_runner-0.28",
    },
    "0.33.0": {
        **_V2_ONLY,
        V32: "deepseek_v32",
        NVIDIA: "deepseek_v32_nvidia",
        RUNNER_V2: "gpu.model_runner-0.33",
    },
    # 0.34 removed the v1 runner (v1/worker/gpu_model_runner.py and gpu_input_batch.py).
    "0.34.0": {
        **_V2_ONLY,
        RUNNER_V1: ABSENT,
        V32: "deepseek_v32",
        NVIDIA: "deepseek_v32_nvidia",
        RUNNER_V2: "gpu.model_runner-0.33",
    },
}
# What the adapter at 186d193 hooked (git show HEAD:hooks/src/shadowtrace_hooks/adapters/vllm.py).
OLD_HOOKS = {(MODEL, "Indexer.forward"), (OP, "SparseAttnIndexer.forward_cuda")}


def vllm_source(version: str) -> Source:
    return source("vllm", version)


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("module", sorted(EXPECTED["0.33.0"]))
def test_every_hooked_symbol_exists_with_the_parameters_the_adapter_expects(
    version: str, module: str
) -> None:
    src = vllm_source(version)
    assert TARGETS[module] == "vllm"
    layout, reasons = selected(src, vllm.LAYOUTS, module)
    want = EXPECTED[version][module]
    if want == ABSENT:
        assert src.file(module) is None
    elif want == REFUSED:
        assert layout is None
        assert any("_sparse_indexer_and_attn: expected parameters (self, positions" in r for r in reasons), (
            reasons
        )
    else:
        assert layout is not None, reasons
        assert layout.name == want, reasons


# === the registry's route on CUDA, down to the indexer ================================


def platform_body(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements as CUDA runs them: of `if current_platform.is_cuda(): ...
    elif ...: ... else: ...`, the CUDA branch."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If) and "current_platform" in ast.unparse(node.test):
            out += platform_body(node.body if "is_cuda()" in ast.unparse(node.test) else node.orelse)
        elif not isinstance(node, ast.If):
            out.append(node)
    return out


def cuda_class(src: Source, module: str, name: str) -> tuple[str, ast.ClassDef]:
    """The class `name` as `module` binds it on CUDA: defined there or imported (the last
    binding wins), following the platform dispatch of package __init__ files."""
    tree = src.tree(module)
    assert tree is not None, f"{module} is not in {src.path.name}"
    found: tuple[str, ast.ClassDef] | None = None
    for node in platform_body(tree.body):
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = (module, node)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    found = cuda_class(src, src.absolute(module, node), alias.name)
    assert found is not None, f"{module}.{name} is not bound on CUDA in {src.path.name}"
    return found


def class_attribute(src: Source, module: str, cls: ast.ClassDef, name: str) -> tuple[str, ast.ClassDef]:
    """The class a class attribute (`model_cls = X`) names, looked up along the bases."""
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return cuda_class(src, module, ast.unparse(node.value))
    for base in cls.bases:
        if isinstance(base, ast.Name):
            base_module, base_cls = cuda_class(src, module, base.id)
            return class_attribute(src, base_module, base_cls, name)
    raise AssertionError(f"{cls.name}.{name} is not set in {src.path.name}")


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def constructed(src: Source, module: str, fn: ast.FunctionDef, suffix: str) -> tuple[str, ast.ClassDef]:
    """The class named `*suffix` that a method constructs (`X(...)` or `attn_cls = X`; of
    several, the MLA one: DSA models are MLA models)."""
    names = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    candidates = sorted(n for n in names if n.endswith(suffix))
    mla = [n for n in candidates if "MLA" in n]
    assert candidates, f"{fn.name} constructs no *{suffix}"
    return cuda_class(src, module, (mla or candidates)[0])


def cuda_route(src: Source, architecture: str) -> list[tuple[str, str]]:
    """The hookable methods a CUDA forward of `architecture` passes through, model forward
    first, indexer last; each link is read in the source."""
    registry = mapping(src, "vllm.model_executor.models.registry", "_TEXT_GENERATION_MODELS")
    module, name = registry[architecture]
    module = module if "." in module else f"vllm.model_executor.models.{module}"
    lm_module, lm = cuda_class(src, module, name)
    forward_module, forward_owner = lm_module, lm
    while method(forward_owner, "forward") is None:
        assert isinstance(forward_owner.bases[0], ast.Name)
        forward_module, forward_owner = cuda_class(src, forward_module, forward_owner.bases[0].id)
    route = [(forward_module, f"{forward_owner.name}.forward")]
    model_module, model = class_attribute(src, lm_module, lm, "model_cls")
    init = method(model, "__init__")
    assert init is not None
    layer_module, layer = constructed(src, model_module, init, "DecoderLayer")
    layer_init = method(layer, "__init__")
    assert layer_init is not None
    attn_module, attn = constructed(src, layer_module, layer_init, "Attention")
    qual = attn.name
    if calls(src, attn_module, f"{qual}.forward", "_sparse_indexer_and_attn"):
        # deepseek_v32: the indexer runs inside the method, through a function imported by
        # name (a patch of the op module's attribute or of SparseAttnIndexer would miss it).
        assert calls(src, attn_module, f"{qual}._sparse_indexer_and_attn", "sparse_attn_indexer")
        imported = src.definition(attn_module, "sparse_attn_indexer")
        assert imported is not None
        assert imported is src.definition(OP, "sparse_attn_indexer")
        assert not calls(src, attn_module, f"{qual}._sparse_indexer_and_attn", "indexer_op")
        return [*route, (attn_module, f"{qual}.forward"), (attn_module, f"{qual}._sparse_indexer_and_attn")]
    # deepseek_v2: the MLA wrapper calls the Indexer, whose SparseAttnIndexer (a CustomOp)
    # dispatches to forward_cuda on CUDA.
    assert calls(src, attn_module, f"{qual}.forward", "mla_attn")
    assert calls(src, attn_module, f"{qual}.__init__", "MultiHeadLatentAttentionWrapper")
    assert calls(src, "vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.forward", "indexer")
    indexer_module, indexer = constructed(src, attn_module, method(attn, "__init__"), "Indexer")  # type: ignore[arg-type]
    assert calls(src, indexer_module, f"{indexer.name}.forward", "indexer_op")
    assert calls(src, indexer_module, f"{indexer.name}.__init__", "SparseAttnIndexer")
    custom_op = "vllm.model_executor.custom_op"
    assert calls(src, custom_op, "CustomOp.__init__", "dispatch_forward")
    assert "self.forward_cuda" in ast.unparse(src.definition(custom_op, "CustomOp.dispatch_forward"))  # type: ignore[arg-type]
    return [*route, (indexer_module, f"{indexer.name}.forward"), (OP, "SparseAttnIndexer.forward_cuda")]


def hooked(src: Source) -> set[tuple[str, str]]:
    """The methods the adapter patches in this release: the symbols of the layouts it picks."""
    out = set()
    for module in EXPECTED["0.33.0"]:
        layout, _ = selected(src, vllm.LAYOUTS, module)
        if layout is not None:
            out |= {(s.module, s.qualname) for s in layout.symbols}
    return out


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("architecture", ["GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"])
def test_the_registry_routes_glm5_and_deepseek_v32_on_cuda_to_a_hooked_indexer(
    version: str, architecture: str
) -> None:
    src = vllm_source(version)
    route = cuda_route(src, architecture)
    patched = hooked(src)
    # The indexer hook, and the model forward the adapter watches for it.
    assert route[-1] in patched, route
    assert route[0] in patched, route
    v32_route = version >= "0.29"
    assert (route[-1][0] == V32) == v32_route, route
    if v32_route:
        # The vLLM >= 0.29 trap: nothing the adapter hooked before reaches this route.
        assert not OLD_HOOKS & set(route), route


# === what the hooks read ==============================================================


def assigned(src: Source, module: str, qualname: str) -> set[str]:
    """Attributes a class sets on self in its own methods (`self.x = ...`)."""
    cls = src.definition(module, qualname)
    assert isinstance(cls, ast.ClassDef), f"{module}.{qualname} in {src.path.name}"
    out = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for t in ast.walk(target) if target is not None else ():
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
    return out


def fields(src: Source, module: str, qualname: str) -> set[str]:
    """A dataclass's annotated fields and a class's properties."""
    cls = src.definition(module, qualname)
    assert isinstance(cls, ast.ClassDef), f"{module}.{qualname} in {src.path.name}"
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names | {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("version", RELEASES)
def test_the_model_runners_hold_the_request_ids_where_the_adapter_reads_them(version: str) -> None:
    src = vllm_source(version)
    if EXPECTED[version][RUNNER_V1] == ABSENT:
        assert src.file("vllm.v1.worker.gpu_input_batch") is None
    else:
        v1_runner_holds_the_request_ids(src)
    # v2: prepare_inputs returns the step's InputBatch; dummy runs skip it.
    assert calls(src, RUNNER_V2, "GPUModelRunner.execute_model", "prepare_inputs")
    read = {"req_ids", "num_reqs", "num_tokens", "num_draft_tokens", "query_start_loc_np", "prefill_len_np"}
    assert read <= fields(src, "vllm.v1.worker.gpu.input_batch", "InputBatch")
    for field in ("finished_req_ids", "preempted_req_ids"):
        assert field in fields(src, "vllm.v1.core.sched.output", "SchedulerOutput")


def v1_runner_holds_the_request_ids(src: Source) -> None:
    # v1: _model_forward is entered inside the step's forward context, after _update_states
    # reordered the batch.
    execute = src.definition(RUNNER_V1, "GPUModelRunner.execute_model")
    assert isinstance(execute, ast.FunctionDef)
    lines = {
        name: [n.lineno for n in ast.walk(execute) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]
        for name in ("self._update_states", "self._model_forward")
    }
    assert len(lines["self._model_forward"]) == 1
    assert lines["self._update_states"][0] < lines["self._model_forward"][0]
    inside = [
        n for n in ast.walk(execute) if isinstance(n, ast.With)
        and any("set_forward_context" in ast.unparse(i.context_expr) for i in n.items)
        and any(isinstance(c, ast.Call) and ast.unparse(c.func) == "self._model_forward" for c in ast.walk(n))
    ]  # fmt: skip
    assert inside
    assert {"query_start_loc", "input_batch"} <= assigned(src, RUNNER_V1, "GPUModelRunner")
    batch = "vllm.v1.worker.gpu_input_batch"
    assert {"req_ids", "num_reqs"} <= fields(src, batch, "InputBatch")
    assert "num_prompt_tokens" in assigned(src, batch, "InputBatch")


@pytest.mark.parametrize("version", RELEASES)
def test_the_forward_context_and_indexer_metadata_hold_what_the_hooks_read(version: str) -> None:
    src = vllm_source(version)
    assert {"attn_metadata", "ubatch_slices", "cudagraph_runtime_mode"} <= fields(
        src, "vllm.forward_context", "ForwardContext"
    )
    assert src.parameters("vllm.forward_context", "get_forward_context") == []
    breakable = "vllm.compilation.breakable_cudagraph"
    assert src.parameters(breakable, "BreakableCUDAGraphCapture.current") == ["cls"]
    assert src.parameters(breakable, "eager_break_during_capture") == ["fn"]
    meta = fields(src, "vllm.v1.attention.backends.mla.indexer", "DeepseekV32IndexerMetadata")
    assert {"num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens"} <= meta
    indexer = {"topk_tokens", "n_head", "head_dim", "rope_dim", "wq_b", "wk_weights_proj", "k_norm",
               "k_cache", "prefix", "indexer_op"}  # fmt: skip
    assert indexer | {"config"} <= assigned(src, MODEL, "Indexer")
    assert {"kv_cache", "prefix"} <= assigned(src, MODEL, "DeepseekV32IndexerCache")
    assert "eps" in assigned(src, "vllm.model_executor.layers.layernorm", "LayerNorm")
    if version >= "0.28":
        assert "dense_mha_metadata_layer_name" in assigned(src, OP, "SparseAttnIndexer")
    if version >= "0.29":
        assert indexer <= assigned(src, V32, "DeepseekV32Indexer")
        attention = {"indexer", "topk_indices_buffer", "_dense_mha_metadata_layer_name",
                     "_index_rope_interleave", "indexer_rope_emb"}  # fmt: skip
        assert attention <= assigned(src, V32, "DeepseekV32Attention")
        assert "_vllm_config" in assigned(src, "vllm.model_executor.layers.attention", "MLAAttention")
        # The v32 attention's _sparse_indexer_and_attn is an eager break the adapter re-decorates.
        sia = src.definition(V32, "DeepseekV32Attention._sparse_indexer_and_attn")
        assert isinstance(sia, ast.FunctionDef)
        assert [ast.unparse(d) for d in sia.decorator_list] == ["eager_break_during_capture"]
        assert src.definition(V32, "eager_break_during_capture") is src.definition(
            breakable, "eager_break_during_capture"
        )


@pytest.mark.parametrize("version", RELEASES)
def test_shardq_rows_are_read_where_the_adapter_reads_them(version: str) -> None:
    """0.34's ShardQ: the prefill metadata carries `shardq_gather_indices`, and the indexer
    op gathers q and weights by them and writes the rows packed (the stand-in replays this,
    hooks/tests/standins/vllm.py). Before 0.34 there is no such field: the adapter reads it
    with a default, and 0.33's row sharding gathered the rows back itself."""
    src = vllm_source(version)
    prefill = fields(src, "vllm.v1.attention.backends.mla.indexer", "DeepseekV32IndexerPrefillMetadata")
    op = src.definition(OP, "sparse_attn_indexer")
    assert isinstance(op, ast.FunctionDef)
    body = ast.unparse(op)
    if version < "0.34":
        assert "shardq_gather_indices" not in prefill
        assert "shardq_gather_indices" not in body
        return
    assert "shardq_gather_indices" in prefill
    assert "prefill_metadata.shardq_gather_indices" in body
    assert "q_quant[indices]" in body
    assert "weights[indices]" in body
    # the chunks' rows are the packed ones: topk_indices_buffer[row_start:row_end]
    assert "topk_indices_buffer[row_start:row_end" in body
    shardq = "vllm.v1.attention.ops.shardq"
    zigzag = ast.unparse(src.tree(shardq))  # the partition the stand-in reimplements
    assert "num_chunks = 2 * world" in zigzag
    assert "np.minimum(chunk, num_chunks - 1 - chunk)" in zigzag
