"""`python -m shadowtrace_hooks doctor` and the first-forward check: what the hooks found and
hooked is said, and a layout they cannot trace is never silent."""

import json
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
    first = next(line for line in out.stdout.splitlines() if line.startswith("device kernels: "))
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


def hooks_cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHADOWTRACE") and k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "shadowtrace_hooks", *map(str, args)], capture_output=True, text=True,
        env={**clean, **(env or {})}, check=False,
    )  # fmt: skip


def test_the_command_line_has_a_help_per_command_and_names_an_unknown_one() -> None:
    for flag in ("--help", "-h"):
        top = hooks_cli(flag)
        assert top.returncode == 0, top.stderr
        commands = top.stdout.split("COMMAND\n", 2)[-1]
        assert "    doctor    whether tracing is set up here" in commands, top.stdout
        assert "    bisect    which layers' shadow value" in commands, top.stdout
    doctor_help = hooks_cli("doctor", "--help")
    assert doctor_help.returncode == 0, doctor_help.stderr
    assert "--json" in doctor_help.stdout
    assert "startup .pth" in doctor_help.stdout
    unknown = hooks_cli("foo")
    assert unknown.returncode == 2
    assert "invalid choice: 'foo'" in unknown.stderr
    assert hooks_cli().returncode == 2


def test_the_doctor_checks_the_startup_file_the_environment_and_the_directory(tmp_path: Path) -> None:
    """What a serving user gets wrong first: each check is said, and a problem is exit 1."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"SHADOWTRACE_LAYER": "0", "SHADOWTRACE_DIR": str(blocker / "runs")}
    out = hooks_cli("doctor", "--json", env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    checks = json.loads(out.stdout)["checks"]
    assert checks["startup"]["ok"], checks
    started = "shadowtrace_hooks.pth: SHADOWTRACE=1 starts the hooks in every new process"
    assert checks["startup"]["detail"].endswith(started)
    environment = checks["environment"]
    assert not environment["ok"]
    assert "SHADOWTRACE is not set here: tracing is off" in environment["detail"]
    typo = "SHADOWTRACE_LAYER is no shadowtrace variable and is ignored: did you mean SHADOWTRACE_LAYERS?"
    assert typo in environment["detail"]
    runs = blocker / "runs"
    assert checks["directory"] == {
        "ok": False,
        "detail": f"SHADOWTRACE_DIR {runs} does not exist and cannot be created: {blocker} is not a "
        "directory",
    }
    text = hooks_cli("doctor", env={"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)})
    lines = text.stdout.splitlines()
    assert lines[1] == "environment: ok: SHADOWTRACE is on: layers all, sites all, shadow fp32 local", lines
    assert lines[2] == f"directory: ok: SHADOWTRACE_DIR {tmp_path} is writable", lines


def test_a_missing_startup_file_is_a_problem_that_says_how_to_install(tmp_path: Path) -> None:
    from shadowtrace_hooks import setup_check

    check = setup_check.startup_pth([tmp_path])
    assert not check.ok
    assert check.line == (
        f"shadowtrace_hooks.pth is not in {tmp_path}: SHADOWTRACE=1 starts nothing; install the wheel "
        "(pip install ./hooks), not an editable install, which leaves it out"
    )


def test_the_directory_check_says_whether_runs_can_be_written(tmp_path: Path) -> None:
    from shadowtrace_hooks import setup_check

    assert setup_check.directory(str(tmp_path)).ok
    new = setup_check.directory(str(tmp_path / "runs" / "today"))
    assert new.ok
    assert new.line == (
        f"SHADOWTRACE_DIR {tmp_path / 'runs' / 'today'} does not exist yet; it will be created under "
        f"{tmp_path}, which is writable"
    )
    (tmp_path / "file").write_text("")
    assert setup_check.directory(str(tmp_path / "file")).line == (
        f"SHADOWTRACE_DIR {tmp_path / 'file'} is a file, not a directory"
    )
    relative = setup_check.directory("shadowtrace-runs")
    assert "(relative: each process resolves it in its own working directory)" in relative.line
