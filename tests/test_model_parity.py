"""Our Llama / Qwen2 / Qwen3 against transformers on tiny random models (fp32, CPU).

Every step runs through a paged KV cache and the TorchNativeBackend, with attention metadata
built by hand below, so these tests also pin the model <-> attention-backend contract.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.attention.torch_native import TorchNativeBackend
from specserve.config import ModelConfig
from specserve.loader.hf_config import normalize_hf_config
from specserve.models import build_model
from specserve.models.eagle3 import default_aux_layer_ids

TOL = 1e-4
BLOCK = 4  # small blocks so sequences span several of them
VOCAB = 256


def _hf_config(kind: str, num_layers: int = 2):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if kind == "llama3":  # Llama 3.1 rope scaling, tied embeddings
        rs = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=32)
        return transformers.LlamaConfig(**common, rope_scaling=rs, rope_theta=500000.0, tie_word_embeddings=True)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    raise AssertionError(kind)


_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _make_pair(kind: str, num_layers: int = 2):
    torch.manual_seed(0)
    cfg = _hf_config(kind, num_layers)
    hf = getattr(transformers, _HF_CLASSES[kind])(cfg).eval()
    with torch.no_grad():  # transformers zero-inits biases and ones-inits norms: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    config = ModelConfig.from_hf(normalize_hf_config(cfg.to_dict()))
    ours = build_model(config, "cpu", torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours, config


class PagedRunner:
    """Minimal paged-KV bookkeeping: one block list and cached length per request."""

    def __init__(self, model, config: ModelConfig, num_blocks: int = 64) -> None:
        self.model = model
        shape = (num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
        self.backend = TorchNativeBackend(caches, BLOCK, config.head_dim**-0.5)
        self.free = list(range(num_blocks))
        self.blocks: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}

    def step(self, batch: list[tuple[int, list[int], list[int] | None]], tree_masks=None, rows=None):
        """batch: (request id, new token ids, explicit positions or None = next positions).

        Returns (logits [T, vocab] (``rows``: of those rows only), hidden or (hidden, aux)).
        """
        ids, pos, slots, q_lens, seq_lens = [], [], [], [], []
        for rid, toks, positions in batch:
            start = self.cached.get(rid, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * BLOCK < end:
                blocks.append(self.free.pop(0))
            ids += toks
            pos += positions if positions is not None else list(range(start, end))
            slots += [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(start, end)]
            q_lens.append(len(toks))
            seq_lens.append(end)
            self.cached[rid] = end
        width = max(len(self.blocks[rid]) for rid, _, _ in batch)
        table = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (rid, _, _) in enumerate(batch):
            table[b, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid])
        meta = AttentionMetadata(
            query_lens=q_lens,
            seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=table,
            tree_masks=tree_masks,
        )
        self.backend.plan(meta)
        with torch.no_grad(), forward_context(self.backend):
            out = self.model(torch.tensor(ids), torch.tensor(pos))
            hidden = out[0] if isinstance(out, tuple) else out
            return self.model.compute_logits(hidden if rows is None else hidden[rows]), out

    def truncate(self, rid: int, length: int) -> None:
        self.cached[rid] = length


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_prefill_and_decode_match_transformers(kind: str) -> None:
    hf, ours, config = _make_pair(kind)
    run = PagedRunner(ours, config)
    g = torch.Generator().manual_seed(1)
    # long enough that llama3 scaling (original context 32) changes some frequencies
    prompts = {0: torch.randint(0, VOCAB, (11,), generator=g).tolist(),
               1: torch.randint(0, VOCAB, (45,), generator=g).tolist()}
    logits, _ = run.step([(0, prompts[0], None), (1, prompts[1], None)])
    ref = torch.cat([_hf_logits(hf, prompts[0]), _hf_logits(hf, prompts[1])])
    assert _close(logits, ref) <= TOL

    seqs = {r: list(p) for r, p in prompts.items()}
    last = {0: logits[10], 1: logits[-1]}
    for _ in range(4):  # greedy decode, both requests in one batch
        batch = []
        for r in (0, 1):
            tok = int(last[r].argmax())
            seqs[r].append(tok)
            batch.append((r, [tok], None))
        logits, _ = run.step(batch)
        for b, r in enumerate((0, 1)):
            assert _close(logits[b], _hf_logits(hf, seqs[r])[-1]) <= TOL
            last[r] = logits[b]


def test_chunked_prefill_equals_one_shot() -> None:
    hf, ours, config = _make_pair("llama")
    prompt = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    one = PagedRunner(ours, config)
    full, _ = one.step([(0, prompt, None)])
    chunked = PagedRunner(ours, config)
    first, _ = chunked.step([(0, prompt[:7], None)])
    second, _ = chunked.step([(0, prompt[7:], None)])
    assert _close(torch.cat([first, second]), full) <= 1e-5
    assert _close(full, _hf_logits(hf, prompt)) <= TOL


def test_tree_verify_equals_each_path_run_causally() -> None:
    hf, ours, config = _make_pair("qwen3")
    run = PagedRunner(ours, config)
    prefix = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    run.step([(0, prefix, None)])
    # tree: node 0 is the root (last committed token's successor); parents by index
    parents = [-1, 0, 0, 1, 1, 2]
    tokens = [17, 42, 99, 5, 230, 64]
    depth = []
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
    leaves = [i for i in range(n) if i not in parents]
    for leaf in leaves:
        path = []
        j = leaf
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        ref = _hf_logits(hf, prefix + [tokens[i] for i in path])[len(prefix):]
        assert _close(logits[path], ref) <= TOL


def test_tree_mixed_with_plain_decode_in_one_batch() -> None:
    hf, ours, config = _make_pair("llama")
    run = PagedRunner(ours, config)
    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    b = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    run.step([(0, a, None), (1, b, None)])
    parents, tokens = [-1, 0, 0], [3, 4, 5]
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    positions = [len(b), len(b) + 1, len(b) + 1]
    logits, _ = run.step([(0, [77], None), (1, tokens, positions)], tree_masks={1: mask})
    assert _close(logits[0], _hf_logits(hf, a + [77])[-1]) <= TOL
    assert _close(logits[1:3], _hf_logits(hf, b + [3, 4])[-2:]) <= TOL
    assert _close(logits[3], _hf_logits(hf, b + [3, 5])[-1]) <= TOL


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_aux_hidden_states_are_layer_inputs(kind: str) -> None:
    hf, ours, config = _make_pair(kind, num_layers=6)
    assert default_aux_layer_ids(30) == (2, 15, 27)
    ids = (0, 2, 3, 5)
    ours.set_aux_hidden_layers(ids)
    run = PagedRunner(ours, config)
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    logits, (hidden, aux) = run.step([(0, prompt, None)])
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    H = config.hidden_size
    assert aux.shape == (10, len(ids) * H)
    for k, i in enumerate(ids):
        assert _close(aux[:, k * H : (k + 1) * H], out.hidden_states[i][0]) <= TOL
    assert _close(logits, out.logits[0]) <= TOL
    ours.set_aux_hidden_layers(None)
    logits2, plain = run.step([(1, prompt, None)])
    assert isinstance(plain, torch.Tensor) and _close(logits2, logits) <= 1e-5
    with pytest.raises(ValueError, match="aux hidden layer ids"):
        ours.set_aux_hidden_layers((0, 6))


def test_load_weights_reports_missing_unexpected_and_shape() -> None:
    hf, ours, _ = _make_pair("llama")
    sd = dict(hf.state_dict())
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        ours.load_weights((k, v) for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.9.foo"):
        ours.load_weights([*sd.items(), ("model.layers.9.foo", torch.zeros(1))])
    bad = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match=r"shape mismatch for model.layers.0.self_attn.k_proj.weight"):
        ours.load_weights(bad.items())
    # round trip through our un-fused view of the parameters
    for name, t in ours.hf_weights():
        assert torch.equal(t, sd[name]), name


def test_build_model_rejects_unknown_architecture() -> None:
    cfg = ModelConfig.from_hf(dict(normalize_hf_config(_hf_config("llama").to_dict()), architectures=["GPTNeoX"]))
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoX'.*LlamaForCausalLM"):
        build_model(cfg)


def test_bf16_model_keeps_fp32_rope_and_logits() -> None:
    _, ours32, config = _make_pair("llama")
    ours16 = build_model(config, "cpu", "bfloat16")
    ours16.load_weights(ours32.hf_weights())
    assert ours16.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert ours16.rotary_emb.cos.dtype == torch.float32
    run = PagedRunner(ours16, config)
    run.backend.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in run.backend.kv_caches]
    prompt = list(range(1, 12))
    logits, _ = run.step([(0, prompt, None)])
    assert logits.dtype == torch.float32
    ref, _ = PagedRunner(ours32, config).step([(0, prompt, None)])
    assert _close(logits, ref) < 0.1
