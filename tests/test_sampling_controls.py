"""Sampling controls on the real SmolLM2, with speculation off and on (chain, tree, the adaptive default):
logit_bias, penalties and min_tokens edit every sampling and verify row alike, and a seeded request's
text depends on its seed alone, not on the batch around it or on speculation."""

from unittest import mock

import pytest

from specserve import LLM, SamplingParams

KV = dict(dtype="float32", num_kv_blocks=128)  # 2,048 tokens: 17 short requests at once
CHAIN = dict(speculative_num_steps=3)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
STATIC = dict(speculative_algorithm="EAGLE3", speculative_policy="static")
CONV = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def engines(smollm2):
    from specserve.speculative.policy.cost_model import CostModel
    from test_golden_spec import fixed_cost_model

    cost = fixed_cost_model(256, 256, 3)  # (the adaptive engine's start-up profile, not measured here)
    with mock.patch.object(CostModel, "load", classmethod(lambda cls, path: __import__("copy").deepcopy(cost))):
        adaptive = LLM(**KV, max_num_batched_tokens=256, speculative_algorithm="EAGLE3", speculative_calibrate=False,
                       **CHAIN)
    assert adaptive.engine.config.speculative.policy == "adaptive"
    return {"plain": smollm2, "chain": LLM(**KV, **STATIC, **CHAIN), "tree": LLM(**KV, **STATIC, **TREE),
            "adaptive": adaptive}


def _tokens(llm, convs, params):
    return [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]


def test_logit_bias_bans_and_forces_tokens(engines):
    plain = engines["plain"]
    base = _tokens(plain, [CONV], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    banned = set(base[:4])
    sps = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={t: -100 for t in banned}),
           SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logit_bias={t: -100 for t in banned}),
           SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logit_bias={1234: 100})]
    for name in ("plain", "chain"):  # (the three requests in one batch: each row its own bias)
        *outs, forced = _tokens(engines[name], [CONV] * 3, sps)
        for out in outs:
            assert len(out) == 8 and not banned & set(out), (name, out)
        assert forced == [1234] * 6
    vocab = plain.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias keys"):
        plain.generate("hi", SamplingParams(logit_bias={vocab: 1.0}))
    assert not plain.engine.has_unfinished_requests()


def test_greedy_with_penalties_and_bias_is_the_same_with_speculation(engines, chat_prompts):
    """Penalties see each verify row's drafts: greedy tokens equal the plain engine's, chain and tree
    (and they differ from the unpenalized output, so the penalties act)."""
    convs = chat_prompts[:3]
    sps = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5),
           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=-1.0,
                          logit_bias={28: 3.0, 30: -5.0})]
    both = _tokens(engines["plain"], convs * 2, sps + [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3)
    ref, unpenalized = both[:3], both[3:]  # (one batch: the plain engine's greedy tokens do not depend on it)
    assert all(r != u for r, u in zip(ref, unpenalized))
    for name in ("chain", "tree"):
        st0 = engines[name].engine.get_stats().spec_accepted_tokens
        assert _tokens(engines[name], convs, sps) == ref, name
        assert engines[name].engine.get_stats().spec_accepted_tokens > st0


def test_min_tokens_masks_eos_and_stop_ids_at_every_row(engines):
    """A prompt greedy ends early: with min_tokens neither EOS nor a stop token id comes before it,
    speculating or not (the masks follow each verify row's output index)."""
    conv = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    plain = engines["plain"]
    eos = plain.engine.tokenizer.eos_token_ids
    base = _tokens(plain, [conv], SamplingParams(temperature=0, max_tokens=32))[0]
    assert len(base) < 8 and base[-1] in eos
    mt = len(base) + 6
    stop_id = base[1]
    sp = SamplingParams(temperature=0, max_tokens=mt + 4, min_tokens=mt, stop_token_ids=[stop_id])
    ref = _tokens(plain, [conv], sp)[0]
    assert len(ref) >= mt and not (set(eos) | {stop_id}) & set(ref[:mt])
    for name in ("chain", "tree"):
        assert _tokens(engines[name], [conv], sp)[0] == ref, name


def test_seeded_text_is_the_same_alone_under_load_and_with_speculation(engines, chat_prompts):
    """Two seeded requests (one with penalties) give the same tokens alone and among 8 others (greedy,
    unseeded, other seeds, penalized), with speculation off, chain, tree and adaptive; other seeds differ."""
    target = [SamplingParams(temperature=0.8, seed=1234, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=-7, max_tokens=6, ignore_eos=True,
                             frequency_penalty=0.5, logit_bias={13: 2.0})]
    convs = [CONV, chat_prompts[0]]
    others = [SamplingParams(temperature=[0, 0.7, 1.0, 1.2][i % 4], seed=[None, 99 + i][i % 2], max_tokens=3 + i % 6,
                             ignore_eos=True, presence_penalty=0.3 * (i % 3 == 0)) for i in range(8)]
    # the others' prompts: plain text of 2-25 tokens (their prefill is not what is tested)
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    other_prompts = [" ".join(words[: 1 + (5 * i) % 14]) * (1 + i % 2) for i in range(8)]
    prompt_ids = [engines["plain"].tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
    other_seed = SamplingParams(temperature=0.8, seed=1235, max_tokens=6, ignore_eos=True)  # target[0]'s, reseeded
    want = _tokens(engines["plain"], convs, target)
    for name, llm in engines.items():
        if name == "adaptive":  # (alone with speculation: chain and tree are checked under load)
            assert _tokens(llm, convs, target) == want, name
        outs = llm.generate(other_prompts[:4] + prompt_ids + other_prompts[4:] + prompt_ids[:1],
                            others[:4] + target + others[4:] + [other_seed], use_tqdm=False)
        loaded = [o.outputs[0].token_ids for o in outs]
        assert loaded[4:6] == want, name
        assert loaded[-1] != want[0], name
    assert engines["adaptive"].engine.get_stats().spec_accepted_tokens > 0
