"""Loading the real SmolLM2 GGUF, against transformers' own GGUF loader; tokenizer; errors.

This is the loader's one real-model test module: transformers' GGUF path takes ~30 s
(model + tokenizer), so its results are shared through module-scoped fixtures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import pytest
import torch
import transformers

from specserve.attention.base import AttentionMetadata, forward_context
from specserve.attention.torch_native import TorchNativeBackend
from specserve.loader import (
    IncrementalDetokenizer,
    Tokenizer,
    default_model_path,
    dummy_weights,
    gguf,
    load_model_source,
)
from specserve.models import build_model
from hf_reference import gguf_parsed_once, hf_smollm2, release

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30? Answer in one word, ünïcödé OK 🎉."},
]


@pytest.fixture(scope="module")
def timed_sources(tmp_path_factory):
    """Cold GGUF load into an empty cache, then a cached load (the timings go in the report)."""
    torch.set_num_threads(2)
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    t0 = time.perf_counter()
    cold = load_model_source(None)
    t1 = time.perf_counter()

    def no_conversion(*args, **kwargs):
        raise AssertionError("second load converted the GGUF again instead of using the cache")

    mp.setattr(gguf, "convert_gguf", no_conversion)
    warm = load_model_source(None)
    t2 = time.perf_counter()
    n = sum(t.numel() for _, t in warm.weights())
    t3 = time.perf_counter()
    cached = gguf.is_cached(warm.path)  # (in this fixture's cache dir)
    mp.undo()
    print(f"\nGGUF cold load {t1 - t0:.2f}s; cached load {t2 - t1:.3f}s (+{t3 - t2:.3f}s reading {n} weights)")
    return cold, warm, cached


@pytest.fixture(scope="module")
def source(timed_sources):
    return timed_sources[1]


@pytest.fixture(scope="module")
def hf_model():
    # (shared with test_engine_e2e, which runs first: one transformers GGUF load for both)
    yield hf_smollm2()
    release()


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = default_model_path()
    with gguf_parsed_once():  # (the parse hf_model's load made)
        return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _prefill_logits(model, config, ids: list[int]) -> torch.Tensor:
    block = 16
    nblocks = (len(ids) + block - 1) // block
    shape = (nblocks, block, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    backend = TorchNativeBackend(caches, block, config.head_dim**-0.5)
    backend.plan(
        AttentionMetadata(
            query_lens=[len(ids)],
            seq_lens=[len(ids)],
            slot_mapping=torch.arange(len(ids)),
            block_tables=torch.arange(nblocks)[None],
        )
    )
    with torch.no_grad(), forward_context(backend):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_cold_and_cached_load_agree(timed_sources) -> None:
    cold, warm, cached = timed_sources
    assert cold.format == warm.format == "gguf"
    assert cold.model_dir == warm.model_dir and cached
    assert warm.hf_config == cold.hf_config
    c = warm.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("LlamaForCausalLM", 30, 576, 9)
    assert (c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings, c.rope_theta) == (3, 49152, True, 100000.0)
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert warm.tokenizer.eos_token_ids == {2} and warm.tokenizer.bos_token_id == 1


def test_weights_equal_transformers_gguf_loader(source, hf_model) -> None:
    ref = hf_model.state_dict()
    ours = dict(source.weights())
    assert "lm_head.weight" not in ours  # tied
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.17.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.5.input_layernorm.weight",
        "model.norm.weight",
    ]:
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], ref[name]), name


def test_logits_match_transformers(source, hf_model) -> None:
    model = build_model(source.config, "cpu", torch.float32)
    model.load_weights(source.weights())
    ids = source.tokenizer.apply_chat_template(MESSAGES)
    ours = _prefill_logits(model, source.config, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-3
    assert torch.equal(ours[-1].argmax(), ref[-1].argmax())


def test_tokenizer_matches_transformers(source, hf_tokenizer) -> None:
    tok = source.tokenizer
    text = "Hello world! It's 2024-05-01, ünïcödé 🎉 <|im_end|> done.\n\n  indented\tcode()"
    ids = tok.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert "<|im_end|>" not in tok.decode(ids)  # special tokens skipped by default
    ref = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.apply_chat_template(MESSAGES) == list(ref)
    text_prompt = tok.apply_chat_template_text(MESSAGES)
    assert text_prompt.endswith("<|im_start|>assistant\n")
    assert text_prompt == hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok.vocab_size == 49152


def test_incremental_detokenizer_streams_whole_characters(source) -> None:
    tok = source.tokenizer
    text = " Größe: 🎉🎉 中文字符 and done."
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas = [detok.append(i) for i in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some byte tokens had to wait for the rest of their character
    assert detok.append(tok.eos_token_id) == ""  # skipped special token


def test_hf_directory_with_sharded_safetensors(source, tmp_path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="4MB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(source.model_dir, name), tmp_path / name)
    src = load_model_source(str(tmp_path))
    assert src.format == "safetensors" and src.config.architecture == "LlamaForCausalLM"
    model = build_model(src.config)
    model.load_weights(src.weights())
    ids = src.tokenizer.encode("a short prompt")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (_prefill_logits(model, src.config, ids) - ref).abs().max().item() <= 1e-4


def test_generation_config_adds_eos_ids(source, tmp_path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(source.model_dir, name), tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(str(tmp_path)).eos_token_ids == {0, 2}


def test_dummy_weights_load_into_model(source) -> None:
    config = dataclasses.replace(source.config, num_hidden_layers=2, vocab_size=1000)
    model = build_model(config)
    model.load_weights(dummy_weights(config))
    w = model.model.layers[1].self_attn.qkv_proj.weight
    assert 0.015 < w.std().item() < 0.025
    assert torch.equal(model.model.norm.weight, torch.ones(576))
    a, b = dict(dummy_weights(config, seed=1)), dict(dummy_weights(config, seed=1))
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded


def test_bad_paths_give_clear_errors(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf does not exist; expected a \.gguf file or an HF model"):
        load_model_source(str(missing))
    with pytest.raises(ValueError, match=r"no config.json.*expected a \.gguf file"):
        load_model_source(str(tmp_path))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.bin: not a GGUF file"):
        load_model_source(str(junk))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        load_model_source(str(tmp_path))


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _write_gguf(path, hf, arch: str) -> None:
    """A llama.cpp-layout F32 GGUF of a tiny transformers model (q/k rows permuted for llama)."""
    import gguf as gguf_pkg

    cfg = hf.config
    tokens = _byte_tokens() + ["\u0120t", "<s>", "</s>"]
    w = gguf_pkg.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["\u0120 t"])
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    layer_names = {v: k for k, v in gguf._LAYER_NAMES.items()}
    glob_names = {v: k for k, v in gguf._GLOBAL_NAMES.items()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.numpy().astype("float32")
        if name in glob_names:
            w.add_tensor(glob_names[name], a)
            continue
        _, _, i, *mid, leaf = name.split(".")
        sub = ".".join(mid)
        if arch == "llama" and sub in ("self_attn.q_proj", "self_attn.k_proj"):
            n = cfg.num_attention_heads if "q_proj" in sub else cfg.num_key_value_heads
            rows = a.shape[0]
            a = a.reshape(n, 2, rows // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(f"blk.{i}.{layer_names[sub]}.{leaf}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthetic_gguf_round_trip(arch: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    common = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    _write_gguf(tmp_path / "tiny.gguf", hf, arch)

    src = load_model_source(str(tmp_path / "tiny.gguf"))
    assert src.config.architecture == type(hf).__name__
    assert src.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert src.config.head_dim == hf.config.head_dim and src.config.qk_norm == (arch == "qwen3")
    ref = hf.state_dict()
    got = dict(src.weights())
    assert set(got) == set(ref) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name

    tok = src.tokenizer
    ids = tok.encode("a tt")
    assert tok.convert_ids_to_tokens(ids) == ["a", "\u0120t", "t"] and tok.decode(ids) == "a tt"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == [257, tok.encode("x")[0], 258]
    assert tok.eos_token_ids == {258} and tok.bos_token_id == 257

    model = build_model(src.config)
    model.load_weights(src.weights())
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert (_prefill_logits(model, src.config, prompt) - expected).abs().max().item() <= 1e-4


def test_gguf_names_and_config_normalisation() -> None:
    from specserve.loader.hf_config import normalize_hf_config

    assert gguf.hf_tensor_name("blk.7.ffn_gate.weight") == "model.layers.7.mlp.gate_proj.weight"
    assert gguf.hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf.hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.ssm_a'"):
        gguf.hf_tensor_name("blk.0.ssm_a")
    d = normalize_hf_config({"model_type": "qwen2", "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 1e6}})
    assert d["architectures"] == ["Qwen2ForCausalLM"] and d["rope_theta"] == 1e6
    assert d["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="unknown model_type 'mamba'"):
        normalize_hf_config({"model_type": "mamba"})
