"""Run fast's kernels, on the GPU at hand, with the configs fast picks for another GPU generation.

    PYTHONPATH=benchmarks/as_capability:$PYTHONPATH REFGDN_AS_CAPABILITY=8.0 python -m pytest tests/test_fast_grad.py

Every Python process started with this directory on its path and REFGDN_AS_CAPABILITY set (conformance's worker
processes too) reports that compute capability for CUDA devices to fast's config rules
(fast.chunk.common._capability): with 8.0 an H100 / H200 launches the configs of warp-MMA GPUs (Ampere, Ada, RTX 50:
fast.chunk.state.state_config, the backward's in fast.chunk_bwd), compiled for itself. It checks that those configs
give the right numbers; it says nothing about their speed on the other GPU (benchmarks.compile_check --arch shows
their registers and spills there). A test aid, never imported by the library. Without the variable this file does
nothing.
"""
import os

_cap = os.environ.get("REFGDN_AS_CAPABILITY")
if _cap:
    import fast.chunk.common as _common

    _major, _minor = (int(x) for x in _cap.split("."))
    _common._capability = lambda kind, index: (_major, _minor) if kind == "cuda" else (9, 0)
