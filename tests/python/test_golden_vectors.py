"""The committed golden numerics vectors are exactly what their generator writes.

tests/golden/make_golden.py derives every vector from PyTorch's own FP8 casts and torch
reference math; the Rust tests (and later the Python hooks) check themselves against
tests/golden/numerics_v1.json. Regenerating it here proves the file was not edited by hand
and still matches the pinned torch.
"""

import subprocess
import sys

from conftest import REPO

GOLDEN = REPO / "tests" / "golden"


def test_the_golden_file_is_reproduced_byte_for_byte_by_its_generator() -> None:
    out = subprocess.run(
        [sys.executable, GOLDEN / "make_golden.py"], check=True, capture_output=True, cwd=REPO
    ).stdout
    assert out == (GOLDEN / "numerics_v1.json").read_bytes()
