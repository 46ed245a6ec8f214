"""ModelRunner: turns a StepPlan into one forward over a flat ragged batch, then samples.

It owns the target model, its paged KV cache and the attention backend. Host lists become
device tensors once per step; the only device->host copy is the sampled/verified tokens.

On CUDA the default is the Triton paged-attention backend with CUDA graphs of the forward for
padded token counts up to the step budget (``--max-cudagraph-capture-size`` lowers that,
``--enforce-eager`` turns graphs off); on the CPU the
torch-native backend.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.attention.base import AttentionBackend, AttentionMetadata, forward_context, is_fp8
from specserve.attention.torch_native import TorchNativeBackend
from specserve.config import EngineConfig, ModelConfig
from specserve.engine import logits_process, sampler
from specserve.engine.host_copy import host_buffer, host_to_device, pinned_copy
from specserve.engine.kv_cache import kv_slot
from specserve.engine.scheduler import CommitResult, StepPlan
from specserve.speculative.accept import compact_tree_kv

if TYPE_CHECKING:
    from specserve.distributed.driver import TPDriver
    from specserve.engine.cuda_graph import CUDAGraphRunner
    from specserve.engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # rows of the flat batch whose logits are needed, per sampling request: (start, count)
    sample_spans: list[tuple[int, int]]
    # (row, request) where the input is the request's PENDING_TOKEN, read on the device from the
    # step before (overlap scheduling: ModelRunner.launch's ``prev``)
    pending_rows: list[tuple[int, "Request"]] = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A plain step's forward and sampling, queued on the device; ``result`` reads its tokens back
    (the step's one host sync)."""

    tokens: torch.Tensor | None  # [N] one token per sampling request, on the device
    index: dict["Request", int]  # sampling request -> its row in ``tokens``
    logprobs_wanted: list[int | None] = field(default_factory=list)
    logprobs: "sampler.TopLogprobs | None" = None
    # on CUDA: the tokens (and log-probabilities) copied to pinned host memory, and an event after the
    # copies. ``result`` waits for that event, not for the stream, which by then may hold the next step
    host_tokens: torch.Tensor | None = None
    done: "torch.cuda.Event | None" = None

    def read_back_later(self) -> None:
        """Queue the copies ``result`` reads (CUDA; elsewhere ``result`` reads the tensors themselves)."""
        if self.tokens is None or self.tokens.device.type != "cuda":
            return
        self.host_tokens = pinned_copy(self.tokens)
        if self.logprobs is not None:
            self.logprobs = self.logprobs.map(pinned_copy)
        self.done = torch.cuda.Event()
        self.done.record()

    def result(self) -> CommitResult:
        if self.tokens is None:
            return CommitResult(token_ids=[])
        if self.done is not None:
            self.done.synchronize()
        toks = (self.host_tokens if self.host_tokens is not None else self.tokens).tolist()
        lps = None
        if self.logprobs is not None:
            all_lps = self.logprobs.dicts(toks, self.logprobs_wanted)  # each row its own top n
            lps = [[all_lps[i]] if w is not None else None for i, w in enumerate(self.logprobs_wanted)]
        return CommitResult(token_ids=[[t] for t in toks], logprobs=lps)


@dataclass
class StepLists:
    """A step's host lists, built request by request (ModelRunner.prepare; the drafter's early verify,
    which knows a step before it is scheduled), for ModelRunner.upload."""

    block_size: int
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # per sampling request: (first row, rows)
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # the sliding-window layers' pool (kv_cache.WindowBlocks), where the engine has one
    window_slots: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)

    def add(self, toks: list[int], start: int, table: list[int], positions: list[int] | None = None,
            sample_rows: int = 0, window_table: list[int] | None = None) -> int:
        """A request's tokens at KV positions start, start + 1, ... (RoPE ``positions``: the same by
        default); its last ``sample_rows`` rows are sampled. ``window_table``: its KVSlots.window_table
        (engines with a window pool). Returns its first row."""
        a, n, bs = len(self.ids), len(toks), self.block_size
        self.ids.extend(toks)
        if n == 1 and positions is None:  # a decode: most requests of a step
            self.pos.append(start)
            self.slots.append(kv_slot(table, start, bs))
        else:
            kv = range(start, start + n)
            self.pos.extend(kv if positions is None else positions)
            self.slots.extend(kv_slot(table, i, bs) for i in kv)
        if window_table:
            self.window_slots.extend(kv_slot(window_table, i, bs) for i in range(start, start + n))
            self.window_tables.append(window_table)
        self.q_lens.append(n)
        self.seq_lens.append(start + n)
        self.tables.append(table)
        if sample_rows:
            self.spans.append((a + n - sample_rows, sample_rows))
        return a


FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The target's KV cache dtype for ``--kv-cache-dtype`` (auto: the model's; EngineConfig checks the name)."""
    return model_dtype if name == "auto" else FP8_KV_DTYPES[name]


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVLayout:
    """The target's KV pools: ``num_blocks`` blocks of every layer, or, with sliding-window layers whose
    window is shorter than the context, ``num_blocks`` of the full-attention layers and
    ``num_window_blocks`` of the ``window`` layers (kv_cache.WindowBlocks). Each pool has one spare
    block past its own (padded writes, null table entries)."""

    num_blocks: int
    window: int | None = None
    num_window_blocks: int = 0

    def window_layers(self, mc: ModelConfig) -> list[int]:
        return [i for i in range(mc.num_hidden_layers) if self.window is not None and mc.layer_window(i)]


def kv_layout(config: EngineConfig, mc: ModelConfig, num_blocks: int, dtype: torch.dtype, max_len: int) -> KVLayout:
    """The budget of ``num_blocks`` blocks of every layer (num_kv_blocks_for), split per layer type. The
    window pool gets what every seat's window holds at once, cdiv(window, bs) + 2 blocks (drafts, a
    block boundary), plus a step's tokens (a prefill chunk writes all of its own), at most
    ``num_blocks``; the rest of the bytes go to the full-attention layers."""
    windows = {mc.layer_window(i) for i in range(mc.num_hidden_layers)} - {None}
    n_win = sum(mc.layer_window(i) is not None for i in range(mc.num_hidden_layers))
    if not windows or n_win == mc.num_hidden_layers or max(windows) >= max_len:
        return KVLayout(num_blocks)
    if len(windows) > 1:
        raise ValueError(f"sliding-window layers of several windows {sorted(windows)} are not supported")
    (window,) = windows
    bs = config.block_size
    layer_block = kv_bytes_per_token(mc, kv_cache_dtype(config.kv_cache_dtype, dtype)) // mc.num_hidden_layers * bs
    full_block = (mc.num_hidden_layers - n_win) * layer_block + _spec_bytes_per_block(config, mc, dtype)
    budget = num_blocks * (full_block + n_win * layer_block)
    seats = config.max_num_seqs * (-(-window // bs) + 2) + -(-config.max_num_batched_tokens // bs)
    num_window = min(seats, num_blocks)
    return KVLayout((budget - num_window * n_win * layer_block) // full_block, window, num_window)


def _spec_bytes_per_block(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    """What speculation keeps per full-attention block: the draft head's one KV layer, shaped like the
    target's (EAGLE heads) in the head's dtype, and the target's features of every token (three
    layers' hidden states, EAGLE-3)."""
    sc = config.speculative
    if sc is None:
        return 0
    head_dtype = dtype if sc.draft_dtype == "auto" else getattr(torch, sc.draft_dtype)
    return (kv_bytes_per_token(mc, head_dtype) // mc.num_hidden_layers + 3 * mc.hidden_size * dtype.itemsize) \
        * config.block_size


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]: views of one slab
    [num_layers * 2, num_blocks * block_size, ...] (``kv_slab``), so moving a token's KV in every
    layer is one indexing op."""
    # (fp8: zeroed as bytes; the CPU has no fill for 8-bit floats)
    slab = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                       dtype=torch.uint8 if is_fp8(dtype) else dtype, device=device).view(dtype)
    return [(slab[i, 0], slab[i, 1]) for i in range(num_layers)]


def kv_slab(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[num_layers * 2, slots, num_kv_heads, head_dim]: every layer's K and V over one storage, for
    moving tokens' KV (8-bit float caches as their bytes, the storage allocate_kv_cache made: indexing
    ops lack fp8 kernels on the CPU)."""
    k0 = kv_caches[0][0]
    slab = k0._base
    if slab is None or slab.shape[:2] != (len(kv_caches), 2):
        raise ValueError("KV caches not from allocate_kv_cache: no slab under them")
    slab = slab.view(2 * len(kv_caches), -1, *k0.shape[2:])
    return slab.view(torch.uint8) if is_fp8(slab.dtype) else slab


def num_kv_blocks_for(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                      reserve_bytes: int = 0) -> int:
    """Blocks of every layer the KV budget holds (``kv_layout`` splits them per layer type)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = (kv_bytes_per_token(mc, kv_cache_dtype(config.kv_cache_dtype, dtype)) * config.block_size
                 + _spec_bytes_per_block(config, mc, dtype))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total - reserve_bytes
    else:
        budget = config.kv_cache_memory_gb * 2**30
    return max(1, int(budget // per_block))


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA (when triton is installed), 'torch' elsewhere."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
    if name == "torch":
        return name
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":  # (the interpreter: tests)
            raise ValueError(f"the triton attention backend needs a CUDA device, got {device}")
        if not has_triton:
            raise ValueError("attention_backend=triton but the triton package is not installed")
        return name
    if device.type == "cuda":
        if has_triton:
            return "triton"
        log.warning("triton is not installed: using the torch-native attention backend on %s", device)
    return "torch"


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 num_blocks: int | KVLayout, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: frozenset[int] = frozenset(), driver: "TPDriver | None" = None) -> None:
        """``model_config``: this rank's heads under tensor parallelism; ``driver`` there (rank 0): the
        group's other ranks, sent each target call (then no CUDA graphs). ``num_blocks``: of every
        layer, or a KVLayout with a window pool."""
        layout = num_blocks if isinstance(num_blocks, KVLayout) else KVLayout(num_blocks)
        num_blocks = layout.num_blocks
        self.layout = layout
        self.model = model
        self.eos_token_ids = eos_token_ids  # masked before a request's min_tokens (logits_process)
        self.mc = model_config
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.backend_name = resolve_attention_backend(config.attention_backend, device)
        mc, bs = model_config, config.block_size
        scale = mc.head_dim**-0.5
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        self.graphs: CUDAGraphRunner | None = None
        self.attn: AttentionBackend
        # one block beyond each pool's: padded (graph) tokens write their K/V there, the drafter's
        # device-side no-op moves too; [full-attention layers' caches] (+ [window layers' caches])
        windowed = layout.window_layers(mc)
        full = [i for i in range(mc.num_hidden_layers) if i not in windowed]
        self.pool_caches = [allocate_kv_cache(len(full), num_blocks + 1, bs, mc.num_key_value_heads, mc.head_dim,
                                              self.kv_dtype, device)]
        by_layer = dict(zip(full, self.pool_caches[0]))
        if windowed:
            self.pool_caches.append(allocate_kv_cache(len(windowed), layout.num_window_blocks + 1, bs,
                                                      mc.num_key_value_heads, mc.head_dim, self.kv_dtype, device))
            by_layer.update(zip(windowed, self.pool_caches[1]))
        self.kv_caches = [by_layer[i] for i in range(mc.num_hidden_layers)]
        window_scratch = layout.num_window_blocks * bs if windowed else None
        if self.backend_name == "triton":
            from specserve.attention.triton_backend import TritonBackend

            max_len = config.max_model_len or mc.max_position_embeddings
            self.attn = TritonBackend(
                self.kv_caches, bs, scale, num_heads=mc.num_attention_heads,
                max_num_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                max_blocks_per_seq=min(num_blocks, -(-max_len // bs)), scratch_slot=num_blocks * bs,
                exact_trees=config.exact_tree_attention, window_scratch_slot=window_scratch)
            if device.type == "cuda" and not config.enforce_eager:
                from specserve.engine.cuda_graph import CUDAGraphRunner, capture_sizes

                self.graphs = CUDAGraphRunner(model, self.attn, capture_sizes(config.graph_token_limit), device)
        else:
            self.attn = TorchNativeBackend(self.kv_caches, bs, scale)
        self.driver = driver
        if driver is not None:
            assert self.graphs is None, "tensor-parallel steps run eagerly"
            self.model, self.attn = driver.wrap(model, self.attn)
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        # forwards per path ("target:graph" / "target:eager"): benchmarks check no step fell back
        self.path_counts: Counter[str] = Counter()
        log.info("model runner: %s attention, CUDA graphs %s", self.backend_name,
                 f"for up to {self.graphs.max_size} tokens" if self.graphs else "off")

    def ensure_graph_tokens(self, num_tokens: int, trees: bool = False) -> None:
        """Make steps of up to ``num_tokens`` tokens (within the step budget) replay a graph: the
        drafter asks for max_num_seqs x (1 + most drafts), so no verify shape runs eagerly.
        Call before capture."""
        from specserve.engine.cuda_graph import CUDAGraphRunner, capture_sizes

        if self.graphs is None:
            return
        n = min(num_tokens, self.config.max_num_batched_tokens)
        if n > self.graphs.max_size:
            assert not self.graphs.graphs, "ensure_graph_tokens() must run before capture"
            tree_tokens = self.graphs.tree_tokens
            self.graphs = CUDAGraphRunner(self.model, self.attn, capture_sizes(n), self.device)
            self.graphs.tree_tokens = tree_tokens
            log.info("CUDA graphs extended to steps of up to %d tokens", self.graphs.max_size)
        if trees:  # verify steps of trees: graphs of the attention's exact-trees variant too
            self.graphs.tree_tokens = max(self.graphs.tree_tokens, n)

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs now (otherwise the first step does). Call once the model's outputs
        are final: turning on EAGLE-3 aux hidden states after capture costs a re-capture."""
        if self.graphs is not None:
            self.graphs.capture()

    # -- inputs ------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> StepInputs:
        lists = StepLists(self.block_size)
        pending: list[tuple[int, Request]] = []
        for b, s in enumerate(plan.scheduled):
            r = s.req
            nc = r.num_computed_tokens
            toks = r.all_token_ids[nc : nc + s.num_new_tokens] + s.draft_token_ids
            n = len(toks)
            positions = None  # KV slots in order; a tree's RoPE positions follow node depth
            if s.tree is not None:
                positions = [nc + d for d in s.tree.depths[:n]]
                lists.tree_masks[b] = s.tree.mask()[:n, :n]
            a = lists.add(toks, nc, r.kv.block_table, positions, len(s.draft_token_ids) + 1 if s.samples else 0,
                          r.kv.window_table)
            if r.num_pending_tokens and nc + n == r.num_tokens:  # (its input is its pending token)
                pending.append((a + n - 1, r))
        inputs = self.upload(lists)
        inputs.pending_rows = pending
        return inputs

    def upload(self, lists: "StepLists") -> StepInputs:
        """A step's inputs from its host lists (``prepare``'s, or a caller's that knows a step before it
        is scheduled): one packed host->device copy, no sync."""
        ids, tables = lists.ids, lists.tables
        width = max(len(t) for t in tables)
        T, B = len(ids), len(tables)
        win = bool(lists.window_tables)  # (a window table is as long as its block table)
        if win and len(lists.window_tables) != B:
            raise ValueError(f"{len(lists.window_tables)} window tables for {B} requests")
        # one host buffer (pinned on CUDA), one asynchronous copy: ids | positions | slots | block tables
        # (| window slots | window tables)
        on_cuda = self.device.type == "cuda"
        n = 3 * T + B * width
        h, host = host_buffer(n + win * (T + B * width), torch.long, self.device)
        h[:T] = ids
        h[T : 2 * T] = lists.pos
        h[2 * T : 3 * T] = lists.slots
        for part, ts in ((h[3 * T : n], tables), (h[n + T :], lists.window_tables)):
            tab = part.reshape(-1, width)
            for i, t in enumerate(ts):
                tab[i, : len(t)] = t
        if win:
            h[n : n + T] = lists.window_slots
        buf = host.to(self.device, non_blocking=True) if on_cuda else host
        meta = AttentionMetadata(
            query_lens=lists.q_lens,
            seq_lens=lists.seq_lens,
            slot_mapping=buf[2 * T : 3 * T],
            block_tables=buf[3 * T : n].view(B, width),
            tree_masks=lists.tree_masks or None,
            window_slot_mapping=buf[n : n + T] if win else None,
            window_block_tables=buf[n + T :].view(B, width) if win else None,
        )
        return StepInputs(input_ids=buf[:T], positions=buf[T : 2 * T], meta=meta, sample_spans=lists.spans)

    # -- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: StepInputs, copy: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], or (hidden, aux) when EAGLE-3 aux layers are set: a CUDA graph replay when
        one fits the step's token count, else an eager forward. ``copy`` False: a replay's outputs
        may be the graph's own memory, valid until the next replay (CUDAGraphRunner.replay)."""
        if self.graphs is not None and self.graphs.fits(inputs.input_ids.shape[0]):
            eager_before = self.graphs.eager_tree_steps  # (a step with exact trees past their graphs)
            out = self.graphs.replay(inputs.input_ids, inputs.positions, inputs.meta, copy)
            self.path_counts["target:graph" if self.graphs.eager_tree_steps == eager_before else "target:eager"] += 1
            return out  # type: ignore[return-value]
        self.path_counts["target:eager"] += 1
        self.attn.plan(inputs.meta)
        with forward_context(self.attn):
            return self.model(inputs.input_ids, inputs.positions)

    def compact_tree_kv(self, tables: torch.Tensor, nc: torch.Tensor, accepted: torch.Tensor, path: torch.Tensor,
                        live: torch.Tensor, window_tables: torch.Tensor | None = None) -> None:
        """Accepted tree nodes' KV moved behind their root (speculative.accept.compact_tree_kv) in every
        pool, the window pool's through ``window_tables``, on every tensor-parallel rank."""
        if self.driver is not None:  # (the other ranks' KV heads first: the same call there)
            self.driver.compact_tree_kv(tables, nc, accepted, path, live, window_tables)
        bs = self.block_size
        compact_tree_kv(kv_slab(self.pool_caches[0]), tables, nc, accepted, path, live, bs, self.layout.num_blocks * bs)
        if len(self.pool_caches) > 1:
            if window_tables is None:
                raise ValueError("a tree compaction with a window pool needs its window tables")
            compact_tree_kv(kv_slab(self.pool_caches[1]), window_tables, nc, accepted, path, live, bs,
                            self.layout.num_window_blocks * bs)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> CommitResult:
        """Plain decode / prefill step (no drafts): one sampled token per finishing request."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: LaunchedStep | None = None) -> LaunchedStep:
        """A plain step's forward and sampling queued on the device, nothing read back. With
        ``prev`` (overlap scheduling), the inputs that are pending tokens are ``prev``'s samples."""
        inputs, hidden = self.launch_forward(plan, prev)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        return self.launch_sampling(plan, inputs, hidden)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan, prev: LaunchedStep | None = None
                       ) -> tuple[StepInputs, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """``launch``'s inputs and forward (outputs as ``forward(copy=False)``: read them before the
        next forward is launched)."""
        inputs = self.prepare(plan)
        if prev is not None:
            self.path_counts["launch:ahead"] += 1
        if inputs.pending_rows:
            src = [prev.index.get(r) for _, r in inputs.pending_rows] if prev is not None else [None]
            if None in src or prev is None or prev.tokens is None:
                raise RuntimeError("a step reads pending tokens that no launched step samples")
            dst = host_to_device([row for row, _ in inputs.pending_rows], self.device)
            inputs.input_ids.index_copy_(0, dst, prev.tokens.index_select(0, host_to_device(src, self.device)))
        return inputs, self.forward(inputs, copy=False)

    def launch_sampling(self, plan: StepPlan, inputs: StepInputs, hidden: torch.Tensor) -> LaunchedStep:
        """One token for each request that finishes its scheduled tokens this step (no drafts), queued on
        the device: logits, tokens and log-probabilities stay there until ``result``."""
        sampling = [s for s in plan.scheduled if s.samples]
        if not sampling:
            return LaunchedStep(None, {})
        rows = host_to_device([a for a, _ in inputs.sample_spans], self.device)
        raw = self.model.compute_logits(hidden[rows])
        spans = [(s.req, j, [[]]) for j, s in enumerate(sampling) if s.req.processes_logits]
        logits = logits_process.process(raw, spans, self.eos_token_ids) if spans else raw
        if all(s.req.params.greedy for s in sampling):
            tokens = logits.argmax(dim=-1)  # building a SamplingBatch would copy (and sync) 4 tensors
        else:  # (the token sampled sits at index num_tokens: after a pending token, where there is one)
            sb = sampler.SamplingBatch.build([s.req.params for s in sampling],
                                             [s.req.num_tokens - s.req.num_prompt_tokens for s in sampling], self.device)
            tokens = sampler.sample(logits, sb, self.generator)
        launched = LaunchedStep(tokens, {s.req: j for j, s in enumerate(sampling)})
        want = [s.req.params.logprobs for s in sampling]
        if any(w is not None for w in want):  # (the model's distribution: before processing)
            launched.logprobs = sampler.top_logprobs_on_device(raw, tokens, max(w or 0 for w in want))
            launched.logprobs_wanted = want
        launched.read_back_later()
        return launched
