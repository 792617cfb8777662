"""What an adapter hooks, as data.

Each adapter declares its `LAYOUTS`: for every upstream layout it supports (a release range
or a commit), the symbols it patches or reads, with the parameters it relies on. The same
declarations serve two checks:

- at install, `select` resolves them on the imported engine (`inspect`) and picks the layout
  that matches, or refuses with every difference;
- the conformance tests resolve them in released source without importing it (`ast`, in
  `hooks/tests/conformance/`), so a release that moved or changed a symbol fails a test
  instead of a user's trace.
"""

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

# A release as sources name them: 0.33.0, 5.24.0 (a commit hash or a PR number is none).
_RELEASE = re.compile(r"\d+(?:\.\d+)+")


class UnsupportedVersion(RuntimeError):
    """The engine has none of the layouts the adapter was written against."""


@dataclass(frozen=True)
class Symbol:
    """A class method or module function the adapter patches or calls, in `module`.

    `params` are the parameter names as `inspect.signature` lists them (`self` included for
    methods, `*args`/`**kwargs` by name); with `leading`, the engine may add parameters
    after these.
    """

    module: str
    qualname: str
    params: tuple[str, ...]
    leading: bool = False

    def mismatch(self, got: list[str] | None) -> str | None:
        """Why parameters `got` (None: the symbol is missing) do not fit, or None."""
        where = f"{self.module}.{self.qualname}"
        if got is None:
            return f"{where} does not exist"
        have = got[: len(self.params)] if self.leading else got
        if tuple(have) == self.params:
            return None
        tail = ", ..." if self.leading else ""
        return f"{where}: expected parameters ({', '.join(self.params)}{tail}), got ({', '.join(got)})"


@dataclass(frozen=True)
class Layout:
    """One upstream layout: where it comes from (release range or commit) and its symbols."""

    name: str
    source: str
    symbols: tuple[Symbol, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.module for s in self.symbols))

    @property
    def newest(self) -> str | None:
        """The newest release the layout was checked against: the last its source names
        (None for a layout checked against commits, whose releases are not compared)."""
        found = _RELEASE.findall(self.source)
        return found[-1] if found else None

    def untested(self, engine: str, version: str) -> str | None:
        """Why a run on `engine` `version` is on a release nobody checked this layout
        against (newer than `newest`, or a version that names no release), or None.
        Signatures that still match say nothing of what the code now means."""
        newest = self.newest
        if newest is None:
            return None
        release = _release(version)
        if not release:
            return (
                f"{engine} version {version!r} names no release: not compared with {newest}, the newest "
                f"release layout {self.name} was checked against"
            )
        if release <= _release(newest):
            return None
        return (
            f"{engine} {version} is newer than {newest}, the newest release layout {self.name} "
            f"was checked against: its signatures match, what it records may still be misread"
        )


def _release(version: str) -> tuple[int, ...]:
    """The numbers of a release (0.34.0rc1 -> (0, 34, 0)); () when it names none."""
    found = _RELEASE.match(version.strip())
    if found is None:
        found = re.match(r"\d+", version.strip())
    return tuple(int(part) for part in found.group().split(".")) if found else ()


def run_settings(layout: Layout, engine: str, version: str, more: str = "") -> dict[str, str]:
    """The settings every run traced on `layout` records: `adapter` (what was hooked, `more`
    appended), and `untested_engine_version` where the engine is newer than the layout was
    checked against, said once on stderr too."""
    out = {"adapter": f"{engine}: layout {layout.name} ({layout.source}){more}"}
    why = layout.untested(engine, version)
    if why is not None:
        from shadowtrace_hooks import session  # the conformance tests read layouts without torch

        out["untested_engine_version"] = why
        session.warn_once(f"untested:{engine}:{layout.name}", why)
    return out


def parameters(obj: Any) -> list[str] | None:
    """Parameter names of a function or method, None when it is not callable. A function a
    decorator wrapped is read through the wrapper: `functools.wraps`' `__wrapped__`, and the
    hub-kernel wrapper of the `kernels` package (a hard dependency of transformers from
    5.25), which replaces a decorated function by an `nn.Module` instance whose call reads
    `(*args, **kwargs)` and whose class's `forward` carries the function's own signature
    after `self` (kernels 0.18 and 0.19: `_create_func_module`, `kernel_layer_name`)."""
    if obj is None or not callable(obj):
        return None
    target, skip = obj, 0
    if hub_kernel_layer(obj) is not None:
        target, skip = type(obj).forward, 1
    try:
        return list(inspect.signature(inspect.unwrap(target)).parameters)[skip:]
    except (TypeError, ValueError):
        return None


def hub_kernel_layer(obj: Any) -> str | None:
    """The hub-kernel layer name of a function the `kernels` package wrapped (an instance of
    a module class carrying `kernel_layer_name`), or None for anything else."""
    if inspect.isclass(obj) or not callable(getattr(type(obj), "forward", None)):
        return None
    name = getattr(type(obj), "kernel_layer_name", None)
    return name if isinstance(name, str) else None


def resolve(module: Any, qualname: str) -> Any:
    """`Class.method` or `function` in an imported module, or None."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def problems(layout: Layout, modules: dict[str, Any]) -> list[str]:
    """Every difference between the layout and the imported modules (by name)."""
    out = []
    for symbol in layout.symbols:
        module = modules.get(symbol.module)
        if module is None:
            out.append(f"{symbol.module} is not imported")
            continue
        why = symbol.mismatch(parameters(resolve(module, symbol.qualname)))
        if why is not None:
            out.append(why)
    return out


def select(layouts: tuple[Layout, ...], modules: dict[str, Any], where: str) -> Layout:
    """The first layout every symbol of which the imported modules match; UnsupportedVersion
    naming each layout's differences when none does."""
    reasons = []
    for layout in layouts:
        wanted = {m: modules.get(m) for m in layout.modules}
        why = problems(layout, wanted)
        if not why:
            return layout
        reasons.append(f"{layout.name} ({layout.source}): " + "; ".join(why))
    raise UnsupportedVersion(f"{where}: no supported layout matches: " + " | ".join(reasons))


def imported(name: str) -> Any:
    """The module, imported (for layouts whose symbols span modules the engine has loaded)."""
    return importlib.import_module(name)
