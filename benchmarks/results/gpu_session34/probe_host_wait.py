# Session 34 probe 3: how long the host waits for the device per cycle (tree32) or step (no-spec).
import time, torch, sys, cProfile, pstats, io
sys.path.insert(0, "benchmarks")
from spec_single import CONFIGS
from specserve import LLM, SamplingParams
for cfg in ("tree32", "nospec"):
    spec = dict(CONFIGS[cfg])
    if spec: spec.update(speculative_algorithm="EAGLE3", speculative_draft_model_path="models/smollm2-135m-eagle3", speculative_policy="static")
    llm = LLM(model="/tmp/m.gguf", dtype="bfloat16", max_num_seqs=1, num_kv_blocks=1024, **spec)
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(["Tell me about the history of Rome."], sp)
    waits = [0.0]
    orig = torch.cuda.Event.synchronize
    def timed(self):
        a = time.perf_counter(); orig(self); waits[0] += time.perf_counter() - a
    torch.cuda.Event.synchronize = timed
    s0 = llm.engine.stats.steps
    t = time.perf_counter(); llm.generate(["Write a long poem about the sea and the wind."], sp); dt = time.perf_counter() - t
    n = llm.engine.stats.steps - s0
    torch.cuda.Event.synchronize = orig
    print(cfg, "steps", n, "ms/step", round(1000*dt/n, 3), "event wait ms/step", round(1000*waits[0]/n, 3))
    pr = cProfile.Profile(); pr.enable(); llm.generate(["Write a long poem about the sea and the wind."], sp); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[-2600:])
