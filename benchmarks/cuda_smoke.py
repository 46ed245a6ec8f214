"""CUDA smoke run on the real SmolLM2 (run on the GPU machine with the GGUF staged there).

1. Greedy parity: specserve (fp32, the GPU default attention backend and CUDA graphs) vs
   transformers `generate` on the same GGUF, 64 tokens, 5 held-out ShareGPT chat prompts.
2. C=1 speculation on the GPU (bf16): no-spec vs EAGLE-3 chain and tree with a given head,
   tokens/s and accept length, greedy outputs compared with no-spec.

    python3 benchmarks/cuda_smoke.py --model /tmp/m.gguf --head models/smollm2-135m-eagle3 --out $OUT/cuda_smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

PROMPTS = os.path.join(os.path.dirname(__file__), "data", "smoke_prompts.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", default=None)
    ap.add_argument("--out", default="cuda_smoke.json")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from specserve import LLM, SamplingParams

    prompts = [[{"role": "user", "content": p}] for p in json.load(open(PROMPTS))]
    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    llm = LLM(model=args.model, dtype="float32")
    ours = [o.outputs[0].token_ids for o in llm.chat(prompts[:5], sp)]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.model), gguf_file=os.path.basename(args.model),
                                              dtype=torch.float32).cuda().eval()
    match = []
    for conv, out in zip(prompts[:5], ours):
        ids = llm.tokenizer.apply_chat_template(conv)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=args.tokens,
                              min_new_tokens=args.tokens, do_sample=False)
        ref_l = ref[0, len(ids):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(out, ref_l)) if a != b), len(out))
        match.append({"equal": out == ref_l, "first_divergence": None if out == ref_l else same})
    result["greedy_parity_fp32"] = match
    del llm, hf
    torch.cuda.empty_cache()
    print(json.dumps(result["greedy_parity_fp32"]))

    if args.head:
        configs = {
            "no-spec": {},
            "chain-3": dict(speculative_num_steps=3),
            "chain-5": dict(speculative_num_steps=5),
            "tree-5x4x16": dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=16),
        }
        spec_prompts = prompts[:10]
        sp1 = SamplingParams(temperature=0, max_tokens=128)
        runs = {}
        ref_out = None
        for name, kw in configs.items():
            spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=args.head,
                        speculative_policy="static", **kw) if kw else {}
            # a fixed KV size: engines of earlier configurations may still hold GPU memory
            llm = LLM(model=args.model, max_num_seqs=1, num_kv_blocks=4096, **spec)
            llm.chat(spec_prompts[:1], SamplingParams(temperature=0, max_tokens=16))  # warm-up
            t0 = time.perf_counter()
            outs = llm.chat(spec_prompts, sp1)
            dt = time.perf_counter() - t0
            toks = [o.outputs[0].token_ids for o in outs]
            n = sum(len(t) for t in toks)
            st = llm.engine.get_stats()
            if ref_out is None:
                ref_out = toks
            runs[name] = {"tok_per_s": n / dt, "tokens": n, "seconds": dt, "accept_length": st.avg_accept_length,
                          "same_as_no_spec": sum(a == b for a, b in zip(toks, ref_out))}
            print(name, json.dumps(runs[name]))
            del llm
            torch.cuda.empty_cache()
        base = runs["no-spec"]["tok_per_s"]
        for r in runs.values():
            r["speedup"] = r["tok_per_s"] / base
        result["c1_bf16"] = runs
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
