"""The static-buffer chain draft loop (the one captured as CUDA graphs on the GPU) computes the same
drafts as the eager loop, and speculation with it stays lossless.

On the CPU the static loop runs eagerly with ``TorchDecodeAttention``; the GPU tests at the end
check graph replay against the same loop run eagerly, and that changing k never re-captures.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.drafter import DEFAULT_HEAD, EagleSpeculator
from specserve.speculative.state import PENDING
from specserve.speculative.tree import tree_fields
from tiny_model import make_random_head, make_tiny_model

SHIPPED = (DEFAULT_HEAD / "config.json").exists()
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [5, 9, 33, 2, 41, 17]]
TREE = dict(speculative_num_steps=4, speculative_eagle_topk=3, speculative_num_draft_tokens=9)
KV_GB = 0.05  # KV for ~100k tokens of the tiny model (the default 2 GB: seconds of zeroing per engine)
CPU = dict(device="cpu", dtype="float32", kv_cache_memory_gb=KV_GB)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft_graph")
    model = make_tiny_model(str(d / "model"), vocab=64, logit_scale=3.0)
    # a head close enough to the target that some drafts are accepted (so accepted counts vary)
    head = make_random_head(model, str(d / "head"), std=0.3)
    return model, head


def host_drafts(dr, r) -> list[int]:
    """``r``'s drafts with their values (a host sync where the static loop left them on the device)."""
    d = r.draft_token_ids
    st = r.spec
    if d and d[0] == PENDING and st is not None and st.device_drafts is not None:
        toks, row = st.device_drafts
        return toks[row, : len(d)].tolist()
    return list(d)


def host_tree(dr, r) -> tuple[list[int], list[int]]:
    """``r``'s tree (tokens, parents), read back where the expansion selected it on the device."""
    st = r.spec
    if st is not None and st.device_tree is not None:
        trees, row = st.device_tree
        tok, par, _, _ = tree_fields(trees[row : row + 1], dr.max_k + 1)
        n = len(r.draft_token_ids) + 1
        return [r.all_token_ids[-1]] + tok[0, 1:n].tolist(), [-1] + par[0, 1:n].tolist()
    return list(r.draft_tree.tokens), list(r.draft_tree.parents)


def record_drafts(llm: LLM) -> list[list[tuple[str, list[int]]]]:
    """Wrap the drafter so every draft step's (request, drafts) are logged."""
    dr = llm.engine.drafter
    log: list[list[tuple[str, list[int]]]] = []
    orig = dr.draft_step

    def wrapped(plan, result):
        orig(plan, result)
        # (the static loop's drafts stay on the device; with the static policy most are launched
        # before the verify's sync, not in _draft)
        step = [(s.req.request_id, host_drafts(dr, s.req)) for s in plan.scheduled if s.req.draft_token_ids]
        if step:
            log.append(step)

    dr.draft_step = wrapped
    return log


def record_trees(llm: LLM) -> list[list[tuple[str, list[int], list[int]]]]:
    """Every draft step's (request, tree tokens, tree parents)."""
    dr = llm.engine.drafter
    log: list[list[tuple[str, list[int], list[int]]]] = []
    orig = dr.proposer.propose

    def wrapped(todo, h, tree):
        orig(todo, h, tree)
        log.append([(r.request_id, *host_tree(dr, r)) for r, _ in todo])

    dr.proposer.propose = wrapped
    return log


def run(model: str | None, head: str, static: str | None, prompts, params, catch_up_tokens: int | None = None,
        **engine) -> tuple[list, list, dict]:
    llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="static", **engine)
    if static is not None:
        llm.engine.drafter.enable_static_draft(attention=static)
    if catch_up_tokens is not None:  # a smaller static catch-up: larger catch-ups run in groups of requests
        llm.engine.drafter.catch_up.runner.attn.max_num_tokens = catch_up_tokens
    log = record_drafts(llm)
    if prompts and isinstance(prompts[0][0], dict):
        outs = llm.chat(prompts, params)
    else:
        outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], log, dict(llm.engine.drafter.path_counts)


def assert_same_drafts(log: list, ref_log: list) -> int:
    """Each request drafts what it drafts in ``ref_log`` step for step, except that a fused launch may
    draft a request near its end shorter (a prefix: its cap after the most the verify could commit,
    Caps.after_verify), in one of its last 2k + 2 draft steps; past that the two runs may part. Returns
    the draft steps compared."""
    def per_request(lg: list) -> dict:
        out: dict = {}
        for step in lg:
            for rid, d in step:
                out.setdefault(rid, []).append(d)
        return out

    mine, ref = per_request(log), per_request(ref_log)
    assert mine.keys() == ref.keys()
    compared = 0
    for rid, seq in mine.items():
        for i, (a, b) in enumerate(zip(seq, ref[rid])):
            if a != b:
                # (capped where the verify of k drafts, committing all k + 1, would leave fewer than k
                # drafts: within 2k + 1 tokens of the end, at most 2k + 2 steps of one token or more)
                assert len(a) < len(b) and a == b[: len(a)] and i >= len(ref[rid]) - (2 * len(b) + 2), (rid, i, a, b)
                break
            compared += 1
    return compared


def test_a_request_near_its_end_rides_a_fused_launch_with_no_drafts(tiny):
    """Where one request of a step has no draft left after the most its verify can commit, the step's
    catch-up and chains are still launched before the sync (its row drafts nothing), the verify after
    it is not launched early, and outputs stay plain decoding's."""
    model, head = tiny
    sp = [SamplingParams(temperature=0, max_tokens=20 + 7 * i, ignore_eos=True) for i in range(4)]  # ends apart
    plain = LLM(model=model, **CPU, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:4], sp)]
    llm = LLM(model=model, **CPU, max_num_seqs=4, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="static", speculative_num_steps=3)
    dr = llm.engine.drafter
    dr.enable_static_draft(attention="torch")
    dr.pipeline.early_verify = True
    launched, early = [], []
    launch_fused, launch_early = dr.pipeline.launch_fused, dr.pipeline.launch_early_verify
    dr.pipeline.launch_fused = lambda targets, *a: (launched.append([kk for _, _, kk in targets]), launch_fused(targets, *a))[1]
    dr.pipeline.launch_early_verify = lambda targets, *a: (early.append(dr.pipeline.early), launch_early(targets, *a),
                                                   early.append(dr.pipeline.early))[1]
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], sp)]
    assert out == ref
    with_zero = [i for i, nk in enumerate(launched) if 0 in nk and any(nk)]
    # unfused for a binding cap: only steps whose every request is at its end (the last one, alone)
    assert len(with_zero) >= 4 and dr.path_counts.get("unfused:k", 0) <= 3
    # (an early verify launched sets dr.pipeline.early; none where a request drafts nothing next)
    launched_early = [b is not None for b in early[1::2]]
    assert sum(launched_early) > 5 and len(launched_early) == len(launched)
    assert not any(launched_early[i] for i in with_zero)


@pytest.mark.parametrize("early", [False, True])
def test_trees_near_their_end_stay_whole_and_fused(tiny, early):
    """A tree drafts all its nodes while its request has a token left to draft (it commits at most its
    depth plus one, and the commit cuts at max_tokens what it accepts past it), so steps near a request's
    end keep the fused launch; no early verify is launched for a request that ends in its commit or has
    no draft left after it. Outputs stay plain decoding's."""
    model, head = tiny
    sp = [SamplingParams(temperature=0, max_tokens=20 + 5 * i, ignore_eos=True) for i in range(4)]  # ends apart
    plain = LLM(model=model, **CPU, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:4], sp)]
    llm = LLM(model=model, **CPU, max_num_seqs=4, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="static", **TREE)
    dr = llm.engine.drafter
    dr.enable_static_draft(fused_launch=True)
    dr.pipeline.early_verify = early
    log = record_trees(llm)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], sp)]
    assert out == ref
    assert {len(toks) - 1 for step in log for _, toks, _ in step} == {dr.max_k}
    if early:
        assert dr.path_counts["early_verify"] > 5 and dr.path_counts.get("early_verify:discarded", 0) == 0
    # (cut to fewer nodes within ~2 x nodes tokens of the end, 20 of these steps left the fused launch)
    assert dr.path_counts["fused"] > 10
    assert dr.path_counts.get("unfused:k", 0) + dr.path_counts.get("unfused:tree", 0) <= 3


def mixed_k_params(n: int, max_tokens: int = 24) -> list[SamplingParams]:
    """Per-request draft caps 1..3 (and different lengths): one batch mixes every k."""
    return [SamplingParams(temperature=0, max_tokens=max_tokens - 3 * (i % 2), ignore_eos=True,
                           max_spec_tokens=1 + i % 3) for i in range(n)]


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_static_chain_same_drafts_as_eager_tiny(tiny, steps):
    model, head = tiny
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = dict(max_num_seqs=4, speculative_num_steps=steps)
    ref_out, ref_log, _ = run(model, head, None, PROMPTS, sp, **eng)
    out, log, paths = run(model, head, "torch", PROMPTS, sp, **eng)
    assert out == ref_out
    assert assert_same_drafts(log, ref_log) > 10
    assert paths.get("chain:eager", 0) == len(log) and "chain:graph" not in paths


def test_static_chain_mixed_k_in_one_batch(tiny):
    model, head = tiny
    params = mixed_k_params(len(PROMPTS))
    eng = dict(max_num_seqs=8, speculative_num_steps=3)
    ref_out, ref_log, _ = run(model, head, None, PROMPTS, params, **eng)
    out, log, _ = run(model, head, "torch", PROMPTS, params, **eng)
    assert out == ref_out
    assert {len(d) for step in log for _, d in step} == {1, 2, 3}
    # rows past their k only write the scratch slot: the drafts of every k are the eager loop's
    assert assert_same_drafts(log, ref_log) > 10
    plain = LLM(model=model, **CPU, max_num_seqs=8)
    assert out == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_static_draft_with_preemption_matches_no_spec(tiny, shape):
    """The static loop through preemptions; trees left on the device (and fused launches of up to four
    requests) too: a preempted request's pending tree is dropped with its drafts, and it drafts afresh
    once back."""
    model, head = tiny
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS * 2
    blocks = 60 if shape == "chain" else 70
    plain = LLM(dtype="float32", model=model, device="cpu", max_num_seqs=8, num_kv_blocks=blocks, block_size=4)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(model=model, device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=blocks, block_size=4,
              speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static",
              **(dict(speculative_num_steps=4) if shape == "chain" else TREE))
    llm.engine.drafter.enable_static_draft(fused_launch=shape == "tree")
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.scheduler.num_preemptions > 0
    if shape == "tree":
        assert llm.engine.drafter.path_counts["fused"] > 0
    assert out == ref


@pytest.mark.parametrize("budget", [9, None])
def test_static_chain_drafts_verified_from_the_device(tiny, budget):
    """The static loop's drafts stay on the device (PENDING on the host) until the verify writes them
    into its input ids. With drafts that are two right then wrong (written where each loop keeps them:
    the device tensor, or the host list) and a token budget that cuts drafts short and leaves drafted
    requests out of a step, the static loop's run accepts exactly what the eager loop's does, and both
    give plain decoding's outputs. Steps that verify chains only launch the next catch-up and chain
    before the verify's sync ("fused": the accepted rows chosen on the device)."""
    model, head = tiny
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=model, **CPU, max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp)]
    runs = []
    for static in (None, "torch"):
        llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_policy="static", max_num_seqs=8, speculative_num_steps=3,
                  **({} if budget is None else {"max_num_batched_tokens": budget}))
        dr = llm.engine.drafter
        if static is not None:
            dr.enable_static_draft(attention=static)
        draft_step = dr.draft_step

        def two_right_then_wrong(plan, result):
            draft_step(plan, result)
            for s in plan.scheduled:
                r = s.req
                if not r.draft_token_ids:
                    continue
                nxt = ref[int(r.request_id)][r.num_output_tokens :]
                want = (nxt[:2] + [(nxt[2] + 1) % 64 if len(nxt) > 2 else 0])[: len(r.draft_token_ids)]
                if r.draft_token_ids[0] == PENDING:
                    toks, row = r.spec.device_drafts
                    with torch.inference_mode():
                        toks[row, : len(want)] = torch.tensor(want)
                else:
                    r.draft_token_ids = want

        dr.draft_step = two_right_then_wrong
        cut = []
        schedule = llm.engine.scheduler.schedule

        def logged_schedule():
            drafted = {r.request_id: len(r.draft_token_ids) for r in llm.engine.scheduler.running}
            plan = schedule()
            verified = {s.req.request_id: len(s.draft_token_ids) for s in plan.scheduled}
            cut.append(sum(verified.get(i, 0) < n for i, n in drafted.items()))
            return plan

        llm.engine.scheduler.schedule = logged_schedule
        for i, p in enumerate(PROMPTS):
            llm.engine.add_request(str(i), p, sp)
        outs = {}
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                outs[o.request_id] = o.outputs[0].token_ids
        st = llm.engine.stats
        runs.append(([outs[str(i)] for i in range(len(PROMPTS))], st.spec_draft_tokens, st.spec_accepted_tokens,
                     sum(cut), dict(dr.path_counts)))
    (ref_out, ref_drafted, ref_acc, _, _), (out, drafted, acc, cut_static, paths) = runs
    assert paths.get("chain:eager", 0) > 5 and paths.get("fused", 0) > 0
    if budget is None:  # every step past the prompts' and the end of the shorter requests'
        assert paths["fused"] > paths["chain:eager"] / 2
    else:
        assert cut_static > 0  # the budget did leave drafts unverified or cut
    assert acc > 0 and (drafted, acc) == (ref_drafted, ref_acc)
    assert out == ref_out == ref


def adaptive_static_loop(model: str, head: str) -> tuple[LLM, list[int], list]:
    """An adaptive engine with the static loop and early decisions on, with its draft steps that decide
    anything counted (the list), and plain decoding's outputs of PROMPTS for its sampling params (SP24)."""
    plain = LLM(model=model, **CPU, max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, SP24)]
    llm = LLM(model=model, **CPU, max_num_seqs=8, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="adaptive", speculative_num_steps=3)
    dr = llm.engine.drafter
    dr.enable_static_draft(attention="torch")
    decisions: list[int] = []
    draft_step = dr.draft_step

    def counted(plan, result):
        if any(s.samples and not s.req.is_finished for s in plan.scheduled):
            decisions.append(1)
        draft_step(plan, result)

    dr.draft_step = counted
    return llm, ref, decisions


SP24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_adaptive_quick_decisions_launch_before_the_sync(tiny):
    """The adaptive policy's quick decision is taken before the verify's sync and
    its catch-up and chain launched there; draft_step applies that decision instead of taking
    another (one quick_arm call per decision), and outputs stay plain decoding's."""
    llm, ref, decisions = adaptive_static_loop(*tiny)
    dr = llm.engine.drafter
    calls = []
    dr.controller.quick_arm = lambda batch, running=None: calls.append(batch) or 2  # every decision quick: depth 2
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP24)]
    assert out == ref
    assert dr.path_counts["fused"] > 5
    assert len(calls) <= len(decisions)
    assert llm.engine.stats.spec_draft_tokens > 0


@functools.lru_cache(maxsize=None)  # (the same plain runs for each test of the module)
def stop_mid_cycle(model: str) -> tuple[SamplingParams, list[list[int]]]:
    """Greedy params whose stop token only request 2 comes to (past its first few tokens: it stops
    there, mid-cycle; the others run to max_tokens 40), and plain decoding's outputs of PROMPTS."""
    plain = LLM(model=model, **CPU, max_num_seqs=8)
    free = [o.outputs[0].token_ids for o in
            plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]
    stop_tok = next(t for t in free[2][8:] if all(t not in f for j, f in enumerate(free) if j != 2))
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok])
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp)]
    assert 8 < len(ref[2]) < 40 and sum(len(o) == 40 for o in ref) >= 2  # (one more ends at EOS)
    return sp, ref


@pytest.mark.parametrize("budget", [None, 13])
def test_early_verify_runs_the_next_verify_launched_before_the_commit(tiny, budget):
    """With ``early_verify`` (on by default on a GPU) the verify after a fused launch's drafts is launched
    right after the sync, before the commit, and the next step uses it where its plan is the one launched.
    Requests stop at a stop token (some mid-cycle) and by max_tokens, and a token budget cuts some steps:
    those early verifies are discarded. Outputs and every accepted count stay those of the same engine
    without it, and of plain decoding."""
    model, head = tiny
    sp, ref = stop_mid_cycle(model)
    runs = []
    for early in (False, True):
        llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_policy="static", max_num_seqs=8, speculative_num_steps=3,
                  **({} if budget is None else {"max_num_batched_tokens": budget}))
        dr = llm.engine.drafter
        dr.enable_static_draft(attention="torch")
        assert dr.pipeline.early_verify is False  # (a CPU default)
        dr.pipeline.early_verify = early
        verify_all = dr._accept

        def two_right_then_wrong(sampling, *a, **kw):
            """Drafts the fused launch left on the device, rewritten once this verify's outcome is known
            (before either run reads them): two right then one wrong, so accepted counts vary."""
            results = verify_all(sampling, *a, **kw)
            for s, res in zip(sampling, results):
                row, kk = (dr.pipeline.fused or {}).get(s.req.request_id, (0, 0))
                nxt = ref[int(s.req.request_id.rsplit("-", 1)[-1])][s.req.num_output_tokens + len(res.tokens):] + [0] * 3
                if kk:
                    with torch.inference_mode():
                        dr.pipeline.fused_toks[row, :kk] = torch.tensor([nxt[0], nxt[1], (nxt[2] + 1) % 64][:kk])
            return results

        dr._accept = two_right_then_wrong
        eng, outs, n = llm.engine, {}, 0
        for i, p in enumerate(PROMPTS[:-1]):
            eng.add_request(str(i), p, sp)
        while eng.has_unfinished_requests():
            n += 1
            if n == 12:  # an arrival while the next verify is in flight: the plan it was launched for changes
                eng.add_request(str(len(PROMPTS) - 1), PROMPTS[-1], sp)
            for o in eng.step():
                outs[o.request_id] = o.outputs[0].token_ids
        out = [outs[str(i)] for i in range(len(PROMPTS))]
        st = eng.stats
        runs.append((out, st.spec_draft_tokens, st.spec_accepted_tokens, dict(dr.path_counts)))
        assert all(r.kv_hold_tokens == 0 for r in llm.engine.scheduler.running)
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks  # nothing held past the end
    (out0, d0, a0, p0), (out1, d1, a1, p1) = runs
    assert out0 == out1 == ref
    assert (d1, a1) == (d0, a0) and a1 > 0
    assert "early_verify" not in p0 and p1["early_verify"] > p1["fused"] / 3
    assert p1.get("early_verify:discarded", 0) > 0  # the arrival (and the budget's cuts)


@pytest.mark.skipif(not SHIPPED, reason="the shipped head is not in the tree")
def test_static_chain_smollm2_chat(smollm2, chat_prompts):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = chat_prompts[:2]
    eng = dict(max_num_seqs=2, speculative_num_steps=3)
    ref_out, ref_log, _ = run(None, str(DEFAULT_HEAD), None, prompts, sp, **eng)
    out, log, paths = run(None, str(DEFAULT_HEAD), "torch", prompts, sp, **eng)
    assert out == ref_out
    # drafts accepted, most cycles launched before the verify's sync (the accepted rows picked on the
    # device), and every draft the eager loop's (short of a request's end: assert_same_drafts)
    assert sum(len(d) for step in log for _, d in step) > len(log) and paths.get("fused", 0) > len(log) / 2
    assert assert_same_drafts(log, ref_log) > 5
    assert out == [o.outputs[0].token_ids for o in smollm2.chat(prompts, sp)]  # plain decoding's


def test_sampled_requests_keep_the_eager_loop(tiny):
    model, head = tiny
    llm = LLM(model=model, **CPU, max_num_seqs=4, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static", speculative_num_steps=3)
    llm.engine.drafter.enable_static_draft()
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1))
    paths, st = llm.engine.drafter.path_counts, llm.engine.stats
    # they drafted (verified drafts every step), through the eager loop: the q distributions need it
    assert st.spec_verify_steps >= 4 and st.spec_draft_tokens > 2 * st.spec_verify_steps, st
    assert paths["catch_up:torch"] >= 4 and not any(k.startswith("chain:") for k in paths), paths




def run_tree(model, head, static: bool, prompts, params, device: str = "cpu", graphs: bool = True, **engine):
    kw = dict(dtype="float32", num_kv_blocks=256) if device == "cuda" else dict(dtype="float32", kv_cache_memory_gb=KV_GB)
    llm = LLM(model=model, device=device, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="static", **TREE, **kw, **engine)
    dr = llm.engine.drafter
    if device == "cpu" and static:
        dr.enable_static_draft(attention="torch")
    if not graphs:
        dr.proposer.tree_runner.graphs.clear()
        dr.catch_up.runner.graphs.clear()
        if dr.pipeline.tree_launch is not None:
            dr.pipeline.tree_launch.graphs.clear()
            dr.pipeline.tree_verify.graphs.clear()
    log = record_trees(llm)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    paths = dict(dr.path_counts)
    tg = llm.engine.runner.graphs
    if tg is not None:  # the target's graphs for steps with exact trees, and tree steps run eagerly
        paths["target:tree_graphs"] = len(tg.tree_graphs)
        paths["target:eager_tree_steps"] = tg.eager_tree_steps
    return out, log, paths


def test_static_tree_same_trees_as_eager_tiny(tiny):
    """Trees left on the device for the verify (the static draft loop) are the trees read back to the host
    without it, for greedy and sampled requests and per-request tree sizes in one batch."""
    model, head = tiny
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, max_spec_tokens=[8, 3, 5][i % 3])
              for i in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0.8, seed=4, max_tokens=20, ignore_eos=True)
    ref_out, ref_log, ref_paths = run_tree(model, head, False, PROMPTS, params, max_num_seqs=8)
    out, log, paths = run_tree(model, head, True, PROMPTS, params, max_num_seqs=8)
    assert not any(k.startswith("tree:") for k in ref_paths)  # host trees: no static draft path
    assert log == ref_log and len(log) > 5
    assert {len(toks) - 1 for step in log for _, toks, _ in step} >= {3, 5, 8}
    assert out == ref_out
    assert paths["tree:eager"] == len(log) and "tree:graph" not in paths
    plain = LLM(model=model, **CPU, max_num_seqs=8)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    ref = [o.outputs[0].token_ids for o in plain.generate([PROMPTS[i] for i in greedy], [params[i] for i in greedy])]
    assert [out[i] for i in greedy] == ref


# -- GPU: graphs ------------------------------------------------------------------------------------


def _gpu_run(model, head, graphs: bool, prompts, params, **engine):
    # a fixed KV size: an engine sized from free memory would find it all held by the one before
    llm = LLM(model=model, device="cuda", dtype="float32", num_kv_blocks=256, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static", **engine)
    dr = llm.engine.drafter
    assert dr.proposer.chain_runner is not None and dr.catch_up.runner is not None
    if not graphs:
        dr.proposer.chain_runner.graphs.clear()
        dr.catch_up.runner.graphs.clear()
        if dr.pipeline.fused_launch is not None:
            dr.pipeline.fused_launch.graphs.clear()
    log = record_drafts(llm)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return llm, out, log


@pytest.mark.gpu
@pytest.mark.parametrize("n", [5, 2])
def test_gpu_graph_drafts_equal_eager_static_loop(tiny, n):
    """Graph replays give the eager static loop's drafts; with two requests or fewer the fused launch
    (acceptance, catch-up, chain) replays as one graph (FusedLaunchRunner)."""
    model, head = tiny
    params = mixed_k_params(n, max_tokens=40)[::-1]
    eng = dict(max_num_seqs=8, speculative_num_steps=3)
    llm_g, out_g, log_g = _gpu_run(model, head, True, PROMPTS[:n], params, **eng)
    llm_e, out_e, log_e = _gpu_run(model, head, False, PROMPTS[:n], params, **eng)
    assert out_g == out_e
    assert log_g == log_e
    pg, pe = llm_g.engine.drafter.path_counts, llm_e.engine.drafter.path_counts
    # (a request near its end may take a second chain in a step: in a fused launch with no drafts, then
    # its own once the commit leaves it room)
    assert len(log_g) <= pg["chain:graph"] <= len(log_g) + 2 * n and "chain:eager" not in pg
    assert pe["chain:eager"] == pg["chain:graph"] and "chain:graph" not in pe
    if n == 2:
        assert pg["fused_launch:graph"] > len(log_g) / 2 and pe["fused_launch:eager"] == pg["fused_launch:graph"]
    assert pg["catch_up:graph"] > 0


@pytest.mark.gpu
def test_gpu_switching_k_never_recaptures_or_runs_eagerly(tiny, monkeypatch):
    from specserve.engine.cuda_graph import CUDAGraphRunner
    from specserve.speculative.draft_graph import CatchUpRunner, ChainDraftRunner, FusedLaunchRunner

    model, head = tiny
    llm = LLM(model=model, device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=256, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static", speculative_num_steps=5)
    dr = llm.engine.drafter
    n_graphs = len(dr.proposer.chain_runner.graphs)
    assert n_graphs == len(dr.proposer.chain_runner.batch_sizes) * 5
    assert dr.graph_memory_bytes >= 0

    def no_capture(*a, **k):
        raise AssertionError("re-captured after start-up")

    for cls in (CUDAGraphRunner, CatchUpRunner, ChainDraftRunner, FusedLaunchRunner):
        monkeypatch.setattr(cls, "capture", no_capture)
    # k from 1 to 5 within a batch and across steps (caps shrink near max_tokens)
    params = [SamplingParams(temperature=0, max_tokens=30 + i, ignore_eos=True, max_spec_tokens=1 + i % 5)
              for i in range(len(PROMPTS))]
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    # two requests with different caps and room to draft: the fused launch's own graphs (the five
    # above reach two requests only within a few tokens of max_tokens, where no fused launch fits)
    params2 = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, max_spec_tokens=m) for m in (2, 5)]
    out2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params2)]
    monkeypatch.undo()  # the reference engine below captures its own graphs at its start-up
    plain = LLM(model=model, device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=256)
    assert out == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert out2 == [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], params2)]
    assert len(dr.proposer.chain_runner.graphs) == n_graphs
    assert "chain:eager" not in dr.path_counts and dr.path_counts["chain:graph"] > 0
    assert dr.path_counts["fused_launch:graph"] > 0  # (steps of up to two requests) and never eagerly
    # decode/verify steps all replay target graphs (prompts are short: prefill steps fit too)
    assert "target:eager" not in llm.engine.runner.path_counts


@pytest.mark.gpu
@pytest.mark.parametrize("n", [5, 2])
def test_gpu_tree_graphs_equal_eager_expansion(tiny, n):
    """Graph replays of the expansion (trees selected on the device) give the eager body's trees and
    outputs. Two requests drafting whole trees take the tree's fused launch (acceptance, catch-up,
    expansion, selection) as one graph."""
    model, head = tiny
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             max_spec_tokens=[8, 3, 5][i % 3] if n > 2 else None) for i in range(n)]
    prompts = PROMPTS[:n]
    out_g, log_g, pg = run_tree(model, head, True, prompts, params, device="cuda", max_num_seqs=8)
    out_e, log_e, pe = run_tree(model, head, True, prompts, params, device="cuda", graphs=False, max_num_seqs=8)
    assert out_g == out_e and log_g == log_e
    assert pg["tree:graph"] == len(log_g) and "tree:eager" not in pg
    assert pe["tree:eager"] == len(log_e) and "tree:graph" not in pe
    assert "fused_launch:eager" not in pg
    # verifies after the sync replay the target's graphs captured with the exact-trees kernel
    assert pg["target:tree_graphs"] > 0 and pg["target:eager_tree_steps"] == 0
    if n == 2:  # steps of up to four requests: acceptance, catch-up, expansion and trees as one graph
        assert pg["fused_launch:graph"] > len(log_g) and pe["fused_launch:eager"] == pg["fused_launch:graph"]
        # ... and the verify of the trees it selects, launched before the sync, as a graph of its own
        assert pg["presync_verify:graph"] > len(log_g) / 2 and "presync_verify:eager" not in pg
        assert pe["presync_verify:eager"] == pg["presync_verify:graph"]
    plain = LLM(model=model, device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=256)
    assert out_g == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("budget", [None, 20])
def test_fused_tree_launch_and_early_verify_same_as_plain_trees(tiny, budget):
    """Trees selected on the device and left there (no read-back per expansion); with the fused launch
    the next catch-up, expansion and trees go to the device before the verify's sync (acceptance
    computed there: accept_trees), and with early_verify the verify after them is launched before the
    commit. A stop token ends a request mid-cycle, an arrival changes a launched plan and a token
    budget cuts trees: outputs and every accepted count stay those of the static trees without
    either, and of plain decoding."""
    model, head = tiny
    sp, ref = stop_mid_cycle(model)
    runs = []
    for fused, early, presync in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_policy="static", max_num_seqs=8, **TREE,
                  **({} if budget is None else {"max_num_batched_tokens": budget}))
        dr = llm.engine.drafter
        dr.enable_static_draft(attention="torch", fused_launch=fused)
        assert (dr.pipeline.tree_launch is not None) == fused
        dr.pipeline.early_verify = early
        dr.pipeline.presync_verify = presync
        eng, outs, n = llm.engine, {}, 0
        for i, p in enumerate(PROMPTS[:3]):
            eng.add_request(str(i), p, sp)
        while eng.has_unfinished_requests():
            n += 1
            if n == 10:
                eng.add_request("3", PROMPTS[3], sp)
            if n == 40:
                eng.add_request("4", PROMPTS[4], sp)
            for o in eng.step():
                outs[o.request_id] = o.outputs[0].token_ids
        st = eng.stats
        runs.append(([outs[str(i)] for i in range(len(PROMPTS))], st.spec_draft_tokens, st.spec_accepted_tokens,
                     dict(dr.path_counts)))
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    (o0, d0, a0, p0), (o1, d1, a1, p1), (o2, d2, a2, p2), (o3, d3, a3, p3) = runs
    assert o0 == o1 == o2 == o3 == ref
    assert (d0, a0) == (d1, a1) == (d2, a2) == (d3, a3) and a0 > 0
    assert "fused" not in p0 and p1["fused_launch:eager"] > 5 and p1["fused"] == p1["fused_launch:eager"]
    assert "early_verify" not in p1 and p2["early_verify"] > p2["fused"] / 3
    assert "presync_verify" not in p2
    # launched before the sync, from the device's picks; most of them are the step that follows
    assert p3["presync_verify"] > p3["fused"] / 3 and p3["early_verify"] > p3["presync_verify"] / 2
    if budget is None:  # (under the budget no step of three requests fuses: the arrivals find none in flight)
        assert p2.get("early_verify:discarded", 0) > 0
        # a request stopping at a token it commits (stop_mid_cycle), or an arrival, discards one
        assert p3.get("presync_verify:discarded", 0) + p3.get("early_verify:discarded", 0) > 0


@pytest.mark.parametrize("static", [None, "torch"])
def test_draft_head_in_its_own_dtype(tiny, static):
    """``speculative_draft_dtype``: a float32 head (weights, draft KV, the loop's hidden states) under a
    bfloat16 target drafts from the target's bf16 features and stays lossless; a dtype it does not
    know is refused."""
    model, head = tiny
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(model=model, **{**CPU, "dtype": "bfloat16"}).generate(PROMPTS[:3], sp)]
    llm = LLM(model=model, **{**CPU, "dtype": "bfloat16"}, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static", speculative_num_steps=3,
              speculative_draft_dtype="float32")
    dr = llm.engine.drafter
    if static is not None:
        dr.enable_static_draft(attention=static)
        assert dr.proposer.chain_runner.h0.dtype == torch.float32
    assert dr.head.fc.weight.dtype == torch.float32 and dr.attn.kv_caches[0][0].dtype == torch.float32
    assert llm.engine.dtype == torch.bfloat16 and dr.features.features.dtype == torch.bfloat16
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp)]
    assert out == ref and llm.engine.stats.spec_draft_tokens > 50
    with pytest.raises(ValueError, match="speculative_draft_dtype"):
        LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
            speculative_draft_dtype="int8")


def test_adaptive_trees_take_the_fused_launch(tiny):
    """The adaptive policy's early picks for trees (quick decisions and forced arms, taken before the
    verify's sync; the tree arm drafts the whole tree) let its steps of whole trees take the fused tree
    launch; outputs stay plain decoding's."""
    model, head = tiny
    plain = LLM(model=model, **CPU, max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], SP24)]
    llm = LLM(model=model, **CPU, max_num_seqs=8, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="adaptive", **TREE)
    dr = llm.engine.drafter
    dr.enable_static_draft(attention="torch", fused_launch=True)
    dr.controller.forced_arm = dr.controller.tree_arm  # (drafting on every cycle: the tiny head accepts little)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], SP24)]
    assert out == ref
    assert dr.path_counts["fused"] > 5 and dr.path_counts["fused"] == dr.path_counts["fused_launch:eager"]


def test_fused_trees_near_the_model_length_stay_within_its_blocks(tiny):
    """A fused tree launch reserves the slots of the next tree after the most its verify commits (the
    tree's depth + 1, not its node count + 1): with a request ending one token short of the model's
    length, no block table grows past the model's length (the H200's attention refuses such a step:
    'block table (1, 17) does not fit 1 requests x 16 blocks'), and the output is plain decoding's."""
    model, head = tiny
    bs = 4
    plain = LLM(model=model, **CPU, max_num_seqs=1, block_size=bs)
    max_len = plain.engine.max_model_len
    prompt = [(7 * i) % 60 + 2 for i in range(max_len - 40)]
    sp = SamplingParams(temperature=0, max_tokens=max_len - len(prompt) - 1, ignore_eos=True)
    ref = plain.generate([prompt], sp)[0].outputs[0].token_ids
    llm = LLM(model=model, **CPU, max_num_seqs=1, block_size=bs, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=12)
    llm.engine.drafter.enable_static_draft(fused_launch=True)
    most_blocks = -(-max_len // bs)
    widest = []
    runner = llm.engine.runner
    forward = runner.forward

    def checked(inputs, copy=True):
        widest.append(inputs.meta.block_tables.shape[1])
        return forward(inputs, copy)

    runner.forward = checked
    out = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert llm.engine.drafter.path_counts["fused"] > 0
    assert max(widest) <= most_blocks
    assert out == ref


@pytest.mark.parametrize("static", [None, "torch", pytest.param("cuda", marks=pytest.mark.gpu)],
                         ids=["eager", "static_fused", "gpu_graphs"])
def test_a_tree_engine_switching_between_chain_and_tree_arms_stays_lossless(tiny, static):
    """The adaptive policy's arms in a tree engine: chains of 1..K drafts and the whole tree (K + 1), one
    arm a decision. Switching arm every step (on static buffers with the fused tree launch, a GPU's paths:
    device chains and trees in one verify, a chain's step never fused; eagerly; and on a GPU with its
    graphs, early and presync verifies), outputs stay plain decoding's and both kinds were drafted."""
    model, head = tiny
    dev = dict(device="cuda", dtype="float32", num_kv_blocks=256) if static == "cuda" else CPU
    plain = LLM(model=model, **dev, max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], SP24)]
    llm = LLM(model=model, **dev, max_num_seqs=8, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
              speculative_policy="adaptive", speculative_calibrate=False, **TREE)
    dr = llm.engine.drafter
    ctl = dr.controller
    K = TREE["speculative_num_steps"]
    assert ctl.arms() == list(range(K + 2)) and ctl.tree_arm == K + 1
    if static == "torch":
        dr.enable_static_draft(attention=static, fused_launch=True)
    arms = iter([K + 1, K + 1, 2, K + 1, 1, 3, K + 1, K + 1, K] * 20)
    step = llm.engine.step

    def switching():
        ctl.forced_arm = next(arms)
        return step()

    llm.engine.step = switching
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], SP24)]
    assert out == ref
    hist = ctl.k_histogram  # (a tree drafts its 8 nodes; chains 1..K)
    assert hist[TREE["speculative_num_draft_tokens"] - 1] > 3 and hist[1] + hist[2] + hist[3] > 3
    if static is not None:
        assert dr.path_counts["fused"] > 0 and dr.path_counts["unfused:k"] > 0
