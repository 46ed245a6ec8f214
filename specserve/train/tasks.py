"""Task prompts built from ShareGPT conversations: a held-out multi-task set and training prompts.

Six tasks, each prompt a single user turn (``chat`` in training may hold several):

- chat: a ShareGPT user turn as it is (MT-bench-style open questions, code, any language);
- translation: a ShareGPT reply passage (English prose) to translate into French, Spanish or German;
- summarization: a ShareGPT reply passage to summarize;
- qa: a question about a ShareGPT reply passage (its main point, a term in it, a sentence of it);
- math: a word problem from a template with random numbers and names (no public set);
- rag: two or three ShareGPT reply passages as documents and the question one of them answers.

Every prompt records the conversation indices it draws on (``sources``), so a training set can be
built from conversations disjoint from a held-out set's. Math templates are split too: the held-out
set uses every fourth template (``MATH_HELDOUT``), training prompts the others.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

from specserve.train.data import Conversation

TASKS = ("chat", "translation", "summarization", "qa", "math", "rag")
LANGUAGES = ("French", "Spanish", "German")


@dataclass
class TaskPrompt:
    id: str  # "<task>-<n>", unique within a set
    task: str
    sources: list[int]  # conversation indices the prompt draws on (none for math)
    messages: Conversation  # ends with a user message

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(o: dict[str, Any]) -> TaskPrompt:
        if o.get("task") not in TASKS:
            raise ValueError(f"unknown task {o.get('task')!r} in prompt {o.get('id')!r}")
        msgs = o["messages"]
        if not msgs or msgs[-1]["role"] != "user":
            raise ValueError(f"prompt {o.get('id')!r} does not end with a user message")
        return TaskPrompt(id=o["id"], task=o["task"], sources=list(o["sources"]), messages=msgs)


# ---- passages ---------------------------------------------------------------------------------

_CODE = re.compile(r"```|[{};]\s*$|^\s*(def|class|import|#include|public|function)\b", re.M)


def is_english(text: str) -> bool:
    """Letters are most of it, and nearly all of them ASCII (English, as far as ShareGPT goes)."""
    ascii_letters = sum(c.isascii() and c.isalpha() for c in text)
    letters = sum(c.isalpha() for c in text)
    return letters > 0.6 * len(text) and ascii_letters > 0.98 * letters


def is_english_prose(text: str) -> bool:
    """English, no code, no table: a passage to translate, summarize or ask about."""
    return bool(text) and not _CODE.search(text) and text.count("|") <= 3 and is_english(text)


def passage(text: str, lo: int, hi: int) -> str | None:
    """Leading whole paragraphs of ``text`` within [lo, hi] characters (a long first paragraph is
    cut after its last sentence that fits); None when that is shorter than ``lo``."""
    out = ""
    for para in re.split(r"\n\s*\n", text.strip()):
        para = para.strip()
        if not para:
            continue
        joined = f"{out}\n\n{para}" if out else para
        if len(joined) <= hi:
            out = joined
            continue
        if not out:  # the first paragraph alone is too long: whole sentences of it
            cut = para[:hi]
            end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
            out = cut[: end + 1] if end > 0 else ""
        break
    return out if len(out) >= lo else None


def _replies(conv: Conversation) -> list[str]:
    return [m["content"] for m in conv if m["role"] == "assistant"]


def _first_user(conv: Conversation) -> str | None:
    for m in conv:
        if m["role"] == "user":
            return m["content"].strip()
    return None


# ---- math word problems -------------------------------------------------------------------------

_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
          "Maya", "Nikolai", "Olivia", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf")
_ITEMS = ("pencil", "apple", "notebook", "sticker", "marble", "cookie", "battery", "candle", "card", "balloon")
_THINGS = ("bicycle", "laptop", "guitar", "tent", "camera", "phone", "desk", "pair of skates")
_ASK = ("", " Show your work.", " Explain your reasoning step by step.", " Give the final answer on the last line.",
        " Think it through step by step before answering.")


def _math_templates() -> list:
    def t0(r, n):
        item = r.choice(_ITEMS)
        a, b, c = r.randint(3, 12), r.randint(4, 24), r.randint(2, 15)
        return (f"{n[0]} buys {a} packs of {item}s. Each pack holds {b} {item}s and costs ${c}. How many "
                f"{item}s does {n[0]} have, and how much did they cost in total?")

    def t1(r, n):
        a, b, c, d = r.randint(40, 120), r.randint(1, 5), r.randint(40, 120), r.randint(1, 5)
        return (f"A train travels at {a} km/h for {b} hours, then at {c} km/h for {d} hours. How far does it "
                "travel in total, and what is its average speed over the whole trip?")

    def t2(r, n):
        a, p, b = r.randint(4, 40) * 10, r.choice((10, 20, 25, 30, 40, 50)), r.randint(5, 30)
        return (f"{n[0]} has ${a}. {n[0]} spends {p}% of it on a {r.choice(_THINGS)} case and ${b} on lunch. "
                "How much money is left?")

    def t3(r, n):
        a, b = r.randint(3, 40), r.randint(3, 40)
        return (f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter? If both "
                "sides are doubled, what is the new area?")

    def t4(r, n):
        a, b = r.randint(6, 40), 2 * r.randint(2, 15)
        a += (a + b) % 2
        return (f"{n[0]} is {a} years old. {n[1]} is {b} years older than {n[0]}, and {n[2]} is half as old "
                f"as {n[1]}. How old is {n[2]}?")

    def t5(r, n):
        p = r.choice((20, 25, 40, 50, 60, 75))
        a = r.randint(3, 30) * {20: 5, 25: 4, 40: 5, 50: 2, 60: 5, 75: 4}[p]  # p % of a is whole
        return f"A school club has {a} members. {p}% of them are in their first year. How many are not?"

    def t6(r, n):
        a, b, c = r.randint(2, 5), r.choice((12, 18, 24, 30)), r.choice((36, 48, 60, 72, 90))
        return f"A recipe needs {a} cups of flour for {b} cookies. How many cups are needed for {c} cookies?"

    def t7(r, n):
        item, a, b, c = r.choice(_ITEMS), r.randint(2, 9), r.randint(10, 60), 2 * r.randint(2, 20)
        return (f"A shop sells {item}s at ${a} each. On Monday it sells {b} of them, on Tuesday {c} more than on "
                "Monday, and on Wednesday half as many as on Tuesday. What is the shop's revenue for the "
                "three days?")

    def t8(r, n):
        a, b = r.randint(8, 60), r.randint(150, 1500)
        return (f"{n[0]} saves ${a} every week. How many weeks will it take to save enough for a "
                f"{r.choice(_THINGS)} that costs ${b}?")

    def t9(r, n):
        a, b = r.randint(10, 60) * 10, r.randint(12, 40)
        c = r.randint(2, b - 4)
        return (f"A tank holds {a} liters. It is filled at {b} liters per minute while it drains at {c} liters "
                "per minute. Starting empty, how long does it take to fill?")

    def t10(r, n):
        a, b, d = r.randint(3, 30), r.randint(3, 30), r.randint(2, 9)
        c = d * r.randint(2, 20)
        return f"What is {a} × {b} + {c} ÷ {d} − {r.randint(1, 50)}? Explain the order of operations you use."

    def t11(r, n):
        a, b, c = r.randint(10, 45), r.randint(180, 600), r.randint(2, 6)
        return (f"{n[0]} reads {a} pages a day. The book has {b} pages. After {c} days, how many pages are left, "
                "and how many more days will it take to finish?")

    def t12(r, n):
        a, b, c = r.randint(4, 12), r.choice((1.5, 1.7, 1.85, 2.1)), r.randint(12, 90) * 10
        return (f"A car uses {a} liters of fuel per 100 km and fuel costs ${b} per liter. How much does the fuel "
                f"for a {c} km trip cost?")

    def t13(r, n):
        a, p, q = r.randint(20, 300), r.choice((10, 15, 20, 25, 30)), r.choice((5, 8, 10, 12))
        return (f"A jacket costs ${a}. It is discounted by {p}%, and then a {q}% sales tax is added to the "
                "discounted price. What is the final price?")

    def t14(r, n):
        b, x = r.randint(2, 20), r.randint(10, 80)
        return (f"{n[0]}, {n[1]} and {n[2]} split a bill of ${3 * x + b}. {n[0]} pays ${b} more than each of the "
                "other two, who pay equal amounts. How much does each person pay?")

    def t15(r, n):
        a, b, c = r.randint(8, 40), r.randint(8, 40), r.randint(1, 3)
        return (f"A garden is {a} m by {b} m. A path {c} m wide runs around the inside of its edge. What area of "
                "the garden is not covered by the path?")

    return [t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15]


MATH_TEMPLATES = _math_templates()
MATH_HELDOUT = tuple(range(0, len(MATH_TEMPLATES), 4))  # the held-out set's templates; training: the rest


def math_problem(r: random.Random, templates: Sequence[int]) -> str:
    names = r.sample(_NAMES, 3)
    return MATH_TEMPLATES[r.choice(list(templates))](r, names) + r.choice(_ASK)


# ---- one prompt per task ------------------------------------------------------------------------

_TRANSLATE = ("Translate the following text into {lang}:\n\n{p}", "Please translate this into {lang}.\n\n{p}",
              "{p}\n\nTranslate the text above to {lang}.", "Translate to {lang}:\n\"{p}\"")
_SUMMARIZE = ("Summarize the following text in two or three sentences:\n\n{p}", "Write a short summary of this:\n\n{p}",
              "{p}\n\nSummarize the text above in one paragraph.",
              "Give the main points of the following text as a bulleted list:\n\n{p}")
_QA = ("Read the passage and answer the question.\n\nPassage:\n{p}\n\nQuestion: {q}",
       "{p}\n\nBased on the text above: {q}", "Text:\n{p}\n\n{q} Answer from the text.")
_RAG = ("Answer the question using the documents below.\n\n{docs}\n\nQuestion: {q}",
        "Use only the information in the following context to answer.\n\n{docs}\n\nQuestion: {q}",
        "{docs}\n\nBased on the documents above, answer: {q}")
_STOP = set("about above after again also because been before being below between both could does doing during "
            "each from further have having into itself more most other over same should some such than that their "
            "theirs them then there these they this those through under until very were what when where which "
            "while whom will with would your yours".split())


def _qa_question(r: random.Random, p: str) -> str:
    words = re.findall(r"[A-Za-z][a-z]{5,}", p)
    counts: dict[str, int] = {}
    for w in words:
        if w.lower() not in _STOP:
            counts[w.lower()] = counts.get(w.lower(), 0) + 1
    terms = [w for w, c in counts.items() if c >= 2]
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", p) if 30 <= len(s.strip()) <= 200]
    kind = r.randrange(4)
    if kind == 0 and terms:
        return f"What does the passage say about \"{r.choice(terms)}\"?"
    if kind == 1 and sentences:
        return f"Is this statement supported by the passage: \"{r.choice(sentences)}\"? Explain briefly."
    if kind == 2:
        return "List two facts the passage states."
    return "What is the main point of the passage?"


class _Pool:
    """Conversation indices in a seeded order; ``take`` hands out the next one that qualifies (each
    at most once)."""

    def __init__(self, indices: Sequence[int], r: random.Random) -> None:
        self.order = list(indices)
        r.shuffle(self.order)
        self.pos = 0

    def take(self, ok) -> Iterator[tuple[int, Any]]:
        while self.pos < len(self.order):
            i = self.order[self.pos]
            self.pos += 1
            v = ok(i)
            if v is not None:
                yield i, v


def build_task_prompts(convs: Sequence[Conversation], indices: Sequence[int], per_task: dict[str, int],
                       seed: int, math_templates: Sequence[int], unique: bool = True,
                       max_chat_chars: int = 800) -> list[TaskPrompt]:
    """``per_task[task]`` single-turn prompts per task from the conversations ``indices``, in task
    order; fewer where the conversations run out. ``unique``: each conversation used by at most
    one prompt of the set (else at most once per task). Chat prompts are English first turns."""
    bad = set(per_task) - set(TASKS)
    if bad:
        raise ValueError(f"unknown tasks {sorted(bad)}; tasks are {TASKS}")
    r = random.Random(seed)
    pool = _Pool(indices, r)
    out: list[TaskPrompt] = []

    def reply_passage(lo: int, hi: int):
        def ok(i: int) -> str | None:
            for text in _replies(convs[i])[:1]:
                p = passage(text, lo, hi)
                if p and is_english_prose(p):
                    return p
            return None
        return ok

    def user(msg: str) -> Conversation:
        return [{"role": "user", "content": msg}]

    for task in TASKS:
        n = per_task.get(task, 0)
        if n <= 0:
            continue
        made: list[TaskPrompt] = []
        if not unique:
            pool = _Pool(indices, r)

        def add(sources: list[int], msg: str) -> None:
            made.append(TaskPrompt(id=f"{task}-{len(made)}", task=task, sources=sources, messages=user(msg)))

        if task == "chat":
            def ok_chat(i: int) -> str | None:
                u = _first_user(convs[i])
                return u if u and 20 <= len(u) <= max_chat_chars and is_english(u) else None
            for i, u in pool.take(ok_chat):
                add([i], u)
                if len(made) == n:
                    break
        elif task == "translation":
            for i, p in pool.take(reply_passage(120, 600)):
                add([i], r.choice(_TRANSLATE).format(lang=r.choice(LANGUAGES), p=p))
                if len(made) == n:
                    break
        elif task == "summarization":
            for i, p in pool.take(reply_passage(400, 1500)):
                add([i], r.choice(_SUMMARIZE).format(p=p))
                if len(made) == n:
                    break
        elif task == "qa":
            for i, p in pool.take(reply_passage(300, 1200)):
                add([i], r.choice(_QA).format(p=p, q=_qa_question(r, p)))
                if len(made) == n:
                    break
        elif task == "math":
            for _ in range(n):
                add([], math_problem(r, math_templates))
        elif task == "rag":
            def ok_doc(i: int):
                q, p = _first_user(convs[i]), reply_passage(200, 800)(i)
                return (q, p) if p and q and 15 <= len(q) <= 300 and is_english_prose(q) else None
            docs = pool.take(ok_doc)
            while len(made) < n:
                k = r.choice((2, 3))
                group = [d for _, d in zip(range(k), docs)]
                if len(group) < k:
                    break
                q = r.choice(group)[1][0]  # the question one document answers
                r.shuffle(group)
                text = "\n\n".join(f"Document {j + 1}:\n{p}" for j, (_, (_, p)) in enumerate(group))
                add([i for i, _ in group], r.choice(_RAG).format(docs=text, q=q))
        out += made
    return out


def chat_prompts(convs: Sequence[Conversation], indices: Sequence[int], turns: int, max_chars: int,
                 limit: int | None = None) -> list[TaskPrompt]:
    """ShareGPT conversations as training prompts of every kind, in ``indices`` order (at most
    ``limit``): the user turns of each (up to ``turns``; a leading system message kept; the replies
    dropped, distillation answers the turns one at a time), a turn over ``max_chars`` ending it."""
    out = []
    for i in indices:
        msgs: Conversation = []
        users = 0
        for m in convs[i]:
            if m["role"] == "system" and not msgs:
                msgs.append(m)
            elif m["role"] == "user":
                if users == turns or len(m["content"]) > max_chars or not m["content"].strip():
                    break
                msgs.append(m)
                users += 1
        if users:
            out.append(TaskPrompt(id=f"chat-{i}", task="chat", sources=[i], messages=msgs))
        if limit is not None and len(out) >= limit:
            break
    return out
