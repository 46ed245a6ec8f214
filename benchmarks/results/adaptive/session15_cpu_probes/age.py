"""Does serving history slow a no-spec engine? Engine 0 serves alone for a while; then it runs side by side with fresh engine 1."""
import sys, time, torch
from collections import OrderedDict
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import adaptive as A
from specserve import LLM
from specserve.engine.heap import freeze_startup_heap
torch.set_num_threads(2); torch.manual_seed(0)
AGE = [(32, 90), (4, 40), (32, 90), (16, 60), (8, 40), (32, 60)]
llms = [LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=32, seed=0) for _ in range(2)]
clients = [A.Client(f"e{i}", l) for i, l in enumerate(llms)]
pool = A.prompt_pool(llms[0].tokenizer, 600, 256, 64, 0)
for c in clients:
    c.reset(); A.run_side_by_side([c], lambda _: 2, lambda i: (pool[i][0], 8), 2, lambda cl: False if cl.live or cl.issued < 2 else True)
freeze_startup_heap()
off = 2
def pt(cs, C, S):
    global off
    r = A.run_point(cs, C, (lambda o: lambda i: pool[(o + i) % 600])(off), S)
    off += max(c.issued for c in cs)
    return [r["configs"][c.name]["tok_s"] for c in cs]
print("fresh both", pt(clients, 16, 25), flush=True)
for C, S in AGE:
    print("age", C, pt(clients[:1], C, S), flush=True)
bm = llms[0].engine.blocks
print("bm", type(bm), bm.stats if bm else None, flush=True)
for i in range(2):
    print("aged vs fresh", pt(clients, 16, 25), flush=True)
fq = bm.free_queue
bm.free_queue = OrderedDict((b, None) for b in sorted(fq))
for i in range(2):
    print("aged, free queue sorted vs fresh", pt(clients, 16, 25), flush=True)
