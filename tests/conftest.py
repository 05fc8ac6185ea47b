"""Test set-up: without a GPU, Triton kernels run in the Triton interpreter.

The variable must be set before triton is first imported, so it is set here, at collection.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker is a process of its own: an equal share of the cores' intra-op threads
# each keeps the workers from oversubscribing them (CI has 2 cores and runs 2 workers: one thread each; the
# GPU machine runs 12 workers on 16 cores, whose CPU float64 oracles ran 16 threads each before).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _workers)))
