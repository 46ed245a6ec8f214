"""Guard for refactors of the speculative layer: a fixed workload's outputs, drafting paths and the
controller's k per request per step must match the run recorded in tests/golden/spec_golden.json.

Cases: the tiny random model and the real SmolLM2 with the shipped head, chain and tree, static and
adaptive. Adaptive decisions depend on measured time, so the run is made deterministic: every clock
the engine and the drafter read (``gc_pauses.clock``) is a simulated device clock that advances only
in target and head forwards (by a fixed cost per call and per token), and the cost profile is a fixed
one built from the same costs (no start-up profiling, no calibration). What is compared: output
tokens, ``path_counts``, the k histogram, each step's drafts per running request, acceptance counts.

Record anew (only when a change of behaviour is intended):
    PYTHONPATH=$PWD python tests/test_golden_spec.py --record
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

GOLDEN = Path(__file__).parent / "golden" / "spec_golden.json"
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-eagle3"

# simulated seconds: a target forward of T tokens, a head forward of T tokens
TARGET_S, TARGET_PER_TOKEN_S = 2e-3, 2e-5
HEAD_S, HEAD_PER_TOKEN_S = 3e-4, 1e-6

CHAIN = dict(speculative_num_steps=3)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
SHAPES = {"chain": CHAIN, "tree": TREE}
POLICIES = {"static": dict(speculative_policy="static"), "adaptive": dict(speculative_policy="adaptive")}


class SimClock:
    """time.perf_counter for gc_pauses: advances only in forwards."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def fixed_cost_model(max_tokens: int, max_batch: int, K: int):
    from specserve.speculative.policy.cost_model import CostModel, profile_points

    cost = CostModel()
    cost.target.profile = {n: TARGET_S + TARGET_PER_TOKEN_S * n for n in profile_points(max_tokens)}
    cost.draft.profile = {n: HEAD_S + HEAD_PER_TOKEN_S * n for n in profile_points(max_batch)}
    for b in (1 << i for i in range(max_batch.bit_length())):
        if b in cost.target.profile:
            cost.batch_profiles[b] = {b * t: TARGET_S + TARGET_PER_TOKEN_S * b * t for t in range(1, K + 2)
                                      if b * t <= max_tokens}
    cost.meta = {"date": "fixed", "noisy": False, "source": "golden"}
    return cost


def run_case(model: str, head: str, shape: str, policy: str, prompts, max_tokens: int, **engine_kw) -> dict:
    from specserve import LLM, SamplingParams
    from specserve.engine import gc_pauses
    from specserve.models.eagle3 import Eagle3DraftModel
    from specserve.models.llama import LlamaForCausalLM
    from specserve.speculative.policy.cost_model import CostModel

    sim = SimClock()
    fake_time = types.SimpleNamespace(perf_counter=sim.perf_counter)
    t_fwd, h_fwd = LlamaForCausalLM.forward, Eagle3DraftModel.forward

    def target_forward(self, input_ids, *a, **kw):
        sim.now += TARGET_S + TARGET_PER_TOKEN_S * input_ids.shape[0]
        return t_fwd(self, input_ids, *a, **kw)

    def head_forward(self, embeds, *a, **kw):
        sim.now += HEAD_S + HEAD_PER_TOKEN_S * embeds.shape[0]
        return h_fwd(self, embeds, *a, **kw)

    kw = dict(model=model, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, block_size=4,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_calibrate=False,
              **SHAPES[shape], **POLICIES[policy], **engine_kw)
    K = 5 if shape == "tree" else 3
    cost = fixed_cost_model(256, 4, K)
    with mock.patch.object(gc_pauses, "time", fake_time), \
            mock.patch.object(LlamaForCausalLM, "forward", target_forward), \
            mock.patch.object(Eagle3DraftModel, "forward", head_forward), \
            mock.patch.object(CostModel, "load", classmethod(lambda cls, path: __import__("copy").deepcopy(cost))):
        llm = LLM(**kw)
        e = llm.engine
        ks_log: list[list[int]] = []
        step = e.step

        def logged_step():
            out = step()
            ks_log.append([len(r.draft_token_ids) for r in e.scheduler.running])
            return out

        e.step = logged_step
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params) if isinstance(prompts[0], (str, list)) and not isinstance(
            prompts[0][0], dict) else llm.chat(prompts, params)
        st = e.get_stats()
        d = e.drafter
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "path_counts": dict(sorted(d.path_counts.items())),
            "k_histogram": {str(k): v for k, v in sorted(st.k_histogram.items())},
            "ks_per_step": ks_log,
            "accepted": st.spec_accepted_tokens,
            "drafted": st.spec_draft_tokens,
        }


def tiny_paths(tmp: str) -> tuple[str, str]:
    from tiny_model import make_random_head, make_tiny_model

    model = make_tiny_model(os.path.join(tmp, "model"), vocab=64, logit_scale=3.0)
    head = make_random_head(model, os.path.join(tmp, "head"), std=0.3)
    return model, head


TINY_PROMPTS = [[1, 5, 9, 12, 3], [7, 7, 2], [30, 31, 32, 33, 34, 35, 36], [4]]
CASES = [(m, s, p) for m in ("tiny", "smollm2") for s in ("chain", "tree") for p in ("static", "adaptive")]


def smollm2_prompts() -> list:
    from specserve.bench.datasets import sharegpt_prompts

    return [[{"role": "user", "content": p.prompt}] for p in sharegpt_prompts(3, seed=0, max_chars=200)]


def run(which: str, shape: str, policy: str, tmp: str) -> dict:
    if which == "tiny":
        model, head = tiny_paths(tmp)
        return run_case(model, head, shape, policy, TINY_PROMPTS, 24, kv_cache_memory_gb=0.01)
    return run_case(None, str(SHIPPED), shape, policy, smollm2_prompts(), 12, kv_cache_memory_gb=0.05)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("which,shape,policy", CASES, ids=["-".join(c) for c in CASES])
def test_golden_run_is_unchanged(golden, tmp_path, which, shape, policy):
    got = run(which, shape, policy, str(tmp_path))
    want = golden["-".join((which, shape, policy))]
    assert got["tokens"] == want["tokens"]
    assert got["ks_per_step"] == want["ks_per_step"]
    assert got == want


if __name__ == "__main__":
    import tempfile

    if "--record" not in sys.argv:
        sys.exit("usage: tests/test_golden_spec.py --record")
    torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "2")))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in CASES:
            out["-".join(c)] = run(*c, tmp)
            print("-".join(c), out["-".join(c)]["path_counts"], out["-".join(c)]["k_histogram"], flush=True)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
