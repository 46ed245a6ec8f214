"""Engine command-line flags, shared by `serve`, `generate` and the benchmarks."""

from __future__ import annotations

import argparse
import logging

from specserve.config import DEFAULT_HEAD, KV_CACHE_DTYPES, EngineConfig

log = logging.getLogger(__name__)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="HF directory with tokenizer.json (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' and activations' dtype (auto: bfloat16 on CUDA and on a CPU with bf16 units "
                        "(AVX512-BF16, AMX), else float32)")
    g.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape (benchmarks without a checkpoint)")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's random state (unseeded requests)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step (prompt chunks, decodes and drafts together)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks of every layer (default: sized from --kv-cache-memory-gb on CPU, "
                        "--gpu-memory-utilization on CUDA); with sliding-window layers (Gemma 3) their bytes "
                        "are split per layer type, so the global layers get more blocks")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the KV cache's dtype: auto (the model's) or fp8 (= fp8_e4m3) / fp8_e5m2, stored with "
                        "scale 1.0: half the cache memory; the draft head's cache keeps the head's dtype")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="KV cache size on CPU, in GB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="CUDA: fraction of the GPU's memory for weights, activations and the KV cache")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off (default: on; full blocks of a prompt seen before are reused)")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="turn chunked prefill off (default: on; long prompts are split over steps)")
    g.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="waiting-queue size; requests beyond it are refused (the server answers 503 + Retry-After)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton paged attention on CUDA, torch-native on CPU")
    g.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs (default: graphs on CUDA)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="CUDA graphs for steps of up to this many tokens (default: --max-num-batched-tokens)")
    g.add_argument("--exact-tree-attention", default=None, action=argparse.BooleanOptionalAction,
                   help="Triton: tree verifies compute each token bit for bit as plain decoding will, so greedy "
                        "tree speculation matches plain decoding in bf16 (default: on; off: faster verifies "
                        "whose bf16 roundings may flip near-ties)")
    g.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"],
                   help="plain decoding: schedule and queue step n+1 on the device before step n's tokens are "
                        "read back (auto: on for CUDA)")
    g.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_const", const="off",
                   help="the same as --overlap-schedule off (SGLang's flag)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the target over this many ranks (processes; gloo on CPU, NCCL on GPU); under "
                        "torchrun, its WORLD_SIZE")
    g.add_argument("--no-cpu-weight-packing", dest="cpu_weight_packing", action="store_false",
                   help="CPU: plain F.linear instead of oneDNN-packed weights (default: packed)")
    s = parser.add_argument_group(
        "speculative decoding (named like SGLang's flags)",
        "On by default: the default model speculates with its shipped EAGLE-3 head under the adaptive policy "
        "(drafting depth per batch size, plain decoding where drafting does not pay). Another --model "
        "speculates only with --speculative-algorithm and --speculative-draft-model-path.")
    s.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "EAGLE3", "NONE"],
                   help="EAGLE3 or EAGLE; NONE turns speculation off (default: EAGLE3 with the default model's "
                        "shipped head, none for another model)")
    s.add_argument("--speculative-draft-model-path", default=None,
                   help="the draft head's directory (default: the head shipped for the default model)")
    s.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft steps per verify: the deepest draft (default: a chain's --speculative-num-draft-tokens "
                        "- 1 where given, else 7 for a chain where steps replay CUDA graphs, else 5)")
    s.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="children per tree node; 1 drafts a chain (default: 1)")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tokens per verify, the root included (default: num-steps + 1, a chain)")
    s.add_argument("--speculative-policy", default=None, choices=["static", "threshold", "adaptive"],
                   help="how many tokens each step drafts: static (always num-steps), threshold (off above "
                        "--speculative-disable-batch-threshold requests) or adaptive (measured goodput per "
                        "batch size; default)")
    s.add_argument("--speculative-disable-batch-threshold", type=int, default=None,
                   help="threshold policy: no drafting above this many running requests (default: none)")
    s.add_argument("--speculative-calibrate", default=None, action=argparse.BooleanOptionalAction,
                   help="adaptive policy: time engine steps of every draft depth per batch size at start-up "
                        "(default: on where steps replay CUDA graphs)")
    s.add_argument("--speculative-draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft head's dtype (default: auto, the engine's --dtype)")
    s.add_argument("--speculative-adaptive-config", default=None, metavar="FILE.json",
                   help="adaptive policy: a JSON object of AdaptivePolicyConfig fields to change "
                        "(specserve/config.py; default: none)")
    s.add_argument("--speculative-recalibrate", default=None, action="store_true",
                   help="adaptive policy: profile step costs again instead of reusing the cached profile "
                        "(kept per model, device and settings under SPECSERVE_CACHE_DIR; default: reuse)")


ENGINE_FIELDS = (
    "model", "tokenizer", "dtype", "device", "load_format", "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "block_size", "num_kv_blocks", "kv_cache_dtype", "kv_cache_memory_gb", "gpu_memory_utilization", "enable_prefix_caching",
    "enable_chunked_prefill", "max_waiting_requests", "attention_backend", "enforce_eager",
    "max_cudagraph_capture_size", "exact_tree_attention", "overlap_schedule", "cpu_weight_packing",
    "tensor_parallel_size",
)
SPEC_FIELDS = (
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "speculative_policy", "speculative_disable_batch_threshold",
    "speculative_calibrate", "speculative_draft_dtype", "speculative_adaptive_config", "speculative_recalibrate",
)


def engine_config_from_args(args: argparse.Namespace, default_speculative: bool = True) -> EngineConfig:
    """EngineConfig from parsed flags. ``default_speculative``: the default model without
    --speculative-algorithm speculates with its shipped EAGLE-3 head (when that head is there)."""
    kwargs = {f: getattr(args, f) for f in ENGINE_FIELDS if hasattr(args, f)}
    spec = {f: getattr(args, f, None) for f in SPEC_FIELDS}
    if spec["speculative_algorithm"] == "NONE":
        spec = {}
    elif default_speculative and spec["speculative_algorithm"] is None and kwargs.get("model") is None:
        if (DEFAULT_HEAD / "config.json").exists():
            spec["speculative_algorithm"] = "EAGLE3"
        else:
            log.warning("no speculation: the default model's EAGLE-3 head is missing at %s", DEFAULT_HEAD)
    kwargs.update({k: v for k, v in spec.items() if v is not None})
    return EngineConfig.from_kwargs(**kwargs)
