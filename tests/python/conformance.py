"""Checks of an adapter's declared layouts against released source, shared by the
per-engine conformance tests (`test_conformance_*.py`)."""

import ast

from shadowtrace_hooks.adapters.layout import Layout
from upstream import Source


def mismatches(source: Source, layout: Layout) -> list[str]:
    """Every symbol of `layout` that the released source lacks or defines with other
    parameters (empty: the layout matches)."""
    out = []
    for symbol in layout.symbols:
        why = symbol.mismatch(source.parameters(symbol.module, symbol.qualname))
        if why is not None:
            out.append(why)
    return out


def selected(source: Source, layouts: tuple[Layout, ...], module: str) -> tuple[Layout | None, list[str]]:
    """The layout an install on `module` would pick in this release (the first whose
    symbols all match, as `layout.select` does at run time), and every layout's reasons."""
    reasons = []
    for layout in layouts:
        if module not in layout.modules:
            continue
        why = mismatches(source, layout)
        if not why:
            return layout, reasons
        reasons.append(f"{layout.name}: " + "; ".join(why))
    return None, reasons


def calls(source: Source, module: str, qualname: str, callee: str) -> bool:
    """Whether the body of `qualname` in `module` calls `callee` (as `callee(...)` or
    `x.callee(...)`)."""
    node = source.definition(module, qualname)
    if node is None:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == callee:
                return True
    return False


def mapping(source: Source, module: str, name: str) -> dict:
    """A module-level dict literal (or OrderedDict([...]) of pairs), evaluated."""
    tree = source.tree(module)
    assert tree is not None, f"{module} is not in {source.path.name}"
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        value = node.value
        if isinstance(value, ast.Call) and value.args:  # OrderedDict([...])
            value = value.args[0]
        return dict(ast.literal_eval(value))
    raise AssertionError(f"{module}.{name} is not in {source.path.name}")
