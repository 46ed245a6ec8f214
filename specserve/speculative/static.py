"""The draft side's static-buffer runners (catch-up, chain loop or tree expansion, fused launches), built on CUDA
with the Triton backend and captured as CUDA graphs unless --enforce-eager; tests build them on the CPU."""

from __future__ import annotations

import logging
from typing import Any

import torch

from specserve.engine.cuda_graph import capture_sizes
from specserve.attention.torch_decode import TorchDecodeAttention
from specserve.speculative.draft_graph import FUSED_MAX_BATCH, CatchUpRunner, ChainDraftRunner, FusedLaunchRunner
from specserve.speculative.tree_graph import FusedTreeLaunch, TreeDraftRunner, TreeVerifyGraph

log = logging.getLogger(__name__)


def decode_attention(d: Any, rows: int, triton: bool) -> Any:
    """A decode attention over the draft KV (one query per row) reading its own ``block_tables``."""
    hc, bs = d.head.config, d.engine.config.block_size
    tables = torch.zeros(rows, -(-d.engine.max_model_len // bs), dtype=torch.long, device=d.device)
    caches, scale = d.attn.kv_caches, hc.head_dim**-0.5
    if triton:
        from specserve.attention.triton_decode import TritonDecodeAttention

        return TritonDecodeAttention(caches, bs, scale, num_heads=hc.num_attention_heads, block_tables=tables)
    return TorchDecodeAttention(caches, bs, scale, tables)


def build_tree_runner(d: Any, triton: bool = False, chain: ChainDraftRunner | None = None) -> None:
    """Every tree's expansion (tree_graph.py); its frontier slots are queries of a decode attention over the
    chain loop's h0 and block tables where that is built, else over its own."""
    e, bs = d.engine, d.engine.config.block_size
    max_batch = e.config.max_num_seqs
    if chain is None:
        tables = torch.zeros(max_batch, -(-e.max_model_len // bs), dtype=torch.long, device=d.device)
        h0 = torch.zeros(max_batch, d.head.config.hidden_size, dtype=d.head_dtype, device=d.device)
    else:
        tables, h0 = chain.block_tables, chain.h0
    attn = decode_attention(d, max_batch * d.topk, triton)
    d.proposer.tree_runner = TreeDraftRunner(d.head, d.target.embed_tokens, attn, tables, bs, d.scratch_slot // bs + 1,
                                             h0, max_batch, d.topk, d.cfg.num_steps, d.device, num_nodes=d.max_k + 1)
    d.catch_up.h0 = h0


def build_static_draft(d: Any, graphs: bool, attention: str, fused_launch: bool | None) -> None:
    """attention: "triton", "torch" or "auto" (triton on CUDA with the triton backend). fused_launch:
    the fused launch of small steps (default: with graphs)."""
    e, cu, prop, pipe = d.engine, d.catch_up, d.proposer, d.pipeline
    bs, hc, dev = e.config.block_size, d.head.config, d.device
    max_batch = e.config.max_num_seqs
    if attention == "auto":
        attention = "triton" if dev.type == "cuda" and d.runner.backend_name == "triton" else "torch"
    triton = attention == "triton"
    if graphs and not (triton and dev.type == "cuda"):
        raise ValueError("CUDA graphs of the draft loop need a CUDA device and the triton attention backend")
    cu.runner = pipe.fused_launch = pipe.tree_launch = pipe.tree_verify = None
    dec = decode_attention(d, max_batch, triton)
    chain = ChainDraftRunner(d.head, d.target.embed_tokens, dec, dec.block_tables, bs, d.scratch_slot,
                             max_batch, d.max_k, dev, d.head_dtype)
    prop.chain_runner, cu.h0 = chain, chain.h0
    if d.topk > 1:
        build_tree_runner(d, triton, chain)
    fused_launch = graphs if fused_launch is None else fused_launch
    tr = prop.tree_runner
    if fused_launch and tr is not None:
        Bm = min(FUSED_MAX_BATCH, tr.batch_sizes[-1])
        row_attn = decode_attention(d, Bm * (min(tr.depth, tr.num_nodes - 1) + 1), triton)
        pipe.tree_launch = FusedTreeLaunch(tr, row_attn, d.scratch_slot, hc.feature_size, e.dtype, Bm,
                                           compact=d.runner.compact_tree_kv, features=d.features.features,
                                           window=len(d.runner.pool_caches) > 1)
        pipe.tree_verify = TreeVerifyGraph(pipe.tree_launch, d.target, d.runner.attn, d.target.config.vocab_size)
    if triton:
        from specserve.attention.triton_backend import TritonBackend

        cu_attn = TritonBackend(d.attn.kv_caches, bs, hc.head_dim**-0.5, num_heads=hc.num_attention_heads,
                                max_num_tokens=e.config.max_num_batched_tokens, max_num_seqs=max_batch,
                                max_blocks_per_seq=-(-e.max_model_len // bs), scratch_slot=d.scratch_slot)
        # a catch-up covers a verify's accepted drafts + 1, or a stretch of plain steps in chunks of a step
        sizes = capture_sizes(max(e.config.graph_token_limit, min(e.config.max_num_batched_tokens,
                                                                   max_batch * (d.max_k + 1)))) \
            if graphs or fused_launch else []
        cu.runner = CatchUpRunner(d.head, d.target.embed_tokens, cu_attn, chain.h0, sizes, dev, e.dtype)
        if fused_launch and d.topk == 1:
            pipe.fused_launch = FusedLaunchRunner(cu.runner, chain, dev)
    if graphs:
        capture(d)


def runners(d: Any) -> list[tuple[str, Any]]:
    """The static draft runners built, by name."""
    prop, pipe = d.proposer, d.pipeline
    loop = ("tree expansion", prop.tree_runner) if prop.tree_runner else ("chain loop", prop.chain_runner)
    parts = [("catch-up", d.catch_up.runner), loop, ("fused launch", pipe.fused_launch or pipe.tree_launch),
             ("tree verify", pipe.tree_verify)]
    return [(name, r) for name, r in parts if r is not None]


def capture(d: Any) -> None:
    pool = torch.cuda.graph_pool_handle()
    for name, runner in runners(d):
        st = runner.capture(pool)
        log.info("draft CUDA graphs: %s %d in %.2fs using %.1f MiB of GPU memory", name, st.graphs, st.seconds,
                 st.bytes / 2**20)


def graph_memory_bytes(d: Any) -> int:
    """GPU memory the draft CUDA graphs took at capture."""
    return sum(r.stats.bytes for _, r in runners(d))
