"""A fake OpenAI-style streaming server with known timings, for testing the benchmark itself.

It answers /v1/completions and /v1/chat/completions by streaming ``max_tokens`` tokens: the
first chunk after ``ttft_s``, then one chunk every ``itl_s``, ``tokens_per_chunk`` tokens each
(several per chunk is what a speculative server looks like). Usage carries the speculation
extension fields; /metrics exports counters and a k histogram under the names the benchmark
looks for; /get_server_info reports an accept length the way SGLang does.

    python -m specserve.bench.fake_server --port 8123 --ttft 0.2 --itl 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class FakeSpec:
    ttft_s: float = 0.2
    itl_s: float = 0.05
    tokens_per_chunk: int = 1
    draft_k: int = 3  # reported draft tokens per verify step
    send_token_ids: bool = True  # put a token_ids list in each chunk (lets the client count exactly)
    fail_every: int = 0  # every n-th request answers HTTP 500 (0: never)
    break_every: int = 0  # every n-th request's stream stops after one chunk, without [DONE]
    model: str = "fake-model"


def make_app(spec: FakeSpec) -> Starlette:
    # the names and shapes specserve's server exports (server/metrics.py)
    reg = CollectorRegistry(auto_describe=True)
    steps = Counter("specserve:spec_verify_steps", "verify steps", registry=reg)
    accepted = Counter("specserve:spec_accepted_tokens", "accepted draft tokens", registry=reg)
    drafted = Counter("specserve:spec_draft_tokens", "draft tokens", registry=reg)
    engine_steps = Counter("specserve:engine_steps", "engine steps", registry=reg)
    spec_steps = Counter("specserve:spec_steps", "engine steps that speculated", registry=reg)
    k_chosen = Counter("specserve:spec_k_chosen", "k chosen per request-step", ["k"], registry=reg)
    ttft_hist = Histogram("specserve:time_to_first_token_seconds", "TTFT", registry=reg)
    state = {"requests": 0}

    async def generate(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        state["requests"] += 1
        broken = bool(spec.break_every and state["requests"] % spec.break_every == 0)
        if spec.fail_every and state["requests"] % spec.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        n = int(body.get("max_tokens") or 16)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(str(prompt).split())

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
            obj: dict[str, Any] = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": int(time.time()), "model": spec.model,
                                   "choices": [choice] if choice else []}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def stream() -> AsyncIterator[str]:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            await asyncio.sleep(spec.ttft_s)
            sent, n_chunks = 0, 0
            while sent < n:
                if n_chunks:
                    await asyncio.sleep(spec.itl_s)
                m = min(spec.tokens_per_chunk, n - sent)
                ids = list(range(sent, sent + m))
                text = "".join(f" t{i}" for i in ids)
                sent += m
                n_chunks += 1
                if n_chunks == 1:
                    ttft_hist.observe(spec.ttft_s)
                steps.inc()
                accepted.inc(m - 1)
                drafted.inc(spec.draft_k)
                engine_steps.inc()
                spec_steps.inc()
                k_chosen.labels(k=str(spec.draft_k)).inc()
                finish = "length" if sent == n else None
                choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                if spec.send_token_ids:
                    choice["token_ids"] = ids
                yield chunk(choice)
                if broken:
                    return  # a server dying mid-stream
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk(None, {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n, "spec_verify_steps": n_chunks,
                                   "spec_accepted_tokens": n - n_chunks, "spec_draft_tokens": n_chunks * spec.draft_k})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": spec.model, "object": "model"}]})

    async def server_info(_: Request) -> Response:
        return JSONResponse({"model_path": spec.model,
                             "internal_states": [{"avg_spec_accept_length": float(spec.tokens_per_chunk)}]})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(reg), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/health", health),
        Route("/v1/models", models),
        Route("/get_server_info", server_info),
        Route("/metrics", metrics),
    ])


class ThreadedServer:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app: Any):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="fake streaming OpenAI server for benchmark tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft", type=float, default=0.2)
    p.add_argument("--itl", type=float, default=0.05)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--startup-delay", type=float, default=0.0, help="sleep before listening")
    p.add_argument("--crash", action="store_true", help="exit at once with status 3 (a server that fails to start)")
    a = p.parse_args()
    if a.crash:
        print("fake server: crashing on purpose", flush=True)
        raise SystemExit(3)
    time.sleep(a.startup_delay)
    spec = FakeSpec(ttft_s=a.ttft, itl_s=a.itl, tokens_per_chunk=a.tokens_per_chunk)
    uvicorn.run(make_app(spec), host=a.host, port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
