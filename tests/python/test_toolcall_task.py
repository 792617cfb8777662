"""The tool-call task of issue 40 (models/train/toolcall.py): deterministic per seed, the
committed demo prompts its output, the expected call read back from the prompt's own bytes,
held-out seeds apart from training's, lengths on target, a control without schemas; and the
training script's whole path on a CPU at a tiny scale."""

import hashlib
import json
import random
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

TRAIN = REPO / "models" / "train"
sys.path.insert(0, str(TRAIN))
import corpus as corpus_py  # noqa: E402
import toolcall  # noqa: E402
import toolcall_eval  # noqa: E402

DEMO = REPO / "tracer" / "demo" / "toolcall"
LENGTHS = (1024, 2048, 3072, 4096, 6144, 8192)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """The corpus rebuilt from this interpreter's stdlib, checked against the committed
    record's hashes (the committed prompts are made of its bytes)."""
    out = tmp_path_factory.mktemp("corpus")
    record = corpus_py.build(out, Path(sysconfig.get_paths()["stdlib"]))
    committed = json.loads((REPO / "models" / "corpus" / "corpus.json").read_text())
    assert record["splits"] == committed["splits"], (
        "this interpreter's stdlib is not the committed corpus's "
        f"(CPython {committed['python']}): the prompts cannot be regenerated"
    )
    return out


@pytest.fixture(scope="module")
def text(corpus_dir: Path) -> dict:
    return toolcall.load_text(corpus_dir)


def parse(ex_ids: bytes, start: int) -> tuple[list[dict], bytes, dict]:
    """The schemas, the request text and the expected answer, read from an example's bytes by
    their delimiters alone."""
    head, sep, _ = ex_ids.partition(toolcall.TOOLS_END)
    schemas = [json.loads(line) for line in head[1:].split(b"\n")] if sep else []
    request = ex_ids[ex_ids.rindex(toolcall.REQUEST, 0, start) + 1 : start - 1]
    answer = ex_ids[start : ex_ids.index(toolcall.END, start)]
    return schemas, request, json.loads(answer)


def test_an_example_is_the_same_bytes_for_the_same_seed_and_other_bytes_for_another(text) -> None:
    for seed in (3, toolcall.HELDOUT_SEED_BASE + 7):
        a = toolcall.example(seed, 2048, text, requests=3)
        b = toolcall.example(seed, 2048, text, requests=3)
        assert (a.ids, a.answers, a.expected) == (b.ids, b.answers, b.expected)
        other = toolcall.example(seed + 1, 2048, text, requests=3)
        assert other.ids != a.ids
        assert other.schemas != a.schemas


def test_the_committed_demo_prompts_regenerate_byte_for_byte(text) -> None:
    sets = toolcall.demo_sets(text)
    assert sorted(p.name for p in DEMO.iterdir()) == sorted(sets)
    for name, content in sets.items():
        assert (DEMO / name).read_text() == json.dumps(content, separators=(",", ":")) + "\n", name
    for content in sets.values():
        for p in content["prompts"]:
            assert len(p["ids"]) + len(p["answer"]) + 1 == content["length"]
            assert p["ids"][-1] == toolcall.ANSWER[0]


@pytest.mark.parametrize("seed", [0, 11, toolcall.HELDOUT_SEED_BASE + 5])
@pytest.mark.parametrize("length", LENGTHS)
def test_the_expected_call_is_the_requested_schemas_name_and_defaults_read_from_the_prompt(
    text, seed: int, length: int
) -> None:
    ex = toolcall.example(seed, length, text, requests=4)
    for (start, end), expected in zip(ex.answers, ex.expected, strict=True):
        schemas, request, answer = parse(ex.ids, start)
        assert answer == expected
        assert ex.ids[end - 1 : end] == toolcall.END
        assert request.startswith(b"call ")
        (tool,) = [s for s in schemas if s["description"].encode() == request[len(b"call ") :]]
        assert answer["name"] == tool["name"]
        assert list(answer["arguments"]) == list(tool["parameters"])
        for param, value in answer["arguments"].items():
            assert value == tool["arguments"][param]
            assert value in tool["parameters"][param]["enum"]
    assert toolcall.MIN_TOOLS <= len(schemas) <= toolcall.MAX_TOOLS
    # Each delimiter where the example says and nowhere else: the answer spans are exact.
    assert ex.ids.count(toolcall.ANSWER) == ex.ids.count(toolcall.END) == len(ex.answers)
    assert ex.ids.count(toolcall.REQUEST) == len(ex.answers)
    assert ex.ids.count(toolcall.TOOLS_BEGIN) == ex.ids.count(toolcall.TOOLS_END) == 1
    assert ex.ids[ex.schema_span[1] - 1 : ex.schema_span[1]] == toolcall.TOOLS_END


@pytest.mark.parametrize("seed", [0, 11, toolcall.HELDOUT_SEED_BASE + 5])
def test_the_call_is_the_schemas_own_bytes_right_after_its_description(text, seed: int) -> None:
    """What lets a copying (induction) circuit answer: the request ends with the description,
    and the schema holds the call's bytes right after that description, as many bytes after
    its end as the answer is after the request's (version 1's answers copied no schema span,
    and the models trained on them learnt none of the task)."""
    ex = toolcall.example(seed, 4096, text, requests=4)
    lines = ex.ids[1 : ex.schema_span[1] - 1].split(b"\n")
    for start, end in ex.answers:
        _, request, _ = parse(ex.ids, start)
        description = request[len(b"call ") :]
        (line,) = [x for x in lines if json.loads(x)["description"].encode() == description]
        call = ex.ids[start : end - 1]
        assert call[:1] == b"{"
        assert call[-1:] == b"}"
        after = line.index(b'"description":"' + description + b'"') + len(b'"description":"' + description)
        assert line[after:].startswith(b'",' + call[1:-1] + b',"parameters":')
        assert len(b'","name":"') == len(toolcall.ANSWER + b'{"name":"')


class _NextByteOracle(torch.nn.Module):
    """Logits one-hot on the byte `shift` positions after the next one: right by construction
    at shift 0, a byte late at shift 1."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift

    def forward(self, ids):
        target = torch.roll(ids, -1 - self.shift, dims=1)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, 256).float())


def test_the_exact_call_verdict_accepts_an_oracle_and_rejects_one_a_byte_late(text) -> None:
    for tools in (True, False):
        examples = toolcall_eval.prompts(text, 1024, 4, tools)
        right = [toolcall_eval.judge(_NextByteOracle(0), ex, "cpu", None) for ex in examples]
        late = [toolcall_eval.judge(_NextByteOracle(1), ex, "cpu", None) for ex in examples]
        assert all(j["exact"] and j["first_wrong"] is None for j in right)
        assert not any(j["exact"] for j in late)


def test_held_out_seeds_are_disjoint_from_trainings_and_read_only_held_out_text(text) -> None:
    seeds = [ex.seed for n in LENGTHS for ex in toolcall_eval.prompts(text, n, 32)]
    demo = [p["seed"] for f in DEMO.iterdir() for p in json.loads(f.read_text())["prompts"]]
    assert min(seeds + demo) >= toolcall.HELDOUT_SEED_BASE
    assert len(set(seeds)) == len(seeds)
    assert toolcall.split_of(toolcall.HELDOUT_SEED_BASE - 1) == "train"
    with pytest.raises(ValueError, match="negative"):
        toolcall.split_of(-1)
    # The filler comes from the seed's own corpus split: text the other split does not hold.
    for seed, split, other in ((5, "train", "heldout"), (toolcall.HELDOUT_SEED_BASE + 5, "heldout", "train")):
        ex = toolcall.example(seed, 4096, text)
        filler = ex.ids[ex.schema_span[1] : ex.answers[0][0]].rpartition(toolcall.REQUEST)[0]
        assert filler[-256:] in text[split]
        assert filler[-256:] not in text[other]


@pytest.mark.parametrize("requests", [1, 4])
def test_every_example_is_exactly_its_target_length(text, requests: int) -> None:
    for length in (toolcall.MIN_LENGTH, 1500, *LENGTHS):
        for seed in range(20):
            ex = toolcall.example(seed, length, text, requests=requests)
            assert len(ex.ids) == length
            assert ex.answers[-1][1] == length


def test_the_no_tool_control_has_no_schema_and_the_tool_prompts_filler_before_its_request(text) -> None:
    for seed in (2, toolcall.HELDOUT_SEED_BASE + 2):
        tool = toolcall.example(seed, 3072, text)
        control = toolcall.example(seed, 3072, text, tools=False)
        assert len(control.ids) == 3072
        assert control.schema_span == (0, 0)
        assert not control.schemas
        assert toolcall.TOOLS_BEGIN not in control.ids
        assert toolcall.TOOLS_END not in control.ids
        assert b'"description"' not in control.ids
        schemas, request, answer = parse(control.ids, control.answers[0][0])
        assert schemas == []
        assert request.startswith(b"say ")
        assert answer == {"reply": request[len(b"say ") :].decode()}
        tool_filler = tool.ids[tool.schema_span[1] : tool.ids.index(toolcall.REQUEST)]
        control_filler = control.ids[: control.ids.index(toolcall.REQUEST)]
        assert control_filler.endswith(tool_filler)
        assert len(control_filler) > len(tool_filler)


def test_a_copy_row_writes_each_segment_twice_and_marks_the_second_copy_but_its_first_byte(text) -> None:
    window = text["train"][:4096]
    for seed in range(200):
        rng = random.Random(seed)
        row, copies = toolcall.copy_row(rng, 512, window)
        assert len(row) == 512
        assert 1 <= len(copies) <= 3
        for start, end in copies:
            second = row[start - 1 : end]
            assert 12 <= len(second) <= 512 // 8
            # The first copy comes earlier in the row, whole, and is not this one.
            assert row.find(second) < start - 1
        # Between the segments, the corpus window in order: nothing else is written.
        assert all(b not in row for b in toolcall.DELIMITERS)
    same = [toolcall.copy_row(random.Random(7), 512, window) for _ in range(2)]
    assert same[0] == same[1]


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_the_training_script_runs_every_stage_and_the_evaluation_on_a_cpu(
    corpus_dir: Path, tmp_path: Path, family: str
) -> None:
    out = tmp_path / family
    run = subprocess.run(
        [sys.executable, str(TRAIN / "train_toolcall.py"), "--model", family, "--corpus", str(corpus_dir),
         "--out", str(out), "--device", "cpu", "--shrink", "--steps", "copy=2,dense=2,warmup=2,sparse=2",
         "--eval-count", "1", "--eval-windows", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "training_record.json"
    ]  # fmt: skip
    record = json.loads((out / "training_record.json").read_text())
    assert record["steps"] == {"copy": 2, "dense": 2, "warmup": 2, "sparse": 2}
    assert record["config"]["num_hidden_layers"] == 4
    generator = hashlib.sha256((TRAIN / "toolcall.py").read_bytes()).hexdigest()
    assert record["task"]["generator_sha256"] == generator
    assert record["task"]["answer_loss_weight"] > 1
    assert record["task"]["examples_trained"]["tool"] > 0
    stages = {c["stage"] for c in record["curve"]}
    assert stages == {"copy", "dense", "warmup", "sparse"}
    assert any("answer" in c for c in record["curve"])
    assert record["task"]["examples_trained"]["copies"] > 0
    for dtype in ("fp32", "bf16"):
        assert list(record["toolcall_eval"][dtype]) == ["1024"]
        for row in record["toolcall_eval"][dtype].values():
            assert row["prompts"] == row["control_prompts"] == 1
            assert 0 <= row["exact"] <= 1
            assert len(row["schema_mass"]) == len(row["schema_in_topk"]) == 4
            assert all(0 <= m <= 1 for m in row["schema_mass"] + row["schema_in_topk"])
