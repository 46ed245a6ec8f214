"""What a training run reads and writes: the head it continues from, its checkpoints, the model card."""

from __future__ import annotations

import logging
import os
import platform
from typing import TYPE_CHECKING, Any, Sequence

import torch

from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel
from specserve.train.target import Target

log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from specserve.train.eagle3 import TrainConfig


def load_init_head(path: str, target: Target) -> Eagle3DraftModel:
    """An EAGLE-3 head to continue training from (fp32); it must fit the target's shapes."""
    head = Eagle3DraftModel.from_pretrained(path)
    if not head.is_eagle3:
        raise ValueError(f"--init-from {path} is not an EAGLE-3 head")
    want = Eagle3Config.from_target(target.config, head.config.draft_vocab_size)
    got = head.config
    for f in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "feature_size"):
        if getattr(got, f) != getattr(want, f):
            raise ValueError(f"--init-from {path}: {f} {getattr(got, f)} does not fit the target ({getattr(want, f)})")
    return head


def save_checkpoint(path: str, head: Eagle3DraftModel, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    torch.save({"head": head.state_dict(), "optim": opt.state_dict(), **state}, tmp)
    os.replace(tmp, path)


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write_model_card(cfg: TrainConfig, s: dict[str, Any], argv: Sequence[str] | None) -> None:
    cmd = "specserve train-draft " + " ".join(argv) if argv else "(called from Python)"
    acc = s.get("heldout_acceptance") or {}
    chain = acc.get("chain_accept_length") or {}
    lines = [
        f"# EAGLE-3 draft head for {s['target']}",
        "",
        "Public EAGLE-3 layout (`LlamaForCausalLMEagle3`: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`);",
        "loads in specserve, SGLang and vLLM. Embeddings are shared with the target.",
        "",
        "## Training",
        "",
        f"- Data: {cfg.data} — {s['train_conversations']} conversations, {s['train_examples']} examples, "
        f"{s['train_tokens']} tokens, {s['train_loss_tokens']} assistant (loss) tokens; "
        + (f"assistant turns of {s.get('distilled_conversations')} conversations regenerated greedily by the "
           f"target (self-distillation, {cfg.distill_turns} turn(s), up to {cfg.distill_max_tokens} tokens"
           f"{', the rest keep the dataset replies' if cfg.distill_keep_original else ''})." if cfg.self_distill
           else "the dataset's own assistant turns."),
        (f"- Held-out split: the first {cfg.heldout} indices of `random.Random({cfg.split_seed}).shuffle(range(n))` "
         f"over the {s['source_conversations']} conversations (`heldout.json`); none was trained on." if cfg.heldout
         else "- Held-out split: none taken here (`--heldout 0`): the data was built without the held-out "
              "conversations."),
        (f"- Continued from the head at {cfg.init_from}; its draft vocab of {s['draft_vocab_size']} tokens re-chosen "
         f"from these loss tokens ({s['vocab_tokens_replaced']} replaced; coverage {s['init_vocab_coverage']:.2%} -> "
         f"{s['draft_vocab_coverage']:.2%})." if cfg.init_from and cfg.remap_vocab else
         f"- Continued from the head at {cfg.init_from} (its draft vocab of {s['draft_vocab_size']} tokens kept; "
         f"coverage {s['draft_vocab_coverage']:.2%} of these loss tokens)." if cfg.init_from else
         f"- Draft vocab: {s['draft_vocab_size']} most frequent assistant tokens "
         f"(coverage {s['draft_vocab_coverage']:.2%} of loss tokens)."),
        f"- Training-time test: {cfg.ttt_steps} unrolled steps, weights {cfg.ttt_decay}^i, soft cross-entropy "
        "against the target's distribution over the draft vocab.",
        f"- AdamW lr {cfg.lr}, warmup {cfg.warmup_ratio:.0%} + cosine to {cfg.min_lr_ratio}x, grad clip "
        f"{cfg.grad_clip}, {cfg.batch_tokens} tokens per batch; {s['steps']} steps, {s['epochs_completed']} "
        f"full epoch(s), {s['train_loop_s']} s of training, {s['total_s']} s in all.",
        f"- Hardware: {s['device']}.",
        "",
        "Command:",
        "",
        "```",
        cmd,
        "```",
        "",
        "## Measured acceptance (held-out ShareGPT first turns, greedy)",
        "",
    ]
    if acc:
        lines += [
            f"{acc['heldout_prompts']} held-out prompts, replies of up to {acc['max_tokens']} tokens, "
            f"{acc['bases']} drafting positions.",
            "",
            "| chain length k | " + " | ".join(chain) + " |",
            "| --- | " + " | ".join("---" for _ in chain) + " |",
            "| accept length τ | " + " | ".join(str(v) for v in chain.values()) + " |",
            "",
            "Per-step acceptance (step i right given steps before it right): "
            + ", ".join(str(v) for v in acc["per_step_accept_rate"]) + ".",
            "",
            acc["note"],
        ]
    else:
        lines.append("(not measured in this run)")
    with open(os.path.join(cfg.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
