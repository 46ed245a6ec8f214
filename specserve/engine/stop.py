"""Stop conditions, checked after every appended token."""

from __future__ import annotations

from specserve.engine.request import Request


def check_stop(req: Request, eos_token_ids: set[int], max_model_len: int,
               new_text_start: int = 0) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if ``req`` must stop after its last token, else None.

    A stop string found in the text cuts the text there (kept when include_stop_str_in_output).
    """
    p = req.params
    tok = req.output_token_ids[-1]
    n_out = req.num_output_tokens
    if n_out >= p.min_tokens:
        if not p.ignore_eos and tok in eos_token_ids:
            return "stop", tok
        if tok in p.stop_token_ids:
            return "stop", tok
        if p.stop_list:
            # a new match must end in the text added by the last token
            start = max(0, new_text_start - max(len(s) for s in p.stop_list) + 1)
            for s in p.stop_list:
                at = req.text.find(s, start)
                if at != -1:
                    req.text = req.text[: at + len(s)] if p.include_stop_str_in_output else req.text[:at]
                    return "stop", s
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return "length", None
    if req.num_tokens >= max_model_len:
        return "length", None
    return None
