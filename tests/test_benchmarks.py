"""The benchmarks' own arithmetic that a figure in RESULTS.md rests on (CPU)."""
import random

import pytest

from benchmarks.bench_prefill import busy_ms


def _busy_by_unit_steps(spans) -> float:
    """The union's length by counting the integer microseconds covered (spans on integer endpoints), in ms."""
    covered = set()
    for a, b in spans:
        covered.update(range(a, b))
    return len(covered) / 1e3


@pytest.mark.parametrize("spans", [
    pytest.param([], id="none"),
    pytest.param([(0, 10)], id="one"),
    pytest.param([(0, 10), (20, 25)], id="gap"),
    pytest.param([(0, 10), (10, 12)], id="touching"),
    pytest.param([(0, 10), (2, 5)], id="nested"),
    pytest.param([(5, 15), (0, 10), (12, 30)], id="unsorted-overlapping"),
])
def test_busy_ms_counts_overlaps_once(spans):
    assert busy_ms(spans) == pytest.approx(_busy_by_unit_steps(spans))


def test_busy_ms_random_two_streams():
    rng = random.Random(0)
    for _ in range(50):
        spans = []
        for _stream in range(2):
            t = rng.randrange(0, 20)
            for _ in range(rng.randrange(1, 8)):
                d = rng.randrange(1, 30)
                spans.append((t, t + d))
                t += d + rng.randrange(0, 10)
        assert busy_ms(spans) == pytest.approx(_busy_by_unit_steps(spans))
        assert busy_ms(spans) <= sum(b - a for a, b in spans) / 1e3
