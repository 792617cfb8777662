"""The definition files shipped with the package: trace format v1 and the environment.

They are the repository's `schemas/v1/*.json`, the same files the Rust side compiles in.
"""

import json
from functools import cache
from importlib import resources
from typing import Any

TABLES = ("hidden", "topk", "events", "logits")
SCHEMA_VERSION = 1


@cache
def load(name: str) -> Any:
    """One definition file, parsed: `hidden`, `topk`, `events`, `logits`, `vocabulary`, `env`."""
    text = resources.files("shadowtrace_hooks").joinpath("schemas", f"{name}.json").read_text()
    return json.loads(text)


def manifest_schema() -> Any:
    """The JSON Schema of manifest.json."""
    return load("manifest.schema")
