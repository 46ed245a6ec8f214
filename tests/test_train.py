"""The EAGLE-3 trainer: vocab map, template-derived loss mask, TTT == incremental drafting,
and a tiny end-to-end training run on CPU (random 2-layer target, char-level tokenizer)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.attention.torch_native import TorchNativeBackend
from specserve.config import ModelConfig
from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel
from specserve.train import data as D
from specserve.train.attention import TTTBackend
from specserve.train.checkpoint import load_init_head
from specserve.train.eagle3 import TrainConfig, simulate_accept_length, train
from specserve.train.target import Target
from specserve.train.vocab import build_vocab_map, count_tokens

torch.set_num_threads(2)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---- vocab map ------------------------------------------------------------------------------


def test_vocab_map_picks_most_frequent_in_id_order() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 0])
    d2t, t2d = build_vocab_map(counts, 4)
    chosen = torch.arange(4) + d2t
    assert chosen.tolist() == [0, 2, 3, 6]  # the four most frequent, in target-id order
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    # fewer seen tokens than slots: unseen lowest ids fill the rest; ties go to the lower id
    d2t, t2d = build_vocab_map(torch.tensor([0, 3, 0, 0, 2]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(counts, 9)


def test_count_tokens_only_counts_masked_positions() -> None:
    counts = count_tokens([([1, 2, 2, 3], [False, True, True, False])], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 0, 0]


def test_draft_to_target_uses_the_map() -> None:
    cfg = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, vocab_size=10, draft_vocab_size=3, aux_layer_ids=(0, 1, 1))
    head = Eagle3DraftModel(cfg)
    d2t, t2d = build_vocab_map(torch.tensor([0, 4, 0, 0, 9, 0, 0, 0, 1, 0]), 3)
    head.set_vocab_map(d2t, t2d)
    assert head.draft_to_target(torch.tensor([0, 1, 2])).tolist() == [1, 4, 8]


# ---- tiny tokenizer and target --------------------------------------------------------------


def tiny_tokenizer():
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders
    from tokenizers.models import BPE

    from specserve.loader.tokenizer import Tokenizer

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(["<unk>"] + chars)}
    backend = HFTok(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend, eos_token="<|im_end|>", chat_template=CHATML)


def tiny_target(tok, layers: int = 2, std: float = 0.5) -> Target:
    from specserve.loader import dummy_weights
    from specserve.models.registry import build_model

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=tok.vocab_size, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    model = build_model(cfg, "cpu", torch.float32)
    model.load_weights(dummy_weights(cfg, std=std))
    return Target(model=model, config=cfg, tokenizer=tok, device=torch.device("cpu"), dtype=torch.float32)


def test_loss_mask_comes_from_the_template() -> None:
    tok = tiny_tokenizer()
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"},
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "ok"}]
    ex = D.tokenize_conversation(tok, conv, [tok.eos_token_id], max_len=512)
    assert ex is not None
    spans = tok.decode([i for i, m in zip(ex.ids, ex.mask) if m], skip_special_tokens=False)
    assert spans == "yo!<|im_end|>ok<|im_end|>"  # replies + their end-of-turn, nothing else
    assert D.tokenize_conversation(tok, conv[:1], [tok.eos_token_id], max_len=512) is None


def test_heldout_split_is_the_benchmark_order() -> None:
    import random

    train_idx, held = D.heldout_split(50, 7, seed=3)
    order = list(range(50))
    random.Random(3).shuffle(order)
    assert held == order[:7]
    assert sorted(train_idx + held) == list(range(50)) and not set(train_idx) & set(held)


# ---- training-time test == what the engine does while drafting --------------------------------


def _paged_draft_step(head: Eagle3DraftModel, cache, embeds, hidden, positions, seq_len: int) -> torch.Tensor:
    """One draft forward of one request whose cache holds positions [0, seq_len - len(positions))."""
    n = positions.numel()
    meta = AttentionMetadata(query_lens=[n], seq_lens=[seq_len], slot_mapping=positions.clone(),
                             block_tables=torch.arange(cache[0][0].shape[0])[None, :])
    be = TorchNativeBackend(cache, block_size=cache[0][0].shape[1], scale=head.config.head_dim ** -0.5)
    be.plan(meta)
    with forward_context(be):
        return head(embeds, hidden, positions)


def test_ttt_attention_equals_incremental_drafting() -> None:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=50, draft_vocab_size=50, aux_layer_ids=(0, 1, 2))
    head = Eagle3DraftModel(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    L, steps = 10, 4
    emb = torch.randn(L + steps + 1, 32)  # embeds of x[0..]
    feat = torch.randn(L, 3 * 32)
    with torch.no_grad():
        h0 = head.combine(feat)
        # TTT: step i at base t takes embed(x[t+1+i]) at position t+i
        ttt_out = []
        be = TTTBackend(1, L, scale=cfg.head_dim ** -0.5)
        hidden = h0
        with forward_context(be):
            for i in range(steps):
                hidden = head(emb[1 + i : 1 + i + L], hidden, torch.arange(L) + i)
                ttt_out.append(hidden)
        # incremental: prefill pairs 0..t, then one token per step at t+1, t+2, ...
        for t in [0, 3, L - 1]:
            cache = [(torch.zeros(8, 4, 2, 8), torch.zeros(8, 4, 2, 8))]
            pos = torch.arange(t + 1)
            out = _paged_draft_step(head, cache, emb[1 : t + 2], h0[: t + 1], pos, t + 1)
            torch.testing.assert_close(out[t], ttt_out[0][t], rtol=1e-5, atol=1e-5)
            h = out[t : t + 1]
            for i in range(1, steps):
                h = _paged_draft_step(head, cache, emb[t + 1 + i : t + 2 + i], h, torch.tensor([t + i]), t + 1 + i)
                torch.testing.assert_close(h[0], ttt_out[i][t], rtol=1e-5, atol=1e-5)


def test_simulated_accept_length() -> None:
    # base 0 accepts 2 drafts (+1 bonus) -> base 3 accepts 0 -> base 4 accepts 1 (+1): 6 tokens, 3 steps
    runs = [[2, 5, 5, 0, 1, 0]]
    assert simulate_accept_length(runs, k=5) == (6, 3)
    assert simulate_accept_length(runs, k=1) == (6, 3)  # bases 0, 2, 4 each emit 1 draft + 1 bonus
    assert simulate_accept_length([[0, 0, 0]], k=3) == (3, 3)


def test_remap_vocab_keeps_known_rows_and_maps_new_ones_from_the_target() -> None:
    from specserve.train.eagle3 import remap_vocab

    target = tiny_target(tiny_tokenizer())
    V, H = target.config.vocab_size, target.config.hidden_size
    dvs = 80  # more rows than hidden dims: the map from target rows to head rows is determined
    head = Eagle3DraftModel(Eagle3Config.from_target(target.config, dvs))
    tw = target.model.lm_head_weight.float()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[1 : dvs + 1] = True
    head.set_vocab_map(torch.ones(dvs, dtype=torch.int64), t2d)
    m0 = torch.randn(H, H, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        head.lm_head.weight.copy_(tw[1 : dvs + 1] @ m0)  # rows of target ids 1..80
    before = head.lm_head.weight.detach().clone()
    counts = torch.zeros(V, dtype=torch.int64)
    counts[3 : dvs + 3] = 5  # ids 3..82 seen: 81 and 82 come in, 1 and 2 (never seen) go
    assert remap_vocab(head, target, counts) == 2
    assert torch.nonzero(head.t2d).flatten().tolist() == list(range(3, dvs + 3))
    assert head.draft_to_target(torch.tensor([0, dvs - 1])).tolist() == [3, dvs + 2]
    w = head.lm_head.weight.detach()
    torch.testing.assert_close(w[: dvs - 2], before[2:])  # kept tokens keep what they learned
    torch.testing.assert_close(w[dvs - 2 :], tw[[dvs + 1, dvs + 2]] @ m0, rtol=1e-3, atol=1e-3)  # mapped rows
    # tokens unseen in the new data: those the head has win the ties
    counts[[dvs + 1, dvs + 2]] = 0
    head.set_vocab_map(torch.ones(dvs, dtype=torch.int64), t2d)
    assert remap_vocab(head, target, counts) == 0
    assert torch.nonzero(head.t2d).flatten().tolist() == list(range(1, dvs + 1))


# ---- tiny end-to-end run ----------------------------------------------------------------------


def _conversations(n: int) -> list[list[dict[str, str]]]:
    words = ["apple", "river", "stone", "cloud", "green", "table", "music", "light"]
    out = []
    for i in range(n):
        a, b = words[i % 8], words[(3 * i + 1) % 8]
        out.append([{"role": "user", "content": f"say {a} {b}"},
                    {"role": "assistant", "content": f"{a} {b} {a} {b}. the {a} is near the {b}."}])
    return out


def test_tiny_training_run_loss_falls_and_head_reloads(tmp_path) -> None:
    tok = tiny_tokenizer()
    target = tiny_target(tok)
    data = tmp_path / "convs.jsonl"
    with open(data, "w") as f:
        for c in _conversations(24):
            f.write(json.dumps(c) + "\n")
    out = tmp_path / "head"
    cfg = TrainConfig(output_dir=str(out), data=str(data), draft_vocab_size=48, heldout=4, max_len=128,
                      batch_tokens=512, epochs=1, max_steps=20, lr=3e-3, warmup_ratio=0.05, ttt_steps=3,
                      eval_conversations=2, eval_max_tokens=8, distill_backend="simple", save_every=20,
                      log_every=1, progress=False)
    summary = train(cfg, target)
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert summary["steps"] == 20
    assert len(json.load(open(out / "heldout.json"))["indices"]) == 4
    assert summary["train_conversations"] == 20  # the held-out four were not trained on
    assert (out / "README.md").read_text().count("accept length") >= 1

    head = Eagle3DraftModel.from_pretrained(str(out))
    assert head.config.draft_vocab_size == 48 and head.config.aux_layer_ids == (1, 1, 0)
    ids = torch.tensor([5, 6, 7, 8])
    target.model.set_aux_hidden_layers(head.config.aux_layer_ids)
    from specserve.train.attention import DenseCausalBackend

    with torch.no_grad(), forward_context(DenseCausalBackend(1, 4, 16 ** -0.5)):
        _, aux = target.model(ids, torch.arange(4))
    be = TTTBackend(1, 4, scale=head.config.head_dim ** -0.5)
    with torch.no_grad(), forward_context(be):
        h = head(target.model.embed_tokens(ids), head.combine(aux), torch.arange(4))
    logits = head.compute_logits(h)
    assert logits.shape == (4, 48) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    drafted = head.draft_to_target(logits.argmax(-1))
    assert bool(head.t2d[drafted].all())
    acc = summary["heldout_acceptance"]
    assert acc["heldout_prompts"] == 2 and acc["chain_accept_length"]["1"] >= 1.0

    # resume: continue the finished run's checkpoint for 3 more steps
    cfg2 = TrainConfig(**{**cfg.__dict__, "max_steps": 23, "resume": True, "eval_conversations": 0})
    s2 = train(cfg2, target)
    assert s2["steps"] == 23
    assert os.path.isfile(out / "checkpoint.pt")

    # --init-from: a new run continues the saved head (its vocab map kept), so its first loss is
    # that of a trained head, far below a fresh head's first loss
    def first_loss(d) -> float:
        return json.loads(open(d / "train_log.jsonl").readline())["loss"]

    out3 = tmp_path / "continued"
    cfg3 = TrainConfig(**{**cfg.__dict__, "output_dir": str(out3), "max_steps": 2, "eval_conversations": 0,
                          "init_from": str(out), "draft_vocab_size": 32, "seed": 1})
    s3 = train(cfg3, target)
    # another batch-order seed keeps the held-out split (--split-seed sets it)
    assert json.load(open(out3 / "heldout.json"))["indices"] == json.load(open(out / "heldout.json"))["indices"]
    assert s3["draft_vocab_size"] == 48 and s3["init_from"] == str(out)
    cont = Eagle3DraftModel.from_pretrained(str(out3))
    assert torch.equal(cont.d2t, head.d2t) and torch.equal(cont.t2d, head.t2d)
    assert first_loss(out3) < 0.7 * first_loss(out)
    import dataclasses

    wide = Eagle3DraftModel(Eagle3Config.from_target(dataclasses.replace(target.config, intermediate_size=96), 48))
    wide.save_pretrained(str(tmp_path / "wide"))
    with pytest.raises(ValueError, match="intermediate_size 96 does not fit"):
        load_init_head(str(tmp_path / "wide"), target)


def _six_conversations(tmp_path):
    """A tiny random target and a JSONL of six conversations for it."""
    target = tiny_target(tiny_tokenizer())
    data = tmp_path / "convs.jsonl"
    with open(data, "w") as f:
        for c in _conversations(6):
            f.write(json.dumps({"messages": c}) + "\n")
    return target, data


def test_self_distillation_replaces_replies(tmp_path) -> None:
    target, data = _six_conversations(tmp_path)
    cfg = TrainConfig(output_dir=str(tmp_path / "o"), data=str(data), heldout=1, self_distill=True,
                      distill_backend="simple", distill_max_tokens=6, max_len=128, batch_tokens=512)
    from specserve.train.distill import distill

    convs = D.load_conversations(str(data))
    got = distill(cfg, target, list(enumerate(convs)))
    assert len(got) >= 1
    for i, c in got:
        assert c[0] == convs[i][0] and c[-1]["role"] == "assistant"
        assert c[-1]["content"] != convs[i][1]["content"]  # the target's own (random) reply
        assert 0 < len(c[-1]["content"]) <= 6 * len("<unk>")  # at most 6 generated tokens


def test_resumed_prepare_distills_what_the_budget_missed(tmp_path) -> None:
    target, data = _six_conversations(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    convs = D.load_conversations(str(data))
    train_idx, _ = D.heldout_split(len(convs), 1, 0)
    # an earlier prepare whose budget reached only the first training conversation
    D.save_conversations(str(out / "train_conversations.jsonl"), [(i, convs[i]) for i in train_idx],
                         distilled={train_idx[0]})
    cfg = TrainConfig(output_dir=str(out), data=str(data), heldout=1, self_distill=True, resume=True,
                      distill_backend="simple", distill_max_tokens=6, max_len=128, batch_tokens=512)
    from specserve.train.distill import build_examples

    _, _, facts = build_examples(cfg, target)
    assert facts["distilled_conversations"] == len(train_idx)
    assert facts["distill_resumed_conversations"] == len(train_idx) - 1
    recs = {o["index"]: o for o in map(json.loads, open(out / "train_conversations.jsonl"))}
    assert sorted(recs) == sorted(train_idx) and all(r["distilled"] for r in recs.values())
    # the first kept its earlier (here: original) reply; the others got the target's own
    assert recs[train_idx[0]]["messages"] == convs[train_idx[0]]
    for i in train_idx[1:]:
        assert recs[i]["messages"][-1]["content"] != convs[i][1]["content"]


def test_resumed_prepare_extends_distilled_conversations_to_more_turns(tmp_path) -> None:
    target = tiny_target(tiny_tokenizer())
    two_turns = [c + [{"role": "user", "content": "again"}, {"role": "assistant", "content": "stone cloud."}]
                 for c in _conversations(6)]
    data = tmp_path / "convs.jsonl"
    with open(data, "w") as f:
        for c in two_turns:
            f.write(json.dumps({"messages": c}) + "\n")
    out = tmp_path / "o"
    out.mkdir()
    train_idx, _ = D.heldout_split(6, 1, 0)
    # an earlier prepare distilled the first turn of every training conversation (here: a marked reply)
    first = {i: [two_turns[i][0], {"role": "assistant", "content": f"earlier reply {i}"}] for i in train_idx}
    D.save_conversations(str(out / "train_conversations.jsonl"), list(first.items()), distilled=set(train_idx))
    cfg = TrainConfig(output_dir=str(out), data=str(data), heldout=1, self_distill=True, resume=True,
                      distill_turns=2, distill_backend="simple", distill_max_tokens=6, max_len=256, batch_tokens=512)
    from specserve.train.distill import build_examples

    examples, _, facts = build_examples(cfg, target)
    assert facts["distill_extended_turns"] == len(train_idx)
    recs = {o["index"]: o["messages"] for o in map(json.loads, open(out / "train_conversations.jsonl"))}
    for i in train_idx:
        m = recs[i]
        assert [x["role"] for x in m] == ["user", "assistant", "user", "assistant"]
        assert m[:3] == first[i] + [two_turns[i][2]]  # the earlier reply is kept, the second turn asked
        assert m[3]["content"] != two_turns[i][3]["content"]  # ... and answered by the target
    # both replies are trained on: more loss tokens than the first replies alone
    assert sum(e.num_loss_tokens for e in examples) > sum(
        len(target.tokenizer.encode(first[i][1]["content"])) for i in train_idx)
    # a second resume has nothing left to extend
    _, _, facts2 = build_examples(cfg, target)
    assert "distill_extended_turns" not in facts2


def tiny_base_tokenizer():
    """The tiny vocabulary as a base model's: no chat template, BOS added by the post-processor."""
    from tokenizers.processors import TemplateProcessing

    from specserve.loader.tokenizer import Tokenizer

    backend = tiny_tokenizer().backend
    backend.add_special_tokens(["<bos>"])
    backend.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", backend.token_to_id("<bos>"))])
    return Tokenizer(backend, bos_token="<bos>", eos_token="<|im_end|>")


def test_template_less_model_trains_on_completion_text(tmp_path) -> None:
    """A base model (no chat template): the user turn is the prompt as /v1/completions encodes it
    (BOS added), the reply its continuation; distillation and the held-out replies continue it."""
    from specserve.train.distill import distill
    from specserve.train.eagle3 import heldout_examples
    from specserve.train.generate import simple_greedy

    tok = tiny_base_tokenizer()
    target = tiny_target(tok)
    conv = [{"role": "user", "content": "say stone cloud"}, {"role": "assistant", "content": " stone cloud."}]
    prompt = tok.encode("say stone cloud", add_special_tokens=True)
    assert prompt[0] == tok.bos_token_id
    ex = D.tokenize_conversation(tok, conv, target.stop_ids, max_len=128)
    assert ex.ids == prompt + tok.encode(" stone cloud.")
    assert tok.decode([i for i, m in zip(ex.ids, ex.mask) if m]) == " stone cloud."
    # batched tokenization takes the same path
    assert [e.ids for e in D.tokenize_all(tok, [(0, conv)], target.stop_ids, 128)] == [ex.ids]

    cfg = TrainConfig(output_dir=str(tmp_path), self_distill=True, distill_backend="simple", distill_max_tokens=6,
                      max_len=128, batch_tokens=512)
    want = simple_greedy(target, [prompt], 6)[0]
    [(_, got)] = distill(cfg, target, [(0, conv)])
    assert got[0] == conv[0] and got[1]["content"] == tok.decode([t for t in want if t not in target.stop_ids])
    [held] = heldout_examples(target, [(0, conv)], 1, 6, 128, "simple", 4)
    assert held.ids == prompt + want and held.mask == [False] * len(prompt) + [True] * len(want)


def test_dense_causal_backend_applies_a_sliding_window() -> None:
    """The target's feature pass on a sliding-window layer (Gemma 3): a query sees its last ``window`` keys."""
    from specserve.train.attention import DenseCausalBackend

    torch.manual_seed(0)
    L, window = 7, 3
    q, k, v = torch.randn(L, 2, 8), torch.randn(L, 1, 8), torch.randn(L, 1, 8)
    out = DenseCausalBackend(1, L, scale=0.5).forward(0, q, k, v, window=window)
    for p in range(L):
        lo = max(0, p - window + 1)
        w = torch.softmax((q[p] @ k[lo : p + 1, 0].T) * 0.5, dim=-1)  # [heads, keys]
        torch.testing.assert_close(out[p], w @ v[lo : p + 1, 0])


def test_device_name_reads_the_cuda_device_name(monkeypatch) -> None:
    from specserve.train.checkpoint import device_name

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"GPU {d}")
    assert device_name(torch.device("cuda", 0)) == "GPU cuda:0"  # the trainer's summary on a GPU
    assert device_name(torch.device("cpu")).startswith("CPU")
