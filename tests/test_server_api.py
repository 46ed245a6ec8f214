"""Server behaviour against a fake engine (fast): protocol, errors, streaming, abort, metrics.

The real-model end-to-end tests are in test_server.py.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from functools import partial  # noqa: E402

from fake_engine import TEXT, BrokenEngine, FakeEngine  # noqa: E402

from specserve.server.launch import serve_in_thread  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


class Live:
    def __init__(self, server) -> None:
        self.url = server.url
        self.server = server
        self.srv = server.app.state.server
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def on_engine(self, fn, *args):
        """Run an engine method (by name) or fn(engine, *args) in the engine-core process."""
        return self.server.on_engine(fn, *args)

    def post(self, path: str, body, **kw) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=30, **kw)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with serve_in_thread(partial(FakeEngine, step_delay=0.001)) as server:
        yield Live(server)


@pytest.fixture(scope="module")
def spec_live() -> Iterator[Live]:
    """Fake engine that 'speculates': every decode step verifies 3 drafts and accepts 2."""
    with serve_in_thread(partial(FakeEngine, step_delay=0.001, spec_k=3),
                         served_model_name=["fake-spec", "alias"]) as server:
        yield Live(server)


# ---------------------------------------------------------------- happy paths


def test_chat_stream_equals_nonstream_and_usage(live: Live) -> None:
    r = live.client.chat.completions.create(model="fake-model", messages=USER, max_tokens=12, temperature=0)
    prompt_len = len(live.srv.tokenizer.apply_chat_template(USER))
    assert r.choices[0].message.content == TEXT[:12]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 12, prompt_len + 12)

    chunks = list(live.client.chat.completions.create(
        model="default", messages=USER, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == prompt_len


def test_many_concurrent_streams(live: Live) -> None:
    import asyncio

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)

        async def one(n: int) -> str:
            stream = await client.completions.create(model="default", prompt="x", max_tokens=n, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(n) for n in range(5, 29)))  # 24 streams, 8 run at a time
        finally:
            await client.close()

    texts = asyncio.run(run())
    assert texts == [TEXT[:n] for n in range(5, 29)]


def test_sse_wire_format_ends_with_done(live: Live) -> None:
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == TEXT[:3]


def test_content_parts_max_completion_tokens_and_extensions(live: Live) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 50, "max_completion_tokens": 4, "temperature": 0, "ignore_eos": True,
            "top_k": 5, "top_p": 0.9, "min_p": 0.05, "user": "someone"}
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == TEXT[:4]
    expected = live.srv.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}])
    assert out["usage"]["prompt_tokens"] == len(expected)


def test_null_fields_mean_defaults(live: Live) -> None:
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "n": None, "stream": None, "logprobs": None,
            "stop": None, "seed": None, "echo": None, "best_of": None, "stream_options": None, "top_p": None}
    r = live.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == TEXT[:3]


def test_completions_stop_string_stream_and_not(live: Live) -> None:
    r = live.client.completions.create(model="default", prompt="go", max_tokens=40, temperature=0, stop=["fox"])
    assert r.choices[0].text == "the quick brown "
    assert r.choices[0].finish_reason == "stop"
    stream = live.client.completions.create(model="default", prompt="go", max_tokens=40, temperature=0,
                                            stop=["fox"], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "the quick brown "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_prompt_forms_echo_and_best_of(live: Live) -> None:
    ids = live.srv.tokenizer.encode("abc")
    for prompt in ("abc", ["abc"], ids, [ids]):
        r = live.client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0, best_of=1)
        assert r.choices[0].text == TEXT[:2]
        assert r.usage.prompt_tokens == 3
    r = live.client.completions.create(model="default", prompt="abc", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text == "abc" + TEXT[:2]


def test_seed_reproducible(live: Live) -> None:
    def sample(seed: int) -> str:
        r = live.client.completions.create(model="default", prompt="x", max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_chat_and_completions(live: Live) -> None:
    r = live.client.chat.completions.create(model="default", messages=USER, max_tokens=3, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == list(TEXT[:3])
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    chunks = list(live.client.chat.completions.create(model="default", messages=USER, max_tokens=3, temperature=0,
                                                      logprobs=True, top_logprobs=1, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == list(TEXT[:3])

    r = live.client.completions.create(model="default", prompt="x", max_tokens=3, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == list(TEXT[:3]) and lp.text_offset == [0, 1, 2] and len(lp.token_logprobs) == 3


def test_models_health_server_info(live: Live) -> None:
    models = live.client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert httpx.get(live.url + "/health").status_code == 200
    info = httpx.get(live.url + "/get_server_info").json()
    assert info["max_model_len"] == 512
    assert "avg_spec_accept_length" not in info["internal_states"][0]  # no speculation: absent, like SGLang


def test_idle_connection_outlives_client_pool_expiry(live: Live) -> None:
    """An HTTP/1.1 connection idle for longer than httpx's 5-s pool expiry is still served: the server must
    not be the side that closes it, or a client reusing it at that moment gets a connection reset."""
    import http.client

    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        sock = None
        for pause in (0.0, 5.5):
            time.sleep(pause)
            conn.request("GET", "/health")  # raises (the server closed it) or reconnects if it was closed
            r = conn.getresponse()
            r.read()
            assert r.status == 200
            sock = sock or conn.sock
            assert conn.sock is sock, f"a new connection after {pause} s idle"
    finally:
        conn.close()


# ---------------------------------------------------------------- errors

BAD = [
    ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", "[1, 2]", 400, "Invalid request"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {}, 400, "messages: field required"),
    ("/v1/chat/completions", {"messages": USER, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 10**9}, 400, "512"),
    ("/v1/chat/completions", {"messages": USER, "n": 2}, 400, "n must be 1"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, 400, "requires logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": USER, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"x1": 5}}, 400, "logit_bias keys"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias values"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 1}}, 400, "logit_bias keys"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "chat template"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text content parts"),
    ("/v1/chat/completions", {"messages": USER, "model": "gpt-9"}, 404, "gpt-9"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "exactly one prompt"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x" * 600, "max_tokens": 1}, 400, "600"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[f"{i}-{b[3][:20]}" for i, b in enumerate(BAD)])
def test_bad_requests_give_4xx_with_reason(live: Live, path: str, body, status: int, needle: str) -> None:
    r = live.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] and "message" in err


def test_openai_client_sees_error_classes(live: Live) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        live.client.chat.completions.create(model="default", messages=USER, n=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.client.chat.completions.create(model="nope", messages=USER)
    assert httpx.get(live.url + "/v1/nothing-here").status_code == 404


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    """One server for the stream-interval and API-key tests (neither setting touches what the other checks)."""
    with serve_in_thread(partial(FakeEngine, step_delay=0.001), stream_interval=4, api_key="s3cret") as server:
        yield server.url


def test_stream_interval_gathers_tokens_per_chunk(keyed: str) -> None:
    body = {"prompt": "x", "max_tokens": 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", keyed + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": "Bearer s3cret"}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert "".join(texts) == (TEXT * 2)[:10]
    assert all(len(t) >= 4 for t in texts[:-1]) and len(texts) <= 3  # 1 char = 1 token


def test_api_key_required_on_v1_only(keyed: str) -> None:
    url = keyed
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    assert good.completions.create(model="default", prompt="x", max_tokens=1, temperature=0).choices[0].text == "t"
    assert httpx.get(url + "/health").status_code == 200


def test_queue_full_is_503_with_retry_after() -> None:
    with serve_in_thread(partial(FakeEngine, max_waiting=0)) as server:
        url = server.url
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert "queue is full" in r.json()["error"]["message"]


def test_engine_failure_fails_requests_and_health() -> None:
    with serve_in_thread(BrokenEngine) as server:
        url = server.url
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503


# ---------------------------------------------------------------- abort on disconnect


def test_stream_disconnect_aborts_and_frees_blocks(live: Live) -> None:
    live.on_engine("set_step_delay", 0.01)  # slower steps: a wide margin for "the other stream is still running" below
    body = {"prompt": "x", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as other_client, httpx.Client(timeout=30) as client:
        with other_client.stream("POST", live.url + "/v1/completions", json={**body, "max_tokens": 300}) as other:
            other_lines = other.iter_lines()
            next(other_lines)
            with client.stream("POST", live.url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                first = json.loads(next(lines)[6:])
                for _ in range(5):
                    next(lines)
                held = live.on_engine("blocks_by_request")
                assert held.get(first["id"], 0) > 0 and len(held) == 2
            # the response is closed: the connection drops mid-stream
            wait_until(lambda: first["id"] in live.on_engine("aborted_ids"))
            held, used = live.on_engine("kv_state")
            assert first["id"] not in held
            assert len(held) == 1, "the other stream should still be generating"
            assert used == sum(held.values())  # nothing left behind by the aborted request
            live.on_engine("set_step_delay", 0.001)
            rest = [json.loads(line[6:]) for line in other_lines if line and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert len(text) > 0 and live.on_engine("blocks_used") == 0


def test_disconnect_after_two_chunks_frees_kv_and_gauges_fall_without_traffic(live: Live) -> None:
    wait_until(lambda: not live.on_engine("has_unfinished_requests"))
    body = {"prompt": "x", "max_tokens": 450, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", live.url + "/v1/completions", json=body) as resp:
            lines = (line for line in resp.iter_lines() if line)
            rid = json.loads(next(lines)[6:])["id"]
            next(lines)
            m = scrape(live.url)
            assert m["specserve:num_requests_running"] == 1 and m["specserve:kv_cache_usage_perc"] > 0
    # nothing else is sent to the engine: the abort alone must bring the gauges down
    wait_until(lambda: scrape(live.url)["specserve:num_requests_running"] == 0)
    m = scrape(live.url)
    assert m["specserve:kv_cache_usage_perc"] == 0
    assert m["specserve:request_success_total{finished_reason=abort}"] >= 1
    assert rid in live.on_engine("aborted_ids") and live.on_engine("blocks_used") == 0


def test_nonstream_disconnect_aborts(live: Live) -> None:
    before = len(live.on_engine("aborted_ids"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 450, "temperature": 0},
                   timeout=httpx.Timeout(30, read=0.1))
    wait_until(lambda: len(live.on_engine("aborted_ids")) == before + 1)
    wait_until(lambda: not live.on_engine("has_unfinished_requests"))


# ---------------------------------------------------------------- metrics / speculation stats


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_parse_and_move(live: Live) -> None:
    before = scrape(live.url)
    live.client.completions.create(model="default", prompt="abcd", max_tokens=5, temperature=0)
    after = scrape(live.url)
    assert after["specserve:generation_tokens_total"] - before["specserve:generation_tokens_total"] == 5
    assert after["specserve:prompt_tokens_total"] - before["specserve:prompt_tokens_total"] == 4
    assert after["specserve:time_to_first_token_seconds_count"] == before["specserve:time_to_first_token_seconds_count"] + 1
    assert after["specserve:e2e_request_latency_seconds_count"] == before["specserve:e2e_request_latency_seconds_count"] + 1
    assert after["specserve:inter_token_latency_seconds_count"] == before["specserve:inter_token_latency_seconds_count"] + 4
    assert after["specserve:request_success_total{finished_reason=length}"] >= 1
    for name in ("specserve:num_requests_running", "specserve:num_requests_waiting", "specserve:kv_cache_usage_perc",
                 "specserve:num_preemptions_total", "specserve:request_time_per_output_token_seconds_count"):
        assert name in after


def test_speculation_stats_in_usage_metrics_and_server_info(spec_live: Live) -> None:
    r = spec_live.client.completions.create(model="alias", prompt="x", max_tokens=7, temperature=0)
    # step 1 gives 1 token (prefill), then 3 per verify step: 1 + 3 + 3
    assert r.usage.completion_tokens == 7
    assert r.usage.model_extra["spec_verify_steps"] == 2
    assert r.usage.model_extra["spec_draft_tokens"] == 6
    assert r.usage.model_extra["spec_accepted_tokens"] == 4
    assert r.usage.model_extra["spec_accept_length"] == 3.0
    m = scrape(spec_live.url)
    assert m["specserve:spec_accepted_tokens_per_pos_total{position=0}"] == 2
    assert m["specserve:spec_accepted_tokens_per_pos_total{position=1}"] == 2
    assert m["specserve:spec_accepted_tokens_per_pos_total{position=2}"] == 0
    assert m["specserve:spec_draft_tokens_per_pos_total{position=2}"] == 2
    assert m["specserve:spec_k_chosen_total{k=3}"] >= 2
    assert m["specserve:spec_avg_accept_length"] == 3.0
    assert m["specserve:request_spec_accept_length_count"] == 1
    info = httpx.get(spec_live.url + "/get_server_info").json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == 3.0
    assert httpx.get(spec_live.url + "/server_info").json()["internal_states"][0]["avg_spec_accept_length"] == 3.0
