"""Data parallelism: two engine-core replicas behind one front-end serve requests balanced by load
(each replica answers some), with the outputs of one engine; stats are the replicas' summed; a replica
that dies makes the server answer 503."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import httpx
import openai
import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.server.client import DataParallelClient, merge_stats
from specserve.server.launch import build_engine, serve_in_thread
from tiny_model import make_tiny_hf_model

PROMPTS = [[5, 17, 33, 2, 9, 40], [7, 8, 61, 3, 12], [4, 4, 20], [30, 31, 32, 33], [50, 1, 6], [11, 12, 13, 14, 15]]


def test_merge_stats_sums_counts_and_averages_kv_usage() -> None:
    a = SimpleNamespace(num_running=2, kv_usage=0.5, generation_tokens=10, spec_accepted_per_position=[3, 1],
                        k_histogram={0: 4, 2: 1}, avg=None)
    b = SimpleNamespace(num_running=1, kv_usage=0.25, generation_tokens=5, spec_accepted_per_position=[2],
                        k_histogram={2: 2}, avg=None)
    m = merge_stats([a, b])
    assert (m.num_running, m.kv_usage, m.generation_tokens) == (3, 0.375, 15)
    assert m.spec_accepted_per_position == [5, 1] and m.k_histogram == {0: 4, 2: 3} and m.avg is None
    assert a.spec_accepted_per_position == [3, 1]  # (the inputs are left as they were)


def test_two_replicas_share_requests_and_match_one_engine(tmp_path) -> None:
    path = str(tmp_path / "qwen3")
    make_tiny_hf_model(path, "qwen3", vocab=63)
    config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64, max_num_seqs=4)
    llm = LLM(dtype="float32", model=path, device="cpu", num_kv_blocks=16, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    with serve_in_thread(partial(build_engine, config), data_parallel_size=2, gpus_per_replica=0) as server:
        assert isinstance(server.client, DataParallelClient) and len(server.cores) == 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete(prompt: list[int]) -> str:
            r = client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert got == want
        served = [r.call_threadsafe("get_stats").prompt_tokens for r in server.client.replicas]
        assert all(n > 0 for n in served) and sum(served) == sum(map(len, PROMPTS)), served
        info = httpx.get(server.url + "/server_info").json()
        assert info["internal_states"][0]["prompt_tokens"] == sum(served)  # (summed over the replicas)
        # one replica gone: the front-end answers 503
        server.cores[1].kill()
        server.cores[1].join(10)
        with pytest.raises(openai.APIStatusError) as e:
            for _ in range(50):  # (until the front-end has seen the exit)
                complete(PROMPTS[0])
        assert e.value.status_code == 503
