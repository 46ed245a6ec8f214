"""Speculation never changes what is generated: greedy token-for-token, sampling in distribution."""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve import LLM, SamplingParams
from tiny_model import make_random_head, make_tiny_model

CHAIN = dict(speculative_num_steps=3)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
KV_GB = 0.05  # KV for ~50k tokens of the tiny model (the default 2 GB: 2-3 s of zeroing per engine)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(str(d / "model"), vocab=8, logit_scale=8.0)
    head = make_random_head(model, str(d / "head"))
    return model, head


def exact_joint(model_dir: str, prompt: list[int], k: int) -> np.ndarray:
    """P(first k tokens) of plain sampling at temperature 1, from transformers: one forward over
    every prompt + (k-1)-token prefix gives each prefix's next-token distributions at once."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=k)))  # row-major, as np.ravel_multi_index
    prefixes = seqs[::V, : k - 1]  # seqs[i]'s first k-1 tokens are prefixes[i // V]
    with torch.inference_mode():
        ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
        logp = torch.log_softmax(hf(ids).logits[:, len(prompt) - 1 :].double(), -1)  # [V^(k-1), k, V]
    logp = logp[torch.arange(len(seqs)) // V].gather(-1, seqs[..., None])[..., 0].sum(-1)
    return torch.exp(logp).numpy().reshape([V] * k)


@pytest.fixture(scope="module")
def joint(tiny):
    return exact_joint(tiny[0], [3, 5, 1], 3)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampling_distribution_is_unchanged(tiny, joint, spec):
    """The first k tokens of n sampled requests against their exact joint (chi-square, 512 cells).

    max_tokens is k + 1: the draft cap (what is left of max_tokens, less one) lets the first
    verify draft 2 tokens, so both observed tokens after the first can come from accepted drafts
    or a rejection's residual (with max_tokens = k only 1 draft was ever verified). Statistic at
    n = 1e4 (seed 7, ~290 cells; the unchanged sampler gives p ~0.6, p > 0.01 passes) for broken
    samplers: residual drawn from p instead of max(0, p - q): 3458 (chain); accepting with u < p
    instead of u * q < p: 2831 (chain); verifying against q**1.3 renormalised, not the q the drafts
    were drawn from: 655, p ~5e-30 (chain); a tree's rejected child left in the distribution it
    draws from next: 2433 (tree). Each is about twice what the same n gave at max_tokens = k (then
    1e5 samples, ~8x the time)."""
    model, head = tiny
    prompt, k, n = [3, 5, 1], 3, 10_000
    p = joint.reshape(-1)
    llm = LLM(model=model, dtype="float32", max_num_seqs=2048, max_num_batched_tokens=16384, seed=7, kv_cache_memory_gb=KV_GB,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="static", **spec)
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=k + 1, ignore_eos=True),
                        use_tqdm=False)
    st = llm.engine.get_stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens  # drafts both accepted and rejected
    assert st.spec_draft_tokens > 2 * n  # most requests' first verify had two drafts
    idx = [int(np.ravel_multi_index(o.outputs[0].token_ids[:k], [8] * k)) for o in outs]
    counts = np.bincount(idx, minlength=p.size)
    keep = p * n >= 5  # chi-square needs expected counts >= 5; pool the rest
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum())
    exp = exp / exp.sum() * obs.sum()
    assert chisquare(obs, exp).pvalue > 0.01


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_tiny_model_token_for_token(tiny, spec):
    model, head = tiny
    prompts = [[i % 8, (3 * i) % 8, (5 * i + 1) % 8] for i in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(dtype="float32", model=model, kv_cache_memory_gb=KV_GB).generate(prompts, sp)]
    llm = LLM(model=model, dtype="float32", num_kv_blocks=12, block_size=4, max_num_seqs=8, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static", **spec)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    st = llm.engine.get_stats()
    assert st.spec_accepted_tokens > 0 and st.num_preemptions > 0
    assert out == ref
