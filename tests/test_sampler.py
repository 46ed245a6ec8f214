import torch

from specserve.engine import sampler
from specserve.sampling_params import SamplingParams


def _sb(params, out_index=None):
    return sampler.SamplingBatch.build(params, out_index or [0] * len(params), torch.device("cpu"))


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    out = sampler.sample(logits, _sb([SamplingParams(temperature=0)] * 4))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]])
    p = sampler.processed_probs(logits, _sb([SamplingParams(temperature=1.0, top_k=2)]))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum().item() > 0.999
    p = sampler.processed_probs(logits, _sb([SamplingParams(temperature=1.0, top_p=0.5)]))
    assert p[0, 0].item() == 1.0  # first token alone holds > 50%
    p = sampler.processed_probs(logits, _sb([SamplingParams(temperature=1.0, min_p=0.3)]))
    assert (p[0, 2:] == 0).all() and p[0, 1] > 0


def test_sampling_matches_distribution_and_seed_reproducible():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    g = torch.Generator().manual_seed(1)
    sb = _sb([SamplingParams(temperature=1.0)] * 20000)
    toks = sampler.sample(logits.expand(20000, 3), sb, g)
    freq = torch.bincount(toks, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)


def test_seeded_rows_repeat_their_seed_and_differ_across_seeds():
    """Rows with the same seed draw the same tokens; other seeds, other tokens (flat logits over 1000
    tokens: two seeds agree on one row with p ~1e-3, on all 8 rows never)."""
    logits = torch.zeros(8, 1000)

    def draw(seed):
        return sampler.sample(logits, _sb([SamplingParams(seed=seed)] * 8, list(range(8))))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_temperature_reshapes_the_distribution():
    """Frequencies follow softmax(logits / T): T = 0.5 squares the odds of [0.5, 0.3, 0.2], T = 2
    takes their square root (each ~0.1 apart, far beyond the 0.02 tolerance)."""
    base = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.log(base)[None].expand(20000, 3)
    for t in (0.5, 2.0):
        g = torch.Generator().manual_seed(3)
        toks = sampler.sample(logits, _sb([SamplingParams(temperature=t)] * 20000), g)
        freq = torch.bincount(toks, minlength=3).float() / 20000
        want = base ** (1 / t) / (base ** (1 / t)).sum()
        assert torch.allclose(freq, want, atol=0.02), (t, freq, want)
        assert not torch.allclose(freq, base, atol=0.05)


def test_logprobs_contain_chosen_and_top():
    """The chosen token (here outside the top 3 of 10) plus the top 3, with the raw distribution's values."""
    logits = torch.tensor([[0.5, 4.0, -1.0, 3.0, 2.5, 0.0, 1.0, -2.0, 2.0, 0.2]])
    want = torch.log_softmax(logits, -1)[0]
    d = sampler.top_logprobs(logits, torch.tensor([6]), 3)[0]
    assert list(d) == [6, 1, 3, 4]  # chosen first, then the top 3 in order
    for tok, lp in d.items():
        assert abs(lp - want[tok].item()) < 1e-5
    d = sampler.top_logprobs(logits, torch.tensor([3]), 2)[0]  # chosen among the top: no duplicate
    assert list(d) == [3, 1] and abs(d[3] - want[3].item()) < 1e-5
    assert list(sampler.top_logprobs(logits, torch.tensor([9]), 0)[0]) == [9]


def test_logprobs_rows_keep_their_own_top_n():
    """One batch computes the largest n asked for; each row keeps the n its request asked for."""
    logits = torch.tensor([[0.5, 4.0, -1.0, 3.0, 2.5], [1.0, 0.0, 2.0, 3.0, 4.0], [1.0, 0.0, 2.0, 3.0, 4.0]])
    lps = sampler.top_logprobs_on_device(logits, torch.tensor([0, 4, 1]), 3)
    d = lps.dicts([0, 4, 1], [3, 0, 1])
    assert [list(x) for x in d] == [[0, 1, 3, 4], [4], [1, 4]]
