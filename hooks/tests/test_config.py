"""The SHADOWTRACE_* environment reads as env.json defines it."""

import pytest
from shadowtrace_hooks.config import EnvError, resolve, unknown_names, variables


def test_unset_means_off_with_the_documented_defaults() -> None:
    values = resolve({})
    assert values["SHADOWTRACE"] is False
    assert values["SHADOWTRACE_LAYERS"] == "all"
    assert values["SHADOWTRACE_MODE"] == ["local"]
    assert values["SHADOWTRACE_TOKENS"] == {"kind": "all"}
    assert values["SHADOWTRACE_QUEUE_MB"] == 256
    assert values["SHADOWTRACE_QUEUE_TIMEOUT_S"] == values["SHADOWTRACE_FLUSH_TIMEOUT_S"] == 30.0
    assert list(values) == [v["name"] for v in variables()]


def test_values_read_as_their_types() -> None:
    values = resolve(
        {
            "SHADOWTRACE": "on",
            "SHADOWTRACE_LAYERS": "10, 0-3,76-77",
            "SHADOWTRACE_SITES": "layer_out,indexer",
            "SHADOWTRACE_MODE": "free,local,free",
            "SHADOWTRACE_TOKENS": "every:4",
            "SHADOWTRACE_TAGS": "prompt_kind=tool, ticket=12",
        }
    )
    assert values["SHADOWTRACE"] is True
    assert values["SHADOWTRACE_LAYERS"] == [[0, 3], [10, 10], [76, 77]]
    assert values["SHADOWTRACE_SITES"] == ["layer_out", "indexer"]
    assert values["SHADOWTRACE_MODE"] == ["free", "local"]
    assert values["SHADOWTRACE_TOKENS"] == {"kind": "every", "n": 4}
    assert values["SHADOWTRACE_TAGS"] == {"prompt_kind": "tool", "ticket": "12"}


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("SHADOWTRACE_LAYERS", "3-1", "all, or layers and ranges such as 0-3,10"),
        ("SHADOWTRACE_SHADOW", "fp16", "one of fp32, bf16, none"),
        ("SHADOWTRACE_QUEUE_MB", "0", "an integer >= 1"),
        (
            "SHADOWTRACE_QUEUE_CAPACITY",
            "4096",
            "unset: replaced by SHADOWTRACE_QUEUE_MB (the queue is bounded in bytes, not rows)",
        ),
        ("SHADOWTRACE_BOUNDARY_BAND", "nan", "a number >= 0"),
        ("SHADOWTRACE", "maybe", "1/true/yes/on or 0/false/no/off"),
        ("SHADOWTRACE_TOKENS", "last:0", "all, every:N or last:N with N >= 1"),
    ],
)
def test_a_bad_value_names_the_variable_what_it_got_and_what_it_expected(
    name: str, value: str, expected: str
) -> None:
    with pytest.raises(EnvError) as err:
        resolve({name: value})
    assert str(err.value) == f"{name}={value!r}: expected {expected}"


def test_an_unknown_name_is_named_once_with_the_closest_variable() -> None:
    names = ["SHADOWTRACE_LAYER", "PATH", "SHADOWTRACE_LAYERS", "SHADOWTRACE_LAYER",
             "SHADOWTRACE_SHADOW_SCOPES", "SHADOWTRACE_DIRECTORY"]  # fmt: skip
    assert unknown_names(names) == [
        ("SHADOWTRACE_LAYER", "SHADOWTRACE_LAYERS"),
        ("SHADOWTRACE_SHADOW_SCOPES", "SHADOWTRACE_SHADOW_SCOPE"),
        ("SHADOWTRACE_DIRECTORY", "SHADOWTRACE_DIR"),
    ]


def test_the_other_programs_and_retired_names_are_not_unknown() -> None:
    names = ["SHADOWTRACE", "SHADOWTRACE_BIN_DIR", "SHADOWTRACE_BENCH_REPEATS",
             "SHADOWTRACE_QUEUE_CAPACITY", "SHADOWTRACEX"]  # fmt: skip
    assert unknown_names(names) == []
