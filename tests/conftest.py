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


import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """With -n and pytest-xdist's default distribution ("load"), its "worksteal" one where this xdist has it (3.2+):
    a worker that runs out of tests takes pending ones from the other, so the suite's long tests (30-45 s each on the
    CI's 2 cores) do not leave one worker idle at the end. An explicit --dist is left as given."""
    opt = config.option
    if not getattr(opt, "numprocesses", None) or getattr(opt, "dist", None) not in ("load", "no"):
        return
    try:
        import xdist
        version = tuple(int(x) for x in xdist.__version__.split(".")[:2])
    except Exception:  # noqa: BLE001 - no xdist, or a version string of another form: keep the default
        return
    if version >= (3, 2):
        opt.dist = "worksteal"


# The slowest tests on the CI's 2 cores (20-40 s each, `pytest --durations`), moved to the front of the run: started
# first, they run beside the many short ones instead of ending it on one worker while the other idles (worksteal moves
# pending tests, never a running one).
SLOW_FIRST = ("test_greedy_speculative_equals_plain_fast32",
              "test_planner_equals_real_triton_launches_of_the_fast_model", "test_fuzz_fast_prefill_against_refgdn",
              "test_rejection_sampling_through_the_loop_keeps_the_target_distribution",
              "test_fast_serving_steps_by_conformance_rule", "test_fast_float32_by_conformance_rule",
              "test_fast_serving_steps_wider", "test_fuzz_prefill_shapes_against_refgdn",
              "test_layer_prefill_rows_at_a_tiny_shape")


def pytest_collection_modifyitems(config, items):
    """SLOW_FIRST's tests first, everything else in its collected order (a stable sort: the same order in every
    xdist worker)."""
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in SLOW_FIRST)


@pytest.fixture(autouse=True)
def _bf16_casts_as_on_a_gpu(request):
    """A test parametrized with a bfloat16 dtype runs, in the Triton interpreter, with fp32 -> bf16 casts rounding to
    nearest even as a GPU's cvt.rn does (the interpreter truncates them: every in-kernel bf16 rounding would err up
    to twice as much, all toward zero), as the matrix runs a bfloat16 conformance Case (conformance.core.Case.checks);
    restored after the test (fast.utils.interpreter_bf16_round_to_nearest; on a GPU, or with an interpreter it does
    not know, nothing changes)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if not any(v is torch.bfloat16 for v in params.values()):
        yield
        return
    from fast.utils import interpreter_bf16_round_to_nearest
    with interpreter_bf16_round_to_nearest():
        yield
