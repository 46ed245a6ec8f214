"""Training data for the draft head: conversations -> token ids + assistant-token loss mask.

A model without a chat template (a base model) gets its conversations as plain completion text
(``plain_ids``): each reply is the continuation of the messages before it.

The loss mask comes from the chat template itself: each assistant turn's span is where the
rendering of the conversation up to and including that turn extends the rendering of the
conversation before it with the generation prompt added. Nothing here knows a template's markers;
only the end-of-turn token ids (the model's EOS ids) trim template text that follows a reply.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch

Message = dict[str, str]
Conversation = list[Message]


# ---- sources -------------------------------------------------------------------------------


def load_conversations(source: str) -> list[Conversation]:
    """``sharegpt`` (the packaged ShareGPT V3) or a JSONL (or .jsonl.gz) file of conversations.

    A JSONL line is a list of {"role", "content"} messages, or an object holding one under
    "messages" or "conversations" (ShareGPT {"from", "value"} turns are accepted too).
    """
    if source == "sharegpt":
        from specserve.bench.datasets import sharegpt_conversations

        return [list(c) for c in sharegpt_conversations()]
    if not os.path.isfile(source):
        raise FileNotFoundError(f"--data must be 'sharegpt' or a JSONL file; {source!r} does not exist")
    out: list[Conversation] = []
    opener = gzip.open if source.endswith(".gz") else open
    with opener(source, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_parse_conversation(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{source}:{n}: not a conversation ({e})") from e
    return out


def _parse_conversation(obj: Any) -> Conversation:
    from specserve.bench.datasets import ROLE_MAP

    if isinstance(obj, dict):
        obj = obj.get("messages") or obj.get("conversations")
    if not isinstance(obj, list) or not obj:
        raise ValueError("expected a non-empty list of messages")
    msgs = []
    for m in obj:
        role = m.get("role") or ROLE_MAP.get(m.get("from", ""))
        content = m.get("content", m.get("value"))
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ValueError(f"bad message {str(m)[:80]!r}")
        msgs.append({"role": role, "content": content})
    return msgs


def save_conversations(path: str, convs: Iterable[tuple[int, Conversation]], distilled: set[int] | None = None) -> None:
    """JSONL of {"index", "messages"[, "distilled"]}; ``load_conversations`` reads it back."""
    with open(path, "w") as f:
        for i, c in convs:
            rec: dict[str, Any] = {"index": i, "messages": c}
            if distilled is not None:
                rec["distilled"] = i in distilled
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def heldout_split(num_conversations: int, num_heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) conversation indices.

    Held-out = the first ``num_heldout`` indices of ``random.Random(seed).shuffle(range(n))``: the
    order ``sharegpt_prompts(num, seed=seed)`` scans, so a benchmark drawing its prompts that way
    (with a num below the held-out size) sees conversations the head was not trained on.
    """
    idx = list(range(num_conversations))
    random.Random(seed).shuffle(idx)
    held = idx[:num_heldout]
    held_set = set(held)
    return [i for i in range(num_conversations) if i not in held_set], held


def user_turns(conv: Conversation) -> int:
    """How many user messages the conversation has."""
    return sum(m["role"] == "user" for m in conv)


def first_exchange(conv: Conversation, turns: int = 1) -> Conversation:
    """The conversation cut after its ``turns``-th user message (leading system message kept)."""
    out: Conversation = []
    users = 0
    for m in conv:
        if m["role"] == "user":
            if users == turns:
                break
            users += 1
        out.append(m)
    return out


# ---- tokenisation with the template's own assistant spans ------------------------------------


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_ids(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat-template rendering (works for our tokenizer and HF ones); for a model
    without a template (a base model) the plain completion text of ``plain_ids``."""
    if not has_chat_template(tokenizer):
        return plain_ids(tokenizer, messages)
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
    if isinstance(out, str):
        return list(encode(tokenizer, out))
    if hasattr(out, "keys") and "input_ids" in out:  # a BatchEncoding
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def plain_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """A conversation as completion text, for a model without a chat template: the message contents
    back to back, the first encoded as /v1/completions encodes a prompt (BOS added), each later one
    on its own so that every prefix of messages renders to a prefix of the ids.
    # [user "The sky is", assistant " blue."] -> [<bos>, The, ▁sky, ▁is, ▁blue, .]"""
    texts = [m["content"] for m in messages] or [""]
    try:
        ids = list(tokenizer.encode(texts[0], add_special_tokens=True))
    except TypeError:
        ids = list(tokenizer.encode(texts[0]))
    for t in texts[1:]:
        ids += encode(tokenizer, t)
    return ids


def encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Example:
    ids: list[int]
    mask: list[bool]  # True where the token is part of an assistant reply (a loss target)
    index: int  # conversation index in the source

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)


def _renders(conv: Conversation) -> list[tuple[Conversation, bool]]:
    """The renderings the mask needs: the whole conversation, then per assistant turn j the
    prefix before it with the generation prompt and (unless j is last) the prefix through it."""
    out = [(conv, False)]
    for j, m in enumerate(conv):
        if m["role"] == "assistant":
            out.append((conv[:j], True))
            if j + 1 < len(conv):
                out.append((conv[: j + 1], False))
    return out


def tokenize_conversation(tokenizer: Any, conv: Conversation, stop_ids: Sequence[int], max_len: int,
                          index: int = -1, rendered: list[list[int]] | None = None) -> Example | None:
    """Ids and assistant mask of one conversation; None when it has no assistant token within max_len.

    ``rendered``: the ids of ``_renders(conv)`` in order, when already computed (batched).
    """
    if rendered is None:
        rendered = [render_ids(tokenizer, c, add_generation_prompt=g) for c, g in _renders(conv)]
    it = iter(rendered)
    full = next(it)
    mask = [False] * len(full)
    stops = set(int(s) for s in stop_ids)
    for j, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = next(it)
        upto = next(it) if j + 1 < len(conv) else full
        start = _common_prefix(before, full)
        end = _common_prefix(upto, full)
        # the turn ends at its first end-of-turn token; template text after it is no target
        for k in range(start, end):
            if full[k] in stops:
                end = k + 1
                break
        for k in range(start, end):
            mask[k] = True
    full, mask = full[:max_len], mask[:max_len]
    if not any(mask[1:]):
        return None
    return Example(ids=full, mask=mask, index=index)


def tokenize_all(tokenizer: Any, convs: Iterable[tuple[int, Conversation]], stop_ids: Sequence[int],
                 max_len: int, chunk: int = 2048) -> list[Example]:
    """Examples of many conversations. With our Tokenizer the template texts are encoded in
    batches (the tokenizer library runs those on all cores)."""
    convs = list(convs)
    batched = (has_chat_template(tokenizer) and hasattr(tokenizer, "apply_chat_template_text")
               and hasattr(tokenizer, "backend"))
    out = []
    for c0 in range(0, len(convs), chunk):
        part = convs[c0 : c0 + chunk]
        rendered: list[list[list[int]] | None] = [None] * len(part)
        if batched:
            jobs = [(k, c, g) for k, (_, conv) in enumerate(part) for c, g in _renders(conv)]
            texts = [tokenizer.apply_chat_template_text(list(c), add_generation_prompt=g) for _, c, g in jobs]
            encs = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
            per: list[list[list[int]]] = [[] for _ in part]
            for (k, _, _), e in zip(jobs, encs):
                per[k].append(e.ids)
            rendered = list(per)
        for (i, c), r in zip(part, rendered):
            ex = tokenize_conversation(tokenizer, c, stop_ids, max_len, index=i, rendered=r)
            if ex is not None:
                out.append(ex)
    return out


def save_examples(path: str, examples: Sequence[Example]) -> None:
    lens = torch.tensor([len(e.ids) for e in examples], dtype=torch.int64)
    torch.save({"ids": torch.tensor([t for e in examples for t in e.ids], dtype=torch.int32),
                "mask": torch.tensor([m for e in examples for m in e.mask], dtype=torch.bool),
                "lens": lens, "index": torch.tensor([e.index for e in examples], dtype=torch.int64)}, path)


def load_examples(path: str) -> list[Example]:
    d = torch.load(path, weights_only=True)
    ids, mask = d["ids"].tolist(), d["mask"].tolist()
    out, off = [], 0
    for n, i in zip(d["lens"].tolist(), d["index"].tolist()):
        out.append(Example(ids=ids[off : off + n], mask=mask[off : off + n], index=i))
        off += n
    return out


# ---- batching ------------------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, L] bool
    lengths: torch.Tensor  # [B] int64

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device))


def make_batches(examples: Sequence[Example], max_tokens: int, seed: int, pad_multiple: int = 64) -> list[list[int]]:
    """Groups of example indices of similar length, each fitting B * padded_L <= max_tokens.

    Sorted by length to limit padding, then the groups are shuffled with ``seed``.
    """
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        L = len(examples[i].ids)
        padded = -(-L // pad_multiple) * pad_multiple
        if cur and padded * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    random.Random(seed).shuffle(groups)
    return groups


def collate(examples: Sequence[Example], group: Sequence[int], pad_multiple: int = 64) -> Batch:
    lens = [len(examples[i].ids) for i in group]
    L = -(-max(lens) // pad_multiple) * pad_multiple
    ids = torch.zeros(len(group), L, dtype=torch.int64)
    mask = torch.zeros(len(group), L, dtype=torch.bool)
    for r, i in enumerate(group):
        ex = examples[i]
        ids[r, : len(ex.ids)] = torch.tensor(ex.ids, dtype=torch.int64)
        mask[r, : len(ex.ids)] = torch.tensor(ex.mask, dtype=torch.bool)
    return Batch(ids, mask, torch.tensor(lens, dtype=torch.int64))


def iter_epoch(examples: Sequence[Example], max_tokens: int, seed: int) -> Iterator[Batch]:
    for g in make_batches(examples, max_tokens, seed):
        yield collate(examples, g)
