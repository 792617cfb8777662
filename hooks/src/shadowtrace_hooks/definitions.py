"""The definition files shipped with the package: trace format v2 and the environment.

They are the repository's `schemas/v2/*.json` (what v2 redefines: the topk table and the
manifest) over `schemas/v1/*.json` (everything v2 keeps), the same files the Rust side
compiles in.
"""

import json
from functools import cache
from importlib import resources
from typing import Any

TABLES = ("hidden", "topk", "events", "logits")
SCHEMA_VERSION = 2
# Newest first: a definition is read from the first folder that holds it.
_FOLDERS = ("schemas_v2", "schemas")


@cache
def load(name: str) -> Any:
    """One definition file, parsed: `hidden`, `topk`, `events`, `logits`, `vocabulary`, `env`,
    `manifest.schema`."""
    package = resources.files("shadowtrace_hooks")
    for folder in _FOLDERS:
        path = package.joinpath(folder, f"{name}.json")
        if path.is_file():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"definition {name}.json: in none of {', '.join(_FOLDERS)}")


def manifest_schema() -> Any:
    """The JSON Schema of manifest.json."""
    return load("manifest.schema")
