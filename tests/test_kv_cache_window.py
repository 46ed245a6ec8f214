"""The sliding-window layers' KV pool (kv_cache.WindowBlocks): blocks out of every future token's window
are freed and reused, prefix hits need only the window before their end, preemption frees both pools,
and the KV budget is split per layer type (kv_layout)."""

from __future__ import annotations

import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.engine.kv_cache import BlockManager, KVSlots, WindowBlocks
from specserve.engine.request import Request, Status
from specserve.engine.runner import KVLayout, kv_layout
from specserve.engine.scheduler import CommitResult, Scheduler
from specserve.loader.hf_config import normalize_hf_config
from specserve.sampling_params import SamplingParams
from tiny_model import GEMMA3_270M_CONFIG

BS, WINDOW = 4, 8


def _sched(full=64, window_blocks=16, budget=64, max_seqs=8, caching=True):
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=BS, num_kv_blocks=full,
                       enable_prefix_caching=caching)
    return Scheduler(cfg, BlockManager(full, BS, caching), 10_000, {0}, WindowBlocks(window_blocks, BS, WINDOW, caching))


def _req(i, n, max_tokens=64):
    return Request(f"r{i}", None, list(range(100 * i + 1, 100 * i + n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))


def _step(s, tok=5):
    plan = s.schedule()
    s.commit(plan, CommitResult(token_ids=[[tok] for x in plan.scheduled if x.samples]), lambda r: None)
    return plan


def _live(w: WindowBlocks, kv: KVSlots) -> list[int]:
    return [b for b in kv.window_table if b != w.null]


def test_drop_frees_blocks_out_of_every_future_window() -> None:
    w = WindowBlocks(8, BS, WINDOW)
    kv = KVSlots(window_table=[])
    w.grow(kv, 4)  # positions 0..15
    w.drop(kv, 8)  # a token at 8 sees 1..8: block 0 (0..3) still holds 1..3
    assert kv.window_table.count(w.null) == 0 and w.pool.num_free_blocks == 4
    w.drop(kv, 12)  # a token at 12 sees 5..12: block 0 is out
    assert kv.window_table[0] == w.null and w.pool.num_free_blocks == 5
    w.drop(kv, 16)  # sees 9..16: blocks 0, 1 out; 2 (8..11) still holds 9..11
    assert kv.window_table[:2] == [w.null] * 2 and kv.window_table[2] != w.null and w.pool.num_free_blocks == 6
    w.drop(kv, 16)  # again: nothing more
    assert w.pool.num_free_blocks == 6
    w.release(kv)
    assert w.pool.num_free_blocks == 8 and kv.window_table == []


def test_long_decode_holds_only_its_window_and_freed_blocks_serve_others() -> None:
    s = _sched(window_blocks=8)
    w = s.window
    a = _req(0, 30, max_tokens=40)
    s.add(a)
    _step(s)  # the prompt's 30 tokens: 8 blocks of each pool
    assert len(_live(w, a.kv)) == 8
    for _ in range(40):
        _step(s)
        if a.is_finished:
            break
        # the full table grows with every block; the window table keeps cdiv(window, bs) + 1 blocks at most
        assert len(a.kv.window_table) == len(a.kv.block_table)
        assert len(_live(w, a.kv)) <= -(-WINDOW // BS) + 1
    assert a.num_output_tokens == 40  # 70 tokens (18 blocks) through a window pool of 8 blocks
    # a second long request admitted while the first runs reuses what the first freed
    s2 = _sched(window_blocks=6, budget=8)  # prefill chunks of 8 tokens
    w2 = s2.window
    b, c = _req(1, 30, max_tokens=8), _req(2, 12, max_tokens=8)
    s2.add(b)
    held_b: set[int] = set()
    for _ in range(3):
        _step(s2)
        held_b |= set(_live(w2, b.kv))
    assert b.kv.window_table[:2] == [w2.null] * 2  # positions 0..7, out of the window of 16 on
    assert held_b == set(range(6))  # b has had every block of the pool
    s2.add(c)
    for _ in range(4):
        _step(s2)
    assert _live(w2, c.kv) and c.num_output_tokens >= 1  # so c's are blocks b dropped
    while s2.has_unfinished():
        _step(s2)
    assert w2.pool.num_free_blocks == 6 and s2.blocks.num_free_blocks == 64


def test_prefix_hit_needs_only_the_window_before_its_end() -> None:
    s = _sched(window_blocks=16)
    w = s.window
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks before the last token
    a = Request("a", None, prompt, SamplingParams(temperature=0, max_tokens=1))
    s.add(a)
    _step(s)
    assert a.is_finished
    b = Request("b", None, prompt + [99], SamplingParams(temperature=0, max_tokens=1))
    s.add(b)
    plan = s.schedule()
    # 28 tokens cached: the full pool's 7 blocks, the window pool's last cdiv(7, 4) = 2 (blocks 0..4 null)
    assert b.num_computed_tokens == 28 and plan.scheduled[0].num_new_tokens == 3
    assert b.kv.window_table[:5] == [w.null] * 5 and w.null not in b.kv.window_table[5:]
    assert len(b.kv.window_table) == len(b.kv.block_table)


def test_prefix_hit_is_cut_where_the_window_blocks_were_reused() -> None:
    s = _sched(window_blocks=8)
    w = s.window
    prompt = list(range(1, 31))
    s.add(Request("a", None, prompt, SamplingParams(temperature=0, max_tokens=1)))
    _step(s)
    # evict every cached window block (LRU: the free queue hands them out), keep the full pool's
    taken = w.pool.allocate(8)
    w.pool.free(taken)
    b = Request("b", None, prompt + [99], SamplingParams(temperature=0, max_tokens=1))
    s.add(b)
    s.schedule()
    assert b.num_computed_tokens == 0 and s.blocks.stats.prefix_hits == 0


def test_preemption_frees_both_pools_and_recompute_hits_the_cache() -> None:
    s = _sched(full=10, window_blocks=10, budget=64)
    w = s.window
    a, b = _req(0, 14, max_tokens=20), _req(1, 14, max_tokens=20)  # 9 blocks each at the end
    s.add(a), s.add(b)
    preempted = []
    for _ in range(60):
        plan = _step(s)
        preempted += plan.preempted
        if not s.has_unfinished():
            break
    assert preempted and a.num_output_tokens == b.num_output_tokens == 20
    assert s.blocks.stats.prefix_hits > 0  # the recompute took its blocks from the cache
    assert s.blocks.num_free_blocks == 10 and w.pool.num_free_blocks == 10
    assert all(r.status == Status.FINISHED for r in (a, b))


def test_rejected_drafts_trim_both_tables() -> None:
    s = _sched()
    a = _req(0, 6)
    s.add(a)
    _step(s)
    a.draft_token_ids = [7] * 9  # blocks for 16 tokens
    plan = s.schedule()
    assert len(a.kv.block_table) == len(a.kv.window_table) == 4
    s.commit(plan, CommitResult(token_ids=[[5]], num_accepted_drafts=[0]), lambda r: None)
    assert len(a.kv.block_table) == len(a.kv.window_table) == 2


def test_layout_counts_per_layer_type_and_fits_more_tokens() -> None:
    """Gemma 3 270M (15 sliding layers of window 512, 3 global): the tokens a 1 GiB budget holds."""
    mc = ModelConfig.from_hf(normalize_hf_config(GEMMA3_270M_CONFIG))
    cfg = EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=2048)
    per_block = 2 * 18 * 256 * 2 * 16  # every layer's K and V of 16 tokens, bf16
    before = 2**30 // per_block
    lay = kv_layout(cfg, mc, before, torch.bfloat16, 32768)
    assert lay.window == 512 and lay.num_window_blocks == 64 * (32 + 2) + 128
    used = lay.num_blocks * 3 * per_block // 18 + lay.num_window_blocks * 15 * per_block // 18
    assert before * per_block - per_block < used <= before * per_block  # the same bytes
    # 3,640 blocks of 16 tokens before; after, the bytes of 15 layers' 2,304 blocks, the rest 3 layers'
    assert (before, lay.num_blocks) == (3640, (3640 * 18 - 2304 * 15) // 3) == (3640, 10320)  # 2.8x the tokens
    # the windows of 64 seats are a fixed cost: 4 GiB holds 5.2x the tokens
    assert kv_layout(cfg, mc, 4 * before, torch.bfloat16, 32768).num_blocks == (4 * 3640 * 18 - 2304 * 15) // 3
    # a context inside the window, or a model without sliding layers: one pool, as before
    assert kv_layout(cfg, mc, before, torch.bfloat16, 512) == KVLayout(before)
    llama = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=8)
    assert kv_layout(cfg, llama, 100, torch.float32, 4096) == KVLayout(100)
