"""`specserve` command line: serve | generate | bench | train-draft.

Building the parser imports no torch: `specserve --help` and `specserve serve --help` answer at once.
The bench and train-draft flags are added only when that command is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or action.default is argparse.SUPPRESS or not action.option_strings:
            return help
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
            return f"{help} (default: {'on' if action.default not in (False, None) else 'off'})"
        return f"{help} (default: %(default)s)"


SERVE_HELP = ("OpenAI-compatible HTTP server. The default model speculates by default with its shipped EAGLE-3 "
              "head (adaptive policy); --speculative-algorithm NONE turns speculation off.")
GENERATE_HELP = ("generate offline for a few prompts; speculates by default like `serve` (the default model "
                 "with its shipped EAGLE-3 head); --speculative-algorithm NONE turns speculation off.")


def _generate(args: argparse.Namespace) -> None:
    from specserve.engine.args import engine_config_from_args
    from specserve.engine.engine import LLMEngine
    from specserve.engine.threads import set_cpu_threads

    set_cpu_threads()
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


def _serve(args: argparse.Namespace) -> None:
    from specserve.server.launch import main

    main(args)


def _add_bench(p: argparse.ArgumentParser) -> None:
    from specserve.bench.served_vs_offline import add_args as add_svo_args, main as svo_main
    from specserve.bench.serving_args import add_bench_serve_args, main as bench_main
    from specserve.bench.soak import add_soak_args, main as soak_main
    from specserve.bench.sweep import add_sweep_args, main as sweep_main

    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    b = bsub.add_parser("serve", help="load a running server")
    add_bench_serve_args(b)
    b.set_defaults(func=bench_main)
    b = bsub.add_parser("sweep", help="start servers per configuration and sweep concurrency")
    add_sweep_args(b)
    b.set_defaults(func=sweep_main)
    b = bsub.add_parser("served-vs-offline",
                        help="the same engine served and in-process at each concurrency: tok/s, TTFT, TPOT, ITL")
    add_svo_args(b)
    b.set_defaults(func=svo_main)
    b = bsub.add_parser("soak", formatter_class=HelpFormatter,
                        help="many requests against a running server, some malformed, structured or dropped "
                             "mid-stream: all complete, no 5xx, KV freed, memory flat")
    add_soak_args(b)
    b.set_defaults(func=soak_main)


def _add_train(p: argparse.ArgumentParser) -> None:
    from specserve.train import add_train_args, main as train_main

    add_train_args(p)
    p.set_defaults(func=train_main)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from specserve.engine.args import add_engine_args
    from specserve.server.args import add_serve_args

    parser = argparse.ArgumentParser(prog="specserve", description="LLM serving with adaptive EAGLE-3 speculative "
                                     "decoding.", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP, formatter_class=HelpFormatter)
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help=GENERATE_HELP, description=GENERATE_HELP, formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt; repeatable (default: one haiku prompt)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the chat template as a user message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of each request's sampling (default: none)")
    p.set_defaults(func=_generate)

    command = next((a for a in argv if not a.startswith("-")), None)  # flags of the others: only when given
    p = sub.add_parser("bench", help="serving benchmark client, sweeps and the soak test")
    if command == "bench":
        _add_bench(p)
    p = sub.add_parser("train-draft", help="train an EAGLE-3 draft head")
    if command == "train-draft":
        _add_train(p)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    if args.cmd in ("serve", "generate") and _torchrun_rank() > 0:  # a tensor-parallel rank past 0: no engine
        from specserve.distributed.worker import run_worker
        from specserve.engine.args import engine_config_from_args

        run_worker(engine_config_from_args(args))
        return
    # the command as typed, for the benchmark results (sys.argv is the caller's when main() is called)
    args.argv = ["specserve", *argv]
    args.func(args)


if __name__ == "__main__":
    main()
