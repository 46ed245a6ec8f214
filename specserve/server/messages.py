"""What crosses the process boundary between the front-ends and the engine core.

msgpack (msgspec) frames over ZeroMQ: token ids, finish info and stats, never text. Front-end ->
core on one PULL socket shared by all front-ends; core -> front-end i on its own PUSH socket.
Only the start-up handshake and utility calls (tests, introspection) are pickled.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: str
    client_index: int
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' init fields (output_kind left out: the core streams deltas)
    arrival_time: float  # wall clock


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class Utility(msgspec.Struct, tag="utility", array_like=True, gc=False):
    """Run a pickled (fn, args) on the engine between steps: fn is an engine method's name or a callable."""

    call_id: int
    client_index: int
    payload: bytes


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    """From the supervisor, once the front-ends are gone: the core exits."""


CoreInput = Union[AddRequest, Abort, Utility, Shutdown]


class Delta(msgspec.Struct, array_like=True, gc=False):
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # one entry per new token, when asked for
    # set when finished: the request's prefix-cache and speculation counts
    num_cached_tokens: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class Rejected(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    status: int  # HTTP status the front-end answers with (400 bad input, 503 queue full)
    message: str


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    ok: bool
    payload: bytes  # pickled result, or the error's text


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One message per step (or per batch of inputs) to one front-end."""

    deltas: list[Delta] = []
    accepted: list[str] = []
    rejected: list[Rejected] = []
    utility: list[UtilityResult] = []
    stats: dict[str, Any] | None = None  # engine-wide counters and gauges (EngineStats' fields)
    # the core failed: its error, then it exits
    error: str | None = None


input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreOutputs)
