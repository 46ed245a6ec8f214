# Session 34 probe 1 (run on the H200 from the repo root, PYTHONPATH=/tmp/site:$PWD, GGUF at /tmp/m.gguf):
# host launch time and back-to-back device time of each CUDA graph replay of a tree32 engine.
import time, torch, sys
sys.path.insert(0, "benchmarks")
from spec_single import CONFIGS
from specserve import LLM
spec = dict(CONFIGS["tree32"]); spec.update(speculative_algorithm="EAGLE3", speculative_draft_model_path="models/smollm2-135m-eagle3", speculative_policy="static")
llm = LLM(model="/tmp/m.gguf", dtype="bfloat16", max_num_seqs=1, num_kv_blocks=1024, **spec)
e = llm.engine; d = e.drafter
def t(name, fn, reps=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    hs = []
    for _ in range(reps):
        a = time.perf_counter(); fn(); hs.append(time.perf_counter() - a)
        if len(hs) % 20 == 0: torch.cuda.synchronize()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); dev = (time.perf_counter() - s) / reps
    hs.sort(); print(f"{name}: host launch median {hs[len(hs)//2]*1e6:.0f} us, back-to-back {dev*1e6:.0f} us/replay")
g = e.runner.graphs.graphs
for n in (1, 16, 32):
    t(f"target graph {n} tokens ({g[n].__class__.__name__})", g[n].replay)
tl = d.tree_launch
for k, gr in tl.graphs.items():
    if k[0] == 1: t(f"fused tree launch {k}", gr.replay)
for k, gr in d.tree_runner.graphs.items():
    if k[0] == 1: t(f"tree expansion {k}", gr.replay)
for k, gr in d.catch_up_runner.graphs.items():
    if k in (8,): t(f"catch-up {k}", gr.replay)
