"""A/B of the packed linears' row buckets (session 17), one engine per process: a static chain-3 engine
serves 48 ShareGPT prompts (<= 256 tokens, outputs spread around 64) with 8 in flight; prints output
tok/s. argv[1]: 1 = row counts above 64 padded to 8 per octave (as committed), 0 = every row count exact.

    for i in 1 2 3; do for b in 0 1; do python benchmarks/results/adaptive/session17_ab/row_buckets_ab.py $b; done; done
"""
import os
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from adaptive import Client, prompt_pool, run_side_by_side  # noqa: E402

from specserve import LLM  # noqa: E402
from specserve.models import cpu_packing  # noqa: E402

cpu_packing.ROW_BUCKETS = sys.argv[1] == "1"
torch.set_num_threads(2)
llm = LLM(None, max_num_seqs=8, seed=0, speculative_algorithm="EAGLE3", speculative_policy="static",
          speculative_num_steps=3)
pool = prompt_pool(llm.tokenizer, 600, 256, 64, 0)
c = Client("chain3", llm)
warm = [(p, 8) for p, _ in pool[:2]]
c.reset()
run_side_by_side([c], lambda _: 2, lambda i: warm[i], 2, lambda cl: False if cl.live or cl.issued < 2 else True)
c.reset()
t0 = time.perf_counter()
run_side_by_side([c], lambda _: 8, lambda i: pool[2 + i], 48, lambda cl: cl.issued >= 48 and not cl.live)
wall = time.perf_counter() - t0
tokens = sum(r.n_out for r in c.done)
print(f"row_buckets={int(cpu_packing.ROW_BUCKETS)} tokens={tokens} wall={wall:.2f}s tok/s={tokens / wall:.1f}", flush=True)
