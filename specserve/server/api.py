"""OpenAI-compatible HTTP front-end (FastAPI) of an engine-core process; launch.py runs it.

The front-end tokenizes, applies the chat template, sends token ids to the engine core
(engine_core.py), and turns the ids it gets back into text and SSE chunks (client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
import msgspec
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.sampling_params import SamplingParams
from specserve.server import protocol as P
from specserve.server.client import EngineClient, EngineDeadError, RequestRejected, RequestState
from specserve.server.metrics import ServerMetrics, avg_accept_length
from specserve.structured import tools as T

log = logging.getLogger(__name__)

QUEUE_FULL_RETRY_AFTER_S = 1
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, err_type: str, code: str | None = None,
        param: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type
        self.code, self.param, self.headers = code, param, headers


def _error(status: int, message: str, err_type: str, code: str | None = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, err_type, code, param), status_code=status, headers=headers)


def _format_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", err.get("msg", ""))
            return f"Request body is not valid JSON: {reason}", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            msg = "field required"
        parts.append(f"{where}: {msg}")
    return "Invalid request: " + "; ".join(parts), param


class ServerState:
    """State shared by the route handlers of one front-end."""

    def __init__(self, client: EngineClient, served_model_names: list[str] | None, api_key: str | None) -> None:
        self.client = client
        self.requested_names = served_model_names
        self.model_names: list[str] = []
        self.api_key = api_key
        self.metrics: ServerMetrics | None = None
        self.tokenizer: Any = None
        self.accepting = True  # False once shutting down: new requests get 503
        self.started = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def info(self) -> Any:
        return self.client.info

    def check_model(self, requested: str | None) -> None:
        if requested is None or requested == "default" or requested in self.model_names:
            return
        raise ApiError(
            404, f"The model `{requested}` does not exist. Served: {', '.join(self.model_names)}",
            "NotFoundError", "model_not_found", "model",
        )

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     arrival: float) -> RequestState:
        if not self.accepting:
            raise ApiError(503, "The server is shutting down.", "ServiceUnavailableError", "shutting_down")
        try:
            return await self.client.add_request(request_id, prompt_ids, params, arrival)
        except EngineDeadError as e:
            raise ApiError(503, f"The engine is not running: {e}", "ServiceUnavailableError", "engine_dead") from e
        except RequestRejected as e:
            if e.status == 503:
                raise ApiError(
                    503, f"Server overloaded: the waiting queue is full ({e}). Retry later.",
                    "ServiceUnavailableError", "queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
                ) from e
            if e.status == 400:  # the engine's verdict on the input (lengths, token ids, ...)
                raise ApiError(400, str(e), "BadRequestError", "invalid_request") from e
            raise ApiError(e.status, str(e), "InternalServerError", "internal_error") from e

    async def drain(self, timeout: float) -> None:
        """Stop admission, let requests in flight finish for up to ``timeout`` s, abort the rest."""
        self.accepting = False
        client = self.client
        log.info("shutting down: %d requests in flight, waiting up to %.0f s", client.num_in_flight, timeout)
        deadline = time.monotonic() + timeout
        while client.num_in_flight and time.monotonic() < deadline and client.is_alive:
            await asyncio.sleep(0.02)
        n = client.abort_all()
        if n:
            log.info("aborted %d requests still running after %.0f s", n, timeout)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(srv: ServerState, state: RequestState, request: Request) -> bool:
    """Wait for a non-streaming request to finish; False if the client went away first (aborted)."""
    task = asyncio.ensure_future(state.result())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            try:
                task.result()
            except EngineDeadError as e:
                raise ApiError(503, f"The engine stopped: {e}", "ServiceUnavailableError", "engine_dead") from e
            return True
        return False
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        srv.client.abort(state.request_id)  # a no-op once finished


async def _abort(client: EngineClient, request_id: str) -> None:
    """After a stream: abort it if it has not finished (a no-op once finished). A coroutine, so it runs
    on the event loop (a plain function would go to a worker thread, racing the loop on the socket)."""
    client.abort(request_id)


_json = msgspec.json.Encoder()


class _ApiKeyCheck:
    """Bearer-key check on /v1 routes, as plain ASGI (starlette's BaseHTTPMiddleware wraps every
    streamed chunk in an extra task and queue)."""

    def __init__(self, app: Any, srv: ServerState) -> None:
        self.app, self.srv = app, srv

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        key = self.srv.api_key
        if key is not None and scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
                response = _error(401, "Missing or invalid API key (send `Authorization: Bearer <key>`).",
                                  "AuthenticationError", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# characters JSON leaves raw that line splitters such as str.splitlines (httpx's aiter_lines) break at
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _sse(obj: dict[str, Any]) -> bytes:
    data = _json.encode(obj)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:  # (inside JSON strings only: escaping keeps it valid)
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before the app reads or parses it,
    decided from Content-Length, or while a chunked body streams in (buffered up to the limit)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:  # the server enforces the declared length
            if int(length) > self.max_bytes:
                return await self._reject(scope, receive, send)
            return await self.app(scope, receive, send)
        buffered, size = [], 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        message = f"Request body too large: the limit is {self.max_bytes} bytes (--max-request-bytes)."
        # no "Connection: close": uvicorn then reads the unread body past the response and drops it; a
        # socket closed on unread bytes resets, and a client still sending its body would lose the 413
        response = _error(413, message, "BadRequestError", "request_too_large")
        await response(scope, receive, send)


def build_app(client: EngineClient, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, startup_timeout: float = 3600.0,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app of one front-end; it connects to the engine core on start-up (lifespan)."""
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    srv = ServerState(client, names, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.loop = asyncio.get_running_loop()
        info = await client.start(startup_timeout)
        srv.tokenizer = info.tokenizer
        srv.model_names = list(srv.requested_names or []) or [info.model_name]
        srv.metrics = client.metrics = ServerMetrics(srv.model_names[0], engine_stats=client.client_index == 0)
        try:
            yield
        finally:
            client.close()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    # ------------------------------------------------------------ errors

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.err_type, exc.code, exc.param, exc.headers)

    @app.exception_handler(P.BadRequest)
    async def _bad_request(request: Request, exc: P.BadRequest) -> JSONResponse:
        return _error(400, str(exc), "BadRequestError", "invalid_request", exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _format_validation_errors(list(exc.errors()))
        return _error(400, message, "BadRequestError", "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(exc.status_code, str(exc.detail), err_type, _HTTP_CODES.get(exc.status_code),
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(500, f"Internal server error: {type(exc).__name__}: {exc}", "InternalServerError",
                      "internal_error")

    app.add_middleware(_ApiKeyCheck, srv=srv)

    # ------------------------------------------------------------ info endpoints

    @app.get("/health")
    async def health() -> Response:
        if client.is_alive and srv.accepting:
            return JSONResponse({"status": "ok"})
        why = "shutting down" if client.is_alive else f"engine is not running: {client.error}"
        return _error(503, why, "ServiceUnavailableError", "shutting_down" if client.is_alive else "engine_dead")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": srv.started, "owned_by": "specserve",
                "root": getattr(srv.info.config, "model", None) or name, "max_model_len": srv.info.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in srv.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        srv.check_model(model_id)  # 404 in the one error shape; "default" names the first
        return model_card(model_id if model_id in srv.model_names else srv.model_name)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        stats = client.stats
        state = {k: ({str(i): v for i, v in sorted(x.items())} if isinstance(x, dict) else x)
                 for k, x in vars(stats).items()} if stats is not None else {}
        accept = avg_accept_length(stats)
        if accept is not None:  # absent without speculation, as SGLang does
            state["avg_spec_accept_length"] = accept
        state["last_gen_throughput"] = srv.metrics.last_gen_throughput()
        cfg = srv.info.config
        spec = getattr(cfg, "speculative", None)
        return jsonable_encoder({
            "served_model_name": srv.model_name,
            "model_path": getattr(cfg, "model", None),
            "max_model_len": srv.info.max_model_len,
            "speculative_algorithm": getattr(spec, "algorithm", None),
            "engine_config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
            "engine_core_pid": srv.info.core_pid,
            "front_end_pid": os.getpid(),
            "internal_states": [state],
        })

    # ------------------------------------------------------------ chat

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        srv.check_model(body.model)
        params = body.to_sampling_params()
        try:  # in a thread: the tokenizer releases the GIL, so other streams and /health keep flowing
            prompt_ids = await asyncio.to_thread(srv.tokenizer.apply_chat_template, body.chat_messages(),
                                                 add_generation_prompt=True)
        except Exception as e:  # a template may refuse a message sequence (roles, order)
            raise P.BadRequest(f"Could not apply the chat template to these messages: {e}", "messages") from e
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created, model = P.now(), body.model or srv.model_name
        top_n = body.top_logprobs or 0
        plan = body.tool_plan()
        tools = plan is not None and plan.active  # the output is parsed for tool calls
        state = await srv.submit(request_id, list(prompt_ids), params, arrival)

        if body.stream:
            gen = _chat_stream(srv, state, created, model, top_n, body.include_usage, tools)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(_abort, client, request_id))
        if not await _collect(srv, state, request):
            return Response(status_code=499)  # client closed the request; nobody reads this
        message: dict[str, Any] = {"role": "assistant", "content": state.text}
        finish_reason = state.finish_reason
        if tools:
            message["content"], calls = T.parse_tool_calls(state.text)
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": (P.chat_logprobs(srv.tokenizer, state.token_ids, state.logprobs, top_n)
                         if state.logprobs is not None else None),
            "finish_reason": finish_reason,
            "stop_reason": state.stop_reason,
        }
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": P.usage_dict(state),
        })

    # ------------------------------------------------------------ completions

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        srv.check_model(body.model)
        params = body.to_sampling_params()
        prompt = body.single_prompt()
        if body.echo and body.logprobs is not None:
            raise P.BadRequest("echo with logprobs is not supported (no prompt logprobs)", "echo")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created, model = P.now(), body.model or srv.model_name
        top_n = body.logprobs or 0
        # (special tokens as the offline engine adds them: Gemma's BOS)
        prompt_ids = (await asyncio.to_thread(srv.tokenizer.encode, prompt, add_special_tokens=True)
                      if isinstance(prompt, str) else list(prompt))
        state = await srv.submit(request_id, prompt_ids, params, arrival)
        echo_text = "" if not body.echo else (prompt if isinstance(prompt, str) else srv.tokenizer.decode(prompt))

        if body.stream:
            gen = _completion_stream(srv, state, created, model, top_n, body.include_usage, echo_text)
            return StreamingResponse(gen, media_type="text/event-stream", headers=_SSE_HEADERS,
                                     background=BackgroundTask(_abort, client, request_id))
        if not await _collect(srv, state, request):
            return Response(status_code=499)
        logprobs = None
        if state.logprobs is not None:
            logprobs = P.completion_logprobs(srv.tokenizer, state.token_ids, state.logprobs, top_n, len(echo_text))
        choice = {"index": 0, "text": echo_text + state.text, "logprobs": logprobs,
                  "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": P.usage_dict(state),
        })

    return app


# ---------------------------------------------------------------- SSE generators


async def _chat_stream(srv: ServerState, state: RequestState, created: int, model: str, top_n: int,
                       include_usage: bool, tools: bool = False) -> AsyncIterator[bytes]:
    request_id = state.request_id
    calls = T.ToolCallStream() if tools else None

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              stop_reason: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        obj = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return obj

    try:
        first = True
        while True:
            text, ids, lps, last = await state.next_chunk()
            if first:  # sent with the first output, so a client's time-to-first-chunk is a real TTFT
                yield _sse(chunk({"role": "assistant", "content": ""}))
                first = False
            logprobs = P.chat_logprobs(srv.tokenizer, ids, lps, top_n) if lps and ids else None
            made: list[dict[str, Any]] = []
            if calls is not None:
                text, made = calls.feed(text, final=last)
            delta: dict[str, Any] = {"content": text} if text else {}
            if made:
                delta["tool_calls"] = made
            if last:
                finish = state.finish_reason
                if calls is not None and calls.num_calls and finish == "stop":
                    finish = "tool_calls"
                yield _sse(chunk(delta, finish, logprobs, state.stop_reason))
                break
            if delta or logprobs:
                yield _sse(chunk(delta, None, logprobs))
        if include_usage:
            yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": P.usage_dict(state)})
    except EngineDeadError as e:
        yield _sse(P.error_body(f"The engine stopped: {e}", "ServiceUnavailableError", "engine_dead"))
    except Exception as e:
        log.exception("stream %s failed", request_id)
        yield _sse(P.error_body(f"Internal server error: {type(e).__name__}: {e}", "InternalServerError",
                                "internal_error"))
    finally:
        srv.client.abort(request_id)  # frees its KV blocks when the client went away mid-stream
    yield b"data: [DONE]\n\n"


async def _completion_stream(srv: ServerState, state: RequestState, created: int, model: str, top_n: int,
                             include_usage: bool, echo_text: str) -> AsyncIterator[bytes]:
    request_id = state.request_id

    def chunk(text: str, finish: str | None = None, logprobs: Any = None, stop_reason: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        obj = {"id": request_id, "object": "text_completion", "created": created, "model": model,
               "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return obj

    try:
        if echo_text:
            yield _sse(chunk(echo_text))
        offset = len(echo_text)
        while True:
            text, ids, lps, last = await state.next_chunk()
            logprobs = P.completion_logprobs(srv.tokenizer, ids, lps, top_n, offset) if lps and ids else None
            offset += len(text)
            if last:
                yield _sse(chunk(text, state.finish_reason, logprobs, state.stop_reason))
                break
            if text or logprobs:
                yield _sse(chunk(text, None, logprobs))
        if include_usage:
            yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": P.usage_dict(state)})
    except EngineDeadError as e:
        yield _sse(P.error_body(f"The engine stopped: {e}", "ServiceUnavailableError", "engine_dead"))
    except Exception as e:
        log.exception("stream %s failed", request_id)
        yield _sse(P.error_body(f"Internal server error: {type(e).__name__}: {e}", "InternalServerError",
                                "internal_error"))
    finally:
        srv.client.abort(request_id)
    yield b"data: [DONE]\n\n"
