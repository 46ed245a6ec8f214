"""Per-request sampling parameters, shaped like vLLM's SamplingParams."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.structured.params import StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (as vLLM's): everything so far, what is new since the
    last output, or one output when it finishes. FINAL_ONLY builds nothing per step (``LLM.generate``);
    DELTA copies only the new tokens (a streaming client that keeps its own text)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: minus this where a token is in the output, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # HF: prompt and output tokens' logits / it (> 0) or * it (<= 0)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: just the sampled one)
    max_spec_tokens: int | None = None  # per-request cap on drafted tokens; 0 disables speculation
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # the output follows this grammar (a JSON schema, regex, choice, ...; a dict is read as its fields)
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_list: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self.validate()
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.structured_outputs is not None and self.min_tokens:  # (EOS masked where only EOS may follow)
            bad("min_tokens cannot be combined with structured outputs: the grammar decides where the output ends")
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            bad("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.max_spec_tokens is not None and self.max_spec_tokens < 0:
            bad(f"max_spec_tokens must be >= 0, got {self.max_spec_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2 <= v <= 2:
                bad(f"{name} must be a number in [-2, 2], got {v!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty < float("inf"):
            bad(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad(f"logit_bias must map token ids to biases, got {self.logit_bias!r:.100}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    bad(f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    bad(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def seeded(self) -> bool:
        """Drawn at random from its own seed: each draw a function of (seed, output index) alone."""
        return self.seed is not None and not self.greedy

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether its rows take edits before sampling (logits_process): penalties, a bias, or EOS and
        stop tokens masked before min_tokens."""
        masks = self.min_tokens > 0 and (bool(self.stop_token_ids) or not self.ignore_eos)
        return self.penalized or bool(self.logit_bias) or masks
