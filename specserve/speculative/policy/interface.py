"""The policy's hooks: ``ks = controller.decide(Batch(...))`` (0 = plain decode) after a verify's sync, or
``controller.quick_arm(batch)`` before it (the arm every request drafts); outcomes through ``observe_many``,
``observe_step`` and ``finish_cycle``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    """The requests about to step, for ``decide``."""

    requests: list  # each with .request_id
    caps: list[int]  # most draft tokens each may take
    num_running: int
