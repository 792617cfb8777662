"""Engine adapters: each knows one engine's hook points, at the versions it states.

`TARGETS` maps the module an adapter patches to the adapter; `startup` installs an adapter
when its module is imported (or at once when it already was), so engine code is never
imported by shadowtrace itself.
"""

import importlib
from types import ModuleType

# module that defines the hooked classes -> adapter module (relative to this package)
TARGETS = {
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa": "hf",
    "transformers.models.deepseek_v32.modeling_deepseek_v32": "hf",
    "tensorrt_llm._torch.attention_backend.sparse.dsa.indexer": "trtllm",
    "sglang.srt.layers.attention.dsa.dsa_indexer": "sglang",
    "sglang.srt.layers.attention.nsa.nsa_indexer": "sglang",
    "vllm.model_executor.models.deepseek_v2": "vllm",
    "vllm.model_executor.layers.sparse_attn_indexer": "vllm",
}


def adapter(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def install(module: ModuleType) -> None:
    """Installs the adapter for an engine module that was just imported."""
    adapter(TARGETS[module.__name__]).install(module)
