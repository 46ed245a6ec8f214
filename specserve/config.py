"""Configuration dataclasses. Each validates itself on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a decoder-only transformer, read from an HF config.json dict."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hidden_act: str = "silu"
    # Gemma 3: per-layer "sliding_attention" | "full_attention"; sliding layers attend to the last
    # `sliding_window` positions (their own included) with RoPE base `rope_local_theta`
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # None: head_dim (attention scale = this ** -0.5)
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            if bad:
                raise ValueError(f"unsupported layer_types {bad}: expected sliding_attention or full_attention")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}")

    def layer_window(self, layer: int) -> int | None:
        """How many positions (its own included) a token sees in this layer; None: all before it."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch.startswith("Qwen2")),
            qk_norm=arch.startswith("Qwen3"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            hidden_act=d.get("hidden_act") or d.get("hidden_activation") or "silu",
            layer_types=tuple(d["layer_types"]) if d.get("layer_types") else None,
            sliding_window=d.get("sliding_window") if d.get("layer_types") else None,
            rope_local_theta=d.get("rope_local_base_freq"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
        )


@dataclass(frozen=True)
class AdaptivePolicyConfig:
    """The adaptive policy's tunables (controller + goodput table); docs/decisions.md says why each default."""

    prefill_share_limit: float = 0.25  # a cycle whose prompt tokens take more of its time is charged, not measured
    decay: float = 0.995  # per cycle measured in a bucket (~200 cycles of memory)
    default_cv: float = 0.3  # spread of an arm's goodput per cycle: its standard error is this / sqrt(cycles + 1)
    z: float = 1.5  # standard errors of optimism when exploring
    margin: float = 0.02  # a better arm must beat the pick by this fraction to replace it (or be explored)
    explore_every: int = 16  # decisions per exploration turn in a bucket (0: never explore)
    warm_visits: int = 32  # a bucket's first decisions ...
    warm_every: int = 4  # ... may explore this often
    min_cycles: float = 0.3  # decayed cycles plain decoding keeps in a bucket (else it is explored first)
    pick_cycles: float = 0.3  # served decayed cycles an arm needs in a bucket, past its warm-up, to be picked
    explore_budget: float = 0.01  # share of a bucket's time explorations may lose ...
    budget_decay: float = 0.999  # ... over this memory per cycle (~1,000 cycles)
    cap_cycles: float = 4.0  # plain decoding's own cycles before its time per request bounds the drafting arms'
    clip: float = 3.0  # a cycle counts at most this x the arm's estimated seconds

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = int if f.type in ("int", int) else float
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
                raise ValueError(f"adaptive policy: {f.name} must be {want.__name__}, got {v!r}")
            if v < 0 or v != v:
                raise ValueError(f"adaptive policy: {f.name} must be >= 0, got {v!r}")
        for name in ("decay", "budget_decay"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"adaptive policy: {name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("warm_every",):
            if getattr(self, name) < 1:
                raise ValueError(f"adaptive policy: {name} must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AdaptivePolicyConfig":
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"adaptive policy: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(f.name for f in dataclasses.fields(cls))}")
        return cls(**d)

    @classmethod
    def from_json_file(cls, path: str) -> "AdaptivePolicyConfig":
        import json

        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--speculative-adaptive-config {path}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"--speculative-adaptive-config {path}: want a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"--speculative-adaptive-config {path}: {e}") from None


SpecAlgorithm = Literal["EAGLE", "EAGLE3"]
SpecPolicy = Literal["static", "threshold", "adaptive"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """EAGLE drafting settings, named like SGLang's --speculative-* flags."""

    algorithm: SpecAlgorithm = "EAGLE3"
    draft_model_path: str | None = None
    # draft depth (the adaptive policy's cap); None: a chain's num_draft_tokens - 1, else 7 for a chain
    # where steps replay CUDA graphs (deep drafts cost the graphs little), else 5 (LLMEngine resolves it)
    num_steps: int | None = None
    eagle_topk: int = 1
    num_draft_tokens: int | None = None  # None: steps + 1 for a chain
    policy: SpecPolicy = "adaptive"
    disable_batch_threshold: int | None = None
    # adaptive: time engine steps of every depth on scratch requests at start-up, per batch size
    # (None: where steps replay CUDA graphs, whose host time the forward profile cannot see)
    calibrate: bool | None = None
    # the head's own dtype ("auto": the engine's). The head is small: in float32 under a bfloat16
    # target it costs little more per draft step and keeps its logits from bf16 rounding
    draft_dtype: str = "auto"
    adaptive: AdaptivePolicyConfig = field(default_factory=AdaptivePolicyConfig)  # the adaptive policy's tunables
    recalibrate: bool = False  # profile step costs again even where a cached profile exists

    def __post_init__(self) -> None:
        if isinstance(self.adaptive, str):  # a JSON file (--speculative-adaptive-config)
            object.__setattr__(self, "adaptive", AdaptivePolicyConfig.from_json_file(self.adaptive))
        elif isinstance(self.adaptive, dict):
            object.__setattr__(self, "adaptive", AdaptivePolicyConfig.from_dict(self.adaptive))
        elif not isinstance(self.adaptive, AdaptivePolicyConfig):
            raise ValueError(f"speculative_adaptive_config must be a JSON file or AdaptivePolicyConfig, got {self.adaptive!r}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"speculative_draft_dtype must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.algorithm not in ("EAGLE", "EAGLE3"):
            raise ValueError(f"speculative_algorithm must be EAGLE or EAGLE3, got {self.algorithm!r}")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {self.eagle_topk}")
        if self.policy not in ("static", "threshold", "adaptive"):
            raise ValueError(f"speculative_policy must be static, threshold or adaptive, got {self.policy!r}")
        if self.policy == "threshold" and self.disable_batch_threshold is None:
            raise ValueError("speculative_policy=threshold needs speculative_disable_batch_threshold")
        if self.num_steps is None:
            return  # checked once resolved
        n = self.resolved_num_draft_tokens
        if self.eagle_topk == 1 and n != self.num_steps + 1:
            raise ValueError(
                f"with speculative_eagle_topk=1 (a chain), speculative_num_draft_tokens must be "
                f"num_steps + 1 = {self.num_steps + 1}, got {n}"
            )
        # root + topk children at step 1 + topk*topk candidates at each later step
        max_nodes = 1 + self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        if n > 64:
            raise ValueError(f"speculative_num_draft_tokens={n} exceeds 64 (the tree mask is one 64-bit word per token)")
        if n < 2 or n > max_nodes:
            raise ValueError(f"speculative_num_draft_tokens={n} must be in [2, {max_nodes}] for these steps/topk")

    def resolved(self, graphs: bool) -> "SpeculativeConfig":
        """With num_steps set: a chain's num_draft_tokens - 1 where given, else 7 for a chain whose steps
        replay CUDA graphs (``graphs``), else 5."""
        if self.num_steps is not None:
            return self
        if self.eagle_topk == 1:
            steps = self.num_draft_tokens - 1 if self.num_draft_tokens is not None else 7 if graphs else 5
        else:
            steps = 5
        return dataclasses.replace(self, num_steps=steps)

    @property
    def resolved_num_draft_tokens(self) -> int:
        assert self.num_steps is not None, "SpeculativeConfig.resolved() first"
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    @property
    def is_chain(self) -> bool:
        return self.eagle_topk == 1


DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-eagle3"  # shipped for the default model


def default_draft_path() -> str:
    if not (DEFAULT_HEAD / "config.json").exists():
        raise FileNotFoundError(f"no draft head given and the default head is missing at {DEFAULT_HEAD}; "
                                "pass --speculative-draft-model-path")
    return str(DEFAULT_HEAD)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; field names match the CLI flags (dashes -> underscores)."""

    model: str | None = None  # GGUF file or HF model directory; None = default model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on a CPU with bf16 units (AVX512-BF16, AMX), else float32
    device: str = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb / gpu_memory_utilization
    kv_cache_memory_gb: float = 2.0  # CPU KV budget
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 4096
    speculative: SpeculativeConfig | None = None
    attention_backend: Literal["auto", "torch", "triton"] = "auto"  # auto: triton on CUDA, torch on CPU
    enforce_eager: bool = False  # True: no CUDA graphs
    # CUDA graphs for steps of up to this many tokens (larger steps run eagerly); None: the whole
    # step budget (max_num_batched_tokens). The drafter raises it to cover every verify it may ask for
    max_cudagraph_capture_size: int | None = None
    # Triton: each tree token attends as plain decoding of its committed path will, bit for bit, so greedy
    # tree speculation is lossless in bf16 too (slower verifies). None: on
    exact_tree_attention: bool | None = None
    cpu_weight_packing: bool = True  # CPU: linear weights pre-packed for oneDNN (flat cost in tokens per step)
    # the target's KV cache: "auto" (the model's dtype) or 8-bit floats ("fp8" = "fp8_e4m3", "fp8_e5m2"),
    # stored with scale 1.0 and saturated at the format's largest value, as vLLM does without
    # calibrated scales: half the memory and half the bytes attention reads per key
    kv_cache_dtype: str = "auto"
    # overlap scheduling of plain decoding: step n + 1 is scheduled and queued on the device before step
    # n's tokens are read back (the next step's inputs read them there), so the host's scheduling,
    # commit and detokenizing run while the device computes; with speculation, the plain steps whose
    # successor is known before the sync to be plain (the policy's quick decisions; drafting steps
    # launch their next verify early in the drafter). "auto": on for CUDA; "on" also on the CPU, where
    # a forward returns when done and nothing overlaps (tests)
    overlap_schedule: Literal["auto", "on", "off"] = "auto"
    # ranks the target is split over (one process each; distributed/): heads, MLP columns and vocabulary
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {self.max_cudagraph_capture_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @property
    def graph_token_limit(self) -> int:
        """The largest step (in tokens) that replays a CUDA graph."""
        return min(self.max_cudagraph_capture_size or self.max_num_batched_tokens, self.max_num_batched_tokens)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat engine args (like vLLM's), folding speculative_* into SpeculativeConfig."""
        spec_map = {
            "speculative_algorithm": "algorithm",
            "speculative_draft_model_path": "draft_model_path",
            "speculative_num_steps": "num_steps",
            "speculative_eagle_topk": "eagle_topk",
            "speculative_num_draft_tokens": "num_draft_tokens",
            "speculative_policy": "policy",
            "speculative_disable_batch_threshold": "disable_batch_threshold",
            "speculative_calibrate": "calibrate",
            "speculative_draft_dtype": "draft_dtype",
            "speculative_adaptive_config": "adaptive",
            "speculative_recalibrate": "recalibrate",
        }
        spec_kwargs = {spec_map[k]: v for k in list(kwargs) if k in spec_map and (v := kwargs.pop(k)) is not None}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        if spec_kwargs and "speculative" not in kwargs:
            if "algorithm" not in spec_kwargs and "draft_model_path" not in spec_kwargs:
                raise ValueError("speculative_* arguments given without speculative_algorithm")
            kwargs["speculative"] = SpeculativeConfig(**spec_kwargs)
        return cls(**kwargs)


def replace(cfg: Any, **changes: Any) -> Any:
    return dataclasses.replace(cfg, **changes)


__all__ = ["ModelConfig", "AdaptivePolicyConfig", "SpeculativeConfig", "EngineConfig", "replace", "field"]
