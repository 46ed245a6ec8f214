"""Replies from the target, for self-distillation and for held-out acceptance.

``engine`` (default) runs our engine batched (continuous batching), greedy or sampled at a
temperature with a seed per reply. ``simple`` is a small static-batch greedy loop over a dense KV
cache, kept for when the engine is not usable on a device; both use the target's own chat
template (plain completion text for a model without one) and stop at its end-of-turn ids.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend, AttentionMetadata, forward_context
from specserve.train.attention import window_causal_mask
from specserve.train.data import Conversation, render_ids
from specserve.train.target import Target

log = logging.getLogger(__name__)


@dataclass
class Reply:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, the stop token included when one was produced
    text: str


def generate_replies(target: Target, convs: Sequence[Conversation], max_tokens: int, backend: str = "engine",
                     batch_size: int = 256, max_num_batched_tokens: int = 16384,
                     time_budget_s: float | None = None, temperatures: Sequence[float] | None = None,
                     seeds: Sequence[int] | None = None) -> list[Reply | None]:
    """One call of a ``ReplyGenerator`` (its engine sized for these prompts)."""
    gen = ReplyGenerator(target, backend, batch_size, max_num_batched_tokens)
    return gen.replies(convs, max_tokens, time_budget_s, temperatures, seeds)


class ReplyGenerator:
    """The target's replies through one engine kept across calls (built on first use; KV for a full
    batch of ``max_len``-token sequences, or of the first call's longest prompt and reply, and built
    anew when a call needs more), or through the simple loop (``backend="simple"``)."""

    def __init__(self, target: Target, backend: str = "engine", batch_size: int = 256,
                 max_num_batched_tokens: int = 16384, max_len: int | None = None) -> None:
        self.target, self.backend, self.batch_size = target, backend, batch_size
        self.max_num_batched_tokens, self.max_len = max_num_batched_tokens, max_len
        self._llm = None
        self._llm_len = 0  # tokens per sequence the engine's KV was sized for

    def _engine(self, need: int):
        if self._llm is None or need > self._llm_len:
            self._llm = None
            self._llm_len = max(need, self.max_len or 0)
            # KV for a full batch, not a share of free memory: the trainer holds GPU memory of its own
            blocks = self.batch_size * (-(-self._llm_len // 16) + 1)
            self._llm = _make_llm(self.target, self.batch_size, self.max_num_batched_tokens, blocks)
        return self._llm

    def replies(self, convs: Sequence[Conversation], max_tokens: int, time_budget_s: float | None = None,
                temperatures: Sequence[float] | None = None,
                seeds: Sequence[int] | None = None) -> list[Reply | None]:
        """A reply to each conversation (its last message must be a user message): greedy, or for
        conversation i sampled at ``temperatures[i]`` > 0 (engine only) with seed ``seeds[i]``.

        With ``time_budget_s`` generation stops at the deadline (the engine aborts what is in flight;
        the simple loop finishes its batch); conversations not reached get None. The engine takes the
        conversations in the given order then, so what a budget leaves out is the tail of that order.
        """
        target, backend, batch_size = self.target, self.backend, self.batch_size
        for c in convs:
            if not c or c[-1]["role"] != "user":
                raise ValueError("each conversation to reply to must end with a user message")
        temps = [0.0] * len(convs) if temperatures is None else [float(t) for t in temperatures]
        if len(temps) != len(convs) or (seeds is not None and len(seeds) != len(convs)):
            raise ValueError(f"{len(temps)} temperatures and {len(seeds or temps)} seeds for "
                             f"{len(convs)} conversations")
        if any(t < 0 for t in temps):
            raise ValueError(f"temperatures must be >= 0, got {min(temps)}")
        sampled = any(t > 0 for t in temps)
        if sampled and backend != "engine":
            raise ValueError("sampled replies (temperature > 0) need the engine backend")
        prompts = [render_ids(target.tokenizer, c, add_generation_prompt=True) for c in convs]
        out: list[Reply | None] = [None] * len(convs)
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        # longest first keeps padding (simple loop) and late stragglers (engine) down; under a budget the
        # engine keeps the caller's order, so what is cut is not always the shortest prompts
        longest_first = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        order = list(range(len(prompts))) if deadline is not None and backend == "engine" else longest_first
        gens: dict[int, list[int]] = {}
        if backend == "engine" and prompts:
            try:
                llm = self._engine(max(map(len, prompts)) + max_tokens)
                order = _engine_generate(llm, prompts, order, max_tokens, batch_size, deadline, gens, temps, seeds)
            except Exception as e:  # keep a long run alive: the simple loop gives the same greedy tokens
                if sampled:
                    raise
                log.warning("engine generation failed (%s: %s); using the simple loop", type(e).__name__, e)
                order = [i for i in longest_first if i not in gens]
        elif backend == "engine":
            order = []
        for g0 in range(0, len(order), batch_size):
            if deadline is not None and time.monotonic() > deadline:
                log.info("generation budget spent with %d of %d replies done", len(gens), len(prompts))
                break
            idx = order[g0 : g0 + batch_size]
            for i, ids in zip(idx, simple_greedy(target, [prompts[i] for i in idx], max_tokens)):
                gens[i] = ids
        for i, ids in gens.items():
            out[i] = Reply(prompt_ids=prompts[i], token_ids=ids,
                           text=target.tokenizer.decode(_strip_stop(ids, target.stop_ids)))
        return out


def _strip_stop(ids: list[int], stop_ids: Sequence[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in set(stop_ids) else ids


def _make_llm(target: Target, max_num_seqs: int, max_num_batched_tokens: int, num_kv_blocks: int):
    from specserve import LLM

    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[target.dtype]
    return LLM(model=target.path, device=str(target.device), dtype=dtype, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
               num_kv_blocks=num_kv_blocks, block_size=16)


def _engine_generate(llm, prompts: list[list[int]], order: list[int], max_tokens: int, concurrency: int,
                     deadline: float | None, gens: dict[int, list[int]], temperatures: Sequence[float],
                     seeds: Sequence[int] | None) -> list[int]:
    """Feed prompts to the engine (continuous batching) until done or the deadline; fills ``gens``.

    Returns the prompts not attempted (empty unless the engine rejected some).
    """
    from tqdm.auto import tqdm

    from specserve import SamplingParams

    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def params(i: int) -> SamplingParams:
        if temperatures[i] == 0:
            return greedy
        return SamplingParams(temperature=temperatures[i], max_tokens=max_tokens,
                              seed=None if seeds is None else int(seeds[i]))

    stops = set(llm.tokenizer.eos_token_ids)
    queue = collections.deque(order)
    inflight: dict[str, int] = {}
    rejected: list[int] = []
    bar = tqdm(total=len(order), desc="generate", mininterval=10)
    while queue or inflight:
        while queue and len(inflight) < 2 * concurrency:
            i = queue.popleft()
            rid = f"distill-{i}"
            try:
                engine.add_request(rid, prompts[i], params(i))
            except ValueError:  # e.g. longer than the engine's context
                rejected.append(i)
                continue
            inflight[rid] = i
        if deadline is not None and time.monotonic() > deadline:
            for rid in inflight:
                engine.abort_request(rid)
            log.info("generation budget spent with %d of %d replies done", len(gens), len(order))
            queue.clear()
            break
        for o in engine.step():
            if o.finished and o.request_id in inflight:
                i = inflight.pop(o.request_id)
                ids = list(o.outputs[0].token_ids)
                if o.outputs[0].finish_reason == "stop" and stops and (not ids or ids[-1] not in stops):
                    ids.append(min(stops))  # keep the end-of-turn token as a training target
                gens[i] = ids
                bar.update(1)
    bar.close()
    return rejected


# ---- the simple path: static batch, dense KV cache --------------------------------------------


class _DenseKVBackend(AttentionBackend):
    """Per-row dense cache [B, max_len, KVH, D]; prefill (right-padded) then one token per row."""

    def __init__(self, num_layers: int, B: int, max_len: int, kvh: int, d: int, dtype: torch.dtype,
                 device: torch.device, scale: float) -> None:
        super().__init__([], block_size=1, scale=scale)
        self.k = torch.zeros(num_layers, B, max_len, kvh, d, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.B = B
        self.lens = torch.zeros(B, dtype=torch.long, device=device)  # tokens cached before this step
        self.prefill_len = 0  # > 0: this step is a prefill of that padded length
        self._kv_len = 0  # keys to attend over in a decode step (max over rows, this token included)

    def plan(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        B = self.B
        if self.prefill_len:
            L = self.prefill_len
            qb, kb, vb = (t.view(B, L, t.shape[1], t.shape[2]) for t in (q, k, v))
            self.k[layer, :, :L] = kb
            self.v[layer, :, :L] = vb
            wmask = None if window is None or L <= window else window_causal_mask(L, window, q.device)
            out = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                                 attn_mask=wmask, is_causal=wmask is None, scale=self.scale,
                                                 enable_gqa=qb.shape[2] != kb.shape[2])
            return out.transpose(1, 2).reshape(B * L, q.shape[1], q.shape[2])
        rows = torch.arange(B, device=q.device)
        self.k[layer, rows, self.lens] = k
        self.v[layer, rows, self.lens] = v
        n = int(self._kv_len)
        kk = self.k[layer, :, :n].transpose(1, 2)
        vv = self.v[layer, :, :n].transpose(1, 2)
        key_pos = torch.arange(n, device=q.device)[None, :]
        mask = key_pos <= self.lens[:, None]
        if window is not None:
            mask &= key_pos > self.lens[:, None] - window
        mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=mask, scale=self.scale,
                                             enable_gqa=q.shape[1] != kk.shape[1])
        return out[:, :, 0, :]


@torch.no_grad()
def simple_greedy(target: Target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model, cfg, dev = target.model, target.config, target.device
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    L = int(lens.max())
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p, device=dev)
    be = _DenseKVBackend(cfg.num_hidden_layers, B, L + max_tokens, cfg.num_key_value_heads, cfg.head_dim,
                         target.dtype, dev, cfg.head_dim ** -0.5)
    stops = torch.tensor(target.stop_ids or [-1], device=dev)
    prev_aux = model.aux_hidden_layers
    model.set_aux_hidden_layers(None)
    try:
        with forward_context(be):
            be.prefill_len = L
            h = model(ids.reshape(-1), torch.arange(L, device=dev).repeat(B))
            be.prefill_len = 0
            last = h.view(B, L, -1)[torch.arange(B, device=dev), lens - 1]
            tok = model.compute_logits(last).argmax(-1)
            be.lens = lens.clone()
            out = torch.zeros(B, max_tokens, dtype=torch.long, device=dev)
            done = torch.zeros(B, dtype=torch.bool, device=dev)
            n_out = torch.zeros(B, dtype=torch.long, device=dev)
            for step in range(max_tokens):
                out[:, step] = tok
                n_out += (~done).long()
                done |= torch.isin(tok, stops)
                if step == max_tokens - 1 or bool(done.all()):
                    break
                be._kv_len = int(be.lens.max()) + 1
                h = model(tok, be.lens.clone())
                be.lens += 1
                tok = model.compute_logits(h).argmax(-1)
    finally:
        model.set_aux_hidden_layers(prev_aux)
    n_host = n_out.tolist()
    rows = out.tolist()
    return [rows[r][: n_host[r]] for r in range(B)]
