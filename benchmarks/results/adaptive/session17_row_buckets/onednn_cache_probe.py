import os, sys, time, resource, torch
torch.set_num_threads(2)
shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
ws = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i)) for o, i in shapes]
xs = {}
def fwd(M):
    for (o, i), w in zip(shapes, ws):
        torch.ops.mkldnn._linear_pointwise(torch.ones(M, i), w, None, "none", [], "")
def t(M, n=1):
    t0 = time.perf_counter()
    for _ in range(n): fwd(M)
    return (time.perf_counter() - t0) / n * 1e3
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with torch.inference_mode():
    for _ in range(5): fwd(4)
    steady = min(t(4) for _ in range(10))
    firsts = [t(M) for M in (37, 38, 39)]
    seconds = [min(t(M) for _ in range(3)) for M in (37, 38, 39)]
    r0 = rss()
    for M in range(40, 40 + int(sys.argv[1])): fwd(M)
    r1 = rss()
    after = t(4)
    after2 = min(t(4) for _ in range(5))
    print(f"cap={os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY','default')}: M=4 steady {steady:.3f} ms; new M first {[round(x,2) for x in firsts]} cached {[round(x,2) for x in seconds]}; "
          f"after {sys.argv[1]} other Ms ({len(shapes)} shapes each): M=4 first {after:.3f} then {after2:.3f}; rss +{r1-r0:.0f} MB")
