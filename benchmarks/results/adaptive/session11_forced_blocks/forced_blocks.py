"""Force arms in alternating blocks on an adaptive engine in a closed loop at C; compare each arm's
end-to-end tok/s (all step time) with what the bandit's cycles measured for it."""
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import torch

from adaptive import Client, prompt_pool, run_side_by_side  # noqa
from specserve import LLM
from specserve.spec.bandit import batch_key

C = int(os.environ.get("C", 32))
BLOCK = int(os.environ.get("BLOCK", 30))
ROUNDS = int(os.environ.get("ROUNDS", 6))
ARMS = [int(x) for x in os.environ.get("ARMS", "0,1").split(",")]
torch.set_num_threads(2)
torch.manual_seed(0)
llm = LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=max(C, 8), seed=0, speculative_algorithm="EAGLE3",
          speculative_policy="adaptive", speculative_num_steps=3, speculative_calibrate=False)
drafter = llm.engine.drafter
ctl = drafter.controller
pool = prompt_pool(llm.tokenizer, 600, 256, 64, 0)
forced = {"arm": 0}


def quick_arm(batch, num_running=None):
    ctl._quick_key = batch_key(batch)
    return forced["arm"]


ctl.quick_arm = quick_arm
log = []  # per finished cycle
orig_finish = ctl.finish_cycle


def finish_cycle(c, seconds):
    if c is not None and c.tokens > 0:
        measured = c.measured and c.prefill_seconds <= ctl.prefill_share_limit * seconds
        log.append(dict(arm=c.arm, tokens=c.tokens, seconds=seconds, prefill=c.prefill_seconds,
                        measured=measured, flag=c.measured, requests=c.requests, block=forced["block"],
                        pos=forced["pos"]))
    orig_finish(c, seconds)


ctl.finish_cycle = finish_cycle
client = Client("a", llm)
src = lambda i: pool[i % len(pool)]  # noqa
client.reset()
steps = []  # (block, arm, pos, seconds, tokens, prefill tokens, new requests)
forced["block"], forced["pos"] = -1, 0
# warm up: run to the first completion at C
run_side_by_side([client], lambda c: C, src, None, lambda c: c.t_first_done is not None)
client.stopped = False
orig_step = llm.engine.step
for b in range(ROUNDS * len(ARMS)):
    forced["block"] = b
    forced["arm"] = ARMS[b % len(ARMS)]
    for pos in range(BLOCK):
        forced["pos"] = pos
        client.top_up(C, src)
        issued0 = client.issued
        t0 = time.perf_counter()
        plan_tokens = llm.engine.scheduler
        outs = llm.engine.step()
        dt = time.perf_counter() - t0
        n = sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            if o.finished:
                client.live.pop(o.request_id, None)
        steps.append(dict(block=b, arm=forced["arm"], pos=pos, seconds=dt, tokens=n))
res = collections.defaultdict(lambda: collections.Counter())
SKIP = 3
for s in steps:
    if s["pos"] < SKIP:
        continue
    r = res[s["arm"]]
    r["e2e_s"] += s["seconds"]
    r["e2e_tok"] += s["tokens"]
for c in log:
    if c["pos"] < SKIP + 1 or c["block"] < 0:
        continue
    r = res[c["arm"]]
    key = "m" if c["measured"] else "u"
    r[key + "_cycles"] += 1
    r[key + "_tok"] += c["tokens"]
    r[key + "_s"] += c["seconds"]
    r[key + "_prefill"] += c["prefill"]
    r[key + "_req"] += c["requests"]
out = {}
for arm, r in sorted(res.items()):
    o = dict(r)
    o["e2e_tok_s"] = r["e2e_tok"] / r["e2e_s"]
    if r["m_s"]:
        o["bandit_tok_s"] = r["m_tok"] / (r["m_s"] - r["m_prefill"])  # as observe gets it
        o["m_tok_per_req"] = r["m_tok"] / r["m_req"]
    o["cyc_tok_s_all"] = (r["m_tok"] + r["u_tok"]) / (r["m_s"] + r["u_s"])
    out[arm] = o
    print(arm, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in o.items()}))
json.dump({"steps": steps, "cycles": log, "summary": out}, open(os.environ.get("OUT", "/tmp/h5runs/diag.json"), "w"))
