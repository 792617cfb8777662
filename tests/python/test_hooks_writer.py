"""Runs written by the Python hooks are runs the Rust analyzer reads, and the hooks read
the environment exactly as the Rust side does."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
from conftest import SCHEMAS_V2, binary
from shadowtrace_hooks import definitions, format
from shadowtrace_hooks.config import EnvError, resolve, variables
from shadowtrace_hooks.writer import RunWriter

IDENTITY = {
    "run_id": "py-run",
    "model": {
        "name": "synthetic/tiny",
        "architecture": "glm_moe_dsa",
        "config_hash": "0" * 64,
        "revision": None,
        "num_layers": 2,
        "index_topk": 4,
    },
    "engine": {"name": "transformers", "version": "test", "commit": None, "variant": None},
    "device": {"kind": "cpu", "name": "cpu", "index": None},
    "dtypes": {"prod": "bf16", "shadow": "fp32"},
    "parallelism": {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "rank": 0, "world_size": 1},
    "shadow": {"precision": "fp32", "modes": ["local"]},
    "prompt": {"kind": "tool", "length": 8, "token_hash": "ab" * 32, "salt_id": None},
    "settings": {},
    "tags": {"written_by": "pytest"},
    "injections": [],
}


def hidden(layer: int, token: int, nan: int = 0) -> dict:
    err = math.nan if nan else 1e-3
    return {
        "seq": layer * 100 + token, "step": 0, "layer": layer, "site": "layer_out", "token": token,
        "shadow_mode": "local", "numel": 16, "prod_nan": nan, "prod_pos_inf": 0, "prod_neg_inf": 0,
        "prod_max_abs": 1.0, "prod_l2": 2.0, "shadow_nan": 0, "shadow_pos_inf": 0, "shadow_neg_inf": 0,
        "shadow_max_abs": 1.0, "shadow_l2": 2.0, "rel_l2_err": err, "cosine": 1.0, "max_abs_diff": err,
    }  # fmt: skip


def write_run(run_dir: Path) -> dict:
    writer = RunWriter(run_dir, IDENTITY)
    for layer in range(2):
        for token in range(8):
            assert writer.send("hidden", hidden(layer, token, nan=int(layer == 1 and token == 5)))
        for token in range(4, 8):
            # k = 4 of token + 1 visible keys: prod took 0..3, the shadow 0, 1, 2 and the
            # query's own key; |P & S| = 3, |P | S| = 5.
            writer.send(
                "topk",
                {
                    "step": 0, "layer": layer, "token": token, "shadow_input": "raw", "indexer_layer": layer,
                    "unit": "token", "unit_tokens": 1, "k": 4, "visible": token + 1, "prod_selected": 4,
                    "prod_kth_score": 1.0, "prod_kth_margin": 0.1, "shadow_selected": 4,
                    "shadow_kth_score": 1.0, "shadow_kth_margin": 0.1, "shared": 3, "jaccard": 3 / 5,
                    "prod_only_gaps": [3], "shadow_only_gaps": [token], "prod_gaps": [0, 1, 1, 1],
                },
            )  # fmt: skip
    writer.send("logits", {"step": 0, "token": 7, "prod_top_ids": [5, 6], "prod_top_logprobs": [-0.1, -2.0]})
    return writer.close()


def test_a_python_run_is_read_by_the_rust_analyzer(tmp_path: Path) -> None:
    run = tmp_path / "py-run"
    manifest = write_run(run)
    assert manifest["status"] == "complete"
    jsonschema.Draft202012Validator(json.loads((SCHEMAS_V2 / "manifest.schema.json").read_text())).validate(
        manifest
    )
    assert (manifest["schema_version"], manifest["conventions"], manifest["deviations"]) == (2, [], [])
    inspect = subprocess.run(
        [binary("shadowtrace"), "inspect", run], capture_output=True, text=True, check=False
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "written by shadowtrace-hooks" in inspect.stdout
    out = subprocess.run(
        [binary("shadowtrace"), "analyze", run, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    (result,) = json.loads(out.stdout)["runs"]
    onset = result["onset"]
    assert (onset["layer"], onset["site"], onset["token"], onset["shadow_finite"]) == (
        1,
        "layer_out",
        5,
        True,
    )
    # Query tokens 4..7 see 5..8 keys with k = 4, and the shadow swaps key 3
    # for the query's own key: |P & S| = 3, |P | S| = 5.
    assert result["topk"][0]["jaccard"]["mean"] == pytest.approx(3 / 5)


def test_the_rust_analyzer_verifies_the_python_writers_content_hashes(tmp_path: Path) -> None:
    """The hooks hash each closed part with the `xxhash` package; the Rust reader recomputes
    XXH3-64 with another implementation (xxhash-rust) and must agree on every part, then
    refuse a part whose data pages changed since."""
    run = tmp_path / "py-run"
    manifest = write_run(run)
    hashed = {name: t.get("file_hashes", {}) for name, t in manifest["tables"].items()}
    assert all(sorted(hashed[name]) == sorted(t["files"]) for name, t in manifest["tables"].items()), hashed
    assert sum(len(h) for h in hashed.values()) == 3, hashed  # hidden, topk and logits; no events
    assert "parts_unhashed" not in manifest["counters"]
    ok = subprocess.run([binary("shadowtrace"), "inspect", run], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "content hash" not in ok.stdout
    part = run / manifest["tables"]["hidden"]["files"][0]
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x10
    part.write_bytes(bytes(data))
    for command in (["inspect"], ["analyze"]):
        bad = subprocess.run(
            [binary("shadowtrace"), *command, run], capture_output=True, text=True, check=False
        )
        assert bad.returncode == 2, (command, bad.stdout, bad.stderr)
        assert "bytes changed since its writer closed it" in bad.stdout + bad.stderr
        assert str(part) in bad.stdout + bad.stderr


def test_a_writer_without_xxhash_counts_its_parts_unhashed_and_readers_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shadowtrace_hooks import writer as writer_module

    monkeypatch.setattr(writer_module, "xxhash", None)
    run = tmp_path / "py-run"
    manifest = write_run(run)
    files = sum(len(t["files"]) for t in manifest["tables"].values())
    assert manifest["counters"]["parts_unhashed"] == files
    assert all("file_hashes" not in t for t in manifest["tables"].values())
    out = subprocess.run([binary("shadowtrace"), "inspect", run], capture_output=True, text=True, check=False)
    assert f"{files} listed part file(s) carry no content hash" in out.stdout, out.stdout


def test_python_files_have_the_defined_schema_and_encodings(tmp_path: Path) -> None:
    run = tmp_path / "py-run"
    write_run(run)
    part = run / "topk" / "part-00000.parquet"
    assert pq.read_schema(part).remove_metadata().equals(format.arrow_schema("topk").remove_metadata())
    metadata = pq.read_metadata(part)
    assert metadata.metadata[b"shadowtrace.run_id"] == b"py-run"
    encodings = {
        metadata.row_group(0).column(i).path_in_schema: metadata.row_group(0).column(i).encodings
        for i in range(metadata.num_columns)
    }
    assert metadata.metadata[b"shadowtrace.schema_version"] == b"2"
    assert "BYTE_STREAM_SPLIT" in encodings["prod_only_gaps.list.element"]
    assert "BYTE_STREAM_SPLIT" in encodings["prod_kth_score"]
    assert "DELTA_BINARY_PACKED" in encodings["prod_selected"]


def test_the_lossy_queue_accounts_for_every_row(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "lossy", IDENTITY, queue_mode="lossy", queue_bytes=1)
    sent = 20_000
    dropped = sum(not writer.send("hidden", hidden(0, t % 8)) for t in range(sent))
    manifest = writer.close()
    entry = manifest["tables"]["hidden"]
    assert entry["dropped_rows"] == dropped
    assert entry["rows"] + entry["dropped_rows"] == sent


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"SHADOWTRACE": "1", "SHADOWTRACE_LAYERS": "76-77, 0-3", "SHADOWTRACE_TOKENS": "last:512"},
        {
            "SHADOWTRACE_MODE": "free,local",
            "SHADOWTRACE_TAGS": "a=1,b=two",
            "SHADOWTRACE_BOUNDARY_BAND": "0.25",
        },
    ],
)
def test_python_and_rust_read_the_environment_alike(environ: dict) -> None:
    rust = subprocess.run(
        [binary("shadowtrace"), "env", "--format", "json"],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    assert json.loads(rust.stdout) == resolve(environ)


# Values each type must read alike on both sides, valid and not: whitespace of both kinds,
# signs, underscores, non-ASCII digits, words Python's int() and float() take, overflow.
_CORPUS = {
    "bool": ["1", "0", "true", "FALSE", " yes ", "On", "off", "", "maybe", "2", "\u212aon", "\x1c1"],
    "path": ["runs", " runs ", "", "  ", "a b/c", "\u00fcber", "\x1cruns"],
    "int": [
        "1",
        "007",
        " 12 ",
        "1_000",
        "+5",
        "-1",
        "0",
        "1.0",
        "1e3",
        "",
        "\u0663",
        "\u00a012",
        "\x1c12",
        "9223372036854775807",
        "9223372036854775808",
        "0000000000000000000000000007",
        "-0000000000000000000000000007",
        "-9223372036854775809",
        "1" * 5000,
        "12 3",
        "0x10",
    ],
    "float": [
        "0.25",
        ".5",
        "5.",
        "1e3",
        "1E-3",
        "0",
        "-0",
        "-0.5",
        "nan",
        "inf",
        "-inf",
        "infinity",
        "1_0.5",
        "",
        "+1",
        "1e400",
        " 2 ",
        "1.2.3",
        "\u0663",
        "0x1p3",
        "1e",
        ".",
        "-.5e-3",
        "\u00a00.5",
    ],
    "layers": [
        "all",
        "3",
        "0000000000000000000000000003-00000000000000000000000000004",
        "3-",
        "-3",
        "0-3,10",
        " 76-77 , 0-3",
        "3-1",
        "1,,2",
        "",
        "a",
        "0 - 3",
        "4294967295",
        "4294967296",
        "\u0663",
        "+3",
        "3-+5",
        "3--5",
        "ALL",
        "1_0",
        "\u00a03",
        "3-4-5",
        "0-" + "9" * 5000,
    ],
    "enum": ["", "none!"],
    "sites": ["all", "layer_out", "layer_out, indexer", "attn", "", ",", "ALL", "layer_out,,attn_out"],
    "modes": ["local", "free,local", "local,local", "", "x", "LOCAL", " free "],
    "tokens": [
        "all",
        "every:4",
        "every:0000000000000000000000000004",
        "last:512",
        "last:0",
        "every:",
        "every:+5",
        "every: 5",
        "last:\u0663",
        "every:1_0",
        "first:3",
        "every:18446744073709551615",
        "every:18446744073709551616",
        "every:" + "9" * 5000,
        "ALL",
        "every:4:5",
        "every :4",
    ],
    "topk_lists": [
        "none",
        "all",
        "every:64",
        " every:1 ",
        "every:0",
        "every:",
        "every:+4",
        "every: 4",
        "every :4",
        "last:4",
        "NONE",
        "every:\u0663",
        "every:1_0",
        "every:18446744073709551615",
        "every:18446744073709551616",
        "every:4:5",
        "",
    ],
    "tags": ["", "a=1", "a=1, b=two", "a", "=x", "a=b=c", " a = 1 ", "a=1,a=2", ",,", "a=,b=", "\u00a0a=1"],
    "grafts": [
        "",
        "indexer",
        "indexer@20-23, layer_out , mlp_out@ 3 ",
        "attn_out@0",
        ",,",
        "kv@1",
        "Indexer",
        "indexer@",
        "indexer@3-1",
        "indexer@-3",
        "indexer@+3",
        "indexer@1-2-3",
        "indexer@\u0663",
        "indexer@1_0",
        "indexer@4294967295",
        "indexer@4294967296",
        "indexer@00000000000000000000000001-0000000000000000000000000002",
        "indexer@ 1 - 2 ",
        "\u00a0indexer",
        "layer_out@0-0,layer_out@0-0",
    ],
}


def _environment_cases() -> list[tuple[str, str]]:
    cases = []
    for var in variables():
        values = list(_CORPUS[var["type"]])
        for word in var.get("values", []):
            values += [word, word.upper(), f" {word} ", f"{word}x"]
        cases += [(var["name"], value) for value in values]
    # A retired variable, set to anything, is refused on both sides with what replaced it.
    cases += [(name, value) for name in definitions.load("env")["retired"] for value in ("4096", "")]
    return cases


@pytest.mark.parametrize(("name", "value"), _environment_cases())
def test_every_variable_reads_the_same_on_both_sides_valid_or_not(name: str, value: str) -> None:
    rust = subprocess.run(
        [binary("shadowtrace"), "env", "--format", "json"],
        capture_output=True,
        text=True,
        env={name: value},
        check=False,
    )
    try:
        python = resolve({name: value})
    except EnvError as e:
        refused: EnvError | None = e
    else:
        refused = None
    if refused is not None:
        assert rust.returncode == 2, f"Rust accepted {value!r}: {rust.stdout}"
        line = rust.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: {name}="), line
        assert line.rsplit(": expected ", 1)[1] == refused.expected, (line, refused.expected)
        return
    assert rust.returncode == 0, f"Python read {value!r} as {python[name]!r}; Rust: {rust.stderr}"
    assert json.loads(rust.stdout) == python
    assert json.dumps(json.loads(rust.stdout), sort_keys=True) == json.dumps(python, sort_keys=True)


def test_dense_rows_written_from_the_device_comparison_are_null_for_pyarrow_and_duckdb(
    tmp_path: Path,
) -> None:
    import duckdb
    import numpy as np
    import torch
    from shadowtrace_hooks import selection
    from shadowtrace_hooks.transfer import Packet

    k, band = 4, 0.5
    q_pos = torch.arange(10)  # queries 0..3 see at most k keys: dense
    generator = torch.Generator().manual_seed(5)
    causal = torch.arange(10)[None, :] <= q_pos[:, None]
    scores = torch.randn(10, 10, generator=generator).masked_fill(~causal, -math.inf)
    shadow = scores + 0.01 * torch.randn(10, 10, generator=generator)
    packet = Packet()
    spec = selection.compare(packet, scores.topk(k).indices, q_pos, 10, k, prod_scores=scores,
                             shadow_scores=shadow, band=band)  # fmt: skip
    visible = (q_pos + 1).numpy().astype(np.int32)
    # The columns as Run.topk hands them to the writer.
    columns = {
        **selection.columns(spec, packet.ship().arrays(), visible, k), "step": 0, "layer": 0,
        "token": q_pos.numpy().astype(np.int32), "shadow_input": "raw", "indexer_layer": 0, "unit": "token",
        "unit_tokens": 1, "k": k, "visible": visible,
    }  # fmt: skip
    writer = RunWriter(tmp_path / "py-run", IDENTITY)
    assert writer.send_columns("topk", columns, 10)
    writer.close()
    files = str(tmp_path / "py-run" / "topk" / "*.parquet")
    nullable = [
        "prod_kth_score", "prod_kth_margin", "prod_boundary_gaps", "prod_boundary_offsets",
        "prod_boundary_selected", "shadow_kth_score", "shadow_kth_margin", "shadow_boundary_gaps",
        "shadow_boundary_offsets", "shadow_boundary_selected", "churn_shared", "churn_unselected",
    ]  # fmt: skip
    table = pq.read_table(tmp_path / "py-run" / "topk").sort_by("token")
    for name in nullable:
        assert table[name].is_null().to_pylist() == [True] * 4 + [False] * 6, name
    for name in ("prod_kth_score", "shadow_kth_score"):
        assert not any(math.isnan(v) for v in table[name].drop_null().to_pylist()), name
    for name in nullable:
        ((dense_null, sparse_null),) = duckdb.sql(
            f"select count(*) filter (visible <= k and {name} is null), "
            f"count(*) filter (visible > k and {name} is null) from read_parquet('{files}')"
        ).fetchall()
        assert (dense_null, sparse_null) == (4, 0), name
    # Jaccard from the counts alone, as the format promises, equals the producer's
    ((mismatched,),) = duckdb.sql(
        f"select count(*) from read_parquet('{files}') "
        f"where abs(jaccard - shared / (prod_selected + len(shadow_only_gaps))) > 1e-6"
    ).fetchall()
    assert mismatched == 0


def test_importing_the_hooks_package_loads_nothing_heavy() -> None:
    code = "import sys, shadowtrace_hooks; print(sorted(m for m in ('torch', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
