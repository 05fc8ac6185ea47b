"""fast: the refgdn API in Triton kernels, plus the CUDA-graph serving path.

Every op here has a refgdn twin with the same name and signature; `python -m conformance`
checks each against it. On a machine without a GPU the kernels run in the Triton interpreter:
``TRITON_INTERPRET=1`` is set here (before any kernel is defined) unless already set.
"""
import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .conv import causal_conv1d, causal_conv1d_update
from .gating import gdn_gating, l2norm
from .norm import rms_norm, rms_norm_gated
from .serving import GDNStateCache, gdn_accept, gdn_decode, gdn_materialize, gdn_prefill, gdn_verify
from .chunk import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, recurrent_gated_delta_rule
from . import library  # noqa: F401  (torch.library custom ops + autograd: torch.ops.fast.*)
from .utils import install_interpreter_shared_lang_patch as _shared_patch, is_interpreting as _interpreting

if _interpreting():
    _shared_patch()        # the interpreter patches triton.language once per launch, not per helper call

__all__ = ["recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule", "causal_conv1d",
           "causal_conv1d_update", "gdn_gating", "l2norm", "rms_norm_gated", "rms_norm", "GDNStateCache", "gdn_prefill",
           "gdn_decode", "gdn_verify", "gdn_accept", "gdn_materialize"]
