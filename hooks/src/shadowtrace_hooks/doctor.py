"""What the adapters find and hook in this environment, for `python -m shadowtrace_hooks
doctor`: first whether the hooks' Triton kernels will run here; then per engine installed
here, its version and, for every module an adapter targets, whether the module exists,
whether importing it hooked it (the layout it matched) and, when not, why. It imports the
engines' modules, as tracing would: run it in the engine's environment, not inside a
serving process."""

import importlib
import importlib.metadata
import importlib.util
from typing import TextIO

from shadowtrace_hooks import adapters, kernels, session, startup

ENGINES = {"hf": "transformers", "trtllm": "tensorrt_llm", "sglang": "sglang", "vllm": "vllm"}
DISTRIBUTIONS = {"tensorrt_llm": "tensorrt-llm"}


def run(out: TextIO) -> int:
    """Writes the report; 0 when every installed engine had its targets hooked, 1 otherwise."""
    sess = startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": "/nonexistent-shadowtrace-doctor"})
    if sess is None:
        out.write("shadowtrace doctor: the hooks could not start (see the line above)\n")
        return 1
    ok = True
    out.write(f"device kernels: {kernels.describe()}\n")
    try:
        for name, package in ENGINES.items():
            ok &= _engine(out, name, package, sess)
    finally:
        session.stop()
    return 0 if ok else 1


def _engine(out: TextIO, name: str, package: str, sess: session.Session) -> bool:
    if importlib.util.find_spec(package) is None:
        out.write(f"{package}: not installed\n")
        return True
    version = _version(package)
    out.write(f"{package} {version}\n")
    hooked = 0
    for module_name, adapter in adapters.TARGETS.items():
        if adapter != name:
            continue
        status = _module(module_name, sess)
        hooked += status.startswith("hooked")
        out.write(f"  {module_name}: {status}\n")
    if not hooked:
        out.write(f"  nothing of {package} {version} is hooked: a run on it records no indexer rows\n")
    return hooked > 0


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
