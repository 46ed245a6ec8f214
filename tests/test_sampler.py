import torch

from specserve.engine import sampler
from specserve.sampling_params import SamplingParams


def _sb(params, gens=None):
    return sampler.SamplingBatch.build(params, gens or [None] * len(params), torch.device("cpu"))


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
    a = sampler.sample(torch.randn(1, 1000).expand(2, 1000).clone(), _sb([SamplingParams(seed=7)] * 2,
                       [torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)]))
    assert a[0] == a[1]


def test_logprobs_contain_chosen_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    d = sampler.top_logprobs(logits, torch.tensor([0]), 2)[0]
    assert set(d) == {0, 1, 2}
    assert abs(sum(torch.tensor(list(d.values())).exp().tolist()) - 1) < 1e-5
