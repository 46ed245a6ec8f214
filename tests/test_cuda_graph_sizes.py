"""The CUDA-graph size helpers (pure Python; the graphs themselves run in test_gpu_graphs on a GPU)."""

from types import SimpleNamespace

import pytest
import torch

from specserve.config import EngineConfig
from specserve.engine.cuda_graph import CAPTURE_SIZES, capture_sizes, dummy_meta, fit_sizes


def test_capture_sizes_follow_the_ladder_and_end_at_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert capture_sizes(512) == list(CAPTURE_SIZES)
    assert capture_sizes(1000) == list(CAPTURE_SIZES) + [768, 1000]  # steps of 256 past 512
    assert capture_sizes(2048) == list(CAPTURE_SIZES) + [768, 1024, 1280, 1536, 1792, 2048]
    for limit in (3, 77, 513, 1025, 4096):
        sizes = capture_sizes(limit)
        assert sizes == sorted(set(sizes)) and sizes[-1] == limit and sizes[0] == 1
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(0)


def test_graph_token_limit_is_the_capture_size_capped_by_the_step_budget():
    assert EngineConfig().graph_token_limit == 2048
    assert EngineConfig(max_cudagraph_capture_size=256).graph_token_limit == 256
    assert EngineConfig(max_num_batched_tokens=512, max_cudagraph_capture_size=4096).graph_token_limit == 512
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineConfig(max_cudagraph_capture_size=0)


def _attn(max_num_seqs: int, block_size: int, max_blocks_per_seq: int, num_blocks: int = 100,
          window_blocks: int | None = None):
    return SimpleNamespace(max_num_seqs=max_num_seqs, block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
                           scratch_slot=num_blocks * block_size,
                           window_scratch_slot=None if window_blocks is None else window_blocks * block_size)


def test_fit_sizes_drops_counts_no_step_can_reach():
    """At most max_num_seqs requests x max_model_len tokens (here 4 x 2 blocks x 16 = 128) per step:
    larger sizes go, the largest reachable count is added; sizes that all fit are kept as they are."""
    attn = _attn(4, 16, 2)
    assert fit_sizes(attn, capture_sizes(512)) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert fit_sizes(attn, [1, 2, 100, 200]) == [1, 2, 100, 128]
    assert fit_sizes(attn, [1, 2, 4]) == [1, 2, 4]
    assert fit_sizes(_attn(1, 16, 1), [1, 2, 4, 8, 16, 24, 32]) == [1, 2, 4, 8, 16]
    assert fit_sizes(_attn(1, 4, 1), [8, 16]) == [4]


@pytest.mark.parametrize("n", [1, 5, 16, 17, 100, 128])
def test_dummy_meta_lays_out_n_tokens_on_the_scratch_block(n):
    """A capture's step: n tokens over at most max_num_seqs requests of at most max_model_len tokens,
    every slot and block table entry on the scratch block."""
    attn = _attn(4, 16, 2)
    m = dummy_meta(attn, n, torch.device("cpu"))
    assert sum(m.query_lens) == n and len(m.query_lens) <= 4
    assert m.seq_lens == m.query_lens and max(m.query_lens) <= 32
    assert (m.slot_mapping == attn.scratch_slot).all() and m.slot_mapping.shape == (n,)
    assert (m.block_tables == attn.scratch_slot // 16).all() and m.block_tables.shape[0] == len(m.query_lens)
    assert m.block_tables.shape[1] * 16 >= max(m.query_lens)
    assert m.window_slot_mapping is None and m.window_block_tables is None
    w = dummy_meta(_attn(4, 16, 2, window_blocks=30), n, torch.device("cpu"))  # a window pool: its own scratch block
    assert (w.window_slot_mapping == 30 * 16).all() and (w.window_block_tables == 30).all()
    assert w.window_block_tables.shape == w.block_tables.shape and (w.slot_mapping == attn.scratch_slot).all()


def test_dummy_meta_refuses_more_tokens_than_a_step_holds():
    with pytest.raises(ValueError, match="cannot lay out 129 tokens"):
        dummy_meta(_attn(4, 16, 2), 129, torch.device("cpu"))
