"""Device results brought to the host in one copy, read on the writer's thread.

A capture computes its rows on the engine's device and adds the tensors to a `Packet`.
`Packet.ship` lays them end to end in one byte buffer on the device and starts a single
copy into pinned host memory (`non_blocking`): the forward goes on while the copy runs,
and nothing on the forward's thread waits for it. `Shipment.arrays`, called on the writer's
thread, waits for that copy (a blocking CUDA event: the thread sleeps, where a spinning wait
slowed the forward's launches) and returns numpy views of each tensor.

Tensors whose size depends on the data (a comparison's lists) cannot be made without the
host knowing that size, which the device computes. Waiting for it at once would leave the
device idle until the host, held up, had queued enough work again. `Packet.later` puts that
wait off: the size is copied to the host as the device computes it, and the work runs on
a side stream once the device has reached it (checked, without waiting, at each `add`), or
when the inputs of all work put off in the process would hold more than `PENDING_BYTES`
of device memory, or when its packet ships (each layer, in the HF adapter). Work the device
has reached makes its tensors without the host waiting (`selection`'s lists, through Triton);
work that waits for the device itself (torch's `nonzero`) waits only for the side stream,
while the forward's own work, queued since, keeps the device busy.

On a CPU there is no copy to wait for: the buffer is the host's already.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Each tensor starts at a multiple of this many bytes in the buffer: numpy views aligned.
_ALIGN = 8
_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.int16: np.int16,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


Produce = Callable[[], tuple[torch.Tensor, ...]]


@dataclass
class Later:
    """Tensors `Packet.later` is still to make: their indices in `Shipment.arrays()`, and
    why they could not be made (their arrays are then empty), once settled."""

    slots: list[int]
    error: str | None = None


@dataclass
class _Job:
    """Work put off: `produce` runs once `ready` (recorded on `stream`, the stream that
    queued the work it reads) has passed; its inputs hold `nbytes` of device memory."""

    packet: "Packet"
    produce: Produce
    later: Later
    stream: torch.cuda.Stream
    ready: torch.cuda.Event
    nbytes: int


# Device memory the inputs of put-off work may hold at once, over every packet (one per
# request) of the process: beyond it the oldest runs whether the device has reached it or
# not. A GLM-5 comparison chunk (4096 rows x 8192 keys, prod and shadow, a band) holds about
# 450 MiB, so one chunk waits at a time there; with production only, two.
PENDING_BYTES = 512 << 20
# Work put off in the process, oldest first.
_waiting: list[_Job] = []
# One side stream per device, made on first use.
_side: dict[torch.device, torch.cuda.Stream] = {}


def held_bytes() -> int:
    """Device memory the inputs of put-off work hold now."""
    return sum(job.nbytes for job in _waiting)


class Packet:
    """Tensors of one device bound for the host together. `add` returns the tensor's index
    in `Shipment.arrays()`; `later` reserves indices for tensors made afterwards."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._made: list[torch.cuda.Event] = []

    def __len__(self) -> int:
        return len(self.tensors)

    def add(self, tensor: torch.Tensor) -> int:
        self.settle(reached=True)
        _check(tensor)
        self.tensors.append(tensor.detach())
        return len(self.tensors) - 1

    def later(self, device: torch.device, count: int, produce: Produce, nbytes: int = 0) -> Later:
        """Reserves `count` indices for the tensors `produce()` returns, made from what the
        device has been asked so far (inputs of `nbytes` it keeps alive until it runs), and
        from host memory the device's copies queued so far fill (they have arrived when it
        runs). On
        CUDA (outside a graph capture) `produce` runs on a side stream later (see the module
        docstring), at the latest when the packet ships; elsewhere it runs now. A `produce`
        that raises leaves its arrays empty and says why in the `Later` returned."""
        later = Later(list(range(len(self.tensors), len(self.tensors) + count)))
        placeholder = torch.empty(0, dtype=torch.uint8, device=device)
        self.tensors.extend([placeholder] * count)
        if device.type != "cuda":
            self._fill(later, produce)
            return later
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                # A CUDA graph cannot hold the host's wait; the capture's guard counts this.
                raise RuntimeError("packet: data-sized tensors cannot be made during CUDA graph capture")
            stream = torch.cuda.current_stream()
            # blocking: a host that must wait for it (`_run`) sleeps, where a spin would slow
            # the forward's launches
            ready = torch.cuda.Event(blocking=True)
            ready.record(stream)
        # Until the work has run, its arrays are not made: an exit (SIGTERM's SystemExit)
        # in the middle leaves this, never empty arrays that look made.
        later.error = "not made: the work put off never ran"
        _waiting.append(_Job(self, produce, later, stream, ready, nbytes))
        while len(_waiting) > 1 and held_bytes() > PENDING_BYTES:
            _run(_waiting[0])
        return later

    def settle(self, *, reached: bool = False) -> None:
        """Runs this packet's put-off work, oldest first; with `reached`, only the work the
        device has already reached, which the host then waits for only briefly."""
        for job in [j for j in _waiting if j.packet is self]:
            if reached and not job.ready.query():
                return
            _run(job)

    def discard(self) -> None:
        """Drops what was added and the work put off for it (a packet no decoder reads)."""
        _waiting[:] = [job for job in _waiting if job.packet is not self]
        self.tensors, self._made = [], []

    def _fill(self, later: Later, produce: Produce) -> tuple[torch.Tensor, ...]:
        try:
            made = tuple(t.detach() for t in produce())
            if len(made) != len(later.slots):
                raise ValueError(f"packet: later work made {len(made)} tensors, expected {len(later.slots)}")
            for t in made:
                _check(t)
        except Exception as e:  # the arrays stay empty; the reader of `later` says so
            later.error = f"{type(e).__name__}: {e}"
            return ()
        for slot, tensor in zip(later.slots, made, strict=True):
            self.tensors[slot] = tensor
        later.error = None
        return made

    def ship(self) -> "Shipment":
        """Starts the copy of every tensor added; the packet is empty afterwards."""
        self.settle()
        tensors, self.tensors = self.tensors, []
        made, self._made = self._made, []
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type == "cuda":
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream()
                for event in made:  # the side stream's tensors, whichever stream ships them
                    stream.wait_event(event)
        buffer, layout = pack(tensors)
        return copy_packed(buffer, layout)


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, torch.dtype, tuple]]]:
    """The tensors laid end to end in one byte buffer on their device (each at a multiple of
    `_ALIGN` bytes), and where each lies. A graph capture packs its captures once: the copy
    into the buffer is then part of the graph, which each replay reruns (`graphs`)."""
    layout = []
    pieces = []
    offset = 0
    device = tensors[0].device if tensors else torch.device("cpu")
    for t in tensors:
        if t.device != device:
            raise ValueError(f"packet: tensors on {device} and {t.device}; one packet holds one device")
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        pad = -offset % _ALIGN
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            offset += pad
        layout.append((offset, t.dtype, tuple(t.shape)))
        pieces.append(flat)
        offset += flat.numel()
    if not pieces:
        return torch.empty(0, dtype=torch.uint8), layout
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return (torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()), layout


def copy_packed(
    buffer: torch.Tensor, layout: list[tuple[int, torch.dtype, tuple]], *, reused: bool = False
) -> "Shipment":
    """Starts the copy of a packed buffer to the host, queued on the current stream after the
    work that wrote it. A CPU buffer is the host's already: the shipment holds it, or a copy
    of it when the buffer is `reused` (a graph's, which the next replay rewrites)."""
    if buffer.numel() == 0:
        return Shipment(torch.empty(0, dtype=torch.uint8), None, layout)
    if buffer.device.type != "cuda":
        return Shipment(buffer.clone() if reused else buffer, None, layout)
    with torch.cuda.device(buffer.device):
        stream = torch.cuda.current_stream()
        try:
            host = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: a plain (synchronous) copy
            return Shipment(buffer.cpu(), None, layout)
        host.copy_(buffer, non_blocking=True)
        # The writer's thread waits on it for most of a forward: a blocking event sleeps
        # there, where the default one spins in the driver against the forward's launches.
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
    return Shipment(host, done, layout)


def _run(job: _Job) -> None:
    """Runs put-off work on its device's side stream once the work it reads is done; the
    stream that queued it waits for the results before going on. The host waits for the
    device to reach the work first (at once, where `settle` found it reached), so that what
    the work reads on the host, copied there before `later` (the size of what it makes), has
    arrived. A failure stays with the work (`Later.error`), never with the capture whose call
    ran it."""
    _waiting.remove(job)
    device = job.stream.device
    try:
        job.ready.synchronize()
        with torch.cuda.device(device):
            side = _side.get(device)
            if side is None:
                # high priority: a reached `nonzero` need not queue behind the forward's GEMMs
                side = _side[device] = torch.cuda.Stream(device=device, priority=-1)
            side.wait_event(job.ready)
            with torch.cuda.stream(side):
                made = job.packet._fill(job.later, job.produce)
                done = torch.cuda.Event()
                done.record(side)
            # The inputs, freed once `job` goes, return to `job.stream`'s pool: this wait
            # orders their next use there after the side stream's reads.
            job.stream.wait_event(done)
        for t in made:
            t.record_stream(job.stream)  # made on the side stream, read on job.stream
        job.packet._made.append(done)
    except Exception as e:
        job.later.error = f"{type(e).__name__}: {e}"
        for slot in job.later.slots:  # nothing half made goes out as if it were the lists
            job.packet.tensors[slot] = torch.empty(0, dtype=torch.uint8, device=device)


def _check(tensor: torch.Tensor) -> None:
    if tensor.dtype not in _NUMPY:
        raise TypeError(f"packet: dtype {tensor.dtype} has no host form; expected one of {list(_NUMPY)}")


class Shipment:
    """A packet on its way to the host: `nbytes` held, `arrays()` once it has arrived."""

    def __init__(
        self,
        host: torch.Tensor,
        done: "torch.cuda.Event | None",
        layout: list[tuple[int, torch.dtype, tuple]],
    ) -> None:
        self.host, self.done, self.layout = host, done, layout
        self.nbytes = host.numel()

    def arrays(self) -> list[np.ndarray]:
        """Each tensor of the packet as a numpy array, in `add` order (waits for the copy)."""
        if self.done is not None:
            self.done.synchronize()
        raw = self.host.numpy()
        out = []
        for offset, dtype, shape in self.layout:
            kind = np.dtype(_NUMPY[dtype])
            count = int(np.prod(shape, dtype=np.int64))
            out.append(np.frombuffer(raw, dtype=kind, count=count, offset=offset).reshape(shape))
        return out
