"""Same run, interleaved (CS=1,2 SECS=40 REPS=2 PYTHONPATH=. python <this file>): adaptive with 989c26f's exploration budget vs the same engine with the old one."""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))  # benchmarks/
import torch
import adaptive as A
from specserve import LLM

torch.set_num_threads(2); torch.manual_seed(0)
cs = [int(x) for x in os.environ.get("CS", "1,2").split(",")]
secs = float(os.environ.get("SECS", 40))
ad = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive", "speculative_num_steps": 3,
      "speculative_calibrate": True}
llms = {"chain2": LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=8, seed=0, **{**A.STATIC, "speculative_num_steps": 2}),
        "new": LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=8, seed=0, **ad),
        "old": LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=8, seed=0, **ad)}
old = llms["old"].engine.drafter.controller
old.bandit.budget_decay = 0.995
old.catch_up_seconds = lambda tokens: 0.0
clients = [A.Client(n, l) for n, l in llms.items()]
pool = A.prompt_pool(llms["chain2"].tokenizer, 600, 256, 64, 0)
off = 2
out = []
for rep in range(int(os.environ.get("REPS", 1))):
    for C in cs:
        src = (lambda o: (lambda i: pool[(o + i) % len(pool)]))(off)
        p = A.run_point(clients, C, src, secs)
        off += max(c.issued for c in clients)
        cf = p["configs"]
        row = {n: round(cf[n]["tok_s"], 2) for n in cf}
        row.update(C=C, new_over_old=cf["new"]["tok_s"] / cf["old"]["tok_s"],
                   new_over_chain2=cf["new"]["tok_s"] / cf["chain2"]["tok_s"],
                   old_over_chain2=cf["old"]["tok_s"] / cf["chain2"]["tok_s"],
                   hist={n: cf[n].get("k_histogram") for n in ("new", "old")},
                   expl={n: cf[n].get("explorations") for n in ("new", "old")})
        print(json.dumps(row), flush=True)
        out.append(row)
json.dump(out, open(os.environ.get("OUT", "ab.json"), "w"), indent=1)
