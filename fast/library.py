"""torch.library registration of fast's differentiable ops: custom ops with fake (meta) implementations
and registered autograd, so ``torch.compile(fullgraph=True)`` keeps them in one graph, forward and backward.

    torch.ops.fast.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                          use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size)
        -> (o, final_state, A, G, kn)      (A, G, kn: kernel 1's outputs kept for the backward, or empty)
    torch.ops.fast.chunk_gated_delta_rule_bwd(do, dht, <the forward's inputs>, A, G, kn)
        -> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
    torch.ops.fast.causal_conv1d(x, weight, bias, activation, initial_state, cu_seqlens) -> (y, final_state)
    torch.ops.fast.causal_conv1d_bwd(dy, dfinal, <the forward's inputs>) -> (dx, dweight, dbias, dinitial_state)
    torch.ops.fast.rms_norm_gated(x, g, weight, bias, activation, eps) -> y
    torch.ops.fast.rms_norm_gated_bwd(dy, <the forward's inputs>) -> (dx, dg, dweight, dbias)
    torch.ops.fast.rms_norm(x, weight, bias, residual, eps, unit_offset, res_dtype) -> (y, x + residual or empty)
    torch.ops.fast.rms_norm_bwd(dy, dres_out, <the forward's inputs>) -> (dx, dweight, dbias, dresidual)

Users call fast.chunk_gated_delta_rule / fast.causal_conv1d / fast.rms_norm_gated / fast.rms_norm: they validate on
the host, then take the op when a gradient is wanted or torch.compile is tracing (plain inference calls the kernels
directly and pays no dispatcher overhead). The ops always return the final state (a custom op's outputs cannot depend
on a flag's value being None); the public functions drop it unless output_final_state.

Custom ops cannot return None: gradients that do not exist (no initial state, no fused gating, no bias)
come back from the backward ops as empty tensors and are mapped to None in the autograd formula.

What is saved for backward: the inputs (see fast.chunk_bwd and fast.conv_bwd for why the rest is recomputed),
and, for the chunked rule where the backward would rerun the forward's kernel 1 exactly
(fast.chunk_bwd.reuses_forward_kkt: bf16 by default), that kernel's outputs A, G and the normalised k, as fla
keeps A and G: the backward then skips it. The forward op returns them as three more outputs (empty tensors
where not kept) so autograd can save them; they are not differentiable. ``scale`` arrives as a float (the
public function fills in the K ** -0.5 default).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from refgdn.checks import check_cu_seqlens_values, one_host_read_scope

from . import chunk as _chunk
from . import chunk_bwd as _chunk_bwd
from . import conv as _conv
from . import conv_bwd as _conv_bwd
from . import norm as _norm


def _check_cu_values(cu_seqlens: Optional[Tensor], T: int) -> None:
    """cu_seqlens' values, when the public function could not read them: under torch.compile the host
    validation sees fake tensors (refgdn.checks.check_cu_seqlens leaves the values to this check, which
    runs with the real tensors when the compiled graph runs; the same ValueError). Eager calls were
    checked already: inside the public function's one_host_read scope this re-check reads nothing new."""
    if cu_seqlens is not None:
        check_cu_seqlens_values(cu_seqlens, T)


def _none_if_empty(t: Tensor, keep: bool) -> Optional[Tensor]:
    return t if keep else None


# ============================================================================================
# chunked gated delta rule
# ============================================================================================

@torch.library.custom_op("fast::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                              initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                              use_qk_l2norm_in_kernel: bool, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                              chunk_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] -> (o [B, T, HV, V], final_state [N, HV, K, V]
    fp32, A [B, T, HV, chunk_size], G [B, T, HV] fp32, kn [B, T, H, K]): the last three kernel 1's outputs where
    the backward reuses them (_keeps_kkt), else empty (kn also without use_qk_l2norm_in_kernel)."""
    with one_host_read_scope():                     # the check and the forward's tables share one read
        _check_cu_values(cu_seqlens, q.shape[1])
        if not _keeps_kkt(v):
            o, final = _chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, True, cu_seqlens,
                                                         use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size)
            return o, final, _empty(q), _empty(q), _empty(q)
        o, final, (A, G, kn) = _chunk.chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale, initial_state, True, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
            chunk_size, keep_kkt=True)
        return o, final, A, G, kn if kn is not None else _empty(q)


def _keeps_kkt(v: Tensor) -> bool:
    """The forward keeps kernel 1's outputs for the backward (by the inputs' dtype: v's, the op's compute dtype)."""
    return _chunk_bwd.reuses_forward_kkt(v.dtype)


def _empty(like: Tensor) -> Tensor:
    """A fresh empty stand-in for an output that is not kept (custom ops' outputs may not alias)."""
    return like.new_empty(0, dtype=torch.float32)


@chunk_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o, final = q.new_empty(B, T, HV, V, dtype=v.dtype), q.new_empty(N, HV, K, V, dtype=torch.float32)
    if not _keeps_kkt(v):
        return o, final, _empty(q), _empty(q), _empty(q)
    return (o, final, q.new_empty(B, T, HV, chunk_size, dtype=k.dtype), q.new_empty(B, T, HV, dtype=torch.float32),
            q.new_empty(B, T, H, K, dtype=k.dtype) if use_qk_l2norm_in_kernel else _empty(q))


@torch.library.custom_op("fast::chunk_gated_delta_rule_bwd", mutates_args=())
def chunk_gated_delta_rule_bwd_op(do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                                  beta: Tensor, scale: float, initial_state: Optional[Tensor],
                                  cu_seqlens: Optional[Tensor], use_qk_l2norm_in_kernel: bool,
                                  A_log: Optional[Tensor], dt_bias: Optional[Tensor], chunk_size: int,
                                  A: Optional[Tensor] = None, G: Optional[Tensor] = None,
                                  kn: Optional[Tensor] = None
                                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias); absent ones (no initial state / gating) are empty.
    A, G, kn: the forward op's kept kernel 1 outputs (empty or None: not kept; kernel 1 reruns)."""
    kkt = None
    if A is not None and G is not None and A.numel() > 0 and G.numel() > 0:
        kkt = (A, G, kn if kn is not None and kn.numel() > 0 else None)
    out = _chunk_bwd.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens,
                                                use_qk_l2norm_in_kernel, A_log, dt_bias, chunk_size, kkt=kkt)
    # a fresh empty tensor per absent gradient: a custom op's returns may not alias each other
    return tuple(t if t is not None else q.new_empty(0, dtype=torch.float32) for t in out)


@chunk_gated_delta_rule_bwd_op.register_fake
def _(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
      chunk_size, A=None, G=None, kn=None):
    def empty():
        return q.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            v.new_empty(v.shape), g.new_empty(g.shape), beta.new_empty(beta.shape),
            initial_state.new_empty(initial_state.shape) if initial_state is not None
            else empty(),
            torch.empty_like(A_log) if A_log is not None else empty(),
            torch.empty_like(dt_bias) if dt_bias is not None else empty())


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, l2, A_log, dt_bias, chunk_size = inputs
    _, _, A, G, kn = output
    # saved: the inputs, and kernel 1's outputs where the forward kept them (empty otherwise); the backward
    # recomputes the rest: w, u, h, v_new (fast.chunk_bwd docstring)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, A, G, kn)
    ctx.scale, ctx.l2, ctx.chunk_size = scale, l2, chunk_size
    # unused outputs' gradients arrive as None, not as zeros autograd would fill: A, G and kn are kept for the
    # backward and never read by a loss (zero-filling their gradients cost ~42 us per step at bench_train's
    # shape, H100: A alone is [B, T, HV, BT]); o's and final_state's None are handled in _chunk_backward
    ctx.set_materialize_grads(False)


def _chunk_backward(ctx, do, dht, dA, dG, dkn):
    """do, dht: None when no loss reads o / final_state (set_materialize_grads(False)); dA, dG, dkn: gradients
    of the kept intermediates, which no loss reads (ignored)."""
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, A, G, kn = ctx.saved_tensors
    if do is None:
        do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = chunk_gated_delta_rule_bwd_op(
        do, dht, q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, ctx.l2, A_log, dt_bias, ctx.chunk_size,
        A, G, kn)
    return (dq, dk, dv, dg, dbeta, None, _none_if_empty(dh0, initial_state is not None), None, None,
            _none_if_empty(dA_log, A_log is not None), _none_if_empty(ddt_bias, dt_bias is not None), None)


chunk_gated_delta_rule_op.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


# ============================================================================================
# causal conv1d
# ============================================================================================

@torch.library.custom_op("fast::causal_conv1d", mutates_args=())
def causal_conv1d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str,
                     initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """x: [B, T, D] -> (y [B, T, D], final_state [N, D, W-1]); activation "" (none) or "silu"."""
    with one_host_read_scope():                     # the check and the tile table share one read
        _check_cu_values(cu_seqlens, x.shape[1])
        y, final = _conv.causal_conv1d_with_config(x, weight, bias, activation or None, initial_state, True,
                                                   cu_seqlens)
    return y, final


@causal_conv1d_op.register_fake
def _(x, weight, bias, activation, initial_state, cu_seqlens):
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    sdt = initial_state.dtype if initial_state is not None else x.dtype
    return x.new_empty(B, T, D), x.new_empty(N, D, W - 1, dtype=sdt)


@torch.library.custom_op("fast::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd_op(dy: Tensor, dfinal: Optional[Tensor], x: Tensor, weight: Tensor, bias: Optional[Tensor],
                         activation: str, initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor]
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dweight, dbias, dinitial_state); absent ones (no bias / initial state) are empty."""
    out = _conv_bwd.causal_conv1d_bwd(x, weight, dy, bias, activation or None, initial_state, cu_seqlens, dfinal)
    return tuple(t if t is not None else x.new_empty(0) for t in out)       # fresh: returns may not alias


@causal_conv1d_bwd_op.register_fake
def _(dy, dfinal, x, weight, bias, activation, initial_state, cu_seqlens):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty(0),
            initial_state.new_empty(initial_state.shape) if initial_state is not None else x.new_empty(0))


def _conv_setup_context(ctx, inputs, output):
    x, weight, bias, activation, initial_state, cu_seqlens = inputs
    # saved: the inputs only; the pre-activation is recomputed (fast.conv_bwd docstring)
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
    ctx.activation = activation
    ctx.set_materialize_grads(False)                # an unread final_state's gradient is None, not a zero fill


def _conv_backward(ctx, dy, dfinal):
    x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    dx, dweight, dbias, dinit = causal_conv1d_bwd_op(dy, dfinal, x, weight, bias, ctx.activation, initial_state,
                                                     cu_seqlens)
    return (dx, dweight, _none_if_empty(dbias, bias is not None), None,
            _none_if_empty(dinit, initial_state is not None), None)


causal_conv1d_op.register_autograd(_conv_backward, setup_context=_conv_setup_context)


# ============================================================================================
# gated RMSNorm (the GDN layer's output norm)
# ============================================================================================

@torch.library.custom_op("fast::rms_norm_gated", mutates_args=())
def rms_norm_gated_op(x: Tensor, g: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], activation: str,
                      eps: float) -> Tensor:
    """x, g: [..., D] -> y [..., D] (x's dtype, contiguous)."""
    return _norm.norm_fwd(x, g, weight, bias, activation, eps)[0]


@rms_norm_gated_op.register_fake
def _(x, g, weight, bias, activation, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("fast::rms_norm_gated_bwd", mutates_args=())
def rms_norm_gated_bwd_op(dy: Tensor, x: Tensor, g: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                          activation: str, eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dg, dweight, dbias); absent ones (no weight / bias) are empty."""
    out = _norm.norm_bwd(dy, x, g, weight, bias, activation, eps)
    return tuple(t if t is not None else x.new_empty(0) for t in out)


@rms_norm_gated_bwd_op.register_fake
def _(dy, x, g, weight, bias, activation, eps):
    return (x.new_empty(x.shape), g.new_empty(g.shape),
            weight.new_empty(weight.shape) if weight is not None else x.new_empty(0),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty(0))


def _norm_setup_context(ctx, inputs, output):
    x, g, weight, bias, activation, eps = inputs
    ctx.save_for_backward(x, g, weight, bias)       # the inputs only: 1 / rms is recomputed (fast.norm)
    ctx.activation, ctx.eps = activation, eps


def _norm_backward(ctx, dy):
    x, g, weight, bias = ctx.saved_tensors
    dx, dg, dw, db = rms_norm_gated_bwd_op(dy, x, g, weight, bias, ctx.activation, ctx.eps)
    return dx, dg, _none_if_empty(dw, weight is not None), _none_if_empty(db, bias is not None), None, None


rms_norm_gated_op.register_autograd(_norm_backward, setup_context=_norm_setup_context)


# ============================================================================================
# plain RMSNorm (refgdn.model's norms)
# ============================================================================================

@torch.library.custom_op("fast::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
                unit_offset: bool, res_dtype: Optional[torch.dtype]) -> Tuple[Tensor, Tensor]:
    """x: [..., D] -> (y [..., D] (x's dtype, contiguous), the sum x + residual in res_dtype, or empty when res_dtype
    is None)."""
    y, res_out = _norm.norm_fwd(x, None, weight, bias, None, eps, unit_offset, residual=residual, res_dtype=res_dtype)
    return y, res_out if res_out is not None else x.new_empty(0)


@rms_norm_op.register_fake
def _(x, weight, bias, residual, eps, unit_offset, res_dtype):
    return x.new_empty(x.shape), (x.new_empty(x.shape, dtype=res_dtype) if res_dtype is not None else x.new_empty(0))


@torch.library.custom_op("fast::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(dy: Tensor, dres_out: Optional[Tensor], x: Tensor, weight: Optional[Tensor],
                    bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
                    unit_offset: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dweight, dbias, dresidual); absent ones (no weight / bias / residual) are empty."""
    ds, _, dw, db = _norm.norm_bwd(dy, x, None, weight, bias, None, eps, unit_offset, residual=residual,
                                   dres_out=dres_out)
    dres = ds.to(residual.dtype, copy=True) if residual is not None else None
    out = (ds.to(x.dtype), dw, db, dres)
    return tuple(t if t is not None else x.new_empty(0) for t in out)


@rms_norm_bwd_op.register_fake
def _(dy, dres_out, x, weight, bias, residual, eps, unit_offset):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape) if weight is not None else x.new_empty(0),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty(0),
            residual.new_empty(residual.shape) if residual is not None else x.new_empty(0))


def _plain_norm_setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, unit_offset, res_dtype = inputs
    ctx.save_for_backward(x, weight, bias, residual)    # the inputs only: 1 / rms is recomputed (fast.norm)
    ctx.eps, ctx.unit_offset, ctx.stored = eps, unit_offset, res_dtype is not None


def _plain_norm_backward(ctx, dy, dres_out):
    x, weight, bias, residual = ctx.saved_tensors
    dx, dw, db, dres = rms_norm_bwd_op(dy, dres_out if ctx.stored else None, x, weight, bias, residual, ctx.eps,
                                       ctx.unit_offset)
    return (dx, _none_if_empty(dw, weight is not None), _none_if_empty(db, bias is not None),
            _none_if_empty(dres, residual is not None), None, None, None)


rms_norm_op.register_autograd(_plain_norm_backward, setup_context=_plain_norm_setup_context)


def wants_graph(*tensors) -> bool:
    """Take the custom op (autograd / torch.compile) rather than the kernels directly: when a gradient
    is wanted or torch.compile is tracing."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
