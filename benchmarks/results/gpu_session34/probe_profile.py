# Session 34 probe 4 (same setup as the others): a tree32 engine's steady cycle under torch.profiler (CUDA
# activity only): device busy time, the gaps between kernels, and the kernels by device time per step.
import sys, torch, time
sys.path.insert(0, "benchmarks")
from spec_single import CONFIGS
from specserve import LLM, SamplingParams
from torch.profiler import profile, ProfilerActivity
spec = dict(CONFIGS["tree32"]); spec.update(speculative_algorithm="EAGLE3", speculative_draft_model_path="models/smollm2-135m-eagle3", speculative_policy="static")
llm = LLM(model="/tmp/m.gguf", dtype="bfloat16", max_num_seqs=1, num_kv_blocks=1024, **spec)
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
llm.generate(["Tell me about the history of Rome."], sp)
eng = llm.engine
eng.add_request("x", "Write a long poem about the sea and the wind.", sp)
for _ in range(8): eng.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    for _ in range(30): eng.step()
    torch.cuda.synchronize(); dt = time.perf_counter() - t
ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
ev.sort(key=lambda e: e.time_range.start)
busy = sum(e.time_range.end - e.time_range.start for e in ev)
span = ev[-1].time_range.end - ev[0].time_range.start
print(f"wall {dt*1000/30:.3f} ms/step; device busy {busy/30/1000:.3f} ms/step of span {span/30/1000:.3f}; kernels/step {len(ev)/30:.1f}")
gaps = []
for a, b in zip(ev, ev[1:]):
    g = b.time_range.start - a.time_range.end
    if g > 0: gaps.append((g, a.name[:50], b.name[:50]))
gaps.sort(reverse=True)
print("gap total per step (us)", sum(g for g, *_ in gaps)/30)
for g, a, b in gaps[:12]: print(f"  gap {g:.0f} us after {a} before {b}")
from collections import defaultdict
tot = defaultdict(lambda: [0, 0.0])
for e in ev:
    tot[e.name[:70]][0] += 1; tot[e.name[:70]][1] += e.time_range.end - e.time_range.start
for n, (c, t) in sorted(tot.items(), key=lambda x: -x[1][1])[:25]:
    print(f"{t/30:8.1f} us/step {c/30:6.1f}/step  {n}")
