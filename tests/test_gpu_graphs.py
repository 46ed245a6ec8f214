"""GPU path: Triton attention vs torch-native at real shapes, CUDA-graph replay vs eager, and greedy
engine output with graphs vs without, on a SmolLM2-shaped model with random (dummy) weights.

The real SmolLM2 weights live in a GGUF that the GPU machine lacks, so the model directory here
is SmolLM2's config.json, a word-level tokenizer over its 49,152 ids and `--load-format dummy`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tiny_model import SMOLLM2_CONFIG, make_dummy_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_dummy_dir(tmp_path_factory) -> str:
    return make_dummy_model_dir(str(tmp_path_factory.mktemp("smollm2_dummy")))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 70, 1, 150, 17, 33, 260, 9][:n]
    return [torch.randint(3, 49152, (L,), generator=g).tolist() for L in lens]


# -- attention at real shapes -------------------------------------------------------------------

def _random_step(q_lens, ctx_lens, block_size, num_blocks, device, seed=0, trees=None):
    from specserve.attention.base import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables, off = [], 0
    for s in seq:
        nb = -(-s // block_size)
        tables.append(perm[off : off + nb])
        off += nb
    width = max(len(t) for t in tables)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, s, q in zip(tables, seq, q_lens) for p in range(s - q, s)]
    return AttentionMetadata(
        query_lens=list(q_lens), seq_lens=seq,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device),
        tree_masks=trees,
    )


def _chain_tree_mask(n: int) -> torch.Tensor:
    """Root with two branches: nodes 1..n-1 alternate between them."""
    parents = [-1] + [0 if i <= 2 else i - 2 for i in range(1, n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", ["mixed", "small"])
def test_triton_matches_torch_native_llama8b_heads(dtype, batch, monkeypatch):
    """'mixed': decodes, verifies, a tree and prefill chunks; 'small': few tokens, so keys are split."""
    from specserve.attention.torch_native import TorchNativeBackend
    from specserve.attention.triton_backend import TritonBackend

    dev = torch.device("cuda")
    H, KVH, D, bs, nb = 32, 8, 128, 16, 4096
    if batch == "mixed":
        q_lens = [1] * 20 + [4] * 8 + [10, 300, 57]
        ctx = [(i * 97) % 1500 for i in range(len(q_lens))]
        trees = {28: _chain_tree_mask(10).to(dev)}
    else:
        q_lens, ctx, trees = [1, 1, 5, 4], [1000, 77, 3000, 511], {2: _chain_tree_mask(5).to(dev)}
    meta = _random_step(q_lens, ctx, bs, nb, dev, trees=trees)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (nb, bs, KVH, D)
    caches = [(torch.randn(shape, generator=g, device=dev).to(dtype), torch.randn(shape, generator=g, device=dev).to(dtype))]
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g, device=dev).to(dtype)
    k = torch.randn(T, KVH, D, generator=g, device=dev).to(dtype)
    v = torch.randn(T, KVH, D, generator=g, device=dev).to(dtype)
    ref = TorchNativeBackend([(a.clone(), b.clone()) for a, b in caches], bs, D**-0.5)
    ref.plan(meta)
    out_ref = ref.forward(0, q, k, v).float()
    from specserve.attention import triton_backend

    for large in (False, True):  # graph-sized tiles (16 rows), then the large-step tiles (64 rows)
        monkeypatch.setattr(triton_backend, "LARGE_STEP_TOKENS", 0 if large else 512)
        tri = TritonBackend([(a.clone(), b.clone()) for a, b in caches], bs, D**-0.5, num_heads=H,
                            max_num_tokens=1024, max_num_seqs=64, max_blocks_per_seq=256)
        tri.plan(meta)
        assert tri._block_m == (64 if large else 16)
        assert (tri._num_merges > 0) == (batch == "small")
        out = tri.forward(0, q, k, v).float()
        err = ((out - out_ref).norm() / out_ref.norm()).item()
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        assert torch.isfinite(out).all() and err < tol, f"{dtype}: relative error {err:.2e}"
        assert torch.equal(tri.kv_caches[0][0], ref.kv_caches[0][0])


# -- graph replay vs eager, runner level --------------------------------------------------------

def _runner(model, mc, dtype, enforce_eager, num_blocks=256, max_tokens=1024):
    from specserve.config import EngineConfig
    from specserve.engine.runner import ModelRunner

    cfg = EngineConfig(max_num_batched_tokens=max_tokens, max_num_seqs=32, num_kv_blocks=num_blocks,
                       enforce_eager=enforce_eager, attention_backend="triton")
    return ModelRunner(model, mc, cfg, num_blocks, torch.device("cuda"), dtype)


def _same_random_kv(a, b, g: torch.Generator) -> None:
    """Random K/V context in runner a's caches, copied into runner b's."""
    for (ka, va), (kb, vb) in zip(a.kv_caches, b.kv_caches):
        ka.normal_(generator=g)
        va.normal_(generator=g)
        kb.copy_(ka)
        vb.copy_(va)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_matches_eager(dtype):
    from specserve.config import ModelConfig
    from specserve.engine.runner import StepInputs
    from specserve.loader import dummy_weights
    from specserve.models import build_model

    dev = torch.device("cuda")
    mc = ModelConfig.from_hf(SMOLLM2_CONFIG)
    model = build_model(mc, dev, dtype)
    model.load_weights(dummy_weights(mc, dev))
    model.eval()
    graphed = _runner(model, mc, dtype, enforce_eager=False)
    eager = _runner(model, mc, dtype, enforce_eager=True)
    assert graphed.graphs is not None and eager.graphs is None
    graphed.capture_graphs()
    assert graphed.graphs.capture_seconds > 0
    assert graphed.graphs.max_size == 1024  # the whole step budget (a small model stays launch-bound)
    g = torch.Generator(device=dev).manual_seed(0)
    _same_random_kv(graphed, eager, g)
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: padded and unpadded GEMMs round differently
    steps = [([1], [40]), ([1, 1, 1], [5, 90, 300]), ([4, 1, 4], [20, 7, 64]), ([100, 1, 30], [0, 50, 9]),
             ([300, 212], [0, 0]), ([600, 1], [0, 33])]  # the last replays the 768-token graph (past 512)
    for i, (q_lens, ctx) in enumerate(steps):
        if i == 4:
            model.set_aux_hidden_layers((2, 15, 27))  # EAGLE-3 features: outputs change -> re-capture
        meta = _random_step(q_lens, ctx, 16, 256, dev, seed=i)
        T = sum(q_lens)
        ids = torch.randint(0, mc.vocab_size, (T,), device=dev, generator=g)
        pos = torch.cat([torch.arange(c, c + q, device=dev) for q, c in zip(q_lens, ctx)])
        out_g = graphed.forward(StepInputs(ids, pos, meta, []))
        out_e = eager.forward(StepInputs(ids, pos, meta, []))
        outs_g = out_g if isinstance(out_g, tuple) else (out_g,)
        outs_e = out_e if isinstance(out_e, tuple) else (out_e,)
        assert len(outs_g) == len(outs_e) == (2 if i >= 4 else 1)
        for a, b in zip(outs_g, outs_e):
            assert a.shape == b.shape and a.shape[0] == T
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err < tol, f"step {i}: relative error {err:.2e}"
        # same K/V everywhere except the graph runner's scratch block (the last one)
        for (kc, _), (ke, _) in zip(graphed.kv_caches, eager.kv_caches):
            err = ((kc[:-1].float() - ke[:-1].float()).norm() / ke[:-1].float().norm()).item()
            assert err < tol
    model.set_aux_hidden_layers(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_torch_ops(dtype, monkeypatch):
    """The whole model with the Triton add+RMSNorm, SiLU*mul and rotary+cache-write kernels vs the
    same steps through the torch ops (eager, both on the Triton attention backend)."""
    from specserve.config import ModelConfig
    from specserve.engine.runner import StepInputs
    from specserve.loader import dummy_weights
    from specserve.models import build_model, layers, triton_ops

    dev = torch.device("cuda")
    mc = ModelConfig.from_hf(SMOLLM2_CONFIG)
    model = build_model(mc, dev, dtype)
    model.load_weights(dummy_weights(mc, dev))
    model.eval()
    fused, plain = _runner(model, mc, dtype, True), _runner(model, mc, dtype, True)
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "silu_mul", "rope_and_cache"):
        fn = getattr(triton_ops, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        monkeypatch.setattr(triton_ops, name, counted)
    g = torch.Generator(device=dev).manual_seed(0)
    _same_random_kv(fused, plain, g)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for i, (q_lens, ctx) in enumerate([([1, 1, 1], [5, 90, 300]), ([4, 1, 30], [20, 7, 64])]):
        model.set_aux_hidden_layers((2, 15, 27) if i else None)
        meta = _random_step(q_lens, ctx, 16, 256, dev, seed=i)
        T = sum(q_lens)
        ids = torch.randint(0, mc.vocab_size, (T,), device=dev, generator=g)
        pos = torch.cat([torch.arange(c, c + q, device=dev) for q, c in zip(q_lens, ctx)])
        calls.clear()
        monkeypatch.setattr(layers, "FUSED_OPS", True)
        out_f = fused.forward(StepInputs(ids, pos, meta, []))
        assert calls == {"add_rms_norm": 2 * 30 + 1, "silu_mul": 30, "rope_and_cache": 30}, calls
        monkeypatch.setattr(layers, "FUSED_OPS", False)
        out_p = plain.forward(StepInputs(ids, pos, meta, []))
        assert calls["rope_and_cache"] == 30  # the torch path launched none of them
        outs_f = out_f if isinstance(out_f, tuple) else (out_f,)
        outs_p = out_p if isinstance(out_p, tuple) else (out_p,)
        assert len(outs_f) == len(outs_p) == (2 if i else 1)
        for a, b in zip(outs_f, outs_p):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err < tol, f"step {i}: relative error {err:.2e}"
        for fc, pc in zip(fused.kv_caches, plain.kv_caches):
            for a, b in zip(fc, pc):  # K and V, every layer (later layers see the small differences)
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err < tol
    model.set_aux_hidden_layers(None)


# -- engine: greedy output with graphs == without ------------------------------------------------

def _generate(model_dir, prompts, max_tokens=32, forced_arm=None, fuse=True, **engine_args):
    from specserve import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", device="cuda", dtype="float32", num_kv_blocks=512,
              max_num_batched_tokens=128, **engine_args)
    if forced_arm is not None:
        llm.engine.drafter.controller.forced_arm = forced_arm
    if not fuse:  # every catch-up after the verify's sync, in draft_step
        llm.engine.drafter.pipeline.fused_targets = lambda plan: None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


def test_engine_greedy_same_with_and_without_graphs(smollm2_dummy_dir):
    prompts = _prompts(8)
    with_graphs, llm = _generate(smollm2_dummy_dir, prompts)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs  # graphs were used
    eager, _ = _generate(smollm2_dummy_dir, prompts, enforce_eager=True)
    torch_native, _ = _generate(smollm2_dummy_dir, prompts, attention_backend="torch")
    assert with_graphs == eager
    assert with_graphs == torch_native
    assert all(len(t) == 32 for t in with_graphs)


def test_overlap_scheduling_on_the_gpu_gives_step_by_step_tokens(smollm2_dummy_dir):
    """Plain decoding overlap scheduled (on by default on CUDA without speculation): the next step's
    inputs read the last step's samples on the device, through graph replay; requests end at different
    lengths (rows for finished requests are computed and dropped), seeded sampling beside greedy."""
    from specserve import LLM, SamplingParams

    prompts = _prompts(8)
    params = [SamplingParams(temperature=0 if i % 3 else 0.9, seed=i, max_tokens=8 + 5 * i, ignore_eos=True)
              for i in range(8)]
    got = {}
    for mode in ("auto", "off"):
        llm = LLM(smollm2_dummy_dir, load_format="dummy", device="cuda", dtype="float32", num_kv_blocks=512,
                  max_num_batched_tokens=128, max_num_seqs=6, overlap_schedule=mode)
        assert llm.engine.overlap == (mode == "auto")
        got[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if mode == "auto":
            counts = llm.engine.runner.path_counts
            assert counts["launch:ahead"] > 0.8 * llm.engine.stats.steps and counts["target:eager"] == 0
    assert got["auto"] == got["off"]
    assert [len(t) for t in got["auto"]] == [8 + 5 * i for i in range(8)]


def test_engine_fp8_kv_cache_with_graphs(smollm2_dummy_dir):
    """--kv-cache-dtype fp8 on the GPU: the fused rotary kernel stores 8-bit K/V and attention widens them;
    graph replay gives the eager engine's tokens (how often 8-bit K/V flips a random model's pick is printed)."""
    prompts = _prompts(8)
    fp8, llm = _generate(smollm2_dummy_dir, prompts, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    eager, _ = _generate(smollm2_dummy_dir, prompts, kv_cache_dtype="fp8", enforce_eager=True)
    assert fp8 == eager and all(len(t) == 32 for t in fp8)
    full, _ = _generate(smollm2_dummy_dir, prompts)
    same = sum(a == b for x, y in zip(fp8, full) for a, b in zip(x, y)) / sum(map(len, full))
    print(f"fp8 vs fp32 KV: {same:.1%} of tokens the same")


def test_engine_speculation_with_graphs_is_lossless(smollm2_dummy_dir, tmp_path):
    """Verify steps (1+k tokens per request) and EAGLE-3 aux outputs through graph replay."""
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    mc = load_model_source(smollm2_dummy_dir).config
    torch.manual_seed(1)
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=mc.vocab_size))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    head.save_pretrained(str(tmp_path / "head"))
    prompts = _prompts(6, seed=1)
    plain, _ = _generate(smollm2_dummy_dir, prompts)
    spec, llm = _generate(smollm2_dummy_dir, prompts, speculative_algorithm="EAGLE3",
                          speculative_draft_model_path=str(tmp_path / "head"), speculative_num_steps=3,
                          speculative_policy="static")
    assert llm.engine.stats.spec_draft_tokens > 0
    assert spec == plain


def test_adaptive_times_few_steady_catch_ups_and_stays_lossless(smollm2_dummy_dir, tmp_path):
    """The adaptive engine on the GPU times catch-ups with device events: every switch's, but only
    one steady catch-up (after a drafting step) in CATCH_UP_TIMING_EVERY; the others reuse the
    timed ones' mean. Held at depth 3 every step after the first drafts, so nearly all are steady.
    Unfused: a fused catch-up (launched before the verify's sync) is timed with its cycle instead."""
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel
    from specserve.speculative.cycle import CATCH_UP_TIMING_EVERY

    mc = load_model_source(smollm2_dummy_dir).config
    torch.manual_seed(2)
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=mc.vocab_size))
    head.save_pretrained(str(tmp_path / "head"))
    prompts = _prompts(4, seed=2)
    plain, _ = _generate(smollm2_dummy_dir, prompts, max_tokens=48)
    spec, llm = _generate(smollm2_dummy_dir, prompts, max_tokens=48, forced_arm=3, fuse=False,
                          speculative_algorithm="EAGLE3",
                          speculative_draft_model_path=str(tmp_path / "head"), speculative_num_steps=3,
                          speculative_policy="adaptive", speculative_calibrate=False)
    assert spec == plain
    d = llm.engine.drafter
    assert d.cycle.steady_count >= 30  # drafting steps after a drafting step
    assert d.cycle.steady_s  # the timed ones' mean, by rows
    # switches (the first draft of each batch) and new row buckets are timed too: a few more than 1 in 8
    assert d.cycle.catch_ups_timed <= d.cycle.steady_count / CATCH_UP_TIMING_EVERY + 12
    assert d.cycle.catch_ups_timed >= 1


def test_spec_engine_overlaps_its_plain_steps_on_the_gpu(smollm2_dummy_dir, tmp_path):
    """A spec engine's plain steps overlap scheduled on the GPU (auto): the threshold policy off above 3
    running requests, on again at 2 as requests of different lengths finish; greedy tokens are plain
    decoding's, every step replays a graph."""
    from specserve import LLM, SamplingParams
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    mc = load_model_source(smollm2_dummy_dir).config
    torch.manual_seed(3)
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=mc.vocab_size))
    head.save_pretrained(str(tmp_path / "head"))
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=12 + 8 * i, ignore_eos=True) for i in range(8)]
    kw = dict(load_format="dummy", device="cuda", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=128)
    plain = [o.outputs[0].token_ids for o in LLM(smollm2_dummy_dir, overlap_schedule="off", **kw).generate(prompts, params)]
    llm = LLM(smollm2_dummy_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / "head"),
              speculative_num_steps=3, speculative_policy="threshold", speculative_disable_batch_threshold=3, **kw)
    assert llm.engine.overlap
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain
    counts = llm.engine.drafter.path_counts
    assert counts["plain_ahead"] > 20 and llm.engine.stats.spec_steps > 0, (dict(counts), llm.engine.stats.spec_steps)
    assert llm.engine.runner.path_counts["target:eager"] == 0


def test_plain_steps_keep_the_features_their_graph_wrote(smollm2_dummy_dir, tmp_path):
    """EAGLE-3 features of plain steps are written by the target's forward itself (its CUDA graph reads the
    step's slots from the attention backend's persistent buffer; padding rows go to the scratch slot), not
    scattered after it: every slot a plain step computed holds that step's aux output row, exactly."""
    from specserve import LLM, SamplingParams
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    mc = load_model_source(smollm2_dummy_dir).config
    torch.manual_seed(4)
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=mc.vocab_size))
    head.save_pretrained(str(tmp_path / "head"))
    llm = LLM(smollm2_dummy_dir, load_format="dummy", device="cuda", num_kv_blocks=512, max_num_batched_tokens=128,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / "head"),
              speculative_num_steps=3, speculative_policy="threshold", speculative_disable_batch_threshold=0)
    d, runner = llm.engine.drafter, llm.engine.runner
    assert d.features.in_forward and d.target.feature_sink is d.features.features
    forward, rows = runner.forward, []

    def keep_rows(inputs, copy=True):
        out = forward(inputs, copy)
        T = inputs.input_ids.shape[0]  # (queued before the next replay overwrites the graph's outputs)
        rows.append((inputs.meta.slot_mapping.clone(), out[1][:T].clone()))
        return out

    runner.forward = keep_rows
    prompts = _prompts(6, seed=4)
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(prompts))
    assert runner.path_counts["target:graph"] > 20 and d.path_counts["plain_ahead"] > 10
    assert d.features.in_forward
    last = {}  # slot -> the row of the last step that computed it
    for slots, aux in rows:
        for i, s in enumerate(slots.tolist()):
            last[s] = aux[i]
    got = d.features.features[torch.tensor(list(last), device="cuda")]
    assert torch.equal(got, torch.stack(list(last.values())))
