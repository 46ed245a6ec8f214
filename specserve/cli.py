"""`specserve` command line: serve | generate | bench | train-draft."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine


def _generate(args: argparse.Namespace) -> None:
    from specserve.engine.args import engine_config_from_args
    from specserve.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    try:
        _generate_with(engine, args)
    finally:
        engine.close()


def _generate_with(engine: "LLMEngine", args: argparse.Namespace) -> None:
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or ["Write a haiku about speculative decoding."]
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
        engine.add_request(str(i), ids, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    for i, p in enumerate(prompts):
        o = outs[str(i)]
        m = o.metrics
        print(f"### prompt: {p}\n{o.outputs[0].text}\n")
        info = {"tokens": len(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                "ttft_s": round(m.ttft or 0, 3), "accept_length": m.accept_length}
        print(json.dumps(info), file=sys.stderr)


def _torchrun_rank() -> int:
    from specserve.distributed.parallel import torchrun_env

    env = torchrun_env()
    return int(env["RANK"]) if env is not None else 0


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specserve.engine.args import add_engine_args

    parser = argparse.ArgumentParser(prog="specserve")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    from specserve.server.launch import add_serve_args, main as serve_main

    add_serve_args(p)
    p.set_defaults(func=serve_main)

    p = sub.add_parser("generate", help="generate offline for a few prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="repeatable")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.set_defaults(func=_generate)

    p = sub.add_parser("bench", help="serving benchmark client and sweeps")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    try:
        from specserve.bench.serving_args import add_bench_serve_args, main as bench_main
        from specserve.bench.sweep import add_sweep_args, main as sweep_main

        b = bsub.add_parser("serve", help="load a running server")
        add_bench_serve_args(b)
        b.set_defaults(func=bench_main)
        b = bsub.add_parser("sweep", help="start servers per configuration and sweep concurrency")
        add_sweep_args(b)
        b.set_defaults(func=sweep_main)
        from specserve.bench.served_vs_offline import add_args as add_svo_args, main as svo_main

        b = bsub.add_parser("served-vs-offline",
                            help="the same engine served and in-process at each concurrency: tok/s, TTFT, TPOT, ITL")
        add_svo_args(b)
        b.set_defaults(func=svo_main)
    except ImportError:  # pragma: no cover - during development only
        pass

    p = sub.add_parser("train-draft", help="train an EAGLE-3 draft head")
    try:
        from specserve.train import add_train_args, main as train_main

        add_train_args(p)
        p.set_defaults(func=train_main)
    except ImportError:  # pragma: no cover
        pass

    args = parser.parse_args(argv)
    if args.cmd in ("serve", "generate") and _torchrun_rank() > 0:  # a tensor-parallel rank past 0: no engine
        from specserve.distributed.worker import run_worker
        from specserve.engine.args import engine_config_from_args

        run_worker(engine_config_from_args(args))
        return
    # the command as typed, for the benchmark results (sys.argv is the caller's when main() is called)
    args.argv = ["specserve", *(sys.argv[1:] if argv is None else argv)]
    args.func(args)


if __name__ == "__main__":
    main()
