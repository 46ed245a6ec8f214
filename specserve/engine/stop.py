"""Stop conditions, checked after every appended token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the server's front-end uses the string helpers below without torch
    from specserve.engine.request import Request


def stops_at_token(req: Request, tok: int, n_out: int, eos_token_ids: set[int]) -> bool:
    """Whether ``tok``, as ``req``'s output token number ``n_out``, ends it (EOS or a stop token)."""
    p = req.params
    return n_out >= p.min_tokens and ((not p.ignore_eos and tok in eos_token_ids) or tok in p.stop_token_ids)


def may_stop(req: Request, tokens: list[int], eos_token_ids: set[int]) -> bool:
    """Whether committing ``tokens`` may end ``req`` before its length limits: a stop token or EOS among
    them, or any stop string (only the detokenized text can tell)."""
    n = req.num_output_tokens
    return bool(req.params.stop_list) or any(stops_at_token(req, t, n + i + 1, eos_token_ids)
                                             for i, t in enumerate(tokens))


def check_stop(req: Request, eos_token_ids: set[int], max_model_len: int,
               new_text_start: int = 0) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if ``req`` must stop after its last token, else None.

    A stop string found in the text cuts the text there (kept when include_stop_str_in_output).
    """
    p = req.params
    tok = req.output_token_ids[-1]
    n_out = req.num_output_tokens
    if stops_at_token(req, tok, n_out, eos_token_ids):  # stop_reason: the stop token's id, None for EOS (vLLM)
        return "stop", tok if tok in p.stop_token_ids else None
    if n_out >= p.min_tokens:
        if p.stop_list:
            found = find_stop_string(req.text, p.stop_list, new_text_start)
            if found is not None:
                at, s = found
                req.text = req.text[: at + len(s)] if p.include_stop_str_in_output else req.text[:at]
                return "stop", s
    if req.grammar is not None and req.grammar.terminated:  # at an EOS the grammar allowed (with ignore_eos)
        return "stop", None
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return "length", None
    if req.num_tokens >= max_model_len:
        return "length", None
    return None


def find_stop_string(text: str, stops: list[str], new_text_start: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the first listed stop string in ``text`` that ends after ``new_text_start``."""
    # a new match must end in the text added since new_text_start
    start = max(0, new_text_start - max(len(s) for s in stops) + 1)
    for s in stops:
        at = text.find(s, start)
        if at != -1:
            return at, s
    return None


def stop_string_holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could still begin a stop string: a stream holds them back.

    "Paris is a city that", stops ["that has"] -> 4 ("that" is withheld until the next token decides).
    """
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def streamable_text_end(text: str, params: SamplingParams, finished: bool) -> int:
    """How much of a request's text a stream may hand out now (the rest may yet be cut by a stop string)."""
    if finished or not params.stop_list or params.include_stop_str_in_output:
        return len(text)
    return len(text) - stop_string_holdback(text, params.stop_list)
