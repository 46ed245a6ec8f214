"""Cached prompt blocks without draft KV: taken and caught up by the head, or refused and recomputed.

Blocks filled while a request does not draft (speculation off, a plain-decoding pick of the adaptive
policy, ``max_spec_tokens=0``) get no draft KV. A drafting request that meets them in the prefix cache
either takes them and has the head catch up over them from the target features kept at their slots
(``catch_up_cached_prefix``, the default since session 42) or, as before, refuses them and recomputes the
prompt through the target. Per round, for each setting (interleaved, one engine each): the prompts once
with ``max_spec_tokens=0`` (one token: their blocks cached without draft KV), then the same prompts
drafting (static chain), timed. Reports tok/s of the timed phase, prefix hits / refusals and the accepted
drafts (the same either way: the catch-up gives the head the draft KV a recompute would).

    python benchmarks/prefix_draft_kv.py --output-file benchmarks/results/prefix_draft_kv.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import chat_prompt_ids, run_metadata, write_json  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402


def timed_phase(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    eng = llm.engine
    eng.blocks.reset_prefix_cache()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, max_spec_tokens=0), use_tqdm=False)
    before = eng.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    s = time.perf_counter() - t0
    after = eng.get_stats()
    return {"seconds": s, "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / s,
            "prefix_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "prefix_refused": after.prefix_cache_refused - before.prefix_cache_refused,
            "accepted": sum(o.metrics.spec_accepted_tokens for o in outs),
            "drafted": sum(o.metrics.spec_draft_tokens for o in outs),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=3, help="the static chain's depth")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args(argv)
    llms = {}
    for name, on in (("caught_up", True), ("refused", False)):
        llms[name] = LLM(max_num_seqs=args.max_num_seqs, speculative_algorithm="EAGLE3", speculative_policy="static",
                         speculative_num_steps=args.num_steps, kv_cache_memory_gb=0.5)
        llms[name].engine.drafter.controller.catch_up_cached_prefix = on
    prompts = chat_prompt_ids(llms["caught_up"].tokenizer, args.num_prompts)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in llms}
    for r in range(args.rounds):
        for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            runs[n].append(timed_phase(llms[n], prompts, args.max_tokens))
    same = runs["caught_up"][0]["tokens"] == runs["refused"][0]["tokens"]
    result: dict[str, Any] = {"benchmark": "prefix_draft_kv", **run_metadata(),
                              "command": "python benchmarks/prefix_draft_kv.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "settings": vars(args), "same_tokens": same, "configs": {}}
    for n, rs in runs.items():
        result["configs"][n] = {"tok_s_rounds": [round(x["tok_s"], 1) for x in rs],
                                "tok_s_median": round(statistics.median(x["tok_s"] for x in rs), 1),
                                **{k: rs[0][k] for k in ("prefix_hits", "prefix_refused", "accepted", "drafted")}}
    ratio = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["caught_up"], runs["refused"])]
    result["caught_up_over_refused"] = {"rounds": [round(x, 3) for x in ratio], "median": round(statistics.median(ratio), 3)}
    for n, c in result["configs"].items():
        print(f"{n}: {c['tok_s_median']} tok/s (rounds {c['tok_s_rounds']}), prefix hits {c['prefix_hits']}, "
              f"refused {c['prefix_refused']}, accepted {c['accepted']} of {c['drafted']} drafted")
    print(f"caught up / refused: {result['caught_up_over_refused']}; same tokens: {same}")
    write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
