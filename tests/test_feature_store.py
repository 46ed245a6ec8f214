"""The drafter keeps the target's features of every computed token by KV slot (``features``): a
plain step writes all its rows, a verify step the rows it keeps (the accepted drafts' at the slots
of the positions they are committed at), and a catch-up reads them back by slot. Checked against
the features of one prefill over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.catch_up import catch_up_slots
from tiny_model import make_random_head, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("feature_store")
    model = make_tiny_model(str(d / "model"), vocab=64, logit_scale=3.0)
    head = make_random_head(model, str(d / "head"), std=0.3)  # some drafts accepted, some not
    return model, head


# KV for ~50k tokens of the tiny model (the default 2 GB budget is ~2M: 2-3 s of zeroing per engine)
KV_GB = 0.05


def spec_llm(model: str, head: str, **kw) -> LLM:
    return LLM(model=model, device="cpu", dtype="float32", max_num_seqs=4, block_size=4, speculative_algorithm="EAGLE3",
               speculative_draft_model_path=head, speculative_num_steps=3, kv_cache_memory_gb=KV_GB, **kw)


def stored(llm: LLM, req, n: int) -> torch.Tensor:
    """The feature rows kept for positions 0..n-1 of ``req``."""
    d = llm.engine.drafter
    _, slots = catch_up_slots([req], [0], [n], llm.engine.config.block_size)
    return d.features.features[torch.as_tensor(slots)]


def reference(model: str, head: str, tokens: list[int]) -> torch.Tensor:
    """Features of ``tokens`` from one prefill of them: the target forward's own output (a fresh
    engine, speculation off), not what the drafter kept of it."""
    llm = spec_llm(model, head, speculative_policy="threshold", speculative_disable_batch_threshold=0)
    runner = llm.engine.runner
    forward, outs = runner.forward, []
    # (copies always: the outputs are read after the step)
    runner.forward = lambda inputs, copy=True: (outs.append(forward(inputs)), outs[-1])[1]
    llm.engine.add_request("ref", tokens, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.step()
    return outs[0][1][: len(tokens)]


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
SP60 = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def future(tiny) -> dict[str, list[int]]:
    """Plain decoding's 60 greedy tokens of each of PROMPTS, by request id."""
    plain = LLM(dtype="float32", model=tiny[0], device="cpu", max_num_seqs=4, block_size=4, kv_cache_memory_gb=KV_GB)
    return {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(plain.generate(PROMPTS, SP60))}


@pytest.mark.parametrize("in_forward", [True, False], ids=["written_by_the_forward", "scattered_after_it"])
@pytest.mark.parametrize("policy", ["static", "tree", "off"])
def test_kept_features_are_the_targets_at_each_position(tiny, future, policy, in_forward):
    model, head = tiny
    kw = {"static": dict(speculative_policy="static"),
          # trees: accepted nodes off the first branch move up to the slots after the root (_compact)
          "tree": dict(speculative_policy="static", speculative_eagle_topk=4, speculative_num_draft_tokens=8),
          "off": dict(speculative_policy="threshold", speculative_disable_batch_threshold=0)}[policy]
    llm = spec_llm(model, head, **kw)
    prompts, sp = PROMPTS, SP60
    d = llm.engine.drafter
    fs = d.features
    assert fs.in_forward and d.target.feature_sink is fs.features  # EAGLE-3: the forward writes them
    if not in_forward:  # the drafter's own scatter after each forward (EAGLE heads)
        d.target.set_feature_sink(None)
        fs.in_forward = False
    propose = d.proposer.propose

    def two_right_then_wrong(todo, h, tree):
        # (a random head's drafts are seldom accepted: the greedy continuation's next two tokens, then
        # a wrong one, so that every verify keeps some drafts' rows and drops others)
        propose(todo, h, tree)
        for r, k in todo:
            nxt = future[r.request_id][r.num_output_tokens :]
            r.draft_token_ids = (nxt[:2] + [(nxt[2] + 1) % 64 if len(nxt) > 2 else 0])[:k]

    if policy != "tree":  # (a tree's own candidates: with 4 per node some are accepted)
        d.proposer.propose = two_right_then_wrong
    moved = []
    compact = d._compact
    d._compact = lambda trees: (moved.extend(p != list(range(1, len(p) + 1)) for _, p in trees), compact(trees))[1]
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, sp)
    for _ in range(20):
        llm.engine.step()
    st = llm.engine.stats
    if policy != "off":
        assert st.spec_accepted_tokens > 0 and st.spec_draft_tokens > st.spec_accepted_tokens  # both kinds of row
        assert any(moved) or policy != "tree"
    else:
        assert st.spec_draft_tokens == 0
    assert fs.in_forward == in_forward
    assert_features_are_the_targets(llm, model, head, prompts, more_than=15)


def assert_features_are_the_targets(llm: LLM, model: str, head: str, prompts: list[list[int]], more_than: int) -> None:
    for i in range(len(prompts)):
        req = llm.engine.requests[f"r{i}"]
        n = req.num_computed_tokens  # (the last committed token has no KV, nor a feature, yet)
        assert n > len(prompts[i]) + more_than
        torch.testing.assert_close(stored(llm, req, n), reference(model, head, req.all_token_ids[:n]),
                                   atol=1e-4, rtol=1e-4)


def test_catch_up_slots_are_the_block_tables(tiny):
    model, head = tiny
    llm = spec_llm(model, head, speculative_policy="static")
    d = llm.engine.drafter
    reqs = []
    for i, p in enumerate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8], [10, 11, 12, 13, 14, 15]]):
        llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        reqs.append(llm.engine.requests[f"r{i}"])
    llm.engine.step()
    starts, q_lens = [2, 0, 5], [6, 2, 1]
    bs = llm.engine.config.block_size
    positions, slots = catch_up_slots(reqs, starts, q_lens, bs)
    want_pos = [p for a, q in zip(starts, q_lens) for p in range(a, a + q)]
    assert positions.tolist() == want_pos
    owner = [r for r, q in zip(reqs, q_lens) for _ in range(q)]
    assert slots.tolist() == [r.kv.block_table[p // bs] * bs + p % bs for r, p in zip(owner, want_pos)]
    assert slots.dtype == np.int64


def test_catch_up_of_a_request_that_stopped_inside_its_accepted_drafts(tiny):
    """A stop inside the drafts a verify accepted leaves the request's KV ahead of its last token
    (commit advances num_computed_tokens by every accepted draft before it appends them): its
    catch-up covers the positions whose next token is known, no further."""
    model, head = tiny
    llm = spec_llm(model, head, speculative_policy="static")
    llm.engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        llm.engine.step()
    d = llm.engine.drafter
    r = llm.engine.requests["r"]
    st = r.spec
    assert st.draft_pos == r.num_computed_tokens == r.num_tokens - 1  # caught up by the last draft step
    st.draft_pos -= 3  # three positions behind, as after a verify
    r.num_computed_tokens += 2  # and two more accepted drafts computed, then a stop before them
    with torch.inference_mode():  # (as draft_step runs it)
        d.catch_up([r])
    assert st.draft_pos == r.num_tokens - 1
