"""The head-weight scale the SGLang and vLLM adapters record (`engine.folded_scale`), against
the released code that folds it: each release's Indexer `__init__` is evaluated for the
attributes it sets, and the factors its own fold multiplies the head weights by (SGLang's
`_get_logits_head_gate`, vLLM's `Indexer.forward`) are read from its source and multiplied.
If a release renamed an attribute the adapter reads, dropped or added a factor, the adapter
would record a scale the engine does not use; here the two must agree, and must agree with
the model's index_head_dim^-0.5 x index_n_heads^-0.5 for GLM-5 and DeepSeek-V3.2's shapes.
Nothing of the engines is imported: wheels fetched once, read with `ast` (upstream.py)."""

import ast
import math
from types import SimpleNamespace

import pytest
import test_conformance_sglang as sglang_releases
import test_conformance_vllm as vllm_releases
from shadowtrace_hooks.adapters import engine
from shadowtrace_hooks.adapters import vllm as vllm_adapter
from upstream import Source, source

# (index_n_heads, index_head_dim) of GLM-5 and DeepSeek-V3.2 (their config.json)
SHAPES = {"glm_moe_dsa": (32, 128), "deepseek_v32": (64, 128)}


def init_attributes(src: Source, module: str, heads: int, dim: int) -> SimpleNamespace:
    """The attributes `Indexer.__init__` of `module` sets from plain values, in order: each
    `self.x = <expr>` whose expression evaluates from the constructor's shape arguments,
    the config and what was set before (module and tensor attributes do not, and are left out)."""
    node = src.definition(module, "Indexer.__init__")
    assert isinstance(node, ast.FunctionDef), f"Indexer.__init__ in {module} of {src.path.name}"
    config = SimpleNamespace(index_n_heads=heads, index_head_dim=dim, index_topk=2048, hidden_size=6144)
    self = SimpleNamespace()
    names = {"self": self, "config": config, "index_n_heads": heads, "index_head_dim": dim}
    for stmt in ast.walk(node):
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        target = stmt.targets[0]
        if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            try:
                value = eval(compile(ast.Expression(stmt.value), module, "eval"), {}, names)
            except Exception:  # a module, a tensor, a call into the engine: not a plain value
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                setattr(self, target.attr, value)
    return self


def factors(chain: ast.expr) -> list[ast.expr]:
    """The operands of a product a * b * c (any nesting of `*`)."""
    if isinstance(chain, ast.BinOp) and isinstance(chain.op, ast.Mult):
        return factors(chain.left) + factors(chain.right)
    return [chain]


def self_factor(node: ast.expr) -> bool:
    """`self.x`, or `self.x ** <constant>`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        exponent = node.right.operand if isinstance(node.right, ast.UnaryOp) else node.right
        return self_factor(node.left) and isinstance(exponent, ast.Constant)
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def fold(src: Source, module: str, method: str, self: SimpleNamespace) -> tuple[float, list[str]]:
    """The product of the `self` factors every `weights = ... * ...` in `Indexer.<method>`
    multiplies the head weights by, evaluated on the `__init__` attributes; and those factors."""
    node = src.definition(module, f"Indexer.{method}")
    assert node is not None, f"Indexer.{method} in {module} of {src.path.name}"
    found = []
    for stmt in ast.walk(node):
        if isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ["weights"]:
            found += [f for f in factors(stmt.value) if self_factor(f)]
    assert found, f"no scale factor folded into the head weights in Indexer.{method} of {src.path.name}"
    product = 1.0
    for f in found:
        product *= eval(compile(ast.Expression(f), module, "eval"), {}, {"self": self})
    return product, [ast.unparse(f) for f in found]


def check(src: Source, module: str, method: str, heads_attr: str, family: str) -> None:
    heads, dim = SHAPES[family]
    self = init_attributes(src, module, heads, dim)
    released, names = fold(src, module, method, self)
    recorded = engine.folded_scale(self, "softmax_scale", heads_attr)
    assert recorded is not None, (
        f"{src.path.name}: Indexer.__init__ sets no softmax_scale / {heads_attr} the adapter reads "
        f"(it sets {sorted(vars(self))})"
    )
    assert math.isclose(recorded, released, rel_tol=1e-12), (
        f"{src.path.name}: the release folds {' x '.join(names)} = {released}, the adapter records {recorded}"
    )
    verdict = engine.head_weight_scale_convention(recorded, "release", SimpleNamespace(
        index_n_heads=heads, index_head_dim=dim))  # fmt: skip
    assert not engine.departs(verdict), verdict
    assert math.isclose(released, dim**-0.5 * heads**-0.5, rel_tol=1e-12)


@pytest.mark.parametrize("family", SHAPES)
@pytest.mark.parametrize("version", sglang_releases.VERSIONS)
def test_the_scale_the_sglang_adapter_records_is_the_one_the_release_folds(version: str, family: str) -> None:
    module, _ = sglang_releases.RELEASES[version]
    check(source("sglang", version), module, "_get_logits_head_gate", "n_heads", family)


@pytest.mark.parametrize("family", SHAPES)
@pytest.mark.parametrize("version", vllm_releases.RELEASES)
def test_the_scale_the_vllm_adapter_records_is_the_one_the_release_folds(version: str, family: str) -> None:
    check(source("vllm", version), vllm_adapter.MODEL_MODULE, "forward", "n_head", family)
