"""Decode and verify step times of an 8B-shaped Llama on one GPU, against the linear-layers floor.

The model (Llama-3-8B shapes: hidden 4096, 32 layers, 32 heads / 8 KV heads, head_dim 128,
intermediate 14336, vocab 128256) gets random bf16 weights built on the GPU. Every request has
`--context` tokens of (random) KV already cached. Measured in one run:

- decode at batch 1, 16, 64: the target forward through ModelRunner (Triton attention, CUDA graph
  replay, metadata planned every step), the same with the LM head + greedy pick + the one host
  sync of an engine step, and the floor: the same 32 x 4 matmuls alone, also graph-captured;
- the verify cost curve: forward time vs tokens per step (1 .. 2048) for one request and for 16
  requests sharing the tokens, each with its floor;
- the attention kernel alone (batch 64 decode, one layer) as achieved KV bandwidth.

    python benchmarks/gpu_decode.py --out benchmarks/results/gpu_decode.json
    python benchmarks/gpu_decode.py --tiny   # a small model, for a dry run anywhere
    python benchmarks/gpu_decode.py --also-kv-cache-dtype fp8 --out ...   # and decode over 8-bit K/V (scale 1.0)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionMetadata, to_cache_dtype
from specserve.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig
from specserve.engine.runner import ModelRunner, StepInputs
from specserve.loader import dummy_weights
from specserve.models import build_model

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
}
TINY = dict(LLAMA_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def make_inputs(q_lens: list[int], ctx: int, block_size: int, first_block: int, device: torch.device,
                gen: torch.Generator, vocab: int) -> tuple[StepInputs, int]:
    """A step where request b has `ctx` cached tokens and q_lens[b] new ones (blocks shuffled)."""
    seq = [ctx + q for q in q_lens]
    nblk = [-(-s // block_size) for s in seq]
    total = sum(nblk)
    perm = (torch.randperm(total, generator=gen) + first_block).tolist()
    tables, off = [], 0
    for n in nblk:
        tables.append(perm[off : off + n])
        off += n
    width = max(nblk)
    slots = [t[p // block_size] * block_size + p % block_size for t, s, q in zip(tables, seq, q_lens)
             for p in range(s - q, s)]
    T = sum(q_lens)
    meta = AttentionMetadata(
        query_lens=list(q_lens), seq_lens=seq,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device),
    )
    ids = torch.randint(0, vocab, (T,), generator=gen).to(device)
    pos = torch.cat([torch.arange(ctx, ctx + q) for q in q_lens]).to(device)
    spans, start = [], 0
    for q in q_lens:
        spans.append((start, q))
        start += q
    return StepInputs(ids, pos, meta, spans), total


def gpu_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Mean time per call of back-to-back calls (device events; CPU work overlaps the GPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def synced_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median wall time of calls that each end in a host sync (what an engine step sees)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


class LinearFloor:
    """The decoder's matmuls alone (qkv, o, gate_up, down per layer) on the model's own weights."""

    def __init__(self, model: torch.nn.Module, use_graphs: bool) -> None:
        self.weights = [(l.self_attn.qkv_proj.weight, l.self_attn.o_proj.weight, l.mlp.gate_up_proj.weight,
                         l.mlp.down_proj.weight) for l in model.model.layers]
        self.use_graphs = use_graphs
        self.graphs: dict[int, Callable[[], None]] = {}
        self._keep: dict[int, object] = {}  # a graph's input buffers must outlive it

    def _fn(self, T: int) -> Callable[[], None]:
        w0 = self.weights[0]
        dev, dt = w0[0].device, w0[0].dtype
        x = torch.randn(T, w0[0].shape[1], device=dev, dtype=dt)
        a = torch.randn(T, w0[1].shape[1], device=dev, dtype=dt)
        m = torch.randn(T, w0[3].shape[1], device=dev, dtype=dt)

        def run() -> None:
            for wqkv, wo, wgu, wd in self.weights:
                F.linear(x, wqkv)
                F.linear(a, wo)
                F.linear(x, wgu)
                F.linear(m, wd)

        return run

    def get(self, T: int) -> Callable[[], None]:
        if T not in self.graphs:
            run = self._fn(T)
            if self.use_graphs:
                run()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run()
                self.graphs[T] = g.replay
                self._keep[T] = (g, run)
            else:
                self.graphs[T] = run
        return self.graphs[T]


def spread(T: int, B: int) -> list[int]:
    B = min(B, T)
    return [T // B + (1 if i < T % B else 0) for i in range(B)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write results JSON here")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--verify-tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="small model (dry run)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="the engine's --kv-cache-dtype (fp8: half the K/V bytes attention reads)")
    ap.add_argument("--also-kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                    help="after the other sections, decode again (and one layer's attention) with a second runner "
                         "whose cache has this dtype, over the same model, against the floor measured alongside")
    ap.add_argument("--no-unfused", dest="unfused", action="store_false",
                    help="skip the decode A/B with the torch elementwise ops instead of the fused Triton kernels")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    hf = TINY if args.tiny else LLAMA_8B
    mc = ModelConfig.from_hf(hf)
    batches = [int(b) for b in args.batches.split(",")]
    verify = [int(t) for t in args.verify_tokens.split(",")]
    max_tokens = max(verify + batches)
    bs = 16
    it = args.iters

    t0 = time.perf_counter()
    model = build_model(mc, dev, dtype)
    model.load_weights(dummy_weights(mc, dev))
    model.eval()
    build_s = time.perf_counter() - t0

    # KV room for the largest scenario (each step's blocks start at block 0)
    max_req = max(batches + [16])
    need = [b * -(-(args.context + 1) // bs) for b in batches]
    need += [sum(-(-(args.context + q) // bs) for q in spread(T, n)) for n in (1, 16) for T in verify]
    num_blocks = max(need) + 16
    def make_runner(kv_cache_dtype: str) -> ModelRunner:
        cfg = EngineConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max(max_req, 64), block_size=bs,
                           num_kv_blocks=num_blocks, max_model_len=args.context + max_tokens,
                           kv_cache_dtype=kv_cache_dtype)
        r = ModelRunner(model, mc, cfg, num_blocks, dev, dtype)
        for kc, vc in r.kv_caches:  # random context K/V (never time on zeros)
            for c in (kc, vc):
                c.copy_(to_cache_dtype(torch.randn(c.shape, device=dev, dtype=dtype), c.dtype))
        return r

    runner = make_runner(args.kv_cache_dtype)
    t0 = time.perf_counter()
    runner.capture_graphs()
    capture = {"seconds": round(time.perf_counter() - t0, 3)}
    if runner.graphs is not None:
        capture.update(sizes=runner.graphs.sizes, mib=round(runner.graphs.capture_bytes / 2**20, 1))

    floor = LinearFloor(model, use_graphs=cuda)
    lm_head_w = model.lm_head_weight

    def forward_fn(inputs: StepInputs) -> Callable[[], object]:
        return lambda: runner.forward(inputs)

    def step_fn(inputs: StepInputs) -> Callable[[], object]:
        rows = torch.tensor([a + n - 1 for a, n in inputs.sample_spans], device=dev)

        def step() -> object:
            hidden = runner.forward(inputs)
            return model.compute_logits(hidden[rows]).argmax(-1).tolist()  # the one host sync

        return step

    def decode_inputs(B: int) -> StepInputs:
        return make_inputs([1] * B, args.context, bs, 0, dev, gen, mc.vocab_size)[0]

    results: dict = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")},
        "dtype": str(dtype).replace("torch.", ""),
        "context": args.context,
        "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""),
        "attention_backend": runner.backend_name,
        "notes": ("forward_ms: ModelRunner.forward (plan + graph replay), back-to-back steps, device events; "
                  "step_ms: forward + LM head + greedy argmax + host sync, median wall time; floor_ms: the 128 "
                  "decoder matmuls alone (no LM head), graph-captured; KV context is random, blocks shuffled"),
        "model_build_seconds": round(build_s, 2),
        "graph_capture": capture,
        "decode": [],
        "verify_curve": [],
        "errors": [],
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    def section(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # keep what the other sections measured
            import traceback

            traceback.print_exc()
            results["errors"].append({"section": name, "error": repr(e)[:400]})
            if cuda:
                torch.cuda.synchronize()
        save()

    def decode() -> None:
        for B in batches:
            inputs = decode_inputs(B)
            fwd = gpu_time_ms(forward_fn(inputs), it)
            step = synced_time_ms(step_fn(inputs), it)
            fl = gpu_time_ms(floor.get(B), it)
            x = torch.randn(B, mc.hidden_size, device=dev, dtype=dtype)
            lm = gpu_time_ms(lambda: F.linear(x, lm_head_w), it)
            row = {"batch": B, "forward_ms": round(fwd, 3), "step_ms": round(step, 3), "floor_ms": round(fl, 3),
                   "lm_head_ms": round(lm, 3), "forward_over_floor": round(fwd / fl, 3),
                   "step_over_floor_plus_lm_head": round(step / (fl + lm), 3)}
            results["decode"].append(row)
            print(json.dumps(row), flush=True)
            save()
        if runner.graphs is not None:  # eager forward at batch 1, to show what graphs save
            g, runner.graphs = runner.graphs, None
            try:
                results["decode_batch1_eager_forward_ms"] = round(gpu_time_ms(forward_fn(decode_inputs(1)), it), 3)
            finally:
                runner.graphs = g

    def verify_curve() -> None:
        for nreq in (1, 16):
            for T in verify:
                q_lens = spread(T, nreq)
                inputs, _ = make_inputs(q_lens, args.context, bs, 0, dev, gen, mc.vocab_size)
                n_it = max(3, min(it, int(500 / max(T, 1))))
                fwd = gpu_time_ms(forward_fn(inputs), n_it)
                fl = gpu_time_ms(floor.get(T), n_it)
                graphed = runner.graphs is not None and runner.graphs.fits(T)
                row = {"requests": len(q_lens), "tokens": T, "forward_ms": round(fwd, 3), "floor_ms": round(fl, 3),
                       "graph": graphed}
                results["verify_curve"].append(row)
                print(json.dumps(row), flush=True)
                save()

    def attention_layer(key: str = "attention_layer", only_default: bool = False) -> None:
        """KV write + attention of one layer per decode batch, graph-captured (GPU time only); bytes =
        the K and V it must read. On the Triton backend also other launch settings, to tune the default."""
        attn = runner.attn
        H, KVH, D = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        variants: list[tuple[str, dict]] = [("default", {})]
        fresh: dict[str, object] = {}  # variants that size the backend differently get their own
        knobs = ("split_kv", "block_n", "num_warps", "num_stages", "min_split_keys")
        saved = {k: getattr(attn, k, None) for k in knobs}
        if runner.backend_name == "triton" and not only_default:
            variants += [("no_split", {"split_kv": False}), ("block_n=32", {"block_n": 32}),
                         ("block_n=128", {"block_n": 128}), ("warps=8", {"num_warps": 8}),
                         ("stages=3", {"num_stages": 3}), ("no_split,block_n=128,warps=8",
                                                           {"split_kv": False, "block_n": 128, "num_warps": 8}),
                         ("split>=64 keys", {"min_split_keys": 64}),
                         ("split>=64 keys,block_n=32", {"min_split_keys": 64, "block_n": 32})]
            from specserve.attention.triton_backend import TritonBackend

            for mult in (4, 8):
                name = f"{mult}x SMs programs"
                fresh[name] = TritonBackend(
                    attn.kv_caches, attn.block_size, attn.scale, num_heads=attn.num_heads,
                    max_num_tokens=attn.max_num_tokens, max_num_seqs=attn.max_num_seqs,
                    max_blocks_per_seq=attn.max_blocks_per_seq, scratch_slot=attn.scratch_slot,
                    target_programs=mult * torch.cuda.get_device_properties(dev).multi_processor_count)
                variants.append((name, {}))
        results[key] = []
        for B in batches:
            inputs = decode_inputs(B)
            q = torch.randn(B, H, D, device=dev, dtype=dtype)
            k = torch.randn(B, KVH, D, device=dev, dtype=dtype)
            kv_bytes = 2 * B * (args.context + 1) * KVH * D * runner.kv_dtype.itemsize
            for name, over in variants:
                a = fresh.get(name, attn)
                try:
                    for knob, val in over.items():
                        setattr(a, knob, val)
                    a.plan(inputs.meta)
                    if cuda:
                        a.forward(0, q, k, k)  # compile outside the capture
                        torch.cuda.synchronize()
                        a.graph_min_tokens = B
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            a.forward(0, q, k, k)
                        fn: Callable[[], object] = graph.replay
                    else:
                        fn = lambda: a.forward(0, q, k, k)  # noqa: E731
                    us = gpu_time_ms(fn, it * 5) * 1e3
                    row = {"batch": B, "variant": name, "us": round(us, 2), "kv_gb_per_s": round(kv_bytes / us / 1e3, 1),
                           "x_layers_ms": round(us * mc.num_hidden_layers / 1e3, 3)}
                except Exception as e:  # a variant that fails is reported, not fatal
                    row = {"batch": B, "variant": name, "error": repr(e)[:200]}
                finally:
                    if runner.backend_name == "triton":
                        for knob in over:  # fresh backends take no overrides
                            setattr(a, knob, saved[knob])
                        a.graph_min_tokens = 1
                results[key].append(row)
                print(json.dumps(row), flush=True)

    def decode_without_split() -> None:
        """The decode forward again with split-KV off (re-captured graphs), to show what splitting buys."""
        runner.attn.split_kv = False
        try:
            runner.capture_graphs()
            rows = []
            for B in batches:
                rows.append({"batch": B, "forward_ms": round(gpu_time_ms(forward_fn(decode_inputs(B)), it), 3)})
                print(json.dumps(rows[-1]), flush=True)
            results["decode_forward_no_split_kv"] = rows
        finally:
            runner.attn.split_kv = True
            runner.capture_graphs()

    def kernel_profile() -> None:
        """Where a decode step's GPU time goes: the kernels of one eager forward."""
        from torch.profiler import ProfilerActivity, profile

        B = batches[len(batches) // 2]
        inputs = decode_inputs(B)
        g, runner.graphs = runner.graphs, None
        try:
            runner.forward(inputs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.forward(inputs)
                torch.cuda.synchronize()
        finally:
            runner.graphs = g
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0 and e.count > 0:
                rows.append({"kernel": e.key[:90], "count": e.count, "total_us": round(t, 1)})
        rows.sort(key=lambda r: -r["total_us"])
        results["kernel_profile"] = {"batch": B, "eager_forward_kernel_us": round(sum(r["total_us"] for r in rows), 1),
                                     "num_kernels": sum(r["count"] for r in rows), "top": rows[:25]}

    def forward_against_floor(B: int) -> dict:
        """The current runner's decode forward at batch B and the linear-layers floor, measured together."""
        fwd = gpu_time_ms(forward_fn(decode_inputs(B)), it)
        fl = gpu_time_ms(floor.get(B), it)
        return {"batch": B, "forward_ms": round(fwd, 3), "floor_ms": round(fl, 3), "forward_over_floor": round(fwd / fl, 3)}

    def unfused() -> None:
        """Decode again with the torch ops for norm, SiLU*mul, rotary and the cache write (re-captured
        graphs), in this run: what the fused Triton kernels (models/triton_ops.py) save."""
        from specserve.models import layers

        layers.FUSED_OPS = False
        try:
            runner.capture_graphs()
            rows = []
            for B in batches:
                rows.append(forward_against_floor(B))
                print(json.dumps(rows[-1]), flush=True)
            results["decode_unfused"] = rows
        finally:
            layers.FUSED_OPS = True
            runner.capture_graphs()

    def other_kv_dtype() -> None:
        """Decode with a second runner whose K/V cache has --also-kv-cache-dtype (graphs of its own), each
        batch's floor measured alongside; and one layer's attention (default launch) per batch."""
        nonlocal runner
        main_runner = runner
        runner = make_runner(args.also_kv_cache_dtype)
        try:
            runner.capture_graphs()
            rows = []
            for B in batches:
                row = forward_against_floor(B)
                main_fwd = gpu_time_ms(lambda r=main_runner, i=decode_inputs(B): r.forward(i), it)
                rows.append({**row, "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""),
                             "main_forward_ms": round(main_fwd, 3),
                             "main_forward_over_floor": round(main_fwd / row["floor_ms"], 3)})
                print(json.dumps(rows[-1]), flush=True)
            results["decode_other_kv_dtype"] = rows
            attention_layer(key="attention_layer_other_kv_dtype", only_default=True)
        finally:
            runner = main_runner

    section("decode", decode)
    section("verify_curve", verify_curve)
    section("attention_layer", attention_layer)
    if runner.backend_name == "triton" and cuda:
        section("decode_without_split", decode_without_split)
    if cuda:
        section("kernel_profile", kernel_profile)
        if args.unfused:
            section("unfused", unfused)
    if args.also_kv_cache_dtype:
        section("other_kv_dtype", other_kv_dtype)

    print(f"\n{results['device']}, {results['dtype']}, context {args.context}, graphs: {capture}")
    print(f"{'batch':>6} {'forward':>9} {'step':>9} {'floor':>9} {'lm_head':>8} {'fwd/floor':>10} {'step/(floor+lm)':>16}")
    for r in results["decode"]:
        print(f"{r['batch']:>6} {r['forward_ms']:>9.3f} {r['step_ms']:>9.3f} {r['floor_ms']:>9.3f} "
              f"{r['lm_head_ms']:>8.3f} {r['forward_over_floor']:>10.3f} {r['step_over_floor_plus_lm_head']:>16.3f}")
    if "decode_batch1_eager_forward_ms" in results:
        print(f"batch 1 eager forward (no graphs): {results['decode_batch1_eager_forward_ms']} ms")
    print(f"\n{'reqs':>5} {'tokens':>7} {'forward':>9} {'floor':>9} {'ratio':>6} graph")
    for r in results["verify_curve"]:
        print(f"{r['requests']:>5} {r['tokens']:>7} {r['forward_ms']:>9.3f} {r['floor_ms']:>9.3f} "
              f"{r['forward_ms'] / r['floor_ms']:>6.2f} {r['graph']}")
    if "decode_forward_no_split_kv" in results:
        print(f"decode forward without split-KV: {results['decode_forward_no_split_kv']}")
    print(f"\n{'batch':>6} {'attention variant':>30} {'us/layer':>9} {'GB/s':>7} {'x layers ms':>11}")
    for r in results.get("attention_layer", []):
        if "us" in r:
            print(f"{r['batch']:>6} {r['variant']:>30} {r['us']:>9.2f} {r['kv_gb_per_s']:>7.1f} {r['x_layers_ms']:>11.3f}")
    if "kernel_profile" in results:
        kp = results["kernel_profile"]
        print(f"\neager forward at batch {kp['batch']}: {kp['num_kernels']} kernels, "
              f"{kp['eager_forward_kernel_us']:.0f} us of kernel time")
        for r in kp["top"][:15]:
            print(f"  {r['total_us']:>9.1f} us {r['count']:>5}x  {r['kernel']}")
    if "decode_other_kv_dtype" in results:
        print(f"\ndecode with a {args.also_kv_cache_dtype} K/V cache: {json.dumps(results['decode_other_kv_dtype'])}")
        print(f"its attention layer: {json.dumps(results.get('attention_layer_other_kv_dtype'))}")
    if "decode_unfused" in results:
        print(f"\ndecode with the torch elementwise ops (not fused): {json.dumps(results['decode_unfused'])}")
    if results["errors"]:
        print(f"\nERRORS: {json.dumps(results['errors'])}")


if __name__ == "__main__":
    main()
