"""Triton kernels for the RMSNorms (refgdn.norm): the GDN layer's gated output norm and the model's plain one,
forward and backward, one pair of kernels for both (GATE 2: no gate).

    x, g: [..., D]   weight, bias: [D] (or None)  ->  y: [..., D] in x.dtype
    rms_norm_gated:  y = (x / sqrt(mean(x^2) + eps) * w + bias) * act(g)   act(g) = g sigmoid(g) or sigmoid(g)
    rms_norm:        y =  s / sqrt(mean(s^2) + eps) * w + bias             s = x (+ residual), w = weight or 1 + weight

One memory-bound pass each way, a block of BM whole rows (D <= MAX_D, padded to BD = next_pow2(D)) per program,
float32 inside (float64 for float64 inputs), rounded once at the store. Rows are addressed at one stride, or as
(i // N1, i % N1) at two where the leading dims do not merge (_rows), so x and g may be strided views without a copy
(e.g. a [T, HV, V] slice of a fused projection, as the model's z at one value head per key head). Pinned configs,
never autotuned: the forward runs inside decode and verify graphs (DESIGN.md invariant 2).

Backward, per row (r = 1 / sqrt(mean(x^2) + eps), n = x r, p = n w + b the pre-gate value, a = act(g), 1 ungated):

    dp = dy a ;  dg = dy p act'(g) ;  dn = dp w ;  dx = r (dn - n mean(dn n)) ;  dw = sum_rows dp n ;  db = sum_rows dp

r is recomputed from x (nothing but the inputs is saved); dw and db: each block's column sums in float32, summed over
a program's blocks in float64, then over the programs on the host (8 programs per SM, BWD_PROGRAMS_PER_SM).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from refgdn.checks import check_rms_norm_gated_inputs, check_rms_norm_inputs
from refgdn.norm import residual_out_dtype

from .chunk.common import _num_sms
from .launch import LayoutPlans, Relaunch, launch
from .utils import cdiv, eps_split, fp64_eps, next_pow2

MAX_D = 16384          # one row per block at most (16K fp32 values over 8 warps: 64 registers a tensor)
BWD_PROGRAMS_PER_SM = 8    # the backward's programs (each walks row blocks, keeping its dw / db partial sums)
GATES = {"swish": 0, "silu": 0, "sigmoid": 1, None: 2}    # None: rms_norm (no gate; g unread)


@triton.jit
def _sigmoid(z):
    """sigmoid(z) without overflow: exp only of -|z| <= 0."""
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1 / (1 + e), e / (1 + e))


@triton.jit
def _row_ptrs(base, o_m, N1, s0, s1, o_d, SPLIT: tl.constexpr):
    """[BM, BD] pointers, unit column stride, of rows o_m: at o_m * s1 (SPLIT false: the leading dims merge into one
    stride), else at (o_m // N1) * s0 + (o_m % N1) * s1 (o_m int32 there: a 64-bit division costs ~3x more)."""
    if SPLIT:
        o_r = o_m.to(tl.int32)
        return base + ((o_r // N1).to(tl.int64) * s0 + (o_r % N1).to(tl.int64) * s1)[:, None] + o_d[None, :]
    else:
        return base + (o_m * s1)[:, None] + o_d[None, :]


@triton.jit(do_not_specialize=["M"])
def rms_norm_fwd_kernel(x, g, w, b, y, r, r_out, M, N1, s_x0, s_x1, s_g0, s_g1, eps, eps_lo,
                        D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, GATE: tl.constexpr,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, FP64: tl.constexpr,
                        X_SPLIT: tl.constexpr, G_SPLIT: tl.constexpr, UNIT_W: tl.constexpr = False,
                        HAS_R: tl.constexpr = False, STORE_R: tl.constexpr = False):
    """x, g: M rows of D (strided, see _row_ptrs); w, b: [D]; y: [M, D] contiguous.

    y = (x / sqrt(mean(x^2) + eps) * w + b) * act(g)      GATE 0: act(g) = g sigmoid(g); 1: sigmoid(g); 2: 1 (g unread)
    UNIT_W: w is 1 + the weight loaded (the zero-centred weight of refgdn.model's norms). eps + eps_lo: eps as two
    float32 scalars (Triton passes a Python float as float32), summed in float64 by the float64 variant
    (utils.eps_split).
    HAS_R: x <- x + r first (fla's pre-norm residual add; r: [M, D] contiguous), in the compute dtype; STORE_R: that sum
    stored to r_out ([M, D] contiguous, its own dtype).
    """
    i_m = tl.program_id(0)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    mask = (o_m < M)[:, None] & m_d[None, :]
    if FP64:
        cdt = tl.float64
    else:
        cdt = tl.float32
    # every load first (one round trip to memory, not one per operand)
    b_x = tl.load(_row_ptrs(x, o_m, N1, s_x0, s_x1, o_d, X_SPLIT), mask=mask, other=0).to(cdt)
    if HAS_R:
        b_x += tl.load(r + o_m[:, None] * D + o_d[None, :], mask=mask, other=0).to(cdt)
    if GATE != 2:
        b_g = tl.load(_row_ptrs(g, o_m, N1, s_g0, s_g1, o_d, G_SPLIT), mask=mask, other=0).to(cdt)
    if HAS_W:
        b_w = tl.load(w + o_d, mask=m_d, other=0).to(cdt)
        if UNIT_W:
            b_w = 1 + b_w
    if HAS_B:
        b_b = tl.load(b + o_d, mask=m_d, other=0).to(cdt)
    if STORE_R:
        tl.store(r_out + o_m[:, None] * D + o_d[None, :], b_x.to(r_out.dtype.element_ty), mask=mask)
    # padded columns load 0: they add nothing to the sum of squares, and the mean divides by the true D
    b_r = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + fp64_eps(eps, eps_lo, FP64))
    b_y = b_x * b_r[:, None]
    if HAS_W:
        b_y = b_y * b_w[None, :]
    if HAS_B:
        b_y = b_y + b_b[None, :]
    if GATE == 0:
        b_y = b_y * (b_g * _sigmoid(b_g))
    elif GATE == 1:
        b_y = b_y * _sigmoid(b_g)
    tl.store(y + o_m[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "ITERS"])
def rms_norm_bwd_kernel(x, g, w, b, dy, dx, dg, dw_part, db_part, r, dr_out, M, N1, s_x0, s_x1, s_g0, s_g1, eps,
                        eps_lo, ITERS,
                        D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, GATE: tl.constexpr,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, FP64: tl.constexpr,
                        X_SPLIT: tl.constexpr, G_SPLIT: tl.constexpr, STAGES: tl.constexpr = 1,
                        UNIT_W: tl.constexpr = False, HAS_R: tl.constexpr = False, HAS_DR: tl.constexpr = False):
    """Program p walks row blocks p * ITERS .. p * ITERS + ITERS - 1 (BM rows each). dy, dx, dg: [M, D] contiguous
    (GATE 2: no gate, dg unwritten); dw_part, db_part: [programs, D] float64, this program's sums over its rows
    (module docstring). UNIT_W: w = 1 + weight (dw's formula is the same). HAS_R: the norm's input is x + r (r: [M, D]
    contiguous); HAS_DR: dr_out ([M, D] contiguous), the gradient of the stored sum (prenorm), adds to dx, which is
    then the gradient of x and of r alike."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if FP64:
        cdt = tl.float64
    else:
        cdt = tl.float32
    b_w = tl.full([BD], 1, cdt)
    if HAS_W:
        b_w = tl.load(w + o_d, mask=m_d, other=0).to(cdt)
        if UNIT_W:
            b_w = 1 + b_w
    b_b = tl.zeros([BD], cdt)
    if HAS_B:
        b_b = tl.load(b + o_d, mask=m_d, other=0).to(cdt)
    # dw, db: each row block's column sums, accumulated over the program's blocks in float64 (the column sums of many
    # rows are the op's only long reductions: summed this way they are as accurate as autograd's)
    acc_w = tl.zeros([BD], tl.float64)
    acc_b = tl.zeros([BD], tl.float64)
    for i in tl.range(0, ITERS, num_stages=STAGES):
        o_m = ((i_p * ITERS + i) * BM + tl.arange(0, BM)).to(tl.int64)
        mask = (o_m < M)[:, None] & m_d[None, :]
        b_x = tl.load(_row_ptrs(x, o_m, N1, s_x0, s_x1, o_d, X_SPLIT), mask=mask, other=0).to(cdt)
        if HAS_R:
            b_x += tl.load(r + o_m[:, None] * D + o_d[None, :], mask=mask, other=0).to(cdt)
        if GATE != 2:
            b_g = tl.load(_row_ptrs(g, o_m, N1, s_g0, s_g1, o_d, G_SPLIT), mask=mask, other=0).to(cdt)
        b_dy = tl.load(dy + o_m[:, None] * D + o_d[None, :], mask=mask, other=0).to(cdt)
        b_r = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + fp64_eps(eps, eps_lo, FP64))
        b_n = b_x * b_r[:, None]
        if GATE == 2:
            b_dp = b_dy                                   # no gate: dp = dy, no dg
        else:
            b_s = _sigmoid(b_g)
            if GATE == 0:
                b_a = b_g * b_s
                b_da = b_s * (1 + b_g * (1 - b_s))       # d/dg of g sigmoid(g)
            else:
                b_a = b_s
                b_da = b_s * (1 - b_s)
            b_dp = b_dy * b_a                             # masked rows and columns: dy = 0
            b_p = b_n * b_w[None, :] + b_b[None, :]
            tl.store(dg + o_m[:, None] * D + o_d[None, :], (b_dy * b_p * b_da).to(dg.dtype.element_ty), mask=mask)
        b_dn = b_dp * b_w[None, :]
        b_dx = b_r[:, None] * (b_dn - b_n * (tl.sum(b_dn * b_n, axis=1) / D)[:, None])
        if HAS_DR:
            b_dx += tl.load(dr_out + o_m[:, None] * D + o_d[None, :], mask=mask, other=0).to(cdt)
        tl.store(dx + o_m[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=mask)
        if HAS_W:
            acc_w += tl.sum(b_dp * b_n, axis=0).to(tl.float64)
        if HAS_B:
            acc_b += tl.sum(b_dp, axis=0).to(tl.float64)
    if HAS_W:
        tl.store(dw_part + i_p * D + o_d, acc_w, mask=m_d)
    if HAS_B:
        tl.store(db_part + i_p * D + o_d, acc_b, mask=m_d)


# ============================================================================================
# host side
# ============================================================================================

def norm_config(M: int, D: int) -> dict:
    """BM rows of BD = next_pow2(D) per program, ~512 values a block and at least ~16 programs where M allows (a
    decode step's few rows spread over SMs); one warp per 256 values, 1 to 8. H200, Triton 3.6, bf16, D = 128, us
    per call in a CUDA graph (scratch sweeps, 2026-11-27): M = 32: BM 2 / 1 warp 1.68 (fla 1.89-1.98); M = 1024: BM
    4 / 4 warps 2.28-2.30, BM 2 / 2 warps 2.32, the pinned BM 4 / 2 warps 2.37-2.39, BM 32 / 8 warps 3.43 (fla
    2.47-2.53); M = 131072: BM 4 / 2 warps 26.1-26.2, BM 32 / 8 warps 27.2 (fla 27.0-27.1). One variant per power of
    two of M until BM saturates. Pinned (module docstring)."""
    BD = next_pow2(D)
    BM = max(1, min(next_pow2(M) // 16, 512 // BD))
    return dict(BM=BM, BD=BD, num_warps=min(8, max(1, BM * BD // 256)))


def norm_bwd_config(M: int, D: int) -> dict:
    """The backward's blocks: norm_config's BM, one warp per 512 values (its tiles are three: x, g, dy), the row-block
    loop software-pipelined at three stages (STAGES; the same bits as one stage), 8 programs per SM
    (BWD_PROGRAMS_PER_SM). H200, Triton 3.6, bf16, D = 128, M = 131072, forward + backward in a CUDA graph (scratch
    sweeps, 2026-11-27, fla 84.7-84.9 in each): BM 4 / 1 warp / 8 per SM / 3 stages 86.6-86.8 us; 16 per SM 88.4,
    4 stages 94.6, 2 stages 91.2 (16 per SM); BM 2 / 16 per SM / 4 stages 87.7; BM 8 94.8; 2 warps 101.8; one stage
    94.3-96.2 (16 per SM), 64 per SM 104-106; BM 32 / 8 warps / 4 per SM / one stage 114.7. Tried and slower: the
    next row block's loads issued a block ahead by hand, with per-element float64 sums (101.4)."""
    cfg = norm_config(M, D)
    return dict(cfg, num_warps=min(8, max(1, cfg["BM"] * cfg["BD"] // 512)), STAGES=3)


def _rows(t: torch.Tensor) -> Tuple[torch.Tensor, int, int, int, bool]:
    """t: [..., D] -> (t or a contiguous copy, N1, s0, s1, split): row i of the flattened [M, D] sits at
    (i // N1) * s0 + (i % N1) * s1 with unit column stride; split False when every row is at i * s1 (the leading
    dims merge into one stride: the kernels skip the division). A copy only where the leading dims but the last
    do not merge into one stride, or the last dim is strided."""
    D = t.shape[-1]
    if t.dim() == 1:
        return t, 1, 0, D, False
    if D > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    N1 = t.shape[-2]
    try:
        v = t.view(-1, N1, D)                           # [..., N1, D] -> [(...), N1, D]
    except RuntimeError:
        t = t.contiguous()
        v = t.view(-1, N1, D)
    s0, s1 = v.stride(0), v.stride(1)
    split = v.shape[0] > 1 and N1 > 1 and s0 != N1 * s1
    if split and v.shape[0] * N1 >= 2 ** 31:                # (the split rows' index is int32 in _row_ptrs)
        return _rows(t.contiguous())
    return t, N1, s0, (s1 if N1 > 1 or v.shape[0] == 1 else s0), split


def plain_norm_config(M: int, D: int) -> dict:
    """rms_norm's forward blocks: BM = 512 / BD rows (at least one) whatever M, one warp per 256 values. One variant per
    D (and dtypes): refgdn.model's norms run in every step, the MTP head's eager ones of any token count included, so
    their compile keys must not depend on the row count (norm_config's power-of-two classes would add a variant per
    class). M is unused (norm_config's signature)."""
    BD = next_pow2(D)
    BM = max(1, 512 // BD)
    return dict(BM=BM, BD=BD, num_warps=min(8, max(1, BM * BD // 256)))


def _check_limits(D: int) -> None:
    if D > MAX_D:
        raise ValueError(f"x's last dim D must be <= {MAX_D} for fast's RMSNorms (one row per block), got {D}")


def _kw(x, g, weight, bias, activation, unit_offset: bool, M: int, D: int, x_split: bool, g_split: bool, config,
        pinned, residual=None) -> dict:
    return dict(D=D, GATE=GATES[activation], HAS_W=weight is not None, HAS_B=bias is not None,
                FP64=torch.float64 in {t.dtype for t in (x, g, weight, bias, residual) if t is not None},
                X_SPLIT=x_split, G_SPLIT=g_split, UNIT_W=bool(unit_offset), HAS_R=residual is not None,
                **dict(pinned(M, D), **(config or {})))


def _flat(t: Optional[torch.Tensor], M: int, D: int) -> Optional[torch.Tensor]:
    """t [..., D] as [M, D] contiguous (a copy only where it is not); None stays None."""
    return None if t is None else t.reshape(M, D).contiguous()


def _gate_rows(g, x_rows):
    """g's rows as _rows gives them; without a gate (g None) x's, unsplit: the kernels never read them as g."""
    return _rows(g) if g is not None else x_rows[:4] + (False,)


class _FwdPlan:
    """norm_fwd's launch for one call layout (shapes, strides, dtypes, devices, flags, eps), everything but the
    tensors: y's shape / dtype / device, res_out's dtype, the grid, the kernel's integer and float arguments and its
    launcher (fast.launch.Relaunch: from the layout's second launch on, the compiled kernel's launcher is called
    directly). direct: x, g and residual go to the kernel as they are (no copy), so a later call of the same layout
    needs nothing but fresh outputs (:func:`_cached_fwd`)."""
    __slots__ = ("shape", "dtype", "device", "res_dtype", "M", "grid", "scalars", "launch", "direct")


def _fwd_plan(x, g, weight, bias, activation, eps, unit_offset, config, residual, res_dtype, reuse: bool):
    """-> (plan, x2, g2, residual2): the plan of this call and the tensors its launch takes (x2, g2: _rows's, a
    contiguous copy where the rows have no two-stride form; residual2 as [M, D] rows). reuse: keep the compiled
    launcher (the plan will serve later calls)."""
    D = x.shape[-1]
    p = _FwdPlan()
    p.shape, p.dtype, p.device, p.res_dtype = x.shape, x.dtype, x.device, res_dtype
    M = p.M = x.numel() // D
    if M == 0:                                          # nothing to launch (and no rows to view: _rows needs some)
        p.direct, p.launch = False, None
        return p, x, g, residual
    xr = _rows(x)
    x2, N1, sx0, sx1, x_split = xr
    g2, _, sg0, sg1, g_split = _gate_rows(g, xr)        # (g has x's shape: the same N1)
    r2 = _flat(residual, M, D)
    p.direct = x2 is x and (g is None or g2 is g) and (residual is None or residual.is_contiguous())
    kw = _kw(x, g, weight, bias, activation, unit_offset, M, D, x_split, g_split, config,
             norm_config if activation is not None else plain_norm_config, residual)
    kw["STORE_R"] = res_dtype is not None
    p.grid = (cdiv(M, kw["BM"]),)
    p.scalars = (M, N1, sx0, sx1, sg0, sg1, *eps_split(eps))
    p.launch = Relaunch(rms_norm_fwd_kernel, p.grid, kw, reuse)
    return p, x2, g2, r2


def _fwd_run(p: _FwdPlan, x2, g2, weight, bias, r2):
    """The plan's launch on these tensors (as _fwd_plan returned them) -> (y, res_out)."""
    y = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    res_out = torch.empty(p.shape, dtype=p.res_dtype, device=p.device) if p.res_dtype is not None else None
    if p.M:
        p.launch(x2, g2, weight, bias, y, r2, res_out, *p.scalars)
    return y, res_out


def norm_fwd(x, g, weight, bias, activation, eps: float, unit_offset: bool = False, config: Optional[dict] = None,
             residual: Optional[torch.Tensor] = None, res_dtype: Optional[torch.dtype] = None):
    """The forward's launch (inputs checked): -> (y, res_out): y contiguous, x's shape and dtype; res_out the sum x +
    residual (x's shape, contiguous) stored in res_dtype, or None when res_dtype is None. activation None: rms_norm (g
    None, plain_norm_config), else rms_norm_gated (norm_config). config: benchmark overrides of BM / num_warps (each
    value its own variant). residual (x's shape): normalise x + residual."""
    _check_limits(x.shape[-1])
    p, x2, g2, r2 = _fwd_plan(x, g, weight, bias, activation, eps, unit_offset, config, residual, res_dtype, False)
    return _fwd_run(p, x2, g2, weight, bias, r2)


# Eager forwards by call layout (fast.launch.LayoutPlans: the checks and the plan read x, g, weight, bias and residual's
# metadata). The model's norms run ~14 times per decode step with a handful of layouts; a full call (the host checks,
# _rows, the config, Triton's JITFunction.run) cost ~60 us of wall time per [1, 2048] norm on an H200 host, torch's
# own F.rms_norm 11-17 us, the planned call 21-24 (benchmarks/RESULTS.md, 2026-11-28).
_FWD = LayoutPlans()


def _fwd_key(kind: str, x, activation, eps, flags: tuple):
    """The part of a call's layout the guard does not hold: which op, its non-tensor arguments (each with its type:
    the checks reject 1 for True, and an int eps is not a float's variant), x's shape (the guard compares it too,
    but a key per shape keeps q / k norms of one step from evicting each other). None where x is not a tensor."""
    if not isinstance(x, torch.Tensor):
        return None
    return (kind, activation, type(eps), eps, *((type(f), f) for f in flags), x.shape)


def _cached_fwd(key, x, g, weight, bias, residual):
    """(y, res_out) of a call whose layout passed the checks before, launched through its plan; None otherwise (the
    caller checks in full). Calls that want the autograd path (library.wants_graph) are never served here."""
    p = _FWD.get(key, (x, g, weight, bias, residual))
    if p is None:
        return None
    from . import library                                                # (no cycle at import)
    if library.wants_graph(x, g, weight, bias, residual):
        return None
    return _fwd_run(p, x, x if g is None else g, weight, bias, residual)


def _remember_fwd(key, x, g, weight, bias, activation, eps, unit_offset, residual, res_dtype) -> None:
    """After a full call that passed the checks: a plan for its layout (from the layout's second call; LayoutPlans
    keeps it where its launch takes the tensors as they are)."""
    _FWD.remember(key, (x, g, weight, bias, residual),
                  lambda: _fwd_plan(x, g, weight, bias, activation, eps, unit_offset, None, residual, res_dtype,
                                    True)[0])


def norm_bwd(dy, x, g, weight, bias, activation, eps: float, unit_offset: bool = False,
             config: Optional[dict] = None, residual: Optional[torch.Tensor] = None,
             dres_out: Optional[torch.Tensor] = None):
    """-> (dx, dg or None (no gate), dweight or None, dbias or None) in the dtypes of x, g, weight, bias (dx, dg
    contiguous). residual: the forward's (the norm's input was x + residual); dres_out: the gradient of the stored
    sum (prenorm), added to dx. With a residual, dx is also the residual's gradient (in the wider of the two dtypes:
    the caller casts)."""
    D = x.shape[-1]
    _check_limits(D)
    M = x.numel() // D
    dx = torch.empty(x.shape, dtype=x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype),
                     device=x.device)
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device) if g is not None else None
    xr = _rows(x)
    x2, N1, sx0, sx1, x_split = xr
    g2, _, sg0, sg1, g_split = _gate_rows(g, xr)        # (g has x's shape: the same N1)
    config = dict(config or {})
    per_sm = config.pop("programs_per_sm", BWD_PROGRAMS_PER_SM)
    kw = _kw(x, g, weight, bias, activation, unit_offset, M, D, x_split, g_split, config,
             norm_bwd_config, residual)
    kw["HAS_DR"] = dres_out is not None
    blocks = cdiv(M, kw["BM"])
    programs = max(1, min(blocks, per_sm * _num_sms(x.device)))    # dw / db: one partial row per program
    iters = cdiv(blocks, programs)
    programs = cdiv(blocks, iters) if blocks else 1
    f64 = torch.float64
    dw_part = torch.zeros(programs, D, dtype=f64, device=x.device) if weight is not None else None
    db_part = torch.zeros(programs, D, dtype=f64, device=x.device) if bias is not None else None
    if M > 0:
        dy2 = dy.reshape(M, D)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        launch(rms_norm_bwd_kernel, (programs,), kw, x2, g2, weight, bias, dy2, dx, dg if g is not None else dx,
               dw_part, db_part, _flat(residual, M, D), _flat(dres_out, M, D), M, N1, sx0, sx1, sg0, sg1,
               *eps_split(eps), iters)
    dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dg, dw, db


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: Optional[torch.Tensor], bias=None,
                   activation: str = "swish", residual=None, prenorm: bool = False, residual_in_fp32: bool = False,
                   eps: float = 1e-6) -> torch.Tensor:
    """x, g: [..., D]; weight, bias: [D] or None -> y: [..., D] in x.dtype (fla 0.6.0's name and argument order;
    refgdn.rms_norm_gated's twin).

        y = (x / sqrt(mean(x^2) + eps) * weight + bias) * act(g)      act: g sigmoid(g) (swish / silu) or sigmoid(g)

    float32 inside (float64 for float64 inputs), rounded once. Differentiable in x, g, weight and bias (through
    torch.ops.fast.rms_norm_gated when a gradient is wanted or torch.compile traces). D <= 16384.
    """
    key = _fwd_key("gated", x, activation, eps, (prenorm, residual_in_fp32))
    out = _cached_fwd(key, x, g, weight, bias, None) if key is not None and residual is None else None
    if out is not None:                                                  # a known layout: checked before
        return out[0]
    check_rms_norm_gated_inputs(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps)
    from . import library                                                # registers the ops (no cycle at import)
    if library.wants_graph(x, g, weight, bias):
        return library.rms_norm_gated_op(x, g, weight, bias, activation, float(eps))
    y = norm_fwd(x, g, weight, bias, activation, eps)[0]
    _remember_fwd(key, x, g, weight, bias, activation, eps, False, None, None)
    return y


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias=None, residual=None, eps: float = 1e-5,
             prenorm: bool = False, residual_in_fp32: bool = False, *, unit_offset: bool = False):
    """x: [..., D]; weight, bias: [D] or None; residual: [..., D] or None -> y: [..., D] in x.dtype, or (y,
    residual_out) with prenorm (fla 0.6.0's ``fla.modules.layernorm.rms_norm`` name and argument order;
    refgdn.rms_norm's twin, which says what residual_out is).

        s = x + residual;   y = s / sqrt(mean(s^2) + eps) * w + bias        w = weight, or 1 + weight with unit_offset

    One kernel: the residual add, the stored sum (prenorm only) and the norm in one pass (float32 inside, float64
    for float64 inputs, y rounded once). Differentiable in x, weight, bias and residual (through
    torch.ops.fast.rms_norm when a gradient is wanted or torch.compile traces). D <= 16384. One compiled variant per
    D, dtypes and residual flags, whatever the row count (plain_norm_config).
    """
    key = _fwd_key("plain", x, None, eps, (prenorm, residual_in_fp32, unit_offset))
    out = _cached_fwd(key, x, None, weight, bias, residual) if key is not None else None
    if out is not None:                                                  # a known layout: checked before
        y, res_out = out
        rdt = res_out.dtype if res_out is not None else None
    else:
        check_rms_norm_inputs(x, weight, bias, residual, eps, prenorm, residual_in_fp32, unit_offset)
        rdt = residual_out_dtype(x, residual, residual_in_fp32, prenorm)  # the sum is stored for prenorm only
        from . import library                                            # registers the ops (no cycle at import)
        if library.wants_graph(x, weight, bias, residual):
            y, res_out = library.rms_norm_op(x, weight, bias, residual, float(eps), bool(unit_offset), rdt)
        else:
            y, res_out = norm_fwd(x, None, weight, bias, None, eps, unit_offset, residual=residual, res_dtype=rdt)
            _remember_fwd(key, x, None, weight, bias, None, eps, unit_offset, residual, rdt)
    if not prenorm:
        return y
    return y, (res_out if rdt is not None else x)
