"""What the hooks find and hook in this environment, for `python -m shadowtrace_hooks
doctor`: first whether tracing is set up here (the startup .pth installed, the SHADOWTRACE_*
variables, SHADOWTRACE_DIR writable: setup_check.py); then whether the hooks' Triton kernels
will run here; then per engine installed here, its version and, for every module an adapter
targets, whether the module exists, whether importing it hooked it (the layout it matched) and,
when not, why. It imports the engines' modules, as tracing would: run it in the engine's
environment, not inside a serving process."""

import importlib
import importlib.metadata
import importlib.util
import json
from typing import Any, TextIO

from shadowtrace_hooks import adapters, kernels, session, setup_check, startup

ENGINES = {"hf": "transformers", "trtllm": "tensorrt_llm", "sglang": "sglang", "vllm": "vllm"}
DISTRIBUTIONS = {"tensorrt_llm": "tensorrt-llm"}


def run(out: TextIO, as_json: bool = False) -> int:
    """Writes the report (text, or one JSON object); 0 when every check passed and every
    installed engine had its targets hooked, 1 otherwise."""
    checks = setup_check.run()
    report: dict[str, Any] = {"checks": {c.name: {"ok": c.ok, "detail": c.line} for c in checks}}
    if not as_json:
        for c in checks:
            out.write(f"{c.name}: {'ok' if c.ok else 'PROBLEM'}: {c.line}\n")
    ok = all(c.ok for c in checks)
    sess = startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": "/nonexistent-shadowtrace-doctor"})
    if sess is None:
        report["ok"] = False
        report["engines"] = {}
        _write(out, as_json, report, "shadowtrace doctor: the hooks could not start (see the line above)\n")
        return 1
    report["device_kernels"] = kernels.describe()
    if not as_json:
        out.write(f"device kernels: {report['device_kernels']}\n")
    engines: dict[str, Any] = {}
    try:
        for name, package in ENGINES.items():
            engines[package] = _engine(out if not as_json else None, name, package, sess)
            ok &= engines[package]["ok"]
    finally:
        session.stop()
    report["engines"] = engines
    report["ok"] = ok
    if as_json:
        out.write(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


def _write(out: TextIO, as_json: bool, report: dict[str, Any], text: str) -> None:
    out.write(json.dumps(report, indent=2) + "\n" if as_json else text)


def _engine(out: TextIO | None, name: str, package: str, sess: session.Session) -> dict[str, Any]:
    """One engine's report: written to `out` as text (when given), and returned as data."""
    write = out.write if out is not None else (lambda _: 0)
    if importlib.util.find_spec(package) is None:
        write(f"{package}: not installed\n")
        return {"installed": False, "ok": True}
    version = _version(package)
    write(f"{package} {version}\n")
    modules = {}
    for module_name, adapter in adapters.TARGETS.items():
        if adapter != name:
            continue
        modules[module_name] = _module(module_name, sess)
        write(f"  {module_name}: {modules[module_name]}\n")
    hooked = sum(status.startswith("hooked") for status in modules.values())
    if not hooked:
        write(f"  nothing of {package} {version} is hooked: a run on it records no indexer rows\n")
    return {"installed": True, "version": version, "modules": modules, "ok": hooked > 0}


def _version(package: str) -> str:
    """The version of the package that imports (which may not be the installed distribution
    when PYTHONPATH puts another copy first)."""
    try:
        return str(importlib.import_module(package).__version__)
    except Exception:
        try:
            return importlib.metadata.version(DISTRIBUTIONS.get(package, package))
        except importlib.metadata.PackageNotFoundError:
            return "unknown version"


def _module(name: str, sess: session.Session) -> str:
    try:
        if importlib.util.find_spec(name) is None:
            return "not in this version"
    except (ImportError, ValueError) as e:  # a parent package that fails to import
        return f"cannot be looked up: {type(e).__name__}: {e}"
    try:
        module = importlib.import_module(name)
    except Exception as e:  # an engine module may need a GPU or a platform at import
        return f"found, but importing it failed: {type(e).__name__}: {e}"
    refused = sess.disabled.get(f"install:{name}")
    if refused is not None:
        return f"found, not hooked: {refused}"
    layout = getattr(module, "_shadowtrace_layout", None)
    if layout is None:
        return "found, not hooked (the adapter installed nothing on it)"
    scores = getattr(module, "_shadowtrace_scores", None)
    return f"hooked, layout {layout.name} ({layout.source})" + (f"; {scores}" if scores else "")
