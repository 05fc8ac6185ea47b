"""The causal-conv1d package's API (``causal_conv1d_fn``, ``causal_conv1d_update``: transformers' Qwen3-Next calls
them) over fast's causal_conv1d / causal_conv1d_update: refgdn.compat's mapping, bound to fast's ops."""
from __future__ import annotations

import functools
import sys

from refgdn import compat as _compat

causal_conv1d_fn = functools.wraps(_compat.causal_conv1d_fn)(
    lambda *a, **k: _compat.causal_conv1d_fn(*a, **k, ops=sys.modules["fast"]))


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, *, check_values: bool = False):
    """refgdn.compat.causal_conv1d_update on fast's ops (semantics and shapes there): x [B, D] or [B, D, 1],
    conv_state [B, D, S >= W-1] (or a pool [S_pool, D, S] with conv_state_indices [B]), weight [D, W] -> out like x.

    As fast's other serving ops, conv_state_indices' values are checked on the host only with check_values=True (a
    sync); without it a pool of [S_pool, D, W-1] rows with x in the pool's dtype is updated on the device by
    fast.vllm_ops.causal_conv1d_update, and nothing is read back (capturable in a CUDA graph)."""
    return _compat.causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
                                        ops=sys.modules["fast"], check_values=check_values)
