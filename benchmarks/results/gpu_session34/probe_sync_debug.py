# Session 34 probe 2: synchronizing CUDA calls in a tree32 engine's steady cycle (torch's sync debug mode).
import time, torch, sys, warnings, traceback, collections
sys.path.insert(0, "benchmarks")
from spec_single import CONFIGS
from specserve import LLM, SamplingParams
spec = dict(CONFIGS["tree32"]); spec.update(speculative_algorithm="EAGLE3", speculative_draft_model_path="models/smollm2-135m-eagle3", speculative_policy="static")
llm = LLM(model="/tmp/m.gguf", dtype="bfloat16", max_num_seqs=1, num_kv_blocks=1024, **spec)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(["Tell me about the history of Rome."], sp)
seen = collections.Counter()
def hook(message, category, filename, lineno, file=None, line=None):
    st = "".join(l for l in traceback.format_stack(limit=12)[:-2] if "specserve" in l)
    seen[(str(message)[:80], st)] += 1
warnings.showwarning = hook
torch.cuda.set_sync_debug_mode("warn")
t=time.perf_counter(); out = llm.generate(["Write a poem about the sea and the wind."], sp); dt=time.perf_counter()-t
torch.cuda.set_sync_debug_mode(0)
st = llm.engine.stats
print("steps", st.steps, "s", round(dt,3))
for (m, s), c in seen.most_common(12):
    print(c, m); print(s[-1200:])
