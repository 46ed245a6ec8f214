"""Sliding-window attention in the Triton backend against the torch-native one (Triton's interpreter
without CUDA), and the tiny Gemma 3 served through it."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.torch_native import TorchNativeBackend

from triton_interpreter import triton_tests_device  # noqa: E402

DEVICE = triton_tests_device()

from specserve.attention.triton_backend import TritonBackend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # interpreter


def _step(q_lens, ctx_lens, backend_kw, heads=4, kv_heads=1, head_dim=32, block_size=4, num_blocks=48, seed=0,
          trees=None, windows=(None, 6, 21)):
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables, off = [], 0
    for s in seq:
        nb = -(-s // block_size)
        tables.append(perm[off : off + nb])
        off += nb
    width = max(len(t) for t in tables)
    slots = [t[p // block_size] * block_size + p % block_size for t, s, q in zip(tables, seq, q_lens)
             for p in range(s - q, s)]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = (torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g))
    T = sum(q_lens)
    q, k, v = (torch.randn(T, n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata(
        query_lens=list(q_lens), seq_lens=seq, slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=DEVICE),
        tree_masks={b: m.to(DEVICE) for b, m in trees.items()} if trees else None)
    outs = {}
    for name in ("ref", "tri"):
        caches = [(cache[0].clone().to(DEVICE), cache[1].clone().to(DEVICE))]
        if name == "ref":
            b = TorchNativeBackend(caches, block_size, head_dim**-0.5)
        else:
            b = TritonBackend(caches, block_size, head_dim**-0.5, num_heads=heads, max_num_tokens=64, max_num_seqs=8,
                              max_blocks_per_seq=32, block_n=16, **backend_kw)
        b.plan(meta)
        outs[name] = {w: b.forward(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), window=w).cpu() for w in windows}
    outs["merges"], outs["exact"] = b._num_merges, b.step_exact
    return outs


@pytest.mark.parametrize("backend_kw", [{"split_kv": False}, {"target_programs": 256, "min_split_keys": 16}],
                         ids=["whole", "split"])
def test_window_matches_torch_native(backend_kw) -> None:
    # decodes at 40 and 70 keys (the split case splits them), a prefill chunk past the window, a short prompt
    outs = _step([1, 1, 9, 3], [39, 69, 30, 0], backend_kw)
    assert (outs["merges"] > 0) == ("min_split_keys" in backend_kw)
    for w in (None, 6, 21):
        assert (outs["tri"][w] - outs["ref"][w]).abs().max().item() < 1e-4, w
    assert (outs["ref"][6] - outs["ref"][None]).abs().max().item() > 1e-2  # the window changed something


def _tree_mask(parents: list[int]) -> torch.Tensor:
    m = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


# 20 nodes, depth up to 9: a window of 4 or 8 hides prefix keys and tree ancestors (node 18 at prefix + 9
# sees its ancestors from depth 2 on with a window of 8); siblings interleave: a key's depth is not its index
DEEP_TREE = [-1, 0, 1, 0, 2, 4, 3, 5, 6, 7, 8, 9, 1, 10, 12, 13, 11, 14, 16, 15]


@pytest.mark.parametrize("backend_kw", [{"split_kv": False}, {"target_programs": 256, "min_split_keys": 16},
                                        {"exact_trees": False}], ids=["exact", "exact_split", "shared_tiles"])
def test_tree_tokens_see_the_window_of_their_position(backend_kw) -> None:
    """A tree token at prefix + depth sees keys within the window of that position, a tree key at its
    own prefix + depth: the torch backend's mask, with a decode and a chunk in the same step."""
    tree = _tree_mask(DEEP_TREE)
    assert int(tree.sum(1).max()) - 1 == 9
    # (24: the root at 30 sees keys from 7 on, in the key range [0, 16) that split tiles share below the tree)
    outs = _step([20, 1, 9], [30, 40, 14], backend_kw, trees={0: tree}, windows=(4, 8, 24))
    assert outs["exact"] == ("exact_trees" not in backend_kw)
    for w in (4, 8, 24):
        assert (outs["tri"][w] - outs["ref"][w]).abs().max().item() < 1e-4, w
    assert (outs["ref"][8][:20] - outs["ref"][24][:20]).abs().max().item() > 1e-2  # the window cut the tree rows


def test_tiny_gemma3_on_triton_equals_torch(tmp_path) -> None:
    from specserve import LLM, SamplingParams
    from tiny_model import make_tiny_gemma3

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path, layers=2)
    prompts = [[5, 17, 33, 2, 9, 120, 44, 7, 8, 91, 3, 12], [200, 4]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(model=path, max_num_batched_tokens=8, num_kv_blocks=24, block_size=4, max_model_len=64,
              max_num_seqs=2, device=str(DEVICE), dtype="float32")
    ref = LLM(attention_backend="torch", **kw).generate(prompts, sp)
    llm = LLM(attention_backend="triton", enforce_eager=True, **kw)
    assert llm.engine.scheduler.window is not None  # the window layer's K/V in a pool of its own
    tri = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_window_pool_reads_its_own_tables_and_never_its_null_blocks(name: str) -> None:
    """A window pool (kv_cache.WindowBlocks): the window layer's K/V at other block ids, blocks out of the
    window null (a spare block of garbage); the same output as one cache read through one table."""
    bs, D, W, nb = 4, 32, 6, 24
    g = torch.Generator().manual_seed(3)
    q_lens, seq = [1, 5, 2], [23, 17, 9]  # decodes and a chunk past the window of 6
    tables = [list(range(0, 6)), list(range(6, 11)), list(range(11, 14))]
    cache = (torch.randn(nb, bs, 1, D, generator=g), torch.randn(nb, bs, 1, D, generator=g))
    perm = torch.randperm(nb, generator=g).tolist()  # block x of `cache` is block perm[x] of the pool
    pool = (torch.empty_like(cache[0]), torch.empty_like(cache[1]))
    for x in range(nb):
        pool[0][perm[x]], pool[1][perm[x]] = cache[0][x], cache[1][x]
    null = nb  # (the spare block past the pool's)
    pool = tuple(torch.cat([c, torch.full_like(c[:1], 1e4)]) for c in pool)
    wtables = [[null if (j + 1) * bs <= s - q - W + 1 else perm[b] for j, b in enumerate(t)]
               for t, s, q in zip(tables, seq, q_lens)]
    assert [t.count(null) for t in wtables] == [4, 1, 0]
    T = sum(q_lens)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (4, 1, 1))
    pos = [(t, p) for t, s, ql in zip(tables, seq, q_lens) for p in range(s - ql, s)]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in pos], device=DEVICE)
    wslots = torch.tensor([perm[t[p // bs]] * bs + p % bs for t, p in pos], device=DEVICE)

    def run(caches, **meta_kw):
        meta = AttentionMetadata(query_lens=q_lens, seq_lens=seq, slot_mapping=slots,
                                 block_tables=torch.tensor([t + [0] * (6 - len(t)) for t in tables], device=DEVICE),
                                 **meta_kw)
        caches = [(c[0].clone().to(DEVICE), c[1].clone().to(DEVICE)) for c in caches]
        if name == "torch":
            b = TorchNativeBackend(caches, bs, D**-0.5)
        else:
            b = TritonBackend(caches, bs, D**-0.5, num_heads=4, max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=8,
                              block_n=16, scratch_slot=(nb - 1) * bs,
                              window_scratch_slot=null * bs if "window_block_tables" in meta_kw else None)
        b.plan(meta)
        return b.forward(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), window=W).cpu()

    ref = run([cache])
    got = run([pool], window_slot_mapping=wslots,
              window_block_tables=torch.tensor([t + [0] * (6 - len(t)) for t in wtables], device=DEVICE))
    assert (got - ref).abs().max().item() < 1e-4


def test_tree_speculation_with_a_window_pool_on_triton_equals_plain_decoding(tmp_path) -> None:
    """Trees on the Triton backend with a window pool (window 4, trees of depth 3 + bonus: the window
    cuts into the tree; accepted KV moved in both pools): plain decoding's greedy tokens (on torch attention:
    not interpreted), each at the same log-probability (the K/V it read; fp32)."""
    from specserve import LLM, SamplingParams
    from tiny_model import make_random_head, make_tiny_gemma3

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path, layers=2, vocab=8, window=4)
    head = make_random_head(path, str(tmp_path / "head"), constant=True, drafts=[6, 2])
    prompts = [[5, 7, 3, 2, 4, 6, 4, 7, 3, 5, 3, 2, 6, 6], [2, 4]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)  # (4 drafts accepted)
    kw = dict(model=path, max_num_batched_tokens=16, num_kv_blocks=24, block_size=4, max_model_len=64, max_num_seqs=2,
              device=str(DEVICE), dtype="float32", attention_backend="triton", enforce_eager=True)
    plain = LLM(**{**kw, "attention_backend": "torch"}).generate(prompts, sp)
    llm = LLM(**kw, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    assert llm.engine.scheduler.window is not None  # (the window layer's K/V in a pool of its own)
    outs = llm.generate(prompts, sp)
    for o, p in zip(outs, plain):
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
        lp = torch.tensor([list(d.values()) for d in o.outputs[0].logprobs])
        assert torch.allclose(lp, torch.tensor([list(d.values()) for d in p.outputs[0].logprobs]), atol=1e-4)
    assert sum(o.metrics.spec_accepted_tokens for o in outs) > 0


def test_chain_speculation_with_a_window_pool_on_triton_equals_torch(tmp_path) -> None:
    from specserve import LLM, SamplingParams
    from tiny_model import make_random_head, make_tiny_gemma3

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path, layers=2, vocab=8)
    head = make_random_head(path, str(tmp_path / "head"), constant=True, drafts=[6, 2])
    prompts = [[5, 7, 3, 2, 4, 6, 4, 7, 3, 5, 3, 2, 6, 6], [2, 4]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    kw = dict(model=path, max_num_batched_tokens=8, num_kv_blocks=24, block_size=4, max_model_len=64, max_num_seqs=2,
              device=str(DEVICE), dtype="float32", speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="static", speculative_num_steps=3, speculative_num_draft_tokens=4)
    ref = LLM(attention_backend="torch", **kw).generate(prompts, sp)
    tri = LLM(attention_backend="triton", enforce_eager=True, **kw).generate(prompts, sp)
    assert sum(o.metrics.spec_accepted_tokens for o in tri) > 0
    for a, b in zip(tri, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = torch.tensor([list(d.values()) for d in a.outputs[0].logprobs])
        assert torch.allclose(lp, torch.tensor([list(d.values()) for d in b.outputs[0].logprobs]), atol=1e-4)


@pytest.mark.gpu  # (CUDA graphs and the static draft paths)
@pytest.mark.parametrize("spec", [None, "chains", "trees"], ids=["plain", "chains", "trees"])
def test_window_pool_under_cuda_graphs_equals_torch(tmp_path, spec: str | None) -> None:
    """Graph replays read the window pool's persistent tables; with chains also the static draft loop,
    the fused launches and the early verify (its window slots built before the step is scheduled); with
    trees the tree verify's graphs (the kernel's windows by tree positions), then without log-probs the
    fused tree launch and the verify before the sync (window slots computed on the device)."""
    from specserve import LLM, SamplingParams
    from tiny_model import make_random_head, make_tiny_gemma3

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path, vocab=8, window=4 if spec == "trees" else 8)  # (trees of depth 5: cut by the window)
    kw = dict(model=path, max_num_batched_tokens=32, num_kv_blocks=64, block_size=4, max_model_len=256,
              max_num_seqs=4, device="cuda", dtype="float32")
    if spec:
        kw.update(speculative_algorithm="EAGLE3", speculative_policy="static",
                  speculative_num_steps=3 if spec == "chains" else 5,
                  speculative_num_draft_tokens=4 if spec == "chains" else 6,
                  speculative_eagle_topk=1 if spec == "chains" else 2, speculative_draft_model_path=make_random_head(
                      path, str(tmp_path / "head"), constant=True, drafts=[6, 2]))
    prompts = [[5, 7, 3, 2, 4, 6, 4, 7, 3, 5, 3, 2, 6, 6] * 3, [2, 4], [3, 3, 5, 7, 2, 4, 6, 5, 4]]
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=0)
    ref = LLM(attention_backend="torch", enforce_eager=True, **kw).generate(prompts, sp)
    llm = LLM(attention_backend="triton", **kw)
    assert llm.engine.scheduler.window is not None and llm.engine.runner.graphs is not None
    tri = llm.generate(prompts, sp)
    assert llm.engine.runner.path_counts["target:graph"] > 0
    for a, b in zip(tri, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = torch.tensor([list(d.values()) for d in a.outputs[0].logprobs])
        assert torch.allclose(lp, torch.tensor([list(d.values()) for d in b.outputs[0].logprobs]), atol=1e-3)
    if spec:
        assert sum(o.metrics.spec_accepted_tokens for o in tri) > 0
    if spec == "trees":
        fused = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
        assert llm.engine.drafter.path_counts["fused"] > 0
        assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in ref]
