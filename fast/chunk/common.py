"""Shared pieces of fast.chunk's kernels: constants, the tl.dot precision tables, the jit helpers
that several kernels (and fast.chunk_bwd's) call, and the host helpers of every launcher.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   G, Gl: [B, T, HV] fp32
    G_i - G_j = (G_i - G_j) + (Gl_i - Gl_j)        (``_gdiff``: the compensated decay exponent, PRECISE)

Jit helpers: ``_chunk_coords`` (global chunk index -> batch row, chunk, bos, eos), ``_chunk_rows`` (and the
chunk's rows, their mask and flat (token, head) index, for the chunk-parallel kernels), ``_seq_head`` (a
sequential pass's program -> sequence, head; varlen: longest first), ``_exp`` (tl.exp, or
range-reduced for fp32 inputs), ``_gate`` (fused gating), ``_beta_of`` / ``_load_beta`` (beta, or its logits'
sigmoid), ``_l2norm_rows``, ``_dot`` / ``_trunc_tf32`` (tl.dot with the interpreter's fp32 cast), ``_operand`` (a dot
operand rounded to the tiles' dtype, or kept fp32 for a split dot), ``_gdiff``.
Host helpers: ``_num_sms``, ``_warp_mma`` / ``_small_smem`` (configs by GPU generation), ``_blocks`` (padded head
dims), ``_cfg`` (pinned config + benchmark overrides), ``_unit_last``, ``_contig``, ``_fp32_prec``, ``_precise``,
``_is_fp64``, ``_check_fast_limits`` and ``_Chunks`` (dense / varlen chunk bookkeeping).
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..utils import cdiv, next_pow2, varlen_chunk_tables


SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
MAX_HEAD_DIM = 256
CHUNK_SIZES = (16, 32, 64)
# tl.dot input precisions (constexprs, so each value is its own compiled variant):
#   FP32_PRECISION: dots on fp32 inputs. "ieee" is exact fp32 FMA (slow, spills on sm90: fp32 inputs are
#     not the fast path); "tf32x3" would use tensor cores at ~fp32 accuracy.
#   INV_PRECISION: the 16x16 fp32 products of the triangular inverse's off-diagonal blocks, per input
#     dtype. A is stored in the input dtype before w = A (beta exp(G) K), so TF32 products (relative
#     rounding 2^-11) are far below bf16's (2^-9); fp16 rounds like TF32, so it gets tf32x3 (~fp32);
#     fp32 gets exact IEEE.
FP32_PRECISION = "ieee"
INV_PRECISION = MappingProxyType({torch.bfloat16: "tf32", torch.float16: "tf32x3", torch.float32: "ieee"})
#   INV_DIAG_PRECISION: the products of the diagonal blocks' doubling (inv_method "doubling"): their 4 levels
#     compound the products' rounding. bf16: tf32, the same setting as INV_PRECISION's (A is stored in bf16, whose
#     rounding, 2^-9, is above four tf32 roundings of 2^-11). fp16 rounds like tf32, so it gets tf32x3 (~fp32).
INV_DIAG_PRECISION = MappingProxyType({torch.bfloat16: "tf32", torch.float16: "tf32x3", torch.float32: "ieee"})
# The 16x16 diagonal blocks of (I + L)^-1: "rows" (forward substitution, 15 dependent steps of masked reductions,
# exact fp32) or "doubling" (4 levels of two 16x16 dots at INV_DIAG_PRECISION), chosen by the launchers' inv_method
# argument. Default (fast.chunk.wy._inv_rows): doubling for bf16 on a GPU and in the interpreter (4x cheaper
# there), rows for fp16 and fp32 on a GPU, where doubling's tf32x3 / IEEE products cost more than the rows' 15 steps.
# Kernel 1 alone and the whole forward (H200, Triton 3.6, bf16, Qwen3-Next shape, l2norm in the kernel, ms;
# benchmarks.bench_prefill.inverse_sweep, 2026-11-26): B=4 T=4096 rows 0.156 / 0.646, doubling with tf32 products
# 0.119 / 0.610, with tf32x3 0.315 / 0.804; B=1 T=65536 0.906 / 3.117, 0.684 / 2.966, 1.699 / 3.575; the 16-sequence
# varlen mix 0.314 / 1.495, 0.222 / 1.325, 0.617 / 2.017. The forward's error against the float64 truth (max
# relative, mean of 3 seeds), rows vs tf32 doubling: B=4 T=4096 o 5.668e-3 both, final state 3.614e-3 / 3.616e-3;
# varlen o 6.274e-3 both, state 3.940e-3 / 3.871e-3. Both are direct (no series, no approximation); the tests run both.
# Per-kernel config overrides (the launchers' ``configs`` argument, for benchmark sweeps) are merged over
# the pinned heuristics: {"kkt": {...}, "w_u": {...}, "state": {...}, "output": {...}} with keys
# BV, num_warps, num_stages (BV for "state", "output"; for "kkt" also HPP and INV_DIAG_PREC, the doubling's
# product precision). Each distinct config is its own compiled variant.


# ============================================================================================
# shared jit helpers
# ============================================================================================

@triton.jit
def _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN: tl.constexpr):
    """Global chunk index -> (batch row i_b [int64], chunk index within its sequence, bos, eos).

    Tokens of the chunk are rows bos + i_t * BT + r (r < BT) of batch row i_b, valid while < eos.
    Dense: chunk i_c = i_b * NT + i_t, bos = 0, eos = T. Varlen (B == 1): chunk_indices [NT_total, 2].
    """
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        i_b = i_n * 0
    else:
        i_b = (i_c // NT).to(tl.int64)
        i_t = i_c % NT
        bos = 0
        eos = T
    return i_b, i_t, bos, eos


@triton.jit
def _chunk_rows(i_c, i_h, cu_seqlens, chunk_indices, T, NT, HV: tl.constexpr, BT: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    """Chunk i_c's token rows for value head i_h: (i_b, i_t, bos, eos as _chunk_coords's; rows [BT]; m_r [BT],
    the row lies inside its sequence; tok [BT] int64, the flat (token, value head) index of [B, T, HV, ...])."""
    i_b, i_t, bos, eos = _chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_r = rows < eos
    tok = (i_b * T + rows).to(tl.int64) * HV + i_h
    return i_b, i_t, bos, eos, rows, m_r, tok


@triton.jit
def _in_rows_of(i_n, in_rows, IN_ROWS: tl.constexpr):
    """IN_ROWS (FlashInfer's paged prefill, fast.paged): the kernels run on a chunk-aligned row space in which
    sequence i_n holds the caller's tokens at rows [lo, hi), row p holding the caller's row p - d; in_rows [N, 3]
    int32 = (lo, hi, d). -> (lo, hi, d), zeros without IN_ROWS. The intermediates (G, A, kn, v_new, h, the gates)
    stay in the kernels' rows; q, k, v and o are the caller's (_caller_rows)."""
    if IN_ROWS:
        return tl.load(in_rows + i_n * 3), tl.load(in_rows + i_n * 3 + 1), tl.load(in_rows + i_n * 3 + 2)
    else:
        return 0, 0, 0


@triton.jit
def _in_rows_of_chunk(i_c, i_b, chunk_indices, in_rows, IN_ROWS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """_in_rows_of for global chunk i_c of a chunk-parallel kernel (i_b: _chunk_coords' batch row, the sequence when
    dense; varlen: chunk_indices' row)."""
    i_n = i_b
    if IN_ROWS and IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    return _in_rows_of(i_n, in_rows, IN_ROWS)


@triton.jit
def _caller_rows(rows, m_r, lo, hi, d, IN_ROWS: tl.constexpr):
    """The caller's rows holding the kernels' rows ``rows`` and their mask (_in_rows_of's (lo, hi, d)): rows outside
    [lo, hi) are masked (zeros in, nothing out). Without IN_ROWS: (rows, m_r) as they are."""
    if IN_ROWS:
        return rows - d, m_r & (rows >= lo) & (rows < hi)
    else:
        return rows, m_r


@triton.jit
def _seq_coords(i_n, cu_seqlens, T, IS_VARLEN: tl.constexpr):
    """Sequence index -> (batch row i_b [int64], bos, eos): its tokens are rows bos .. eos - 1 of batch
    row i_b. Dense: i_b = i_n, bos = 0, eos = T. Varlen (B == 1): from cu_seqlens."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
        i_b = (i_n * 0).to(tl.int64)
    else:
        bos = 0
        eos = T
        i_b = i_n.to(tl.int64)
    return i_b, bos, eos


@triton.jit
def _seq_head(i_nh, seq_order, HV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A sequential pass's program index along its (sequence, value head) axis -> (sequence i_n, head i_h).
    Dense: i_nh = i_n * HV + i_h. Varlen: the rank-th longest sequence, seq_order[rank] (varlen_chunk_tables'
    order), so programs that walk the most chunks are dispatched first (heads of one sequence adjacent)."""
    i_h = i_nh % HV
    if IS_VARLEN:
        i_n = tl.load(seq_order + i_nh // HV)
    else:
        i_n = i_nh // HV
    return i_n, i_h


@triton.jit
def _seq_first_chunk(i_n, chunk_offsets, NT, IS_VARLEN: tl.constexpr):
    """Sequence index -> the global index of its first chunk (int64; chunks of all sequences in order):
    chunk_offsets[i_n] varlen, i_n NT dense."""
    if IS_VARLEN:
        boc = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        boc = i_n.to(tl.int64) * NT
    return boc


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """exp(x) in fp32. PRECISE (fp32 inputs): range-reduced, a few ulp at any |x|; else tl.exp.

    precision hazard: tl.exp lowers to ex2.approx(x * log2 e) with the product rounded first, which
    costs a relative error ~|x| 2^-24 in the result (~1e-6 at |x| = 20): visible against an fp32
    oracle under strong gating. PRECISE splits x = n ln2 + r exactly (Cody-Waite: ln2 = C1 + C2 with
    C1 short enough that n C1 is exact; n = floor(x / ln2) keeps 2^n finite wherever exp(x) is),
    takes exp2 of the small r log2 e only and builds 2^n from its bits. x < -87 (near the smallest
    normal) returns 0; x > 88.72 overflows to inf as it should.
    """
    if PRECISE:
        xc = tl.where(x < -87.0, -87.0, tl.where(x > 89.0, 89.0, x))
        xc = tl.where(x == x, xc, 0.0)                                     # NaN: returned as is below
        n = tl.floor(xc * 1.4426950408889634)                              # -126 <= n <= 128
        r = (xc - n * 0.693359375) - n * -2.1219444005469057e-4          # x - n ln2, in ~[0, ln2)
        two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)   # 2^n exactly (n >= -126)
        y = tl.exp2(r * 1.4426950408889634) * two_n
        return tl.where(x < -87.0, 0.0, tl.where(x == x, y, x))
    else:
        return tl.exp(x)


@triton.jit
def _gate(a, A_log_h, dt_bias_h, THRESHOLD: tl.constexpr, PRECISE: tl.constexpr):
    """Fused gating in fp32: g = -exp(A_log) * softplus(a + dt_bias), softplus(x) = x for x > 20.

    Below the threshold softplus is evaluated as max(x, 0) + log(1 + exp(-|x|)) (the same function;
    exp never overflows and the log's argument stays in [1, 2])."""
    x = a + dt_bias_h
    sp = tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + tl.log(1.0 + _exp(-tl.abs(x), PRECISE)))
    return -_exp(A_log_h, PRECISE) * sp


@triton.jit
def _beta_of(b, m, BETA_LOGITS: tl.constexpr, PRECISE: tl.constexpr):
    """beta in fp32 from what the caller passed as beta: BETA_LOGITS 0, beta itself; 1, its logits (beta =
    sigmoid(b)); 2, beta = 2 sigmoid(b) (fla's allow_neg_eigval). Rows outside the mask m: 0, as loaded.
    sigmoid without overflow: exp only of -|b| <= 0 (exp(-b) would overflow for b << 0)."""
    b = b.to(tl.float32)
    if BETA_LOGITS != 0:
        e = _exp(-tl.abs(b), PRECISE)
        s = tl.where(b >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        if BETA_LOGITS == 2:
            s = s * 2.0
        b = tl.where(m, s, 0.0)
    return b


@triton.jit
def _load_beta(p, rows, m, s_bt, BETA_LOGITS: tl.constexpr, PRECISE: tl.constexpr):
    """beta in fp32 at ``rows`` (masked rows: 0) of one (sequence, value head)'s column ``p`` (row stride s_bt):
    _beta_of of the load."""
    return _beta_of(tl.load(p + rows.to(tl.int64) * s_bt, mask=m, other=0.0), m, BETA_LOGITS, PRECISE)


@triton.jit
def _l2norm_rows(x, EPS: tl.constexpr):
    """x: [M, BK] -> x / sqrt(sum(x^2) + eps) per row, computed in fp32, returned in x's dtype.
    Masked-off columns were loaded as 0, so they do not count in the norm."""
    xf = x.to(tl.float32)
    return (xf * tl.rsqrt(tl.sum(xf * xf, 1) + EPS)[:, None]).to(x.dtype)


@triton.jit
def _trunc_tf32(x):
    """fp32 -> the tf32 value tensor cores read (the low 13 mantissa bits dropped: truncation, the
    conservative model). Interpreter only: it computes tl.dot in fp32 whatever input_precision says."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _hi_lo(x, DT: tl.constexpr):
    """fp32 x -> (hi, lo) in the 16-bit DT with hi + lo = x to about 16 mantissa bits (x - hi is exact in
    fp32; lo rounds it once)."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _operand(x, DT: tl.constexpr, PREC: tl.constexpr):
    """x as an operand of _dot at precision PREC: rounded to DT (the tiles' dtype) for a one-pass dot, or left as it
    is (fp32) under "bf16x2", whose _dot_split rounds it into two bf16 terms instead (the backward's split
    recompute)."""
    if PREC != "bf16x2":
        x = x.to(DT)
    return x


@triton.jit
def _dot_split(a, b, DT: tl.constexpr, DOT_F32: tl.constexpr):
    """a @ b in 16-bit dots (DT, bf16) with fp32 accumulation, each fp32 operand split into hi + lo in DT
    (about 16 mantissa bits instead of tf32's 10): two dots when one operand is already 16-bit (and exact),
    three when both are fp32 (hi hi + hi lo + lo hi), one when neither is."""
    if a.dtype == tl.float32:
        a_hi, a_lo = _hi_lo(a, DT)
        if b.dtype == tl.float32:
            b_hi, b_lo = _hi_lo(b, DT)
            return (_dot(a_hi, b_hi, None, DOT_F32) + _dot(a_hi, b_lo, None, DOT_F32)
                    + _dot(a_lo, b_hi, None, DOT_F32))
        else:
            return _dot(a_hi, b.to(DT), None, DOT_F32) + _dot(a_lo, b.to(DT), None, DOT_F32)
    elif b.dtype == tl.float32:
        b_hi, b_lo = _hi_lo(b, DT)
        return _dot(a.to(DT), b_hi, None, DOT_F32) + _dot(a.to(DT), b_lo, None, DOT_F32)
    else:
        return _dot(a.to(DT), b.to(DT), None, DOT_F32)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """tl.dot with fp32 accumulation. PREC: input_precision for fp32 operands ("ieee", "tf32x3"), or
    None for 16-bit operands (the default), or "bf16x2" (the backward's experimental recompute of bf16
    inputs: _dot_split). DOT_F32 (interpreter only): cast operands to fp32 first, as bf16 dots are wrong
    there (the interpreter ignores input_precision)."""
    if PREC == "bf16x2":
        return _dot_split(a, b, tl.bfloat16, DOT_F32)
    else:
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if PREC == "tf32":          # the interpreter computes fp32: model the tensor cores' tf32 operands
                a = _trunc_tf32(a)
                b = _trunc_tf32(b)
        if PREC is None:
            return tl.dot(a, b)
        else:
            return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _gdiff(Ga, Gla, Gb, Glb, PRECISE: tl.constexpr):
    """G_a - G_b from (G, Gl) pairs: [Ma] x [Mb] -> [Ma, Mb] (the Gl terms only when PRECISE)."""
    d = Ga[:, None] - Gb[None, :]
    if PRECISE:
        d = d + (Gla[:, None] - Glb[None, :])
    return d


# ============================================================================================
# host helpers: configs, layouts, chunk bookkeeping
# ============================================================================================

def _num_sms(device: torch.device) -> int:
    """The device's SM count (132, an H100 SXM / H200, for a non-CUDA device). Cached per device: the
    forward's configs ask three times per call, and each property lookup is a torch.cuda call."""
    return _sm_count(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _sm_count(kind: str, index: Optional[int]) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(torch.device(kind, index)).multi_processor_count
    return 132  # H100 SXM / H200


def _warp_mma(device: torch.device) -> bool:
    """Whether the device is a CUDA GPU whose Triton dots are warp-level mma.sync with register accumulators: sm_8x
    (Ampere, Ada) and sm_12x (RTX 50, GB10), not Hopper's wgmma or sm_100's tcgen05. Its kernels take their own
    configs where the sm_90-tuned ones spill there (state_config, state_fuses_output, output_config; the backward's
    dh_bwd_config). False for any other device (the interpreter; compile checks patch _capability). Cached per
    device, as _num_sms."""
    major = _capability(device.type, device.index)[0]
    return major < 9 or major == 12


def _small_smem(device: torch.device) -> bool:
    """Whether a block may use at most ~99 KB of shared memory on the device (sm_86, sm_89, sm_12x: RTX 30 / 40 / 50,
    A10, L4, L40S), where float32 tiles take narrower configs (state_config, output_config); sm_80 / sm_87 allow
    163 KB, sm_90 / sm_100 227 KB. By compute capability, as _warp_mma."""
    cap = _capability(device.type, device.index)
    return cap in ((8, 6), (8, 9)) or cap[0] == 12


@functools.lru_cache(maxsize=None)
def _capability(kind: str, index: Optional[int]) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA device; (9, 0) for any other (the configs' sm_90 default)."""
    if kind == "cuda":
        return torch.cuda.get_device_capability(torch.device(kind, index))
    return (9, 0)


def _blocks(K: int, V: int) -> Tuple[int, int]:
    """Padded head dims: one power-of-two block each (>= 16, the smallest tl.dot size)."""
    return max(16, next_pow2(K)), max(16, next_pow2(V))


def _cfg(name: str, base: dict, configs: Optional[dict] = None) -> dict:
    """The pinned config `base` with the overrides configs[name] (benchmark sweeps) merged over it."""
    return dict(base, **(configs or {}).get(name, {}))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """Kernels address the last dim with unit stride; other dims may have any stride (slices are views)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _rows16(x: torch.Tensor, cuda_only: bool = True) -> torch.Tensor:
    """x itself when every stride but the last (unit) is a multiple of 16 elements and its base is 16-byte aligned;
    else a copy laid out so (rows padded to a multiple of 16 elements, viewed back to x's shape). CUDA only (the
    interpreter has no such variant) unless cuda_only is False (the CPU test of the layout).

    Why: Triton specialises an integer argument divisible by 16, and pointer alignment, into its own compiled
    variant, and Triton 3.6 miscompiles the state pass's variant for a k whose row strides are not: the unfused pass
    with v_new from A (BV 16, 4 warps, K = 32, BT 64) ran a `tl.dot` on out-of-range shared-memory addresses
    (compute-sanitizer; an illegal-address fault, or a wrong o and final state: the quick conformance family
    "strided-slices" on an H200, k a view of a fused projection with a row stride of 136 elements). Row strides of
    36, 40 and 136 faulted, 48 and 64 did not (2026-11-27, benchmarks/RESULTS.md). Callers with aligned rows (every
    contiguous k with H K % 16 == 0, vLLM's fused projections at Qwen3-Next's sizes, l2norm's normalised copy) pay
    nothing."""
    if ((cuda_only and x.device.type != "cuda") or x.numel() == 0
            or (x.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in x.stride()[:-1]))):
        return x
    pad = -(-x.shape[-1] // 16) * 16
    out = torch.empty(*x.shape[:-1], pad, dtype=x.dtype, device=x.device)[..., :x.shape[-1]]
    return out.copy_(x)


def _fp32_prec(dtype: torch.dtype):
    """input_precision of the dots whose operands are in `dtype`: None (default) for 16-bit operands,
    FP32_PRECISION for fp32 inputs (plain TF32 would fail fp32 conformance)."""
    return FP32_PRECISION if dtype == torch.float32 else None


def _upcast(prec_of) -> bool:
    """Kernels 1-3's UPCAST for the backward's recompute (prec_of = (precision, dtype), None on the
    forward): convert the 16-bit tiles to fp32 after the load, except under "bf16x2", whose dots split
    fp32 operands themselves and want the 16-bit tiles as they are."""
    return prec_of is not None and prec_of[0] != "bf16x2"


def _precise(dtype: torch.dtype) -> bool:
    """Range-reduced exp (``_exp``) for fp32 inputs; 16-bit inputs round far above tl.exp's error."""
    return dtype == torch.float32


def _contig(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x.contiguous() if x is not None else None


def _is_fp64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def _check_fast_limits(K: int, V: int, chunk_size: Optional[int] = None) -> None:
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 16, 32 or 64 for fast's kernels, got {chunk_size!r}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM} for fast's kernels, got K={K}, V={V}")


@triton.jit(do_not_specialize=["N", "T", "rows", "steps"])
def chunk_table_kernel(cu_seqlens, safe_cu, first, indices, offsets, order, N, T, rows, steps, BT: tl.constexpr,
                       BN: tl.constexpr, EVERY: tl.constexpr, RB: tl.constexpr):
    """One program: varlen_chunk_tables' chunk table built on the device from offsets nobody has checked yet.

    cu_seqlens: [N+1] int (any values)  ->  safe_cu: [N+1] (its dtype), each offset clamped to [0, T];
    first: [N+1] int64, first[n] = sum_{m<n} ceil(max(safe_cu[m+1] - safe_cu[m], 0) / BT);
    indices: [rows, 2] int32, row r < first[N]: (n, r - first[n]) for the n with first[n] <= r < first[n+1];
    rows past first[N]: (-1, 0), no chunk (chunk_kkt_inv_kernel's programs for them return at once).
    EVERY (the tables of every kernel of the forward; None pointers otherwise): offsets [N+1] int32, first's
    values (the host tables' words); order [N] int32, the sequences longest first by chunk count, ties in index
    order, as varlen_chunk_tables' (longest-processing-time first: the sequential passes map their programs
    through it), for N <= BN by counting each sequence's predecessors over [RB, RB] tiles (O(N^2 / RB^2) steps;
    a sort, tl.sort, costs seconds per call in the interpreter); index order above BN sequences.

    For valid offsets (0 = cu[0] <= ... <= cu[N] = T) safe_cu == cu_seqlens and the first first[N] rows are
    the host table's (tests/test_host_reads.py). For any values nothing is read or written outside the
    tensors, and a kernel that walks a row's chunk over safe_cu stays inside [0, T): counts are >= 0, so first
    is non-decreasing and each row's chunk lies inside its sequence's clamped span (int64: no overflow).
    Why: chunk_gated_delta_rule runs its kernels on these tables while the host waits for the offsets' values
    (fast.chunk.chunk_gated_delta_rule_fwd, offsets_unchecked); their outputs are scratch until the host check
    passes. Phases: 1. clamp; 2. counts and their prefix sum, BN sequences at a time; 3. each row's
    sequence by binary search over first (``steps`` = bit length of N - 1 halvings).
    """
    o = tl.arange(0, BN)
    for s in range(0, N + 1, BN):                                  # 1. clamp
        m = s + o <= N
        c = tl.load(cu_seqlens + s + o, mask=m, other=0)
        tl.store(safe_cu + s + o, tl.minimum(tl.maximum(c, 0), T).to(c.dtype), mask=m)
    tl.debug_barrier()                                             # the block's stores, visible to all its threads
    run = tl.sum(tl.zeros((BN,), dtype=tl.int64), 0)
    tl.store(first, run)
    for s in range(0, N, BN):                                      # 2. chunks per sequence, prefix sums
        m = s + o < N
        bos = tl.load(safe_cu + s + o, mask=m, other=0).to(tl.int64)
        eos = tl.load(safe_cu + s + o + 1, mask=m, other=0).to(tl.int64)
        cnt = tl.where(m, (tl.maximum(eos - bos, 0) + BT - 1) // BT, 0)
        tl.store(first + s + o + 1, run + tl.cumsum(cnt, 0), mask=m)
        run += tl.sum(cnt, 0)
    tl.debug_barrier()
    if EVERY:                                                      # 2b. offsets as int32, the programs' order
        for s in range(0, N + 1, BN):
            m = s + o <= N
            tl.store(offsets + s + o, tl.load(first + s + o, mask=m, other=0).to(tl.int32), mask=m)
        if N <= BN:
            # sequence n's place: how many sequences come before it (more chunks, or as many and a lower index),
            # counted over [RB, RB] tiles; the places are a permutation, so each n is stored once
            r = tl.arange(0, RB)
            for a in range(0, N, RB):
                na = a + r
                ca = tl.load(first + na + 1, mask=na < N, other=0) - tl.load(first + na, mask=na < N, other=0)
                place = tl.zeros((RB,), dtype=tl.int32)
                for b in range(0, N, RB):
                    nb = b + r
                    cb = tl.load(first + nb + 1, mask=nb < N, other=0) - tl.load(first + nb, mask=nb < N, other=0)
                    before = (cb[None, :] > ca[:, None]) | ((cb[None, :] == ca[:, None]) & (nb[None, :] < na[:, None]))
                    place += tl.sum((before & (nb[None, :] < N)).to(tl.int32), 1)
                tl.store(order + place, na.to(tl.int32), mask=na < N)
        else:
            for s in range(0, N, BN):
                tl.store(order + s + o, (s + o).to(tl.int32), mask=s + o < N)
    for r0 in range(0, rows, BN):                                  # 3. row -> (sequence, chunk within it)
        r = (r0 + o).to(tl.int64)
        lo = tl.zeros((BN,), dtype=tl.int64)                       # the last n in [0, N) with first[n] <= r
        hi = lo + N - 1
        for _ in range(steps):
            mid = (lo + hi + 1) // 2
            up = tl.load(first + mid) <= r
            lo = tl.where(up, mid, lo)
            hi = tl.where(up, hi, mid - 1)
        live = r < run
        within = r - tl.load(first + lo)
        m = r0 + o < rows
        tl.store(indices + r * 2, tl.where(live, lo, -1).to(tl.int32), mask=m)
        tl.store(indices + r * 2 + 1, tl.where(live, within, 0).to(tl.int32), mask=m)


CHUNK_TABLE_BLOCK = 1024     # chunk_table_kernel's BN (one compiled variant for every N and T)
CHUNK_ORDER_BLOCK = 64       # its RB: the tiles of the longest-first order's counts


class _Chunks:
    """Chunk bookkeeping: dense (NT per batch row) or varlen (host-built tables; eager prefill only), or
    varlen from unchecked offsets (``_Chunks.unchecked``: a device-built table for kernel 1 only)."""

    def __init__(self, B: int, T: int, BT: int, cu_seqlens: Optional[torch.Tensor]):
        self.varlen = cu_seqlens is not None
        self.cu_seqlens = cu_seqlens
        if self.varlen:
            # [NT_total, 2] (sequence, chunk), [N+1] first global chunk of each, the checked offsets the kernels
            # read in place of cu_seqlens and [N] the sequences longest first (the sequential passes' program
            # order): one host read (none with cu_seqlens_cpu), one copy
            tab = varlen_chunk_tables(cu_seqlens, BT)
            self.indices, self.offsets, self.cu_seqlens, self.order = tab.indices, tab.offsets, tab.checked, tab.order
            self.NT = 1                                               # unused
            self.total = self.indices.shape[0]
        else:
            self.indices = self.offsets = self.order = None
            self.NT = cdiv(T, BT)
            self.total = B * self.NT

    @classmethod
    def unchecked(cls, T: int, BT: int, cu_seqlens: torch.Tensor, every_kernel: bool = False) -> "_Chunks":
        """Varlen bookkeeping from offsets whose values the host has not read (no host read): one launch of
        chunk_table_kernel. ``total`` is an upper bound on the chunk count, cdiv(T, BT) + N (for valid offsets
        sum_n ceil(len_n / BT) <= sum_n (len_n / BT + 1)); its extra rows hold no chunk (the kernels that walk
        rows skip them). ``cu_seqlens`` is the clamped copy the table was built from (the kernels read it).
        every_kernel=False: for kernel 1 only (no offsets or order: the state pass and kernel 4 use the host
        tables built after the check). True: for every kernel of the forward: ``offsets`` is each sequence's
        first chunk as the device computed it and ``order`` the sequences longest first as the host tables'
        (sorted on the device for N <= CHUNK_TABLE_BLOCK, index order above; either way the same bits)."""
        self = cls.__new__(cls)
        N = cu_seqlens.numel() - 1
        self.varlen, self.NT = True, 1
        self.total = cdiv(T, BT) + N
        dev = cu_seqlens.device
        self.cu_seqlens = torch.empty_like(cu_seqlens)
        self.indices = torch.empty(self.total, 2, dtype=torch.int32, device=dev)
        first = torch.empty(N + 1, dtype=torch.int64, device=dev)
        self.offsets = self.order = None
        if every_kernel:
            # int32 as the host tables' words (the state pass's compiled variants are the same); < 2^31 chunks
            self.offsets = torch.empty(N + 1, dtype=torch.int32, device=dev)
            self.order = torch.empty(N, dtype=torch.int32, device=dev)
        # one program, launched once per call (never autotuned; not specialised on its integers)
        launch(chunk_table_kernel, (1,), dict(BT=BT, BN=CHUNK_TABLE_BLOCK, EVERY=every_kernel, RB=CHUNK_ORDER_BLOCK,
                                              num_warps=4),
               cu_seqlens, self.cu_seqlens, first, self.indices, self.offsets, self.order, N, T, self.total,
               max(N - 1, 1).bit_length())
        return self
