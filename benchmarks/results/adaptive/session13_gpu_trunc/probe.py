"""GPU: does the per-request depth cut (controller.truncate_relative, arm_depths) cost the adaptive engine
at low concurrency? Interleaved as benchmarks/adaptive.py: none, chain 3, chain 5, adaptive (cut at 0.5x
the average request's gain, the default) and adaptive with no cut (0).
Run on the device: CS=1,4,16,64 SECS=12 PYTHONPATH=. python3 <this file> /tmp/m.gguf OUT.json"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))  # benchmarks/
import torch
import adaptive as A
from specserve import LLM

torch.manual_seed(0)
model, out_path = sys.argv[1], sys.argv[2]
cs = [int(x) for x in os.environ.get("CS", "1,4,16,64").split(",")]
secs = float(os.environ.get("SECS", 12))
mk = lambda **kw: LLM(model, max_num_seqs=max(cs + [8]), seed=0, num_kv_blocks=16384, **kw)
ad = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive", "speculative_num_steps": 5}
llms = {"none": mk(), "chain3": mk(**A.STATIC, speculative_num_steps=3), "chain5": mk(**A.STATIC, speculative_num_steps=5),
        "adaptive": mk(**ad), "adaptive_nocut": mk(**ad)}
llms["adaptive_nocut"].engine.drafter.controller.truncate_relative = 0.0
clients = [A.Client(n, l) for n, l in llms.items()]
pool = A.prompt_pool(llms["none"].tokenizer, 600, 300, 128, 0)
warm = [(p, 8) for p, _ in pool[:2]]
for c in clients:
    c.reset()
    A.run_side_by_side([c], lambda _: 2, lambda i: warm[i], 2, lambda cl: False if cl.live or cl.issued < 2 else True)
off, rows = 2, []
for C in cs:
    src = (lambda o: (lambda i: pool[(o + i) % len(pool)]))(off)
    p = A.run_point(clients, C, src, secs)
    off += max(c.issued for c in clients)
    cf = p["configs"]
    best = max(cf[n]["tok_s"] for n in ("none", "chain3", "chain5"))
    row = {"C": C, "tok_s": {n: round(cf[n]["tok_s"], 1) for n in cf},
           "over_best_fixed": {n: round(cf[n]["tok_s"] / best, 3) for n in cf},
           "hist": {n: cf[n].get("k_histogram") for n in cf}, "expl": {n: cf[n].get("explorations") for n in cf},
           "accept_length": {n: cf[n].get("accept_length") for n in cf}}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"command": "CS=%s SECS=%s python3 %s" % (",".join(map(str, cs)), secs, " ".join(sys.argv)), "points": rows},
          open(out_path, "w"), indent=1)
