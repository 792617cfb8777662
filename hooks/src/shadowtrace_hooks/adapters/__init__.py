"""Engine adapters: each knows one engine's hook points, at the layouts it declares.

`TARGETS` maps every module an adapter patches to the adapter, and any other HF transformers
modeling module goes to the generic decoder adapter (`adapter_for`); `startup` installs an
adapter when its module is imported (or at once when it already was), so engine code is
never imported by shadowtrace itself. Each adapter module declares:

- `NAME`: the engine's package name, as the manifest names the engine;
- `LAYOUTS`: the upstream layouts it supports (`layout.Layout`: a release range or commit
  and the symbols relied on), checked at install and against released code by the
  conformance tests;
- `install(module)`: patches one target module, or raises `layout.UnsupportedVersion`.
"""

import importlib
import re
from types import ModuleType

# module that defines the hooked classes -> adapter module (relative to this package)
TARGETS = {
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa": "hf",
    "transformers.models.deepseek_v32.modeling_deepseek_v32": "hf",
    "transformers.models.glm5_next.modeling_glm5_next": "hf_glm5_next",
    "transformers.models.deepseek_v4.modeling_deepseek_v4": "hf_deepseek_v4",
    "tensorrt_llm._torch.attention_backend.sparse.dsa.indexer": "trtllm",
    "tensorrt_llm._torch.attention.backends.sparse.dsa.indexer": "trtllm",
    "tensorrt_llm._torch.models.modeling_deepseekv3": "trtllm",
    "tensorrt_llm._torch.models.modeling_glm5_next": "trtllm",
    "tensorrt_llm._torch.models.modeling_deepseekv4": "trtllm",
    "sglang.srt.layers.attention.dsa.dsa_indexer": "sglang",
    "sglang.srt.layers.attention.nsa.nsa_indexer": "sglang",
    "sglang.srt.model_executor.forward_batch_info": "sglang",
    "sglang.srt.models.deepseek_v2": "sglang",
    "vllm.model_executor.models.deepseek_v2": "vllm",
    "vllm.model_executor.layers.sparse_attn_indexer": "vllm",
    "vllm.models.deepseek_v32.attention": "vllm",
    "vllm.models.deepseek_v32.nvidia.model": "vllm",
    "vllm.v1.worker.gpu_model_runner": "vllm",
    "vllm.v1.worker.gpu.model_runner": "vllm",
    "vllm.models.glm5next": "vllm",
    "vllm.models.deepseek_v4": "vllm",
}
ADAPTERS = ("hf", "hf_glm5_next", "hf_deepseek_v4", "hf_generic", "trtllm", "sglang", "vllm")
# any other `transformers.models.<name>.modeling_<name>`: the generic decoder adapter
_GENERIC = re.compile(r"transformers\.models\.(\w+)\.modeling_\1")


def adapter_for(name: str) -> str | None:
    """The adapter that installs on module `name`, or None."""
    if name in TARGETS:
        return TARGETS[name]
    return "hf_generic" if _GENERIC.fullmatch(name) else None


def adapter(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def install(module: ModuleType) -> None:
    """Installs the adapter for an engine module that was just imported."""
    name = adapter_for(module.__name__)
    if name is not None:
        adapter(name).install(module)
