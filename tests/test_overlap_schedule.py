"""Overlap scheduling of plain decoding (``--overlap-schedule``), end to end on the real SmolLM2.

On the CPU a forward returns when it is done, so nothing overlaps here; what these tests check is
the bookkeeping: the next step is planned and launched over tokens not yet read back (read on the
device), and what comes out is what the step-by-step engine gives, with admissions, chunked
prefill, stops, preemption and aborts in between."""

import pytest

from specserve import LLM, SamplingParams


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24),  # may stop at EOS
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0, max_tokens=20, stop=[" the"]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
    ]


def _run(chat_prompts, overlap: str, **kw):
    llm = LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, overlap_schedule=overlap, **kw)
    outs = llm.chat(chat_prompts[:8], _params())
    eng = llm.engine
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # nothing leaked
    return outs, eng


@pytest.fixture(scope="module")
def step_by_step(smollm2, chat_prompts):
    """The step-by-step engine's outputs (the session's, all 8 requests in one batch: batching, chunking,
    preemption and recompute give the same tokens, test_engine_e2e's batch invariance), the reference of
    both overlapped runs."""
    preempted = smollm2.engine.scheduler.num_preemptions
    outs = smollm2.chat(chat_prompts[:8], _params())
    assert not smollm2.engine.overlap and smollm2.engine.scheduler.num_preemptions == preempted
    return outs


@pytest.mark.parametrize("kv", ["roomy", "tight"])
def test_overlapped_steps_give_what_step_by_step_decoding_gives(chat_prompts, step_by_step, kv):
    """8 requests through 4 sequence slots (admissions while others decode), prompts chunked by a
    64-token budget, greedy / seeded sampling / logprobs / stop strings / EOS / max_tokens 1; "tight":
    a KV cache too small for 4 requests at once, so requests are preempted and recomputed."""
    kw = {"num_kv_blocks": 20, "enable_prefix_caching": False} if kv == "tight" else {"kv_cache_memory_gb": 0.25}
    plain = step_by_step
    over, eng = _run(chat_prompts, "on", **kw)
    assert eng.overlap
    if kv == "tight":
        assert eng.scheduler.num_preemptions > 0
    for a, b in zip(plain, over):
        oa, ob = a.outputs[0], b.outputs[0]
        assert (ob.token_ids, ob.text, ob.finish_reason, ob.stop_reason) == (
            oa.token_ids, oa.text, oa.finish_reason, oa.stop_reason)
        if oa.logprobs is not None:
            assert [list(d) for d in ob.logprobs] == [list(d) for d in oa.logprobs]
            assert all(abs(ob.logprobs[i][t] - v) < 1e-4 for i, d in enumerate(oa.logprobs) for t, v in d.items())
    assert [len(o.outputs[0].token_ids) for o in over][2] == 9 and len(over[7].outputs[0].token_ids) == 1
    # most steps were launched before the one before them was read back
    ahead = eng.runner.path_counts["launch:ahead"]
    assert ahead >= 0.8 * eng.stats.steps, (ahead, eng.stats.steps)
    assert eng.stats.generation_tokens == sum(len(o.outputs[0].token_ids) for o in over)


def test_an_abort_while_the_next_step_is_on_the_device(chat_prompts):
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.25, overlap_schedule="on")
    eng = llm.engine
    eng.add_request("a", "Tell me a long story about a dragon.", SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("b", "Count to ten.", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng._ahead is not None and any(s.req.request_id == "a" for s in eng._ahead[0].scheduled)
    eng.abort_request("a")  # its next token is being computed: dropped at commit
    done = []
    while eng.has_unfinished_requests():
        outs = eng.step()
        assert all(o.request_id == "b" for o in outs)
        done += [o for o in outs if o.finished]
    assert [o.request_id for o in done] == ["b"] and len(done[0].outputs[0].token_ids) == 8
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    # a later request is served normally (the step launched for finished requests is dropped)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_overlap_schedule_flag(smollm2):
    from specserve.config import EngineConfig

    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(overlap_schedule="sometimes")
    assert EngineConfig.from_kwargs(overlap_schedule="on", speculative_algorithm="EAGLE3").overlap_schedule == "on"
    import argparse

    from specserve.engine.args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).overlap_schedule == "auto"
    assert engine_config_from_args(p.parse_args(["--disable-overlap-schedule"])).overlap_schedule == "off"
    assert engine_config_from_args(p.parse_args(["--overlap-schedule", "on"])).overlap_schedule == "on"
    # auto: off on the CPU (nothing to overlap there)
    assert smollm2.engine.config.overlap_schedule == "auto" and not smollm2.engine.overlap


@pytest.fixture(scope="module")
def greedy40(smollm2, chat_prompts) -> list[list[int]]:
    """Plain decoding's 40 greedy tokens (ignore_eos) of the first 6 prompts, one batch: the spec tests' references
    (a shorter run's tokens are a prefix)."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].token_ids for o in smollm2.chat(chat_prompts[:6], sp)]


def test_a_spec_engine_overlaps_its_plain_steps_and_stays_lossless(greedy40, chat_prompts):
    """With speculation, a plain step whose successor is known before its sync to be plain (here the
    threshold policy: off above 2 running requests, on again at 1) launches that successor before the
    sync; drafting resumes as requests finish. Greedy tokens are plain decoding's."""
    convs = chat_prompts[:6]
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(6)]
    llm = LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_gb=0.25, overlap_schedule="on",
              speculative_algorithm="EAGLE3", speculative_policy="threshold", speculative_disable_batch_threshold=2)
    outs = llm.chat(convs, params)
    for a, b, sp in zip(greedy40, outs, params):
        assert b.outputs[0].token_ids == a[: sp.max_tokens]
    eng = llm.engine
    counts = eng.drafter.path_counts
    assert counts["plain_ahead"] > 10 and eng.stats.spec_steps > 0, (counts, eng.stats.spec_steps)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def _plain_and_adaptive(greedy40, chat_prompts):
    """Three prompts of 40 greedy tokens: their plain decoding's outputs, and an overlapped adaptive engine
    (depths 0-2, no start-up calibration) for a test to stub and run."""
    convs = chat_prompts[:3]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in convs]
    base = greedy40[:3]
    llm = LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_gb=0.25, overlap_schedule="on",
              speculative_algorithm="EAGLE3", speculative_policy="adaptive", speculative_num_steps=2,
              speculative_calibrate=False)
    return convs, params, base, llm


def _finished_cycles(ctl, row) -> list:
    """``row(cycle)`` of every cycle the controller finishes from now on."""
    finished: list = []
    orig = ctl._finish_cycle

    def finish(c, seconds):
        finished.append(row(c))
        orig(c, seconds)

    ctl._finish_cycle = finish
    return finished


def test_an_adaptive_engines_plain_decisions_are_taken_before_the_sync_and_launched_ahead(greedy40, chat_prompts):
    """Every adaptive decision is a table lookup taken before the sync: where the table says plain decoding
    the next step is launched ahead, explorations of a depth included; the table is stubbed to pick plain
    decoding and explore depth 2 (two cycles) every sixth decision. Tokens stay plain decoding's and each
    plain cycle counts its requests' tokens once."""
    convs, params, base, llm = _plain_and_adaptive(greedy40, chat_prompts)
    ctl = llm.engine.drafter.controller
    b = ctl.bandit
    calls = {"n": 0}

    def decide(key):
        calls["n"] += 1
        b.chosen[key] = 0
        return (2, True) if calls["n"] % 6 in (0, 1) else (0, False)

    b.decide = decide
    finished = _finished_cycles(ctl, lambda c: (c.arm, c.tokens, c.requests))
    outs = llm.chat(convs, params)
    for a, o in zip(base, outs):
        assert o.outputs[0].token_ids == a
    counts = llm.engine.drafter.path_counts
    plain = ctl.k_histogram[0] // 3  # (batches of three requests, bar the prompt's step)
    assert counts["plain_ahead"] >= plain // 2 > 5, (dict(counts), ctl.k_histogram)
    assert ctl.k_histogram[2] > 0 and llm.engine.stats.spec_steps > 0 and ctl.explorations > 0
    plain_cycles = [(t, n) for arm, t, n in finished if arm == 0]
    assert len(plain_cycles) > 10 and all(t == n > 0 for t, n in plain_cycles), plain_cycles
