"""`python -m shadowtrace_hooks doctor` and the first-forward check: what the hooks found and
hooked is said, and a layout they cannot trace is never silent."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TRANSFORMERS, transformers_path


def doctor(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE") and k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "shadowtrace_hooks", "doctor"], capture_output=True, text=True,
        env={**clean, **env}, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("version", TRANSFORMERS)
def test_the_doctor_names_the_layout_it_hooked_in_each_transformers_release(version: str) -> None:
    out = doctor(transformers_path(version))
    assert out.returncode == 0, out.stdout + out.stderr
    cache = "past_key_values=" if version < "5.24" else "cache="
    assert f"transformers {version}\n" in out.stdout
    first = out.stdout.splitlines()[0]
    if torch.cuda.is_available():
        assert first.startswith("device kernels: "), first
    else:
        assert (
            first
            == "device kernels: CUDA is not available: torch's ops (plain fp32 indexer scores on the CPU)"
        )
    for module in ("glm_moe_dsa.modeling_glm_moe_dsa", "deepseek_v32.modeling_deepseek_v32"):
        (line,) = [x for x in out.stdout.splitlines() if f"transformers.models.{module}:" in x]
        assert f"transformers.models.{module}: hooked, layout {cache}" in line
        assert line.endswith("; indexer scores captured from its top-k call"), line


def test_the_doctor_says_why_a_layout_it_was_not_written_for_is_not_hooked(tmp_path: Path) -> None:
    """A transformers whose GLM-5 indexer takes other parameters: refused by name, exit 1."""
    package = tmp_path / "transformers"
    module = package / "models" / "glm_moe_dsa"
    module.mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "9.0.0"\n')
    for p in (package / "models", module):
        (p / "__init__.py").write_text("")
    (module / "modeling_glm_moe_dsa.py").write_text(textwrap.dedent("""
        class GlmMoeDsaForCausalLM:
            def forward(self, input_ids, attention_mask, position_ids, cache, **kwargs): ...
            def generate(self, *args, **kwargs): ...
        class GlmMoeDsaDecoderLayer:
            def forward(self, hidden_states, attention_mask, position_ids, cache, use_cache,
                        position_embeddings, **kwargs): ...
        class GlmMoeDsaIndexer:
            def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, cache,
                        k_pool): ...
        class GlmMoeDsaRotaryEmbedding:
            def forward(self, x, position_ids): ...
        def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids, unsqueeze_dim): ...
    """))  # fmt: skip
    out = doctor({"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if "modeling_glm_moe_dsa:" in x)
    assert "found, not hooked" in line
    assert "GlmMoeDsaIndexer.forward: expected parameters (self, hidden_states, q_resid, " in line
    assert "got (self, hidden_states, q_resid, position_embeddings, attention_mask, cache, k_pool)" in line
    assert "nothing of transformers 9.0.0 is hooked" in out.stdout


def test_a_first_forward_in_which_an_expected_hook_never_fired_is_reported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose attention calls the indexer's forward directly (bypassing module hooks,
    as a future layout might): the traced forward says so in one line and counts it."""
    import tiny_models
    from shadowtrace_hooks import session, startup
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    model, ids = tiny_models.glm(), tiny_models.prompt(32)
    monkeypatch.setattr(glm.GlmMoeDsaIndexer, "__call__", lambda self, *a, **k: self.forward(*a, **k))
    sess = startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    assert sess is not None
    try:
        with caplog.at_level(logging.WARNING, logger="shadowtrace"), torch.no_grad():
            model(ids)
            model(ids)
        counters = dict(sess.counters)
    finally:
        session.stop()
    lines = [r.getMessage() for r in caplog.records if "never fired" in r.getMessage()]
    assert len(lines) == 1
    assert "indexer" in lines[0]
    assert counters["hooks_never_fired"] == 1
