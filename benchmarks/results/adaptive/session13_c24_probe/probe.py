"""CPU, C = 2 and 4 (session 13's full run: adaptive 0.935 and 0.962 of the best chain): what a held adaptive
engine costs against a static one, and whether taking each depth's tokens per request from the acceptance
model (bandit.prior_requests huge) instead of the measured cycles, or drafting every request to its arm's
full depth (truncate_relative 0), chooses better. Interleaved as
benchmarks/adaptive.py. Run: CS=2,4 SECS=40 PYTHONPATH=. python <this file> OUT.json"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))  # benchmarks/
import torch
import adaptive as A
from specserve import LLM

torch.set_num_threads(2); torch.manual_seed(0)
cs = [int(x) for x in os.environ.get("CS", "2,4").split(",")]
secs = float(os.environ.get("SECS", 40))
ad = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive", "speculative_num_steps": 3,
      "speculative_calibrate": True}
mk = lambda **kw: LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=32, seed=0, **kw)
llms = {"chain1": mk(**A.STATIC, speculative_num_steps=1), "chain2": mk(**A.STATIC, speculative_num_steps=2),
        "chain3": mk(**A.STATIC, speculative_num_steps=3), "adaptive": mk(**ad), "adaptive_model_tokens": mk(**ad),
        "adaptive@2": mk(**ad), "adaptive_nocut": mk(**ad)}
llms["adaptive_model_tokens"].engine.drafter.controller.bandit.prior_requests = 1e9
llms["adaptive@2"].engine.drafter.controller.forced_arm = 2
llms["adaptive_nocut"].engine.drafter.controller.truncate_relative = 0.0
clients = [A.Client(n, l) for n, l in llms.items()]
pool = A.prompt_pool(llms["chain2"].tokenizer, 600, 256, 64, 0)
warm = [(p, 8) for p, _ in pool[:2]]
for c in clients:
    c.reset()
    A.run_side_by_side([c], lambda _: 2, lambda i: warm[i], 2, lambda cl: False if cl.live or cl.issued < 2 else True)
off, rows = int(os.environ.get("OFFSET", 40)), []
for C in cs:
    src = (lambda o: (lambda i: pool[(o + i) % len(pool)]))(off)
    p = A.run_point(clients, C, src, secs)
    off += max(c.issued for c in clients)
    cf = p["configs"]
    best = max(cf[n]["tok_s"] for n in ("chain1", "chain2", "chain3"))
    row = {"C": C, "tok_s": {n: round(cf[n]["tok_s"], 2) for n in cf},
           "over_best_chain": {n: round(cf[n]["tok_s"] / best, 3) for n in cf},
           "tpot_ms": {n: round(cf[n]["tpot_ms_mean"], 1) for n in cf},
           "hist": {n: cf[n].get("k_histogram") for n in cf}, "expl": {n: cf[n].get("explorations") for n in cf},
           "accept_length": {n: cf[n].get("accept_length") for n in cf}}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"command": f"CS={os.environ.get('CS', '2,4')} SECS={secs} python " + " ".join(sys.argv), "points": rows},
          open(sys.argv[1], "w"), indent=1)
