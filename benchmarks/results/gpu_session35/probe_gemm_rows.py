# Session 35 probe 1: does a bf16 GEMM row come out bitwise the same at M tokens as at one token?
# (a tree verify runs 32 tokens through the target where no-spec decoding runs one)
import torch, time
torch.manual_seed(0)
dev = "cuda"
shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
Ms = [1, 2, 4, 5, 8, 12, 16, 24, 32, 48, 64]
for rr in (True, False):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = rr
    print(f"allow_bf16_reduced_precision_reduction={rr}")
    for name, (k, n) in shapes.items():
        w = (torch.randn(n, k, device=dev) / k**0.5).bfloat16()
        x = torch.randn(64, k, device=dev).bfloat16()
        one = torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(64)])
        row = []
        for M in Ms:
            y = torch.nn.functional.linear(x[:M], w)
            row.append(f"{M}:{(y != one[:M]).float().mean().item():.4f}")
        # every row as its own batch entry (M = 1 each) against the weight broadcast
        yb = torch.bmm(x[:32].unsqueeze(1), w.t().unsqueeze(0).expand(32, k, n)).squeeze(1)
        print(f"  {name:8s} differing fraction vs M=1: " + " ".join(row) + f" | bmm32 {(yb != one[:32]).float().mean().item():.4f}")
# timings (graph-free, back to back) of M=1, M=32 linear and the bmm form, gate_up shape
k, n = 576, 3072
w = (torch.randn(n, k, device=dev) / k**0.5).bfloat16(); x = torch.randn(32, k, device=dev).bfloat16()
for label, fn in (("M1", lambda: torch.nn.functional.linear(x[:1], w)), ("M32", lambda: torch.nn.functional.linear(x, w)),
                  ("bmm32", lambda: torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(32, k, n)))):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(2000): fn()
    torch.cuda.synchronize(); print(label, f"{(time.perf_counter() - t) / 2000 * 1e6:.1f} us")
