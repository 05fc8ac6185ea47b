"""The norms. The GDN layer's gated output norm (rms_norm_gated): fast against fla 0.6.0's rms_norm_gated and
transformers' torch Qwen3NextRMSNormGated, at Qwen3-Next's value heads (HV = 32, V = 128, bf16 activations, a [V]
weight). The model's plain norm (rms_norm with unit_offset, hidden 2048): fast against fla 0.6.0's rms_norm (a plain
weight: the same bytes and work) and the torch formula refgdn.model ran before (transformers' Qwen3NextRMSNorm).

Rows (``python -m benchmarks --only norm``):
  - decode, N requests (N x 32 rows of 128): us per call inside a CUDA graph of 32 calls on 32 separate inputs
    (bench_graphs.per_layer_us: how a layer's norm costs inside a model's decode graph; launch overhead excluded);
  - prefill, T = 4096 tokens (131072 rows), forward, and forward + backward: do_bench medians, GB/s from

        bytes = (read x + read z + write y) = 3 M D b                    (forward)
              + (read x, z, dy + write dx, dz) = 5 M D b                 (backward)      b = 2 bytes (bf16)

    and the fraction of the copy bandwidth measured in this process; the plain norm's rows the same at hidden 2048
    (decode N rows; prefill T = 4096 rows; bytes 2 M D b forward, 3 M D b more backward).
"""
from __future__ import annotations

import functools

import torch

from . import common
from .bench_graphs import per_layer_us

TITLE = "Norms: fast vs fla vs torch (rms_norm_gated, rms_norm)"
HV, V = 32, 128
EPS = 1e-6


def hf_torch(x, z, w, eps=EPS):
    """transformers' Qwen3NextRMSNormGated.forward, as a function (its torch path, 16-bit rounding included)."""
    dt = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = w * y.to(dt)
    return (y * torch.nn.functional.silu(z.float())).to(dt)


def _impls():
    import fast
    out = {"fast": lambda x, z, w: fast.rms_norm_gated(x, z, w, None, "swish", eps=EPS),
           "transformers torch": hf_torch}
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated as fla_norm
        out["fla"] = lambda x, z, w: fla_norm(x, z, w, None, "swish", eps=EPS)
    except Exception:  # noqa: BLE001 - fla not installed: its rows are left out
        pass
    return out


def _inputs(M, dtype=torch.bfloat16, seed=0, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, V, generator=gen, device="cuda", dtype=dtype).requires_grad_(grad)
    z = torch.randn(M, V, generator=gen, device="cuda", dtype=dtype).requires_grad_(grad)
    w = (1 + 0.1 * torch.randn(V, generator=gen, device="cuda", dtype=dtype)).requires_grad_(grad)
    return x, z, w


def run() -> list:
    if not common.gpu_available():
        return []
    impls = _impls()
    ceiling = common.copy_bandwidth_gbs()
    rows = []
    for N in (1, 32):
        for name, fn in impls.items():
            # us per call in one CUDA graph of bench_graphs.LAYERS calls, each on its own inputs (a layer in a model)
            rows.append(dict(what=f"decode N={N} ({N * HV} rows x {V})", impl=name, mode="graph, per call",
                             us=per_layer_us(lambda i: functools.partial(fn, *_inputs(N * HV, seed=i)))))
    M = 4096 * HV
    x, z, w = _inputs(M)
    xg, zg, wg = _inputs(M, grad=True)
    dy = torch.randn_like(x)
    fwd_bytes, bwd_bytes = 3 * M * V * x.element_size(), 5 * M * V * x.element_size()
    for name, fn in impls.items():
        fn(x, z, w)
        ms = common.bench(lambda: fn(x, z, w))
        gbs = fwd_bytes / (ms * 1e-3) / 1e9
        rows.append(dict(what=f"prefill T=4096 ({M} rows x {V})", impl=name, mode="forward", us=ms * 1e3,
                         GBs=gbs, of_copy=gbs / ceiling))

        def fb():
            xg.grad = zg.grad = wg.grad = None
            fn(xg, zg, wg).backward(dy)
        fb()
        ms = common.bench(fb)
        gbs = (fwd_bytes + bwd_bytes) / (ms * 1e-3) / 1e9
        rows.append(dict(what=f"prefill T=4096 ({M} rows x {V})", impl=name, mode="forward + backward",
                         us=ms * 1e3, GBs=gbs, of_copy=gbs / ceiling))
    return rows + plain_rows(ceiling)


HIDDEN = 2048


def torch_plain(x, w, eps=EPS):
    """The zero-centred RMSNorm as torch ops (transformers' Qwen3NextRMSNorm; refgdn.model's before it took the ops
    namespace's rms_norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def _plain_impls():
    import fast
    out = {"fast": lambda x, w: fast.rms_norm(x, w, None, None, EPS, unit_offset=True), "torch ops": torch_plain}
    try:
        from fla.modules.layernorm import rms_norm as fla_rms_norm
        out["fla (plain weight)"] = lambda x, w: fla_rms_norm(x, w, None, eps=EPS)
    except Exception:  # noqa: BLE001 - fla not installed: its rows are left out
        pass
    return out


def plain_rows(ceiling: float) -> list:
    """The model's plain norm at hidden 2048 (module docstring)."""
    rows = []
    impls = _plain_impls()

    def inputs(M, seed=0, grad=False):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(M, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
        w = (0.1 * torch.randn(HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)).requires_grad_(grad)
        return x, w
    for N in (1, 32):
        for name, fn in impls.items():
            rows.append(dict(what=f"plain norm, decode N={N} ({N} rows x {HIDDEN})", impl=name, mode="graph, per call",
                             us=per_layer_us(lambda i: functools.partial(fn, *inputs(N, seed=i)))))
    M = 4096
    x, w = inputs(M)
    xg, wg = inputs(M, grad=True)
    dy = torch.randn_like(x)
    fwd_bytes, bwd_bytes = 2 * M * HIDDEN * x.element_size(), 3 * M * HIDDEN * x.element_size()
    for name, fn in impls.items():
        fn(x, w)
        ms = common.bench(lambda: fn(x, w))
        gbs = fwd_bytes / (ms * 1e-3) / 1e9
        rows.append(dict(what=f"plain norm, prefill T=4096 ({M} rows x {HIDDEN})", impl=name, mode="forward",
                         us=ms * 1e3, GBs=gbs, of_copy=gbs / ceiling))

        def fb():
            xg.grad = wg.grad = None
            fn(xg, wg).backward(dy)
        fb()
        ms = common.bench(fb)
        gbs = (fwd_bytes + bwd_bytes) / (ms * 1e-3) / 1e9
        rows.append(dict(what=f"plain norm, prefill T=4096 ({M} rows x {HIDDEN})", impl=name,
                         mode="forward + backward", us=ms * 1e3, GBs=gbs, of_copy=gbs / ceiling))
    return rows


META = {"shape": f"rows of V={V} (HV={HV} value heads per token), bf16 x, z and weight, eps {EPS}; plain norm: rows "
                 f"of {HIDDEN}, bf16 x and weight",
        "bytes": "forward 3 M V b (x, z read, y written); backward 5 M V b more (x, z, dy read, dx, dz written)"}


if __name__ == "__main__":
    rows = run()
    print(common.format_table(rows))
    if rows:
        meta = dict(META, ceiling_copy_GBs=common.copy_bandwidth_gbs())
        common.append_results(TITLE, rows, meta)
