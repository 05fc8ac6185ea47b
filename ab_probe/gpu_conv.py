import torch
from fast import conv_bwd as fcb
torch.manual_seed(0)
dev = "cuda"
for (B, T, D, cu) in ((1, 16384, 8192, None), (1, 30673, 8192, "mix"), (2, 4099, 1000, None)):
    if cu == "mix":
        lens = [1, 3, 4096, 17, 2048, 4000, 7, 4096, 1000, 333, 4096, 2500, 64, 65, 4096, 4189]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
        T = int(cu[-1]); N = len(lens)
    else:
        N = B
    x = torch.randn(B, T, D, device=dev).bfloat16(); w = (torch.randn(D, 4, device=dev) / 2).bfloat16()
    dy = torch.randn(B, T, D, device=dev).bfloat16(); b = torch.randn(D, device=dev).bfloat16()
    s0 = torch.randn(N, D, 3, device=dev).bfloat16(); df = torch.randn(N, D, 3, device=dev).bfloat16()
    a = fcb.causal_conv1d_bwd(x, w, dy, b, "silu", s0, cu, df, configs={"kernel": "window"})
    c = fcb.causal_conv1d_bwd(x, w, dy, b, "silu", s0, cu, df, configs={"kernel": "two_pass"})
    out = []
    for n, ga, gc in zip(("dx", "dw", "db", "dinit"), a, c):
        eq = torch.equal(ga, gc)
        out.append(f"{n} {'bit-equal' if eq else 'max|diff| %.3g (|ref| %.3g)' % ((ga.float()-gc.float()).abs().max(), gc.float().abs().max())}")
    print(f"B={B} T={T} D={D} varlen={cu is not None}:", "; ".join(out), flush=True)
