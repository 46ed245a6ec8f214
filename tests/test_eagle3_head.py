"""The EAGLE draft-head module: public checkpoint layout both ways, clear load errors, EAGLE-1,
and the forward math against a hand-written reference."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.attention.base import forward_context
from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel
from specserve.train.attention import DenseCausalBackend

PUBLIC_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def small_config(**kw) -> Eagle3Config:
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=40, draft_vocab_size=16, rope_theta=10000.0, aux_layer_ids=(2, 4, 5))
    base.update(kw)
    return Eagle3Config(**base)


def random_head(cfg: Eagle3Config, seed: int = 0) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    head = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    if cfg.algorithm == "EAGLE3":
        chosen = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[chosen] = True
        head.set_vocab_map(chosen - torch.arange(cfg.draft_vocab_size), t2d)
    return head


def test_round_trip_is_bit_identical_in_the_public_layout(tmp_path) -> None:
    cfg = small_config(target_hidden_size=24)
    head = random_head(cfg)
    head.save_pretrained(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(tensors) == PUBLIC_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].shape == (32, 3 * 24)
    cj = json.load(open(tmp_path / "config.json"))
    assert cj["architectures"] == ["LlamaForCausalLMEagle3"] and cj["draft_vocab_size"] == 16
    assert cj["target_hidden_size"] == 24 and cj["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]

    back = Eagle3DraftModel.from_pretrained(tmp_path)
    assert back.config == cfg
    sd, sd2 = head.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k]), k

    # bf16 on disk reloads bit-identical in bf16
    head.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    b16 = Eagle3DraftModel.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(b16.lm_head.weight, head.lm_head.weight.to(torch.bfloat16))
    assert b16.d2t.dtype == torch.int64 and b16.t2d.dtype == torch.bool


def test_missing_tensor_and_wrong_shape_name_the_tensor(tmp_path) -> None:
    head = random_head(small_config())
    head.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    good = load_file(path)

    bad = dict(good)
    del bad["midlayer.hidden_norm.weight"]
    save_file(bad, path)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): midlayer.hidden_norm.weight"):
        Eagle3DraftModel.from_pretrained(tmp_path)

    bad = dict(good, **{"midlayer.self_attn.k_proj.weight": torch.zeros(8, 64)})
    save_file(bad, path)
    with pytest.raises(ValueError, match=r"midlayer.self_attn.k_proj.weight has shape \(8, 64\), config implies \(16, 64\)"):
        Eagle3DraftModel.from_pretrained(tmp_path)

    os.remove(path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Eagle3DraftModel.from_pretrained(tmp_path)


def test_sharded_checkpoint_and_extra_embeddings_load(tmp_path) -> None:
    head = random_head(small_config())
    sd = {k: v.contiguous() for k, v in head.state_dict().items()}
    keys = sorted(sd)
    a, b = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    save_file({k: sd[k] for k in a}, tmp_path / "model-00001-of-00002.safetensors")
    # public heads trained elsewhere may carry the (frozen) target embeddings: ignored here
    save_file({**{k: sd[k] for k in b}, "embed_tokens.weight": torch.zeros(40, 32)},
              tmp_path / "model-00002-of-00002.safetensors")
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm.update({k: "model-00002-of-00002.safetensors" for k in b})
    json.dump({"weight_map": wm}, open(tmp_path / "model.safetensors.index.json", "w"))
    head.config.to_json(tmp_path / "config.json")
    back = Eagle3DraftModel.from_pretrained(tmp_path)
    for k in sd:
        assert torch.equal(sd[k], back.state_dict()[k]), k


def test_public_config_defaults() -> None:
    d = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "intermediate_size": 48,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40, "draft_vocab_size": 16,
         "rms_norm_eps": 1e-5}
    cfg = Eagle3Config.from_dict(d)
    assert cfg.rope_theta == 10000.0 and cfg.head_dim == 8 and cfg.aux_layer_ids is None
    assert cfg.resolved_aux_layer_ids(30) == (2, 15, 27)
    with pytest.raises(ValueError, match="not an EAGLE"):
        Eagle3Config.from_dict({**d, "architectures": ["LlamaForCausalLM"], "draft_vocab_size": None})


def _reference_eagle3(head: Eagle3DraftModel, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 midlayer written out by hand: embeds first, residual on h, causal attention."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    cfg, m = head.config, head.midlayer

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    T = e.shape[0]
    x = torch.cat([rms(e, m.input_layernorm.weight), rms(h, m.hidden_norm.weight)], -1)
    a = m.self_attn
    q = (x @ a.q_proj.weight.T).view(1, T, 4, 8).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(1, T, 2, 8).transpose(1, 2)
    v = (x @ a.v_proj.weight.T).view(1, T, 2, 8).transpose(1, 2)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, 8, 2).float() / 8))
    f = torch.outer(torch.arange(T).float(), inv)
    emb = torch.cat([f, f], -1)
    q, k = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    s = (q @ k.transpose(-1, -2)) / 8**0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(T, 32) @ a.o_proj.weight.T
    h2 = h + o
    y = rms(h2, m.post_attention_layernorm.weight)
    mlp = m.mlp
    return h2 + (torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def test_forward_matches_reference_math() -> None:
    head = random_head(small_config()).eval()
    T = 7
    torch.manual_seed(1)
    e, aux = torch.randn(T, 32), torch.randn(T, 96)
    with torch.no_grad(), forward_context(DenseCausalBackend(1, T, 8 ** -0.5)):
        h0 = head.combine(aux)
        out = head(e, h0, torch.arange(T))
        ref = _reference_eagle3(head, e, h0)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        logits = head.compute_logits(out)
    assert logits.shape == (T, 16) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="feature has width"):
        head.combine(torch.randn(T, 32))


@pytest.mark.parametrize("attention_bias", [False, True])
def test_fused_projections_compute_the_same_head(tmp_path, attention_bias: bool) -> None:
    cfg = small_config(attention_bias=attention_bias)
    head = random_head(cfg).eval()
    fused = random_head(cfg).eval().fuse_projections()
    assert fused.midlayer.self_attn.qkv_proj.weight.shape == (4 * 8 + 2 * 2 * 8, 64)
    assert not hasattr(fused.midlayer.mlp, "gate_proj")
    T = 6
    torch.manual_seed(3)
    e, aux = torch.randn(T, 32), torch.randn(T, 96)
    with torch.no_grad():
        with forward_context(DenseCausalBackend(1, T, 8 ** -0.5)):
            ref = head(e, head.combine(aux), torch.arange(3, 3 + T))
        with forward_context(DenseCausalBackend(1, T, 8 ** -0.5)):
            out = fused(e, fused.combine(aux), torch.arange(3, 3 + T))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the fused head's draft -> target map (one gather) follows set_vocab_map
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    d2t = torch.randint(1, V - Vd + 1, (Vd,), generator=torch.Generator().manual_seed(4))
    for m in (head, fused):
        m.set_vocab_map(d2t, torch.zeros(V, dtype=torch.bool))
    ids = torch.arange(Vd)
    assert torch.equal(fused.draft_to_target(ids), ids + d2t) and torch.equal(head.draft_to_target(ids), ids + d2t)
    assert torch.equal(fused.greedy_draft(out), head.draft_to_target(head.compute_logits(out).argmax(-1)))
    assert fused.fuse_projections() is fused  # a second call changes nothing
    with pytest.raises(RuntimeError, match="fused for inference"):
        fused.save_pretrained(tmp_path)
    assert not os.path.exists(tmp_path / "config.json")


def _write_eagle1(path, with_bias: bool) -> dict[str, torch.Tensor]:
    H, I = 32, 48
    torch.manual_seed(2)
    t = {"fc.weight": torch.randn(H, 2 * H) * 0.1}
    if with_bias:
        t["fc.bias"] = torch.randn(H) * 0.1
    for n, shape in [("self_attn.q_proj.weight", (32, H)), ("self_attn.k_proj.weight", (16, H)),
                     ("self_attn.v_proj.weight", (16, H)), ("self_attn.o_proj.weight", (H, 32)),
                     ("post_attention_layernorm.weight", (H,)), ("mlp.gate_proj.weight", (I, H)),
                     ("mlp.up_proj.weight", (I, H)), ("mlp.down_proj.weight", (H, I))]:
        t[f"layers.0.{n}"] = torch.randn(shape) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    json.dump({"architectures": ["LlamaForCausalLMEagle"], "hidden_size": H, "intermediate_size": I,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40, "num_hidden_layers": 1,
               "bias": with_bias, "rms_norm_eps": 1e-6}, open(os.path.join(path, "config.json"), "w"))
    return t


def test_eagle1_head_loads_and_drafts_with_the_target_lm_head(tmp_path) -> None:
    tensors = _write_eagle1(tmp_path, with_bias=True)
    head = Eagle3DraftModel.from_pretrained(tmp_path)
    assert head.config.algorithm == "EAGLE" and head.num_kv_layers == 1
    assert torch.equal(head.fc.bias, tensors["fc.bias"])
    T = 5
    e, h = torch.randn(T, 32), torch.randn(T, 32)
    assert torch.equal(head.combine(h), h)  # EAGLE-1 consumes the target's last hidden state as is
    with torch.no_grad(), forward_context(DenseCausalBackend(1, T, 8 ** -0.5)):
        out = head(e, h, torch.arange(T))
    with pytest.raises(RuntimeError, match="bind_target"):
        head.compute_logits(out)
    lm = torch.randn(40, 32)
    head.bind_target(lambda x: x @ lm.T)
    logits = head.compute_logits(out)
    assert logits.shape == (T, 40)
    assert torch.equal(head.draft_to_target(torch.tensor([3, 7])), torch.tensor([3, 7]))
    # the fused input is fc(cat(embeds, hidden)) with its bias
    x = torch.cat([e, h], -1) @ tensors["fc.weight"].T + tensors["fc.bias"]
    torch.testing.assert_close(head.fc(torch.cat([e, h], -1)), x)

    _write_eagle1(tmp_path / "nobias", with_bias=False)
    assert Eagle3DraftModel.from_pretrained(tmp_path / "nobias").fc.bias is None
