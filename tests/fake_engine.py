"""A tiny stand-in for LLMEngine (same interface) for fast server tests.

One character = one token (id = code point, 0 = EOS). Greedy requests write `TEXT` over and over;
sampled ones draw letters from a per-request `random.Random(seed)`. KV blocks are counted like a
paged cache so tests can see them freed.
"""

from __future__ import annotations

import math
import random
import string
import time
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.sampling_params import RequestOutputKind, SamplingParams

TEXT = "the quick brown fox jumps over the lazy dog. "


class QueueFullError(RuntimeError):
    pass


class FakeTokenizer:
    eos_token_ids = {0}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:  # (no special tokens)
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i not in self.eos_token_ids)

    def detokenizer(self, prompt_ids: list[int] = ()) -> "FakeDetokenizer":
        return FakeDetokenizer(self)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        for m in messages:
            if m["role"] == "tool":
                raise ValueError("this template has no tool role")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


class FakeDetokenizer:
    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self.tokenizer = tokenizer

    def append(self, ids: list[int] | int) -> str:
        return self.tokenizer.decode([ids] if isinstance(ids, int) else ids)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_drafted_per_position: list[int] = field(default_factory=list)
    steps: int = 0
    spec_steps: int = 0
    k_histogram: dict[int, int] = field(default_factory=dict)
    avg_accept_length: float | None = None


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    stop_reason: str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


class FakeEngine:
    def __init__(self, max_model_len: int = 512, num_blocks: int = 256, block_size: int = 4,
                 max_num_seqs: int = 8, max_waiting: int = 64, step_delay: float = 0.002,
                 spec_k: int = 0) -> None:
        self.config = EngineConfig(model="fake", max_model_len=max_model_len, num_kv_blocks=num_blocks,
                                   block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_waiting_requests=max_waiting)
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.spec_k = spec_k  # >0: each step "verifies" k drafts and accepts k-1 of them
        self.num_blocks = num_blocks
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.stats = EngineStats(spec_accepted_per_position=[0] * spec_k, spec_drafted_per_position=[0] * spec_k)
        self.aborted: list[str] = []

    # -------------------------------------------------------------- interface

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"duplicate request id {request_id!r}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue full ({len(self.waiting)} requests)")
        metrics = RequestMetrics(arrival_time=arrival_time or time.time(), num_prompt_tokens=len(ids))
        self.waiting.append(_Req(request_id, prompt if isinstance(prompt, str) else None, ids, params, metrics,
                                 random.Random(params.seed)))

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        self.running = [r for r in self.running if r.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_by_request(self) -> dict[str, int]:
        bs = self.config.block_size
        return {r.request_id: math.ceil((len(r.prompt_ids) + len(r.token_ids) + 1) / bs) for r in self.running}

    def blocks_used(self) -> int:
        return sum(self.blocks_by_request().values())

    # -------------------------------------------------------------- for tests (called in the engine core)

    def kv_state(self) -> tuple[dict[str, int], int]:
        return self.blocks_by_request(), self.blocks_used()

    def aborted_ids(self) -> list[str]:
        return list(self.aborted)

    def set_step_delay(self, seconds: float) -> None:
        self.step_delay = seconds

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_usage = self.blocks_used() / self.num_blocks
        if s.spec_verify_steps:
            s.avg_accept_length = (s.spec_accepted_tokens + s.spec_verify_steps) / s.spec_verify_steps
        return EngineStats(**{k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                              for k, v in vars(s).items()})

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        self.stats.steps += 1
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting.pop(0)
            self.stats.prompt_tokens += len(r.prompt_ids)
            self.running.append(r)
        outputs = []
        if self.spec_k and self.running:
            self.stats.spec_steps += 1
            self.stats.k_histogram[self.spec_k] = self.stats.k_histogram.get(self.spec_k, 0) + 1
        for r in list(self.running):
            n_new = 1
            if self.spec_k and r.token_ids:  # verify k drafts, accept k-1
                n_new = self.spec_k
                r.metrics.spec_verify_steps += 1
                r.metrics.spec_draft_tokens += self.spec_k
                r.metrics.spec_accepted_tokens += self.spec_k - 1
                self.stats.spec_verify_steps += 1
                self.stats.spec_draft_tokens += self.spec_k
                self.stats.spec_accepted_tokens += self.spec_k - 1
                for pos in range(self.spec_k):
                    self.stats.spec_drafted_per_position[pos] += 1
                    if pos < self.spec_k - 1:
                        self.stats.spec_accepted_per_position[pos] += 1
            finish = None
            for _ in range(n_new):
                finish = self._generate_one(r)
                if finish:
                    break
            if finish:
                self.running.remove(r)
            outputs.append(self._output(r, finish))
        return outputs

    # -------------------------------------------------------------- internals

    def _generate_one(self, r: _Req) -> str | None:
        p = r.params
        if p.greedy:
            tid = ord(TEXT[len(r.token_ids) % len(TEXT)])
        else:
            tid = ord(r.rng.choice(string.ascii_lowercase + " "))
        r.token_ids.append(tid)
        self.stats.generation_tokens += 1
        r.metrics.num_generation_tokens += 1
        if p.logprobs is not None:
            entry = {tid: -0.25}
            for i in range(p.logprobs):
                alt = ord("A") + i
                entry.setdefault(alt, -2.0 - i)
            r.logprobs.append(entry)
        r.text = self.tokenizer.decode(r.token_ids)
        for s in p.stop_list:
            at = r.text.find(s)
            if at >= 0:
                r.text = r.text[: at + len(s)] if p.include_stop_str_in_output else r.text[:at]
                r.stop_reason = s
                return "stop"
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(r.prompt_ids)
        if len(r.token_ids) >= max_tokens:
            return "length"
        return None

    def _output(self, r: _Req, finish: str | None) -> RequestOutput:
        new_ids = r.token_ids[r.sent_tokens:]
        # hold back text that could be the start of a stop string (like a real detokenizer does)
        visible = r.text
        if not finish:
            for s in r.params.stop_list:
                for k in range(len(s) - 1, 0, -1):
                    if visible.endswith(s[:k]):
                        visible = visible[:-k]
                        break
        new_text = visible[r.sent_text:] if len(visible) >= r.sent_text else ""
        r.sent_tokens, r.sent_text = len(r.token_ids), max(r.sent_text, len(visible))
        lps = None
        if r.params.logprobs is not None:
            delta = r.params.output_kind is RequestOutputKind.DELTA
            lps = [dict(e) for e in (r.logprobs[len(r.token_ids) - len(new_ids):] if delta else r.logprobs)]
        comp = CompletionOutput(0, r.text, list(r.token_ids), finish, r.stop_reason,
                                logprobs=lps)
        return RequestOutput(r.request_id, r.prompt, list(r.prompt_ids), [comp], finish is not None, r.metrics,
                             new_token_ids=new_ids, new_text=new_text)


class BrokenEngine(FakeEngine):
    """Its first step raises: the engine core fails."""

    def step(self) -> list[RequestOutput]:
        raise RuntimeError("boom")
