"""The SHADOWTRACE_* environment, read once, as `schemas/v1/env.json` defines it.

`resolve` gives every variable's canonical value with defaults applied, the same JSON the
Rust side's `shadowtrace env --format json` prints for the same environment, and refuses
exactly the values it refuses, naming the same variable (schemas/src/env.rs; a test runs a
corpus of valid and invalid values through both). Each type accepts what env.json's `types`
says and nothing more: Python's own `str.strip`, `int` and `float` accept more than that
(Unicode spaces and digits, `1_000`, `nan`), so they only run on text already checked.
"""

import re
from collections.abc import Iterable, Mapping
from typing import Any

from shadowtrace_hooks import definitions

# Words a bool variable reads as true or false (case-insensitive). The startup .pth line
# repeats FALSE_WORDS for SHADOWTRACE itself: it must decide before importing anything.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")

# The whitespace a value and its list items lose: ASCII only, as Rust's is_ascii_whitespace.
_SPACE = " \t\n\x0c\r"
_DIGITS = re.compile(r"[0-9]+")
_INTEGER = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# Integer types' ranges: i64 for int, u32 for layers, u64 for tokens (the Rust types).
_I64 = (-(1 << 63), (1 << 63) - 1)
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


def _integer(digits: str) -> int | None:
    """The value of text already checked to be ASCII digits (and a sign), or None when it
    is too long for any of the types above: int() refuses thousands of digits by raising.
    Leading zeros do not count toward the length (Rust's parse reads `0...01` as 1)."""
    sign, body = ("-", digits[1:]) if digits.startswith("-") else ("", digits)
    body = body.lstrip("0") or "0"
    return int(sign + body) if len(body) <= 21 else None


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
    for name, instead in definitions.load("env").get("retired", {}).items():
        if name in environ:
            raise EnvError(name, environ[name], instead)
    out = {}
    for var in variables():
        raw = environ.get(var["name"], var["default"])
        value = _parse(var, raw.strip(_SPACE))
        if isinstance(value, _Bad):
            raise EnvError(var["name"], raw, value.expected)
        out[var["name"]] = value
    return out


# The prefix every tracing variable's name starts with.
PREFIX = "SHADOWTRACE_"


def unknown_names(names: Iterable[str]) -> list[tuple[str, str]]:
    """The names among `names` (for the process: os.environ's) that start with SHADOWTRACE_
    and are neither a variable, a retired one, nor one of the project's other programs'
    (env.json's `not_tracing`; a name ending in * stands for every name it starts), each with
    the variable closest to it (edit distance; the first in file order on a tie), in the order
    given, each name once: most often a typo (SHADOWTRACE_LAYER), which would otherwise trace
    with the default silently. The Rust side's `env::unknown_names` gives the same."""
    env = definitions.load("env")
    known = {v["name"] for v in env["variables"]} | set(env.get("retired", {}))
    others = list(env.get("not_tracing", {}))
    out: dict[str, str] = {}
    for name in names:
        if not name.startswith(PREFIX) or name in known or name in out:
            continue
        if any(name.startswith(o[:-1]) if o.endswith("*") else name == o for o in others):
            continue
        out[name] = min(env["variables"], key=lambda v: _edit_distance(v["name"], name))["name"]
    return list(out.items())


def unknown_name_line(name: str, closest: str) -> str:
    """The warning for an unknown name, word for word the Rust side's."""
    return f"{name} is no shadowtrace variable and is ignored: did you mean {closest}?"


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between `a` and `b`, in characters."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a):
        current = [i + 1]
        for j, cb in enumerate(b):
            current.append(min(previous[j] + (ca != cb), previous[j + 1] + 1, current[j] + 1))
        previous = current
    return previous[len(b)]


class _Bad:
    def __init__(self, expected: str) -> None:
        self.expected = expected


def _items(raw: str) -> list[str]:
    return [part.strip(_SPACE) for part in raw.split(",") if part.strip(_SPACE)]


def _number(var: dict[str, Any], raw: str, kind: type) -> Any:
    minimum = var.get("min")
    value: int | float | None = None
    if kind is int and _INTEGER.fullmatch(raw):
        value = _integer(raw)
        value = value if value is not None and _I64[0] <= value <= _I64[1] else None
    elif kind is float and _DECIMAL.fullmatch(raw):
        value = float(raw)
        value = value if abs(value) != float("inf") else None
    if value is not None and (minimum is None or value >= minimum):
        return value
    what = "an integer" if kind is int else "a number"
    return _Bad(what if minimum is None else f"{what} >= {minimum}")


def _parse(var: dict[str, Any], raw: str) -> Any:
    kind = var["type"]
    vocabulary = definitions.load("vocabulary")
    if kind == "bool":
        # ASCII letters only: no bool word is spelled otherwise.
        lowered = raw.lower() if raw.isascii() else raw
        if lowered in TRUE_WORDS:
            return True
        if lowered in FALSE_WORDS:
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
    if kind == "topk_lists":
        return _topk_lists(raw)
    if kind == "tags":
        tags = {}
        for pair in _items(raw):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip(_SPACE):
                return _Bad("comma-separated key=value pairs with non-empty keys")
            tags[key.strip(_SPACE)] = value.strip(_SPACE)
        return tags
    if kind == "grafts":
        return _grafts(raw)
    return _Bad(f"a value of the unknown type {kind} (a defect in env.json)")


def _layers(raw: str) -> Any:
    if raw == "all":
        return "all"
    expected = _Bad("all, or layers and ranges such as 0-3,10")
    ranges = []
    for part in _items(raw):
        pair = _layer_range(part)
        if pair is None:
            return expected
        ranges.append(pair)
    return sorted(ranges) if ranges else expected


def _layer_range(text: str) -> list[int] | None:
    """A layer `N` or an inclusive range `N-M` as the layers and grafts types write it (the
    Rust side's `env::layer_range`); None for anything else."""
    first, dash, last = text.partition("-")
    # "3" is the range 3-3; "3-" and "-3" are neither.
    first, last = first.strip(_SPACE), (last if dash else first).strip(_SPACE)
    if not (_DIGITS.fullmatch(first) and _DIGITS.fullmatch(last)):
        return None
    a, b = _integer(first), _integer(last)
    if a is None or b is None or a > b or b > _U32_MAX:
        return None
    return [a, b]


# The sites a graft may name (SHADOWTRACE_GRAFT).
GRAFT_SITES = ("indexer", "attn_out", "mlp_out", "layer_out")


def _grafts(raw: str) -> Any:
    expected = _Bad(
        "empty, or a comma list of SITE, SITE@N or SITE@N-M with SITE one of indexer, "
        "attn_out, mlp_out, layer_out and N <= M"
    )
    grafts = []
    for part in _items(raw):
        site, at, layers = part.partition("@")
        site = site.strip(_SPACE)
        if site not in GRAFT_SITES:
            return expected
        if not at:
            grafts.append({"site": site, "layers": "all"})
            continue
        pair = _layer_range(layers)
        if pair is None:
            return expected
        grafts.append({"site": site, "layers": pair})
    return grafts


def _tokens(raw: str) -> Any:
    if raw == "all":
        return {"kind": "all"}
    kind, _, n = raw.partition(":")
    n = n.strip(_SPACE)
    count = _integer(n) if _DIGITS.fullmatch(n) else None
    if kind in ("every", "last") and count is not None and 1 <= count <= _U64_MAX:
        return {"kind": kind, "n": count}
    return _Bad("all, every:N or last:N with N >= 1")


def _topk_lists(raw: str) -> Any:
    if raw in ("none", "all"):
        return {"kind": raw}
    kind, _, n = raw.partition(":")
    n = n.strip(_SPACE)
    count = _integer(n) if _DIGITS.fullmatch(n) else None
    if kind == "every" and count is not None and 1 <= count <= _U64_MAX:
        return {"kind": kind, "n": count}
    return _Bad("none, all or every:N with N >= 1")
