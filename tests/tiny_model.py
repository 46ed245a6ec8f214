"""A tiny random Llama with a word-level tokenizer, written as an HF model directory, plus a
random EAGLE-3 head for it. Used where the real model would make a test too slow."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def make_tiny_model(path: str, vocab: int = 8, layers: int = 4, seed: int = 0, logit_scale: float = 1.0,
                    constant: bool = False, kv_heads: int = 2) -> str:
    """``constant``: the final norm's weight zero, so every logit is 0 and greedy decoding emits token 0
    forever (with ``make_random_head(constant=True)``: a pair whose drafts are always accepted)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=0, bos_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaky next-token distributions so that drafts get rejected sometimes
        model.lm_head.weight.mul_(logit_scale)
        if constant:
            model.model.norm.weight.zero_()
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t0", "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
    return path


def make_random_head(model_dir: str, path: str, seed: int = 1, std: float = 0.5, constant: bool = False,
                     drafts: list[int] | None = None) -> str:
    """``constant``: its final norm's weight zero: it drafts token 0 every time. ``drafts``: its draft
    vocabulary, these target ids (with ``constant`` it proposes them in this order)."""
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    mc = load_model_source(model_dir).config
    torch.manual_seed(seed)
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=len(drafts) if drafts else mc.vocab_size))
    if drafts:
        ids = torch.tensor(drafts)
        head.set_vocab_map(ids - torch.arange(len(drafts)), torch.zeros(mc.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(0.0 if constant and name == "norm.weight" else 1.0)
            else:
                p.normal_(0, std)
    head.save_pretrained(path)
    return path


# SmolLM2-135M's shapes (its config.json), for engines with random weights (--load-format dummy) where
# the GGUF is not at hand (the GPU machine)
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "rope_scaling": None,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# Gemma 3 270M's shapes (the config.json its GGUF converts to), for the same use
GEMMA3_270M_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "max_position_embeddings": 32768, "tie_word_embeddings": True, "sliding_window": 512,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "float32",
}


def make_dummy_model_dir(path: str, config: dict = SMOLLM2_CONFIG) -> str:
    """An HF model directory with ``config`` and a word-level tokenizer over its ids (t0, t1, ...), and no
    weights: load it with load_format="dummy"."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({"placeholder": torch.zeros(1)}, os.path.join(path, "model.safetensors"))  # dummy load reads none
    vocab = config["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": f"t{config['eos_token_id']}", "bos_token": f"t{config['bos_token_id']}"}, f)
    return path


def tiny_gemma3_config(vocab: int = 256, layers: int = 4, window: int = 8):
    """A tiny transformers Gemma3TextConfig exercising what Gemma 3 adds: sliding (window ``window``)
    and global layers interleaved, local and global RoPE bases (linear scaling on the global one),
    one KV head, an attention scale apart from head_dim and final logit soft-capping."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, sliding_window=window,
        layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        eos_token_id=0, bos_token_id=1, pad_token_id=0)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def make_tiny_gemma3(path: str | None = None, seed: int = 0, **kw):
    """A random transformers Gemma3ForCausalLM (norm weights random, so the 1 + weight matters), saved
    as an HF directory with a word-level tokenizer when ``path`` is given. Returns the model."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_gemma3_config(**kw)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            else:  # transformers' init (std 0.02) makes every logit near zero: peakier ones
                p.normal_(0.0, 0.2 if "embed" in name else 0.08)
    if path is not None:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        vocab = cfg.vocab_size
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "t0", "bos_token": "t1"}, f)
    return model


def make_tiny_hf_model(path: str, kind: str, vocab: int = 64, seed: int = 0, kv_heads: int = 2,
                       attention_bias: bool = False):
    """A tiny random Qwen2 / Qwen3 / Gemma 3 saved by transformers (save_pretrained) with a word-level
    tokenizer (t0 ... t{vocab-1}; Qwen: a chat template joining the messages' contents; Gemma: BOS t1
    before every text, as Gemma's tokenizer has). Returns the model."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    torch.manual_seed(seed)
    if kind == "gemma3":
        model = make_tiny_gemma3(vocab=vocab, seed=seed)
    else:
        cls = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
        cfg = getattr(transformers, cls + "Config")(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=0,
            bos_token_id=1, **({"attention_bias": True} if attention_bias else {}))
        model = getattr(transformers, cls + "ForCausalLM")(cfg).eval()
        with torch.no_grad():  # peaky logits, random biases and norms
            for name, p in model.named_parameters():
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "gemma3":
        tok.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"eos_token": "t0", "bos_token": "t1"}
    if kind != "gemma3":
        cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return model
