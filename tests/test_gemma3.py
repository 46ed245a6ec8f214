"""Gemma 3 against transformers on a tiny random model (fp32, CPU): sliding-window layers with a
window of 8 (prompts and decodes run well past it), local/global RoPE, q/k norms, the attention
scale and logit soft-capping; through the paged cache by hand, then through the engine."""

from __future__ import annotations

import pytest
import torch

from specserve.config import ModelConfig
from specserve.loader.hf_config import normalize_hf_config
from specserve.models import Gemma3ForCausalLM, build_model
from test_model_parity import PagedRunner, _close
from tiny_model import make_tiny_gemma3, tiny_gemma3_config

transformers = pytest.importorskip("transformers")

TOL = 1e-4
VOCAB = 256


@pytest.fixture(scope="module")
def pair():
    hf = make_tiny_gemma3()
    config = ModelConfig.from_hf(normalize_hf_config(hf.config.to_dict()))
    ours = build_model(config, "cpu", torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours, config


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_config_from_hf_reads_gemma3_fields(pair) -> None:
    _, ours, config = pair
    assert isinstance(ours, Gemma3ForCausalLM)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert [config.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert config.rope_theta == 1e6 and config.rope_local_theta == 1e4
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (config.query_pre_attn_scalar, config.final_logit_softcapping) == (24, 30.0)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    # a pre-transformers-5 config.json: flat rope_theta / rope_local_base_freq, the layer pattern
    old = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 7, "num_attention_heads": 1, "num_key_value_heads": 1,
           "head_dim": 8, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_scaling": None}
    c = ModelConfig.from_hf(normalize_hf_config(old))
    assert [c.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        normalize_hf_config(dict(old, attn_logit_softcapping=50.0))


def test_prefill_and_decode_past_the_window_match_transformers(pair) -> None:
    hf, ours, config = pair
    run = PagedRunner(ours, config)
    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, VOCAB, (5,), generator=g).tolist(),  # inside the window at first
               1: torch.randint(0, VOCAB, (45,), generator=g).tolist()}
    logits, _ = run.step([(0, prompts[0], None), (1, prompts[1], None)])
    ref = torch.cat([_hf_logits(hf, prompts[0]), _hf_logits(hf, prompts[1])])
    assert _close(logits, ref) <= TOL
    seqs = {r: list(p) for r, p in prompts.items()}
    last = {0: logits[4], 1: logits[-1]}
    for _ in range(8):  # request 0 decodes past the window of 8
        batch = []
        for r in (0, 1):
            tok = int(last[r].argmax())
            seqs[r].append(tok)
            batch.append((r, [tok], None))
        logits, _ = run.step(batch)
        for b, r in enumerate((0, 1)):
            assert _close(logits[b], _hf_logits(hf, seqs[r])[-1]) <= TOL
            last[r] = logits[b]


def test_window_matters_and_chunked_prefill_equals_one_shot(pair) -> None:
    hf, ours, config = pair
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    full, _ = PagedRunner(ours, config).step([(0, prompt, None)])
    chunked = PagedRunner(ours, config)
    parts = [chunked.step([(0, prompt[a:b], None)])[0] for a, b in ((0, 7), (7, 19), (19, 30))]
    assert _close(torch.cat(parts), full) <= 1e-5
    assert _close(full, _hf_logits(hf, prompt)) <= TOL
    # the same model with the window wide open gives other logits past position 8 (and the same before)
    wide = ModelConfig.from_hf(normalize_hf_config(tiny_gemma3_config(window=64).to_dict()))
    ours_wide = build_model(wide, "cpu", torch.float32)
    ours_wide.load_weights(hf.state_dict().items())
    other, _ = PagedRunner(ours_wide, wide).step([(0, prompt, None)])
    assert _close(other[:8], full[:8]) <= 1e-5
    assert _close(other[8:], full[8:]) > 1e-2


def test_soft_capping_bounds_logits(pair) -> None:
    _, ours, config = pair
    huge = torch.full((1, config.hidden_size), 1e3)
    assert ours.compute_logits(huge).abs().max() <= 30.0


def test_engine_greedy_matches_transformers_with_chunks_and_prefix_cache(tmp_path) -> None:
    """64 greedy tokens of 5 prompts through the engine (an HF directory; chunked prefill, a window
    of 8, prefix-cache hits on a second pass), each token the argmax of transformers' logits."""
    from specserve import LLM, SamplingParams

    path = str(tmp_path / "gemma")
    hf = make_tiny_gemma3(path)
    llm = LLM(dtype="float32", model=path, max_num_batched_tokens=16, num_kv_blocks=96, block_size=4, max_model_len=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 26, 40)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    for ids, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert len(got) == 64
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :]
        assert got == logits.argmax(-1).tolist()
    # the window layers' blocks of a prompt's end were freed 8 tokens into its output (and may be reused
    # since): a hit is where a finished request left off, its prompt + output (a chat's next turn)
    conts = [ids + out.outputs[0].token_ids for ids, out in zip(prompts[3:], outs[3:])]
    again = llm.generate(conts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for ids, o in zip(conts, again):
        assert o.metrics.num_cached_tokens >= len(ids) - 4 - 1
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + o.outputs[0].token_ids[:-1]])).logits[0, len(ids) - 1 :]
        assert o.outputs[0].token_ids == logits.argmax(-1).tolist()


def _greedy_hf(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, len(ids):].tolist()


def test_window_pool_frees_blocks_fits_more_tokens_and_survives_preemption(tmp_path) -> None:
    """A budget of 24 blocks of every layer: 12 blocks for the sliding layers (2 seats' windows and a
    step's chunk) and 36 for the global ones, so 104-token requests fit (96 tokens before); two of
    them preempt each other; greedy tokens are transformers' all along."""
    from specserve import LLM, SamplingParams

    path = str(tmp_path / "gemma")
    hf = make_tiny_gemma3(path)
    llm = LLM(dtype="float32", model=path, max_num_batched_tokens=16, num_kv_blocks=24, block_size=4, max_model_len=128,
              max_num_seqs=2)
    eng = llm.engine
    win = eng.scheduler.window
    assert (eng.blocks.num_blocks, win.pool.num_blocks, eng.max_model_len) == (36, 12, 128)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (40, 33, 21)]
    live = []  # window blocks the running requests hold after each step
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        live.append(sum(b != win.null for r in eng.scheduler.running for b in r.kv.window_table))
    assert eng.scheduler.num_preemptions > 0
    assert max(live) <= win.pool.num_blocks and win.pool.num_free_blocks == win.pool.num_blocks
    for i, ids in enumerate(prompts):
        assert got[str(i)] == _greedy_hf(hf, ids, 64)


@pytest.mark.parametrize("topk", [1, 2])
def test_speculation_past_the_window_is_lossless(tmp_path, topk: int) -> None:
    """A random EAGLE-3 head on the tiny Gemma 3 (window pool, prefix cache, chunked prefill): greedy
    speculation, chains and trees (the torch backend), gives plain decoding's tokens."""
    from specserve import LLM, SamplingParams
    from tiny_model import make_random_head

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path, vocab=8)  # (a random head's drafts are accepted now and then)
    # its drafts: 6 then 2, what this target repeats after some prompts and not others
    head = make_random_head(path, str(tmp_path / "head"), constant=True, drafts=[6, 2])
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 8, (n,), generator=g).tolist() for n in (30, 17, 45)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    kw = dict(model=path, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=32, block_size=4, max_model_len=128, max_num_seqs=3)
    plain = LLM(**kw).generate(prompts, sp)
    llm = LLM(**kw, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=4 if topk == 1 else 6)
    assert llm.engine.scheduler.window is not None
    outs = llm.generate(prompts, sp)
    for o, p in zip(outs, plain):  # the same tokens, each at the same log-probability (the K/V it read)
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
        lp = [[d[t] for t in d] for d in o.outputs[0].logprobs]
        ref = [[d[t] for t in d] for d in p.outputs[0].logprobs]
        assert torch.allclose(torch.tensor(lp), torch.tensor(ref), atol=1e-4)
    assert sum(o.metrics.spec_accepted_tokens for o in outs) > 0


def _run_keeping_window_keys(llm, prompts, sp) -> tuple[list[list[int]], dict]:
    """Outputs, and the window layer's K at each committed position still in the pool after every step:
    {(request, position): K} (the sliding layer 0 reads embeddings: K is a function of token and position)."""
    eng, keys, outs = llm.engine, {}, {}
    k_cache = eng.runner.pool_caches[1][0][0]  # [blocks, bs, kv heads, head dim]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        for r in eng.scheduler.running:
            for pos in range(r.num_computed_tokens):
                blk = r.kv.window_table[pos // 4]
                if blk != eng.scheduler.window.null:
                    keys[(r.request_id, pos)] = k_cache[blk, pos % 4].clone()
    return [outs[str(i)] for i in range(len(prompts))], keys


def test_fused_tree_launch_with_a_window_pool_is_lossless(tmp_path) -> None:
    """The fused tree launch (acceptance and KV compaction on the device, both pools) and the verify
    launched before the sync (its window slots computed there): plain decoding's tokens, and its K at
    every committed position of the window pool."""
    from specserve import LLM, SamplingParams
    from tiny_model import make_random_head

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path, layers=2, vocab=8, window=4)
    head = make_random_head(path, str(tmp_path / "head"), constant=True, drafts=[6, 2])
    prompts = [[5, 7, 3, 2, 4, 6, 4, 7, 3, 5, 3, 2, 6, 6], [2, 4], [3, 3, 5, 7, 2, 4, 6, 5, 4]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=path, dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64, max_num_seqs=3)
    plain, plain_keys = _run_keeping_window_keys(LLM(**kw), prompts, sp)
    llm = LLM(**kw, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_policy="static",
              speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    dr = llm.engine.drafter
    dr.enable_static_draft(attention="torch", fused_launch=True)
    dr.pipeline.early_verify = True
    outs, keys = _run_keeping_window_keys(llm, prompts, sp)
    assert dr.pipeline.tree_launch.window and dr.path_counts["fused"] > 0 and dr.path_counts["presync_verify"] > 0
    assert llm.engine.stats.spec_accepted_tokens > 0
    assert outs == plain
    common = keys.keys() & plain_keys.keys()
    assert len(common) > 40
    assert max((keys[c] - plain_keys[c]).abs().max().item() for c in common) < 1e-5


def test_tree_verify_past_the_window_equals_each_path(pair) -> None:
    """A tree's tokens see the window of their own position (prefix + depth), not of their row."""
    hf, ours, config = pair
    run = PagedRunner(ours, config)
    prefix = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    run.step([(0, prefix, None)])
    parents = [-1, 0, 0, 1, 1, 2, 5, 6]
    tokens = [17, 42, 99, 5, 230, 64, 8, 71]
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    logits, _ = run.step([(0, tokens, [len(prefix) + d for d in depth])], tree_masks={0: mask})
    for leaf in (3, 4, 7):
        path = [leaf]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        ref = _hf_logits(hf, prefix + [tokens[i] for i in path])[len(prefix):]
        assert _close(logits[path], ref) <= TOL


def test_aux_hidden_states_are_layer_inputs(pair) -> None:
    """EAGLE-3 features of Gemma 3: the residual stream entering layers 0, 1 and 3, as transformers has it."""
    hf, ours, config = pair
    ours.set_aux_hidden_layers((0, 1, 3))
    try:
        prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
        logits, (_, aux) = PagedRunner(ours, config).step([(0, prompt, None)])
    finally:
        ours.set_aux_hidden_layers(None)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    H = config.hidden_size
    for k, i in enumerate((0, 1, 3)):
        assert _close(aux[:, k * H : (k + 1) * H], out.hidden_states[i][0]) <= TOL
    assert _close(logits, out.logits[0]) <= TOL


def test_speculation_without_a_head_for_gemma_is_a_clear_error(tmp_path) -> None:
    from specserve import LLM

    path = str(tmp_path / "gemma")
    make_tiny_gemma3(path)
    # the default head is SmolLM2's: its vocabulary is not this model's
    with pytest.raises((ValueError, FileNotFoundError), match="draft head vocab|no draft head"):
        LLM(dtype="float32", model=path, num_kv_blocks=16, block_size=4, max_model_len=64, speculative_algorithm="EAGLE3")


def test_offset_norm_is_transformers_in_bf16() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from specserve.models.layers import OffsetRMSNorm

    ref = Gemma3RMSNorm(64, eps=1e-6)
    ours = OffsetRMSNorm(64, 1e-6)
    with torch.no_grad():
        ref.weight.normal_(0.0, 0.05)  # small offsets: 1 + weight in bf16 would round them away
        ours.weight.copy_(ref.weight)
    ref, ours = ref.bfloat16(), ours.bfloat16()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6)).bfloat16() * 4
    assert torch.equal(ours(x), ref(x))


def test_sliding_layers_of_other_families_are_refused() -> None:
    cfg = transformers.Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1)
    config = ModelConfig.from_hf(normalize_hf_config(dict(cfg.to_dict(), architectures=["Qwen2ForCausalLM"])))
    assert config.layer_window(1) == 8
    with pytest.raises(ValueError, match="sliding-window layers is not supported"):
        build_model(config)


def test_dummy_gemma3_270m_config_builds(tmp_path) -> None:
    """The 270M's shapes with random weights (--load-format dummy, for device runs without the GGUF)."""
    from specserve.loader import load_model_source
    from tiny_model import GEMMA3_270M_CONFIG, make_dummy_model_dir

    src = load_model_source(make_dummy_model_dir(str(tmp_path / "g"), GEMMA3_270M_CONFIG), require_weights=False)
    assert [i for i in range(18) if src.config.layer_window(i) is None] == [5, 11, 17]
    model = build_model(src.config, "meta")
    assert sum(p.numel() for p in model.parameters()) == 268_098_176  # the 270M's parameter count
