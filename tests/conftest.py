"""Test set-up: without a GPU, Triton kernels run in the Triton interpreter.

The variable must be set before triton is first imported, so it is set here, at collection.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker is a process of its own: one intra-op thread each keeps the workers from
# oversubscribing the cores (CI has 2 cores and runs 2 workers).
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)
