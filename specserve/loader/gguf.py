"""GGUF -> HF-style model directory (cached), via the ``gguf`` package.

The first load of a GGUF dequantizes every tensor to fp32, renames it from llama.cpp's names
to HF names, undoes llama.cpp's q/k row permutation (Llama only) and its +1 on Gemma's norm
weights (llama.cpp scales by the weight, HF by 1 + weight), builds config.json from the
metadata and a fast tokenizer (tokenizer.json + tokenizer_config.json with the chat template)
from the vocabulary, and writes all of it into a cache directory keyed by the file's path,
size and mtime. Later loads are plain HF-directory loads.

Cache root: $SPECSERVE_CACHE_DIR, else ~/.cache/specserve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
_CACHE_MARKER = "specserve_cache.json"
_SHARD_BYTES = 4 << 30

_ARCHITECTURES = {  # general.architecture -> (HF architecture, model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around both sublayers: llama.cpp's ffn_norm is the pre-feedforward one there
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp hard-codes what Gemma 3 GGUFs leave out: every 6th layer global, local RoPE base 1e4
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> HF parameter name (ValueError for names we do not know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (its converter permutes them for its rope)."""
    rows = w.shape[0]
    if w.ndim == 1:
        return w.reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)
    cols = w.shape[1]
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# -- cache ---------------------------------------------------------------------------------------


def cache_root() -> str:
    return os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specserve")


def gguf_cache_dir(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{digest}")


def is_cached(path: str) -> bool:
    return os.path.isfile(os.path.join(gguf_cache_dir(path), _CACHE_MARKER))


def ensure_converted(path: str) -> str:
    """The HF-style cache directory for this GGUF, converting it first if needed."""
    out = gguf_cache_dir(path)
    if os.path.isfile(os.path.join(out, _CACHE_MARKER)):
        return out
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError as e:
        raise OSError(
            f"cannot write the GGUF cache under {parent}: {e}; set SPECSERVE_CACHE_DIR to a writable directory"
        ) from e
    try:
        convert_gguf(path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, out)
        except OSError:
            if not os.path.isfile(os.path.join(out, _CACHE_MARKER)):  # not a lost race: a real error
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- conversion ----------------------------------------------------------------------------------


class _Meta:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch: str = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        v = self.arch_get(key)
        if v is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        return v


def _f32(x: float) -> float:
    """GGUF stores floats as float32: recover the shortest decimal (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def array_reader(path: str) -> Any:
    """gguf's GGUFReader over a plain ndarray view of its memmap: the metadata's per-item reads (~10^5
    strings of a vocabulary) skip np.memmap's Python slicing hooks (same fields and tensors)."""
    from gguf.gguf_reader import GGUFReader  # (the module's class: the package's name for it may be wrapped)

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._data = mapped.view(np.ndarray)

    return Reader(path)


def convert_gguf(path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json, tokenizer files and fp32 safetensors to out_dir."""
    reader = array_reader(path)
    meta = _Meta(reader)
    if meta.arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {meta.arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    tensor_names = {t.name for t in reader.tensors}
    hf_config = _hf_config(meta, reader, tensor_names)
    tok_files = _write_tokenizer(meta, path, out_dir, hf_config)
    _write_weights(reader, meta, hf_config, out_dir)
    gen = {"bos_token_id": hf_config.get("bos_token_id"), "eos_token_id": hf_config.get("eos_token_id")}
    _write_json(os.path.join(out_dir, "config.json"), hf_config)
    _write_json(os.path.join(out_dir, "generation_config.json"), gen)
    st = os.stat(path)
    marker = {
        "source": os.path.abspath(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "version": CACHE_FORMAT_VERSION,
        "tokenizer_files": tok_files,
    }
    _write_json(os.path.join(out_dir, _CACHE_MARKER), marker)  # written last: marks a complete entry


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def _hf_config(meta: _Meta, reader: Any, tensor_names: set[str]) -> dict[str, Any]:
    arch, model_type = _ARCHITECTURES[meta.arch]
    hidden = int(meta.require("embedding_length"))
    n_heads = int(meta.require("attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(embd.shape[-1])  # ggml order: (hidden, vocab)
    eos_ids = [meta.get("tokenizer.ggml.eos_token_id")]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and v not in eos_ids:
            eos_ids.append(v)
    eos_ids = [int(i) for i in eos_ids if i is not None]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", n_heads)),
        "head_dim": int(meta.arch_get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": _f32(meta.require("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, reader, tensor_names, hidden // n_heads),
        "max_position_embeddings": int(meta.arch_get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "torch_dtype": "float32",
    }
    if meta.arch == "gemma3":
        cfg.update(_gemma3_config(meta, cfg))
    return cfg


def _gemma3_config(meta: _Meta, cfg: dict[str, Any]) -> dict[str, Any]:
    n_layers = cfg["num_hidden_layers"]
    pattern = int(meta.arch_get("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN))
    cap = meta.arch_get("final_logit_softcapping")
    # llama.cpp: the 27B (62 layers) scales attention by (hidden / heads) ** -0.5, the others by head_dim
    qpas = cfg["hidden_size"] // cfg["num_attention_heads"] if n_layers == 62 else cfg["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta.require("attention.sliding_window")),
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)],
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": qpas,
        "final_logit_softcapping": None if cap is None else _f32(cap),
        "attn_logit_softcapping": None,
    }


def _rope_scaling(meta: _Meta, reader: Any, tensor_names: set[str], head_dim: int) -> dict[str, Any] | None:
    kind = meta.arch_get("rope.scaling.type")
    if "rope_freqs.weight" in tensor_names:
        return _llama3_scaling_from_factors(meta, reader, head_dim)
    if kind in (None, "none"):
        return None
    out: dict[str, Any] = {"rope_type": kind, "factor": _f32(meta.arch_get("rope.scaling.factor", 1.0))}
    orig = meta.arch_get("rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _llama3_scaling_from_factors(meta: _Meta, reader: Any, head_dim: int) -> dict[str, Any]:
    """Llama 3.1 GGUFs store per-frequency divisors (rope_freqs) instead of rope_scaling.

    We recover the standard llama3 parameters and check they reproduce the stored divisors.
    """
    from specserve.models.layers import llama3_inv_freq

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    stored = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    theta = float(meta.arch_get("rope.freq_base", 10000.0))
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rs = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    ours = base / llama3_inv_freq(base, rs)
    if ours.shape != stored.shape or not torch.allclose(ours, stored, rtol=1e-4):
        raise ValueError("GGUF rope_freqs do not match standard llama3 rope scaling; unsupported model")
    return rs


def _write_weights(reader: Any, meta: _Meta, hf_config: dict[str, Any], out_dir: str) -> None:
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    n_heads = hf_config["num_attention_heads"]
    n_kv = hf_config["num_key_value_heads"]
    permute = meta.arch == "llama"
    norm_offset = 1.0 if meta.arch == "gemma3" else 0.0
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into rope_scaling
        name = hf_tensor_name(t.name, meta.arch)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml lists dims innermost first
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, n_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, n_kv)
        elif norm_offset and name.endswith("norm.weight"):
            w = w - norm_offset
        tensor = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
        if size + tensor.nbytes > _SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})


# -- tokenizer -----------------------------------------------------------------------------------

# llama.cpp's pre-tokenizer names -> the split rule of the original HF tokenizer
_GPT2_STYLE = {"gpt2", "default", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_LLAMA3 = {"llama-bpe", "llama3", "dbrx", "smaug-bpe"}
_QWEN2 = {"qwen2", "stablelm2"}
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _write_tokenizer(meta: _Meta, path: str, out_dir: str, hf_config: dict[str, Any]) -> list[str]:
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
        backend.save(os.path.join(out_dir, "tokenizer.json"))
    elif kind == "llama":  # SentencePiece vocab: let transformers' converter build it
        from transformers import AutoTokenizer
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

        # the class named by the model type where transformers names one: AutoTokenizer would first
        # read the GGUF's config through transformers' slower reader
        model_type = hf_config["model_type"]
        named = model_type if TOKENIZER_MAPPING_NAMES.get(model_type) else None
        hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                               tokenizer_type=named)
        hf_tok.backend_tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    else:
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    def tok_of(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok_of("tokenizer.ggml.bos_token_id"),
        "eos_token": tok_of("tokenizer.ggml.eos_token_id"),
        "pad_token": tok_of("tokenizer.ggml.padding_token_id"),
        "unk_token": tok_of("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config["max_position_embeddings"],
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), cfg)
    return ["tokenizer.json", "tokenizer_config.json"]


def _byte_level_bpe(meta: _Meta, tokens: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))

    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3 or pre in _QWEN2:
        regex = _LLAMA3_RE if pre in _LLAMA3 else _QWEN2_RE
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _QWEN2:
            tok.normalizer = normalizers.NFC()
    else:
        if pre not in _GPT2_STYLE:
            logger.warning("unknown GGUF pre-tokenizer %r: using the GPT-2 split rule", pre)
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == _TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == _TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok

