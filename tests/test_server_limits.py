"""Request limits, strict types and the one error shape, against the fake engine (fast).

A body over --max-request-bytes is refused (413) before it is read while other streams flow; types are
strict where OpenAI's are; every error, from every layer, has the shape
{"error": {"message", "type", "param", "code"}} with a string (or null) code; GET /v1/models/{id}.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402
from test_server_api import USER, Live  # noqa: E402

from specserve.server.launch import serve_in_thread  # noqa: E402

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with serve_in_thread(partial(FakeEngine, step_delay=0.005, max_model_len=4096, num_blocks=2048),
                         max_request_bytes=LIMIT) as server:
        yield Live(server)


def check_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] is None or isinstance(err["code"], str), err  # never an integer
    return err


# ---------------------------------------------------------------- body size


def test_10mb_body_gets_413_while_a_stream_keeps_flowing(live: Live) -> None:
    chunks: list[float] = []
    finish: list[str | None] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(time.monotonic())
                    finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    big = json.dumps({"prompt": "y" * (10 << 20), "max_tokens": 1}).encode()
    before = len(chunks)
    r = httpx.post(live.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    answered = time.monotonic()
    err = check_error_shape(r, 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert r.elapsed.total_seconds() < 10  # generous: refused from Content-Length, the body never parsed
    t.join(60)
    # the stream was running before and after the refusal, and ended normally with every token
    assert before >= 1 and any(c > answered for c in chunks), "the stream stalled around the 413"
    assert finish[-1] == "length" and len(chunks) >= 2
    assert httpx.get(live.url + "/health").status_code == 200


def test_chunked_body_over_the_limit_is_refused_while_it_streams_in(live: Live) -> None:
    sent = []

    def body() -> Iterator[bytes]:  # no Content-Length: the limit is checked as the chunks arrive
        yield b'{"prompt": "'
        for _ in range(64):
            sent.append(1)
            yield b"z" * 8192
        yield b'", "max_tokens": 1}'

    try:
        r = httpx.post(live.url + "/v1/completions", content=body(), headers={"content-type": "application/json"},
                       timeout=30)
    except httpx.TransportError:  # the server may close before the client has sent everything
        pytest.fail("no 413 answer to a chunked body over the limit")
    check_error_shape(r, 413)
    small = {"prompt": "ok" * 100, "max_tokens": 2, "temperature": 0}

    def small_body() -> Iterator[bytes]:
        yield json.dumps(small).encode()

    r = httpx.post(live.url + "/v1/completions", content=small_body(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "th"  # under the limit: served


# ---------------------------------------------------------------- strict types and the error shape

STRICT = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "seed": "7"}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": "true"}, "echo"),
    ("/v1/completions", {"prompt": ["1", 2]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
]


@pytest.mark.parametrize("path,body,param", STRICT, ids=[f"{b[2]}-{i}" for i, b in enumerate(STRICT)])
def test_strict_types_are_400_naming_the_field(live: Live, path: str, body: dict, param: str) -> None:
    err = check_error_shape(live.post(path, body), 400)
    assert err["param"] == param and param in err["message"] and err["code"] == "invalid_request"


def test_floats_take_integers_and_null_means_default(live: Live) -> None:
    r = live.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0, "top_p": 1,
                                      "stream": None, "seed": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "the"


@pytest.mark.parametrize("method,path,body,status,code", [
    ("POST", "/v1/completions", "{not json", 400, "invalid_request"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400, "invalid_request"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model_not_found"),
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("GET", "/v1/models/gpt-9", None, 404, "model_not_found"),
])
def test_one_error_shape_with_string_codes(live: Live, method: str, path: str, body, status: int, code: str) -> None:
    if method == "POST":
        r = live.post(path, body)
    else:
        r = httpx.get(live.url + path, timeout=30)
    assert check_error_shape(r, status)["code"] == code


def test_get_model_by_id(live: Live) -> None:
    r = httpx.get(live.url + "/v1/models/fake-model", timeout=30)
    assert r.status_code == 200
    card = r.json()
    assert card["id"] == "fake-model" and card["object"] == "model" and card["max_model_len"] == 4096
    assert live.client.models.retrieve("fake-model").id == "fake-model"
