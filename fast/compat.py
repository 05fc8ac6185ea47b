"""The causal-conv1d package's API (``causal_conv1d_fn``, ``causal_conv1d_update``: transformers' Qwen3-Next calls
them) over fast's causal_conv1d / causal_conv1d_update: refgdn.compat's mapping, bound to fast's ops."""
from __future__ import annotations

import functools
import sys

from refgdn import compat as _compat

causal_conv1d_fn = functools.wraps(_compat.causal_conv1d_fn)(
    lambda *a, **k: _compat.causal_conv1d_fn(*a, **k, ops=sys.modules["fast"]))
causal_conv1d_update = functools.wraps(_compat.causal_conv1d_update)(
    lambda *a, **k: _compat.causal_conv1d_update(*a, **k, ops=sys.modules["fast"]))
