"""The ops vLLM's Qwen3-Next GDN layer calls, in Triton: refgdn.vllm_ops's twins (semantics and arguments there).

``chunk_gated_delta_rule``: fast's chunked forward in vLLM's argument order. ``fused_gdn_gating``: fast's gating.
``causal_conv1d_update``: conv_update_slots_kernel (fast.conv). ``causal_conv1d_fn``: fast's varlen conv in
gdn_prefill's slot form. ``fused_recurrent_gated_delta_rule``: vLLM's serving form of the recurrent op (states in a slot
pool, per-token slots for speculative decoding), one Triton program per (V-block, sequence, value head) as the recurrent
kernel (fast.chunk.recurrent.recurrent_slots_kernel). ``fused_recurrent_gated_delta_rule_packed_decode``: newer vLLM's
decode without drafts, the same kernel with the gates formed in it, on views of the conv's packed rows.
``fused_sigmoid_gating_delta_rule_update``: newer vLLM's recurrent op with the gates formed in the same kernel.
``fused_post_conv_prep``: newer vLLM's prefill preparation (split, l2norm, gates) in one kernel
(fast.gating.post_conv_prep_kernel).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

import refgdn.vllm_ops as _ref
from refgdn.checks import (check_gdn_inputs, check_vllm_conv_fn_inputs, check_vllm_conv_fn_refusals,
                           check_vllm_conv_refusals, check_vllm_conv_update_inputs, check_vllm_packed_decode_inputs,
                           check_vllm_post_conv_inputs, check_vllm_recurrent_inputs, check_vllm_sigmoid_gating_inputs,
                           final_state_v_first, one_host_read, vllm_conv_fn_rows, vllm_conv_update_rows,
                           vllm_packed_decode_slots, vllm_recurrent_slots)

from .chunk import _call_signature as _chunk_call_signature, chunk_gated_delta_rule as _chunk
from .chunk import chunk_gated_delta_rule_fwd as _chunk_fwd
from .chunk.common import L2NORM_EPS, _check_fast_limits, _is_fp64, _precise, _unit_last
from .chunk.recurrent import WRITE_EACH_ROW, WRITE_EACH_SLOT, WRITE_FINAL, launch_slots, slots_plan
from .conv import (VLLM_ROWS_BLOCK, _forward as _conv_forward, conv_update_slots_kernel, vllm_conv_rows_kernel,
                   vllm_conv_update_config)
from .gating import SOFTPLUS_THRESHOLD, post_conv_prep_config, post_conv_prep_kernel
from .gating import gdn_gating as _gating
from .launch import LayoutPlans, Offset, Relaunch, SignaturePlans, launch, scalar_key, shape_key
from .serving import PREFILL_CHUNK
from .utils import cdiv, next_pow2

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gated_delta_rule_packed_decode", "fused_sigmoid_gating_delta_rule_update",
           "fused_gdn_gating", "fused_post_conv_prep",
           "causal_conv1d_update", "causal_conv1d_fn"]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, *, chunk_indices=None,
                           chunk_offsets=None, core_attn_out=None, state_layout: str = "kv",
                           check_values: bool = False):
    """fast.chunk_gated_delta_rule in vLLM's argument order (``head_first`` before the l2norm flag); newer vLLM's
    keywords (state_layout "vk", core_attn_out, chunk_indices / chunk_offsets) as refgdn.vllm_ops' twin.

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV]   initial_state: [N, HV, K, V] ("vk": [N, HV, V, K])
    -> (o [B, T, HV, V], final_state [N, HV, K, V] float32 ("vk": [N, HV, V, K]) or None)

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    Shapes and dtypes are checked on the host before anything runs; cu_seqlens' values only with check_values=True
    (a host read: a sync). By default a varlen call reads nothing back, as vLLM's own op with its precomputed
    chunk tables: every kernel runs on chunk tables built on the device from the offsets (fast.chunk's
    offsets_on_device), so a prefill step syncs once per GDN layer less and the call can be captured. Offsets
    that break the rules (0 = cu[0] <= ... <= cu[N] = T) give unspecified values but stay memory-safe (clamped into
    [0, T]). A "vk" final state is written [N, HV, V, K] by the state pass (no transposed copy) and o straight into
    a contiguous core_attn_out (which must not overlap the inputs: ValueError; vLLM's is a buffer of its own). float64,
    gradients and torch.compile tracing go through fast.chunk_gated_delta_rule.
    """
    if (check_values is not False or head_first is not False or not isinstance(cu_seqlens, torch.Tensor)
            or not isinstance(q, torch.Tensor)):
        return _ref.vllm_chunk(_chunk, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               head_first, use_qk_l2norm_in_kernel, chunk_indices, chunk_offsets, core_attn_out,
                               state_layout)
    vk = state_layout == "vk"
    h0 = initial_state.transpose(-1, -2) if vk and isinstance(initial_state, torch.Tensor) else initial_state
    # a signature whose call passed the checks before skips them and launches through its plan (fast.launch: the
    # compiled launchers reused); T and N left out, so a serving stream's prefills share one
    sig = _chunk_signature(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                           chunk_indices, chunk_offsets, core_attn_out, state_layout)
    plan = _CHUNK.get(sig)
    if plan is None:
        _ref.check_vllm_chunk_args(q, v, initial_state, chunk_indices, chunk_offsets, core_attn_out, state_layout)
        check_gdn_inputs(q, k, v, g, beta, scale, h0, cu_seqlens, None, None, 64, None, offset_values=False)
    from . import library
    if (_is_fp64(q, k, v, g, beta, h0) or library.wants_graph(q, k, v, g, beta, h0)
            or type(output_final_state) is not bool or type(use_qk_l2norm_in_kernel) is not bool):
        return _ref.vllm_chunk(_chunk, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               head_first, use_qk_l2norm_in_kernel, chunk_indices, chunk_offsets, core_attn_out,
                               state_layout)
    _ref.check_vllm_chunk_out(core_attn_out, q, k, v, g, beta, initial_state, cu_seqlens)   # (every call)
    if plan is None:
        _check_fast_limits(q.shape[3], v.shape[3], 64)
        plan = _CHUNK.after_checks(sig)                  # (None on a signature's first call: launched as it is)
    out = core_attn_out if core_attn_out is not None and core_attn_out.is_contiguous() else None
    with plan if plan is not None else contextlib.nullcontext():
        o, final = _chunk_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                              chunk_size=64, final_v_first=vk, offsets_on_device=True, out=out)
    if core_attn_out is not None and out is None:
        o = core_attn_out.copy_(o)
    return o, final_state_v_first(final, vk)                # (written [N, HV, V, K] already: no copy)


def _chunk_signature(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, l2, chunk_indices, chunk_offsets,
                     core_attn_out, state_layout) -> Optional[tuple]:
    """What the vLLM chunk op's checks read, T and N left out (fast.chunk's _call_signature for the public op's
    part, on h0 as the [N, HV, K, V] view it checks), plus its own arguments: state_layout by type and value, the
    varlen tables' types, core_attn_out's (type, shape less T, dtype, device) and whether its shape is v's. None
    (check in full, keep no plan) for anything else."""
    if type(state_layout) is not str:
        return None
    base = _chunk_call_signature(q, k, v, g, beta, scale, h0, output_final_state, l2, None, None, 64, cu_seqlens)
    if base is None:
        return None
    try:
        out = None if core_attn_out is None else (shape_key(core_attn_out, 1), core_attn_out.shape == v.shape)
    except Exception:  # noqa: BLE001 - the full checks name the problem
        return None
    return base, state_layout, type(chunk_indices), type(chunk_offsets), out


_CHUNK = SignaturePlans(64, seen_size=256)


@one_host_read
def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None,
                                     inplace_final_state: bool = True, cu_seqlens=None, ssm_state_indices=None,
                                     num_accepted_tokens=None, use_qk_l2norm_in_kernel: bool = False, *,
                                     retrieve_parent_token=None, check_values: bool = False, state_layout: str = "kv",
                                     null_block_id: int = -1):
    """vLLM's serving recurrent op (refgdn.vllm_ops.fused_recurrent_gated_delta_rule's twin, same semantics).

    q, k: [B, T, H, K]   v: [B, T, HV, V]   g, beta: [B, T, HV] (beta None: ones)   cu_seqlens: [N+1], B == 1
    ssm_state_indices: None, [N] or [N, L] int; initial_state: the pool [S, HV, K, V] (any strides) with indices,
    else [N, HV, K, V] or None; num_accepted_tokens: [N] int, with [N, L] indices only.
    -> (o [B, T, HV, V] in v.dtype, final_state: initial_state written in place, or [B * T, HV, K, V])
    state_layout="vk", null_block_id=0: newer vLLM's generation of the op (vllm/third_party/flash_linear_attention):
    every state [.., HV, V, K] (the kernel reads and writes it through its strides), entries <= 0 padding.

        S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;  o_t = scale S^T q_t

    Shapes, dtypes and devices are checked on the host before anything runs; the values of cu_seqlens and of the
    slots only with check_values=True (a host read: a sync), so by default the call reads nothing back and can be
    captured in a CUDA graph. Without the checks the kernel stays memory-safe on any values: each sequence's
    offsets are clamped to [0, T], a read slot outside (null_block_id, S) pads its sequence (zeros out, nothing
    written), a written one outside it is skipped, a num_accepted_tokens entry is clamped to [1, L]; two sequences
    writing one slot race, as in vLLM. float64 runs refgdn (the kernel computes in float32).
    """
    key = None if check_values or retrieve_parent_token is not None else scalar_key(
        "recurrent", inplace_final_state, use_qk_l2norm_in_kernel, state_layout, null_block_id, type(scale))
    tensors = (q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens)
    p = _SLOTS.get(key, tensors)
    if p is not None:                     # a layout whose call passed the checks before: the launch alone
        return p.serve(q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, None,
                       None, scale)
    beta = _ref.default_beta(q, v, beta)
    check_vllm_recurrent_inputs(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
                                ssm_state_indices, num_accepted_tokens, retrieve_parent_token,
                                offset_values=check_values, state_layout=state_layout, null_block_id=null_block_id)
    if _is_fp64(q, k, v, g, beta, initial_state):
        return _ref.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
            num_accepted_tokens, use_qk_l2norm_in_kernel, state_layout=state_layout, null_block_id=null_block_id)
    return _slots_op(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                     num_accepted_tokens, use_qk_l2norm_in_kernel, check_values, state_layout == "vk", null_block_id,
                     v.dtype, key=key, tensors=tensors)


def _slots_op(q, k, v, g, beta, scale, initial_state, inplace: bool, cu_seqlens, idx, num_acc, l2norm: bool,
              check_values: bool, vk: bool, null_block_id: int, o_dtype: torch.dtype, A_log=None, dt_bias=None,
              key=None, tensors=None):
    """The serving recurrent ops' launch (fused_recurrent_gated_delta_rule, fused_sigmoid_gating_delta_rule_update:
    the latter passes the raw gates as g, beta with A_log, dt_bias), after their checks: (o, final_state). key,
    tensors: the call's _SLOTS entry (None: not kept), remembered when the launch reads the call's tensors as they
    are (no copy)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_fast_limits(K, V)
    pool = initial_state.transpose(-1, -2) if vk and initial_state is not None else initial_state  # [.., HV, K, V]
    if check_values:
        vllm_recurrent_slots(B, T, cu_seqlens, idx, num_acc, inplace, None if pool is None else pool.shape[0],
                             null_block_id)
    q2, k2, v2 = _unit_last(q), _unit_last(k), _unit_last(v)
    o = torch.empty(B, T, HV, V, dtype=o_dtype, device=q.device)
    if inplace:
        hs = pool
        write = WRITE_EACH_SLOT if idx is not None and idx.dim() == 2 else WRITE_FINAL
    else:
        dims = (V, K) if vk else (K, V)
        hs = torch.empty(B * T, HV, *dims, dtype=pool.dtype if pool is not None else torch.float32, device=q.device)
        write = WRITE_EACH_ROW
    pos = (q2, k2, v2, g, beta, pool, o, hs.transpose(-1, -2) if vk and not inplace else hs)
    kw = dict(H=H, L=idx.shape[1] if idx is not None and idx.dim() == 2 else 1, write=write, l2norm=l2norm,
              cu_seqlens=cu_seqlens, idx=idx, num_acc=num_acc, A_log=A_log, dt_bias=dt_bias, gate=A_log is not None,
              slot_lo=null_block_id + 1)
    launch_slots(*pos, scale=K ** -0.5 if scale is None else float(scale), **kw)
    if key is not None and q2 is q and k2 is k and v2 is v:
        _SLOTS.remember(key, tensors, lambda: _SlotsOpPlan(pos, kw, o, hs, inplace, K, tensors))
    return o, (initial_state if inplace else hs)


class _SlotsOpPlan:
    """One call layout's launch of _slots_op (_SLOTS): recurrent_slots_kernel's SlotsPlan and the outputs' shapes. The
    kernel takes the call's tensors as they are (their strides are the plan's; a [.., V, K] state, a [B * T, HV] gate
    and its [B, T, HV] view share an address); beta None is a ones vector kept by the plan (read, never written)."""
    __slots__ = ("slots", "o_meta", "hs_meta", "ones", "scale", "M", "direct")

    def __init__(self, pos: tuple, kw: dict, o, hs, inplace: bool, K: int, tensors: tuple):
        """pos, kw: the launch_slots arguments of the call (but scale); o, hs: its outputs; tensors: the call's own
        (q, k, v, g or a, beta or b, initial_state, ...: the order both ops key their plans by)."""
        self.slots = slots_plan(*pos, scale=0.0, **kw)
        self.o_meta = (o.shape, o.dtype, o.device)
        self.hs_meta = None if inplace else (hs.shape, hs.dtype, hs.device)
        self.ones = pos[4] if tensors[4] is None else None       # default_beta's ones (beta None): read, never written
        self.scale = K ** -0.5
        self.M = self.slots.M
        # every tensor the kernel reads is the call's own or shares its address: q, k, v unit-stride (the caller
        # checked), the gates' [B, T, HV] views of [B * T, HV] ones
        self.direct = self.slots.direct and all(
            t is None or t.data_ptr() == u.data_ptr() for t, u in ((tensors[3], pos[3]), (tensors[4], pos[4])))

    def serve(self, q, k, v, g, beta, state, cu_seqlens, idx, num_acc, A_log, dt_bias, scale, cache=None,
              cache_rows=None):
        """-> (o, final_state), as _slots_op returns them for a call of this layout. cache, cache_rows (SGLang's
        target verify): the call's intermediate_states_buffer, written in place (its [C steps, HV, K, V] view shares
        its address; the guard pins its strides, so the view is one), and its rows (or None)."""
        o = torch.empty(self.o_meta[0], dtype=self.o_meta[1], device=self.o_meta[2])
        final = cache if cache is not None else state if self.hs_meta is None else torch.empty(
            self.hs_meta[0], dtype=self.hs_meta[1], device=self.hs_meta[2])
        self.slots.run((q, k, v, g, self.ones if beta is None else beta, state, o, final, cu_seqlens, idx, num_acc,
                        A_log, dt_bias, cache_rows), self.scale if scale is None else float(scale))
        return o, final


# Eager calls of vLLM's recurrent ops by call layout (fast.launch.LayoutPlans): fused_recurrent_gated_delta_rule and
# the newer fused_sigmoid_gating_delta_rule_update, once per GDN layer and step outside vLLM's CUDA graphs. The key:
# the op's non-tensor arguments the checks read (fast.launch.scalar_key); the guard compares every tensor's metadata.
_SLOTS = LayoutPlans()


@one_host_read
def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta: float = 1.0, threshold: float = 20.0,
                                           scale=None, initial_state=None, inplace_final_state: bool = True,
                                           cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                           use_qk_l2norm_in_kernel: bool = False, is_kda: bool = False, *,
                                           check_values: bool = False):
    """Newer vLLM's fused decode / verify op (refgdn.vllm_ops.fused_sigmoid_gating_delta_rule_update's twin, same
    semantics): the gates formed from a, b in recurrent_slots_kernel (GATE), one launch.

    A_log, dt_bias: [HV]   a, b: [B, T, HV] or [B * T, HV]   q, k: [B, T, H, K]   v: [B, T, HV, V]
    initial_state: the pool [S, HV, V, K] (any strides) with ssm_state_indices [N] or [N, L] (entries <= 0: the null
    block), else [N, HV, V, K] or None   -> (o [B, T, HV, V]: float32 with a float32 state, else q's dtype,
    final_state: initial_state written in place, or [B * T, HV, V, K])

    As fused_recurrent_gated_delta_rule(..., state_layout="vk", null_block_id=0) on the gates g = -exp(A_log)
    softplus(a + dt_bias), beta = sigmoid(b), formed per token in float32 (beta never rounded). Host checks of
    shapes, dtypes and devices; the values only with check_values=True (capturable otherwise; unchecked values stay
    memory-safe). float64 runs refgdn.
    """
    key = None if check_values else scalar_key("sigmoid-gating", beta, threshold, inplace_final_state,
                                                use_qk_l2norm_in_kernel, is_kda, type(scale))
    tensors = (q, k, v, a, b, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, A_log, dt_bias)
    p = _SLOTS.get(key, tensors)
    if p is not None:                     # a layout whose call passed the checks before: the launch alone
        return p.serve(q, k, v, a, b, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, A_log,
                       dt_bias, scale)
    N, a3, b3 = check_vllm_sigmoid_gating_inputs(A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state,
                                                 inplace_final_state, cu_seqlens, ssm_state_indices,
                                                 num_accepted_tokens, use_qk_l2norm_in_kernel, is_kda,
                                                 offset_values=check_values)
    if _is_fp64(q, k, v, a, b, A_log, dt_bias, initial_state):
        return _ref.fused_sigmoid_gating_delta_rule_update(
            A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state, inplace_final_state, cu_seqlens,
            ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel, is_kda)
    return _slots_op(q, k, v, a3, b3, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                     num_accepted_tokens, use_qk_l2norm_in_kernel, check_values, True, 0,
                     _ref.sigmoid_gating_out_dtype(q, initial_state), A_log, dt_bias, key=key, tensors=tensors)


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                   ssm_state_indices, use_qk_l2norm_in_kernel: bool = False, *,
                                                   check_values: bool = False):
    """vLLM's packed decode (refgdn.vllm_ops.fused_recurrent_gated_delta_rule_packed_decode's twin, same semantics):
    the gates, the l2norm and the delta rule of one token per request in one Triton launch.

    mixed_qkv: [B, 2 H K + HV V] (q | k | v per row)   a, b: [B, HV] (raw gate projections)   A_log, dt_bias: [HV]
    initial_state: the pool [S, HV, V, K] (vLLM's layout; any strides)   out: [B, 1, HV, V] contiguous, written in
    place   ssm_state_indices: [B] int (<= 0: vLLM's null block, a padded request)   -> (out, initial_state)

        g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b)
        S <- exp(g) S ;  S <- S + k (beta (v - S^T k))^T ;  o = scale S^T q       (S = initial_state[slot]^T)

    recurrent_slots_kernel with its gates formed in the kernel (GATE) on views of mixed_qkv, a and b (nothing is
    copied) and the pool seen as [S, HV, K, V] through its strides. Shapes, dtypes and devices are checked on the
    host; the slots only with check_values=True (a host read), so by default the call can be captured in a CUDA graph.
    Unchecked slots stay memory-safe: one outside [1, S) pads its request (zeros out, nothing read or written); two
    requests on one slot race, as in vLLM. float64 runs refgdn (the kernel computes in float32).
    """
    key = None if check_values else scalar_key("packed", use_qk_l2norm_in_kernel, type(scale))
    tensors = (mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices)
    p = _PACKED.get(key, tensors)
    if p is not None:                     # a layout whose call passed the checks before: the launch alone
        p.run(p.tensors(*tensors), p.scale if scale is None else float(scale))
        return out, initial_state
    B, H, HV, K, V = check_vllm_packed_decode_inputs(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                     ssm_state_indices, use_qk_l2norm_in_kernel)
    if _is_fp64(mixed_qkv, a, b, A_log, dt_bias, initial_state):
        return _ref.fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, use_qk_l2norm_in_kernel)
    _check_fast_limits(K, V)
    if check_values:
        vllm_packed_decode_slots(ssm_state_indices, initial_state.shape[0])
    x = _unit_last(mixed_qkv)
    launch = _packed_launch(x, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices, H, HV, K, V,
                            use_qk_l2norm_in_kernel)
    launch_slots(*launch[0], scale=K ** -0.5 if scale is None else float(scale), **launch[1])
    if x is mixed_qkv:                    # (a copied x: every call checks and copies)
        _PACKED.remember(key, tensors, lambda: _PackedPlan(launch, K, x.element_size()))
    return out, initial_state


def _packed_launch(x, a, b, A_log, dt_bias, initial_state, out, idx, H: int, HV: int, K: int, V: int, l2norm: bool):
    """The packed decode's launch_slots arguments, but scale: (positional, keyword)."""
    q = x[:, :H * K].unflatten(1, (H, K))[:, None]                # [B, 1, H, K]: views of the packed rows
    k = x[:, H * K:2 * H * K].unflatten(1, (H, K))[:, None]
    v = x[:, 2 * H * K:].unflatten(1, (HV, V))[:, None]           # [B, 1, HV, V]
    pool = initial_state.transpose(-1, -2)                        # [S, HV, K, V]: the same memory
    # a, b [B, 1, HV]: the raw gates, formed in the kernel (GATE)
    return ((q, k, v, a[:, None], b[:, None], pool, out, pool),
            dict(H=H, L=1, write=WRITE_FINAL, l2norm=l2norm, idx=idx, A_log=A_log, dt_bias=dt_bias, gate=True,
                 slot_lo=1))


class _PackedPlan:
    """The packed decode's launch for one call layout (_PACKED): recurrent_slots_kernel's SlotsPlan, with q, k and v
    passed as mixed_qkv's address plus their column offsets (fast.launch.Offset: no view built per call), a, b and
    the pool as themselves (the plan's strides say how the kernel reads them)."""
    __slots__ = ("slots", "k_off", "v_off", "scale", "M", "direct")

    def __init__(self, launch: tuple, K: int, itemsize: int):
        pos, kw = launch
        self.slots = slots_plan(*pos, scale=0.0, **kw)
        H = kw["H"]
        self.k_off, self.v_off = H * K * itemsize, 2 * H * K * itemsize
        self.scale = K ** -0.5
        self.M, self.direct = self.slots.M, self.slots.direct

    def tensors(self, x, a, b, A_log, dt_bias, pool, out, idx) -> tuple:
        """The kernel's 14 tensor arguments (SLOTS_TENSORS' order) for this call's tensors."""
        return (Offset(x, 0), Offset(x, self.k_off), Offset(x, self.v_off), a, b, pool, out, pool, None, idx, None,
                A_log, dt_bias, None)

    def run(self, tensors: tuple, scale: float) -> None:
        self.slots.run(tensors, scale)


# Eager packed decodes by call layout (fast.launch.LayoutPlans): newer vLLM calls the op once per GDN layer and decode
# step outside its CUDA graphs (eager mode, batches above the largest captured size). The key: the keywords the
# checks read besides the tensors (the guard compares every tensor's metadata); check_values=True is never served.
_PACKED = LayoutPlans()


def fused_gdn_gating(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """vLLM's fused_gdn_gating (its Qwen3-Next model file) in its argument order: fast.gdn_gating (one Triton kernel).

    A_log: [HV]   a, b: [N, HV] (or [B, T, HV])   dt_bias: [HV]
    -> (g [1, N, HV] float32, beta [1, N, HV] in b's dtype) ([B, T, HV] for 3-D inputs)

        g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)

    beta / threshold are softplus' parameters; only vLLM's defaults (1.0, 20.0) are supported.
    """
    return _ref.vllm_gating(_gating, A_log, a, b, dt_bias, beta, threshold)


def fused_post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                         apply_l2norm: bool = True, output_g_exp: bool = False):
    """Newer vLLM's prefill preparation (refgdn.vllm_ops.fused_post_conv_prep's twin, same semantics): one launch.

    conv_output: [L, 2 H K + HV V]   a, b: [L, HV]   A_log, dt_bias: [HV]
    -> (q [L, H, K], k [L, H, K], v [L, HV, V] contiguous in conv_output's dtype, g [L, HV] float32, beta [L, HV]
    float32)

        q, k <- x / sqrt(sum(x^2) + 1e-6) (apply_l2norm)   g = -exp(A_log) softplus(a + dt_bias) (exp(g): output_g_exp)
        beta = sigmoid(b)

    Shapes, dtypes and devices are checked on the host (no value is read: capturable). float64 runs refgdn.
    """
    # a signature whose call passed the checks before skips them and launches through its plan (the compiled
    # launcher reused); the token count L left out, so a serving stream's prefills share one
    sig = _post_conv_signature(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, apply_l2norm,
                               output_g_exp)
    plan = _POST_CONV.get(sig)
    if plan is None:
        L, H, HV, K, V = check_vllm_post_conv_inputs(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim,
                                                     head_v_dim, apply_l2norm, output_g_exp)
        plan = _POST_CONV.after_checks(sig)              # (None on a signature's first call: launched as it is)
    else:
        L, H, HV, K, V = conv_output.shape[0], num_k_heads, A_log.shape[0], head_k_dim, head_v_dim
    if _is_fp64(conv_output, a, b, A_log, dt_bias):
        return _ref.fused_post_conv_prep(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim,
                                         apply_l2norm, output_g_exp)
    dev, dt = conv_output.device, conv_output.dtype
    q = torch.empty(L, H, K, dtype=dt, device=dev)
    k = torch.empty(L, H, K, dtype=dt, device=dev)
    v = torch.empty(L, HV, V, dtype=dt, device=dev)
    g = torch.empty(L, HV, dtype=torch.float32, device=dev)
    beta = torch.empty(L, HV, dtype=torch.float32, device=dev)
    if L == 0:
        return q, k, v, g, beta
    x, a2, b2 = _unit_last(conv_output), _unit_last(a), _unit_last(b)
    cfg = post_conv_prep_config(H, HV, K, V)
    BT = cfg.pop("BT")
    kw = dict(H=H, HV=HV, K=K, V=V, BT=BT, L2NORM=apply_l2norm, G_EXP=output_g_exp, THRESHOLD=SOFTPLUS_THRESHOLD,
              EPS=L2NORM_EPS, PRECISE=_precise(dt), **cfg)
    with plan if plan is not None else contextlib.nullcontext():
        launch(post_conv_prep_kernel, (cdiv(L, BT), H + HV), kw, x, a2, b2, A_log.contiguous(), dt_bias.contiguous(),
               q, k, v, g, beta, L, x.stride(0), a2.stride(0), b2.stride(0))
    return q, k, v, g, beta


def _post_conv_signature(conv_output, a, b, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim, apply_l2norm,
                         output_g_exp) -> Optional[tuple]:
    """What fused_post_conv_prep's checks read, with the token count L left out: the tensors' (type, shape, dtype,
    device) less dim 0 of conv_output, a and b, whether a's and b's dim 0 is conv_output's, and the integers and
    flags by exact type and value. None (check in full, keep no plan) for anything else."""
    if not isinstance(conv_output, torch.Tensor) or conv_output.dim() != 2:
        return None
    key = scalar_key(num_k_heads, head_k_dim, head_v_dim, apply_l2norm, output_g_exp)
    if key is None:
        return None
    try:
        L = conv_output.shape[0]
        return (key, shape_key(conv_output, 0), shape_key(a, 0), shape_key(b, 0), a.shape[0] == L,
                b.shape[0] == L, shape_key(A_log), shape_key(dt_bias))
    except Exception:  # noqa: BLE001 - not a tensor, or too few dims: the full checks name the problem
        return None


_POST_CONV = SignaturePlans(64, seen_size=256)


@one_host_read
def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, query_start_loc=None, max_query_len: int = -1,
                         pad_slot_id: int = -1, block_idx_last_scheduled_token=None, initial_state_idx=None,
                         retrieve_parent_token=None, validate_data: bool = False, *, check_values: bool = False):
    """vLLM's causal_conv1d_update (refgdn.vllm_ops.causal_conv1d_update's twin, same semantics): one Triton kernel.

    x: [B, D], [B, D, L] or [T, D] with query_start_loc [B+1]; conv_state: [S, D, C] (updated in place); weight:
    [D, W]; bias: [D]; conv_state_indices, num_accepted_tokens: [B] int -> y shaped as x, in x's dtype.

        u = [conv_state[s, :, o : o + W - 1], x_b];  y_t = act(bias + sum_j weight[:, j] u[:, t + j])

    Shapes, dtypes and devices are checked on the host first; the values (offsets, slots, counts) only with
    check_values=True (a host read), so by default nothing is read back and the call can be captured in a CUDA graph.
    Unchecked values stay memory-safe: offsets clamped to [0, T], a slot outside [0, S) pads its request, the window
    offset is clamped into the row, columns past C are not written.
    """
    refused = (block_idx_last_scheduled_token, initial_state_idx, retrieve_parent_token)
    key = None if check_values or any(r is not None for r in refused) else scalar_key(
        "conv_update", activation, max_query_len, pad_slot_id)
    tensors = (x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc)
    p = _CONV_UPDATE.get(key, tensors)
    if p is not None:                     # a layout whose call passed the checks before: the launch alone
        return p.serve(*tensors)
    check_vllm_conv_refusals(block_idx_last_scheduled_token, initial_state_idx, retrieve_parent_token)
    B, D, W, L = check_vllm_conv_update_inputs(x, conv_state, weight, bias, activation, conv_state_indices,
                                               num_accepted_tokens, query_start_loc, max_query_len, pad_slot_id,
                                               offset_values=check_values)
    S, C = conv_state.shape[0], conv_state.shape[2]
    if check_values:
        vllm_conv_update_rows(B, L, query_start_loc, conv_state_indices, num_accepted_tokens, pad_slot_id, S, C, W)
    act = "silu" if activation is True else (None if activation is False else activation)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0 or B == 0:
        return y
    if query_start_loc is not None:                     # x [T, D]: tokens along dim 0
        T, (s_xt, s_xd), s_xb = x.shape[0], x.stride(), 0
        (s_yt, s_yd), s_yb = y.stride(), 0
    elif x.dim() == 2:                                  # [B, D]: one token each
        T, (s_xb, s_xd), s_xt = 1, x.stride(), 0
        (s_yb, s_yd), s_yt = y.stride(), 0
    else:                                               # [B, D, L]
        T, (s_xb, s_xd, s_xt) = x.shape[2], x.stride()
        s_yb, s_yd, s_yt = y.stride()
    fp64 = any(t.dtype == torch.float64 for t in (x, weight, conv_state))
    cfg = vllm_conv_update_config(D, B, x.numel() // D)     # tokens in all, in any of x's layouts (as fast.keys)
    BD = cfg.pop("BD")
    grid = (cdiv(D, BD), B)
    kw = dict(D=D, C=C, W=W, BD=BD, CP=next_pow2(C), SILU=act in ("silu", "swish"), HAS_BIAS=bias is not None,
              INDEXED=conv_state_indices is not None, SPEC=num_accepted_tokens is not None,
              VARLEN=query_start_loc is not None, FP64=fp64, **cfg)
    scalars = (T, S, pad_slot_id, s_xb, s_xd, s_xt, *conv_state.stride(), *weight.stride(), s_yb, s_yd, s_yt)
    launch(conv_update_slots_kernel, grid, kw, x, conv_state, weight, bias, y, conv_state_indices, num_accepted_tokens,
           query_start_loc, *scalars)
    _CONV_UPDATE.remember(key, tensors, lambda: _ConvUpdatePlan(grid, kw, scalars))
    return y


class _ConvUpdatePlan:
    """One call layout's launch of causal_conv1d_update (_CONV_UPDATE): the kernel's grid, constexprs and scalar
    arguments follow from the tensors' metadata, which the layout's guard pins; y is allocated per call (x's shape,
    contiguous: its strides are the plan's)."""
    __slots__ = ("launch", "scalars", "M", "direct")

    def __init__(self, grid: tuple, kw: dict, scalars: tuple):
        self.launch, self.scalars, self.M, self.direct = Relaunch(conv_update_slots_kernel, grid, kw), scalars, 1, True

    def serve(self, x, conv_state, weight, bias, idx, num_acc, qsl):
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.launch(x, conv_state, weight, bias, y, idx, num_acc, qsl, *self.scalars)
        return y


# Eager calls of vLLM's conv update by call layout (fast.launch.LayoutPlans): once per GDN layer and decode step
# outside vLLM's CUDA graphs (mixed batches). The key: the non-tensor arguments the checks read, by exact type.
_CONV_UPDATE = LayoutPlans()


@one_host_read
def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                     activation="silu", pad_slot_id: int = -1, block_idx_first_scheduled_token=None,
                     block_idx_last_scheduled_token=None, initial_state_idx=None, num_computed_tokens=None,
                     block_size_to_align=0, metadata=None, validate_data: bool = False, *, check_values: bool = False):
    """vLLM's causal_conv1d_fn (refgdn.vllm_ops.causal_conv1d_fn's twin, same semantics): the prefill conv, each
    request's window read from and written to its conv_states row in place.

    x: [D, T]; weight: [D, W]; bias: [D]; conv_states: [S, D, C]; query_start_loc: [B+1]; cache_indices: [B] int;
    has_initial_state: [B] bool -> y: [D, T] in x's dtype (a view of a [T, D] tensor: vLLM's channel-last layout).

        y_t = act(bias + sum_j weight[:, j] x_{t-W+1+j})     conv_states[s, :, :W - 1] <- the last W - 1 inputs

    fast's varlen conv kernels with the serving prefill's slot rows (gdn_prefill's conv: rows read and written in
    place, -1 for none), the rows and the tile table formed on the device (fast.chunk.common._Chunks.unchecked), so
    nothing is read back: query_start_loc's values and the rows are checked on the host only with check_values=True,
    and the call can be captured in a CUDA graph. Unchecked values stay memory-safe: offsets are clamped into [0, T]
    (a decreasing pair gives an empty request), a row outside [0, S) pads its request (zeros out, nothing read or
    written); two requests on one row race. A padded request's outputs are zeros, stored by the conv kernel.
    """
    sig = None if check_values else _conv_fn_signature(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation, pad_slot_id,
        block_idx_first_scheduled_token, block_idx_last_scheduled_token, initial_state_idx, num_computed_tokens,
        block_size_to_align)
    plan = _CONV_FN.get(sig)
    if plan is None:
        check_vllm_conv_fn_refusals(block_idx_first_scheduled_token, block_idx_last_scheduled_token,
                                    initial_state_idx, num_computed_tokens, block_size_to_align)
        check_vllm_conv_fn_inputs(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                                  activation, pad_slot_id, offset_values=check_values)
        if check_values:
            vllm_conv_fn_rows(query_start_loc.numel() - 1, cache_indices, pad_slot_id, conv_states.shape[0])
        plan = _CONV_FN.after_checks(sig)              # (None on a signature's first call: launched as it is)
    if _is_fp64(x, weight, bias, conv_states):
        return _ref.causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                                     activation, pad_slot_id)
    if plan is None:
        return _conv_fn_run(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                            activation, pad_slot_id)
    with plan:
        return _conv_fn_run(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                            activation, pad_slot_id)


def _conv_fn_run(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                 pad_slot_id):
    """causal_conv1d_fn's launches, after its checks: the slot rows (vllm_conv_rows_kernel), the tile table
    (chunk_table_kernel), the conv and its final-state kernel (fast.conv._forward, slot form)."""
    act = "silu" if activation is True else (None if activation is False else activation)
    D, T = x.shape
    B = query_start_loc.shape[0] - 1
    if B == 0 or T == 0 or D == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    # (row written, row read) per request: -1 for a padded request (pad_slot_id, negative or past the pool: zeros
    # out, no row read or written) and for a read without has_initial_state
    slot_rows = torch.empty(B, 2, dtype=torch.int32, device=x.device)
    launch(vllm_conv_rows_kernel, (1,), dict(BN=VLLM_ROWS_BLOCK, INDEXED=cache_indices is not None,
                                             HAS_FLAGS=has_initial_state is not None, num_warps=4),
           cache_indices, has_initial_state, slot_rows, B, conv_states.shape[0], pad_slot_id)
    xs = x if x.dtype == conv_states.dtype else x.to(conv_states.dtype)     # vLLM rounds x to the state's dtype
    # (gdn_prefill's conv launch: its tiles PREFILL_CHUNK rows, so both compile the same variants); a padded request's
    # outputs are zeros (PAD_ZERO: its written row is -1), stored so by the conv kernel
    y, _ = _conv_forward(xs.T[None], weight, bias, act, conv_states, True, query_start_loc,
                         config=dict(BT=PREFILL_CHUNK), slot_rows=slot_rows, pad_zero=True, device_table=True)
    return y[0].to(x.dtype).T


def _conv_fn_signature(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                       pad_slot_id, *refused) -> Optional[tuple]:
    """What causal_conv1d_fn's checks read (check_vllm_conv_fn_inputs without the offsets' values, the refusals),
    with the token count T and the request count B left out, so a serving stream's prefills of any length and
    request count share one plan (fast.conv's _call_signature does the same): the tensors' (type, shape, dtype,
    device) less x's T and the vectors' B; B's consistency (the vectors hold B entries, enough rows without
    cache_indices, at least one request); activation and pad_slot_id by type and value; the refused arguments absent.
    None (check in full, keep no plan) for anything else."""
    if any(r is not None for r in refused[:4]) or refused[4] not in (0, None) or type(pad_slot_id) is not int:
        return None
    if not (activation is None or type(activation) in (str, bool)):
        return None
    try:
        B = query_start_loc.numel() - 1
        return (shape_key(x, 1), shape_key(weight), shape_key(bias), shape_key(conv_states),
                shape_key(query_start_loc, 0), shape_key(cache_indices, 0), shape_key(has_initial_state, 0),
                type(activation), activation, pad_slot_id, B >= 1, x.shape[1] == 0, query_start_loc.dim() == 1,
                cache_indices is None or tuple(cache_indices.shape) == (B,),
                has_initial_state is None or tuple(has_initial_state.shape) == (B,),
                cache_indices is not None or conv_states.shape[0] >= B)
    except Exception:  # noqa: BLE001 - not a tensor, or too few dims: the full checks raise their own error
        return None


# Signatures that passed causal_conv1d_fn's checks -> the LaunchPlan of its four launches (fast.launch), from a
# signature's second call on: vLLM calls it once per GDN layer and prefill step, outside CUDA graphs.
_CONV_FN = SignaturePlans(64, seen_size=256)
