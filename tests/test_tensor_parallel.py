"""Tensor parallelism on the CPU (gloo, two ranks): greedy outputs equal one rank's, token for token,
on the real SmolLM2 (9 heads over 3 KV heads: uneven shards) with and without speculation, and on
tiny random Qwen3 and Gemma 3 models with fewer KV heads than ranks (checked against transformers); a
torchrun-style start of two local ranks; a rank that dies ends the engine (and a server's core) with an
error naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial

import openai
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.distributed.driver import RankFailure
from specserve.distributed.parallel import head_shard, split
from specserve.loader import load_model_source
from specserve.server.launch import build_engine, serve_in_thread
from tiny_model import make_random_head, make_tiny_gemma3, make_tiny_hf_model

KV = dict(device="cpu", dtype="float32", num_kv_blocks=24, max_model_len=192, max_num_batched_tokens=256)  # (gloo, on any machine)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TREES = dict(speculative_algorithm="EAGLE3", speculative_policy="static", speculative_num_steps=3,
             speculative_eagle_topk=2, speculative_num_draft_tokens=6)


def test_shards_cover_every_head_once() -> None:
    assert [split(9, 2, r) for r in range(2)] == [(0, 5), (5, 4)]
    assert [head_shard(9, 3, 2, r) for r in range(2)] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    assert [head_shard(4, 1, 2, r) for r in range(2)] == [(0, 2, 0, 1), (2, 2, 0, 1)]
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        head_shard(6, 2, 3, 0)
    with pytest.raises(ValueError, match="more ranks than"):
        head_shard(2, 1, 4, 3)


@pytest.fixture(scope="module")
def smollm_prompts(chat_prompts):
    tok = load_model_source(None).tokenizer
    return [tok.apply_chat_template(c) for c in chat_prompts[:3]]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_smollm2_two_ranks_equal_one(smollm2, smollm_prompts) -> None:
    """Plain decoding (requests that never draft: plain steps on both ranks), then tree speculation (its
    KV compaction runs on both ranks' heads), in one two-rank engine; one rank: the session's engine (the
    three prompts in one prefill step there too)."""
    one = _tokens(smollm2, smollm_prompts)
    llm = LLM(tensor_parallel_size=2, **KV, **TREES)
    try:
        assert llm.engine.runner.mc.num_key_value_heads == 2  # rank 0's share of 3
        plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, max_spec_tokens=0)
        assert _tokens(llm, smollm_prompts, plain) == one
        assert llm.engine.stats.spec_draft_tokens == 0 and llm.engine.stats.steps == 10  # a token a step
        assert _tokens(llm, smollm_prompts) == one
        assert llm.engine.stats.spec_accepted_tokens > 0
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """2 layers, 4 heads over 1 KV head (replicated on both ranks), a vocabulary of 63 (split 32 + 31),
    biases on q, k, v and o (o_proj's added once, by rank 0)."""
    path = str(tmp_path_factory.mktemp("qwen3"))
    return path, make_tiny_hf_model(path, "qwen3", vocab=63, kv_heads=1, attention_bias=True)


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        for _ in range(n):
            ids = ids + [int(hf(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids[-n:]


PROMPTS = [[5, 17, 33, 2, 9, 40], [7, 8, 61, 3, 12, 44, 30, 1, 22]]


def test_fewer_kv_heads_than_ranks(tiny_qwen3) -> None:
    path, hf = tiny_qwen3
    llm = LLM(model=path, tensor_parallel_size=2, **KV)
    try:
        assert llm.engine.runner.mc.num_key_value_heads == 1 and llm.engine.runner.mc.num_attention_heads == 2
        assert _tokens(llm, PROMPTS) == [_hf_greedy(hf, p, 10) for p in PROMPTS]
        # a rank that dies: the next step names it, within seconds
        victim = llm.engine.tp.procs[1]
        victim.kill()
        victim.wait()
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=f"tensor-parallel rank 1 \\(pid {victim.pid}\\) exited with code -9"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - t0 < 60  # (not the collectives' 120 s timeout: no hang)
    finally:
        llm.engine.close()
    assert not torch.distributed.is_initialized()


def test_gemma3_two_ranks(tmp_path) -> None:
    """Sliding-window and global layers, soft-capped logits, 4 heads over 1 KV head: transformers' tokens."""
    path = str(tmp_path / "gemma3")
    hf = make_tiny_gemma3(path)
    prompt = [5, 17, 33, 2, 9, 40, 44, 7, 8, 61, 3, 12]  # past the window of 8
    llm = LLM(model=path, tensor_parallel_size=2, **KV)
    try:
        assert _tokens(llm, [prompt]) == [_hf_greedy(hf, prompt, 10)]
    finally:
        llm.engine.close()


def test_gemma3_trees_two_ranks_equal_one(tmp_path) -> None:
    """Tree speculation with a window pool: every rank moves accepted KV in both of its pools (tokens and
    log-probabilities of one rank's)."""
    path = str(tmp_path / "gemma3")
    make_tiny_gemma3(path, layers=2, vocab=8, window=4)
    spec = dict(TREES, speculative_draft_model_path=make_random_head(path, str(tmp_path / "head"), constant=True,
                                                                      drafts=[6, 2]))
    prompts = [[5, 7, 3, 2, 4, 6, 4, 7, 3, 5, 3, 2, 6, 6], [2, 4]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    one = LLM(model=path, **KV, **spec).generate(prompts, sp)
    llm = LLM(model=path, tensor_parallel_size=2, **KV, **spec)
    try:
        assert llm.engine.scheduler.window is not None
        two = llm.generate(prompts, sp)
    finally:
        llm.engine.close()
    assert sum(o.metrics.spec_accepted_tokens for o in two) > 0
    for a, b in zip(two, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = torch.tensor([list(d.values()) for d in a.outputs[0].logprobs])
        assert torch.allclose(lp, torch.tensor([list(d.values()) for d in b.outputs[0].logprobs]), atol=1e-4)


def test_a_rank_that_raises_ends_the_engine(tiny_qwen3) -> None:
    path, _ = tiny_qwen3
    llm = LLM(model=path, tensor_parallel_size=2, **KV)
    try:
        llm.engine.tp.send("no-such-op")  # rank 1 raises on it and exits 1
        with pytest.raises(RankFailure, match="tensor-parallel rank 1 .* exited with code 1"):
            llm.generate(PROMPTS[:1], GREEDY)
        with pytest.raises(RankFailure, match="exited with code 1"):  # and so does every later call, at once
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_style_start(tiny_qwen3) -> None:
    """Two ranks started as torchrun starts them (its environment variables), through `specserve generate`:
    rank 0 prints the text, rank 1 serves its shard and exits 0 when rank 0 is done."""
    path, hf = tiny_qwen3
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank))
        cmd = [sys.executable, "-m", "specserve.cli", "generate", "--model", path, "-tp", "2", "--no-chat",
               "--prompt", " ".join(f"t{i}" for i in PROMPTS[0]), "--max-tokens", "6", "--device", "cpu",
               "--num-kv-blocks", "16", "--max-model-len", "64"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    text = outs[0][0].split("\n")[1]
    assert text.split() == [f"t{i}" for i in _hf_greedy(hf, PROMPTS[0], 6)]
    assert "rank 1/2 ready" in outs[1][1]


def _rank1_pid(engine) -> int:
    return engine.tp.procs[1].pid


def test_server_answers_503_once_a_rank_dies(tiny_qwen3) -> None:
    """The engine core goes within seconds of its rank 1 (it was idle: no step had to fail first)."""
    path, hf = tiny_qwen3
    config = EngineConfig(model=path, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=16, max_model_len=64)
    with serve_in_thread(partial(build_engine, config)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete():
            return client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        assert complete().split() == [f"t{i}" for i in _hf_greedy(hf, PROMPTS[0], 6)]
        os.kill(server.on_engine(_rank1_pid), signal.SIGKILL)
        server.core.join(10)
        assert server.core.exitcode == 1
        with pytest.raises(openai.APIStatusError) as e:
            complete()
        assert e.value.status_code == 503
