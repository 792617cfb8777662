"""Released engine code, as its users install it: wheels fetched from the package registry
with `pip download --no-deps` and cached under `~/.cache/shadowtrace/upstream` (or
`$XDG_CACHE_HOME/shadowtrace/upstream`), so a second run reads them from disk.

- `Source` reads a wheel's Python files in place and resolves the adapters' declared
  symbols with `ast`, importing nothing (the conformance tests);
- `site` installs a wheel into a directory of its own, meant to go first on PYTHONPATH (a
  second transformers beside the virtualenv's, on the virtualenv's torch).
"""

import ast
import email
import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shadowtrace" / "upstream"


def wheel(package: str, version: str) -> Path:
    """The released wheel of `package==version`, downloaded on first use."""
    wheels = CACHE / "wheels"
    with _locked():
        return _wheel(wheels, package, version)


@contextmanager
def _locked() -> Iterator[None]:
    """One process at a time fills the cache: `./dev test` runs pytest's workers side by side,
    and two downloads or installs of one release into one directory would interleave."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _wheel(wheels: Path, package: str, version: str) -> Path:
    found = sorted(wheels.glob(f"{package}-{version}-*.whl"))
    if not found:
        # The wheel for the interpreter and platform the project pins (CPython 3.11, Linux
        # x86_64), whatever runs the tests: the files read are the same in every wheel.
        platforms = [f"--platform=manylinux_2_{m}_x86_64" for m in (17, 28, 34)] + ["--platform=any"]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--python-version=3.11", "--implementation=cp", *platforms,
             "--dest", str(wheels), f"{package}=={version}"],
            check=True,
        )  # fmt: skip
        found = sorted(wheels.glob(f"{package}-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download {package}=={version} left no wheel in {wheels}")
    return found[0]


# What a release needs beside the virtualenv's packages, pinned: transformers 5.25 requires
# huggingface_hub 2 (and its new HTTP stack) and depends on `kernels`, which wraps hub-kernel
# functions as modules (the HF adapter must read through that wrapper).
COMPANIONS = {
    ("transformers", "5.25.0"): (
        "kernels==0.19.1", "huggingface_hub==2.4.0", "httpx2==2.17.0", "httpcore2==2.17.0",
        "truststore==0.10.5", "tomlkit==0.15.3",
    ),
}  # fmt: skip


def unmet(package: str, version: str) -> list[str]:
    """The requirements of `package==version`, as its wheel's metadata states them, that
    neither this environment nor the release's pinned `COMPANIONS` meet: such a release is
    refused at import (transformers 5.17 requires huggingface_hub < 2, which an environment
    with vLLM 0.34's huggingface_hub 2 cannot give it beside its own)."""
    pinned = {}
    for companion in COMPANIONS.get((package, version), ()):
        requirement = Requirement(companion)
        pinned[canonical(requirement.name)] = next(iter(requirement.specifier)).version
    with zipfile.ZipFile(wheel(package, version)) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = email.message_from_bytes(archive.read(name)).get_all("Requires-Dist") or []
    missing = []
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        found = pinned.get(canonical(requirement.name))
        if found is None:
            try:
                found = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                missing.append(f"{requirement} (not installed)")
                continue
        if not requirement.specifier.contains(found, prereleases=True):
            missing.append(f"{requirement} (found {found})")
    return missing


def canonical(name: str) -> str:
    """A distribution's name as the registry compares them (PEP 503)."""
    return name.lower().replace("_", "-").replace(".", "-")


def site(package: str, version: str) -> Path:
    """A directory holding `package==version` and its pinned `COMPANIONS` (no other
    dependencies: the virtualenv's serve), installed once."""
    target = CACHE / "site" / f"{package}-{version}"
    if (target / ".complete").exists():
        return target
    built = wheel(package, version)
    with _locked():
        if (target / ".complete").exists():
            return target
        shutil.rmtree(target, ignore_errors=True)
        companions = COMPANIONS.get((package, version), ())
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
             "--only-binary=:all:", "--target", str(target), str(built), *companions],
            check=True,
        )  # fmt: skip
        (target / ".complete").touch()
    return target


@cache
def source(package: str, version: str) -> "Source":
    return Source(wheel(package, version))


class Source:
    """The Python modules of one wheel, parsed on demand without importing them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> str | None:
        """The wheel member defining `module` (a module file or a package's __init__)."""
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in self.names:
                return name
        return None

    def text(self, module: str) -> str | None:
        name = self.file(module)
        return None if name is None else self.zip.read(name).decode()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    def definition(self, module: str, qualname: str, _seen: frozenset = frozenset()) -> ast.AST | None:
        """The class, function or method `qualname` as `module` exposes it: defined there,
        or imported into it by name or by `*` (the last binding in the file wins)."""
        tree = self.tree(module)
        if tree is None or (module, qualname) in _seen:
            return None
        seen = _seen | {(module, qualname)}
        head, _, rest = qualname.partition(".")
        found: ast.AST | None = None
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == head:
                found = node
            elif isinstance(node, ast.ImportFrom):
                origin = self.absolute(module, node)
                for alias in node.names:
                    if alias.name == "*" and found is None:
                        found = self.definition(origin, head, seen) or found
                    elif (alias.asname or alias.name) == head:
                        found = self.definition(origin, alias.name, seen)
        if found is None or not rest:
            return found
        if not isinstance(found, ast.ClassDef):
            return None
        method = None
        for node in found.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == rest:
                method = node
        return method

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module an `from X import ...` in `module` names, relative imports resolved."""
        if not node.level:
            return node.module or ""
        is_package = (self.file(module) or "").endswith("__init__.py")
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def parameters(self, module: str, qualname: str) -> list[str] | None:
        """Parameter names as `inspect.signature` would list them, or None when missing."""
        node = self.definition(module, qualname)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        args = node.args
        names = [a.arg for a in (*args.posonlyargs, *args.args)]
        names += [args.vararg.arg] if args.vararg else []
        names += [a.arg for a in args.kwonlyargs]
        names += [args.kwarg.arg] if args.kwarg else []
        return names
