"""CUDA graphs for the target model's forward, one per padded token count.

A step of T tokens replays the graph of the smallest captured size n >= T: its input ids and
positions are copied into static buffers, the attention backend's ``plan`` writes the step's
metadata into the backend's persistent buffers, and the n - T padding tokens write their K/V
into the backend's scratch slot and are dropped from the output. Graphs depend on the token
count only, so any mix of prefill chunks, decodes and verifies of any k replays the same graphs.
Steps larger than the largest size run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.engine.gc_pauses import no_collection

if TYPE_CHECKING:
    from specserve.attention.triton_backend import TritonBackend

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def ladder(limit: int, steps: tuple[int, ...] = CAPTURE_SIZES) -> list[int]:
    """The padded sizes up to ``limit``: ``steps`` below it, then the limit itself (every size replays)."""
    sizes = [s for s in steps if s <= limit]
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def pad_to(sizes: list[int], n: int) -> int | None:
    """The smallest of sorted ``sizes`` >= n, or None past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_sizes(limit: int) -> list[int]:
    """Padded token counts to capture: the ladder up to ``limit`` (steps of 256 past 512), plus the limit."""
    if limit < 1:
        raise ValueError(f"need a positive token limit for CUDA graphs, got {limit}")
    return ladder(limit, CAPTURE_SIZES + tuple(range(768, limit + 1, 256)))


def fit_sizes(attn: TritonBackend, sizes: list[int]) -> list[int]:
    """``sizes`` without the counts no step can reach: at most max_num_seqs requests of at most
    max_model_len tokens each (a small engine would otherwise fail to lay out its capture)."""
    most = attn.max_num_seqs * attn.block_size * attn.max_blocks_per_seq
    kept = sorted(s for s in sizes if s <= most)
    if len(kept) < len(sizes) and (not kept or kept[-1] != most):
        kept.append(most)
    return kept


def _aux_key(model: torch.nn.Module) -> Any:
    """What a captured graph's outputs and writes depend on: the aux layers and the feature sink."""
    sink = getattr(model, "feature_sink", None)
    return getattr(model, "aux_hidden_layers", None), None if sink is None else sink.data_ptr()


def dummy_meta(attn: TritonBackend, n: int, device: torch.device) -> AttentionMetadata:
    """A valid step of n tokens that reads and writes only the backend's scratch block."""
    bs = attn.block_size
    per_req = max(bs, -(-n // attn.max_num_seqs))
    per_req = min(per_req, bs * attn.max_blocks_per_seq)
    q_lens = []
    left = n
    while left > 0:
        q_lens.append(min(per_req, left))
        left -= q_lens[-1]
    if len(q_lens) > attn.max_num_seqs:
        raise ValueError(f"cannot lay out {n} tokens over {attn.max_num_seqs} requests of "
                         f"{bs * attn.max_blocks_per_seq} tokens for graph capture")
    width = -(-per_req // bs)

    def scratch(slot: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if slot is None:
            return None, None
        return (torch.full((n,), slot, dtype=torch.long, device=device),
                torch.full((len(q_lens), width), slot // bs, dtype=torch.long, device=device))

    slots, tables = scratch(attn.scratch_slot)
    window_slots, window_tables = scratch(attn.window_scratch_slot)  # (a window pool's)
    return AttentionMetadata(query_lens=q_lens, seq_lens=list(q_lens), slot_mapping=slots, block_tables=tables,
                             window_slot_mapping=window_slots, window_block_tables=window_tables)


@dataclass
class GraphStats:
    graphs: int = 0
    seconds: float = 0.0
    bytes: int = 0


def capture_each(keys: list[tuple[int, ...]], body: Callable[..., Any], device: torch.device,
                 pool: Any = None, prepare: Callable[..., None] | None = None,
                 outputs: dict[tuple[int, ...], Any] | None = None
                 ) -> tuple[dict[tuple[int, ...], torch.cuda.CUDAGraph], GraphStats]:
    """A CUDA graph of ``body(*key)`` per key (largest first, so smaller ones reuse the pool's
    memory), each after one eager warm-up run (compiles Triton kernels, settles allocations);
    ``prepare(*key)`` first, outside the graph (what the body reads, written by the host);
    ``outputs``: what each captured body returned."""
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    t0 = time.perf_counter()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
    with no_collection():
        for key in keys:
            if prepare is not None:
                prepare(*key)
            body(*key)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = body(*key)
            graphs[key] = g
            if outputs is not None:
                outputs[key] = out
    torch.cuda.synchronize(device)
    stats = GraphStats(len(graphs), time.perf_counter() - t0, max(0, free_before - torch.cuda.mem_get_info(device)[0]))
    return graphs, stats


def replay_or_eager(graphs: dict, key: tuple[int, ...], body: Callable[..., None]) -> str:
    """Replay ``key``'s graph, or run ``body(*key)`` eagerly where it has none; the path taken."""
    graph = graphs.get(key)
    if graph is not None:
        graph.replay()
        return "graph"
    body(*key)
    return "eager"


@torch.inference_mode()
def capture_per_size(attn: TritonBackend, sizes: list[int], body: Callable[[int], Any], device: torch.device,
                     graphs: dict[int, torch.cuda.CUDAGraph], outputs: dict[int, Any],
                     pool: Any = None) -> tuple[float, int]:
    """``capture_each`` of ``body(n)`` (a forward over n padded tokens through ``attn``) per size, the
    attention planned for steps of (previous size, n] tokens. Returns (seconds, bytes of GPU memory)."""
    sizes = sorted(sizes)

    def prepare(n: int) -> None:
        i = sizes.index(n)
        attn.graph_min_tokens = sizes[i - 1] + 1 if i else 1
        attn.plan(dummy_meta(attn, n, device))

    outs: dict[tuple[int, ...], Any] = {}
    try:
        got, stats = capture_each([(n,) for n in reversed(sizes)], body, device, pool, prepare, outs)
    finally:
        attn.graph_min_tokens = 1
    graphs.update({k[0]: g for k, g in got.items()})
    outputs.update({k[0]: o for k, o in outs.items()})
    return stats.seconds, stats.bytes


class CUDAGraphRunner:
    """Captures ``model(input_ids[:n], positions[:n])`` for each size and replays them."""

    def __init__(self, model: torch.nn.Module, attn: TritonBackend, sizes: list[int], device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if max(sizes) > attn.max_num_tokens:
            raise ValueError(f"graph size {max(sizes)} exceeds the attention backend's {attn.max_num_tokens} tokens")
        self.model = model
        self.attn = attn
        self.sizes = fit_sizes(attn, sizes)
        self.device = device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self._captured_for: Any = "none"  # the model's aux-layer setting the graphs were captured with
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        # steps with exact trees (TritonBackend.step_exact) of up to this many tokens replay their own
        # graphs, captured with the kernel's EXACT variant; the drafter of a tree engine sets it
        self.tree_tokens = 0
        self.tree_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tree_outputs: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self.eager_tree_steps = 0  # steps with exact trees past the tree graphs (run eagerly)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def padded_size(self, num_tokens: int) -> int:
        return pad_to(self.sizes, num_tokens)  # type: ignore[return-value]  (callers check fits())

    @property
    def is_current(self) -> bool:
        """Captured, and with the model's current outputs (EAGLE-3 aux layers change them)."""
        return bool(self.graphs) and self._captured_for == _aux_key(self.model)

    def _dummy_meta(self, n: int) -> AttentionMetadata:
        return dummy_meta(self.attn, n, self.device)

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs.clear()
        self.outputs.clear()

        def body(n: int) -> Any:
            with forward_context(self.attn):
                return self.model(self.input_ids[:n], self.positions[:n])

        log.info("capturing %d CUDA graphs (steps of up to %d tokens)...", len(self.sizes), self.max_size)
        stats = capture_per_size(self.attn, self.sizes, body, self.device, self.graphs, self.outputs)
        self.capture_seconds, self.capture_bytes = stats
        self._captured_for = _aux_key(self.model)
        log.info("captured %d CUDA graphs (token counts %s) in %.2fs using %.1f MiB of GPU memory",
                 len(self.graphs), ",".join(map(str, self.sizes)), self.capture_seconds, self.capture_bytes / 2**20)
        self.tree_graphs.clear()
        self.tree_outputs.clear()
        if self.tree_tokens and self.attn.exact_trees:
            sizes = [s for s in self.sizes if s <= self.padded_size(min(self.tree_tokens, self.max_size))]
            self.attn.capture_exact = True
            try:
                secs, nbytes = capture_per_size(self.attn, sizes, body, self.device, self.tree_graphs,
                                                self.tree_outputs)
            finally:
                self.attn.capture_exact = False
            self.capture_seconds += secs
            self.capture_bytes += nbytes
            log.info("captured %d CUDA graphs for steps with exact trees (up to %d tokens) in %.2fs using %.1f MiB",
                     len(sizes), sizes[-1], secs, nbytes / 2**20)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               copy: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The forward of this step's T tokens (T <= max_size), as fresh tensors of T rows; with
        ``copy`` False, views of the graph's output memory, which the next replay overwrites (for a
        caller that queues every read of them before it: a copy is a launch and an allocation)."""
        if not self.is_current:
            if self.graphs:
                log.info("model outputs changed since capture (aux hidden layers): re-capturing CUDA graphs")
            self.capture()
        T = input_ids.shape[0]
        n = self.padded_size(T)
        self.attn.plan(meta)
        graphs, outputs = self.graphs, self.outputs
        if self.attn.step_exact:  # only the EXACT kernel runs exact trees' work
            graphs, outputs = self.tree_graphs, self.tree_outputs
            if n not in graphs:
                self.eager_tree_steps += 1
                with forward_context(self.attn):
                    return self.model(input_ids, positions)
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        graphs[n].replay()
        out = outputs[n]
        if not copy:
            return tuple(o[:T] for o in out) if isinstance(out, tuple) else out[:T]
        if isinstance(out, tuple):
            return tuple(o[:T].clone() for o in out)
        return out[:T].clone()
