"""Why a calibrated adaptive engine fell short at C = 1-2 in session 12's full run (0.940, 0.902) but not in
the 3-engine A/B: same prompts as the full run's first two points, chain 2 / chain 3 against adaptive engines
that differ only in max_num_seqs (what the start-up calibration covers) and in calibration.
Run: SECS=40 PYTHONPATH=. python <this file>"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))  # benchmarks/
import torch
import adaptive as A
from specserve import LLM

torch.set_num_threads(2); torch.manual_seed(0)
cs = [int(x) for x in os.environ.get("CS", "1,2").split(",")]
secs = float(os.environ.get("SECS", 40))
ad = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive", "speculative_num_steps": 3}
mk = lambda n, **kw: LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=n, seed=0, **kw)
llms = {"chain2": mk(32, **{**A.STATIC, "speculative_num_steps": 2}),
        "chain3": mk(32, **{**A.STATIC, "speculative_num_steps": 3}),
        "ad_cal32": mk(32, **ad, speculative_calibrate=True),
        "ad_cal8": mk(8, **ad, speculative_calibrate=True),
        "ad_nocal32": mk(32, **ad, speculative_calibrate=False)}
clients = [A.Client(n, l) for n, l in llms.items()]
pool = A.prompt_pool(llms["chain2"].tokenizer, 600, 256, 64, 0)
warm = [(p, 8) for p, _ in pool[:2]]
for c in clients:
    c.reset()
    A.run_side_by_side([c], lambda _: 2, lambda i: warm[i], 2, lambda cl: False if cl.live or cl.issued < 2 else True)
off, out = 2, []
for C in cs:
    src = (lambda o: (lambda i: pool[(o + i) % len(pool)]))(off)
    p = A.run_point(clients, C, src, secs)
    off += max(c.issued for c in clients)
    cf = p["configs"]
    best = max(cf["chain2"]["tok_s"], cf["chain3"]["tok_s"])
    row = {"C": C, "tok_s": {n: round(cf[n]["tok_s"], 2) for n in cf},
           "over_best_chain": {n: round(cf[n]["tok_s"] / best, 3) for n in cf},
           "tpot_ms": {n: round(cf[n]["tpot_ms_mean"], 1) for n in cf},
           "hist": {n: cf[n].get("k_histogram") for n in cf}, "expl": {n: cf[n].get("explorations") for n in cf},
           "k_changes": {n: cf[n].get("k_changes") for n in cf}}
    print(json.dumps(row), flush=True)
    out.append(row)
json.dump(out, open(os.environ.get("OUT", "probe.json"), "w"), indent=1)
