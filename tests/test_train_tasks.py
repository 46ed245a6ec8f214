"""The head's varied training data and per-task evaluation: task prompts from conversations, the held-out
set kept out of training, sampled self-distillation through the engine, per-task engine acceptance."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from specserve.train.distill import distill_samples
from specserve.train.eagle3 import TrainConfig
from specserve.train.target import load_target
from specserve.train.tasks import (MATH_HELDOUT, MATH_TEMPLATES, TASKS, build_task_prompts, is_english_prose,
                                   passage)
from tiny_model import make_random_head, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- prompt building (pure) ---------------------------------------------------------------------


def test_passages_are_whole_paragraphs_of_english_prose() -> None:
    text = "First paragraph here. It has two sentences.\n\nSecond one is short.\n\n" + "x" * 500
    assert passage(text, 10, 80) == "First paragraph here. It has two sentences.\n\nSecond one is short."
    assert passage("One. Two two two. " + "y" * 300, 3, 20) == "One. Two two two."  # cut after a sentence
    assert passage("tiny", 10, 80) is None
    assert is_english_prose("The river is long and the stone is grey.")
    assert not is_english_prose("def f(x):\n    return x")
    assert not is_english_prose("这是一个很长的中文句子，讲的是河流和石头。")


def _fake_conversations(n: int) -> list[list[dict[str, str]]]:
    words = "river stone cloud table music light garden window".split()
    out = []
    for i in range(n):
        w = [words[(i + k) % 8] for k in range(8)]
        reply = " ".join(f"The {a} is near the {b} and the {b} is far from the {a}." for a, b in zip(w, w[1:]))
        out.append([{"role": "user", "content": f"Tell me about the {w[0]} and the {w[1]}, please."},
                    {"role": "assistant", "content": reply + "\n\n" + reply}])
    return out


def test_task_prompts_draw_only_on_the_given_conversations_each_once() -> None:
    convs = _fake_conversations(200)
    allowed = list(range(0, 200, 2))
    prompts = build_task_prompts(convs, allowed, {t: 6 for t in TASKS}, seed=3, math_templates=MATH_HELDOUT)
    assert Counter(p.task for p in prompts) == {t: 6 for t in TASKS}
    sources = [i for p in prompts for i in p.sources]
    assert set(sources) <= set(allowed) and len(sources) == len(set(sources))
    for p in prompts:
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()
        assert (p.sources == []) == (p.task == "math")
        if p.task == "rag":
            assert len(p.sources) in (2, 3) and "Document 2:" in p.messages[0]["content"]
        if p.task == "translation":
            assert any(lang in p.messages[0]["content"] for lang in ("French", "Spanish", "German"))
    # the same seed gives the same prompts; the held-out math templates are not the training ones
    again = build_task_prompts(convs, allowed, {t: 6 for t in TASKS}, seed=3, math_templates=MATH_HELDOUT)
    assert [p.to_json() for p in again] == [p.to_json() for p in prompts]
    assert set(MATH_HELDOUT) and not set(MATH_HELDOUT) & set(range(len(MATH_TEMPLATES))) - set(MATH_HELDOUT)
    with pytest.raises(ValueError, match="unknown tasks"):
        build_task_prompts(convs, allowed, {"poetry": 1}, seed=0, math_templates=MATH_HELDOUT)


# ---- the held-out set and the training prompts (ShareGPT) ----------------------------------------


def test_heldout_set_is_kept_out_of_training_prompts(tmp_path) -> None:
    td = _bench("train_data")
    held = json.load(open(ROOT / "benchmarks" / "data" / "heldout_tasks.json"))
    head_split = json.load(open(ROOT / "models" / "smollm2-135m-eagle3" / "heldout.json"))["indices"]
    exclude = set(held["exclude_from_training"])
    assert exclude == set(head_split)  # the shipped head never saw these either
    assert Counter(p["task"] for p in held["prompts"]) == {t: held["per_task"] for t in TASKS}
    assert {i for p in held["prompts"] for i in p["sources"]} <= exclude
    out = tmp_path / "prompts.jsonl.gz"
    td.main(["prompts", str(out), "--chat", "60", "--per-task", "5"])
    with td._open(str(out), "r") as f:
        prompts = [json.loads(line) for line in f]
    assert Counter(p["task"] for p in prompts) == {"chat": 60, **{t: 5 for t in TASKS if t != "chat"}}
    assert not {i for p in prompts for i in p["sources"]} & exclude
    assert any(sum(m["role"] == "user" for m in p["messages"]) > 1 for p in prompts)  # later turns too
    # the distillation refuses a prompt file that draws on held-out conversations
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**prompts[0], "sources": [head_split[5]]}) + "\n")
    with pytest.raises(SystemExit, match="held-out"):
        td.main(["distill", str(tmp_path / "d.jsonl"), "--prompts", str(bad)])


# ---- sampled self-distillation through the engine (tiny model) -----------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(str(d / "model"), vocab=64, layers=2)
    return model, make_random_head(model, str(d / "head"))


def test_sampled_replies_differ_from_greedy_and_repeat_with_their_seed(tiny) -> None:
    model, _ = tiny
    target = load_target(model, torch.device("cpu"))
    convs = [(k, [{"role": "user", "content": f"t{k + 1} t{k + 2} t{k + 3}"},
                  {"role": "user", "content": "t9 t8"}]) for k in range(3)]
    cfg = TrainConfig(output_dir="", distill_turns=2, distill_max_tokens=10, distill_batch=8, max_prompt_len=200)
    got = distill_samples(cfg, target, convs, temperatures=[0.0, 1.0, 1.0], seed=0)
    assert [(i, t) for i, t, _ in got] == [(k, t) for k in range(3) for t in (0.0, 1.0, 1.0)]
    for _, _, c in got:  # both user turns answered, the second given the target's first reply
        assert [m["role"] for m in c] == ["user", "assistant", "user", "assistant"]
    text = {(i, n): c[1]["content"] + "|" + c[3]["content"] for n, (i, _, c) in enumerate(got)}
    for k in range(3):
        greedy, s1, s2 = (text[(k, 3 * k + j)] for j in range(3))
        assert s1 != greedy and s2 != greedy and s1 != s2
    cfg1 = TrainConfig(output_dir="", distill_turns=1, distill_max_tokens=10, distill_batch=8, max_prompt_len=200)
    from specserve.train.generate import generate_replies

    plain = generate_replies(target, [c[:1] for _, c in convs], 10)  # greedy, the engine
    once = distill_samples(cfg1, target, convs, temperatures=[0.0, 1.0], seed=0)
    for k in range(3):
        assert once[2 * k][2][1]["content"] == plain[k].text  # temperature 0 is the greedy reply
        assert once[2 * k + 1][2][1]["content"] == got[3 * k + 1][2][1]["content"]  # the seed repeats a sample
    other = distill_samples(cfg1, target, convs, temperatures=[1.0], seed=1)
    assert [c[1]["content"] for _, _, c in other] != [once[2 * k + 1][2][1]["content"] for k in range(3)]
    with pytest.raises(ValueError, match="engine backend"):
        distill_samples(TrainConfig(output_dir="", distill_backend="simple"), target, convs, temperatures=[0.7])


# ---- per-task acceptance in the engine -----------------------------------------------------------


def test_heldout_acceptance_reports_each_task(tiny, tmp_path) -> None:
    model, head = tiny
    tasks = {"prompts": [{"id": f"{t}-{k}", "task": t, "sources": [],
                          "messages": [{"role": "user", "content": f"t{3 + k} t{5 + 2 * k} t{7 + len(t)}"}]}
                         for t in ("qa", "math") for k in range(2)]}
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(tasks))
    ha = _bench("heldout_acceptance")
    res = ha.main(["--tasks", str(path), "--heads", head, "--model", model, "--configs", "chain2,chain3",
                   "--max-tokens", "12", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-gb", "0.05"])
    assert res["settings"]["prompts_per_task"] == {"qa": 2, "math": 2}
    for name, steps in (("chain2", 2), ("chain3", 3)):
        rows = res["heads"][head][name]
        assert set(rows) == {"qa", "math", "all", "mean_of_tasks", "engine_accept_length", "seconds"}
        assert rows["engine_accept_length"] == rows["all"]["accept_length"]  # per-request counts sum to the engine's
        for t in ("qa", "math"):
            r = rows[t]
            assert r["verify_steps"] > 0 and 1.0 <= r["accept_length"] <= steps + 1
            assert r["accept_length"] == round((r["accepted_tokens"] + r["verify_steps"]) / r["verify_steps"], 3)
        assert rows["all"]["verify_steps"] == rows["qa"]["verify_steps"] + rows["math"]["verify_steps"]
        assert rows["mean_of_tasks"] == round((rows["qa"]["accept_length"] + rows["math"]["accept_length"]) / 2, 3)
        assert rows["all"]["draft_vocab_coverage"] == 1.0  # the random head drafts the whole vocab
    assert "| math |" in ha.markdown_table(res)
