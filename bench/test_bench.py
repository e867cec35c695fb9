"""One pytest-benchmark test per row of the matrix (bench/workloads.py); the timing itself is interleaved
across all rows by the session's ``matrix`` fixture (bench/conftest.py, bench/harness.py)."""

import pytest

from bench.harness import record_samples
from bench.workloads import all_keys

# The first test pays for the whole interleaved measurement (several minutes by design).
pytestmark = pytest.mark.timeout(3600)


@pytest.mark.parametrize("key", all_keys())
def test_step(benchmark, matrix, key):
    row = matrix[key]
    if "pending" in row:
        pytest.skip(row["pending"])
    benchmark.group = key.rsplit("/", 1)[0]
    record_samples(
        benchmark,
        row["samples_s"],
        {
            "ratio_vs_bare": row["ratio"]["median"],
            "ratio_p25": row["ratio"]["p25"],
            "ratio_p75": row["ratio"]["p75"],
            "baseline": row["baseline"],
            "describe": row["describe"],
        },
    )
