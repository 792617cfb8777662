"""Activation by environment alone.

The `shadowtrace_hooks.pth` file the package installs into site-packages runs at every
interpreter start: it imports this module only when SHADOWTRACE is set to something other
than 0, so with it unset nothing of shadowtrace is imported. `activate` then reads the
environment once (schemas/v1/env.json), starts the session, and installs each engine
adapter when the engine's module is imported: in the main process and in every worker the
engine spawns, since they start Python too.
"""

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import signal
import sys
import threading
from types import ModuleType
from typing import Any

from shadowtrace_hooks import adapters, config, session

log = logging.getLogger("shadowtrace")


class _InstallAfterExec(importlib.abc.Loader):
    """Runs the real loader, then installs the adapter on the fresh module."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _install(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a target module it asks the other finders and wraps the
    loader they return."""

    def __init__(self) -> None:
        self.searching: set[str] = set()

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if adapters.adapter_for(name) is None or name in self.searching:
            return None
        self.searching.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.searching.discard(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _InstallAfterExec(spec.loader)
        return spec


def _install(module: ModuleType) -> None:
    sess = session.current()
    if sess is not None:
        sess.guarded(f"install:{module.__name__}", None, adapters.install, module)


def _exit_on_sigterm() -> None:
    """SIGTERM's default action ends the process on the spot: the rows still queued would be
    lost, and nothing would say so. Where the process keeps that default, SIGTERM instead
    raises SystemExit (as serving engines' own handlers do), which unwinds the traced
    forward (its runs say `interrupted`) and runs the atexit flush; a second SIGTERM ends
    the process at once. A process with a handler of its own keeps it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


# Whether the process environment was read: Python 3.11's venvs process site-packages' .pth
# files twice (site.venv and site.main each add the directory), so the .pth line calls
# `activate` twice in one process; the second call must not say everything again.
_read_process_environment = False


def activate(environ: dict[str, str] | None = None) -> session.Session | None:
    """Starts tracing in this process when SHADOWTRACE says so (`environ`: the process
    environment when None, read once per process); a bad variable is reported once and leaves
    tracing off, and a SHADOWTRACE_* name that is no variable is warned about once, naming the
    closest one. Never raises."""
    global _read_process_environment
    if environ is None:
        if _read_process_environment:
            return session.current()
        _read_process_environment = True
    environ = dict(os.environ if environ is None else environ)
    for name, closest in config.unknown_names(environ):
        log.warning("shadowtrace: %s", config.unknown_name_line(name, closest))
    try:
        settings = session.Settings.from_environ(environ)
    except config.EnvError as e:
        log.warning("shadowtrace: not tracing: %s", e)
        return None
    if not settings.enabled:
        return None
    sess = session.start(settings)
    atexit.register(session.stop)
    _exit_on_sigterm()
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name in list(sys.modules):
        if adapters.adapter_for(name) is not None:
            _install(sys.modules[name])
    return sess
