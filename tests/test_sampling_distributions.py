"""Sampled tokens follow the processed distribution for temperature != 1, top-k, top-p and min-p, with
and without speculation (chi-square against an exact joint from transformers; a tiny model of 8 tokens,
where the real one would need far more samples per cell)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve import LLM, SamplingParams
from tiny_model import make_random_head, make_tiny_model

PROMPT, K, N = [3, 5, 1], 2, 4000
CASES = {
    "temperature-0.6": dict(temperature=0.6),
    "temperature-1.7": dict(temperature=1.7),
    "top-k-3": dict(temperature=1.0, top_k=3),
    "top-p-0.6": dict(temperature=1.0, top_p=0.6),
    "min-p-0.5": dict(temperature=1.0, min_p=0.5),
}


def reference_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
    """[..., V] logits -> the distribution sampling draws from: softmax(logits / T), then the top k,
    then the smallest head of the sorted rest holding top_p of it, then tokens at >= min_p x the most
    likely; renormalised."""
    x = logits / temperature
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(p)
    for idx in np.ndindex(p.shape[:-1]):
        row = p[idx]
        order = np.argsort(-row, kind="stable")
        keep = order[: top_k if top_k > 0 else len(order)]
        kept = row[keep] / row[keep].sum()
        before = np.cumsum(kept) - kept  # mass above each kept token
        keep = keep[before <= top_p]
        keep = keep[row[keep] >= min_p * row[keep].max()]
        out[idx][keep] = row[keep] / row[keep].sum()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(str(d / "model"), vocab=8, logit_scale=3.0)
    return model, make_random_head(model, str(d / "head"))


@pytest.fixture(scope="module")
def next_logits(tiny) -> np.ndarray:
    """[V, V] float64 logits of the token after PROMPT + [t] for every first token t, and [V] after PROMPT."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    V = hf.config.vocab_size
    ids = torch.cat([torch.tensor(PROMPT).expand(V, -1), torch.arange(V)[:, None]], 1)
    with torch.inference_mode():
        logits = hf(ids).logits.double().numpy()
    return logits[0, len(PROMPT) - 1], logits[:, -1]


def joint(next_logits, params: dict) -> np.ndarray:
    """P(first two tokens) [V * V], row-major."""
    first, second = next_logits
    return (reference_probs(first, **params)[:, None] * reference_probs(second, **params)).reshape(-1)


def test_reference_probs_by_hand():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    assert np.allclose(reference_probs(logits, top_k=2), [2 / 3, 1 / 3, 0, 0])
    assert np.allclose(reference_probs(logits, top_p=0.7), [2 / 3, 1 / 3, 0, 0])  # 0.5 < 0.7: one more
    assert np.allclose(reference_probs(logits, top_p=0.4), [1, 0, 0, 0])
    assert np.allclose(reference_probs(logits, min_p=0.3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    t = np.array([0.5, 0.25, 0.15, 0.1]) ** 2
    assert np.allclose(reference_probs(logits, temperature=0.5), t / t.sum())


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_processed_distributions(tiny, next_logits, spec):
    """N requests per case, all cases in one batch: chi-square p > 0.001 per case (5 cases x 2 engines).
    The same counts against the unprocessed (temperature 1) joint are refused for every case, so the
    test tells each processing step from none. With speculation, max_tokens K + 1 lets the first
    verify check 2 drafted tokens, so both observed tokens can come from accepted drafts (plain: K)."""
    model, head = tiny
    kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="static",
              speculative_num_steps=3) if spec else {}
    llm = LLM(model=model, dtype="float32", max_num_seqs=4096, max_num_batched_tokens=16384, seed=5, kv_cache_memory_gb=0.05,
              **kw)
    names = list(CASES)
    sps = [SamplingParams(max_tokens=K + spec, ignore_eos=True, **CASES[c]) for c in names for _ in range(N)]
    outs = llm.generate([PROMPT] * len(sps), sps, use_tqdm=False)
    if spec:
        st = llm.engine.get_stats()
        assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    plain_joint = joint(next_logits, {})
    for i, c in enumerate(names):
        idx = [o.outputs[0].token_ids[0] * 8 + o.outputs[0].token_ids[1] for o in outs[i * N:(i + 1) * N]]
        counts = np.bincount(idx, minlength=64)
        p = joint(next_logits, CASES[c])
        assert counts[p == 0].sum() == 0, c  # nothing outside the processed support
        assert _pvalue(counts, p) > 1e-3, c
        assert _pvalue(counts, plain_joint) < 1e-6, c


def _pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    n = counts.sum()
    if (counts[p == 0] > 0).any():
        return 0.0
    keep = p * n >= 5  # chi-square needs expected counts >= 5; pool the rest
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp / exp.sum() * obs.sum()).pvalue)
