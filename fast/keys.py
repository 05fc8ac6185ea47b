"""Compile keys of every fast op: which Triton variants a call launches, as pure functions on the CPU.

Each function here has the name and signature of the fast op it describes and returns the list of
:class:`refgdn.capture.CompileKey` the op would launch for those arguments, in launch order, without
launching anything or reading any tensor's values (meta tensors are fine: only shapes and dtypes
are read). The constexprs come from the same config functions the launchers call
(``fast.serving.step_config`` / ``conv_config``, ``fast.chunk``'s ``*_config`` and precision tables,
``fast.conv.conv_fwd_config``), imported, never copied; the launcher's own glue (which kernel, which
flags) is mirrored here and checked against the real launches: ``refgdn.capture.traced_ops(fast)``
raises when a prediction and a launch differ, and tests/test_capture.py runs every op that way.

    key = (kernel, constexprs, dtype of every tensor argument (None when passed None), launch options)

Not in the key: Triton's integer-value specialisation (an int argument equal to 1 or divisible by
16 compiles its own variant) and pointer alignment. For decode / verify / draft steps every such
integer is fixed by the model geometry (D, head sizes, strides); prefill lengths T vary, so a
server warms prefill at a length of each class (``prefill_lengths``). The GPU test counts Triton's
real compilations to check the whole claim.

``bt_rule(T)`` is the chunk-size rule of DESIGN.md: ``BT = min(64, max(16, next_pow2(T)))``
(the bounds are fast.chunk.CHUNK_SIZES): three prefill variants, T = 16, 32, 64.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from refgdn.capture import CompileKey
from refgdn.checks import fla_keywords, fla_recurrent_arguments, host_offsets_known
from refgdn.vllm_ops import sigmoid_gating_out_dtype

from . import chunk as _chunk
from . import conv as _conv
from . import serving as _serving
from .chunk import recurrent as _rec
from .utils import cdiv, is_interpreting, next_pow2

__all__ = ["bt_rule", "prefill_lengths", "gdn_prefill", "gdn_decode", "gdn_verify", "gdn_accept",
           "gdn_materialize", "causal_conv1d", "causal_conv1d_update", "gdn_gating", "l2norm", "rms_norm_gated",
           "rms_norm", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

_I32 = torch.int32
_F32 = torch.float32


def _dt(t) -> Optional[torch.dtype]:
    return None if t is None else t.dtype


def bt_rule(T: int) -> int:
    """Chunk size for a prefill of T tokens: BT = min(64, max(16, next_pow2(T))) over fast.chunk.CHUNK_SIZES."""
    lo, hi = min(_chunk.CHUNK_SIZES), max(_chunk.CHUNK_SIZES)
    return min(hi, max(lo, next_pow2(T)))


def prefill_lengths(max_len: int) -> List[int]:
    """Prefill lengths that launch every chunk-size variant of ``bt_rule`` up to ``max_len`` tokens,
    each BT once at T = BT (a multiple of 16) and once at an odd length (Triton's divisibility classes)."""
    out = set()
    for bt in _chunk.CHUNK_SIZES:
        lo = bt // 2 + 1 if bt > min(_chunk.CHUNK_SIZES) else 1
        for T in (bt, lo + (lo % 2 == 0)):
            if T <= max_len and bt_rule(T) == bt:
                out.add(T)
    return sorted(out)


# ----------------------------------------------------------------------------------------------
# serving: decode, verify, accept, materialize (fast.serving._launch)
# ----------------------------------------------------------------------------------------------

def _checked_kernels() -> bool:
    """fast.serving with device-side value checks (an error buffer in the cache, issue 8)."""
    return hasattr(_serving, "DUP_BLOCK")


def _step_keys(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
               activation, mode: str, device=None) -> List[CompileKey]:
    """device: where the call runs (default the cache's): whether the step kernel is the conv kernel's
    programmatic dependent depends on it (fast.serving.pdl_supported)."""
    H, HV, K, V, D, W, TC = cache.H, cache.HV, cache.K, cache.V, cache.D, cache.W, cache.tokens_cap
    N = state_indices.shape[0]
    if N == 0 or _fp64(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache.ssm_state, cache.conv_state):
        return []                                   # (float64 runs refgdn: fast.serving._StepPlan.fp64)
    varlen = cu_seqlens is not None
    TMAX = {"decode": 1, "verify": TC, "materialize": 0}[mode]
    cc = _serving.conv_config(D, W, N)
    idx = state_indices.dtype
    cu = cu_seqlens.dtype if varlen else idx
    checked = _checked_kernels()
    conv_c = dict(W=W, TCAP=TC, TMAX=TMAX, BD=cc["BD"], VARLEN=varlen, SILU=activation in ("silu", "swish"),
                  HAS_BIAS=conv_bias is not None)
    if checked:
        conv_c.update(BN=_serving.DUP_BLOCK)
    if W <= _conv.WINDOW_MAX_W:
        conv_name = "conv_step_kernel"
        conv_c.update(CWP=next_pow2(max(W - 1, W - 2 + TMAX)))
    else:
        conv_name = "conv_step_any_w_kernel"
        conv_c.update(CW=cache.conv_state.shape[2], SP=next_pow2(W - 1 + TMAX))
    conv_d = dict(x=mixed_qkv.dtype, weight=conv_weight.dtype, bias=(conv_bias if conv_bias is not None
                                                                      else conv_weight).dtype,
                  y=mixed_qkv.dtype, conv_state=cache.conv_state.dtype, meta=cache.pend_meta.dtype, snap=_I32,
                  state_indices=idx, cu_seqlens=cu)
    if checked:
        conv_d.update(err=cache.err.dtype)
    pdl_ok = checked and _serving.pdl_supported(torch.device(device) if device is not None
                                                 else cache.ssm_state.device)
    sc = _serving.step_config(K, V, cache.ssm_state.dtype, HV, mode, N, pdl_ok=pdl_ok)
    step_c = dict(H=H, HV=HV, K=K, V=V, SK=cache.ssm_state.stride(2), SV=cache.ssm_state.stride(3),
                  BK=next_pow2(K), BV=sc["BV"], TCAP=TC, TMAX=TMAX, HPP=sc["HPP"], VARLEN=varlen,
                  KEEP_PENDING=mode == "verify", FOLD=bool(sc["fold"]), PDL=False)
    step_d = dict(y=mixed_qkv.dtype, a=a.dtype, b=b.dtype, A_log=A_log.dtype, dt_bias=dt_bias.dtype,
                  o=mixed_qkv.dtype, ssm=cache.ssm_state.dtype, pk=cache.pend_k.dtype, pv=cache.pend_v.dtype,
                  pg=cache.pend_g.dtype, pbeta=cache.pend_beta.dtype, meta=cache.pend_meta.dtype, snap=_I32,
                  state_indices=idx, cu_seqlens=cu)
    step_o = dict(num_warps=sc["num_warps"])
    if checked:        # the step kernel reads the request rows the conv kernel checked (snap), and the
        del step_c["VARLEN"], step_d["cu_seqlens"]      # indices only for its early state read (PDL)
        conv_c.update(PDL=bool(sc["pdl"]))
        step_c.update(PDL=bool(sc["pdl"]))
    else:
        del step_c["PDL"]
    conv_o = dict(num_warps=cc["num_warps"])
    if sc["pdl"]:
        conv_o.update(launch_pdl=True)
        step_o.update(launch_pdl=True)
    return [CompileKey.make(conv_name, conv_c, conv_d, conv_o),
            CompileKey.make("gdn_step_kernel", step_c, step_d, step_o)]


def gdn_decode(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, scale=None,
               activation="silu", check_values=False, *, device=None) -> List[CompileKey]:
    """Keys of fast.gdn_decode: the conv step kernel (decode: TMAX = 1) and the step kernel. ``device``:
    where the call runs (default the cache's; PDL on sm_90+ for small N)."""
    return _step_keys(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, None,
                      activation, "decode", device)


def gdn_verify(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
               scale=None, activation="silu", check_values=False, *, device=None) -> List[CompileKey]:
    """Keys of fast.gdn_verify: both kernels in verify mode (TMAX = 1 + max_draft, KEEP_PENDING, VARLEN).
    One variant per cache geometry, whatever the number of drafts k <= max_draft of the call (and per
    PDL: N <= fast.serving.PDL_MAX_N on sm_90+)."""
    return _step_keys(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                      activation, "verify", device)


def gdn_accept(cache, state_indices, num_accepted, check_values=False) -> List[CompileKey]:
    """Keys of fast.gdn_accept: accept_kernel with BN = min(next_pow2(N), 1024) (N itself is not specialised)."""
    N = state_indices.shape[0]
    if N == 0:
        return []
    if _checked_kernels():       # one variant for every N (mirrors fast.serving.gdn_accept)
        return [CompileKey.make("accept_kernel", dict(BN=_serving.ACCEPT_BLOCK, BC=32),
                                dict(meta=cache.pend_meta.dtype, err=cache.err.dtype,
                                     state_indices=state_indices.dtype, num_accepted=num_accepted.dtype),
                                dict(num_warps=4))]
    BN = min(next_pow2(N), 1024)
    return [CompileKey.make("accept_kernel", dict(BN=BN),
                            dict(meta=cache.pend_meta.dtype, state_indices=state_indices.dtype,
                                 num_accepted=num_accepted.dtype), dict(num_warps=1))]


def gdn_materialize(cache, state_indices, check_values=False, *, device=None) -> List[CompileKey]:
    """Keys of fast.gdn_materialize: the step kernels with zero new tokens (float32 dummies, varlen)."""
    N = state_indices.shape[0]
    dev = torch.device("meta")
    dummy = torch.empty(0, cache.D, dtype=cache.conv_state.dtype, device=dev)
    ab = torch.empty(0, cache.HV, dtype=_F32, device=dev)
    hv = torch.empty(cache.HV, dtype=_F32, device=dev)
    w = torch.empty(cache.D, cache.W, dtype=_F32, device=dev)
    cu = torch.empty(N + 1, dtype=_I32, device=dev)
    return _step_keys(dummy, ab, ab, w, None, hv, hv, cache, state_indices, cu, None, "materialize", device)


def gdn_prefill(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache, state_indices, cu_seqlens,
                has_initial_state=None, scale=None, activation="silu", check_values=False, cu_seqlens_cpu=None, *,
                device=None) -> List[CompileKey]:
    """Keys of fast.gdn_prefill, in launch order: prefill_rows_kernel, gdn_materialize's step kernels (int32 slots),
    causal_conv1d's and the chunked forward's in their slot forms (chunk size and conv tile PREFILL_CHUNK, the
    offsets known on the host: the op reads them first). float64 runs refgdn: no keys."""
    if _fp64(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, cache.ssm_state, cache.conv_state):
        return []
    T, N = mixed_qkv.shape[0], state_indices.shape[0]
    if N == 0:
        return []
    H, HV, K, V, D = cache.H, cache.HV, cache.K, cache.V, cache.D
    dev = torch.device("meta")

    def e(*shape, dtype=mixed_qkv.dtype):
        return torch.empty(*shape, dtype=dtype, device=dev)
    flags = has_initial_state is not None
    out = [CompileKey.make("prefill_rows_kernel", dict(BN=_serving.PREFILL_BLOCK, HAS_FLAGS=flags),
                           dict(meta=cache.pend_meta.dtype, err=cache.err.dtype, state_indices=state_indices.dtype,
                                has_initial_state=torch.uint8 if flags else state_indices.dtype,
                                cu_seqlens=cu_seqlens.dtype, rows=_I32),
                           dict(num_warps=4))]
    out += gdn_materialize(cache, e(N, dtype=_I32), device=device)
    out += causal_conv1d(e(1, T, D), conv_weight, conv_bias, activation, cache.conv_state, True, cu_seqlens,
                         device=device, slots=True)
    out += chunk_gated_delta_rule(e(1, T, H, K), e(1, T, H, K), e(1, T, HV, V), e(1, T, HV, dtype=a.dtype),
                                  e(1, T, HV, dtype=b.dtype), scale, cache.ssm_state, True, cu_seqlens, True, A_log,
                                  dt_bias, _serving.PREFILL_CHUNK, device=device, offsets_known=True, slots=True,
                                  beta_logits=1)
    return out


def _table_key(BT: int, offsets_dtype, every: bool = False) -> CompileKey:
    """chunk_table_kernel's key (fast.chunk.common._Chunks.unchecked): a varlen tile / chunk table built on the
    device from offsets of this dtype; every: with the int32 offsets and order of every kernel of the forward."""
    return CompileKey.make("chunk_table_kernel", dict(BT=BT, BN=_chunk.CHUNK_TABLE_BLOCK, EVERY=every,
                                                      RB=_chunk.CHUNK_ORDER_BLOCK),
                           dict(cu_seqlens=offsets_dtype, safe_cu=offsets_dtype, first=torch.int64, indices=_I32,
                                offsets=_I32 if every else None, order=_I32 if every else None), dict(num_warps=4))


# ----------------------------------------------------------------------------------------------
# conv (fast.conv)
# ----------------------------------------------------------------------------------------------

def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, cu_seqlens_cpu=None, *, device=None, slots: bool = False,
                  pad_zero: bool = False) -> List[CompileKey]:
    """Keys of fast.causal_conv1d: the window kernel (W <= 4) or the tile kernel, BT/BD from
    fast.conv.conv_fwd_config(T, D, W), then the final-state kernel when asked. ``device``: where the
    call runs (default x's; CUDA float32 compute takes the approximate silu). slots: gdn_prefill's form
    (initial_state a cache's conv_state, read and written at int32 slot rows: the kernels' SLOTS; its tiles are
    fast.serving.PREFILL_CHUNK rows, from gdn_prefill's host table); pad_zero: with slots, vLLM's causal_conv1d_fn
    (PAD_ZERO; its table's key is vllm_causal_conv1d_fn's). Varlen without slots: chunk_table_kernel first (the
    tile table built on the device). (An unpinned BT grows when a grid would exceed 65535 row blocks: > 1M tokens at
    BT = 16, not modelled.)"""
    B, T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (x, weight, initial_state))
    if D == 0:
        return []
    out = []
    cfg = _conv.conv_fwd_config(T, D, W, x.element_size())
    if slots:
        cfg["BT"] = _serving.PREFILL_CHUNK
    elif cu_seqlens is not None:                     # the tile table, built on the device after the host's check
        out.append(_table_key(cfg["BT"], cu_seqlens.dtype))
    window = W <= _conv.WINDOW_MAX_W
    if T > 0:
        c = dict(W=W, BT=cfg["BT"], BD=cfg["BD"], SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None,
                 HAS_INIT=initial_state is not None, IS_VARLEN=cu_seqlens is not None, FP64=fp64, SLOTS=slots,
                 PAD_ZERO=slots and pad_zero)
        if window:
            on_cuda = (torch.device(device) if device is not None else x.device).type == "cuda"
            gpu_f32 = on_cuda and not fp64 and not is_interpreting()
            c.update(FAST_SILU=gpu_f32, PREFETCH=True)
        d = dict(x=x.dtype, y=x.dtype, weight=weight.dtype, bias=_dt(bias), initial_state=_dt(initial_state),
                 cu_seqlens=_dt(cu_seqlens), tile_table=_I32 if cu_seqlens is not None else None,
                 slot_rows=_I32 if slots else None)
        opts = dict(num_warps=cfg["num_warps"])
        out.append(CompileKey.make("causal_conv1d_fwd_window_kernel" if window else "causal_conv1d_fwd_kernel",
                                   c, d, opts))
    if output_final_state and W > 1 and N > 0:
        state_dtype = initial_state.dtype if initial_state is not None else x.dtype
        BDs = max(16, min(256, next_pow2(D)))        # mirrors fast.conv.causal_conv1d_with_config
        out.append(CompileKey.make(
            "causal_conv1d_final_state_kernel",
            dict(W=W, WP=next_pow2(W - 1), BD=BDs, HAS_INIT=initial_state is not None,
                 IS_VARLEN=cu_seqlens is not None, SLOTS=slots),
            dict(x=x.dtype, final_state=state_dtype, initial_state=_dt(initial_state), cu_seqlens=_dt(cu_seqlens),
                 slot_rows=_I32 if slots else None),
            dict(num_warps=4)))
    return out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None) -> List[CompileKey]:
    """Keys of fast.causal_conv1d_update (one kernel; BD mirrors the launcher)."""
    N, D = x.shape
    if N == 0 or D == 0:
        return []
    W = weight.shape[1]
    fp64 = any(t.dtype == torch.float64 for t in (x, weight, conv_state))
    BD = max(16, min(256 if not is_interpreting() else 128, next_pow2(D)))
    return [CompileKey.make("causal_conv1d_update_kernel",
                            dict(W=W, BD=BD, SILU=activation in ("silu", "swish"), HAS_BIAS=bias is not None,
                                 FP64=fp64),
                            dict(x=x.dtype, conv_state=conv_state.dtype, weight=weight.dtype, bias=_dt(bias),
                                 y=x.dtype),
                            dict(num_warps=4))]


# ----------------------------------------------------------------------------------------------
# gating, l2norm (fast.gating)
# ----------------------------------------------------------------------------------------------

def gdn_gating(A_log, a, dt_bias, b) -> List[CompileKey]:
    """Keys of fast.gdn_gating: BM depends on the row count M = a.numel() / HV (one variant per power of two)."""
    from .gating import SOFTPLUS_THRESHOLD
    if a.numel() == 0:
        return []
    HV = a.shape[-1]
    M = a.numel() // HV
    g_fp64 = any(t.dtype == torch.float64 for t in (A_log, a, dt_bias))
    BH = min(next_pow2(HV), 64)
    BM = max(1, min(next_pow2(M), 4096 // BH))
    return [CompileKey.make("gdn_gating_kernel",
                            dict(BM=BM, BH=BH, THRESHOLD=SOFTPLUS_THRESHOLD, G_FP64=g_fp64,
                                 BETA_FP64=b.dtype == torch.float64),
                            dict(A_log=A_log.dtype, a=a.dtype, dt_bias=dt_bias.dtype, b=b.dtype,
                                 g=torch.float64 if g_fp64 else _F32, beta=b.dtype),
                            dict(num_warps=4))]


def l2norm(x, eps=1e-6) -> List[CompileKey]:
    """Keys of fast.l2norm: BM depends on the row count (one variant per power of two)."""
    if x.dim() == 0:
        return l2norm(x.reshape(1), eps)
    if x.numel() == 0:
        return []
    K = x.shape[-1]
    M = x.numel() // K
    BK = next_pow2(K)
    BM = max(1, min(next_pow2(M), max(1, 4096 // BK)))
    return [CompileKey.make("l2norm_kernel", dict(BM=BM, BK=BK, FP64=x.dtype == torch.float64),
                            dict(x=x.dtype, y=x.dtype), dict(num_warps=4 if BK * BM <= 4096 else 8))]


def _norm_key(x, g, weight, bias, activation, unit_offset: bool, config, residual=None, res_dtype=None
              ) -> List[CompileKey]:
    """The key of fast.norm's forward launch (norm_fwd): g None for rms_norm (x's rows stand in for g's); residual /
    res_dtype: rms_norm's pre-norm add and the stored sum's dtype (None: not stored)."""
    from .norm import GATES, _rows
    D = x.shape[-1]
    M = x.numel() // D if D else 0
    if M == 0:
        return []
    cfg = config(M, D)
    warps = cfg.pop("num_warps")
    return [CompileKey.make("rms_norm_fwd_kernel",
                            dict(D=D, GATE=GATES[activation], HAS_W=weight is not None, HAS_B=bias is not None,
                                 FP64=torch.float64 in {_dt(t) for t in (x, g, weight, bias, residual)},
                                 X_SPLIT=_rows(x)[4], G_SPLIT=_rows(g)[4] if g is not None else False,
                                 UNIT_W=bool(unit_offset), HAS_R=residual is not None, STORE_R=res_dtype is not None,
                                 **cfg),
                            dict(x=x.dtype, g=(g if g is not None else x).dtype, w=_dt(weight), b=_dt(bias),
                                 y=x.dtype, r=_dt(residual), r_out=res_dtype),
                            dict(num_warps=warps))]


def rms_norm_gated(x, g, weight, bias=None, activation="swish", residual=None, prenorm=False,
                   residual_in_fp32=False, eps=1e-6) -> List[CompileKey]:
    """Keys of fast.rms_norm_gated's forward: BM depends on the row count (one variant per power of two up to
    4096 / next_pow2(D)). The backward (rms_norm_bwd_kernel) runs in training only, never in a graph."""
    from .norm import norm_config
    return _norm_key(x, g, weight, bias, activation, False, norm_config)


def rms_norm(x, weight, bias=None, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, *,
             unit_offset=False) -> List[CompileKey]:
    """Keys of fast.rms_norm's forward: one per D, dtypes and residual flags, whatever the row count
    (fast.norm.plain_norm_config). The backward runs in training only, never in a graph."""
    from refgdn.norm import residual_out_dtype

    from .norm import plain_norm_config
    return _norm_key(x, None, weight, bias, None, unit_offset, plain_norm_config, residual,
                     residual_out_dtype(x, residual, residual_in_fp32, prenorm))


# ----------------------------------------------------------------------------------------------
# prefill (fast.chunk)
# ----------------------------------------------------------------------------------------------

def _fp64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def _fla_mapped(q, v, beta, initial_state, A_log, dt_bias, cu_seqlens, *flags) -> tuple:
    """refgdn.checks.fla_keywords' mapping, for the keys: (beta, initial_state, A_log, dt_bias). beta, A_log and
    dt_bias go through it as meta tensors, so a key function computes no sigmoid and allocates nothing on a device
    (the keys read dtypes and which tensors exist)."""
    def meta(t):
        return t.to(device="meta") if isinstance(t, torch.Tensor) else t
    return fla_keywords(q, v, meta(beta), initial_state, meta(A_log), meta(dt_bias), cu_seqlens, *flags)[:4]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                           chunk_size=64, cu_seqlens_cpu=None, *, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, state_v_first=False, use_gate_in_kernel=None, chunk_indices=None,
                           cp_context=None, head_first=False, device=None,
                           offsets_known: Optional[bool] = None, slots: bool = False,
                           beta_logits: int = 0, device_tables: bool = False,
                           checkpoints: Optional[tuple] = None, in_rows: bool = False) -> List[CompileKey]:
    """Keys of fast.chunk_gated_delta_rule: kernels 1, 3 and (unless the state pass forms o) 4 at chunk size
    BT = chunk_size; kernel 2 never runs in the forward, whose pass forms v_new from A (float64 runs
    refgdn: no keys). ``device``: the device whose SM count picks the state pass's BV (default q's).
    cu_seqlens_cpu changes no other key (the kernels read a checked copy of cu_seqlens in its dtype).
    offsets_known: whether the host holds cu_seqlens' values when the op runs (cu_seqlens_cpu given, or read
    earlier in the same one_host_read scope, as the model's prefill does through its conv); None: cu_seqlens_cpu
    is given or they are known in the current scope. Varlen with N >= 2 without them, and without autograd or
    torch.compile (the custom op checks first), also builds every kernel's chunk tables on the device
    (chunk_table_kernel's EVERY form: fast.chunk's offsets_unchecked; kernel 1's alone with slots, checkpoints or
    in_rows). slots: gdn_prefill's form (initial_state a cache's
    ssm_state, read and written in place at int32 slot rows: the state pass's H0_SLOTS / HT_SLOTS). fla's keywords
    as the op maps them (refgdn.checks.fla_keywords: beta from logits in float32, gating on or off). beta_logits
    1 / 2: beta holds logits the kernels take (gdn_prefill's raw b, with fla's keywords at their defaults;
    chunk_gated_delta_rule_fwd's beta_logits). device_tables: every kernel's tables built on the device
    (chunk_gated_delta_rule_fwd's offsets_on_device: vLLM's chunk op), one chunk_table_kernel launch for all.
    checkpoints: (ck, starts[, every, page ids]) tensors of chunk_gated_delta_rule_fwd's checkpoints (FlashInfer's;
    the state pass's CKPT, with page ids its CK_PAGED; not pipelined), else None. in_rows: FlashInfer's paged
    prefill (chunk_gated_delta_rule_fwd's in_rows: q, k, v, o at the caller's rows, the kernels' IN_ROWS; q's
    shape then gives the kernels' rows)."""
    beta, initial_state, A_log, dt_bias = _fla_mapped(q, v, beta, initial_state, A_log, dt_bias, cu_seqlens,
                                                      use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                                                      use_gate_in_kernel, chunk_indices, cp_context, head_first)
    if _fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return []
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    BT = chunk_size
    varlen = cu_seqlens is not None and N != 1             # one sequence runs as the dense B = 1 call
    cu_seqlens = cu_seqlens if varlen else None
    precise = _chunk._precise(v.dtype)
    l2 = bool(use_qk_l2norm_in_kernel)
    BK, _ = _chunk._blocks(K, V)
    cu, tab = _dt(cu_seqlens), (_I32 if varlen else None)
    total = T > 0 if varlen else B * cdiv(T, BT) > 0           # some chunk exists
    interp = is_interpreting()
    dev = device if device is not None else q.device
    fused = _chunk.forward_fuses_output(N, T, BT, HV, K, V, dev)   # the state pass forms o too (no kernel 4)
    out = []

    def opts(cfg):
        return {k_: v_ for k_, v_ in cfg.items() if k_ in ("num_warps", "num_stages", "maxnreg")}

    kdt = k.dtype
    if offsets_known is None:
        offsets_known = cu_seqlens_cpu is not None or (varlen and host_offsets_known(cu_seqlens))
    from . import library as _library                     # (imports fast.chunk: not at module level)
    if varlen and not _library.wants_graph(q, k, v, g, beta, initial_state, A_log, dt_bias):
        if device_tables:
            out.append(_table_key(BT, cu_seqlens.dtype, every=True))
        elif not offsets_known:
            # the public op's tables for every kernel, its values checked after the launches
            # (chunk_gated_delta_rule_fwd's late check); with a slot cache, checkpoints or the caller's rows: kernel
            # 1's table alone
            out.append(_table_key(BT, cu_seqlens.dtype, every=not slots and checkpoints is None and not in_rows))
    if total and HV:
        out.append(CompileKey.make(
            "chunk_kkt_inv_kernel",
            dict(H=H, HV=HV, GROUP=HV // H, K=K, BT=BT, BK=_chunk._blocks(K, 16)[0], IS_VARLEN=varlen,
                 GATE=A_log is not None, L2NORM=l2, LOAD_G=False, STORE_G=True, DO_A=True,
                 HPP=_chunk.kkt_heads_per_program(HV // H),
                 PREC=_chunk._fp32_prec(kdt), INV_PREC=_chunk.INV_PRECISION[kdt],
                 INV_DIAG_PREC=_chunk.INV_DIAG_PRECISION[kdt], INV_ROWS=_chunk._inv_rows(None, kdt), DOT_F32=interp,
                 UPCAST=False,
                 PRECISE=precise, THRESHOLD=_chunk.SOFTPLUS_THRESHOLD, EPS=_chunk.L2NORM_EPS,
                 BETA_LOGITS=beta_logits, IN_ROWS=in_rows),
            dict(k=kdt, g=g.dtype, beta=beta.dtype, A_log=_dt(A_log), dt_bias=_dt(dt_bias), G=_F32, Gl=_F32, A=kdt,
                 kn=kdt if l2 else None, cu_seqlens=cu, chunk_indices=tab, in_rows=_I32 if in_rows else None),
            opts(_chunk._cfg("kkt", _chunk.kkt_config(K)))))
    if fused and l2 and B * T * H:                          # q's row scales for the fused pass (output.py)
        cfg = _chunk._cfg("row_scales", _chunk.row_scales_config(K))
        out.append(CompileKey.make(
            "row_scales_kernel", dict(H=H, K=K, BM=cfg["BM"], BK=next_pow2(K), EPS=_chunk.L2NORM_EPS),
            dict(x=q.dtype, s=_F32), opts(cfg)))
    if N * HV:
        cfg = _chunk._cfg("state", _chunk.state_config(N, HV, K, V, dev, fused=fused, itemsize=k.element_size()))
        # the launcher passes stand-ins for the tensors a path does not read (fast.chunk.state._launch_state)
        hv_new = dict(h=v.dtype, v_new=v.dtype) if fused else dict(h=k.dtype, v_new=v.dtype)
        wy = dict(w=v.dtype, u=v.dtype, A=k.dtype, v=v.dtype, beta=beta.dtype)     # v_new from A (FROM_A)
        qo = dict(q=q.dtype, o=v.dtype) if fused else dict(q=k.dtype, o=v.dtype)
        out.append(CompileKey.make(
            "chunk_state_kernel",
            dict(HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=cfg["BV"], IS_VARLEN=varlen,
                 USE_H0=initial_state is not None, STORE_HT=bool(output_final_state),
                 PREC=_chunk._fp32_prec(k.dtype), DOT_F32=interp, PRECISE=precise, UPCAST=False, FROM_A=True,
                 OUTPUT=fused, L2NORM=l2 and fused, EPS=_chunk.L2NORM_EPS,
                 PREFETCH_BETA=_chunk.state_prefetch_beta(fused, varlen, beta.dtype, l2 and fused),
                 UPDATE_X2=slots and _serving.prefill_update_x2(k.dtype), H0_SLOTS=slots,
                 HT_SLOTS=slots and bool(output_final_state), BETA_LOGITS=beta_logits,
                 VN_SPLIT=False, CKPT=checkpoints is not None,      # (VN_SPLIT: the backward's recompute only)
                 CK_PAGED=checkpoints is not None and len(checkpoints) > 3, IN_ROWS=in_rows,
                 K_IN_ROWS=in_rows and not l2),
            dict(k=k.dtype, G=_F32, Gl=_F32, h0=_dt(initial_state),
                 ck=_dt(checkpoints[0]) if checkpoints else None,
                 ck_starts=_dt(checkpoints[1]) if checkpoints else None,
                 ck_idx=_dt(checkpoints[3]) if checkpoints and len(checkpoints) > 3 else None,
                 ht=(initial_state.dtype if slots else _F32) if output_final_state else None,
                 cu_seqlens=cu, chunk_offsets=tab, seq_order=tab, slot_rows=_I32 if slots else None, qs=_F32,
                 in_rows=_I32 if in_rows else None,
                 **hv_new, **wy, **qo),
            opts(cfg)))
    if total and HV and not fused:
        cfg = _chunk._cfg("output", _chunk.output_config(K, V, dev, q.element_size()))
        out.append(CompileKey.make(
            "chunk_output_kernel",
            dict(HV=HV, GROUP=HV // H, K=K, V=V, BT=BT, BK=BK, BV=cfg["BV"], IS_VARLEN=varlen, L2NORM=l2,
                 PREC=_chunk._fp32_prec(q.dtype), DOT_F32=interp, PRECISE=precise, EPS=_chunk.L2NORM_EPS,
                 IN_ROWS=in_rows, K_IN_ROWS=in_rows and not l2),
            dict(q=q.dtype, k=k.dtype, v_new=v.dtype, h=k.dtype, G=_F32, Gl=_F32, o=v.dtype, cu_seqlens=cu,
                 chunk_indices=tab, in_rows=_I32 if in_rows else None),
            opts(cfg)))
    return out


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, *,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                               use_gate_in_kernel=None, chunk_indices=None, cp_context=None,
                               head_first=False) -> List[CompileKey]:
    """Keys of fast.recurrent_gated_delta_rule: one kernel (float64 runs refgdn: no keys; beta's logits in the
    kernel as the op takes them: fast.chunk.kernel_beta_logits)."""
    logits = _chunk.kernel_beta_logits(use_beta_sigmoid_in_kernel, allow_neg_eigval, q, k, v, g, beta, initial_state,
                                       A_log, dt_bias)
    if logits:                                                # (the kernel reads the logits)
        use_beta_sigmoid_in_kernel = allow_neg_eigval = False
    beta, initial_state, A_log, dt_bias = _fla_mapped(q, v, beta, initial_state, A_log, dt_bias, cu_seqlens,
                                                      use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                                                      use_gate_in_kernel, chunk_indices, cp_context, head_first)
    if _fp64(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return []
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    if N * HV == 0:
        return []
    cfg = _chunk._cfg("recurrent", _chunk.recurrent_config(K, V))
    return [CompileKey.make(
        "recurrent_kernel",
        dict(HV=HV, GROUP=HV // H, K=K, V=V, BK=next_pow2(K), BV=cfg["BV"], IS_VARLEN=cu_seqlens is not None,
             GATE=A_log is not None, L2NORM=bool(use_qk_l2norm_in_kernel), USE_H0=initial_state is not None,
             STORE_HT=bool(output_final_state), THRESHOLD=_chunk.SOFTPLUS_THRESHOLD, EPS=_chunk.L2NORM_EPS,
             PRECISE=_chunk._precise(v.dtype), BETA_LOGITS=logits),
        dict(q=q.dtype, k=k.dtype, v=v.dtype, g=g.dtype, beta=beta.dtype, A_log=_dt(A_log), dt_bias=_dt(dt_bias),
             h0=_dt(initial_state), o=v.dtype, ht=_F32 if output_final_state else None, cu_seqlens=_dt(cu_seqlens)),
        {k_: v_ for k_, v_ in cfg.items() if k_ in ("num_warps", "num_stages", "maxnreg")})]


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None) -> List[CompileKey]:
    """Keys of fast.fused_recurrent_gated_delta_rule: recurrent_gated_delta_rule's, on the arguments it maps."""
    args, kwargs = fla_recurrent_arguments(q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                           use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens)
    return recurrent_gated_delta_rule(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# vLLM's vendored fla ops (fast.vllm_ops): traced_ops(fast.vllm_ops, keys=fast.keys.vllm_ops)
# ----------------------------------------------------------------------------------------------

def _vllm_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, *,
                                 chunk_indices=None, chunk_offsets=None, core_attn_out=None,
                                 state_layout="kv", check_values=False) -> List[CompileKey]:
    """Keys of fast.vllm_ops.chunk_gated_delta_rule: chunk_gated_delta_rule's, on the arguments it passes ("vk"
    states as their [N, HV, K, V] views; core_attn_out takes o or a copy of it, no kernel). Its device-table path
    (varlen, check_values False) launches the kernels of the public op's varlen call on tables that one
    chunk_table_kernel launch builds for every kernel (EVERY: the int32 offsets and the longest-first order too),
    with the same specialisations (int32 tables, the offsets' dtype)."""
    if state_layout == "vk" and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                  use_qk_l2norm_in_kernel, head_first=head_first,
                                  device_tables=check_values is False)


def _slots_keys(*args, **kwargs) -> List[CompileKey]:
    """recurrent_slots_kernel's key from the plan the serving ops launch with (fast.chunk.recurrent.slots_launch,
    same arguments; meta tensors do); none when there is nothing to launch."""
    plan = _rec.slots_launch(*args, **kwargs)
    if plan is None:
        return []
    _, kernel_args, constexprs, options = plan
    return [CompileKey.make("recurrent_slots_kernel", constexprs,
                            {name: _dt(t) for name, t in zip(_rec.SLOTS_TENSORS, kernel_args)},
                            {k_: v_ for k_, v_ in options.items() if k_ in ("num_warps", "num_stages", "maxnreg")})]


def _meta(*shape, dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _vllm_fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None,
                                           inplace_final_state=True, cu_seqlens=None, ssm_state_indices=None,
                                           num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, *,
                                           retrieve_parent_token=None, check_values=False, state_layout="kv",
                                           null_block_id=-1) -> List[CompileKey]:
    """Keys of fast.vllm_ops.fused_recurrent_gated_delta_rule: one recurrent_slots_kernel (float64: refgdn, none)."""
    beta = _meta(*g.shape, dtype=q.dtype) if beta is None else beta      # (None: ones in q's dtype)
    if _fp64(q, k, v, g, beta, initial_state):
        return []
    return _slots_op_keys(q, k, v, g, beta, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                          num_accepted_tokens, use_qk_l2norm_in_kernel, state_layout == "vk", null_block_id, v.dtype)


def _slots_op_keys(q, k, v, g, beta, initial_state, inplace, cu_seqlens, idx, num_acc, l2norm, vk, null_block_id,
                   o_dtype, A_log=None, dt_bias=None) -> List[CompileKey]:
    """fast.vllm_ops._slots_op's launch, mirrored: the pool and per-token states through their [.., K, V] views."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    pool = initial_state.transpose(-1, -2) if vk and initial_state is not None else initial_state
    if inplace:
        hs = pool
        write = _rec.WRITE_EACH_SLOT if idx is not None and idx.dim() == 2 else _rec.WRITE_FINAL
    else:
        hs = _meta(B * T, HV, *((V, K) if vk else (K, V)), dtype=initial_state.dtype if initial_state is not None
                   else _F32)
        hs = hs.transpose(-1, -2) if vk else hs
        write = _rec.WRITE_EACH_ROW
    return _slots_keys(q, k, v, g, beta, pool, _meta(B, T, HV, V, dtype=o_dtype), hs, H=H,
                       L=idx.shape[1] if idx is not None and idx.dim() == 2 else 1, scale=1.0, write=write,
                       l2norm=l2norm, cu_seqlens=cu_seqlens, idx=idx, num_acc=num_acc, A_log=A_log, dt_bias=dt_bias,
                       gate=A_log is not None, slot_lo=null_block_id + 1)


def _vllm_fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None,
                                                 initial_state=None, inplace_final_state=True, cu_seqlens=None,
                                                 ssm_state_indices=None, num_accepted_tokens=None,
                                                 use_qk_l2norm_in_kernel=False, is_kda=False, *,
                                                 check_values=False) -> List[CompileKey]:
    """Keys of fast.vllm_ops.fused_sigmoid_gating_delta_rule_update: one recurrent_slots_kernel with the gates formed
    in it (float64: refgdn, none)."""
    if _fp64(q, k, v, a, b, A_log, dt_bias, initial_state):
        return []
    B, T = q.shape[:2]
    return _slots_op_keys(q, k, v, a.reshape(B, T, -1), b.reshape(B, T, -1), initial_state, inplace_final_state,
                          cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel, True, 0,
                          sigmoid_gating_out_dtype(q, initial_state), A_log, dt_bias)


def _vllm_fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                         ssm_state_indices, use_qk_l2norm_in_kernel=False, *,
                                                         check_values=False) -> List[CompileKey]:
    """Keys of fast.vllm_ops.fused_recurrent_gated_delta_rule_packed_decode: one recurrent_slots_kernel with the
    gates formed in it (float64: refgdn, none; no request: none)."""
    if _fp64(mixed_qkv, a, b, A_log, dt_bias, initial_state):
        return []
    B = mixed_qkv.shape[0]
    HV, V, K = initial_state.shape[1:]
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    q = _meta(B, 1, H, K, dtype=mixed_qkv.dtype)                  # (views of the packed rows: only dtypes count)
    pool = initial_state.transpose(-1, -2)
    return _slots_keys(q, q, _meta(B, 1, HV, V, dtype=mixed_qkv.dtype), a[:, None], b[:, None], pool, out, pool, H=H,
                       L=1, scale=1.0, write=_rec.WRITE_FINAL, l2norm=use_qk_l2norm_in_kernel, idx=ssm_state_indices,
                       A_log=A_log, dt_bias=dt_bias, gate=True, slot_lo=1)


def _vllm_fused_gdn_gating(A_log, a, b, dt_bias, beta=1.0, threshold=20.0) -> List[CompileKey]:
    """Keys of fast.vllm_ops.fused_gdn_gating: gdn_gating's."""
    return gdn_gating(A_log, a, dt_bias, b)


def _vllm_fused_post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim,
                               apply_l2norm=True, output_g_exp=False) -> List[CompileKey]:
    """Keys of fast.vllm_ops.fused_post_conv_prep: one post_conv_prep_kernel (float64: refgdn, none; no token: none)."""
    from .gating import SOFTPLUS_THRESHOLD, post_conv_prep_config
    if _fp64(conv_output, a, b, A_log, dt_bias) or conv_output.shape[0] == 0:
        return []
    H, HV, K, V = num_k_heads, A_log.shape[0], head_k_dim, head_v_dim
    cfg = post_conv_prep_config(H, HV, K, V)
    x = conv_output.dtype
    return [CompileKey.make(
        "post_conv_prep_kernel",
        dict(H=H, HV=HV, K=K, V=V, BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], L2NORM=apply_l2norm, G_EXP=output_g_exp,
             THRESHOLD=SOFTPLUS_THRESHOLD, EPS=_chunk.L2NORM_EPS, PRECISE=_chunk._precise(x)),
        dict(x=x, a=a.dtype, b=b.dtype, A_log=A_log.dtype, dt_bias=dt_bias.dtype, q=x, k=x, v=x, g=_F32, beta=_F32),
        dict(num_warps=cfg["num_warps"]))]


def _vllm_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                               num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, pad_slot_id=-1,
                               block_idx_last_scheduled_token=None, initial_state_idx=None,
                               retrieve_parent_token=None, validate_data=False, *,
                               check_values=False) -> List[CompileKey]:
    """Keys of fast.vllm_ops.causal_conv1d_update: one conv_update_slots_kernel (none for an empty call)."""
    B = x.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
    if x.numel() == 0 or B == 0:
        return []
    D, W, C = x.shape[1], weight.shape[1], conv_state.shape[2]
    act = "silu" if activation is True else (None if activation is False else activation)
    cfg = _conv.vllm_conv_update_config(D, B, x.numel() // D)      # tokens in all, in any of x's layouts
    return [CompileKey.make(
        "conv_update_slots_kernel",
        dict(D=D, C=C, W=W, BD=cfg["BD"], CP=next_pow2(C), SILU=act in ("silu", "swish"), HAS_BIAS=bias is not None,
             INDEXED=conv_state_indices is not None, SPEC=num_accepted_tokens is not None,
             VARLEN=query_start_loc is not None,
             FP64=any(t.dtype == torch.float64 for t in (x, weight, conv_state))),
        dict(x=x.dtype, conv_state=conv_state.dtype, weight=weight.dtype, bias=_dt(bias), y=x.dtype,
             idx=_dt(conv_state_indices), num_acc=_dt(num_accepted_tokens), qsl=_dt(query_start_loc)),
        dict(num_warps=cfg["num_warps"]))]


def _vllm_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                           activation="silu", pad_slot_id=-1, block_idx_first_scheduled_token=None,
                           block_idx_last_scheduled_token=None, initial_state_idx=None, num_computed_tokens=None,
                           block_size_to_align=0, metadata=None, validate_data=False, *,
                           check_values=False) -> List[CompileKey]:
    """Keys of fast.vllm_ops.causal_conv1d_fn: its slot rows and tile table on the device (vllm_conv_rows_kernel,
    chunk_table_kernel), then causal_conv1d's slot form (gdn_prefill's conv), on x [D, T] seen as [1, T, D] in
    conv_states' dtype (float64: refgdn, none)."""
    if _fp64(x, weight, bias, conv_states):
        return []
    D, T = x.shape
    B = query_start_loc.shape[0] - 1
    if B == 0 or T == 0 or D == 0:
        return []
    act = "silu" if activation is True else (None if activation is False else activation)
    xs = torch.empty(1, T, D, dtype=conv_states.dtype, device="meta")
    rows = CompileKey.make("vllm_conv_rows_kernel", dict(BN=_conv.VLLM_ROWS_BLOCK, INDEXED=cache_indices is not None,
                                                        HAS_FLAGS=has_initial_state is not None),
                           dict(idx=_dt(cache_indices), init=_dt(has_initial_state), rows=_I32), dict(num_warps=4))
    qdt = query_start_loc.dtype                           # its tile table, built on the device (no host read)
    table = _table_key(_serving.PREFILL_CHUNK, qdt)
    return [rows, table] + causal_conv1d(xs, weight, bias, act, conv_states, True, query_start_loc, device=x.device,
                                         slots=True, pad_zero=True)


class vllm_ops:
    """Keys of fast.vllm_ops's ops, under their names (refgdn.capture.traced_ops(fast.vllm_ops, keys=vllm_ops))."""
    causal_conv1d_fn = staticmethod(_vllm_causal_conv1d_fn)
    causal_conv1d_update = staticmethod(_vllm_causal_conv1d_update)
    chunk_gated_delta_rule = staticmethod(_vllm_chunk_gated_delta_rule)
    fused_gdn_gating = staticmethod(_vllm_fused_gdn_gating)
    fused_post_conv_prep = staticmethod(_vllm_fused_post_conv_prep)
    fused_recurrent_gated_delta_rule = staticmethod(_vllm_fused_recurrent_gated_delta_rule)
    fused_recurrent_gated_delta_rule_packed_decode = staticmethod(_vllm_fused_recurrent_gated_delta_rule_packed_decode)
    fused_sigmoid_gating_delta_rule_update = staticmethod(_vllm_fused_sigmoid_gating_delta_rule_update)


# ----------------------------------------------------------------------------------------------
# SGLang's fused decode op (fast.sglang_ops): traced_ops(fast.sglang_ops, keys=fast.keys.sglang_ops)
# ----------------------------------------------------------------------------------------------

def _sglang_fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                                   initial_state_source, initial_state_indices, scale=None,
                                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False,
                                                   disable_state_update=False, intermediate_states_buffer=None,
                                                   intermediate_state_indices=None, cache_steps=None,
                                                   retrieve_parent_token=None, *, check_values=False
                                                   ) -> List[CompileKey]:
    """Keys of fast.sglang_ops.fused_sigmoid_gating_delta_rule_update: one recurrent_slots_kernel with the gates
    formed in it (float64: refgdn, none; no token or sequence: none)."""
    if _fp64(q, k, v, a, b, A_log, dt_bias, initial_state_source):
        return []
    B, T, H, K = q.shape
    steps = 0 if intermediate_states_buffer is None else intermediate_states_buffer.shape[1]
    pool = initial_state_source.transpose(-1, -2)
    buf = intermediate_states_buffer
    if buf is None:
        hs, write, table = pool, _rec.WRITE_NONE if disable_state_update else _rec.WRITE_FINAL, None
    else:                                               # verify: every token's state to the buffer (rows by sequence)
        hs, write = buf.flatten(0, 1).transpose(-1, -2), _rec.WRITE_EACH_SLOT
        table = intermediate_state_indices
    return _slots_keys(q, k, v, a.reshape(B, T, -1), b.reshape(B, T, -1), pool, v, hs, H=H, L=max(steps, 1),
                       scale=1.0, write=write, l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                       idx=initial_state_indices, A_log=A_log, dt_bias=dt_bias, widx=table, cache=buf is not None,
                       gate=True, pad_zero=False)


class sglang_ops:
    """Keys of fast.sglang_ops's op, under its name (refgdn.capture.traced_ops(fast.sglang_ops, keys=sglang_ops))."""
    fused_sigmoid_gating_delta_rule_update = staticmethod(_sglang_fused_sigmoid_gating_delta_rule_update)


# ----------------------------------------------------------------------------------------------
# FlashInfer's GDN ops (fast.flashinfer_ops): traced_ops(fast.flashinfer_ops, keys=fast.keys.flashinfer_ops)
# ----------------------------------------------------------------------------------------------

def _meta_like(t):
    """t as a meta tensor of its sizes, strides and dtype (None for None): the key functions below run the ops' own
    argument glue (fast.flashinfer_ops) on these, so nothing is computed or allocated on a device."""
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _fi_chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
                               state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0,
                               use_cp=False, *, check_values=False) -> List[CompileKey]:
    """Keys of fast.flashinfer_ops.chunk_gated_delta_rule: the chunked forward's on the device tables, on the
    arguments fast.flashinfer_ops.prefill_core_inputs forms (float64: refgdn, none)."""
    from .flashinfer_ops import prefill_core_inputs
    if _fp64(q, g, beta, initial_state, output_state):
        return []
    q4, k4, v4, g4, beta4, h0 = prefill_core_inputs(*(_meta_like(t) for t in (q, k, v, g, beta, initial_state)))
    return chunk_gated_delta_rule(q4, k4, v4, g4, beta4, scale, h0, output_final_state or output_state is not None,
                                  cu_seqlens, use_qk_l2norm_in_kernel, device=q.device, device_tables=True,
                                  checkpoints=(state_checkpoints, checkpoint_cu_starts) if checkpoint_every_n_tokens
                                  else None)


def _fi_decode(q, k, v, states, A_log, a, b, dt_bias, use_qk_l2norm, idx, out_idx, buf, frozen, vk, tokens=None):
    """recurrent_slots_kernel's key for a FlashInfer decode entry point (float64: refgdn, none)."""
    from .flashinfer_ops import decode_launch_args
    if _fp64(q, a, b, A_log, dt_bias, states, buf):
        return []
    B, T, _, K = q.shape
    o = _meta(B, T, v.shape[2], v.shape[3], dtype=q.dtype)
    pos, kw = decode_launch_args(*(_meta_like(t) for t in (q, k, v, states, A_log, a, b, dt_bias)), use_qk_l2norm,
                                 *(_meta_like(t) for t in (idx, out_idx, buf)), frozen, vk, o, _meta_like(tokens))
    return _slots_keys(*pos, scale=1.0, **kw)


def _fi_gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None,
                                             use_qk_l2norm=True, initial_state=None, initial_state_indices=None,
                                             output_state_indices=None, *, intermediate_states_buffer=None,
                                             disable_state_update=False, check_values=False) -> List[CompileKey]:
    """Keys of fast.flashinfer_ops.gated_delta_rule_decode_pretranspose: one recurrent_slots_kernel."""
    return _fi_decode(q, k, v, initial_state if initial_state is not None else state, A_log, a, b, dt_bias,
                      use_qk_l2norm, initial_state_indices, output_state_indices, intermediate_states_buffer,
                      disable_state_update, True)


def _fi_gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True, *,
                                check_values=False) -> List[CompileKey]:
    """Keys of fast.flashinfer_ops.gated_delta_rule_decode: one recurrent_slots_kernel on the K-major state."""
    return _fi_decode(q, k, v, state, A_log, a, b, dt_bias, use_qk_l2norm, None, None, None, False, False)


def _fi_gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None,
                             output=None, intermediate_states_buffer=None, ssm_state_indices=None,
                             disable_state_update=None, use_qk_l2norm=True, output_state_indices=None, *,
                             check_values=False) -> List[CompileKey]:
    """Keys of fast.flashinfer_ops.gated_delta_rule_mtp: one recurrent_slots_kernel (disable_state_update None:
    True, FlashInfer's default)."""
    frozen = True if disable_state_update is None else disable_state_update
    return _fi_decode(q, k, v, initial_state, A_log, a, b, dt_bias, use_qk_l2norm, initial_state_indices,
                      output_state_indices, intermediate_states_buffer, frozen, True, ssm_state_indices)


def _fi_chunk_gated_delta_rule_paged(q, k, v, g=None, beta=None, scale=None, *, cu_seqlens, state_pool, page_indices,
                                     page_indptr, page_size, last_page_len, use_qk_l2norm_in_kernel=False,
                                     output=None, gate_domain="linear", use_gate_in_kernel=False, A_log=None,
                                     dt_bias=None, beta_is_logit=False, slots=None,
                                     check_values=False) -> List[CompileKey]:
    """Keys of fast.flashinfer_ops.chunk_gated_delta_rule_paged: the chunked forward on the chunk-aligned rows (T +
    63 N; float32 gates; q, k, v at the caller's rows: in_rows) from and into the pool's [K, V] view at slot rows,
    with the paged checkpoints (float64: refgdn, none)."""
    from . import paged as _paged
    from .flashinfer_ops import gqa_to_gva
    if _fp64(q, g, beta, A_log, dt_bias, state_pool):
        return []
    N = cu_seqlens.shape[0] - 1
    Tp = q.shape[0] + 63 * N
    q, k, v = gqa_to_gva(*(_meta_like(t) for t in (q, k, v)))
    sab = max(q.shape[1], v.shape[1])
    i32 = lambda *s: _meta(*s, dtype=torch.int32)  # noqa: E731
    cu_p = _meta(N + 1, dtype=cu_seqlens.dtype)
    out = []
    for kernel, names, plan in (
            ("paged_rows_kernel", _paged.ROWS_TENSORS, _paged.rows_launch(
                cu_seqlens, page_indices, page_indptr, last_page_len,
                tuple(slots) if slots is not None else (i32(N),) * 4, cu_p, i32(N, 3), i32(N, 2), i32(N, 3), page_size,
                0, 1, slots is not None)),
            ("paged_gates_kernel", _paged.GATES_TENSORS, _paged.gates_launch(
                g, beta, A_log, dt_bias, cu_p, i32(N, 3), (_meta(Tp, sab, dtype=torch.float32),) * 2,
                *_paged.modes(g, beta, gate_domain, use_gate_in_kernel, beta_is_logit), _fi_floor()))):
        _, args, constexprs, options = plan
        out.append(CompileKey.make(kernel, constexprs, {n: _dt(t) for n, t in zip(names, args)}, options))
    q4, k4, v4 = (_meta(1, Tp, *x.shape[1:], dtype=x.dtype) for x in (q, k, v))     # (the kernels' rows)
    g4 = beta4 = _meta(1, Tp, v.shape[1], dtype=torch.float32)
    pool = _meta_like(state_pool).transpose(-1, -2)
    return out + chunk_gated_delta_rule(q4, k4, v4, g4, beta4, scale, pool, True, cu_seqlens,
                                        use_qk_l2norm_in_kernel, device=q.device, device_tables=True, slots=True,
                                        checkpoints=(pool, _meta(N, 3, dtype=torch.int32), page_size // 64,
                                                     page_indices), in_rows=True)


def _fi_floor() -> float:
    from .flashinfer_ops import LOG_DECAY_FLOOR
    return LOG_DECAY_FLOOR


def _fi_gated_delta_rule_decode_paged(q, k, v, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True, *,
                                      state_pool, page_indices, page_indptr, last_page_len, backend="auto",
                                      slots=None, check_values=False) -> List[CompileKey]:
    """Keys of fast.flashinfer_ops.gated_delta_rule_decode_paged: one recurrent_slots_kernel on the pool at the page
    table's rows (int32 [B] from gdn_paged_decode_slots, or the slots given)."""
    B = q.shape[0]
    idx, out_idx = (slots if slots is not None else (_meta(B, dtype=torch.int32),) * 2)
    return _fi_decode(q, k, v, state_pool, A_log, a, b, dt_bias, use_qk_l2norm, idx, out_idx, None, False, True)


class flashinfer_ops:
    """Keys of fast.flashinfer_ops's ops, under their names (refgdn.capture.traced_ops(fast.flashinfer_ops,
    keys=flashinfer_ops))."""
    chunk_gated_delta_rule = staticmethod(_fi_chunk_gated_delta_rule)
    gated_delta_rule_decode_pretranspose = staticmethod(_fi_gated_delta_rule_decode_pretranspose)
    gated_delta_rule_decode = staticmethod(_fi_gated_delta_rule_decode)
    gated_delta_rule_mtp = staticmethod(_fi_gated_delta_rule_mtp)
    chunk_gated_delta_rule_paged = staticmethod(_fi_chunk_gated_delta_rule_paged)
    gated_delta_rule_decode_paged = staticmethod(_fi_gated_delta_rule_decode_paged)
