"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.kv_cache import KVSlots
from specserve.outputs import RequestMetrics
from specserve.sampling_params import SamplingParams


# an output token sampled on the device and not read back yet (overlap scheduling: the next step is
# scheduled, and reads it on the device, before the host knows it)
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: requests are compared and looked up by object
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # KV for all_token_ids[:num_computed_tokens] is in the cache
    num_computed_tokens: int = 0
    kv: KVSlots = field(default_factory=KVSlots)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    detok: object | None = None  # IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None = None
    # its own logits processors (logits_process.LogitsProcessor, e.g. a grammar's mask), besides the
    # edits its params ask for
    logits_processors: list[Any] = field(default_factory=list)
    grammar: Any = None  # structured.matcher.GrammarState: what its committed tokens allow next
    metrics: RequestMetrics = field(init=False)
    # speculation: tokens drafted for the next verify (target ids)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_tree: object | None = None  # speculative.tree.DraftTree when the drafts form a tree
    spec: Any = None  # speculative.state.DraftState: the drafter's state of this request
    # its prompt prefix came from cached blocks whose draft KV was never computed (admitted while
    # speculation was off, with the head's catch-up over such blocks turned off): it never drafts
    no_draft_kv: bool = False
    # ... or, with that catch-up (the default), how many leading tokens of what it took from the prefix
    # cache have draft KV: its drafting state starts there, and the head catches up over the rest from
    # the target features kept at those blocks' slots (None: all it took has draft KV)
    draft_kv_tokens: int | None = None
    # KV slots up to this many tokens are written by a forward already launched for the next step
    # (the drafter's early verify): commit keeps their blocks, which it would free as unused
    kv_hold_tokens: int = 0
    # tokens already handed to the caller (for deltas)
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))
        if self.params.logprobs is not None:
            self.logprobs = []
        self._params_process = self.params.processes_logits

    @property
    def processes_logits(self) -> bool:
        """Whether its rows go through logits_process.process (a bool check per request and step)."""
        return self._params_process or bool(self.logits_processors)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Trailing PENDING_TOKENs in all_token_ids (0 or 1: overlap scheduling, Scheduler.advance)."""
        ids = self.all_token_ids
        return 1 if ids and ids[-1] == PENDING_TOKEN else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while more than one known token still lacks KV (prompt, or recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
