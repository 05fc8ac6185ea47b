"""The causal-conv1d package's API (Tri Dao's ``causal_conv1d_fn`` / ``causal_conv1d_update``, which transformers'
Qwen3-Next and Mamba layers call) over an ops namespace's causal_conv1d / causal_conv1d_update.

    causal_conv1d_fn(x [B, D, T], weight [D, W], ...) -> out [B, D, T]          (channels first)
    causal_conv1d_update(x [B, D] or [B, D, 1], conv_state [B, D, S >= W-1], ...) -> out like x;
        conv_state <- [conv_state[..., 1:], x] (the whole buffer shifts; the window is its last W-1 columns + x)

``refgdn.compat`` binds them to refgdn's ops, ``fast.compat`` to fast's: the same mapping, one definition.
``causal_conv1d_update``'s ``conv_state_indices`` [B] picks each row's state from a larger pool [S_pool, D, S]
(continuous batching); the picked rows are updated, the others untouched; a negative index pads (zeros out, nothing
written). Refused by name
(ValueError): ``seq_idx`` (use cu_seqlens with causal_conv1d), the circular-buffer ``cache_seqlens``, and updates of
more than one token.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch

from .checks import _need_tensor, check_index_vector


def _ops(ops):
    return sys.modules["refgdn"] if ops is None else ops


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, seq_idx=None,
                     initial_states: Optional[torch.Tensor] = None, return_final_states: bool = False,
                     final_states_out: Optional[torch.Tensor] = None, activation: Optional[str] = None, *, ops=None):
    """x: [B, D, T], weight: [D, W], bias: [D], initial_states: [B, D, W-1] -> out [B, D, T] in x.dtype (a view of a
    [B, T, D] result), and with return_final_states the last W-1 inputs [B, D, W-1] (written into final_states_out
    when given). out = act(bias + causal depthwise conv of x), act None or "silu" / "swish"."""
    if seq_idx is not None:
        raise ValueError("seq_idx: not supported; pass packed sequences to causal_conv1d with cu_seqlens [N+1]")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor [B, D, T] (channels first), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    want_final = bool(return_final_states) or final_states_out is not None
    y, final = _ops(ops).causal_conv1d(x.transpose(1, 2), weight, bias, activation, initial_states, want_final)
    out = y.transpose(1, 2)                                      # [B, T, D] -> [B, D, T] (a view)
    if not want_final:
        return out
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _checked_indices(idx, x, conv_state, values: bool = True) -> Optional[list]:
    """conv_state_indices checked against x's batch and the pool (ValueError naming it): [B] int on the pool's
    device; with values, its entries (read on the host) negative (a padded row) or distinct and in [0, S_pool),
    returned (else None: nothing read)."""
    _need_tensor("x", x)
    _need_tensor("conv_state", conv_state, 3)               # the pool [S_pool, D, S]
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, D] or [B, D, 1], got {tuple(x.shape)}")
    check_index_vector("conv_state_indices", idx, x.shape[0], conv_state.device)
    if not values:
        return None
    vals = idx.tolist()
    live = [v for v in vals if v >= 0]
    if any(v >= conv_state.shape[0] for v in live) or len(set(live)) != len(live):
        raise ValueError(f"conv_state_indices must be distinct and in [0, {conv_state.shape[0]}) (the pool's rows), "
                         f"or negative (a padded row), got {vals}")
    return vals


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None, cache_seqlens=None,
                         conv_state_indices=None, *, ops=None, check_values: bool = True) -> torch.Tensor:
    """x: [B, D] or [B, D, 1], conv_state: [B, D, S] with S >= W-1 (updated in place), weight: [D, W], bias: [D] ->
    out shaped as x. The window is conv_state's last W-1 columns and x; the whole buffer shifts by one column and
    takes x last (causal-conv1d's semantics; transformers keeps S = W).

    conv_state_indices: [B] int32 / int64: conv_state is a pool [S_pool, D, S] and row b updates
    conv_state[conv_state_indices[b]]; the entries are distinct and in [0, S_pool), or negative: a padded row
    (causal-conv1d's padding: a padded batch keeps its shape), whose output is zeros and which writes no
    state. check_values: the indices' values are read on the host and checked (a sync). When the pool's rows are the
    window itself (S = W-1) and x has the pool's dtype, the update runs in the ops' vLLM-form conv update
    (``<ops>.vllm_ops.causal_conv1d_update``: rows picked on the device, negative ones padded, the same op), so
    without check_values nothing is read back (fast: capturable in a CUDA graph; unchecked values stay memory-safe,
    two rows on one slot race). Otherwise the rows are gathered, updated and written back, which reads the values."""
    if cache_seqlens is not None:
        raise ValueError("cache_seqlens: not supported (a circular conv state)")
    if conv_state_indices is not None:
        # rows that are the window itself (S = W-1), x in their dtype: the vLLM-form update on the device
        on_device = (isinstance(weight, torch.Tensor) and weight.dim() == 2 and isinstance(conv_state, torch.Tensor)
                     and conv_state.dim() == 3 and conv_state.shape[2] == weight.shape[1] - 1
                     and isinstance(x, torch.Tensor) and x.dtype == conv_state.dtype)
        # the values are read when asked, and always for the gather below
        vals = _checked_indices(conv_state_indices, x, conv_state, values=check_values or not on_device)
        if on_device:
            slot_ops = importlib.import_module(_ops(ops).__name__ + ".vllm_ops")
            return slot_ops.causal_conv1d_update(x, conv_state, weight, bias, activation,
                                                 conv_state_indices=conv_state_indices)
        idx = conv_state_indices.long().clamp(min=0)            # a padded row reads row 0 (a copy, never written)
        rows = (conv_state.index_select(0, idx) if conv_state.shape[0]  # [B, D, S]: the requests' states (copies)
                else conv_state.new_zeros(len(vals), *conv_state.shape[1:]))   # (an empty pool: every row padded)
        y = causal_conv1d_update(x, rows, weight, bias, activation, ops=ops)   # (its checks raise first)
        live = [b for b, v in enumerate(vals) if v >= 0]
        if len(live) < len(vals):                               # padded rows: zeros out, no row written
            keep = torch.tensor(live, dtype=torch.long, device=idx.device)
            idx, rows = idx.index_select(0, keep), rows.index_select(0, keep)
            y = y.masked_fill((conv_state_indices < 0).view(-1, *([1] * (y.dim() - 1))), 0)
        conv_state.index_copy_(0, idx, rows)
        return y
    squeeze = isinstance(x, torch.Tensor) and x.dim() == 3
    if squeeze and x.shape[2] != 1:
        raise ValueError(f"x must be [B, D] or [B, D, 1] (one token per update), got {tuple(x.shape)}")
    x2 = x[:, :, 0] if squeeze else x
    W = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    if (W is not None and isinstance(conv_state, torch.Tensor) and conv_state.dim() == 3
            and conv_state.shape[2] > W - 1 >= 0):
        extra = conv_state.shape[2] - (W - 1)
        window = conv_state[:, :, extra:]                       # the last W-1 columns: the op's [B, D, W-1] state
        head = conv_state[:, :, 1:extra + 1].clone()            # read before the op shifts the window
        y = _ops(ops).causal_conv1d_update(x2, window, weight, bias, activation)   # (its checks raise first)
        conv_state[:, :, :extra].copy_(head)                    # the older columns shift too
    else:
        y = _ops(ops).causal_conv1d_update(x2, conv_state, weight, bias, activation)
    return y[:, :, None] if squeeze else y
