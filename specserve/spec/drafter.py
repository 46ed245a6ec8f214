"""EAGLE / EAGLE-3 speculation inside the engine's step.

Per step (engine.step): schedule -> ``verify_step`` (one target forward over every request's
query tokens: prefill chunks, plain decodes, and last token + drafts for those that drafted;
then verification) -> commit (scheduler appends tokens) -> ``draft_step`` (the controller picks k
per request for the next step; requests with k > 0 catch their draft KV up over the tokens
committed since they last drafted and draft k tokens).

The head's input at position i is (embedding of token i+1, target feature of token i); its
output there predicts token i+2. Target features of committed tokens wait in ``pending`` until
the request drafts again, so a request with k = 0 costs no draft work at all.

The draft KV cache has one layer per head layer and shares the target's block tables: the
draft KV of position i lives in the same slot as the target KV of position i.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.attention.torch_native import TorchNativeBackend
from specserve.engine import sampler
from specserve.engine.request import Request
from specserve.engine.runner import allocate_kv_cache
from specserve.engine.scheduler import CommitResult, StepPlan
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.spec.controller import SpecController
from specserve.spec.verify import verify_greedy, verify_sampled

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

DEFAULT_HEAD = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-eagle3"


def default_draft_path() -> str:
    env = os.environ.get("SPECSERVE_DEFAULT_DRAFT")
    path = Path(env) if env else DEFAULT_HEAD
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no draft head given and the default head is missing at {path}; "
            "pass --speculative-draft-model-path"
        )
    return str(path)


@dataclass
class DraftState:
    """Per-request drafting state."""

    draft_pos: int  # first position whose draft KV is not computed
    pending: list[torch.Tensor] = field(default_factory=list)  # target features of positions draft_pos..
    draft_probs: torch.Tensor | None = None  # [k, V] q of the current drafts (sampled requests only)


class EagleSpeculator:
    def __init__(self, engine: "LLMEngine") -> None:
        cfg = engine.config.speculative
        assert cfg is not None
        self.cfg = cfg
        self.engine = engine
        self.runner = engine.runner
        self.target = engine.runner.model
        self.device = engine.device
        path = cfg.draft_model_path or default_draft_path()
        self.head = Eagle3DraftModel.from_pretrained(path, device=self.device, dtype=engine.dtype).eval()
        hc = self.head.config
        want = "EAGLE3" if cfg.algorithm == "EAGLE3" else "EAGLE"
        if hc.algorithm != want:
            raise ValueError(f"--speculative-algorithm {cfg.algorithm} but the head at {path} is {hc.algorithm}")
        mc = engine.model_config
        if hc.vocab_size != mc.vocab_size:
            raise ValueError(f"draft head vocab {hc.vocab_size} != target vocab {mc.vocab_size}")
        if self.head.is_eagle3:
            self.target.set_aux_hidden_layers(hc.resolved_aux_layer_ids(mc.num_hidden_layers))
        else:
            self.head.bind_target(self.target.compute_logits)
        caches = allocate_kv_cache(self.head.num_kv_layers, self.runner.attn.kv_caches[0][0].shape[0],
                                   engine.config.block_size, hc.num_key_value_heads, hc.head_dim,
                                   engine.dtype, self.device)
        self.attn = TorchNativeBackend(caches, engine.config.block_size, hc.head_dim**-0.5)
        engine.blocks.require_draft_kv = True
        self.states: dict[str, DraftState] = {}
        self.controller = SpecController(cfg)
        self.max_k = cfg.num_steps
        log.info("speculation: %s head from %s (draft vocab %d), policy %s, up to %d tokens",
                 hc.algorithm, path, hc.draft_vocab_size, cfg.policy, self.max_k)

    # -- lifecycle ------------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        self.states.pop(req.request_id, None)

    def _state(self, req: Request) -> DraftState:
        st = self.states.get(req.request_id)
        if st is None:
            st = self.states[req.request_id] = DraftState(draft_pos=req.num_computed_tokens)
        return st

    # -- target forward + verification ---------------------------------------------------------
    @torch.inference_mode()
    def verify_step(self, plan: StepPlan) -> CommitResult:
        t0 = time.perf_counter()
        inputs = self.runner.prepare(plan)
        out = self.runner.forward(inputs)
        hidden, feats = out if isinstance(out, tuple) else (out, out)

        sampling = [s for s in plan.scheduled if s.samples]
        rows = torch.cat([torch.arange(a, a + n) for a, n in inputs.sample_spans]) if sampling else None
        logits = self.target.compute_logits(hidden[rows.to(self.device)]) if sampling else None
        sb_all = sampler.SamplingBatch.build([s.req.params for s in sampling],
                                             [s.req.generator for s in sampling], self.device)
        greedy_argmax = logits.argmax(-1).tolist() if logits is not None else []  # the one host sync

        token_ids: list[list[int]] = []
        accepted: list[int] = []
        want_lps = any(s.req.params.logprobs is not None for s in sampling)
        lps: list | None = [] if want_lps else None
        off = 0
        for i, s in enumerate(sampling):
            k = len(s.draft_token_ids)
            span = slice(off, off + k + 1)
            off += k + 1
            p = s.req.params
            if p.greedy:
                res = verify_greedy(greedy_argmax[span], s.draft_token_ids)
            else:
                st = self._state(s.req)
                sb = sb_all.select([i] * (k + 1))
                res = verify_sampled(logits[span], s.draft_token_ids, st.draft_probs, sb, self.runner.generator)
            token_ids.append(res.tokens)
            accepted.append(res.num_accepted)
            if lps is not None:
                if p.logprobs is None:
                    lps.append(None)
                else:
                    n = len(res.tokens)
                    lps.append(sampler.top_logprobs(logits[span][:n], torch.tensor(res.tokens, device=self.device),
                                                    p.logprobs))
        # keep target features of the tokens that will be committed
        j = 0
        start = 0
        for s in plan.scheduled:
            st = self._state(s.req)
            keep = s.num_new_tokens
            if s.samples:
                keep += accepted[j]
                j += 1
            st.pending.append(feats[start : start + keep])
            start += s.num_query_tokens
        self._record(plan, sampling, accepted, time.perf_counter() - t0)
        return CommitResult(token_ids=token_ids, logprobs=lps, num_accepted_drafts=accepted)

    def _record(self, plan: StepPlan, sampling, accepted: list[int], seconds: float) -> None:
        stats = self.engine.stats
        verified = [(s, a) for s, a in zip(sampling, accepted) if s.draft_token_ids]
        if verified:
            stats.spec_steps += 1
        K = self.max_k
        if len(stats.spec_drafted_per_position) < K:
            stats.spec_drafted_per_position = [0] * K
            stats.spec_accepted_per_position = [0] * K
        for s, a in verified:
            k = len(s.draft_token_ids)
            stats.spec_verify_steps += 1
            stats.spec_draft_tokens += k
            stats.spec_accepted_tokens += a
            for pos in range(k):
                stats.spec_drafted_per_position[pos] += 1
                if pos < a:
                    stats.spec_accepted_per_position[pos] += 1
        for s, a in zip(sampling, accepted):
            self.controller.observe(s.req.request_id, len(s.draft_token_ids), a)
        self.controller.observe_step(plan.num_tokens, len(plan.scheduled), seconds)

    # -- drafting -------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_step(self, plan: StepPlan, result: CommitResult) -> None:
        sched = self.engine.scheduler
        # requests that produced a token this step and decode next step
        candidates = [s.req for s in plan.scheduled
                      if s.samples and not s.req.is_finished and s.req.num_tokens - s.req.num_computed_tokens == 1]
        if not candidates:
            return
        caps = []
        for r in candidates:
            cap = self.max_k
            if r.params.max_spec_tokens is not None:
                cap = min(cap, r.params.max_spec_tokens)
            if r.params.max_tokens is not None:
                cap = min(cap, r.params.max_tokens - r.num_output_tokens - 1)
            cap = min(cap, self.engine.max_model_len - r.num_tokens - 1)
            caps.append(max(cap, 0))
        ks = self.controller.decide(candidates, caps, len(sched.running), self._prefill_tokens_waiting())
        todo: list[tuple[Request, int]] = []
        for r, k in zip(candidates, ks):
            if k > 0 and sched._reserve(r, r.num_tokens + k):
                todo.append((r, k))
        if todo:
            t0 = time.perf_counter()
            self._draft(todo)
            self.controller.observe_draft(len(todo), max(k for _, k in todo), time.perf_counter() - t0)
        self.engine.stats.k_histogram = dict(self.controller.k_histogram)

    def _prefill_tokens_waiting(self) -> int:
        sched = self.engine.scheduler
        n = sum(r.num_tokens - r.num_computed_tokens for r in sched.running if r.is_prefilling)
        return n + sum(r.num_tokens for r in list(sched.waiting)[:8])

    def _run_head(self, reqs: list[Request], q_lens: list[int], positions: list[int], seq_lens: list[int],
                  embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        bs = self.engine.config.block_size
        slots = []
        tables = []
        for r in reqs:
            tables.append(r.kv.block_table)
        p_iter = iter(positions)
        for r, n in zip(reqs, q_lens):
            bt = r.kv.block_table
            for _ in range(n):
                p = next(p_iter)
                slots.append(bt[p // bs] * bs + p % bs)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            query_lens=q_lens, seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                                      device=self.device),
        )
        self.attn.plan(meta)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(self.attn):
            return self.head(embeds, hidden, pos_t)

    def _pick(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor | None]]:
        """Next draft token per request (target ids) and, for sampled requests, its distribution q."""
        if all(r.params.greedy for r in reqs):
            ids = self.head.draft_to_target(logits.argmax(-1))
            return ids.tolist(), [None] * len(reqs)
        V = self.engine.model_config.vocab_size
        full = torch.full((logits.shape[0], V), float("-inf"), device=logits.device)
        tgt = self.head.draft_to_target(torch.arange(logits.shape[1], device=logits.device))
        full[:, tgt] = logits
        sb = sampler.SamplingBatch.build([r.params for r in reqs], [r.generator for r in reqs], self.device)
        q = sampler.processed_probs(full, sb)
        toks = sampler.draw(q, sb, self.runner.generator).tolist()
        return toks, [None if r.params.greedy else q[i] for i, r in enumerate(reqs)]

    def _draft(self, todo: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in todo]
        # 1. catch up: pairs (embed(token i+1), feature i) for every position without draft KV
        q_lens, positions, next_tokens, feats = [], [], [], []
        for r in reqs:
            st = self.states[r.request_id]
            n = r.num_computed_tokens - st.draft_pos
            q_lens.append(n)
            positions.extend(range(st.draft_pos, r.num_computed_tokens))
            next_tokens.extend(r.all_token_ids[st.draft_pos + 1 : r.num_computed_tokens + 1])
            feats.extend(st.pending)
        feat = torch.cat(feats, 0)
        emb = self.target.embed_tokens(torch.tensor(next_tokens, dtype=torch.long, device=self.device))
        seq_lens = [r.num_computed_tokens for r in reqs]
        h = self._run_head(reqs, q_lens, positions, seq_lens, emb, self.head.combine(feat))
        last = torch.tensor(q_lens, device=self.device).cumsum(0) - 1
        h = h[last]
        bs = self.engine.config.block_size
        for r in reqs:
            st = self.states[r.request_id]
            st.draft_pos = r.num_computed_tokens
            st.pending = []
            self.engine.blocks.mark_draft_ready(r.kv.block_table[: st.draft_pos // bs])
        toks, qs = self._pick(reqs, self.head.compute_logits(h))
        drafts = [[t] for t in toks]
        dprobs = [[q] for q in qs]
        # 2. draft steps 2..k: position of step j is num_tokens - 2 + j - 1
        active = list(range(len(reqs)))
        for j in range(2, max(k for _, k in todo) + 1):
            active = [i for i in active if todo[i][1] >= j]
            if not active:
                break
            sub = [reqs[i] for i in active]
            pos = [r.num_tokens + j - 3 for r in sub]
            emb = self.target.embed_tokens(torch.tensor([drafts[i][-1] for i in active], device=self.device))
            h_sub = self._run_head(sub, [1] * len(sub), pos, [p + 1 for p in pos], emb,
                                   h[torch.tensor(active, device=self.device)])
            h = h.clone()
            h[torch.tensor(active, device=self.device)] = h_sub
            toks, qs = self._pick(sub, self.head.compute_logits(h_sub))
            for i, t, q in zip(active, toks, qs):
                drafts[i].append(t)
                dprobs[i].append(q)
        for i, r in enumerate(reqs):
            r.draft_token_ids = drafts[i]
            st = self.states[r.request_id]
            st.draft_probs = None if r.params.greedy else torch.stack(dprobs[i])


def build_speculator(engine: "LLMEngine") -> EagleSpeculator:
    return EagleSpeculator(engine)
