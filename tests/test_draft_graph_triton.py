"""The GPU draft path's Triton pieces on the CPU (Triton's interpreter): the decode attention with
device metadata against the PyTorch one, and the whole static draft path (Triton catch-up backend +
Triton decode attention, run eagerly) against the eager loop's drafts.
"""

from __future__ import annotations

import functools

import pytest
import torch

from triton_interpreter import triton_tests_device  # noqa: E402

DEVICE = triton_tests_device()
CUDA = DEVICE.type == "cuda"

from specserve.attention.triton_decode import TritonDecodeAttention  # noqa: E402
from specserve.attention.torch_decode import TorchDecodeAttention  # noqa: E402

CPU = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.05)  # a small KV (the default 2 GB: seconds of zeroing per engine)

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_draft_graph's pair (one KV head: half the interpreted attention programs), made once: a head
    close enough to the target that some drafts are accepted."""
    from tiny_model import make_random_head, make_tiny_model

    d = tmp_path_factory.mktemp("draft_graph_triton")
    model = make_tiny_model(str(d / "model"), vocab=64, logit_scale=3.0, kv_heads=1)
    return model, make_random_head(model, str(d / "head"), std=0.3)


def test_triton_decode_attention_matches_torch():
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, d, h = 40, 4, 2, 32, 4
    caches = [(torch.randn(nb, bs, kvh, d, generator=g), torch.randn(nb, bs, kvh, d, generator=g))]
    B, W = 5, 8
    tables = torch.stack([torch.randperm(nb - 1, generator=g)[:W] for _ in range(B)]).to(DEVICE)
    seq = torch.tensor([1, 7, 32, 13, 1], device=DEVICE)  # rows 0 and 4: inactive (one key)
    pos = seq - 1
    scratch = (nb - 1) * bs
    blk = tables.gather(1, (pos // bs)[:, None])[:, 0]
    slots = torch.where(seq > 1, blk * bs + pos % bs, torch.full_like(pos, scratch))
    q = torch.randn(B, h, d, generator=g).to(DEVICE)
    k = torch.randn(B, kvh, d, generator=g).to(DEVICE)
    v = torch.randn(B, kvh, d, generator=g).to(DEVICE)
    outs = []
    for cls in (TorchDecodeAttention, TritonDecodeAttention):
        cs = [(a.clone().to(DEVICE), b.clone().to(DEVICE)) for a, b in caches]
        if cls is TorchDecodeAttention:
            attn = cls(cs, bs, d**-0.5, tables)
        else:
            attn = cls(cs, bs, d**-0.5, num_heads=h, block_tables=tables, block_n=16)
        attn.set_step(slots, seq)
        outs.append((attn.forward(0, q, k, v).float().cpu(), cs[0][0].cpu()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1])  # same K written to the same slots


@pytest.mark.skipif(CUDA, reason="CPU check of the Triton path; on the GPU test_draft_graph's gpu tests cover it")
def test_triton_static_draft_path_same_drafts(tiny):
    """Catch-up through a Triton backend and the loop through Triton decode attention (eagerly):
    the drafts of the eager torch-native loop, step for step."""
    from test_draft_graph import PROMPTS, assert_same_drafts, mixed_k_params, run

    model, head = tiny
    params = mixed_k_params(3, max_tokens=10)
    eng = dict(max_num_seqs=4, speculative_num_steps=3)
    ref_out, ref_log, _ = run(model, head, None, PROMPTS[:3], params, **eng)
    out, log, paths = run(model, head, "triton", PROMPTS[:3], params, **eng)
    assert out == ref_out
    assert assert_same_drafts(log, ref_log) > 5
    # every catch-up and chain through the static runners (a request near its end may take a second
    # pair in a step: fused with no drafts, then its own once the commit leaves it room)
    assert len(log) <= paths["catch_up:eager"] <= len(log) + 3 and paths["chain:eager"] == paths["catch_up:eager"]
    assert "catch_up:torch" not in paths
    # catch-ups larger than the static runner's token budget: in groups of whole requests, same drafts
    out, log, paths = run(model, head, "triton", PROMPTS[:3], params, catch_up_tokens=12, **eng)
    assert out == ref_out and assert_same_drafts(log, ref_log) > 5
    assert paths["catch_up:eager"] > len(log) and "catch_up:torch" not in paths


@pytest.mark.skipif(CUDA, reason="CPU check of the Triton path; the GPU runs it in every adaptive start-up")
def test_cost_profile_times_the_static_draft_path(tiny, monkeypatch):
    """Where greedy chains draft through the static runners, the start-up profile times that path
    (catch-up + loop, per draft step), and leaves the engine's drafts as they were."""
    from test_draft_graph import PROMPTS, record_drafts

    from specserve import LLM, SamplingParams
    from specserve.speculative import profile
    from specserve.speculative.profile import profile_costs

    # one call a point and one round (not medians of three): each is a loop of interpreted kernels
    monkeypatch.setattr(profile, "measure", functools.partial(profile.measure, repeats=1, rounds=1))
    model, head = tiny
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for profile in (False, True):
        llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_policy="static", speculative_num_steps=3, max_num_seqs=4)
        d = llm.engine.drafter
        d.enable_static_draft(attention="triton")
        if profile:
            calls = {"chain": 0, "catch_up": 0}
            for name, runner in (("chain", d.proposer.chain_runner), ("catch_up", d.catch_up.runner)):
                def counted(*a, _run=runner.run, _n=name, **kw):
                    calls[_n] += 1
                    return _run(*a, **kw)
                runner.run = counted
            cost = profile_costs(d)
            assert cost.meta["draft_path"].startswith("static")
            assert sorted(cost.draft.profile) == [1, 2, 3, 4]
            assert all(s > 0 for s in cost.draft.profile.values())
            # every point, in the warm-up and the round
            assert calls["chain"] >= 4 * 2 and calls["catch_up"] == calls["chain"]
            del d.proposer.chain_runner.run, d.catch_up.runner.run
        log = record_drafts(llm)
        outs.append(([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp)], log))
    assert outs[0] == outs[1]


@pytest.mark.skipif(CUDA, reason="CPU check of the Triton path; test_draft_graph's gpu tests replay its graphs")
def test_fused_launch_as_one_body_same_drafts(tiny, monkeypatch):
    """The fused launch as one body (FusedLaunchRunner: acceptance, catch-up, chain over static buffers;
    its graphs on the GPU) gives the eager loop's drafts, with one request and three (padded to four),
    and with three where the graphs stop at two (the launch step by step until one ends), k mixed 1..3. Drafts are rewritten two right then one wrong
    after each draft step, so accepted counts vary (the body computes them on the device)."""
    from test_draft_graph import PROMPTS, mixed_k_params, record_drafts

    from specserve import LLM
    from specserve.speculative import draft_graph
    from specserve.speculative.state import PENDING

    model, head = tiny
    params = mixed_k_params(3, max_tokens=15)[::-1]  # drafts up to 3, 2, 1 (at 16 tokens a last draft is capped short)
    plain = LLM(model=model, **CPU, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], params)]

    def run_n(n: int, fused: bool, max_batch: int = 4) -> tuple[list, list, dict]:
        llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_policy="static", max_num_seqs=4, speculative_num_steps=3)
        dr = llm.engine.drafter
        if fused:
            monkeypatch.setattr(draft_graph, "FUSED_MAX_BATCH", max_batch)
            dr.enable_static_draft(attention="triton", fused_launch=True)
            assert dr.pipeline.fused_launch is not None and dr.pipeline.fused_launch.batch_sizes[-1] == max_batch
        log = record_drafts(llm)
        logged = dr.draft_step

        def two_right_then_wrong(plan, result):
            logged(plan, result)
            for s in plan.scheduled:
                r = s.req
                k = len(r.draft_token_ids)
                if not k:
                    continue
                nxt = ref[int(r.request_id.rsplit("-", 1)[-1])][r.num_output_tokens:] + [0] * 3
                want = [nxt[0], nxt[1], (nxt[2] + 1) % 64][:k]
                if r.draft_token_ids[0] == PENDING:
                    toks, row = r.spec.device_drafts
                    with torch.inference_mode():
                        toks[row, :k] = torch.tensor(want)
                else:
                    r.draft_token_ids = want

        dr.draft_step = two_right_then_wrong
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], params[:n])]
        return out, log, dict(dr.path_counts)

    refs = {n: run_n(n, False)[:2] for n in (1, 3)}
    for n, max_batch in ((1, 4), (3, 4), (3, 2)):
        ref_out, ref_log = refs[n]
        out, log, paths = run_n(n, True, max_batch)
        assert out == ref_out == ref[:n]
        assert log == ref_log and sum(len(d) for step in log for _, d in step) > len(log)
        if max_batch == 4:  # (three requests padded to four: each row reads its own request's block table)
            assert paths["fused_launch:eager"] > 2 and paths["fused_launch:eager"] == paths["fused"]
        else:  # steps of three requests launch step by step; of two (once request 1 ends), as one body
            assert paths["fused"] > paths["fused_launch:eager"] > 0


@pytest.mark.skipif(CUDA, reason="CPU check of the Triton path; test_draft_graph's gpu tests replay its graphs")
def test_tree_lanes_and_fused_tree_launch_triton_same_trees(tiny):
    """The tree expansion with each frontier slot a query of the Triton decode attention over its lane,
    and the tree's fused launch (FusedTreeLaunch) with the Triton row attention, pick the trees the
    PyTorch decode attention picks, and give plain decoding's outputs."""
    from test_draft_graph import TREE, record_trees

    from specserve import LLM, SamplingParams

    model, head = tiny
    prompts = [[31, 36, 7, 23], [16, 47, 21, 46]]  # (drafts accepted from the first trees: few tokens suffice)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=model, **CPU, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    runs = []
    for attention in ("torch", "triton"):
        llm = LLM(model=model, **CPU, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_policy="static", max_num_seqs=4, **TREE)
        dr = llm.engine.drafter
        dr.enable_static_draft(attention=attention, fused_launch=True)
        log = record_trees(llm)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        st = llm.engine.stats
        runs.append((out, log, st.spec_accepted_tokens, dict(dr.path_counts)))
    (o0, l0, a0, p0), (o1, l1, a1, p1) = runs
    assert o0 == o1 == ref
    assert l0 == l1 and a0 == a1 > 0
    assert p1["fused_launch:eager"] > 3 and p1["fused_launch:eager"] == p0["fused_launch:eager"]
