import time, torch, fast
from fast import conv as C, conv_bwd as CB, library as L
dev = "cuda"
T, D = 64, 8192
x = torch.randn(1, T, D, device=dev).bfloat16().requires_grad_()
w = (torch.randn(D, 4, device=dev) / 2).bfloat16().requires_grad_()
dy = torch.randn(1, T, D, device=dev).bfloat16()
xd, wd = x.detach(), w.detach()
def per_call(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize(); best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - t) / n)
    torch.cuda.synchronize()
    return best * 1e6
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        y, _ = C.causal_conv1d_with_config(x, w, None, "silu", None, True, None)
        ctx.save_for_backward(x, w)
        return y
    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw, _, _ = CB.causal_conv1d_bwd(x, w, dy, None, "silu", None, None, None)
        return dx, dw
def clear():
    x.grad = None; w.grad = None
rows = {
 "forward impl (causal_conv1d_with_config, final state)": lambda: C.causal_conv1d_with_config(xd, wd, None, "silu", None, True, None),
 "forward custom op, no grad (torch.ops.fast.causal_conv1d)": lambda: L.causal_conv1d_op(xd, wd, None, "silu", None, None),
 "backward impl (conv_bwd.causal_conv1d_bwd)": lambda: CB.causal_conv1d_bwd(xd, wd, dy, None, "silu", None, None, None),
 "backward custom op (torch.ops.fast.causal_conv1d_bwd)": lambda: L.causal_conv1d_bwd_op(dy, None, xd, wd, None, "silu", None, None),
 "fwd+bwd, custom op autograd (fast.causal_conv1d)": lambda: (fast.causal_conv1d(x, w, None, "silu")[0].backward(dy), clear()),
 "fwd+bwd, autograd.Function over the impls": lambda: (F.apply(x, w).backward(dy), clear()),
 "one torch op (torch.empty_like + zero_)": lambda: torch.empty_like(dy).zero_(),
}
for k, f in rows.items():
    print(f"{per_call(f):8.1f} us  {k}", flush=True)
