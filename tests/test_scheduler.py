from specserve.config import EngineConfig
from specserve.engine.kv_cache import BlockManager
from specserve.engine.request import Request, Status
from specserve.engine.scheduler import CommitResult, Scheduler
from specserve.sampling_params import SamplingParams


def _sched(num_blocks=64, budget=32, max_seqs=8, block_size=4):
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=block_size,
                       num_kv_blocks=num_blocks)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len=10_000, eos_token_ids={0})


def _req(i, n, max_tokens=8):
    return Request(f"r{i}", None, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))


def _commit(s, plan, tok=5):
    res = CommitResult(token_ids=[[tok] for x in plan.scheduled if x.samples])
    return s.commit(plan, res, lambda r: None)


def test_budget_and_chunked_prefill():
    s = _sched(budget=10)
    a, b = _req(0, 7), _req(1, 7)
    s.add(a), s.add(b)
    plan = s.schedule()
    assert [(x.req.request_id, x.num_new_tokens) for x in plan.scheduled] == [("r0", 7), ("r1", 3)]
    assert plan.num_tokens == 10
    _commit(s, plan)
    assert a.output_token_ids == [5] and b.output_token_ids == [] and b.num_computed_tokens == 3
    plan = s.schedule()
    # a decodes 1 token, b finishes its prefill with the remaining 4
    assert [(x.req.request_id, x.num_new_tokens, x.samples) for x in plan.scheduled] == [
        ("r0", 1, True), ("r1", 4, True)]


def test_max_num_seqs_caps_running():
    s = _sched(max_seqs=2, budget=100)
    for i in range(4):
        s.add(_req(i, 3))
    plan = s.schedule()
    assert len(plan.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_when_blocks_run_out_then_recompute():
    s = _sched(num_blocks=4, budget=100, block_size=4)
    a, b = _req(0, 7, max_tokens=8), _req(1, 7, max_tokens=8)
    s.add(a), s.add(b)
    plan = s.schedule()
    assert len(plan.scheduled) == 2  # 2 blocks each
    _commit(s, plan)  # each now has 8 tokens, 7 computed
    plan = s.schedule()
    _commit(s, plan)  # token 8 fills block 2; both now need a third block
    plan = s.schedule()
    assert plan.preempted == [b] and b.status == Status.WAITING and b.num_computed_tokens == 0
    assert [x.req for x in plan.scheduled] == [a]
    assert s.blocks.num_free_blocks == 1
    _commit(s, plan)
    # b is readmitted as soon as blocks allow, recomputing prompt + generated tokens;
    # its 2 full blocks were cached when it was preempted, so they are found again
    hits = s.blocks.stats.prefix_hits
    while s.has_unfinished():
        _commit(s, s.schedule())
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert b.metrics.num_preemptions >= 1 and s.blocks.stats.prefix_hits - hits >= 8
    assert s.blocks.num_free_blocks == 4


def test_stop_on_eos_and_length_frees_blocks():
    s = _sched()
    a = _req(0, 3, max_tokens=2)
    s.add(a)
    _commit(s, s.schedule())
    _commit(s, s.schedule())
    assert a.finish_reason == "length" and s.blocks.num_free_blocks == 64
    b = _req(1, 3)
    s.add(b)
    _commit(s, s.schedule(), tok=0)
    assert b.finish_reason == "stop" and b.stop_reason is None  # EOS: no stop reason, as vLLM
    c = Request("r2", None, [1, 2, 3], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[7]))
    s.add(c)
    _commit(s, s.schedule(), tok=7)
    assert c.finish_reason == "stop" and c.stop_reason == 7  # a stop token: its id


def test_prefix_cache_hit_skips_computed_blocks():
    s = _sched(block_size=4)
    a = _req(0, 9, max_tokens=1)
    s.add(a)
    _commit(s, s.schedule())
    assert a.is_finished
    b = _req(1, 9)
    s.add(b)
    plan = s.schedule()
    assert plan.scheduled[0].num_new_tokens == 1 and b.metrics.num_cached_tokens == 8


def test_prefix_blocks_without_draft_kv_are_taken_from_where_their_draft_kv_ends():
    """With speculation a prompt served while nobody drafted left blocks without draft KV: the next
    request takes them all and its draft KV starts at the first block lacking it (the head catches up)."""

    def served_then_same_prompt(ready: int):
        s = _sched(block_size=4)
        s.blocks.require_draft_kv = True
        a = _req(0, 9, max_tokens=1)
        s.add(a)
        _commit(s, s.schedule())
        assert a.is_finished
        cached = [b for b in range(64) if s.blocks.blocks[b].block_hash is not None]
        s.blocks.mark_draft_ready(cached[:ready])  # as the head's catch-up marks them
        b = _req(1, 9)
        s.add(b)
        plan = s.schedule()
        return plan.scheduled[0].num_new_tokens, b

    for ready, want in ((0, 0), (1, 4), (2, None)):
        n, b = served_then_same_prompt(ready)
        assert n == 1 and b.metrics.num_cached_tokens == 8 and b.draft_kv_tokens == want


# -- overlap scheduling: the next step planned before this one's tokens are back ------------------
def test_advance_lets_the_next_step_be_planned_over_pending_tokens():
    from specserve.engine.request import PENDING_TOKEN

    s = _sched(budget=100, block_size=4)
    a, b = _req(0, 4, max_tokens=3), _req(1, 5, max_tokens=1)
    s.add(a), s.add(b)
    plan = s.schedule()
    s.advance(plan)
    # both computed their prompts; each holds a placeholder for the token being sampled
    assert a.num_computed_tokens == 4 and a.all_token_ids[-1] == PENDING_TOKEN and a.num_pending_tokens == 1
    assert b.num_computed_tokens == 5 and b.num_pending_tokens == 1
    nxt = s.schedule()
    # a decodes its pending token; b's is its last (max_tokens=1): nothing to compute for it
    assert [(x.req, x.num_new_tokens, x.samples) for x in nxt.scheduled] == [(a, 1, True)]
    # a's pending token is at position 4: the next step needed a second block, which commit keeps
    assert len(a.kv.block_table) == 2
    s.commit(plan, CommitResult(token_ids=[[7], [8]]), lambda r: None)
    assert a.all_token_ids == [1, 2, 3, 4, 7] and a.num_pending_tokens == 0 and len(a.kv.block_table) == 2
    assert a.num_computed_tokens == 4
    assert b.is_finished and b.finish_reason == "length" and b.output_token_ids == [8]
    s.advance(nxt)
    assert a.num_computed_tokens == 5 and a.all_token_ids[-1] == PENDING_TOKEN
    s.commit(nxt, CommitResult(token_ids=[[0]]), lambda r: None)  # EOS
    assert a.is_finished and a.output_token_ids == [7, 0]
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_a_request_aborted_after_its_step_was_launched_is_skipped_at_commit():
    s = _sched(budget=100)
    a, b = _req(0, 3), _req(1, 3)
    s.add(a), s.add(b)
    plan = s.schedule()
    s.advance(plan)
    nxt = s.schedule()
    s.commit(plan, CommitResult(token_ids=[[5], [6]]), lambda r: None)
    s.finish(a, "abort")  # between the launch of nxt and its commit
    s.advance(nxt)
    touched = s.commit(nxt, CommitResult(token_ids=[[9], [10]]), lambda r: None)
    assert touched == [b] and b.output_token_ids == [6, 10] and a.output_token_ids == [5]


def test_commit_counts_the_sampling_requests_that_run_on():
    # a, b and c prefilled in one plan, advanced; scheduling past it preempts c (b's next block took its
    # blocks) and b's token is EOS: only a decodes next (the drafter counts a plain decision's requests so)
    s = _sched(num_blocks=4, budget=100, block_size=4)
    a, b, c = _req(0, 4), _req(1, 4), _req(2, 3)
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    s.advance(plan)
    nxt = s.schedule()
    assert nxt.preempted == [c]
    s.commit(plan, CommitResult(token_ids=[[7], [0], [8]]), lambda r: None)
    assert b.is_finished and c.status == Status.WAITING
    decoding = [x.req for x in plan.scheduled if x.samples and not x.req.is_finished
                and x.req.num_tokens - x.req.num_computed_tokens == 1]
    assert decoding == [a] and plan.num_running_on == 1


def test_a_step_with_drafts_cannot_be_advanced():
    import pytest

    s = _sched(budget=100)
    a = _req(0, 3)
    s.add(a)
    _commit(s, s.schedule())
    a.draft_token_ids = [4, 4]
    plan = s.schedule()
    with pytest.raises(ValueError, match="drafts"):
        s.advance(plan)


def test_a_plan_counts_the_drafts_it_verifies_as_the_budget_leaves_them():
    s = _sched(budget=6)
    a, b = _req(0, 3), _req(1, 3)
    s.add(a), s.add(b)
    plan = s.schedule()
    assert plan.num_drafts == 0 and plan.num_tokens == 6  # prefills
    _commit(s, plan)
    a.draft_token_ids, b.draft_token_ids = [4, 4, 4], [4, 4, 4]
    plan = s.schedule()
    # a: 1 token + 3 drafts; b: 1 token + the 1 draft the budget of 6 leaves
    assert [len(x.draft_token_ids) for x in plan.scheduled] == [3, 1]
    assert plan.num_drafts == 4 == sum(len(x.draft_token_ids) for x in plan.scheduled)
    assert plan.num_tokens == 6 == sum(x.num_query_tokens for x in plan.scheduled)
