"""oneDNN-packed linear weights on the CPU: same numbers as F.linear, every Linear replaced, tied heads too."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.models import cpu_packing
from specserve.models.cpu_packing import (PACKED_MIN_ROWS, PackedLinear, cpu_packing_available, pack_linears,
                                           padded_rows)
from specserve.models.layers import Linear

pytestmark = pytest.mark.skipif(not cpu_packing_available(torch.device("cpu"), torch.float32),
                                reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_at_every_row_count(dtype, tol, bias):
    if not cpu_packing_available(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU's oneDNN does not pack {dtype} (bf16 needs AVX-512 or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    w = (torch.randn(96, 64) * 0.1).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    lin = PackedLinear(nn.Parameter(w, requires_grad=False), b)
    for rows in (1, 2, 3, 4, 5, 8, 33, 64, 65, 100, 300):  # past 64: run padded
        x = torch.randn(rows, 64).to(dtype)
        with torch.inference_mode():
            got = lin(x)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
    x3 = torch.randn(2, 5, 64).to(dtype)  # leading dims are kept
    assert lin(x3).shape == (2, 5, 96)
    x3 = torch.randn(3, 33, 64).to(dtype)  # ... where the rows are padded too
    with torch.inference_mode():
        torch.testing.assert_close(lin(x3).float(), F.linear(x3, w, b).float(), atol=tol, rtol=tol)
    # the packed kernel is the one running from PACKED_MIN_ROWS rows: a changed packed copy changes the output
    lin.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(w))
    many = torch.randn(max(PACKED_MIN_ROWS[dtype], 4), 64).to(dtype)
    with torch.inference_mode():
        assert lin(many).abs().max() <= (b.abs().max() if bias else 0)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = Linear(16, 16)
        self.proj.weight.data.normal_()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.lm_head = None

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed


def test_pack_linears_replaces_every_linear_and_packs_a_tied_head():
    m = Tied()
    w = m.proj.weight
    assert pack_linears(m) == 3
    assert isinstance(m.proj, PackedLinear) and isinstance(m.inner[0], PackedLinear)
    assert m.proj.weight is w  # the dense weight is shared, not copied
    assert isinstance(m.lm_head, PackedLinear) and m.lm_head.weight is m.embed.weight
    x = torch.randn(6, 16)
    with torch.inference_mode():
        torch.testing.assert_close(m.lm_head(x), x @ m.embed.weight.T, atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_the_dense_path():
    lin = PackedLinear(nn.Parameter(torch.randn(8, 4), requires_grad=False), None)
    x = torch.randn(5, 4, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(5, 4))


def test_packing_is_skipped_where_the_cpu_cannot_pack_the_dtype(monkeypatch):
    from specserve.models import cpu_packing

    monkeypatch.setitem(cpu_packing._CAN_PACK, torch.bfloat16, False)
    m = Tied().to(torch.bfloat16)
    assert cpu_packing.pack_for_cpu(m, True, torch.device("cpu"), torch.bfloat16) == 0
    assert isinstance(m.proj, Linear) and m.lm_head is None


def test_the_rows_from_which_the_packed_kernel_runs_are_measured_for_fp32():
    from specserve.models.cpu_packing import packed_min_rows

    assert 1 <= packed_min_rows(torch.float32) <= PACKED_MIN_ROWS[torch.float32]
    assert packed_min_rows(torch.bfloat16) == 1
    lin = PackedLinear(nn.Parameter(torch.randn(8, 4), requires_grad=False), None)
    assert lin.min_numel == packed_min_rows(torch.float32) * 4


def test_row_counts_reaching_onednn_are_few_and_padding_is_small():
    # oneDNN compiles a kernel per row count and keeps 1,024 (per weight shape): prompt chunks of every
    # length up to a 2,048-token step must map to few row counts, each at most 1/8 above the real one,
    # and the decode and verify steps' row counts (up to 64) stay exact
    got = [padded_rows(m) for m in range(1, 2049)]
    assert got[:64] == list(range(1, 65))
    assert all(m <= p <= m * 1.125 for m, p in zip(range(1, 2049), got))
    assert len(set(got)) <= 64 + 8 * 5 + 1
    assert padded_rows(96) == 96 and padded_rows(97) == 104 and padded_rows(2048) == 2048


def test_a_packed_linear_runs_a_prompt_chunk_at_its_padded_row_count(monkeypatch):
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    class Ops:
        @staticmethod
        def _linear_pointwise(x, *a):
            seen.append(x.shape[0])
            return real(x, *a)

        _reorder_linear_weight = torch.ops.mkldnn._reorder_linear_weight

    lin = PackedLinear(nn.Parameter(torch.randn(32, 16), requires_grad=False), None)
    monkeypatch.setattr(cpu_packing.torch.ops, "mkldnn", Ops)
    x = torch.randn(150, 16)
    with torch.inference_mode():
        out = lin(x)
    assert seen == [160] and out.shape == (150, 32)
    torch.testing.assert_close(out, F.linear(x, lin.weight))
