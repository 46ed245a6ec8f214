"""A tensor-parallel rank past 0: loads its shard of the target, then runs every op rank 0 sends
(``plans.py``) until told to stop. It decides nothing: scheduling, drafting and sampling are rank 0's.

Started by rank 0 (``python -m specserve.distributed.worker``, its EngineConfig pickled on stdin) or
by torchrun through the ``serve``/``generate`` commands (``run_worker``). It exits when rank 0 is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time

import torch

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.config import EngineConfig
from specserve.distributed.parallel import init_group, rank_device, torchrun_env
from specserve.distributed.plans import recv_op

log = logging.getLogger(__name__)


def run_worker(config: EngineConfig) -> None:
    """Serve rank $RANK of the group in the torchrun environment until rank 0 sends shutdown."""
    from specserve.engine.engine import load_target, resolve_device, resolve_dtype
    from specserve.engine.runner import ModelRunner
    from specserve.loader import load_model_source

    env = torchrun_env()
    if env is None:
        raise RuntimeError("a tensor-parallel worker needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if size != config.tensor_parallel_size:
        raise ValueError(f"WORLD_SIZE={size} but tensor_parallel_size={config.tensor_parallel_size}")
    device = rank_device(resolve_device(config.device), int(env["LOCAL_RANK"]))
    dtype = resolve_dtype(config.dtype, device)
    tp = init_group(rank, size, "env://", device)
    src = load_model_source(config.model, tokenizer_path=config.tokenizer,
                            require_weights=config.load_format != "dummy")
    model, _ = load_target(src, config, device, dtype, tp)
    op, header, _ = recv_op(tp, device)
    if op == "shutdown":  # rank 0 failed before its KV cache was sized
        return
    if op != "init":
        raise RuntimeError(f"tensor-parallel rank {rank}: expected init, got {op}")
    runner = ModelRunner(model, tp.local_config(src.config), dataclasses.replace(config, enforce_eager=True),
                         header["layout"], device, dtype)
    log.info("tensor-parallel rank %d/%d ready on %s: %d KV heads of %d", rank, size, device,
             runner.mc.num_key_value_heads, src.config.num_key_value_heads)
    with torch.inference_mode():
        while True:
            op, header, t = recv_op(tp, device)
            if op == "forward":
                ids, pos, slots, tables = t[:4]
                window = t[4:6] if header["window"] else (None, None)  # (the window pool's slots, tables)
                meta = AttentionMetadata(header["query_lens"], header["seq_lens"], slots, tables,
                                         header["tree_masks"], t[-1] if header["shift"] else None, *window)
                runner.attn.plan(meta)
                with forward_context(runner.attn):
                    model(ids, pos)
            elif op == "logits":
                model.compute_logits(t[0])
            elif op == "embed":
                model.embed_tokens(t[0])
            elif op == "aux":
                model.set_aux_hidden_layers(header["ids"])
            elif op == "kv_compact":  # (tables, starts, lengths, paths, valid(, window tables))
                runner.compact_tree_kv(*t)
            elif op == "shutdown":
                break
            else:
                raise RuntimeError(f"tensor-parallel rank {rank}: unknown op {op!r}")
    torch.distributed.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """Rank 0 started this process: go when it is gone (its collectives would wait for minutes)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, parent = pickle.load(sys.stdin.buffer)  # from driver.start_tensor_parallel
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    from specserve.engine.threads import set_cpu_threads

    set_cpu_threads()
    try:
        run_worker(config)
    except Exception:
        log.exception("tensor-parallel rank %s failed", os.environ.get("RANK"))
        logging.shutdown()
        os._exit(1)  # sys.exit would run gloo's destructors mid-collective: abort (-6), not 1


if __name__ == "__main__":
    main()
