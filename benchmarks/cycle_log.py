"""What an adaptive engine's bandit measures, cycle by cycle, beside the engine's own time.

The bandit (specserve/speculative/policy/bandit.py) ranks draft depths by the wall time of each decision's
cycle: from one decision (in ``draft_step``) to the next, less what the drafter leaves out (the
time between engine steps, a full decision's host time, the finished requests' catch-up) and less
the prompt tokens' predicted share. ``CycleLog`` records every finished cycle as the controller
saw it and, per engine step, when the step and its ``draft_step`` started and ended, so that each
cycle's measure can be set against the engine's own time over the same stretch (everything inside
``LLMEngine.step`` from one decision to the next: what a user of that engine waits for).

    log = CycleLog.start(llm); ...serve...; log.detach(); log.summary()
"""

from __future__ import annotations

import collections
import time
from typing import Any

from specserve import LLM
from specserve.speculative.policy.bandit import bucket_batch


class CycleLog:
    def __init__(self, llm: LLM) -> None:
        d = llm.engine.drafter
        if d is None or d.cfg.policy != "adaptive":
            raise ValueError("CycleLog needs an engine with the adaptive policy")
        self.engine, self.drafter, self.ctl, self.bandit = llm.engine, d, d.controller, d.controller.bandit
        self.cycles: list[list[Any]] = []  # as the bandit got them: [bucket, arm, tokens, seconds, requests, measured]
        self.decisions: list[list[Any]] = []  # [bucket, visit, batch, arm, exploring, {arm: [goodput, stderr]}]
        # every finished cycle before the prompt share is taken out: [bucket, arm, tokens, seconds, prompt
        # share (s), measured, draft_step calls started when its bookkeeping ran, exploring, requests whose
        # drafts were launched before the sync (fused)]
        self.raw: list[list[Any]] = []
        # per engine.step: [start, draft_step start (-1: none), end, target tokens, requests, target s, prompt tokens]
        self.steps: list[list[float]] = []
        self.draft_calls: list[int] = []  # the step index of each draft_step call
        self._before: list[tuple[Any, str, Any]] = []

    @classmethod
    def start(cls, llm: LLM) -> "CycleLog | None":
        """A log attached to ``llm``'s engine, or None where it has no adaptive controller."""
        d = llm.engine.drafter
        if d is None or d.cfg.policy != "adaptive":
            return None
        log = cls(llm)
        log.attach()
        return log

    def attach(self) -> None:
        eng, d, ctl, bandit = self.engine, self.drafter, self.ctl, self.bandit
        targets = ((bandit, "observe"), (bandit, "charge"), (bandit, "choose"), (ctl, "_finish_cycle"),
                   (ctl, "observe_step"), (d, "draft_step"), (eng, "step"))
        # what was there before (an instance attribute: another tool's wrapper), put back by detach
        self._before = [(obj, name, obj.__dict__.get(name)) for obj, name in targets]
        observe, charge, choose = bandit.observe, bandit.charge, bandit.choose
        finish, observe_step, draft_step, step = ctl._finish_cycle, ctl.observe_step, d.draft_step, eng.step

        def chosen(key: int, priors: dict, batch: int = 1, switch_s: float = 0.0) -> tuple[int, bool]:
            est = bandit.estimates(key, priors, batch)  # pure: what choose weighs next
            visit = bandit.visits.get(key, 0)
            arm, exploring = choose(key, priors, batch, switch_s)
            self.decisions.append([key, visit, batch, arm, int(exploring),
                                   {a: [round(g, 1), round(se, 1)] for a, (g, se) in est.items()}])
            return arm, exploring

        def observed(key: int, arm: int, predicted: float, tokens: float, seconds: float, requests: int = 1,
                     *rest: Any) -> None:
            self.cycles.append([key, arm, tokens, round(seconds, 6), requests, 1])
            observe(key, arm, predicted, tokens, seconds, requests, *rest)

        def charged(key: int, arm: int, tokens: float, seconds: float) -> None:
            self.cycles.append([key, arm, tokens, round(seconds, 6), 0, 0])
            charge(key, arm, tokens, seconds)

        def finished(c: Any, seconds: float) -> None:
            # a cycle decided in draft_step call i is finished in call i + 1, its bookkeeping run there or
            # (deferred, on a GPU) at the next verify's flush: before call i + 2 starts either way
            self.raw.append([c.key, c.arm, c.tokens, round(seconds, 6), round(c.prefill_seconds, 6), int(c.measured),
                             len(self.draft_calls), int(c.exploring), c.launched_early])
            finish(c, seconds)

        def stepped(num_tokens: int, num_seqs: int, seconds: float, prefill_tokens: int = 0, decode_rows: int = 0,
                    own_time: bool = True) -> None:
            if self.steps:
                self.steps[-1][3:7] = [num_tokens, num_seqs, round(seconds, 6), prefill_tokens]
            observe_step(num_tokens, num_seqs, seconds, prefill_tokens, decode_rows, own_time)

        def drafting(plan: Any, result: Any) -> None:
            self.steps[-1][1] = time.perf_counter()
            self.draft_calls.append(len(self.steps) - 1)
            draft_step(plan, result)

        def stepping() -> Any:
            row = [time.perf_counter(), -1.0, 0.0, 0, 0, 0.0, 0]
            self.steps.append(row)
            out = step()
            row[2] = time.perf_counter()
            return out

        bandit.observe, bandit.charge, bandit.choose = observed, charged, chosen
        ctl._finish_cycle, ctl.observe_step, d.draft_step, eng.step = finished, stepped, drafting, stepping

    def detach(self) -> None:
        for obj, name, old in reversed(self._before):
            if old is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)
        self._before = []

    def own_seconds(self, calls: int) -> float | None:
        """The engine's own time (inside its steps) from the decision of draft_step call ``calls`` - 2
        to that of call ``calls`` - 1: the whole of the cycle a raw entry with this count measured."""
        if calls < 2 or calls > len(self.draft_calls):
            return None
        a, b = self.draft_calls[calls - 2], self.draft_calls[calls - 1]
        s = self.steps
        if s[a][2] <= 0 or s[b][1] < 0:
            return None
        return (s[a][2] - s[a][1]) + sum(s[i][2] - s[i][0] for i in range(a + 1, b)) + (s[b][1] - s[b][0])

    def summary(self, min_cycles: int = 3) -> dict[str, Any]:
        """Per bucket (its batch size) and arm: cycles, tokens per cycle, and per cycle the engine's own
        ms, the raw measure's ms (x own), the prompt share taken out, and tok/s by each (the bandit's:
        measured cycles after the prompt share, as it counts them); the shares of its cycles that
        explored and whose drafts were launched before the sync, and the raw tok/s of the latter."""
        by: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
        covered = 0.0
        for key, arm, tokens, sec, pf, measured, calls, exploring, early in self.raw:
            own = self.own_seconds(calls)
            if own is None or own <= 0:
                continue
            covered += own
            b = by[(key, arm)]
            b["n"] += 1
            b["exploring"] += exploring
            if early:
                b["fused"] += 1
                b["f_tokens"] += tokens
                b["f_raw"] += sec
            b["tokens"] += tokens
            b["own"] += own
            b["raw"] += sec
            b["prompt_s"] += pf
            if measured and pf <= self.ctl.policy.prefill_share_limit * sec:
                b["measured"] += 1
                b["m_tokens"] += tokens
                b["m_s"] += max(sec - pf, 0.2 * sec)
        out: dict[str, Any] = {}
        for (key, arm), b in sorted(by.items()):
            if b["n"] < min_cycles:
                continue
            out.setdefault(str(bucket_batch(key)), {})[str(arm)] = {
                "cycles": b["n"], "tokens_per_cycle": round(b["tokens"] / b["n"], 1),
                "own_ms": round(1e3 * b["own"] / b["n"], 3), "raw_ms": round(1e3 * b["raw"] / b["n"], 3),
                "raw_over_own": round(b["raw"] / b["own"], 3), "prompt_ms": round(1e3 * b["prompt_s"] / b["n"], 3),
                "tok_s_own": round(b["tokens"] / b["own"], 1), "tok_s_raw": round(b["tokens"] / b["raw"], 1),
                "tok_s_bandit": round(b["m_tokens"] / b["m_s"], 1) if b["m_s"] > 0 else None,
                "measured_share": round(b["measured"] / b["n"], 3),
                "exploring_share": round(b["exploring"] / b["n"], 3), "fused_share": round(b["fused"] / b["n"], 3),
                "tok_s_raw_fused": round(b["f_tokens"] / b["f_raw"], 1) if b["f_raw"] > 0 else None}
        steps = [s for s in self.steps if s[2] > 0]
        total = sum(s[2] - s[0] for s in steps)
        return {"by_bucket": out, "engine_steps": len(steps), "engine_s": round(total, 4),
                "cycles_own_s": round(covered, 4), "cycles_raw_s": round(sum(r[3] for r in self.raw), 4)}

    def logs(self) -> dict[str, Any]:
        return {"cycles": self.cycles, "decisions": self.decisions, "cycles_raw": self.raw,
                "steps": [[round(x, 6) if isinstance(x, float) else x for x in s] for s in self.steps],
                "draft_calls": self.draft_calls}
