"""Speculation's edges on the real SmolLM2 (the shipped EAGLE-3 head unless a test says otherwise): an
abort between a draft and its verify, logprobs, stop strings and stop tokens landing inside accepted
drafts, preemption under sampled and adaptive speculation, the adaptive policy with trees, EAGLE-1."""

import pytest
import torch

from specserve import LLM, SamplingParams
from hf_reference import hf_smollm2
from tiny_model import make_tiny_model

CHAIN = dict(speculative_num_steps=3)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
STATIC = dict(speculative_algorithm="EAGLE3", speculative_policy="static")
KV = dict(dtype="float32", num_kv_blocks=128)  # 2,048 tokens: no test here evicts or preempts from it
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(smollm2):
    return smollm2


@pytest.fixture(scope="module", params=["chain", "tree"])
def spec(request):
    return LLM(**KV, **STATIC, **(CHAIN if request.param == "chain" else TREE))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _drive(eng, until=None):
    """Step ``eng`` until idle (or ``until(eng)`` holds after a step); the finished outputs by id."""
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
        if until is not None and until(eng):
            break
    return done


ABORT_SP = SamplingParams(max_tokens=16, **GREEDY)


@pytest.fixture(scope="module")
def abort_prompts(plain, chat_prompts):
    """Three prompts' token ids for the abort tests, and the plain engine's outputs of the last two."""
    ids = [plain.tokenizer.apply_chat_template(p) for p in chat_prompts[:3]]
    return ids, _ids(plain.generate(ids[1:], ABORT_SP))


def _abort_mid_speculation(llm, abort_prompts):
    """Two requests draft; one is aborted once a step has verified drafts (its next drafts are proposed,
    and with overlap scheduling its next verify may be launched already). The other's tokens are the
    plain engine's; a request added after the abort is too; every block comes back."""
    eng = llm.engine
    (a, b, c), want = abort_prompts
    long_sp, sp = SamplingParams(max_tokens=40, **GREEDY), ABORT_SP
    eng.add_request("a", a, long_sp)
    eng.add_request("b", b, sp)
    before = eng.get_stats().spec_verify_steps
    _drive(eng, until=lambda e: e.get_stats().spec_verify_steps >= before + 2)
    assert eng.get_stats().spec_verify_steps >= before + 2 and eng.get_stats().num_running == 2
    eng.abort_request("a")
    eng.add_request("c", c, sp)
    done = _drive(eng)
    assert sorted(done) == ["b", "c"]
    assert [done["b"].outputs[0].token_ids, done["c"].outputs[0].token_ids] == want
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_abort_between_a_draft_and_its_verify(spec, abort_prompts):
    _abort_mid_speculation(spec, abort_prompts)


def test_abort_with_the_next_verify_launched_ahead(abort_prompts):
    """Overlap scheduling (on for CUDA, forced here): the drafter launches a chain's next verify before
    the step ends, so the abort lands after that verify is queued."""
    _abort_mid_speculation(LLM(**KV, **STATIC, **CHAIN, overlap_schedule="on"), abort_prompts)


LOGPROBS_SP = SamplingParams(max_tokens=12, logprobs=3, **GREEDY)


@pytest.fixture(scope="module")
def logprobs_ref(plain, chat_prompts):
    """The plain engine's greedy tokens and top-3 logprobs of two prompts (for chain and tree)."""
    return plain.chat(chat_prompts[3:5], LOGPROBS_SP)


def test_logprobs_with_speculation(spec, logprobs_ref, chat_prompts):
    """Greedy: tokens and logprobs (chosen + top 3) are the plain engine's. Sampled: each token's logprob,
    accepted draft or not, is log_softmax of transformers' logits given the tokens before it."""
    convs = chat_prompts[3:5]
    ref, got = logprobs_ref, spec.chat(convs, LOGPROBS_SP)
    assert spec.engine.get_stats().spec_accepted_tokens > 0
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert [list(d) for d in g.outputs[0].logprobs] == [list(d) for d in r.outputs[0].logprobs]
        assert [v for d in g.outputs[0].logprobs for v in d.values()] == pytest.approx(
            [v for d in r.outputs[0].logprobs for v in d.values()], abs=1e-3)
    hf = hf_smollm2()
    sampled = spec.chat(convs, [SamplingParams(temperature=0.7, seed=s, max_tokens=10, logprobs=1, ignore_eos=True)
                                for s in range(2)])
    for conv, out in zip(convs, sampled):
        ids = spec.tokenizer.apply_chat_template(conv)
        toks, lps = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert len(toks) == len(lps) == 10
        with torch.inference_mode():
            ref_lp = torch.log_softmax(hf(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1 :].float(), -1)
        for pos, (t, d) in enumerate(zip(toks, lps)):
            assert next(iter(d)) == t
            assert d[t] == pytest.approx(ref_lp[pos, t].item(), abs=2e-3), pos


STORY = "Here is a long story about a brave knight and a dragon:"


@pytest.fixture(scope="module")
def stops(plain):
    """Stop strings, kept stop strings and stop token ids at many positions of STORY's greedy text (so that
    some land inside a verify's accepted run, some at its end), and the plain engine's outputs with each."""
    full = plain.generate([STORY], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    words = full.text.split()
    params = ([SamplingParams(max_tokens=24, stop=[w], **GREEDY) for w in words[2:10]]
              + [SamplingParams(max_tokens=24, stop=[w], include_stop_str_in_output=True, **GREEDY)
                 for w in words[3:10:2]]
              + [SamplingParams(max_tokens=24, stop_token_ids=[t], **GREEDY) for t in full.token_ids[3:18:2]])
    return params, plain.generate([STORY] * len(params), params)


def test_stops_inside_accepted_drafts(spec, stops):
    """A stop string, a stop token id and a stop string kept in the output end a speculating request
    where they end a plain one: tokens a verify accepted past the stop are dropped."""
    params, ref = stops
    before = spec.engine.get_stats().spec_accepted_tokens
    got = spec.generate([STORY] * len(params), params)
    for r, g in zip(ref, got):
        r, g = r.outputs[0], g.outputs[0]
        assert r.finish_reason == "stop" and len(r.token_ids) < 24
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (r.text, r.token_ids, r.finish_reason,
                                                                         r.stop_reason)
    assert spec.engine.get_stats().spec_accepted_tokens > before


def _check_top_k(outs, k):
    """Every token of a top-k request is within the top k of the model's distribution (its logprobs)."""
    n = 0
    for o in outs:
        for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            assert len(d) == k and t in d, (t, d)  # the chosen token is among the top k: no extra entry
            n += 1
    assert n > 0


def test_preemption_under_sampled_speculation(chat_prompts):
    """6 sampled requests (top-k 5) in a KV cache too small for all: requests are preempted and
    recomputed mid-speculation; every request finishes whole, each token within its top 5, and
    every block comes back (trees: the adaptive test below)."""
    llm = LLM(dtype="float32", num_kv_blocks=16, max_num_seqs=6, **STATIC, **CHAIN)
    sps = [SamplingParams(temperature=0.9, top_k=5, seed=i, max_tokens=24, logprobs=5, ignore_eos=True)
           for i in range(6)]
    outs = llm.chat(chat_prompts[14:20], sps)  # 18 blocks of prompt alone, 16 in the cache
    st = llm.engine.get_stats()
    assert st.num_preemptions > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    _check_top_k(outs, 5)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_adaptive_policy_with_trees_under_preemption(plain, chat_prompts):
    """The adaptive policy over a tree shape, in a KV cache that preempts: greedy output is the plain
    engine's token for token, sampled top-k requests stay in their top k, the policy chose depths."""
    # (a step budget of 128 tokens and 4 requests: the start-up cost profile measures fewer points)
    llm = LLM(dtype="float32", num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=128, speculative_algorithm="EAGLE3",
              **TREE)
    assert llm.engine.config.speculative.policy == "adaptive"
    convs = chat_prompts[10:14]  # 269 prompt tokens + 4 x 16 in 256 slots
    sp = SamplingParams(max_tokens=16, **GREEDY)
    assert _ids(llm.chat(convs, sp)) == _ids(plain.chat(convs, sp))
    sampled = llm.chat(convs, [SamplingParams(temperature=0.9, top_k=5, seed=i, max_tokens=8, logprobs=5,
                                              ignore_eos=True) for i in range(4)])
    _check_top_k(sampled, 5)
    st = llm.engine.get_stats()
    assert st.num_preemptions > 0 and sum(st.k_histogram.values()) > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def _eagle1_head(target_dir: str | None, path: str, constant: bool = False) -> str:
    """A random EAGLE-1 head (public LlamaForCausalLMEagle layout) shaped like the target;
    ``constant``: its weights zero, so its output is 0 and the target's lm_head gives all-zero logits
    (it drafts token 0 every time)."""
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    mc = load_model_source(target_dir).config
    torch.manual_seed(0)
    cfg = Eagle3Config.from_target(mc, draft_vocab_size=mc.vocab_size, algorithm="EAGLE",
                                   architecture="LlamaForCausalLMEagle", aux_layer_ids=None)
    head = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_() if constant else p.normal_(0, 0.02)
    head.save_pretrained(path)
    return path


def test_eagle1_end_to_end(plain, chat_prompts, tmp_path):
    """An EAGLE-1 head drafts from the target's last hidden state: on SmolLM2 (a random head, chain and
    tree) greedy output is the plain engine's with drafts verified; on a tiny model whose every token
    is 0, a head that always drafts 0 has every draft accepted."""
    head = _eagle1_head(None, str(tmp_path / "eagle1"))
    convs = chat_prompts[:2]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    ref = _ids(plain.chat(convs, sp))
    for shape in (CHAIN, TREE):
        llm = LLM(**KV, speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                  speculative_policy="static", **shape)
        assert _ids(llm.chat(convs, sp)) == ref
        assert llm.engine.get_stats().spec_draft_tokens > 0
    tiny = make_tiny_model(str(tmp_path / "tiny"), constant=True)
    llm = LLM(model=tiny, dtype="float32", kv_cache_memory_gb=0.01, speculative_algorithm="EAGLE",
              speculative_draft_model_path=_eagle1_head(tiny, str(tmp_path / "const"), constant=True),
              speculative_policy="static", **CHAIN)
    out = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=17, **GREEDY))
    assert _ids(out) == [[0] * 17] * 4
    st = llm.engine.get_stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens == st.spec_draft_tokens
