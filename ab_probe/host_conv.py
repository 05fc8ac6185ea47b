import cProfile, pstats, time, torch, fast
dev = "cuda"
x = torch.randn(1, 16384, 8192, device=dev).bfloat16().requires_grad_()
w = (torch.randn(8192, 4, device=dev) / 2).bfloat16().requires_grad_()
dy = torch.randn(1, 16384, 8192, device=dev).bfloat16()
xs = torch.randn(1, 64, 8192, device=dev).bfloat16().requires_grad_()
dys = torch.randn(1, 64, 8192, device=dev).bfloat16()
def step(x, dy):
    fast.causal_conv1d(x, w, None, "silu")[0].backward(dy)
    x.grad = None; w.grad = None
for xx, dd, name in ((xs, dys, "T=64 (host-bound)"), (x, dy, "T=16384")):
    for _ in range(5): step(xx, dd)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50): step(xx, dd)
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"{name}: host {1e3*(t1-t)/50:.3f} ms per fwd+bwd (wall incl. sync {1e3*(t2-t)/50:.3f})")
    # forward alone
    t = time.perf_counter()
    for _ in range(50): fast.causal_conv1d(xx.detach(), w.detach(), None, "silu")
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"{name}: host {1e3*(t1-t)/50:.3f} ms per forward without grad")
pr = cProfile.Profile(); pr.enable()
for _ in range(50): step(xs, dys)
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
