"""OpenAI-compatible request models and response builders.

Requests are pydantic models (bad types become 400s through the app's validation handler);
responses are plain dicts built here, shaped like OpenAI's (plus extension fields in `usage`).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.sampling_params import SamplingParams
from specserve.structured import openai_fields, tools as T

MAX_TOP_LOGPROBS = 20
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


class TokenizerLike(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class BadRequest(ValueError):
    """Invalid request parameters; the app answers 400 with this message (and `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, err_type: str, code: str | None = None, param: str | None = None) -> dict:
    """The one error shape of every endpoint and stream: OpenAI's (``code`` a string or null)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# Request models are strict, as OpenAI is: `"max_tokens": "10"`, `"stream": "yes"` are 400s, not coerced
# (a JSON integer is still a float). JSON object keys are strings: a dict field keyed by token ids is
# dict[str, ...], converted after validation.
_STRICT = ConfigDict(extra="ignore", strict=True)


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Base(BaseModel):
    # extra="ignore": clients send fields we do not use (user, metadata, ...); NaN/inf are not
    # numbers a sampler can use, so reject them at parse time.
    model_config = ConfigDict(_STRICT, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Some SDKs send every optional field, unset ones as null: treat null as "not given".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_UINT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    # extensions (vLLM / SGLang bench clients send these)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    max_spec_tokens: int | None = None
    # structured outputs (OpenAI's response_format, vLLM's extras): structured/openai_fields.py
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def _structured(self) -> Any:
        names = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
        try:
            return openai_fields.structured_outputs({n: getattr(self, n) for n in names})
        except openai_fields.FieldError as e:
            raise BadRequest(str(e), e.param) from e

    def _check_common(self) -> None:
        if self.n != 1:
            raise BadRequest(f"n must be 1: only one choice per request is supported, got n={self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, structured: Any = None) -> SamplingParams:
        kwargs: dict[str, Any] = dict(
            structured_outputs=structured,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            max_spec_tokens=self.max_spec_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._logit_bias(),
        )
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from e

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            out[tok] = bias
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool's result: which call it answers

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {part!r:.100}"
                    )
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> T.ToolPlan | None:
        try:
            return T.plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        except T.ToolError as e:
            raise BadRequest(str(e), e.param) from e

    def to_sampling_params(self) -> SamplingParams:
        self._check_common()
        if not self.messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise BadRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured = self._structured()
        plan = self.tool_plan()
        if plan is not None and plan.active:
            if structured is not None and plan.mode != "auto":
                raise BadRequest(f"tool_choice {plan.mode!r} fixes the output's format: leave out response_format "
                                 "and guided_*", "tool_choice")
            structured = structured or plan.structured_outputs()
        return self._sampling_params(max_tokens, logprobs, structured)

    def chat_messages(self) -> list[dict[str, str]]:
        msgs = [{"role": m.role, "content": m.text(), "tool_calls": m.tool_calls} for m in self.messages]
        try:
            return T.render_messages(msgs, self.tool_plan())
        except T.ToolError as e:
            raise BadRequest(str(e), e.param) from e


class CompletionRequest(_Base):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.best_of is not None and self.best_of != 1:
            raise BadRequest(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self._sampling_params(self.max_tokens, self.logprobs, self._structured())

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of prompts is refused: n=1, one choice)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequest(f"exactly one prompt per request is supported, got {len(p)}", "prompt")
            p = p[0]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p, list) and any(t < 0 for t in p):
            raise BadRequest("prompt token ids must be non-negative", "prompt")
        return p


# ---------------------------------------------------------------- responses


def usage_dict(state: Any) -> dict[str, Any]:
    """OpenAI usage plus per-request speculation stats (extension fields); ``state``: client.RequestState."""
    prompt_tokens = len(state.prompt_token_ids)
    completion_tokens = len(state.token_ids)
    f = state.final
    verify, drafted, accepted = (f.spec_verify_steps, f.spec_draft_tokens, f.spec_accepted_tokens) if f else (0, 0, 0)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "spec_verify_steps": verify,
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_accept_length": (accepted + verify) / verify if verify else None,
    }
    if f is not None and f.num_cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": f.num_cached_tokens}
    return usage


def _lp(value: float) -> float:
    # JSON has no -inf/NaN; a clamped floor keeps the response parseable (as vLLM does).
    return value if value == value and value > -9999.0 else -9999.0


def _token_str(tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _ranked(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:n]


def chat_logprobs(
    tokenizer: TokenizerLike, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int
) -> dict[str, Any]:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        tok = _token_str(tokenizer, tid)
        top = []
        for alt, lp in _ranked(entry, top_n):
            alt_tok = _token_str(tokenizer, alt)
            top.append({"token": alt_tok, "logprob": _lp(lp), "bytes": list(alt_tok.encode("utf-8"))})
        content.append(
            {"token": tok, "logprob": _lp(entry.get(tid, float("-inf"))), "bytes": list(tok.encode("utf-8")), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: TokenizerLike,
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    top_n: int,
    text_offset: int,
) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(_lp(entry.get(tid, float("-inf"))))
        tops.append({_token_str(tokenizer, alt): _lp(lp) for alt, lp in _ranked(entry, top_n)} if top_n else None)
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def now() -> int:
    return int(time.time())
