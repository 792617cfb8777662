"""The HF transformers adapter against released transformers wheels (fetched once, read
without importing): every symbol it hooks exists with the parameters it expects, in the
layout the adapter picks for that release, and AutoModelForCausalLM routes GLM-5 and
DeepSeek-V3.2 to the modules it hooks."""

import os
import subprocess
import sys
from importlib import metadata

import pytest
import transformers
import upstream
from conformance import mapping, selected
from conftest import transformers_path
from shadowtrace_hooks.adapters import TARGETS, hf
from upstream import source

# release -> the layout the adapter must pick there
RELEASES = {
    "5.17.0": "past_key_values=",
    "5.23.0": "past_key_values=",
    "5.24.0": "cache=",
    "5.25.0": "cache=",
}


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


def test_deepseek_v32s_rope_function_is_read_through_the_kernels_wrapper_as_5_25_installs_it() -> None:
    """The source read above ignores decorators. Imported as a user installs it (5.25 depends on
    `kernels`), DeepSeek-V3.2's `apply_rotary_pos_emb` is a hub-kernel module whose call reads
    (*args, **kwargs): the adapter refused the model there. Its layout check now reads the
    function's own parameters through the wrapper, in a process of that release."""
    probe = (
        "import inspect, transformers.models.deepseek_v32.modeling_deepseek_v32 as m\n"
        "from shadowtrace_hooks.adapters import hf, layout\n"
        "fn = m.apply_rotary_pos_emb\n"
        "print(inspect.signature(fn))\n"
        "print(layout.hub_kernel_layer(fn), layout.parameters(fn))\n"
        "print(layout.select(hf.layouts(m.__name__), {m.__name__: m}, 'probe').name)\n"
    )
    # the hooks as this process has them (5.25 itself where it is the virtualenv's)
    path = [*transformers_path("5.25.0").values(), *sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "(*args, **kwargs)",
        "rotary_pos_emb ['q', 'k', 'cos', 'sin', 'unsqueeze_dim']",
        "cache=",
    ]


def test_a_release_is_skipped_only_for_a_requirement_this_environment_cannot_meet() -> None:
    """`upstream.unmet` decides which transformers releases skip their tests here
    (conftest.transformers_path). pip built this environment from the registry's metadata, so
    its own release has every requirement met; 5.17 requires huggingface_hub < 2, unmet
    exactly where the installed hub is 2 or later (the engines' torch environments)."""
    assert upstream.unmet("transformers", transformers.__version__) == []
    hub = metadata.version("huggingface_hub")
    unmet = upstream.unmet("transformers", "5.17.0")
    assert [r for r in unmet if r.startswith("huggingface-hub")] == (
        [f"huggingface-hub<2.0,>=1.5.0 (found {hub})"] if int(hub.split(".")[0]) >= 2 else []
    )
