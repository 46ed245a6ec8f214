"""Linear layers with weights pre-packed for oneDNN, for inference on a CPU.

Why: ``F.linear`` on a CPU re-lays-out (packs) the weight matrix on every call once a matmul has
4 or more rows, so on SmolLM2-135M the linear layers of a 4-token forward cost ~2x those of a
1-token one, and 16 tokens ~3.4x (fp32, 2 cores). With the weights packed once at load time,
4-16 rows cost ~1.5-1.9x one row: speculation's verify tokens get cheap. Below 4 rows the
unpacked path is faster (its matrix-vector kernels need no packing), so those stay on F.linear
(measured on SmolLM2's 120 linear layers: 1 row 19.7 ms unpacked vs 23.7 packed; 8 rows 45.7 vs
31.5). In bf16 (with AMX) the packed path is the faster one at every row count, ~18 ms for 1-16
rows. fp32 numerics are unchanged up to summation order (max abs difference ~1e-6 per layer).

Only the engine packs (after its weights are loaded; inference only, no autograd through the packed
weight). The dense weight stays the module's ``weight`` (tied embeddings share it, and code that
reads shapes or dtypes keeps working), so the packed copy costs one more copy of the linear weights.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layers import Linear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# fewer rows than this take F.linear (see the module doc); bf16 has no fast unpacked path to keep.
# fp32: the most it can be; the rows where F.linear is really faster are measured (packed_min_rows)
PACKED_MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}
_MIN_ROWS: dict[torch.dtype, int] = {}

# oneDNN compiles a kernel per (weight shape, row count) the first time it sees one (~0.8 ms each on two
# cores) and keeps 1,024 in an LRU cache (~0.7 MB each). Prompt chunks come in any length, so left exact
# they filled the cache and pushed out the row counts of steps the engine runs every cycle: a verify
# depth tried again after a few hundred prompts paid ~3 ms per layer shape again (a 19x slower first
# call), which can make a depth the adaptive controller explores look slower than the one it runs.
# Row counts up to EXACT_ROWS stay exact (decode and verify steps); above, they are padded up to one
# of ROW_BUCKETS_PER_OCTAVE steps per power of two (at most 1/8 more rows): ~100 row counts up to 2,048
ROW_BUCKETS = True
EXACT_ROWS = 64
ROW_BUCKETS_PER_OCTAVE = 8


def padded_rows(rows: int) -> int:
    """The row count a packed linear of ``rows`` rows runs at (see ROW_BUCKETS)."""
    if not ROW_BUCKETS or rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << (rows.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


def packed_min_rows(dtype: torch.dtype) -> int:
    """Rows from which the packed kernel is used, measured for fp32 once per CPU model, torch version and
    thread count (cached under SPECSERVE_CACHE_DIR: a busy machine measured another value at each start,
    and the cost profile's cache key, which holds it, changed with it): on a 2-core AVX-512 machine
    F.linear's matrix-vector kernel won below 4 rows, on a 2-core AVX2 one the packed kernel won from
    2 rows (3 rows 0.43 vs 1.37 ms on SmolLM2's gate/up weight), so steps of 2-3 rows were several
    times dearer than they needed to be."""
    if dtype not in _MIN_ROWS:
        rows = PACKED_MIN_ROWS[dtype]
        cached = _cached_rows() if dtype == torch.float32 else {}
        if _machine_key() in cached:
            rows = cached[_machine_key()]
        elif dtype == torch.float32:
            w = torch.randn(1536, 576)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)

            def best(fn) -> float:
                for _ in range(3):
                    fn()
                ts = []
                for _ in range(15):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                return sorted(ts)[len(ts) // 2]

            with torch.inference_mode():
                for r in range(2, rows):  # one row: F.linear's matrix-vector kernel (a timing under load said otherwise)
                    x = torch.randn(r, 576)
                    if best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")) < \
                            best(lambda: F.linear(x, w)):
                        rows = r
                        break
            _save_rows({**cached, _machine_key(): rows})
        _MIN_ROWS[dtype] = rows
    return _MIN_ROWS[dtype]


def _rows_path() -> str:
    from specserve.loader.gguf import cache_root

    return os.path.join(cache_root(), "cpu_packing_min_rows.json")


def _machine_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    return f"{cpu or platform.processor()}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def _cached_rows() -> dict[str, int]:
    try:
        with open(_rows_path()) as f:
            return {k: int(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_rows(table: dict[str, int]) -> None:
    path = _rows_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(table, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # measured again at the next start


def cpu_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and _cpu_can_pack(dtype))


_CAN_PACK: dict[torch.dtype, bool] = {}


def _cpu_can_pack(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs ``dtype`` (bf16 needs AVX-512 or AVX-NE-CONVERT: an AVX2-only
    machine refuses it, and the engine then keeps F.linear)."""
    if dtype not in _CAN_PACK:
        try:
            w = torch.zeros(8, 8, dtype=dtype)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(4, 8, dtype=dtype), torch.ops.mkldnn._reorder_linear_weight(w),
                                               None, "none", [], "")
            _CAN_PACK[dtype] = True
        except RuntimeError:
            _CAN_PACK[dtype] = False
    return _CAN_PACK[dtype]


class PackedLinear(nn.Module):
    """y = x W^T (+ b) through oneDNN with W packed once; same interface as ``Linear``."""

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.min_numel = packed_min_rows(weight.dtype) * self.in_features
        with torch.no_grad():
            # not a buffer: an opaque oneDNN tensor has no storage to save or move
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.requires_grad or x.numel() < self.min_numel:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        flat = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every ``Linear``/``nn.Linear`` under ``module`` by a ``PackedLinear`` sharing its
    weights; a tied lm_head (``lm_head is None`` with an embedding) gets a packed one too. Returns
    how many were packed."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (Linear, nn.Linear)):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            n += 1
        else:
            n += pack_linears(child)
    if getattr(module, "lm_head", "absent") is None and hasattr(module, "get_input_embeddings"):
        module.lm_head = PackedLinear(module.get_input_embeddings().weight, None)
        n += 1
    return n


def pack_for_cpu(module: nn.Module, enabled: bool, device: torch.device, dtype: torch.dtype) -> int:
    """``pack_linears`` when enabled and oneDNN can run this device/dtype; how many were packed."""
    if not enabled or not cpu_packing_available(device, dtype):
        return 0
    return pack_linears(module)
