"""Does the adaptive controller's start-up profile reproduce the verify cost curve of its own engine?

The controller prices every draft depth from a cost profile it takes at start-up (EagleSpeculator's
``_profile_costs``: steps of n tokens spread over min(n, max_num_seqs) requests, all aliasing one short
context, a handful of interleaved rounds). Here the same engine's target step (forward + the logits of every
row, as a verify computes them) is timed directly on realistic steps: each request with ``--context`` tokens
of its own cached KV (blocks shuffled), n tokens spread the way the profile spreads them, and one request
verifying n tokens (gpu_decode.py's verify curve) against the cost model's prediction for one request. Out:
per token count, the profile's seconds, the cost model's prediction and the direct measurement, and the
median |predicted / measured - 1| over the profile's range.

    python benchmarks/profile_vs_curve.py --output-file benchmarks/results/profile_vs_curve/cpu_chain3_ctx256.json   # SmolLM2 + shipped head
    python benchmarks/profile_vs_curve.py --device cuda --llama8b --max-num-seqs 64 --context 512 \\
        --tokens 1,2,4,8,16,32,64,128,256,384 --output-file ...     # the 8B shape, random weights and head
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specserve.bench.harness import median_abs_error, run_metadata, shape_error, write_json  # noqa: E402
from gpu_decode import LLAMA_8B, make_inputs, spread  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from tiny_model import SMOLLM2_CONFIG, make_dummy_model_dir, make_random_head  # noqa: E402

from specserve import LLM  # noqa: E402


def interleaved_medians(fns: list[Callable[[], object]], rounds: int, iters: int,
                        sync: Callable[[], None] | None) -> list[float]:
    """Per function, the median wall time of a call run to its end (a sync after each on a GPU), over
    ``rounds`` rounds that each time every function ``iters`` times in turn: a machine whose speed drifts
    between minutes (a shared CPU: +-30 %) shifts every point alike rather than the last ones."""
    for fn in fns:  # warm-up
        fn()
        fn()
    if sync:
        sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for ts, fn in zip(times, fns):
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                if sync:
                    sync()
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the default model and shipped head)")
    ap.add_argument("--head", default=None, help="the EAGLE-3 head (default: the shipped one)")
    ap.add_argument("--llama8b", action="store_true", help="Llama-3-8B shapes, random weights and head (a GPU)")
    ap.add_argument("--dummy-smollm2", action="store_true", help="SmolLM2's shapes, random weights and head")
    ap.add_argument("--num-steps", type=int, default=3, help="--speculative-num-steps")
    ap.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (> 1: trees)")
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (trees)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=256, help="cached tokens of each request in the direct steps")
    ap.add_argument("--tokens", default="1,2,4,8,16,24,32,48,64,96,128",
                    help="token counts of the direct steps (those past the profile's range are extrapolated)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds over every step shape")
    ap.add_argument("--iters", type=int, default=3, help="calls of each shape per round")
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    tokens = [int(t) for t in args.tokens.split(",")]
    tmp = tempfile.mkdtemp(prefix="profile_vs_curve_")
    head, load_format, model = args.head, "auto", args.model
    if args.llama8b or args.dummy_smollm2:
        cfg = dict(SMOLLM2_CONFIG) if args.dummy_smollm2 else dict(LLAMA_8B, bos_token_id=1, eos_token_id=2)
        model, load_format = make_dummy_model_dir(os.path.join(tmp, "model"), cfg), "dummy"
        head = make_random_head(model, os.path.join(tmp, "head"))  # (its cost: the target's steps are timed)
    S, bs = args.max_num_seqs, 16
    blocks = S * -(-(args.context + max(tokens)) // bs) + 16
    kw = {} if model is None else {"model": model}
    llm = LLM(**kw, load_format=load_format, device=args.device, max_num_seqs=S, num_kv_blocks=blocks,
              max_num_batched_tokens=max(max(tokens), 2 * S), max_model_len=args.context + max(tokens) + 16,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="adaptive",
              speculative_calibrate=False, speculative_num_steps=args.num_steps, speculative_eagle_topk=args.topk,
              speculative_num_draft_tokens=args.num_draft_tokens,
              speculative_recalibrate=True)  # the profile taken now, by this engine
    eng = llm.engine
    runner, target, cost = eng.runner, eng.drafter.target, eng.drafter.controller.cost
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    vocab = eng.model_config.vocab_size
    for kc, vc in runner.kv_caches:  # random context K/V (never time on zeros)
        for c in (kc, vc):
            c.copy_(torch.randn(c.shape, device=dev).to(c.dtype))  # (made where it lives: 8B caches are GBs)

    def step(q_lens: list[int]) -> Callable[[], object]:
        inputs, _ = make_inputs(q_lens, args.context, bs, 0, dev, gen, vocab)

        def run() -> object:
            with torch.inference_mode():
                out = runner.forward(inputs)
                hidden = out[0] if isinstance(out, tuple) else out
                return target.compute_logits(hidden)

        return run

    profile = cost.target.profile
    verify_most = eng.config.speculative.resolved_num_draft_tokens  # the most one request verifies
    rows = []
    shapes = [spread(n, min(n, S)) for n in tokens]  # as the profile spreads n tokens
    times = interleaved_medians([step(q) for q in shapes] + [step([n]) for n in tokens], args.rounds, args.iters, sync)
    for n, spread_q, measured, one in zip(tokens, shapes, times[: len(tokens)], times[len(tokens):]):
        pred, pred_one = cost.step_time(n, len(spread_q)), cost.step_time(n, 1)
        row = {"tokens": n, "requests": len(spread_q), "profile_s": profile.get(n), "predicted_s": pred,
               "measured_s": measured, "predicted_over_measured": round(pred / measured, 3),
               "one_request": {"predicted_s": pred_one, "measured_s": one,
                               "predicted_over_measured": round(pred_one / one, 3),
                               "a_verify": n <= verify_most},  # (a request verifies at most this many)
               "in_profile_range": n <= max(profile)}
        rows.append(row)
        print(f"{n:5d} tokens over {len(spread_q):3d} requests: predicted {1e3 * pred:8.3f} ms, measured "
              f"{1e3 * measured:8.3f} ms ({pred / measured:.3f}x); one request: {1e3 * pred_one:8.3f} vs "
              f"{1e3 * one:8.3f} ms ({pred_one / one:.3f}x)", flush=True)
    inside = [r for r in rows if r["in_profile_range"]]
    verifies = [r for r in inside if r["one_request"]["a_verify"]]
    result = {"benchmark": "profile_vs_curve", **run_metadata(),
              "command": "python benchmarks/profile_vs_curve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": vars(args), "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "profile_meta": cost.meta, "profile_max_tokens": max(profile), "rows": rows,
              "median_abs_error_in_range": median_abs_error([r["predicted_over_measured"] for r in inside]),
              # one request's verify: the shapes it takes (up to the tree's or chain's tokens)
              "median_abs_error_one_request_verify": median_abs_error(
                  [r["one_request"]["predicted_over_measured"] for r in verifies]),
              # both sets of shapes together, one drift factor taken out: (factor, median error)
              "shape_error": shape_error([r["predicted_s"] for r in inside] + [r["one_request"]["predicted_s"] for r in verifies],
                                         [r["measured_s"] for r in inside] + [r["one_request"]["measured_s"] for r in verifies]),
              "shape_error_one_request_verify": shape_error([r["one_request"]["predicted_s"] for r in verifies],
                                                            [r["one_request"]["measured_s"] for r in verifies])}
    print(f"profile up to {max(profile)} tokens; median |predicted/measured - 1| in its range: "
          f"{result['median_abs_error_in_range']} (spread as profiled); one request verifying up to {verify_most} "
          f"tokens: {result['median_abs_error_one_request_verify']}; with one drift factor out (factor, error): "
          f"{result['shape_error']}, one request's verifies alone {result['shape_error_one_request_verify']}", flush=True)
    write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
