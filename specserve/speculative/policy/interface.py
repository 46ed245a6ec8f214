"""The policy's two hooks: ``ks = controller.decide(Batch(...))`` (0 = plain decode; ``early=True``: before the
step in flight ends, or None) and ``controller.observe(StepOutcome(...))``, which ends that step's cycle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    """The requests about to step, for ``decide``."""

    requests: list  # each with .request_id
    caps: list[int]  # most draft tokens each may take
    num_running: int
    prefill_tokens: int = 0  # prompt tokens sharing the step
    behind: int = 0  # tokens whose draft KV drafting would first catch up
    context: Callable[[], tuple[int, int]] | None = None  # (prefill_tokens, behind), computed where a full decision
    # needs them (inside its timing), in place of the two fields

    def weighed(self) -> tuple[int, int]:
        return self.context() if self.context is not None else (self.prefill_tokens, self.behind)


@dataclass(frozen=True)
class StepOutcome:
    """What the step of the last decision did, for ``observe``."""

    request_ids: list[str]  # the requests that sampled
    drafted: list[int]  # per request: the depth it verified (0: plain)
    accepted: list[int]  # per request: drafts accepted
    num_tokens: int  # in the target step
    seconds: float  # of the target step
    cycle_seconds: float  # wall time from the decision to now
    num_seqs: int | None = None  # requests in the target step (None: len(request_ids))
    prefill_tokens: int = 0  # prompt tokens before each prompt's last
    own_time: bool = True  # False: ``seconds`` includes device work queued before the step
    draft_seconds: float = 0.0  # of its draft loop (max(drafted) steps), a catch-up after plain steps excluded
    caught_up: int = 0  # tokens a catch-up after plain steps passed over (0: none) ...
    catch_up_seconds: float = 0.0  # ... and its seconds
