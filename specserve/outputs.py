"""What the engine hands back to callers (offline API and server), shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # speculation (accept length = generated tokens / verify steps, as SGLang counts it)
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def accept_length(self) -> float | None:
        if not self.spec_verify_steps:
            return None
        return (self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # tokens/text added since the previous output for this request (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
