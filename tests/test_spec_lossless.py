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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(str(d / "model"), vocab=8, logit_scale=8.0)
    head = make_random_head(model, str(d / "head"))
    return model, head


def exact_joint(model_dir: str, prompt: list[int], k: int) -> np.ndarray:
    """P(first k tokens) of plain sampling at temperature 1, from transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    V = hf.config.vocab_size
    probs = np.zeros([V] * k)
    with torch.inference_mode():
        for seq in itertools.product(range(V), repeat=k):
            ids = torch.tensor([prompt + list(seq[:-1])])
            logp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 :].float(), -1)
            probs[seq] = float(torch.exp(sum(logp[i, seq[i]] for i in range(k))))
    return probs


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampling_distribution_is_unchanged(tiny, spec):
    model, head = tiny
    prompt, k, n = [3, 5, 1], 3, 100_000
    p = exact_joint(model, prompt, k).reshape(-1)
    llm = LLM(model=model, max_num_seqs=2048, max_num_batched_tokens=16384, seed=7,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="static", **spec)
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=k, ignore_eos=True), use_tqdm=False)
    st = llm.engine.get_stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens  # drafts both accepted and rejected
    idx = [int(np.ravel_multi_index(o.outputs[0].token_ids, [8] * k)) for o in outs]
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
    ref = [o.outputs[0].token_ids for o in LLM(model=model).generate(prompts, sp)]
    llm = LLM(model=model, num_kv_blocks=12, block_size=4, max_num_seqs=8, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static", **spec)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    st = llm.engine.get_stats()
    assert st.spec_accepted_tokens > 0 and st.num_preemptions > 0
    assert out == ref
