"""The packet that brings a capture's device results to the host in one copy: tensors added
now and tensors whose making `Packet.later` puts off arrive at the indices they were given,
and work that raises loses only its own arrays, saying why.

On the CPU `later` makes its tensors at once; the CUDA side stream it uses there is checked
on the GPU by tests/gpu/kernels_h200.py (the same comparison's packet from the side stream
and from the CPU, also with the inputs freed and overwritten as soon as the work is queued)."""

import numpy as np
import pytest
import torch
from shadowtrace_hooks import selection
from shadowtrace_hooks.transfer import Packet


def test_work_put_off_arrives_at_the_indices_it_reserved_between_tensors_added_around_it() -> None:
    packet = Packet()
    first = packet.add(torch.tensor([1, 2, 3], dtype=torch.int32))
    later = packet.later(torch.device("cpu"), 2, lambda: (torch.arange(4.0), torch.tensor([True, False])))
    last = packet.add(torch.tensor([7], dtype=torch.int64))
    arrays = packet.ship().arrays()
    assert (first, later.slots, last, later.error) == (0, [1, 2], 3, None)
    assert arrays[first].tolist() == [1, 2, 3]
    assert arrays[1].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert arrays[2].tolist() == [True, False]
    assert arrays[last].tolist() == [7]


@pytest.mark.parametrize(
    ("produce", "why"),
    [
        (lambda: (_ for _ in ()).throw(MemoryError("out of memory")), "MemoryError: out of memory"),
        (lambda: (torch.zeros(1),), "made 1 tensors, expected 2"),
        (lambda: (torch.zeros(1), torch.zeros(1, dtype=torch.complex64)), "has no host form"),
    ],
)
def test_work_that_fails_leaves_its_own_arrays_empty_says_why_and_the_rest_arrives(produce, why) -> None:
    packet = Packet()
    before = packet.add(torch.tensor([5.0]))
    later = packet.later(torch.device("cpu"), 2, produce)
    after = packet.add(torch.tensor([6.0]))
    arrays = packet.ship().arrays()
    assert later.error is not None
    assert why in later.error
    assert [arrays[i].size for i in later.slots] == [0, 0]
    assert arrays[before].tolist() == [5.0]
    assert arrays[after].tolist() == [6.0]


def test_a_comparison_whose_lists_were_not_made_is_refused_by_columns_naming_why(monkeypatch) -> None:
    def fail(*_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(selection, "_gap_coded", fail)
    packet = Packet()
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2)
    spec = selection.compare(
        packet, torch.tensor([[0, 1], [0, 2]]), torch.tensor([3, 3]), 4, 2, shadow_scores=scores, band=0.5
    )
    arrays = packet.ship().arrays()
    with pytest.raises(selection.ListsLost, match="an illegal memory access"):
        selection.columns(spec, arrays, np.array([4, 4]), 2)
