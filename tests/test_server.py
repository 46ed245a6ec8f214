"""End-to-end: the official openai client against a live server running the real SmolLM2 engine.

One server for the module; small max_tokens keep it to seconds. Edge cases of the protocol are
tested against a fake engine in test_server_api.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

torch = pytest.importorskip("torch")

MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "List three colors."}]


def wait_until(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class Live:
    def __init__(self, server) -> None:
        self.url = server.url
        self.server = server
        self.srv = server.app.state.server
        self.tokenizer = self.srv.tokenizer
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def on_engine(self, fn, *args):
        """Run an engine method (by name) or fn(engine, *args) in the engine-core process, between steps."""
        return self.server.on_engine(fn, *args)


def at_once(*calls) -> list:
    """The calls' results, the requests sent together (the server batches them: about the steps of the longest)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


@pytest.fixture(scope="module")
def live(smollm2_server) -> Live:
    return Live(smollm2_server)  # (conftest: a MAX_MODEL_LEN context, 96 blocks, 8 sequences)


def test_chat_stream_matches_nonstream_with_consistent_usage(live: Live) -> None:
    kw = dict(model="default", messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    r, chunks = at_once(lambda: live.client.chat.completions.create(**kw),
                         lambda: list(live.client.chat.completions.create(**kw, stream=True,
                                                                          stream_options={"include_usage": True})))
    text = r.choices[0].message.content
    prompt_len = len(live.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    assert text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 12, prompt_len + 12)

    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, 12)


def test_completions_stop_string(live: Live) -> None:
    prompt = "The three primary colors are"
    full = live.client.completions.create(model="default", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = full[: full.index(stop)]
    r = live.client.completions.create(model="default", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    chunks = list(live.client.completions.create(model="default", prompt=prompt, max_tokens=16, temperature=0,
                                                 stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_equals_nonstream_for_stop_strings_spanning_1_to_4_tokens(live: Live) -> None:
    from test_stop_strings import PARIS, spanning_stops

    kw = dict(model="default", messages=PARIS, max_tokens=12, temperature=0)
    full = live.client.chat.completions.create(**kw).choices[0].message.content
    pieces = [live.tokenizer.decode([t]) for t in live.tokenizer.encode(full)]
    assert "".join(pieces) == full
    stops = ["that has", *spanning_stops(pieces)]

    def nonstream(stop: str) -> str:
        return live.client.chat.completions.create(**kw, stop=[stop]).choices[0].message.content

    def stream(stop: str) -> str:
        chunks = live.client.chat.completions.create(**kw, stop=[stop], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(nonstream, stops))
        streamed = list(pool.map(stream, stops))
    for stop, a, b in zip(stops, plain, streamed):
        assert a == full[: full.index(stop)], stop
        assert b == a, stop


def test_seed_reproducible_and_logprob_count_matches_usage(live: Live) -> None:
    def sample(seed: int):
        return live.client.completions.create(model="default", prompt="Once upon a time", max_tokens=10,
                                              temperature=1.0, seed=seed, logprobs=1)

    a, b = sample(1234), sample(1234)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    assert len(a.choices[0].logprobs.tokens) == a.usage.completion_tokens
    assert all(lp <= 0 for lp in a.choices[0].logprobs.token_logprobs)


def test_prompt_too_long_and_huge_max_tokens_are_400_with_lengths(live: Live) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model="default", prompt="hello " * 600, max_tokens=1)
    assert str(MAX_MODEL_LEN) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model="default", messages=CHAT, max_tokens=100_000)
    assert str(MAX_MODEL_LEN) in e.value.message and "100000" in e.value.message
    with pytest.raises(openai.BadRequestError, match="token ids"):
        live.client.completions.create(model="default", prompt=[1, 10**7], max_tokens=1)


def test_stop_reason_is_null_for_eos_and_the_id_for_a_stop_token(live: Live) -> None:
    body = {"model": "default", "messages": CHAT, "max_tokens": 64, "temperature": 0}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] is None  # EOS, as vLLM
    ids = live.tokenizer.encode(r["message"]["content"])
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "stop_token_ids": [ids[1]]},
                   timeout=120).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == ids[1]


def test_a_long_prompt_is_tokenized_off_the_event_loop(live: Live) -> None:
    """~2 MB of prompt takes the tokenizer a second or more; /health keeps answering meanwhile."""
    import threading

    done: list[float] = []
    answer: list[httpx.Response] = []

    def big() -> None:
        answer.append(httpx.post(live.url + "/v1/completions", json={"prompt": "hello world. " * 160_000,
                                                                      "max_tokens": 1}, timeout=120))
        done.append(time.monotonic())

    t = threading.Thread(target=big)
    start = time.monotonic()
    t.start()
    beats = []
    while t.is_alive():
        assert httpx.get(live.url + "/health", timeout=60).status_code == 200
        beats.append(time.monotonic())
        time.sleep(0.01)
    t.join()
    assert answer[0].status_code == 400 and str(MAX_MODEL_LEN) in answer[0].text  # far too long
    took = done[0] - start
    gaps = [b - a for a, b in zip([start, *beats], beats)]
    assert max(gaps) < took / 2, (max(gaps), took)  # not one long stall while it was tokenized


def _blocks(e) -> tuple[dict[str, int], int]:
    held = {rid: len(r.kv.block_table) for rid, r in e.requests.items()}
    return held, e.blocks.num_blocks - e.blocks.num_free_blocks


def test_disconnect_mid_stream_frees_blocks_other_stream_unaffected(live: Live) -> None:
    body = {"model": "default", "prompt": "Write a long story about a dragon.", "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c1, httpx.Client(timeout=120) as c2:
        with c1.stream("POST", live.url + "/v1/completions", json={**body, "max_tokens": 40}) as keep:
            keep_lines = keep.iter_lines()
            keep_id = json.loads(next(line for line in keep_lines if line)[6:])["id"]
            with c2.stream("POST", live.url + "/v1/completions", json={**body, "max_tokens": 400}) as drop:
                drop_lines = (line for line in drop.iter_lines() if line)
                drop_id = json.loads(next(drop_lines)[6:])["id"]
                next(drop_lines)
                held, _ = live.on_engine(_blocks)
                assert held.get(drop_id, 0) > 0
            # closing the response dropped the connection mid-stream
            wait_until(lambda: drop_id not in live.on_engine(_blocks)[0])
            held, used = live.on_engine(_blocks)
            assert keep_id in held, "the other stream should still be generating"
            assert used == sum(held.values())  # the dropped request's blocks are free
            rest = [json.loads(line[6:]) for line in keep_lines if line and line != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: not live.on_engine("has_unfinished_requests"))
    assert live.on_engine(_blocks) == ({}, 0)


def _scrape(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_and_server_info_move(live: Live) -> None:
    before = _scrape(live.url)
    r = live.client.completions.create(model="default", prompt="Hello", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = _scrape(live.url)
    assert after["specserve:generation_tokens_total"] - before["specserve:generation_tokens_total"] == 4
    assert after["specserve:prompt_tokens_total"] - before["specserve:prompt_tokens_total"] == r.usage.prompt_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds"):
        assert after[f"specserve:{h}_count"] == before[f"specserve:{h}_count"] + 1, h
    assert after["specserve:engine_steps_total"] > before["specserve:engine_steps_total"]
    info = httpx.get(live.url + "/get_server_info").json()
    assert info["internal_states"][0]["generation_tokens"] >= 4
    assert [m.id for m in live.client.models.list().data] == [live.srv.info.model_name]


@pytest.fixture(scope="module")
def spec_live(smollm2_spec_server) -> Live:
    """A server speculating (conftest: the shipped EAGLE-3 head, static chains of 3): drafts accepted and not."""
    return Live(smollm2_spec_server)


def test_speculation_stats_reach_usage_server_info_and_metrics(spec_live: Live) -> None:
    before = _scrape(spec_live.url)
    r = spec_live.client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    u = r.usage.model_extra
    assert r.usage.completion_tokens == 6
    assert u["spec_verify_steps"] > 0 and u["spec_draft_tokens"] >= u["spec_verify_steps"]
    assert 0 <= u["spec_accepted_tokens"] <= u["spec_draft_tokens"]
    assert u["spec_accept_length"] == pytest.approx((u["spec_accepted_tokens"] + u["spec_verify_steps"])
                                                    / u["spec_verify_steps"])
    state = httpx.get(spec_live.url + "/get_server_info").json()["internal_states"][0]
    assert state["avg_spec_accept_length"] >= 1.0
    after = _scrape(spec_live.url)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("specserve:spec_verify_steps_total") == u["spec_verify_steps"]
    assert moved("specserve:spec_draft_tokens_total") == u["spec_draft_tokens"]
    assert moved("specserve:spec_accepted_tokens_total") == u["spec_accepted_tokens"]
    assert sum(v for k, v in after.items() if k.startswith("specserve:spec_draft_tokens_per_pos_total")) \
        == after["specserve:spec_draft_tokens_total"]
    assert any(k.startswith("specserve:spec_k_chosen_total") for k in after)
    assert 0 < after["specserve:spec_step_share"] <= 1


def test_cli_serve_subprocess_with_api_key(tmp_path) -> None:
    """`specserve serve` (cli -> server.launch.main) starts, guards /v1 with the key, answers, and stops.

    The tiny model with dummy weights: this checks the wiring; the model's output is checked above (SmolLM2's
    135M random weights took ~5 s of the start-up)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"), vocab=64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", model, "--port", str(port), "--max-model-len", "256",
           "--num-kv-blocks", "32", "--api-key", "k3y", "--served-model-name", "smol", "--speculative-algorithm",
           "NONE", "--load-format", "dummy", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=180)
        assert httpx.get(url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        r = client.completions.create(model="smol", prompt="Hi", max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    # start-up objects were frozen out of the garbage collector's reach before serving
    assert "start-up objects out of the garbage collector's reach" in proc.stdout.read()


def test_logit_bias_and_penalties_through_the_openai_client(live: Live) -> None:
    """+100 on a token makes every token it; a key past the vocabulary is a 400; penalties are taken."""
    tok = live.tokenizer.encode(" blue", add_special_tokens=False)[0]
    word = live.tokenizer.decode([tok])
    r = live.client.chat.completions.create(model="default", messages=CHAT, max_tokens=5, temperature=0.7,
                                            logit_bias={str(tok): 100})
    assert r.choices[0].message.content == word * 5
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        live.client.completions.create(model="default", prompt="x", max_tokens=2, logit_bias={"10000000": -100})
    r = live.client.completions.create(model="default", prompt="1, 1, 1, 1,", max_tokens=6, temperature=0,
                                       frequency_penalty=2.0, presence_penalty=2.0,
                                       extra_body={"repetition_penalty": 1.5, "ignore_eos": True})
    assert r.usage.completion_tokens == 6 and " 1," not in r.choices[0].text


def test_seeded_text_is_the_same_alone_and_among_concurrent_requests(live: Live) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def seeded(seed: int) -> str:
        return live.client.completions.create(model="default", prompt="Once upon a time", max_tokens=8,
                                              temperature=0.9, seed=seed).choices[0].text

    def other(i: int) -> str:
        return live.client.completions.create(model="default", prompt=f"Count to {i}:", max_tokens=3 + i % 4,
                                              temperature=1.0).choices[0].text

    alone = seeded(4321)
    with ThreadPoolExecutor(17) as pool:
        busy = [pool.submit(other, i) for i in range(16)]
        loaded = pool.submit(seeded, 4321)
        assert all(f.result() is not None for f in busy)
    assert loaded.result() == alone
    assert seeded(4322) != alone
