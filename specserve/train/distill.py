"""The training set: the held-out split, the target's own replies (self-distillation) and the
tokenized examples, cached in the output directory so that a resumed run continues from them."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

from specserve.train import data as D
from specserve.train.target import Target

if TYPE_CHECKING:
    from specserve.train.eagle3 import TrainConfig


def build_examples(cfg: TrainConfig, target: Target) -> tuple[list[D.Example], list[tuple[int, D.Conversation]],
                                                                   dict[str, Any]]:
    """Training examples (cached in the output dir), held-out conversations, and data facts."""
    convs = D.load_conversations(cfg.data)
    train_idx, held_idx = D.heldout_split(len(convs), cfg.heldout, cfg.split_seed)
    with open(os.path.join(cfg.output_dir, "heldout.json"), "w") as f:
        json.dump({"data": cfg.data, "seed": cfg.split_seed, "num_conversations": len(convs),
                   "rule": "first `heldout` indices of random.Random(seed).shuffle(range(n))",
                   "indices": held_idx}, f)
    if cfg.max_conversations is not None:
        train_idx = train_idx[: cfg.max_conversations]
    held = [(i, convs[i]) for i in held_idx]
    facts: dict[str, Any] = {"source_conversations": len(convs), "heldout_conversations": len(held_idx)}
    cache = os.path.join(cfg.output_dir, "train_conversations.jsonl")
    distilled: set[int] = set()
    if cfg.resume and os.path.isfile(cache):
        train = []
        with open(cache) as f:
            for line in f:
                o = json.loads(line)
                train.append((o["index"], o["messages"]))
                if o.get("distilled"):
                    distilled.add(o["index"])
        cached = dict(train)
        # conversations an earlier run's budget did not reach, and distilled ones with fewer turns
        # than --distill-turns asks for now (those continue from their cached replies)
        rest = [i for i in train_idx if i not in distilled
                or D.user_turns(cached[i]) < D.user_turns(D.first_exchange(convs[i], cfg.distill_turns))]
        if cfg.self_distill and rest and cfg.distill_time_budget_s != 0:
            t0 = time.monotonic()
            n0 = len(distilled)
            started = {i: cached[i] for i in rest if i in distilled}
            turns0 = sum(D.user_turns(c) for c in started.values())
            more = dict(distill(cfg, target, [(i, convs[i]) for i in rest], distilled, started))
            facts["distill_resumed_s"] = round(time.monotonic() - t0, 1)
            facts["distill_resumed_conversations"] = len(distilled) - n0
            facts["distill_extended_turns"] = sum(D.user_turns(more[i]) for i in started if i in more) - turns0
            train = [(i, more[i]) if i in more and i in distilled else (i, c) for i, c in train]
            known = {i for i, _ in train}
            train += [(i, c) for i, c in more.items() if i not in known]
            D.save_conversations(cache, train, distilled)
            ex = os.path.join(cfg.output_dir, f"examples_len{cfg.max_len}.pt")
            if os.path.isfile(ex):
                os.remove(ex)  # tokenized from the old replies
    elif cfg.self_distill:
        t0 = time.monotonic()
        train = distill(cfg, target, [(i, convs[i]) for i in train_idx], distilled)
        facts["distill_s"] = round(time.monotonic() - t0, 1)
        D.save_conversations(cache, train, distilled)
    else:
        train = [(i, convs[i]) for i in train_idx]
    facts["distilled_conversations"] = len(distilled)
    t0 = time.monotonic()
    ex_cache = os.path.join(cfg.output_dir, f"examples_len{cfg.max_len}.pt")
    if cfg.resume and os.path.isfile(ex_cache):
        examples = D.load_examples(ex_cache)
    else:
        examples = D.tokenize_all(target.tokenizer, train, target.stop_ids, cfg.max_len)
        D.save_examples(ex_cache, examples)
    facts.update(train_conversations=len(train), train_examples=len(examples),
                 train_tokens=sum(len(e.ids) for e in examples),
                 train_loss_tokens=sum(e.num_loss_tokens for e in examples),
                 tokenize_s=round(time.monotonic() - t0, 1), self_distilled=cfg.self_distill)
    return examples, held, facts


def distill(cfg: TrainConfig, target: Target, convs: list[tuple[int, D.Conversation]],
            distilled: set[int] | None = None,
            started: dict[int, D.Conversation] | None = None) -> list[tuple[int, D.Conversation]]:
    """Replace assistant turns with the target's own greedy replies, one turn depth at a time.

    Indices of conversations that got the target's replies are added to ``distilled``.
    ``started`` maps indices to conversations distilled earlier over fewer turns: those continue
    from there (their later user turns get the target's replies, the earlier replies are kept).
    """
    distilled = set() if distilled is None else distilled
    started = started or {}
    items = [(i, c, started.get(i), 0.0, 0) for i, c in convs]
    out = []
    for (i, src, _, _, _), built in zip(items, _distill_turns(cfg, target, items, cfg.distill_time_budget_s)):
        if built is not None:
            out.append((i, built))
            distilled.add(i)
        elif cfg.distill_keep_original and any(m["role"] == "assistant" for m in src):
            out.append((i, src))
    return out


def distill_samples(cfg: TrainConfig, target: Target, convs: Sequence[tuple[int, D.Conversation]],
                    temperatures: Sequence[float], seed: int = 0) -> list[tuple[int, float, D.Conversation]]:
    """Each conversation's user turns answered by the target once per entry of ``temperatures``
    (0: greedy, else sampled with a seed of (seed, index, entry), so a repeated temperature gives
    another sample), turn by turn as ``distill`` does; (index, temperature, conversation) for the
    variants that got at least their first reply.

    All variants of a turn depth run in one engine; under ``cfg.distill_time_budget_s`` what is
    cut is the tail of ``convs`` (each conversation's variants are adjacent).
    """
    items = [(i, c, None, float(t), _sample_seed(seed, i, j)) for i, c in convs for j, t in enumerate(temperatures)]
    got = _distill_turns(cfg, target, items, cfg.distill_time_budget_s)
    return [(i, t, built) for (i, _, _, t, _), built in zip(items, got) if built is not None]


def _sample_seed(seed: int, index: int, variant: int) -> int:
    return ((seed * 1_000_003 + index) * 1_009 + variant) * 64  # its turn t is drawn with this + t


def _distill_turns(cfg: TrainConfig, target: Target,
                   items: Sequence[tuple[int, D.Conversation, D.Conversation | None, float, int]],
                   budget: float | None) -> list[D.Conversation | None]:
    """Per item (index, source, started or None, temperature, seed): the conversation rebuilt with
    the target's replies to its user turns (up to ``cfg.distill_turns``), or None when not even
    its first reply came (prompt over ``cfg.max_prompt_len``, empty reply, budget spent). Turn
    depth d's replies are asked for once depth d - 1's are in: all items of a depth at once. A
    ``budget`` is shared out by how many items reach each depth (what a depth leaves goes on)."""
    from specserve.train.generate import ReplyGenerator

    gen = ReplyGenerator(target, cfg.distill_backend, cfg.distill_batch,
                         max_len=cfg.max_prompt_len + cfg.distill_max_tokens)  # one engine for every depth
    work: list[tuple[D.Conversation, D.Conversation]] = []  # (source, rebuilt so far)
    for _, c, started, _, _ in items:
        c = D.first_exchange(c, cfg.distill_turns)
        head = []
        for m in c:
            if m["role"] == "user":
                break
            head.append(m)
        work.append((c, list(started if started is not None else head)))
    reach = [sum(D.user_turns(src) > d for src, _ in work) for d in range(cfg.distill_turns)]
    t0 = time.monotonic()
    for turn in range(cfg.distill_turns):
        end = None if budget is None else t0 + budget * sum(reach[: turn + 1]) / max(1, sum(reach))
        if end is not None and time.monotonic() >= end:
            continue
        todo = []
        for w, (src, built) in enumerate(work):
            users = [m for m in src if m["role"] == "user"]
            done = D.user_turns(built)  # turns replied to already
            if turn >= len(users) or turn < done or (turn > 0 and (not built or built[-1]["role"] != "assistant")):
                continue
            prompt = built + [users[turn]]
            if len(D.render_ids(target.tokenizer, prompt, add_generation_prompt=True)) > cfg.max_prompt_len:
                continue
            todo.append((w, prompt))
        left = None if end is None else max(0.0, end - time.monotonic())
        replies = gen.replies([p for _, p in todo], cfg.distill_max_tokens, time_budget_s=left,
                              temperatures=[items[w][3] for w, _ in todo], seeds=[items[w][4] + turn for w, _ in todo])
        for (w, prompt), r in zip(todo, replies):
            if r is None or not r.text.strip():
                continue
            work[w] = (work[w][0], prompt + [{"role": "assistant", "content": r.text}])
    return [built if built and built[-1]["role"] == "assistant" else None for _, built in work]
