"""Logits processing (penalties, logit_bias, min_tokens masks, per-request processors) row by row, and the
seeded sampler's noise: pure logic against references (transformers' repetition penalty, OpenAI's formula)."""

import math

import pytest
import torch

from specserve.engine import logits_process as lp
from specserve.engine import sampler
from specserve.engine.request import Request
from specserve.sampling_params import SamplingParams

V = 40
EOS = {2}


def _req(prompt, output, **params):
    r = Request("r", None, list(prompt), SamplingParams(**params))
    for t in output:
        r.append_token(t)
    return r


def test_prefixes_of_chains_and_trees():
    assert lp.chain_prefixes([7, 8]) == [[], [7], [7, 8]]
    # root 0; nodes 1, 2 under it; node 3 under 1; node 4 under 3
    assert lp.tree_prefixes([0, 5, 6, 7, 8], [-1, 0, 0, 1, 3]) == [[], [5], [6], [5, 7], [5, 7, 8]]


def test_repetition_penalty_is_transformers_over_prompt_output_and_each_rows_drafts():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    r = _req([1, 4, 4, 9], [11, 3], repetition_penalty=1.7)
    drafts = lp.chain_prefixes([20, 3, 21])
    logits = torch.randn(5, V, generator=g) * 3  # row 0 belongs to no processed request
    got = lp.process(logits, [(r, 1, drafts)], EOS)
    assert torch.equal(got[0], logits[0])
    hf = RepetitionPenaltyLogitsProcessor(1.7)
    for i, d in enumerate(drafts):
        ids = torch.tensor([[1, 4, 4, 9, 11, 3] + d])
        want = hf(ids, logits[1 + i : 2 + i].clone())
        assert torch.allclose(got[1 + i], want[0]), i
    assert not torch.equal(got[1:], logits[1:])


def test_frequency_and_presence_penalties_are_openais_over_output_tokens():
    """logit - f * count - p * [count > 0], counts over the output and the row's drafts, not the prompt."""
    g = torch.Generator().manual_seed(1)
    r = _req([5, 5, 6], [7, 7, 8], frequency_penalty=0.6, presence_penalty=-0.4)
    drafts = lp.chain_prefixes([7, 5])
    logits = torch.randn(3, V, generator=g)
    got = lp.process(logits, [(r, 0, drafts)], EOS)
    for i, d in enumerate(drafts):
        counts = torch.bincount(torch.tensor([7, 7, 8] + d), minlength=V).float()
        want = logits[i] - 0.6 * counts + 0.4 * (counts > 0).float()
        assert torch.allclose(got[i], want), i
    assert got[0, 5] == logits[0, 5]  # a prompt token only: no penalty
    assert got[2, 5] == pytest.approx(logits[2, 5].item() - 0.2)  # drafted at row 2's prefix


def test_logit_bias_and_min_tokens_masks_by_output_index():
    """min_tokens 4 after 2 outputs: rows predicting outputs 2 and 3 mask EOS and the stop ids, rows 4
    and 5 do not; the bias applies to every row; a request with ignore_eos keeps EOS."""
    r = _req([1], [9, 9], logit_bias={3: -100, 4: 2.5}, min_tokens=4, stop_token_ids=[6], max_tokens=10)
    q = _req([1], [], min_tokens=1, ignore_eos=True, stop_token_ids=[7])
    logits = torch.zeros(5, V)
    got = lp.process(logits, [(r, 0, lp.chain_prefixes([5, 5, 5])), (q, 4, [[]])], EOS)
    assert (got[:4, 3] == -100).all() and (got[:4, 4] == 2.5).all()
    assert math.isinf(got[0, 2]) and math.isinf(got[1, 6]) and got[2, 2] == 0 and got[3, 6] == 0
    assert got[4, 2] == 0 and math.isinf(got[4, 7])
    assert torch.equal(logits, torch.zeros(5, V))  # the caller's logits are left alone


def test_a_requests_own_processor_sees_its_rows_and_histories():
    seen = []

    class Only(lp.LogitsProcessor):
        def __init__(self, token):
            self.token = token

        def apply(self, logits, rows):
            seen.append((logits.shape, rows.prompt, rows.output, rows.drafts, [rows.out_index(i) for i in range(3)]))
            keep = logits[:, self.token].clone()
            logits.fill_(float("-inf"))
            logits[:, self.token] = keep

    r = _req([1, 2], [3], max_tokens=10)
    r.logits_processors.append(Only(5))
    assert r.processes_logits and not _req([1], [], max_tokens=3).processes_logits
    got = lp.process(torch.randn(4, V), [(r, 1, lp.chain_prefixes([8, 9]))], EOS)
    assert seen == [((3, V), [1, 2], [3], [[], [8], [8, 9]], [1, 2, 3])]
    assert (got[1:].argmax(-1) == 5).all() and not math.isinf(got[0, 0])


@pytest.mark.parametrize("kw,needle", [
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"), (dict(logit_bias={"a": 1.0}), "logit_bias keys"),
    (dict(logit_bias={5: 100.5}), "logit_bias values"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_values_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_seeded_noise_depends_on_seed_and_output_index_only():
    """A row's noise is the same in any batch and any row; another seed or index gives other noise;
    its values are Exp(1) (mean 1, P(E > 1) = 1/e over 4e5 draws)."""
    seeds = torch.tensor([[5, 0], [5, 0], [6, 0], [5, 1]])
    idx = torch.tensor([3, 4, 3, 3])
    e = sampler.seeded_exponential(seeds, idx, 1000)
    alone = sampler.seeded_exponential(seeds[2:3], idx[2:3], 1000)
    assert torch.equal(e[2], alone[0])
    assert all(not torch.equal(e[0], e[i]) for i in (1, 2, 3))
    big = sampler.seeded_exponential(torch.tensor([[123, 45]]).expand(400, 2), torch.arange(400), 1000)
    assert big.mean().item() == pytest.approx(1.0, abs=0.01)
    assert (big > 1).float().mean().item() == pytest.approx(math.exp(-1), abs=0.005)


def test_seeded_draws_follow_the_distribution():
    """One seed over 20000 output indices draws tokens with the frequencies of p (as unseeded rows do)."""
    n = 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(n, 3)
    sb = sampler.SamplingBatch.build([SamplingParams(temperature=1.0, seed=99)] * n, list(range(n)), torch.device("cpu"))
    toks = sampler.sample(logits, sb)
    freq = torch.bincount(toks, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.015)
    again = sampler.sample(logits[:50], sb.select(list(range(50))))
    assert torch.equal(again, toks[:50])  # (select keeps each row's index and seed)
