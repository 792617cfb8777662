"""Device results brought to the host in one copy, read on the writer's thread.

A capture computes its rows on the engine's device and adds the tensors to a `Packet`.
`Packet.ship` lays them end to end in one byte buffer on the device and starts a single
copy into pinned host memory (`non_blocking`): the forward goes on while the copy runs,
and nothing on the forward's thread waits for it. `Shipment.arrays`, called on the writer's
thread, waits for that copy (a CUDA event) and returns numpy views of each tensor.

On a CPU there is no copy to wait for: the buffer is the host's already.
"""

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


class Packet:
    """Tensors of one device bound for the host together. `add` returns the tensor's index
    in `Shipment.arrays()`."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.tensors)

    def add(self, tensor: torch.Tensor) -> int:
        if tensor.dtype not in _NUMPY:
            raise TypeError(f"packet: dtype {tensor.dtype} has no host form; expected one of {list(_NUMPY)}")
        self.tensors.append(tensor.detach())
        return len(self.tensors) - 1

    def ship(self) -> "Shipment":
        """Starts the copy of every tensor added; the packet is empty afterwards."""
        tensors, self.tensors = self.tensors, []
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
            return Shipment(torch.empty(0, dtype=torch.uint8), None, layout)
        buffer = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
        if device.type != "cuda":
            return Shipment(buffer.cpu(), None, layout)
        try:
            host = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: a plain (synchronous) copy
            return Shipment(buffer.cpu(), None, layout)
        host.copy_(buffer, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Shipment(host, done, layout)


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
