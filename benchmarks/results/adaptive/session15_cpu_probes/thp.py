import sys, os, torch
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import adaptive as A
from specserve import LLM
from specserve.engine.heap import freeze_startup_heap
torch.set_num_threads(2); torch.manual_seed(0)
l = LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=32, seed=0)
c = A.Client("e", l)
pool = A.prompt_pool(l.tokenizer, 600, 256, 64, 0)
c.reset(); A.run_side_by_side([c], lambda _: 2, lambda i: (pool[i][0], 8), 2, lambda cl: False if cl.live or cl.issued < 2 else True)
freeze_startup_heap()
out = []
for C, off in ((16, 2), (1, 300)):
    r = A.run_point([c], C, (lambda o: lambda i: pool[(o + i) % 600])(off), 20)
    out.append(round(r["configs"]["e"]["tok_s"], 1))
hp = [l for l in open(f"/proc/{os.getpid()}/smaps_rollup") if "AnonHuge" in l]
print(os.environ.get("THP_MEM_ALLOC_ENABLE", "0"), out, hp[0].strip(), flush=True)
