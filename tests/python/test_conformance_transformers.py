"""The HF transformers adapter against released transformers wheels (fetched once, read
without importing): every symbol it hooks exists with the parameters it expects, in the
layout the adapter picks for that release, and AutoModelForCausalLM routes GLM-5 and
DeepSeek-V3.2 to the modules it hooks."""

import pytest
from conformance import mapping, selected
from shadowtrace_hooks.adapters import TARGETS, hf
from upstream import source

# release -> the layout the adapter must pick there
RELEASES = {"5.17.0": "past_key_values=", "5.23.0": "past_key_values=", "5.24.0": "cache="}


@pytest.mark.parametrize("version", sorted(RELEASES))
@pytest.mark.parametrize("module", sorted(hf.MODULES))
def test_every_hooked_symbol_exists_with_the_parameters_the_adapter_expects(
    version: str, module: str
) -> None:
    layout, reasons = selected(source("transformers", version), hf.LAYOUTS, module)
    assert layout is not None, reasons
    assert layout.name == RELEASES[version], reasons


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_the_auto_registry_routes_glm5_and_deepseek_v32_to_the_hooked_modules(version: str) -> None:
    names = mapping(source("transformers", version), "transformers.models.auto.modeling_auto",
                    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")  # fmt: skip
    for model_type, module in hf.ARCHITECTURES.items():
        prefix, _ = hf.MODULES[module]
        assert names[model_type] == f"{prefix}ForCausalLM"
        assert TARGETS[module] == "hf"
        assert source("transformers", version).definition(module, f"{prefix}ForCausalLM") is not None
