"""EAGLE-3 draft-head training with the training-time test (TTT), and held-out acceptance.

One training step, for a right-padded batch of token rows x[0..L):
  1. the target runs causally over x (our model, aux capture): features f_t = aux at t, and its
     logits z_t (the prediction of x[t+1]), restricted to the draft vocab -> soft labels.
  2. the head is unrolled ``ttt_steps`` times through the SAME module the engine uses. Step i at
     base position t takes embed(x[t+1+i]) and (step 0) fc(f_t) or (later) its own pre-norm output
     from step i-1 at t, sits at RoPE position t+i, attends to step-0 keys 0..t plus the keys of
     steps 1..i at t (``TTTBackend``), and is trained toward softmax(z_{t+1+i}) over the draft
     vocab, weighted ``ttt_decay**i``. Positions count where x[t+2+i] is an assistant token and
     the target's argmax there lies in the draft vocab.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specserve.attention.base import forward_context
from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel
from specserve.models.layers import OffsetRMSNorm
from specserve.train import data as D
from specserve.train.attention import TTTBackend
from specserve.train.checkpoint import device_name, load_init_head, save_checkpoint, write_model_card
from specserve.train.distill import build_examples
from specserve.train.target import Target, target_features
from specserve.train.vocab import build_vocab_map, count_tokens

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    output_dir: str
    model: str | None = None  # target: GGUF file or HF dir; None = the default model
    data: str = "sharegpt"  # or a JSONL of conversations
    draft_vocab_size: int = 16384
    max_conversations: int | None = None  # cap on training conversations (after the split)
    heldout: int = 1000
    split_seed: int = 0  # the held-out split; kept apart from ``seed`` so a new batch order keeps it
    seed: int = 0  # initialisation and batch order
    max_len: int = 2048
    max_prompt_len: int = 1024  # self-distillation: prompts longer than this are skipped
    self_distill: bool = False
    distill_max_tokens: int = 512
    distill_turns: int = 1
    distill_backend: str = "engine"  # engine | simple
    distill_batch: int = 256
    distill_time_budget_s: float | None = None
    distill_keep_original: bool = True  # conversations the budget did not reach keep their own replies
    prepare_only: bool = False  # build (and cache) the training data, then stop
    epochs: int = 3
    max_steps: int | None = None
    time_budget_s: float | None = None  # training loop wall-clock; the LR schedule follows it
    batch_tokens: int = 16384
    lr: float = 3e-4
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 5  # the deepest draft we serve (chain 5, tree 5 x 4 x 16)
    ttt_decay: float = 0.8
    device: str = "auto"
    save_every: int = 500
    resume: bool = False
    eval_conversations: int = 64
    eval_max_tokens: int = 256
    eval_time_budget_s: float | None = None  # cap on generating the held-out replies
    save_dtype: str = "bfloat16"
    init_from_target: bool = True
    init_from: str | None = None  # an EAGLE-3 head to continue training (its draft vocab is kept)
    remap_vocab: bool = False  # with init_from: re-choose the draft vocab (same size) from this data
    log_every: int = 10
    progress: bool = True

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.max_len > self.batch_tokens:
            raise ValueError(f"max_len={self.max_len} must not exceed batch_tokens={self.batch_tokens}")
        if self.distill_backend not in ("engine", "simple"):
            raise ValueError(f"distill_backend must be engine or simple, got {self.distill_backend!r}")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"save_dtype must be float32, bfloat16 or float16, got {self.save_dtype!r}")
        if self.epochs < 1 and self.max_steps is None:
            raise ValueError("epochs must be >= 1 (or give max_steps)")


# ---- the unrolled head ------------------------------------------------------------------------


def unroll(head: Eagle3DraftModel, target: Target, input_ids: torch.Tensor, steps: int,
           on_step: Callable[[int, torch.Tensor], None]) -> None:
    """Run the target over [B, L] rows, then the head ``steps`` times; ``on_step(i, out[B*L, H])``."""
    B, L = input_ids.shape
    aux, last = target_features(target, input_ids, head.config.aux_layer_ids or ())
    on_step(-1, last)  # the target's final hidden state, for the caller's labels
    embeds = target.model.embed_tokens(input_ids)  # [B, L, H]
    H = embeds.shape[-1]
    hidden = head.combine(aux)
    backend = TTTBackend(B, L, scale=head.config.head_dim ** -0.5)
    base_pos = torch.arange(L, device=input_ids.device).repeat(B)
    with forward_context(backend):
        for i in range(steps):
            shifted = torch.cat([embeds[:, 1 + i :], embeds.new_zeros(B, min(1 + i, L), H)], dim=1)[:, :L]
            hidden = head(shifted.reshape(B * L, H), hidden, base_pos + i)
            on_step(i, hidden)


def _draft_ids(head: Eagle3DraftModel) -> torch.Tensor:
    return torch.nonzero(head.t2d, as_tuple=False).flatten()


@torch.no_grad()
def target_labels(target: Target, last: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                  chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits over the draft vocab [T, Vd] fp32, whether the full-vocab argmax is drafted [T])."""
    zs, oks = [], []
    for s in range(0, last.shape[0], chunk):
        z = target.model.compute_logits(last[s : s + chunk])
        oks.append(t2d[z.argmax(-1)])
        zs.append(z[:, draft_ids].float())
    return torch.cat(zs), torch.cat(oks)


@dataclass
class StepStats:
    loss: float
    correct: list[int]
    counts: list[int]

    def acc(self) -> list[float]:
        return [c / n if n else float("nan") for c, n in zip(self.correct, self.counts)]


def ttt_loss(head: Eagle3DraftModel, target: Target, batch: D.Batch, steps: int, decay: float
             ) -> tuple[torch.Tensor, StepStats]:
    ids, loss_mask, lens = batch.input_ids, batch.loss_mask, batch.lengths
    B, L = ids.shape
    dev = ids.device
    draft_ids = _draft_ids(head)
    state: dict[str, Any] = {}
    # label_ok[b, s]: position s predicts an assistant token x[s+1] whose target argmax is drafted
    pos = torch.arange(L, device=dev)
    next_is_target = torch.zeros(B, L, dtype=torch.bool, device=dev)
    next_is_target[:, :-1] = loss_mask[:, 1:] & ((pos[None, :-1] + 1) < lens[:, None])
    losses: list[torch.Tensor] = []
    correct: list[int] = []
    counts: list[int] = []

    def on_step(i: int, out: torch.Tensor) -> None:
        if i < 0:  # labels only where a reply token is predicted (the full-vocab logits dominate a CPU step)
            sel = torch.nonzero(next_is_target.reshape(-1), as_tuple=False).flatten()
            z_sel, ok_sel = target_labels(target, out[sel], draft_ids, head.t2d)
            state["z"] = z_sel.new_zeros(B * L, z_sel.shape[1]).index_copy_(0, sel, z_sel)
            state["ok"] = torch.zeros(B * L, dtype=torch.bool, device=dev).index_copy_(0, sel, ok_sel).view(B, L)
            return
        ok = state["ok"]
        m = torch.zeros(B, L, dtype=torch.bool, device=dev)
        m[:, : L - 1 - i] = ok[:, 1 + i :]
        rows = torch.nonzero(m.reshape(-1), as_tuple=False).flatten()
        counts.append(int(rows.numel()))
        if rows.numel() == 0:
            correct.append(0)
            return
        logits = head.compute_logits(out[rows])
        z = state["z"][rows + 1 + i]
        p = torch.softmax(z, dim=-1)
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        losses.append(decay**i * ce)
        correct.append(int((logits.argmax(-1) == z.argmax(-1)).sum()))

    unroll(head, target, ids, steps, on_step)
    loss = torch.stack(losses).sum() if losses else torch.zeros((), device=dev, requires_grad=True)
    return loss, StepStats(float(loss.detach()), correct, counts)


# ---- held-out acceptance ----------------------------------------------------------------------


@torch.no_grad()
def accept_runs(head: Eagle3DraftModel, target: Target, examples: Sequence[D.Example], steps: int,
                topk: int, batch_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Per sequence and per drafting base t (from the last prompt token on): the number of leading
    draft steps whose argmax is the target's greedy token (chain), and whose top-``topk`` holds it.

    Greedy chain drafting is exactly teacher forcing up to the first miss, so these are the
    counts the engine would accept with the head's hidden states fed back.
    """
    res: list[tuple[list[int], list[int]]] = [([], []) for _ in examples]
    dev = target.device
    for group in D.make_batches(examples, batch_tokens, seed=0):
        batch = D.collate(examples, group).to(dev)
        ids, lens = batch.input_ids, batch.lengths
        B, L = ids.shape
        starts = torch.tensor([examples[g].mask.index(True) for g in group], device=dev)  # first reply token
        hit = torch.zeros(steps, B, L, dtype=torch.bool, device=dev)
        in_k = torch.zeros(steps, B, L, dtype=torch.bool, device=dev)
        pos = torch.arange(L, device=dev)

        def on_step(i: int, out: torch.Tensor) -> None:
            if i < 0:
                return
            valid = (pos[None, :] >= starts[:, None] - 1) & (pos[None, :] + 2 + i <= lens[:, None] - 1)
            rows = torch.nonzero(valid.reshape(-1), as_tuple=False).flatten()
            if rows.numel() == 0:
                return
            logits = head.compute_logits(out[rows])
            truth = ids.reshape(-1)[rows + 2 + i]
            top = head.draft_to_target(logits.topk(topk, dim=-1).indices)
            hit[i].view(-1)[rows] = top[:, 0] == truth
            in_k[i].view(-1)[rows] = (top == truth[:, None]).any(-1)

        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else _nullctx()
        with ctx:
            unroll(head, target, ids, steps, on_step)
        # leading run length along the steps axis
        run_chain = torch.cumprod(hit.long(), dim=0).sum(0)  # [B, L]
        run_topk = torch.cumprod(in_k.long(), dim=0).sum(0)
        for r, g in enumerate(group):
            s0, n = int(starts[r]) - 1, int(lens[r])
            res[g] = (run_chain[r, s0 : n - 1].tolist(), run_topk[r, s0 : n - 1].tolist())
    return res


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def simulate_accept_length(runs: Sequence[Sequence[int]], k: int) -> tuple[int, int]:
    """(tokens, verify steps) of greedy decoding with chains of ``k`` drafts, over all sequences.

    ``runs[s][j]`` is the leading-match count at drafting base (reply start - 1 + j). A verify step
    at base t emits min(run, k) drafts + 1 bonus token and moves the base by that many.
    """
    tokens = steps = 0
    for r in runs:
        n = len(r)  # bases 0..n-1; base j drafts reply token j+1 onward, so n tokens remain to emit
        j = 0
        while j < n:
            a = min(r[j], k, n - 1 - j)
            tokens += a + 1
            steps += 1
            j += a + 1
    return tokens, steps


def acceptance_report(runs: list[tuple[list[int], list[int]]], steps: int, topk: int) -> dict[str, Any]:
    chain = [r[0] for r in runs]
    tree = [r[1] for r in runs]
    per_step = []
    alive = sum(len(r) for r in chain)
    for i in range(steps):
        ok = sum(1 for r in chain for v in r if v >= i + 1)
        per_step.append(round(ok / alive, 4) if alive else None)
        alive = ok
    out: dict[str, Any] = {
        "bases": sum(len(r) for r in chain),
        "per_step_accept_rate": per_step,  # P(step i right | steps before it right), greedy chain
        "chain_accept_length": {},
        "topk_path_accept_length": {},
    }
    for k in range(1, steps + 1):
        t, s = simulate_accept_length(chain, k)
        out["chain_accept_length"][str(k)] = round(t / s, 4) if s else None
        t, s = simulate_accept_length(tree, k)
        out["topk_path_accept_length"][str(k)] = round(t / s, 4) if s else None
    out["topk"] = topk
    out["note"] = ("chain_accept_length[k]: exact greedy accept length (generated tokens per verify step) "
                   "with a chain of k drafts. topk_path_accept_length[k]: upper bound for a tree of depth k "
                   f"that expands the top-{topk} children of every node (no node budget).")
    return out


def heldout_examples(target: Target, convs: Sequence[tuple[int, D.Conversation]], n: int, max_tokens: int,
                     max_prompt_len: int, backend: str, batch: int, time_budget_s: float | None = None
                     ) -> list[D.Example]:
    """Greedy target replies to the first user turn of held-out conversations, as examples."""
    prompts: list[tuple[int, D.Conversation]] = []
    for i, c in convs:
        p = D.first_exchange(c, 1)
        p = [m for m in p if m["role"] != "assistant"]
        if not p or p[-1]["role"] != "user" or not p[-1]["content"].strip():
            continue
        if len(D.render_ids(target.tokenizer, p, add_generation_prompt=True)) > max_prompt_len:
            continue
        prompts.append((i, p))
        if len(prompts) == n:
            break
    from specserve.train.generate import generate_replies

    replies = generate_replies(target, [p for _, p in prompts], max_tokens, backend=backend, batch_size=batch,
                               time_budget_s=time_budget_s)
    out = []
    for (i, _), r in zip(prompts, replies):
        if r is None or len(r.token_ids) < 2:
            continue
        ids = r.prompt_ids + r.token_ids
        out.append(D.Example(ids=ids, mask=[False] * len(r.prompt_ids) + [True] * len(r.token_ids), index=i))
    return out


# ---- training ---------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, progress: float) -> float:
    if progress < cfg.warmup_ratio:
        return cfg.lr * max(progress / cfg.warmup_ratio, 0.01)
    p = min(1.0, (progress - cfg.warmup_ratio) / max(1e-9, 1 - cfg.warmup_ratio))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def init_head(head: Eagle3DraftModel, target: Target, from_target: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.zero_()
        if from_target:
            w = target.model.lm_head_weight
            head.lm_head.weight.copy_(w[_draft_ids(head).to(w.device)].float())
            norm = getattr(getattr(target.model, "model", None), "norm", None)
            # a Gemma final norm's scale (1 + weight, up to 301 in Gemma 3 270M) blows a fresh head's
            # logits up (first loss 547, not 32): that head's norm starts at one
            if norm is not None and not isinstance(norm, OffsetRMSNorm):
                head.norm.weight.copy_(norm.weight.float())


def remap_vocab(head: Eagle3DraftModel, target: Target, counts: torch.Tensor) -> int:
    """Re-choose a continued head's draft vocab (its size kept) as the most frequent tokens of
    ``counts``, ties going to tokens it has. A kept token keeps its lm_head row; a new one gets its
    target row mapped into the head's space by the least-squares linear map from the kept tokens'
    target rows to their head rows (the target's rows as they are score new tokens far too high:
    one-step accuracy 0.26 -> 0.09 on a sample, 0.30 mapped). Returns how many tokens came in."""
    dvs = head.config.draft_vocab_size
    d2t, t2d = build_vocab_map(2 * counts.to(torch.int64) + head.t2d.cpu().long(), dvs)
    old_ids = _draft_ids(head).cpu()
    old_pos = torch.full((t2d.numel(),), -1, dtype=torch.int64)
    old_pos[old_ids] = torch.arange(dvs)
    new_ids = torch.nonzero(t2d, as_tuple=False).flatten()  # target ids in the new draft order
    pos = old_pos[new_ids]
    kept = pos >= 0
    w = head.lm_head.weight
    with torch.no_grad():
        tw = target.model.lm_head_weight.detach().float().cpu()
        hw = w.detach().float().cpu()
        rows = torch.empty_like(hw)
        rows[kept] = hw[pos[kept]]
        if bool((~kept).any()):
            m = torch.linalg.lstsq(tw[old_ids], hw).solution  # [H, H]: target row -> head row
            rows[~kept] = tw[new_ids[~kept]] @ m
        w.copy_(rows.to(device=w.device, dtype=w.dtype))
    head.set_vocab_map(d2t, t2d)
    return int((~kept).sum())


def train(cfg: TrainConfig, target: Target, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole run: data, vocab, head, TTT training, save, held-out acceptance, model card."""
    from tqdm.auto import tqdm

    os.makedirs(cfg.output_dir, exist_ok=True)
    t_start = time.monotonic()
    dev = target.device
    torch.manual_seed(cfg.seed)
    with open(os.path.join(cfg.output_dir, "train_args.json"), "w") as f:
        json.dump({"argv": list(argv) if argv is not None else None, "config": dataclasses.asdict(cfg)}, f, indent=2)

    examples, held, facts = build_examples(cfg, target)
    if not examples:
        raise ValueError("no training example has an assistant token within max_len")
    log.info("data: %s", facts)
    if cfg.prepare_only:
        return facts

    t0 = time.monotonic()
    counts = count_tokens(((e.ids[1:], e.mask[1:]) for e in examples), target.config.vocab_size)
    if cfg.init_from:
        head = load_init_head(cfg.init_from, target)
        facts["init_from"] = cfg.init_from
        if cfg.remap_vocab:
            facts["init_vocab_coverage"] = round(float(counts[head.t2d.bool()].sum()) / max(1, int(counts.sum())), 5)
            facts["vocab_tokens_replaced"] = remap_vocab(head, target, counts)
        dvs, t2d = head.config.draft_vocab_size, head.t2d.bool()
    else:
        dvs = min(cfg.draft_vocab_size, target.config.vocab_size)
        d2t, t2d = build_vocab_map(counts, dvs)
        head = Eagle3DraftModel(Eagle3Config.from_target(target.config, dvs))
        head.set_vocab_map(d2t, t2d)
        init_head(head, target, cfg.init_from_target, cfg.seed)
    facts["draft_vocab_coverage"] = round(float(counts[t2d].sum()) / max(1, int(counts.sum())), 5)
    head.to(dev)
    head.train()
    log.info("vocab map and head ready in %.1f s (draft vocab covers %.2f%% of loss tokens)",
             time.monotonic() - t0, 100 * facts["draft_vocab_coverage"])

    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    batches_per_epoch = len(D.make_batches(examples, cfg.batch_tokens, cfg.seed))
    total_steps = cfg.max_steps or cfg.epochs * batches_per_epoch
    step = epoch = skip = 0
    elapsed_before = 0.0
    ckpt_path = os.path.join(cfg.output_dir, CHECKPOINT)
    if cfg.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev, weights_only=False)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optim"])
        step, epoch, skip, elapsed_before = ck["step"], ck["epoch"], ck["batch_in_epoch"], ck["elapsed"]
        log.info("resumed at step %d (epoch %d, batch %d)", step, epoch, skip)

    log_path = os.path.join(cfg.output_dir, "train_log.jsonl")
    log_f = open(log_path, "a")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else _nullctx()
    t_loop = time.monotonic()
    bar = tqdm(total=total_steps, initial=step, desc="train-draft", disable=not cfg.progress, dynamic_ncols=True)
    ema: list[float] | None = None
    last: StepStats | None = None
    done = False

    def progress() -> float:
        p = step / total_steps
        if cfg.time_budget_s:
            p = max(p, (elapsed_before + time.monotonic() - t_loop) / cfg.time_budget_s)
        return p

    while not done:
        groups = D.make_batches(examples, cfg.batch_tokens, cfg.seed + epoch)
        for j, g in enumerate(groups):
            if j < skip:
                continue
            if progress() >= 1.0:
                done = True
                break
            lr = lr_at(cfg, progress())
            for pg in opt.param_groups:
                pg["lr"] = lr
            batch = D.collate(examples, g).to(dev)
            with autocast:
                loss, st = ttt_loss(head, target, batch, cfg.ttt_steps, cfg.ttt_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            last = st
            acc = st.acc()
            ema = acc if ema is None else [0.9 * e + 0.1 * a if not math.isnan(a) else e for e, a in zip(ema, acc)]
            bar.update(1)
            bar.set_postfix_str(f"loss {st.loss:.3f} acc " + " ".join(f"{a:.2f}" for a in ema[:cfg.ttt_steps]))
            if step % cfg.log_every == 0 or step == 1:
                log_f.write(json.dumps({"step": step, "epoch": epoch, "lr": lr, "loss": round(st.loss, 5),
                                        "grad_norm": round(float(gnorm), 4), "acc": [round(a, 4) for a in acc],
                                        "acc_ema": [round(a, 4) for a in ema],
                                        "elapsed_s": round(elapsed_before + time.monotonic() - t_loop, 1)}) + "\n")
                log_f.flush()
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(ckpt_path, head, opt, {"step": step, "epoch": epoch, "batch_in_epoch": j + 1,
                                                        "elapsed": elapsed_before + time.monotonic() - t_loop})
            if cfg.max_steps is not None and step >= cfg.max_steps:
                done = True
                break
        else:
            epoch += 1
            skip = 0
            if cfg.max_steps is None and not cfg.time_budget_s and epoch >= cfg.epochs:
                done = True
    bar.close()
    log_f.close()
    train_s = elapsed_before + time.monotonic() - t_loop
    save_checkpoint(ckpt_path, head, opt, {"step": step, "epoch": epoch, "batch_in_epoch": 0, "elapsed": train_s})

    head.eval()
    save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.save_dtype]
    head.save_pretrained(cfg.output_dir, dtype=save_dtype)
    summary: dict[str, Any] = {
        **facts, "steps": step, "epochs_completed": epoch, "train_loop_s": round(train_s, 1),
        "final_loss": last.loss if last else None, "final_acc_ema": [round(a, 4) for a in (ema or [])],
        "device": device_name(dev), "target": target.name, "draft_vocab_size": dvs,
    }
    if cfg.eval_conversations > 0:
        if dev.type == "cuda":
            del opt
            torch.cuda.empty_cache()  # the engine sizes its KV cache from what is free
        t0 = time.monotonic()
        evex = heldout_examples(target, held, cfg.eval_conversations, cfg.eval_max_tokens, cfg.max_prompt_len,
                                cfg.distill_backend, cfg.distill_batch, time_budget_s=cfg.eval_time_budget_s)
        # evaluate the head as saved (e.g. bf16 weights), not the fp32 master copy
        saved = Eagle3DraftModel.from_pretrained(cfg.output_dir, device=dev, dtype=torch.float32)
        runs = accept_runs(saved, target, evex, steps=cfg.ttt_steps, topk=4, batch_tokens=cfg.batch_tokens)
        rep = acceptance_report(runs, cfg.ttt_steps, topk=4)
        rep.update(heldout_prompts=len(evex), max_tokens=cfg.eval_max_tokens, eval_s=round(time.monotonic() - t0, 1))
        summary["heldout_acceptance"] = rep
    summary["total_s"] = round(time.monotonic() - t_start, 1)
    with open(os.path.join(cfg.output_dir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    write_model_card(cfg, summary, argv)
    return summary
