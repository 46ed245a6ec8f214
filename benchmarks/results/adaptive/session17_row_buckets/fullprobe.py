"""adaptive.py with every adaptive cycle logged (class-level hooks)."""
import sys, json, time
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks")); sys.path.insert(0, ROOT)
from specserve.spec import controller as cm
LOG = []
orig_dec = cm.SpecController._decide_adaptive
def dec(self, *x, **k):
    ks, ex = orig_dec(self, *x, **k)
    if self._cycle is not None:
        self._cycle.exploring = ex
        self._cycle.full = True
    return ks, ex
cm.SpecController._decide_adaptive = dec
orig_fin = cm.SpecController.finish_cycle
def fin(self, c, seconds):
    if c is not None and self.cfg.policy == "adaptive":
        b = self.bandit
        LOG.append(dict(t=time.perf_counter(), arm=c.arm, ex=getattr(c, "exploring", False), full=getattr(c, "full", False),
                        measured=c.measured, tokens=c.tokens, s=seconds, pre=c.prefill_seconds, key=c.key,
                        pred=(c.target_predicted or 0) + c.draft_predicted, chosen=b.chosen.get(c.key),
                        est={a: round(v[0], 2) for a, v in getattr(b, "_last_est", {}).items()}))
    return orig_fin(self, c, seconds)
cm.SpecController.finish_cycle = fin
from specserve.spec import bandit as bm
orig_est = bm.GoodputBandit.estimates
def est(self, *a, **k):
    out = orig_est(self, *a, **k)
    self._last_est = out
    return out
bm.GoodputBandit.estimates = est
import adaptive
import os
from specserve.models import cpu_packing
cpu_packing.ROW_BUCKETS = os.environ.get("ROWB", "1") == "1"
print("ROW_BUCKETS", cpu_packing.ROW_BUCKETS, flush=True)
out = sys.argv[sys.argv.index("--output-dir") + 1]
try:
    adaptive.main(sys.argv[1:])
finally:
    json.dump(LOG, open(out + "/cycles.json", "w"))
