"""Triton paged attention vs the torch-native reference, on random caches and ragged batches.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU),
so the same kernel source is checked here and on the GPU. Skipped when triton is not installed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specserve.attention.base import AttentionMetadata, to_cache_dtype
from specserve.attention.torch_native import TorchNativeBackend

from triton_interpreter import triton_tests_device  # noqa: E402

DEVICE = triton_tests_device()
CUDA = DEVICE.type == "cuda"

from specserve.attention import triton_backend  # noqa: E402
from specserve.attention.triton_backend import TritonBackend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # interpreter


SPLIT = {"target_programs": 256, "min_split_keys": 16}  # split the keys of every tile of a small step
NO_SPLIT = {"split_kv": False}
SPLIT_IN_TWO = {**SPLIT, "min_split_keys": 48}  # a 71-key tile in 2 key ranges, not 5 (the interpreter's time)


def _case(q_lens, ctx_lens, *, heads=4, kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32,
          trees=None, num_blocks=64, seed=0, block_n=16, backend=NO_SPLIT, packed=False, over=None,
          cache_dtype=None):
    """Run both backends on the same random step; return (out_ref, out_triton, caches equal).
    ``over``: per request, how much longer than its real length the Triton backend's plan takes it
    (its block table covers that much), the difference given back on the device (seq_shift)."""
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    over = over or [0] * len(seq)
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()  # scattered blocks; the last is scratch
    tables, off = [], 0
    for s, o in zip(seq, over):
        nb = -(-(s + o) // block_size)
        tables.append(perm[off : off + nb])
        off += nb
    width = max(len(t) for t in tables)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, s, q in zip(tables, seq, q_lens) for p in range(s - q, s)]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cd = cache_dtype or dtype
    caches = [(to_cache_dtype(torch.randn(shape, generator=g) * 3, cd), to_cache_dtype(torch.randn(shape, generator=g), cd))]
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    caches_ref = [(a.clone().to(DEVICE), b.clone().to(DEVICE)) for a, b in caches]
    caches_tri = [(a.clone().to(DEVICE), b.clone().to(DEVICE)) for a, b in caches]
    meta = AttentionMetadata(
        query_lens=list(q_lens), seq_lens=seq,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=DEVICE),
        tree_masks={b: m.to(DEVICE) for b, m in (trees or {}).items()} or None,
    )
    ref = TorchNativeBackend(caches_ref, block_size, head_dim**-0.5)
    ref.plan(meta)
    out_ref = ref.forward(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    if packed:  # the Triton backend's trees as rows packed into bits (what the drafter's device trees give)
        meta = dataclasses.replace(meta, tree_masks={
            b: (m.long() << torch.arange(m.shape[1], device=m.device)).sum(-1) for b, m in meta.tree_masks.items()})
    tri = TritonBackend(caches_tri, block_size, head_dim**-0.5, num_heads=heads, max_num_tokens=128,
                        max_num_seqs=8, max_blocks_per_seq=32, block_n=block_n, **backend)
    if any(over):
        meta = dataclasses.replace(meta, seq_lens=[s + o for s, o in zip(seq, over)],
                                   seq_shift=torch.tensor([-o for o in over], device=DEVICE))
    tri.plan(meta)
    if (backend is SPLIT or backend is SPLIT_IN_TWO) and max(seq) > 2 * block_n:
        assert tri._num_merges > 0, "the case was meant to split keys"
    out_tri = tri.forward(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    same_cache = all(torch.equal(_bits(a), _bits(c)) and torch.equal(_bits(b), _bits(d))
                     for (a, b), (c, d) in zip(caches_ref, caches_tri))
    return out_ref.float(), out_tri.float(), same_cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_close(ref, out, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


TREE = torch.tensor([[1, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0],
                     [1, 0, 1, 0, 0],
                     [1, 1, 0, 1, 0],
                     [1, 0, 1, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("name,q_lens,ctx_lens,kw", [
    ("decode", [1, 1, 1], [5, 17, 0], {}),
    ("ragged_prefill", [7, 13], [0, 6], {}),
    ("mixed", [9, 1, 4, 1], [0, 21, 3, 40], {}),
    ("gqa_group3", [3, 1, 6], [10, 30, 0], {"heads": 6, "kv_heads": 2}),
    ("mha", [2, 5], [8, 0], {"heads": 2, "kv_heads": 2}),
    ("head_dim_48", [1, 4], [12, 3], {"head_dim": 48}),
    ("fp16", [1, 4, 6], [9, 30, 0], {"dtype": torch.float16}),
    pytest.param("bf16", [1, 4, 6], [9, 30, 0], {"dtype": torch.bfloat16},
                 marks=pytest.mark.skipif(not CUDA, reason="Triton 3.6's interpreter multiplies bf16 dot "
                                                           "operands as raw bits (checked on the GPU)")),
])
@pytest.mark.parametrize("backend", [NO_SPLIT, SPLIT], ids=["whole", "split_kv"])
def test_matches_torch_native(name, q_lens, ctx_lens, kw, backend):
    ref, out, same_cache = _case(q_lens, ctx_lens, backend=backend, **kw)
    assert same_cache, "K/V written to different cache slots"
    _assert_close(ref, out, kw.get("dtype", torch.float32))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("backend", [NO_SPLIT, SPLIT], ids=["whole", "split_kv"])
def test_an_fp8_cache_matches_torch_native_and_stays_near_the_full_precision_one(backend, cache_dtype):
    """--kv-cache-dtype fp8: K/V stored as 8-bit floats (this step's too, saturated), read back widened to
    the queries' dtype: both backends agree on the same stored values; against the unquantized cache the
    output moves by what 3 (e4m3) or 2 (e5m2) mantissa bits lose, and no more."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    q_lens, ctx, trees = [1, 5, 1, 4], [17, 9, 40, 0], {1: TREE}
    ref, out, same_cache = _case(q_lens, ctx, dtype=dtype, trees=trees, backend=backend, cache_dtype=cache_dtype)
    assert same_cache, "K/V written differently"
    _assert_close(ref, out, dtype)
    full, _, _ = _case(q_lens, ctx, dtype=dtype, trees=trees, backend=backend)
    err = ((out - full).norm() / full.norm()).item()
    assert 1e-3 < err < (0.06 if cache_dtype == torch.float8_e4m3fn else 0.12), err


@pytest.mark.parametrize("backend", [NO_SPLIT, SPLIT], ids=["whole", "split_kv"])
def test_tree_masks_and_causal_in_one_batch(backend):
    ref, out, same_cache = _case([5, 1, 5, 3], [9, 3, 0, 14], trees={0: TREE, 2: TREE}, backend=backend)
    assert same_cache
    _assert_close(ref, out, torch.float32)
    # the mask matters: a causal run of the same step differs on the tree rows
    causal_ref, _, _ = _case([5, 1, 5, 3], [9, 3, 0, 14])
    assert not torch.allclose(causal_ref[:5], ref[:5], atol=1e-3)
    # the same trees handed over as packed bits
    ref_p, out_p, same_p = _case([5, 1, 5, 3], [9, 3, 0, 14], trees={0: TREE, 2: TREE}, backend=backend, packed=True)
    assert same_p and torch.equal(out_p, out)


@pytest.mark.parametrize("backend", [NO_SPLIT, SPLIT], ids=["whole", "split_kv"])
def test_lengths_moved_back_on_the_device(backend):
    """A step planned longer than it is (seq_lens past the real ones) reads no key past the real
    length once the device's seq_shift moves every token's limits back: the output of the step
    planned at its real lengths (trees and causal tokens, one request or several). The longer keys
    hold random values: read, they would change the output."""
    for q_lens, ctx, trees, over in (([5], [21], {0: TREE}, [6]), ([5, 1, 5, 3], [9, 3, 0, 14], {0: TREE, 2: TREE}, [3, 0, 6, 5])):
        ref, out, same_cache = _case(q_lens, ctx, trees=trees, backend=backend, over=over, packed=True)
        assert same_cache
        _assert_close(ref, out, torch.float32)


def test_large_step_tiles(monkeypatch):
    """Steps above LARGE_STEP_TOKENS use bigger tiles (several tokens per program)."""
    monkeypatch.setattr(triton_backend, "LARGE_STEP_TOKENS", 8)
    ref, out, _ = _case([20, 1, 9], [3, 12, 0], heads=8, kv_heads=2)
    _assert_close(ref, out, torch.float32)


def _random_caches(g: torch.Generator, nb: int, bs: int, kvh: int, hd: int) -> list:
    return [(torch.randn(nb, bs, kvh, hd, generator=g).to(DEVICE), torch.randn(nb, bs, kvh, hd, generator=g).to(DEVICE))]


def _eager_then_padded(monkeypatch, tri, caches, q, kv, n):
    """The planned step's n tokens launched as planned, then (caches put back) all of q's rows launched
    as a CUDA graph captures them; both outputs and the caches each launch left."""
    before = [(a.clone(), b.clone()) for a, b in caches]
    out = tri.forward(0, q[:n], kv[:n], kv[:n])
    caches_eager = [(a.clone(), b.clone()) for a, b in caches]
    for (a, b), (a0, b0) in zip(caches, before):
        a.copy_(a0)
        b.copy_(b0)
    monkeypatch.setattr(triton_backend, "_capturing", lambda t: True)
    out_pad = tri.forward(0, q, kv, kv)
    return out, out_pad, caches_eager, [(a.clone(), b.clone()) for a, b in caches]


@pytest.mark.parametrize("backend", [NO_SPLIT, {"target_programs": 64, "min_split_keys": 4}],
                         ids=["whole", "split_kv"])
def test_padded_launch_ignores_extra_tokens(monkeypatch, backend):
    """A launch as captured in a CUDA graph (more tokens than planned, every possible work item
    and merge) leaves real rows unchanged and writes padded tokens' K/V only into the scratch slot."""
    g = torch.Generator().manual_seed(1)
    bs, kvh, hd, nb = 8, 2, 16, 16
    caches = _random_caches(g, nb, bs, kvh, hd)
    tri = TritonBackend(caches, bs, hd**-0.5, num_heads=4, max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=8,
                        block_n=16, **backend)
    meta = AttentionMetadata(query_lens=[1, 2], seq_lens=[35, 40],
                             slot_mapping=torch.tensor([4 * 8 + 2, 9 * 8 + 6, 9 * 8 + 7], device=DEVICE),
                             block_tables=torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], device=DEVICE))
    tri.plan(meta)
    assert (tri._num_merges > 0) == (backend is not NO_SPLIT)
    q = torch.randn(5, 4, hd, generator=g).to(DEVICE)
    kv = torch.randn(5, kvh, hd, generator=g).to(DEVICE)
    out, out_pad, caches, caches_pad = _eager_then_padded(monkeypatch, tri, caches, q, kv, 3)
    assert torch.equal(out_pad[:3], out)
    scratch = nb * bs - 1
    flat_pad, flat = caches_pad[0][0].view(-1, kvh, hd), caches[0][0].view(-1, kvh, hd)
    changed = (flat_pad != flat).any(-1).any(-1).nonzero()[:, 0].tolist()
    assert changed == [scratch]


def test_a_smaller_plan_after_a_bigger_one_leaves_no_stale_work(monkeypatch):
    """A small step's plan writes its own entries only (and zeros over the last plan's): a launch as
    captured, which reads every item and merge a step of its size may have, finds nothing stale."""
    from specserve.attention.triton_backend import _ITEM_FIELDS, _MERGE_FIELDS

    g = torch.Generator().manual_seed(3)
    bs, kvh, hd, nb = 8, 2, 16, 24
    caches = _random_caches(g, nb, bs, kvh, hd)
    tri = TritonBackend(caches, bs, hd**-0.5, num_heads=4, max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=8,
                        block_n=16, target_programs=64, min_split_keys=4)
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], device=DEVICE)
    slots = [4 * 8 + 4, 4 * 8 + 5, 9 * 8 + 7, 13 * 8 + 6, 13 * 8 + 7, 14 * 8 + 0]
    big = AttentionMetadata(query_lens=[2, 1, 3], seq_lens=[38, 40, 33], block_tables=tables,
                            slot_mapping=torch.tensor(slots, device=DEVICE))
    tri.plan(big)
    items_big, merges_big = tri._num_items, tri._num_merges
    small = AttentionMetadata(query_lens=[1], seq_lens=[20], slot_mapping=torch.tensor([2 * 8 + 3], device=DEVICE),
                              block_tables=tables[:1, :3])
    tri.plan(small)
    assert tri._num_items < items_big and tri._num_merges < merges_big
    for f in _ITEM_FIELDS:
        assert not tri._item[f][tri._num_items : items_big].any(), f
    for f in _MERGE_FIELDS:
        assert not tri._merge[f][tri._num_merges : merges_big].any(), f
    q = torch.randn(4, 4, hd, generator=g).to(DEVICE)
    kv = torch.randn(4, kvh, hd, generator=g).to(DEVICE)
    out, out_pad, _, _ = _eager_then_padded(monkeypatch, tri, caches, q, kv, 1)
    assert torch.equal(out_pad[:1], out)


def test_bad_inputs_raise():
    caches = [(torch.zeros(4, 4, 2, 16, device=DEVICE), torch.zeros(4, 4, 2, 16, device=DEVICE))]
    tri = TritonBackend(caches, 4, 0.25, num_heads=4, max_num_tokens=4, max_num_seqs=2, max_blocks_per_seq=2)
    bt = torch.zeros(1, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="sized for 4"):
        tri.plan(AttentionMetadata([5], [5], torch.zeros(5, dtype=torch.long, device=DEVICE), bt))
    with pytest.raises(ValueError, match="tree mask"):
        tri.plan(AttentionMetadata([2], [3], torch.zeros(2, dtype=torch.long, device=DEVICE), bt,
                                   tree_masks={0: torch.ones(3, 3, dtype=torch.bool)}))
    with pytest.raises(ValueError, match="exceeds its block table"):
        tri.plan(AttentionMetadata([1], [9], torch.zeros(1, dtype=torch.long, device=DEVICE), bt))
    with pytest.raises(ValueError, match="multiple"):
        TritonBackend(caches, 4, 0.25, num_heads=3, max_num_tokens=4, max_num_seqs=2, max_blocks_per_seq=2)


def _random_tree_mask(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("backend", [NO_SPLIT, SPLIT_IN_TWO], ids=["whole", "split_kv"])
def test_64_token_tree(backend):
    """The largest tree the int64 bitmask holds (bit 63 is the sign bit)."""
    ref, out, _ = _case([64, 2], [7, 5], trees={0: _random_tree_mask(64, 3)}, num_blocks=48, backend=backend,
                        heads=2, kv_heads=1)  # (one KV head: half the interpreted programs)
    _assert_close(ref, out, torch.float32)


@pytest.mark.parametrize("opts", [NO_SPLIT, SPLIT, {}, {"target_programs": 64, "min_split_keys": 48},
                                  {"target_programs": 64, "min_split_keys": 16, "share_tree_prefix": True}])
def test_small_step_plan_in_python_equals_the_numpy_plan(opts):
    """Steps of <= SMALL_PLAN_TOKENS tokens are planned in plain Python: the same work list as numpy's,
    trees included."""
    import random

    import numpy as np

    caches = [(torch.zeros(64, 4, 2, 32), torch.zeros(64, 4, 2, 32))]
    be = TritonBackend(caches, 4, 0.1, num_heads=8, max_num_tokens=256, max_num_seqs=32, max_blocks_per_seq=64,
                       block_n=16, **opts)
    rng = random.Random(0)
    for _ in range(200):
        B = rng.randint(1, 12)
        q = [rng.choice([1, 1, 2, 4, 6, 9, 17]) for _ in range(B)]
        s = [qi + rng.randint(0, 200) for qi in q]
        T = sum(q)
        if T > triton_backend.SMALL_PLAN_TOKENS:
            continue
        trees = {b: torch.ones(qi, qi, dtype=torch.bool) for b, qi in enumerate(q) if qi > 1 and rng.random() < 0.5}
        bm = be.block_m_for(T)
        for exact in (False, True):
            small, parts_small = be._work_small(q, s, T, bm, trees, exact)
            ref, parts_ref = be._work(np.array(q), np.array(s), trees, T, bm, exact)
            assert parts_small == parts_ref
            assert [list(map(int, c)) for c in small] == [list(map(int, c)) for c in ref], (q, s, exact)


PER_TOKEN = {**SPLIT, "share_tree_prefix": False}  # every key range of a tree token its own
SHARED = {**SPLIT, "share_tree_prefix": True}  # the key ranges below the tree read by tiles of several tokens (default)
FEW_PROGRAMS = {"target_programs": 26, "min_split_keys": 16, "share_tree_prefix": True}  # a captured grid below the work


def _interpreter_rows_round_alike() -> bool:
    """Whether numpy's matmul (the interpreter's tl.dot) gives a row the same bits in products of 1, 16
    and 64 rows: it does with some BLAS kernels (an AVX-512 host), not with others (an AVX2 one: sgemm's
    row blocking changes the order of the sums). A tile of several tree tokens and a decode step's tile
    of one differ in height, so only where rows round alike can the interpreter check them bit for bit."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((32, 16)).astype(np.float32)
    return all(bool(((a @ b)[i : i + m] == a[i : i + m] @ b).all()) for m in (1, 16) for i in range(0, 64, m))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not CUDA, reason="Triton 3.6's interpreter multiplies bf16 dot operands as raw bits"))], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", [NO_SPLIT, PER_TOKEN, SHARED, FEW_PROGRAMS],
                         ids=["whole", "split_kv", "shared_prefix", "few_programs"])
def test_tree_tokens_equal_plain_decoding_of_their_paths(monkeypatch, backend, dtype):
    """Exact trees: every tree token's output is bit for bit what a one-token decode step computes
    once its path is committed (prefix, then its ancestors at consecutive positions): what makes
    greedy tree speculation lossless in bf16 on the GPU. ``shifted``: the step planned longer and
    moved back on the device, as the verify launched before the sync is (a whole tree lower: with
    ``shared_prefix`` a range taken as below the tree would hold tree keys, as on the H200 in session
    35, 42/50 prompts equal). Without exact trees (the ancestors' keys between other nodes' masked
    ones) the sums round differently. The launch as a CUDA graph captures it (``few_programs``: fewer
    programs than items, each loops) gives the same. Planned and shifted trees are checked against the
    same decode steps (the shift moves the plan's length, not the keys' slots)."""
    if backend.get("share_tree_prefix") and not CUDA and not _interpreter_rows_round_alike():
        pytest.skip("this host's numpy matmul rounds a row by the product's height: tiles of several tree "
                    "tokens cannot match one-token tiles bit for bit in the interpreter (checked on the GPU)")
    g = torch.Generator().manual_seed(5)
    # the tree's keys cross a 16-key block; one KV head of two query heads (half the interpreted programs)
    bs, kvh, heads, hd, nb, L, n = 4, 1, 2, 32, 48, 41, 8
    base = [(a.to(dtype), b.to(dtype)) for a, b in _random_caches(g, nb, bs, kvh, hd)]
    perm = torch.randperm(nb - 1, generator=g).tolist()
    tables = {over: perm[: -(-(L + n + over) // bs)] for over in (0, 12)}  # planned, shifted: one a prefix
    slot = lambda p: perm[p // bs] * bs + p % bs  # noqa: E731  (p < L + n: the same slot in both tables)
    mask = _random_tree_mask(n, 7)
    q = torch.randn(n, heads, hd, generator=g).to(DEVICE, dtype)
    k = torch.randn(n, kvh, hd, generator=g).to(DEVICE, dtype)
    v = torch.randn(n, kvh, hd, generator=g).to(DEVICE, dtype)
    opts = dict(num_heads=heads, max_num_tokens=64, max_num_seqs=2, max_blocks_per_seq=32, block_n=16, **backend)

    out_trees = []
    for over, table in tables.items():
        caches = [(a.clone(), b.clone()) for a, b in base]
        tri = TritonBackend(caches, bs, hd**-0.5, **opts)
        tri.plan(AttentionMetadata(query_lens=[n], seq_lens=[L + n + over], block_tables=torch.tensor([table], device=DEVICE),
                                   slot_mapping=torch.tensor([slot(L + i) for i in range(n)], device=DEVICE),
                                   tree_masks={0: mask.to(DEVICE)},
                                   seq_shift=torch.tensor([-over], device=DEVICE) if over else None))
        out_tree = tri.forward(0, q, k, v)
        assert tri.exact_fallbacks == 0
        shared = int(tri._item["len"][: tri._num_items].max()) > 1  # tiles of several tree tokens
        assert shared == bool(backend.get("share_tree_prefix")) and tri._num_merges == (0 if backend is NO_SPLIT else n)
        assert tri.step_exact
        monkeypatch.setattr(triton_backend, "_capturing", lambda t: True)
        if backend is FEW_PROGRAMS:  # each program loops over items and merges
            monkeypatch.setattr(tri, "_graph_grid", lambda n: (3, 2))
            assert tri._num_items > 3 and tri._num_merges > 2
        tri.capture_exact = True  # as graphs that replay tree steps are captured
        assert torch.equal(tri.forward(0, q, k, v), out_tree)
        monkeypatch.undo()
        out_trees.append(out_tree)
    bt = torch.tensor([tables[0]], device=DEVICE)

    deep = 0
    for i in range(n):
        path = mask[i].nonzero()[:, 0].tolist()  # root first, the node itself last
        d = len(path) - 1
        deep += path != list(range(d + 1))  # an ancestor is not the node just before
        caches = [(a.clone(), b.clone()) for a, b in base]
        kf, vf = (c.view(-1, kvh, hd) for c in caches[0])
        for r, a in enumerate(path[:-1]):
            kf[slot(L + r)] = k[a]
            vf[slot(L + r)] = v[a]
        dec = TritonBackend(caches, bs, hd**-0.5, **opts)
        dec.plan(AttentionMetadata(query_lens=[1], seq_lens=[L + d + 1], block_tables=bt,
                                   slot_mapping=torch.tensor([slot(L + d)], device=DEVICE)))
        out = dec.forward(0, q[i : i + 1], k[i : i + 1], v[i : i + 1])
        for over, out_tree in zip(tables, out_trees):
            assert torch.equal(out[0], out_tree[i]), f"tree node {i} (path {path}, shift {over}) differs from its decode step"
    assert deep >= 3, "the tree was meant to have paths that skip nodes"


def test_exact_tree_attention_is_an_engine_flag(monkeypatch):
    """``--no-exact-tree-attention`` reaches the engine config (the runner hands it to the backend);
    unset, the backend's exact trees are on; off, trees plan as shared tiles."""
    import argparse

    from specserve.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).exact_tree_attention is None
    assert engine_config_from_args(parser.parse_args(["--no-exact-tree-attention"])).exact_tree_attention is False
    caches = [(torch.zeros(16, 4, 2, 16, device=DEVICE), torch.zeros(16, 4, 2, 16, device=DEVICE))]
    opts = dict(num_heads=4, max_num_tokens=16, max_num_seqs=2, max_blocks_per_seq=8, block_n=16)
    assert TritonBackend(caches, 4, 0.25, **opts).exact_trees
    assert not TritonBackend(caches, 4, 0.25, exact_trees=False, **opts).exact_trees
    tree = AttentionMetadata(query_lens=[5], seq_lens=[20], slot_mapping=torch.arange(15, 20, device=DEVICE),
                             block_tables=torch.arange(5, device=DEVICE)[None], tree_masks={0: TREE.to(DEVICE)})
    for exact in (False, True):
        tri = TritonBackend(caches, 4, 0.25, exact_trees=exact, **opts)
        tri.plan(tree)
        assert tri.step_exact == exact
        assert int(tri._item["len"][: tri._num_items].max()) == (1 if exact else 5)


def test_a_spec_engine_on_this_backend_keeps_the_features_its_forward_wrote(tmp_path):
    """With Triton attention the target's forward writes the EAGLE-3 features at the backend's own slot
    buffer (``step_slots``: what its CUDA graphs read), and speculation gives plain decoding's tokens (plain
    decoding on torch attention: not interpreted). A fixed block count: with a byte budget the GPU run refused
    the requests (context too short)."""
    from specserve import LLM, SamplingParams
    from tiny_model import make_random_head, make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"), vocab=64, logit_scale=3.0)
    head = make_random_head(model, str(tmp_path / "head"), std=0.3)
    kw = dict(device=DEVICE.type, dtype="float32", max_num_seqs=4, block_size=4, num_kv_blocks=128, attention_backend="triton")
    llm = LLM(model=model, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_num_steps=3, speculative_policy="static", **kw)
    assert llm.engine.runner.backend_name == "triton"
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # (3 verify steps a request)
    want = [o.outputs[0].token_ids for o in LLM(model=model, **{**kw, "attention_backend": "torch"}).generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    d = llm.engine.drafter
    assert llm.engine.stats.spec_draft_tokens > 0  # verify steps ran (a random head's drafts: seldom accepted)
    assert d.features.in_forward
