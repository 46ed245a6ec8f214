"""Accept length of the EAGLE-3 head as the engine measures it, on held-out ShareGPT chat prompts.

Greedy, replies of up to ``--max-tokens`` (natural stops), policy ``static`` so every step
drafts; all prompts run as one batch per configuration (accept length does not depend on
timing, so this runs on a busy machine too). Per configuration: accept length τ
((accepted + verify steps) / verify steps, SGLang's count), per-position acceptance, and how many
outputs equal the no-spec greedy outputs token for token.

The prompts are the first ``--num-prompts`` of ``sharegpt_prompts(seed=0)``: held out from the
shipped head's training (models/smollm2-135m-eagle3/heldout.json lists the indices).

    python benchmarks/accept_length.py --output-file benchmarks/results/accept_length.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specserve.bench.harness import REPO, chat_prompt_ids, run_metadata, write_json  # noqa: E402
from spec_single import CONFIGS as SPEC_CONFIGS  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402

# spec_single's configurations (gpu_spec_c1 takes the same), and chain 1
CONFIGS: dict[str, dict[str, Any]] = {"chain1": {"speculative_num_steps": 1, "speculative_eagle_topk": 1},
                                      **{n: c for n, c in SPEC_CONFIGS.items() if c}}
DEFAULT_CONFIGS = "chain1,chain3,chain5,tree"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default=os.path.join(REPO, "models", "smollm2-135m-eagle3"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated; NAME@DTYPE runs NAME with the head in DTYPE (speculative_draft_dtype)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-file", default="benchmarks/results/accept_length.json")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c.partition("@")[0] not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; choose from {list(CONFIGS)}")
    common = dict(device=args.device, dtype=args.dtype, kv_cache_memory_gb=1.0, max_num_seqs=args.num_prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    t0 = time.perf_counter()
    base = LLM(**common)
    prompts = chat_prompt_ids(base.tokenizer, args.num_prompts, seed=0)
    ref = [list(o.outputs[0].token_ids) for o in base.generate(prompts, sp)]
    del base
    result: dict[str, Any] = {
        "benchmark": "accept_length", "command": "python benchmarks/accept_length.py " + " ".join(argv or sys.argv[1:]),
        **run_metadata(), "draft": os.path.relpath(args.draft, REPO) if args.draft.startswith(REPO) else args.draft,
        "settings": {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "greedy": True,
                     "policy": "static", "prompts": "sharegpt_prompts(seed=0) first N (held out from training)"},
        "nospec_output_tokens": sum(map(len, ref)), "configs": {},
    }
    for name in names:
        base_name, _, draft_dtype = name.partition("@")
        llm = LLM(**common, speculative_algorithm="EAGLE3", speculative_draft_model_path=args.draft,
                  speculative_policy="static", speculative_draft_dtype=draft_dtype or None, **CONFIGS[base_name])
        outs = llm.generate(prompts, sp)
        st = llm.engine.get_stats()
        same = sum(list(o.outputs[0].token_ids) == r for o, r in zip(outs, ref))
        row = {**CONFIGS[base_name], "draft_dtype": draft_dtype or "auto", "accept_length": st.avg_accept_length,
               "acceptance_rate_per_position": [round(a / d, 4) if d else None for a, d in
                                                zip(st.spec_accepted_per_position, st.spec_drafted_per_position)],
               "verify_steps": st.spec_verify_steps, "accepted_tokens": st.spec_accepted_tokens,
               "same_tokens_as_nospec": f"{same}/{len(prompts)}"}
        result["configs"][name] = row
        print(f"{name}: accept length {row['accept_length']:.3f}, same as no-spec {row['same_tokens_as_nospec']}",
              flush=True)
        del llm
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
