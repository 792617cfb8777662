"""The SHADOWTRACE_* environment, read once, as `schemas/v1/env.json` defines it.

`resolve` gives every variable's canonical value with defaults applied, the same JSON the
Rust side's `shadowtrace env --format json` prints for the same environment.
"""

from collections.abc import Mapping
from typing import Any

from shadowtrace_hooks import definitions


class EnvError(ValueError):
    """A variable whose value does not read as its type."""

    def __init__(self, name: str, got: str, expected: str) -> None:
        super().__init__(f"{name}={got!r}: expected {expected}")
        self.name, self.got, self.expected = name, got, expected


def variables() -> list[dict[str, Any]]:
    """Every variable's definition, in file order."""
    return definitions.load("env")["variables"]


def resolve(environ: Mapping[str, str]) -> dict[str, Any]:
    """Every variable's canonical value, defaults applied.

    Raises EnvError for the first value that does not read.
    """
    out = {}
    for var in variables():
        raw = environ.get(var["name"], var["default"])
        value = _parse(var, raw.strip())
        if isinstance(value, _Bad):
            raise EnvError(var["name"], raw, value.expected)
        out[var["name"]] = value
    return out


class _Bad:
    def __init__(self, expected: str) -> None:
        self.expected = expected


def _items(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _number(var: dict[str, Any], raw: str, kind: type) -> Any:
    minimum = var.get("min")
    try:
        value = kind(raw)
    except ValueError:
        value = None
    ok = value is not None and value == value and value not in (float("inf"), float("-inf"))
    if ok and (minimum is None or value >= minimum):
        return value
    what = "an integer" if kind is int else "a number"
    return _Bad(f"{what} >= {minimum}")


def _parse(var: dict[str, Any], raw: str) -> Any:
    kind = var["type"]
    vocabulary = definitions.load("vocabulary")
    if kind == "bool":
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("", "0", "false", "no", "off"):
            return False
        return _Bad("1/true/yes/on or 0/false/no/off")
    if kind == "path":
        return raw if raw else _Bad("a directory path")
    if kind == "enum":
        return raw if raw in var["values"] else _Bad("one of " + ", ".join(var["values"]))
    if kind == "int":
        return _number(var, raw, int)
    if kind == "float":
        return _number(var, raw, float)
    if kind == "layers":
        return _layers(raw)
    if kind == "sites":
        known = [s["name"] for s in vocabulary["sites"]]
        sites = _items(raw)
        if raw == "all":
            return "all"
        if not sites or any(s not in known for s in sites):
            return _Bad("all, or a comma list of " + ", ".join(known))
        return sites
    if kind == "modes":
        modes = _items(raw)
        known = vocabulary["shadow_modes"]
        if not modes or any(m not in known for m in modes):
            return _Bad("a comma list of " + ", ".join(known))
        return list(dict.fromkeys(modes))
    if kind == "tokens":
        return _tokens(raw)
    if kind == "tags":
        tags = {}
        for pair in _items(raw):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                return _Bad("comma-separated key=value pairs with non-empty keys")
            tags[key.strip()] = value.strip()
        return tags
    return _Bad(f"a value of the unknown type {kind} (a defect in env.json)")


def _layers(raw: str) -> Any:
    if raw == "all":
        return "all"
    expected = _Bad("all, or layers and ranges such as 0-3,10")
    ranges = []
    for part in _items(raw):
        first, _, last = part.partition("-")
        last = last or first
        if not (first.strip().isdigit() and last.strip().isdigit()):
            return expected
        a, b = int(first), int(last)
        if a > b:
            return expected
        ranges.append([a, b])
    return sorted(ranges) if ranges else expected


def _tokens(raw: str) -> Any:
    if raw == "all":
        return {"kind": "all"}
    kind, _, n = raw.partition(":")
    if kind in ("every", "last") and n.strip().isdigit() and int(n) >= 1:
        return {"kind": kind, "n": int(n)}
    return _Bad("all, every:N or last:N with N >= 1")
