"""Do identical no-spec engines in one process run at different speeds (instance effect)?"""
import sys, time, torch
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import adaptive as A
from specserve import LLM
from specserve.engine.heap import freeze_startup_heap
torch.set_num_threads(2); torch.manual_seed(0)
N = int(sys.argv[1]); C = int(sys.argv[2]); S = float(sys.argv[3]); P = int(sys.argv[4]); share = len(sys.argv) > 5 and sys.argv[5] == "share"
llms = [LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=32, seed=0) for _ in range(N)]
if share:
    m0 = llms[0].engine.runner.model
    for l in llms[1:]:
        l.engine.runner.model = m0
clients = [A.Client(f"e{i}", l) for i, l in enumerate(llms)]
pool = A.prompt_pool(llms[0].tokenizer, 600, 256, 64, 0)
for c in clients:
    c.reset(); A.run_side_by_side([c], lambda _: 2, lambda i: (pool[i][0], 8), 2, lambda cl: False if cl.live or cl.issued < 2 else True)
freeze_startup_heap()
off = 2
for p in range(P):
    r = A.run_point(clients, C, (lambda o: lambda i: pool[(o + i) % 600])(off), S)
    off += max(c.issued for c in clients)
    toks = [r["configs"][c.name]["tok_s"] for c in clients]
    print(p, " ".join(f"{t:.1f}" for t in toks), f"spread {max(toks)/min(toks):.3f}", flush=True)
