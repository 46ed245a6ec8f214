"""The plain engine's edges on the real SmolLM2: logprob values against transformers, seeds, min_tokens,
stop strings kept in the output, prefill without chunking, prefix-cache eviction, a KV cache too small."""

import pytest
import torch

from specserve import LLM, SamplingParams
from hf_reference import hf_smollm2

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2  # (conftest's: every test here reads only)


def test_logprobs_are_transformers_log_softmax(llm, chat_prompts):
    """Each generated token's logprob and the top 5 are log_softmax of transformers' float32 logits
    given the prompt and the tokens before it (teacher forced), for greedy and sampled requests."""
    hf = hf_smollm2()
    convs = chat_prompts[:3]
    params = [SamplingParams(max_tokens=12, logprobs=5, **GREEDY),
              SamplingParams(temperature=0.8, seed=1, max_tokens=12, logprobs=5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=12, logprobs=0, ignore_eos=True)]
    outs = llm.chat(convs, params)
    for conv, out, sp in zip(convs, outs, params):
        ids = llm.tokenizer.apply_chat_template(conv)
        got = out.outputs[0].token_ids
        lps = out.outputs[0].logprobs
        assert len(got) == len(lps) == 12
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :].float(), -1)
        for pos, (tok, d) in enumerate(zip(got, lps)):
            assert next(iter(d)) == tok  # the chosen token first
            assert len(d) in (sp.logprobs, sp.logprobs + 1)  # the top n, and the chosen one if not among them
            for t, v in d.items():
                assert v == pytest.approx(ref[pos, t].item(), abs=2e-3), (pos, t)
            top = ref[pos].topk(sp.logprobs).values.tolist() if sp.logprobs else []
            assert sorted(list(d.values())[len(d) - sp.logprobs :], reverse=True) == pytest.approx(top, abs=2e-3)


def test_seeds_repeat_and_differ(llm):
    """The same seed gives the same tokens (alone or batched with others); other seeds other tokens."""
    prompt = "Write a short poem about the sea."

    def run(seeds):
        sps = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=10, ignore_eos=True) for s in seeds]
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * len(seeds), sps)]

    a = run([11])[0]
    *batch, u0, u1 = run([12, 11, 13, None, None])  # (two unseeded requests among them)
    assert batch[1] == a
    assert len({tuple(t) for t in batch}) == 3  # 10 tokens at temperature 1: seeds differ
    assert u0 != u1


def test_min_tokens_defers_every_stop(llm):
    """A request that stops on EOS after n tokens runs to min_tokens = n + 6 with it (and with a stop
    token id and a stop string it would meet earlier)."""
    conv = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    base = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    n = len(base.token_ids)
    assert base.finish_reason == "stop" and n < 8, base  # EOS comes early for this prompt
    mt = n + 6
    first = base.token_ids[0]
    out, early = (o.outputs[0] for o in llm.chat([conv] * 2, [  # (one batch)
        SamplingParams(temperature=0, max_tokens=mt + 4, min_tokens=mt),
        SamplingParams(temperature=0, max_tokens=mt + 4, min_tokens=mt, stop_token_ids=[first], stop=[base.text[:2]])]))
    assert len(out.token_ids) >= mt
    assert out.token_ids[: n - 1] == base.token_ids[: n - 1]
    eos = set(llm.tokenizer.eos_token_ids)
    assert not eos & set(out.token_ids[:mt])  # EOS is masked, not just passed over
    assert len(early.token_ids) >= mt
    assert first not in early.token_ids[:mt] and not eos & set(early.token_ids[:mt])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_repetition_penalty_is_transformers(llm, chat_prompts):
    """Greedy tokens under repetition_penalty are the argmax of transformers' logits after its
    RepetitionPenaltyLogitsProcessor over prompt + tokens so far (teacher forced), and differ from
    the unpenalized ones."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf = hf_smollm2()
    conv = chat_prompts[0]
    ids = llm.tokenizer.apply_chat_template(conv)
    got, plain = (o.outputs[0].token_ids for o in llm.chat(  # (one batch)
        [conv] * 2, [SamplingParams(repetition_penalty=1.4, max_tokens=16, **GREEDY), SamplingParams(max_tokens=16, **GREEDY)]))
    assert got != plain
    proc = RepetitionPenaltyLogitsProcessor(1.4)
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :].float()
    want = [int(proc(torch.tensor([ids + got[:i]]), logits[i : i + 1]).argmax()) for i in range(len(got))]
    assert got == want


def test_include_stop_str_in_output(llm):
    prompt = "The capital of France is"
    g = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    word = g.text.split()[2]
    cut = g.text.index(word)
    outs = llm.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=12, stop=[word],
                                                      include_stop_str_in_output=include) for include in (False, True)])
    for include, o in zip((False, True), (o.outputs[0] for o in outs)):
        assert o.finish_reason == "stop" and o.stop_reason == word
        assert o.text == g.text[: cut + len(word) * include]


def test_prefill_without_chunking_waits_for_a_whole_budget():
    """enable_chunked_prefill=False: a prompt that does not fit what is left of the step's token budget
    waits for the next step (no partial chunk), unless it is the step's first (then it is chunked:
    nothing else could run it); outputs are those of the chunked engine."""
    text = " ".join(f"item {i}," for i in range(60))
    sp = SamplingParams(max_tokens=6, **GREEDY)

    def run(chunked: bool) -> tuple[tuple[int, int], list[list[int]], list[int]]:
        llm = LLM(dtype="float32", max_num_batched_tokens=64, num_kv_blocks=48, enable_chunked_prefill=chunked)
        eng, tok = llm.engine, llm.tokenizer
        for i in range(2):
            eng.add_request(f"s{i}", tok.encode(f"List {i}: " + text)[:40], sp)  # 40 + 40 tokens > 64
        eng.step()
        st = eng.get_stats()
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        long_prompt = tok.encode("A long list: " + text)[:150]  # longer than the whole budget: chunked even so
        long_out = llm.generate([long_prompt], sp)[0].outputs[0].token_ids
        return (st.num_running, st.num_waiting), [done["s0"], done["s1"]], long_out

    whole, chunks = run(False), run(True)
    assert whole[0] == (1, 1) and chunks[0] == (2, 0)
    assert whole[1:] == chunks[1:]


def test_prefix_cache_evicts_the_least_recent_prompt_and_recomputes_it():
    """16 blocks of 16 tokens: a 56-token prompt's 3 full blocks are served from the cache on its second run; a request
    that needs every block evicts it, and the third run recomputes it with the same output."""
    llm = LLM(dtype="float32", max_num_batched_tokens=256, num_kv_blocks=16, block_size=16)
    eng = llm.engine
    tok = llm.tokenizer
    text = " ".join(f"item {i}," for i in range(200))
    a = tok.encode("A list: " + text)[:56]
    big = tok.encode("Another list: " + text)[: 16 * 16 - 6]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    first = llm.generate([a], sp)[0]
    second = llm.generate([a], sp)[0]
    assert first.metrics.num_cached_tokens == 0 and second.metrics.num_cached_tokens == 48
    assert eng.get_stats().prefix_cache_hits > 0
    assert len(llm.generate([big], sp)[0].outputs[0].token_ids) == 6  # all 16 blocks
    third = llm.generate([a], sp)[0]
    assert third.metrics.num_cached_tokens == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == third.outputs[0].token_ids
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_a_request_larger_than_the_kv_cache_is_refused():
    """max_model_len is capped at what the KV cache holds (2 blocks: 32 tokens): a longer request gets a
    clear error when it is added, and the engine keeps serving the ones that fit."""
    llm = LLM(dtype="float32", num_kv_blocks=2, block_size=16, max_model_len=1024)
    assert llm.engine.max_model_len == 32
    with pytest.raises(ValueError, match="maximum context length is 32"):
        llm.generate([list(range(100, 130))], SamplingParams(max_tokens=3))
    out = llm.generate([list(range(100, 129))], SamplingParams(max_tokens=3, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
