"""The trained checkpoints committed under `models/` (models/README.md), as the tests load
them: transformers' `from_pretrained`, eager attention, and prompts of held-out text."""

import json
from pathlib import Path

import torch
from conftest import REPO
from transformers import AutoModelForCausalLM

MODELS = REPO / "models"
NAMES = {"glm": "glm5-tiny", "deepseek": "dsv32-tiny"}
# The first held-out windows of the corpus (models/corpus/heldout_head.bin): text no model
# trained on, the same bytes the training record's committed-window loss was measured on.
HELDOUT_HEAD = MODELS / "corpus" / "heldout_head.bin"


def folder(family: str, fp8: bool = False) -> Path:
    return MODELS / (NAMES[family] + ("-fp8" if fp8 else ""))


def record(family: str) -> dict:
    return json.loads((folder(family) / "training_record.json").read_text())


def load(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder(family), dtype=dtype).eval()
    model.set_attn_implementation("eager")
    return model


def heldout_windows(length: int, count: int) -> torch.Tensor:
    data = HELDOUT_HEAD.read_bytes()
    assert len(data) >= length * count, (len(data), length, count)
    return torch.tensor(list(data[: length * count]), dtype=torch.long).view(count, length)


def prompt(length: int) -> torch.Tensor:
    """`[1, length]` byte ids of held-out text."""
    return heldout_windows(length, 1)
