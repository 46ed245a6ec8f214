"""EAGLE speculation on the real SmolLM2: greedy output is token-for-token the no-spec output."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.drafter import DEFAULT_HEAD

SHIPPED = (DEFAULT_HEAD / "config.json").exists()
CHAIN = dict(speculative_num_steps=3)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SP8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SP4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# KV for ~5k tokens (the default 2 GB, ~45k, costs 1-3 s of zeroing per engine) where a test's
# prompts need far less (no test here evicts from it)
SMALL_KV = dict(dtype="float32", kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    torch.manual_seed(0)
    mc = load_model_source(None).config
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=8192))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
        head.d2t.zero_()
        head.t2d[:8192] = True
    path = str(tmp_path_factory.mktemp("head"))
    head.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(smollm2, chat_prompts):
    return [o.outputs[0].token_ids for o in smollm2.chat(chat_prompts, SP)]


def heads(random_head):
    return [random_head] + ([str(DEFAULT_HEAD)] if SHIPPED else [])


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_lossless_batch8_with_preemption(random_head, reference, chat_prompts, shape):
    # the last 10 prompts (32-106 tokens), 8 tokens each, in 40 blocks of 4: 1-2 preemptions per head and shape.
    # The random head (every draft rejected) on the chain; the shipped one (drafts accepted and rejected) on both
    for head in heads(random_head)[1 if shape is TREE and SHIPPED else 0 :]:
        llm = LLM(dtype="float32", max_num_seqs=8, num_kv_blocks=40, block_size=4, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=head, speculative_policy="static", **shape)
        out = [o.outputs[0].token_ids for o in llm.chat(chat_prompts[10:], SP8)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert out == [r[:8] for r in reference[10:]], f"head {head}"
        if head != random_head:
            st = llm.engine.get_stats()
            assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_lossless_batch1(random_head, reference, chat_prompts, shape):
    # the shipped head (drafts accepted and rejected; the random head's all-rejected drafts are the
    # batch-8 test's), the random one where it is not in the tree
    head = heads(random_head)[-1]
    llm = LLM(max_num_seqs=1, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="static", **SMALL_KV, **shape)
    outs = llm.chat(chat_prompts[:2], SP)
    assert [o.outputs[0].token_ids for o in outs] == reference[:2], f"head {head}"
    m = outs[0].metrics
    assert m.spec_verify_steps > 0 and m.spec_draft_tokens >= m.spec_verify_steps
    if head != random_head:
        st = llm.engine.get_stats()
        assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens  # both accepted and rejected drafts


def test_a_tree_engines_chain_and_tree_arms_are_lossless(random_head, reference, chat_prompts):
    """A tree engine under the adaptive policy drafts, per decision, a chain (arms 1..K) or its whole tree
    (K + 1): forced to a chain, then to the tree, greedy output is no-spec's token for token, and each
    drafted as it should (the shipped head: drafts accepted and rejected)."""
    llm = LLM(max_num_seqs=2, speculative_algorithm="EAGLE3", speculative_draft_model_path=heads(random_head)[-1],
              **SMALL_KV, **TREE)
    ctl = llm.engine.drafter.controller
    K, nodes = TREE["speculative_num_steps"], TREE["speculative_num_draft_tokens"] - 1
    for arm, k in ((2, 2), (K + 1, nodes)):
        ctl.forced_arm = arm
        before = dict(ctl.k_histogram)
        outs = llm.chat(chat_prompts[2:4], SP)
        assert [o.outputs[0].token_ids for o in outs] == reference[2:4], arm
        drafted = {j: n - before.get(j, 0) for j, n in ctl.k_histogram.items() if n > before.get(j, 0)}
        assert drafted.get(k, 0) > 4 and set(drafted) <= {0, 1, k}, (arm, drafted)  # (1: the last tokens' caps)


@pytest.fixture(scope="module")
def adaptive_random(random_head):
    """An adaptive engine drafting with the random head (one start-up cost profile for the module)."""
    return LLM(max_num_seqs=8, speculative_algorithm="EAGLE3", speculative_draft_model_path=random_head, **SMALL_KV)


def test_adaptive_turns_a_useless_head_off(adaptive_random, reference, chat_prompts):
    llm = adaptive_random
    out = [o.outputs[0].token_ids for o in llm.chat(chat_prompts, SP)]
    assert out == reference
    # a random head is never accepted: once the controller has measured its depths (the first
    # run: every batch size is new to it) it stops drafting
    before = dict(llm.engine.get_stats().k_histogram)
    assert [o.outputs[0].token_ids for o in llm.chat(chat_prompts, SP)] == reference
    hist = {k: v - before.get(k, 0) for k, v in llm.engine.get_stats().k_histogram.items()}
    assert hist.get(0, 0) > 3 * sum(v for k, v in hist.items() if k > 0), hist
    # and it decided by measurement: most decisions' cycles were timed and went to the bandit
    snap = llm.engine.drafter.controller.snapshot()
    assert snap["cycles"] > snap["decisions"] // 2, (snap["cycles"], snap["decisions"])
    assert any(0 in arms for arms in snap["measured_goodput"].values())


def test_a_garbage_collection_pause_is_left_out_of_the_cycle_it_lands_in(adaptive_random, chat_prompts):
    """A full collection over a large heap inside one step: the adaptive controller's cycle that
    holds it is measured without it (it is the process's pause, not the draft depth's)."""
    import gc
    import statistics

    from specserve.engine import gc_pauses

    llm = adaptive_random
    ctl, runner = llm.engine.drafter.controller, llm.engine.runner
    forward, finish_cycle = runner.forward, ctl.finish_cycle
    calls, paused, timed = [0], [], []
    heap = [[i] for i in range(4_000_000)]  # what the collection walks (~0.3-0.6 s: well over a busy cycle)

    def slow_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 6:  # a decode step, well after the prompts' prefill
            before = gc_pauses.pause_seconds()
            gc.collect()
            paused.append(gc_pauses.pause_seconds() - before)
        return forward(*args, **kwargs)

    others = []

    def record(cycle, seconds):
        if cycle is not None:
            if paused and len(timed) < len(paused):
                timed.append(seconds)  # the first cycle ended after the pause: the one holding it
            else:
                others.append(seconds)
        return finish_cycle(cycle, seconds)

    runner.forward, ctl.finish_cycle = slow_forward, record
    try:
        llm.chat(chat_prompts[:4], SP)
    finally:
        del runner.forward, ctl.finish_cycle  # (the shared engine's own methods again)
    del heap
    assert paused and paused[0] > 0.1, paused
    # over the other cycles' median (a cycle on two busy CPU cores can itself take ~0.1 s, as long as
    # the pause: compared with the pause alone, that failed once)
    assert timed and others and timed[0] - statistics.median(others) < 0.5 * paused[0], (timed, others, paused)


@pytest.fixture(scope="module")
def static_random(random_head):
    return LLM(max_num_seqs=2, speculative_algorithm="EAGLE3", speculative_draft_model_path=random_head,
               speculative_policy="static", **SMALL_KV)


def test_per_request_cap_disables_speculation(static_random, chat_prompts):
    llm = static_random
    sp = SamplingParams(temperature=0, max_tokens=8, max_spec_tokens=0)
    m = llm.chat(chat_prompts[3:4], sp)[0].metrics  # (not among the prefix-cache test's prompts)
    assert m.spec_verify_steps == 0 and m.spec_draft_tokens == 0


def test_prefix_cache_while_speculation_is_off(random_head, static_random, reference, chat_prompts):
    """Prompts served while speculation is off leave cached blocks without draft KV. The same
    prompts again, still off, reuse them (and those requests never draft); an engine that drafts
    gets its blocks' draft KV from the catch-up and reuses them while drafting."""
    prompts = chat_prompts[:3]  # more than max_num_seqs: one waits for the others
    reference = [r[:4] for r in reference[:3]]  # 4 greedy tokens (ignore_eos: a prefix of the 16)
    off = LLM(max_num_seqs=2, speculative_algorithm="EAGLE3", speculative_draft_model_path=random_head,
              speculative_policy="threshold", speculative_disable_batch_threshold=0, **SMALL_KV)
    assert [o.outputs[0].token_ids for o in off.chat(prompts, SP4)] == reference
    again = off.chat(prompts, SP4)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert all(o.metrics.num_cached_tokens > 0 for o in again)  # before: 0, the blocks lacked draft KV
    assert off.engine.get_stats().spec_draft_tokens == 0

    on = static_random
    on.chat(prompts, SP4)
    again = on.chat(prompts, SP4)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert all(o.metrics.num_cached_tokens > 0 for o in again)
    assert all(o.metrics.spec_draft_tokens > 0 for o in again)  # reused blocks with draft KV: they draft


def test_cached_blocks_without_draft_kv_are_taken_and_the_head_catches_up_over_them(chat_prompts):
    """A request that never drafts (max_spec_tokens 0) leaves its prompt's blocks cached without draft KV.
    The same prompt, drafting, takes them (no target recompute) and the head catches up over them from the
    features kept at their slots: it drafts and accepts exactly what it does with nothing cached. The engines
    name no head and no depth: the shipped head is the default, and accepts (over 1.5 tokens a verify)."""
    conv = chat_prompts[2]
    seen = {}
    for cached in (True, False):
        llm = LLM(max_num_seqs=4, speculative_algorithm="EAGLE3", speculative_policy="static", **SMALL_KV)
        if cached:
            sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, max_spec_tokens=0)
            assert llm.chat([conv], sp)[0].metrics.spec_draft_tokens == 0
        out = llm.chat([conv], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        m = out.metrics
        bs = llm.engine.config.block_size
        assert m.num_cached_tokens == ((len(out.prompt_token_ids) - 1) // bs * bs if cached else 0)
        assert m.spec_draft_tokens > 0 and (m.spec_accepted_tokens + m.spec_verify_steps) / m.spec_verify_steps > 1.5
        seen[cached] = (out.outputs[0].token_ids, m.spec_draft_tokens, m.spec_accepted_tokens, m.spec_verify_steps)
        del llm
    assert seen[True] == seen[False]
