"""`specserve train-draft`: train an EAGLE-3 draft head for a target the engine loads."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from specserve.train.eagle3 import TrainConfig

log = logging.getLogger(__name__)


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig(output_dir="")
    a = p.add_argument
    a("--model", default=None, help="target: GGUF file or HF model directory (default: the default model)")
    a("--output-dir", required=True, help="where the head (public EAGLE-3 layout), card and logs go")
    a("--data", default=d.data, help="'sharegpt' (packaged ShareGPT V3) or a JSONL file of conversations")
    a("--draft-vocab-size", type=int, default=d.draft_vocab_size)
    a("--max-conversations", type=int, default=None, help="cap on training conversations")
    a("--heldout", type=int, default=d.heldout, help="conversations held out (never trained on)")
    a("--split-seed", type=int, default=d.split_seed, help="seed of the held-out split")
    a("--seed", type=int, default=d.seed, help="seed of the initialisation and the batch order")
    a("--max-len", type=int, default=d.max_len, help="tokens per training sequence (longer are cut)")
    a("--max-prompt-len", type=int, default=d.max_prompt_len)
    a("--self-distill", action=argparse.BooleanOptionalAction, default=d.self_distill,
      help="regenerate assistant turns greedily with the target itself (our engine, batched)")
    a("--distill-max-tokens", type=int, default=d.distill_max_tokens)
    a("--distill-turns", type=int, default=d.distill_turns)
    a("--distill-backend", choices=["engine", "simple"], default=d.distill_backend)
    a("--distill-batch", type=int, default=d.distill_batch, help="concurrent sequences while generating")
    a("--distill-time-budget", type=float, default=None, dest="distill_time_budget_s")
    a("--distill-keep-original", action=argparse.BooleanOptionalAction, default=d.distill_keep_original,
      help="conversations the distillation budget did not reach keep their dataset replies")
    a("--prepare-only", action="store_true", help="build and cache the training data, then stop")
    a("--epochs", type=int, default=d.epochs)
    a("--max-steps", type=int, default=None)
    a("--time-budget", type=float, default=None, dest="time_budget_s",
      help="seconds of training; the LR schedule runs to completion within it")
    a("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per batch")
    a("--lr", type=float, default=d.lr)
    a("--warmup-ratio", type=float, default=d.warmup_ratio)
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--grad-clip", type=float, default=d.grad_clip)
    a("--ttt-steps", type=int, default=d.ttt_steps)
    a("--ttt-decay", type=float, default=d.ttt_decay)
    a("--device", default=d.device)
    a("--save-every", type=int, default=d.save_every, help="steps between resumable checkpoints")
    a("--resume", action="store_true", help="continue from output-dir/checkpoint.pt")
    a("--eval-conversations", type=int, default=d.eval_conversations,
      help="held-out prompts for the acceptance measurement (0: skip)")
    a("--eval-max-tokens", type=int, default=d.eval_max_tokens)
    a("--eval-time-budget", type=float, default=None, dest="eval_time_budget_s",
      help="seconds for generating the held-out replies (groups not started in time are skipped)")
    a("--save-dtype", choices=["float32", "bfloat16", "float16"], default=d.save_dtype)
    a("--init-from-target", action=argparse.BooleanOptionalAction, default=d.init_from_target,
      help="start lm_head/norm from the target's rows for the draft vocab")
    a("--init-from", default=None, help="continue training this EAGLE-3 head (its draft vocab is kept; "
      "--draft-vocab-size is then ignored)")
    a("--remap-vocab", action="store_true", help="with --init-from: re-choose the draft vocab (same size) from "
      "this data's tokens; kept tokens keep their rows, new ones start from the target's")
    a("--log-every", type=int, default=d.log_every)
    a("--progress", action=argparse.BooleanOptionalAction, default=True)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    import dataclasses

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.train.eagle3 import train
    from specserve.train.target import load_target, resolve_device

    cfg = config_from_args(args)
    device = resolve_device(cfg.device)
    target = load_target(cfg.model, device)
    argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "train-draft" else sys.argv[1:]
    summary = train(cfg, target, argv=argv)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "heldout_acceptance"})
    if "heldout_acceptance" in summary:
        log.info("held-out chain accept length: %s", summary["heldout_acceptance"]["chain_accept_length"])
    return summary


__all__ = ["add_train_args", "main", "TrainConfig"]
