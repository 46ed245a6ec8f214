"""Host -> device copies through the pinned staging buffer (engine/host_copy.py)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine import host_copy


def test_cpu_path_is_plain_tensors() -> None:
    cpu = torch.device("cpu")
    assert host_copy.stager(cpu) is None
    assert host_copy.host_to_device([3, 1, 2], cpu).tolist() == [3, 1, 2]
    assert host_copy.host_to_device([[1, 2], [3, 4]], cpu).tolist() == [[1, 2], [3, 4]]
    h, t = host_copy.host_buffer(5, torch.int32, cpu)
    h[2] = 7
    assert t.dtype == torch.int32 and t.tolist() == [0, 0, 7, 0, 0]


@pytest.mark.gpu
def test_staged_copies_survive_the_buffer_going_round() -> None:
    """Many copies in flight behind slow GPU work, through a buffer that goes round several times:
    every device tensor holds what was written for it (a slice rewritten before its copy ran would
    show another copy's values)."""
    dev = torch.device("cuda")
    st = host_copy.PinnedStager(dev, nbytes=4096)
    big = torch.randn(4096, 4096, device=dev)
    outs, want = [], []
    for i in range(200):
        if i % 50 == 0:
            big = big @ big  # keeps the stream busy so the copies queue up
        vals = list(range(i, i + 37 + i % 11))
        h, t = st.array(len(vals), torch.long)
        h[:] = vals
        outs.append(t.to(dev, non_blocking=True))
        want.append(vals)
        h32, t32 = st.array(3, torch.int32)
        h32[:] = [i, -i, 2 * i]
        outs.append(t32.to(dev, non_blocking=True))
        want.append([i, -i, 2 * i])
    torch.cuda.synchronize()
    assert st.rounds >= 3
    assert [o.tolist() for o in outs] == want


@pytest.mark.gpu
def test_host_to_device_on_cuda() -> None:
    dev = torch.device("cuda")
    assert host_copy.host_to_device([5, 6, 7], dev).tolist() == [5, 6, 7]
    rows = host_copy.host_to_device([[1, 2, 3], [4, 5, 6]], dev)
    assert rows.shape == (2, 3) and rows.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert host_copy.host_to_device([1, 2], dev, torch.int32).dtype == torch.int32
    assert host_copy.host_to_device([], dev).numel() == 0


@pytest.mark.gpu
def test_capture_takes_the_plain_path() -> None:
    dev = torch.device("cuda")
    assert host_copy.stager(dev) is not None
    x = torch.zeros(4, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        inside = host_copy.stager(dev)
        x.add_(1)
    assert inside is None
