"""Test set-up: without a GPU, Triton kernels run in the Triton interpreter.

The variable must be set before triton is first imported, so it is set here, at collection.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
