"""Host lists to device tensors for per-step metadata, without a host sync.

A step copies token ids, positions, slots, block tables and the attention plan to the GPU,
5-10 copies per engine step with speculation. ``torch.tensor(list)`` converts element by element
and ``pin_memory()`` allocates each time (docs/decisions.md: ~0.45 ms of an 8 ms step at 64 requests).
Here numpy fills a
slice of one preallocated pinned buffer and the copy is asynchronous.

A slice is written again only after the buffer has gone round once, and each round starts by
waiting for the device's queue to drain (an event), so no copy still in flight reads memory
that is being rewritten. With a 16 MiB buffer that wait comes every 40 steps or more (a chain-5
step at 256 requests stages ~400 KB), and the engine waits on the device every step anyway.

Off CUDA (or while a CUDA graph is being captured, which would record the buffer's address) the plain
path runs: a fresh tensor, pinned on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

_NP = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class PinnedStager:
    """Slices of one pinned host buffer, reused round-robin (see the module docstring)."""

    def __init__(self, device: torch.device, nbytes: int = 16 << 20) -> None:
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.nbytes = nbytes
        self.offset = 0
        self.rounds = 0  # times the buffer went round (each waited for the device's queue)

    def array(self, n: int, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """A pinned host tensor of n elements (contents undefined) and a numpy view of it; copy it
        to the device with ``non_blocking=True`` before the buffer goes round again."""
        nb = n * dtype.itemsize
        if nb > self.nbytes:
            raise ValueError(f"{nb} bytes of step metadata exceed the {self.nbytes}-byte staging buffer")
        start = -(-self.offset // 8) * 8  # aligned for any element type
        if start + nb > self.nbytes:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            ev.synchronize()  # every copy issued so far has read its slice
            self.rounds += 1
            start = 0
        self.offset = start + nb
        t = self.buffer[start : start + nb].view(dtype)
        return t.numpy(), t


_stagers: dict[int, PinnedStager] = {}
_ENABLED = True  # (False: the plain path everywhere)


def stager(device: torch.device) -> PinnedStager | None:
    """The device's stager, or None where the plain path must run (see the module docstring)."""
    if device.type != "cuda" or not _ENABLED or torch.cuda.is_current_stream_capturing():
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    st = _stagers.get(idx)
    if st is None:
        st = _stagers[idx] = PinnedStager(torch.device("cuda", idx))
    return st


def host_to_device(values: list[int] | list[float] | list[list[int]] | np.ndarray, device: torch.device,
                   dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list (or a list of equal-length rows, or a 1-D numpy array) as a device tensor with no
    host sync (``torch.tensor(..., device=cuda)`` waits for the whole stream)."""
    st = stager(device) if dtype in _NP else None
    if st is None:
        t = torch.tensor(values, dtype=dtype)
        if device.type != "cuda":
            return t.to(device)
        return t.pin_memory().to(device, non_blocking=True)
    if len(values) and isinstance(values[0], (list, tuple)):  # rows of equal length (block tables)
        a = np.asarray(values, dtype=_NP[dtype])
        h, t = st.array(a.size, dtype)
        h[:] = a.reshape(-1)
        return t.view(a.shape).to(device, non_blocking=True)
    h, t = st.array(len(values), dtype)
    h[:] = values
    return t.to(device, non_blocking=True)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy into pinned host memory, queued (read it once the stream has passed it:
    an event recorded after the copy; ``tolist()`` on the device tensor would wait for the whole stream)."""
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


def host_buffer(n: int, dtype: torch.dtype, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """A zeroed host tensor of n elements to fill through its numpy view and copy to ``device``
    asynchronously (pinned on CUDA)."""
    st = stager(device)
    if st is None:
        t = torch.zeros(n, dtype=dtype, pin_memory=device.type == "cuda")
        return t.numpy(), t
    h, t = st.array(n, dtype)
    h.fill(0)
    return h, t


class ReadBack:
    """``read_back(t, launch)``: ``t``'s values on the host, ``launch()`` queued on the device before the host
    waits (CUDA: through a reused pinned buffer and an event)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: torch.Tensor | None = None
        self.done: "torch.cuda.Event | None" = None

    def __call__(self, t: torch.Tensor, launch: Callable[[], None]) -> list[int]:
        if self.device.type != "cuda":
            vals = t.tolist()
            launch()
            return vals
        n = t.shape[0]
        if self.host is None or self.host.shape[0] < n:
            self.host = torch.empty(max(n, 1024), dtype=torch.long, pin_memory=True)
        host = self.host[:n]
        host.copy_(t, non_blocking=True)
        if self.done is None:
            self.done = torch.cuda.Event()
        self.done.record()
        launch()
        self.done.synchronize()
        return host.tolist()
