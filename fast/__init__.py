"""fast: the refgdn API in Triton kernels, plus the CUDA-graph serving path.

Every op here has a refgdn twin with the same name and signature; `python -m conformance`
checks each against it. On a CPU-only machine set ``TRITON_INTERPRET=1`` to run the kernels in
the Triton interpreter.
"""
from .conv import causal_conv1d, causal_conv1d_update
from .gating import gdn_gating, l2norm
