"""The adaptive controller's cycle clock, from a decision to the next in the engine's clock; a full decision's
host time is left out and a verify's catch-up moved back to its cycle (docs/decisions.md)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from specserve.engine.gc_pauses import clock
from specserve.engine.request import Request
from specserve.speculative.policy.bandit import batch_key

CATCH_UP_TIMING_EVERY = 8  # steady catch-ups per one timed with device events (the adaptive policy on a GPU)


class CycleClock:
    def __init__(self, controller, engine, max_k: int, time_on_device: bool) -> None:
        self.controller, self.engine, self.max_k = controller, engine, max_k
        self.head: float | None = None  # seconds from the last decision to the end of its draft_step
        self.head_ended = 0.0  # clock() when ``head`` was taken
        self.drafted_last = False  # whether the last decision drafted for anyone
        self.time_on_device = time_on_device  # catch-ups timed to their end with device events
        self.marks: tuple[Any, Any] | None = None
        self.steady_s: dict[int, float] = {}  # seconds of a steady catch-up by rows (bucketed), averaged
        self.steady_count = 0
        self.catch_ups_timed = 0

    def reset(self) -> None:
        self.head = None
        self.drafted_last = False

    def close(self, now: float) -> tuple[Any, float]:
        """The open cycle (detached from the controller) and its seconds up to ``now``, or (None, 0)."""
        if self.head is None:
            return None, 0.0
        e = self.engine
        tail = max(e.step_ended - self.head_ended, 0.0)
        seconds = self.head + tail + now - e.step_started
        self.head = None
        return self.controller.detach_cycle(), seconds

    def open(self, now: float, left_out: float = 0.0) -> None:
        """The new decision's cycle so far: from ``now`` to here, less ``left_out`` seconds."""
        self.head_ended = clock()
        self.head = self.head_ended - now - left_out

    def unpaid_catch_up(self, candidates: list[Request]) -> float:
        """Predicted seconds of the catch-up over what the last verify committed, which plain decoding next
        does not run: charged to a drafting cycle followed by plain decoding as a drafting successor would."""
        if not self.drafted_last:
            return 0.0
        rows = sum(max(r.num_computed_tokens - r.spec.draft_pos, 0) for r in candidates
                   if r.spec is not None)
        if rows <= 0 or rows > len(candidates) * (self.max_k + 2):  # (a stretch of plain steps: no cycle's)
            return 0.0
        known = self.steady_s.get(batch_key(rows))
        return known if known is not None else self.controller.catch_up_seconds(rows)

    def draft(self, todo: list[tuple[Request, int]], catch_up: Callable[[list[Request]], torch.Tensor],
              propose: Callable[[list[tuple[Request, int]], torch.Tensor, bool], None], tree: bool) -> float:
        """Catch up and draft ``todo`` (chains, or trees), timing the catch-up; returns the seconds moved to
        the last cycle."""
        ctl = self.controller
        reqs = [r for r, _ in todo]
        caught_up = sum(r.num_computed_tokens - r.spec.draft_pos for r in reqs)
        prompt_rows = sum(max(min(r.num_computed_tokens, r.num_prompt_tokens) - r.spec.draft_pos, 0) for r in reqs)
        usual = caught_up <= len(todo) * (self.max_k + 2)  # what a verify commits, no stretch of plain steps
        steady = self.drafted_last and usual
        rows_key = batch_key(caught_up)
        known = self.steady_s.get(rows_key)
        timed = self.time_on_device and (not steady or known is None
                                         or self.steady_count % CATCH_UP_TIMING_EVERY == 0)
        t0 = clock()
        if timed:  # events read once the drafts are back (that wait is needed anyway)
            if self.marks is None:
                self.marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.marks[0].record()
            self.catch_ups_timed += 1
        h = catch_up(reqs)
        if timed:
            self.marks[1].record()
        catch_up_s = clock() - t0
        propose(todo, h, tree)
        if timed:
            self.marks[1].synchronize()
            catch_up_s = max(catch_up_s, self.marks[0].elapsed_time(self.marks[1]) / 1e3)
        if steady:
            self.steady_count += 1
            if self.time_on_device and not timed:
                catch_up_s = known
            elif timed or self.engine.device.type != "cuda":  # (a CPU's forward returns when done)
                self.steady_s[rows_key] = catch_up_s if known is None else 0.8 * known + 0.2 * catch_up_s
        if usual and not tree:  # (a tree's forwards grow wider: not one batch's draft step)
            ctl.observe_draft(len(todo), max(k for _, k in todo), clock() - t0)
        elif not self.drafted_last:  # a switch out of plain decoding: not what this depth costs per cycle
            ctl.skip_cycle()
            ctl.observe_catch_up(caught_up, catch_up_s)
        if not self.drafted_last:
            return 0.0
        # the share replaying what the last verify committed (the rest is the head's pass over new prompts)
        return catch_up_s * (max(caught_up - prompt_rows, 0) / caught_up if caught_up > 0 else 1.0)
