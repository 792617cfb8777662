"""What `doctor` checks of this environment before any engine: the three things a serving user
gets wrong first. The startup `.pth` must sit in a directory Python reads `.pth` files from (an
editable install leaves it out, and SHADOWTRACE=1 then starts nothing, silently); the
SHADOWTRACE_* variables must read (a bad value leaves tracing off; a typo'd name is ignored);
and SHADOWTRACE_DIR must be writable, or creatable, by this process.

Each check is a `Check`: whether it passed, and one line that says what was found. Nothing here
imports torch or an engine."""

import dataclasses
import os
import site
import tempfile
from collections.abc import Mapping
from pathlib import Path

from shadowtrace_hooks import config

PTH = "shadowtrace_hooks.pth"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: `ok` false is a problem doctor's exit status counts."""

    name: str
    ok: bool
    line: str


def site_directories() -> list[Path]:
    """The directories this Python processes `.pth` files in at start."""
    dirs = [Path(d) for d in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    return dirs


def startup_pth(dirs: list[Path] | None = None) -> Check:
    """Whether the startup `.pth` is installed where Python runs it."""
    dirs = site_directories() if dirs is None else dirs
    for d in dirs:
        pth = d / PTH
        if pth.is_file():
            if "shadowtrace_hooks.startup" not in pth.read_text(errors="replace"):
                return Check("startup", False, f"{pth} does not start the hooks: reinstall shadowtrace-hooks")
            return Check("startup", True, f"{pth}: SHADOWTRACE=1 starts the hooks in every new process")
    where = ", ".join(map(str, dirs)) or "no site-packages directory"
    return Check(
        "startup",
        False,
        f"{PTH} is not in {where}: SHADOWTRACE=1 starts nothing; install the wheel "
        "(pip install ./hooks), not an editable install, which leaves it out",
    )


def environment(environ: Mapping[str, str]) -> tuple[Check, dict | None]:
    """Whether the SHADOWTRACE_* variables read, whether SHADOWTRACE is on (off is no problem:
    set it in the engine's environment), and every name that is no variable. Also returns the
    resolved values, or None when one does not read."""
    unknown = config.unknown_names(environ)
    typos = "; ".join(config.unknown_name_line(n, c) for n, c in unknown)
    try:
        values = config.resolve(environ)
    except config.EnvError as e:
        line = f"{e}: the hooks would not trace" + (f"; {typos}" if typos else "")
        return Check("environment", False, line), None
    if values["SHADOWTRACE"]:
        sites = values["SHADOWTRACE_SITES"]
        line = (
            f"SHADOWTRACE is on: layers {_layers(values['SHADOWTRACE_LAYERS'])}, sites "
            f"{sites if isinstance(sites, str) else ','.join(sites)}, shadow "
            f"{values['SHADOWTRACE_SHADOW']} {','.join(values['SHADOWTRACE_MODE'])}"
        )
    else:
        line = "SHADOWTRACE is not set here: tracing is off (set SHADOWTRACE=1 in the engine's environment)"
    return Check("environment", not unknown, line + (f"; {typos}" if typos else "")), values


def _layers(value: str | list[list[int]]) -> str:
    """SHADOWTRACE_LAYERS' value as it is written: all, or 0-3,10."""
    if isinstance(value, str):
        return value
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in value)


def directory(path: str) -> Check:
    """Whether runs can be written under `path` (SHADOWTRACE_DIR) by this process: it is a
    writable directory (a file is created in it and removed), or the nearest directory above it
    that exists is writable, so it can be created. A relative path is resolved against this
    process's working directory: each engine process, TP workers included, resolves its own."""
    given = Path(path)
    target = given if given.is_absolute() else Path.cwd() / given
    relative = (
        "" if given.is_absolute() else " (relative: each process resolves it in its own working directory)"
    )
    if target.exists():
        if not target.is_dir():
            return Check("directory", False, f"SHADOWTRACE_DIR {target} is a file, not a directory")
        try:
            with tempfile.TemporaryFile(dir=target):
                pass
        except OSError as e:
            return Check("directory", False, f"SHADOWTRACE_DIR {target} is not writable: {e.strerror or e}")
        return Check("directory", True, f"SHADOWTRACE_DIR {target} is writable{relative}")
    above = target.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if above.is_dir() and os.access(above, os.W_OK | os.X_OK):
        line = f"SHADOWTRACE_DIR {target} does not exist yet; it will be created under {above}"
        line += ", which is writable"
        return Check("directory", True, line + relative)
    why = "is not writable" if above.is_dir() else "is not a directory"
    line = f"SHADOWTRACE_DIR {target} does not exist and cannot be created: {above} {why}"
    return Check("directory", False, line)


def run(environ: Mapping[str, str] | None = None) -> list[Check]:
    """The three checks on `environ` (the process's when None)."""
    environ = dict(os.environ if environ is None else environ)
    env_check, values = environment(environ)
    checks = [startup_pth(), env_check]
    if values is not None:
        checks.append(directory(values["SHADOWTRACE_DIR"]))
    else:
        checks.append(Check("directory", False, "not checked: the environment does not read"))
    return checks
