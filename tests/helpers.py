"""Random inputs for the delta-rule tests (shared by refgdn and fast tests)."""
import torch
import torch.nn.functional as F

GATES = {  # log-decay per token: weak (g near 0) to strong (g near -10)
    "weak": lambda n, gen: -torch.rand(n, generator=gen) * 1e-3,
    "mid": lambda n, gen: -torch.rand(n, generator=gen) * 2.0,
    "strong": lambda n, gen: -10.0 + torch.rand(n, generator=gen) * 0.5,
}


def gdn_inputs(B, T, H, HV, K, V, *, gate="mid", seed=0, dtype=torch.float64, device="cpu", init=False, N=None):
    """q, k, v, g, beta (+ initial_state [N, HV, K, V] if init) with k unit-norm, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = GATES[gate](B * T * HV, gen).reshape(B, T, HV)
    beta = torch.rand(B, T, HV, generator=gen)
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]
    if init:
        out.append((0.5 * torch.randn(N or B, HV, K, V, generator=gen)).to(device=device, dtype=dtype))
    return out


def captured(fn):
    """fn captured in a CUDA graph after one warm-up call on a side stream (compiles and allocates outside the
    capture) -> (graph, what the captured call returned: its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
