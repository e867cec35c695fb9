"""The interleaved timing harness behind `make bench`: ratios, not absolute times.

Why not let pytest-benchmark time each variant on its own: on a shared machine the speed of the CPU drifts
over seconds (other processes, frequency scaling, allocator state), so two variants timed one after the
other differ by more than the 1-2% we need to resolve. Instead every repetition runs each variant once, in
a freshly shuffled order, and each variant's time is divided by its baseline's time *from the same
repetition*. The reported figure is the median of those paired ratios over many repetitions; the 25th and
75th percentiles show the spread. Absolute times are kept in the JSON for reference only.

pytest-benchmark is the runner and the reporter: each variant is one pytest test whose benchmark fixture is
handed the samples this harness measured (see `record_samples`), so ``--benchmark-json``,
``--benchmark-save`` and ``--benchmark-compare`` keep working on the interleaved data.
"""

import dataclasses
import gc
import random
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

__all__ = [
    "CLOCKS",
    "Variant",
    "Measurement",
    "run_interleaved",
    "paired_ratios",
    "percentile",
    "record_samples",
]


@dataclasses.dataclass
class Variant:
    """One cell of the matrix: a callable that runs one training step.

    Attributes:
        key: ``workload/mode/kind``, e.g. ``nca/eager/log``; also the pytest test id.
        baseline: the key this variant's ratio is taken against (``.../bare`` of the same workload and mode).
        fn: runs one training step; None for a pending variant.
        pending: why the variant cannot run here (e.g. a feature not on this branch yet).
        describe: one line for the table.
        check: an optional self-check run once after warm-up; returns an error string or None. A variant
            whose check fails is reported as pending with that reason rather than timed.
        settle: optional, run untimed right after every call of ``fn`` (warm-up included), e.g.
            ``logger.flush()``: work a call handed to a background thread is finished before the next variant
            is timed, so it is never charged to another row. Its duration is kept (``Measurement.settle``).
        thread_clock: time this variant's ``cpu`` samples with the calling thread's CPU time
            (`time.thread_time`) instead of the process's, so background threads (a logger's writer,
            SummaryWriter's) are not counted: the figure is the training thread's own time.
        prepare: optional, run untimed right before every call of ``fn``: what a training loop has just
            done when the timed work starts (e.g. computed the values it is about to log), so that the
            call finds them where a training loop leaves them rather than evicted by other rows.
    """

    key: str
    baseline: str
    fn: Optional[Callable[[], object]] = None
    pending: Optional[str] = None
    describe: str = ""
    check: Optional[Callable[[], Optional[str]]] = None
    settle: Optional[Callable[[], object]] = None
    thread_clock: bool = False
    prepare: Optional[Callable[[], object]] = None

    @property
    def workload(self) -> str:
        return self.key.split("/")[0]

    @property
    def mode(self) -> str:
        return self.key.split("/")[1]

    @property
    def kind(self) -> str:
        return self.key.split("/", 2)[2]


CLOCKS = {
    # Wall time: everything the step costs, including other threads' and processes' work it waits for.
    "wall": time.perf_counter,
    # CPU time of this process (all its threads, not child processes such as wandb's service): far less
    # sensitive to other load on a shared machine, blind to time spent waiting.
    "cpu": time.process_time,
}


@dataclasses.dataclass
class Measurement:
    """Per-variant seconds, one entry per repetition (index r of every variant is the same repetition).

    ``samples`` are on the ``clock`` the ratios use; ``other`` holds the other clock's samples. ``settle``
    holds the wall seconds of each untimed ``Variant.settle`` call, for variants that have one.
    """

    samples: Dict[str, List[float]]
    other: Dict[str, List[float]]
    settle: Dict[str, List[float]]
    clock: str
    repetitions: int
    warmup: int
    seconds: float


def run_interleaved(
    variants: Sequence[Variant],
    repetitions: int,
    warmup: int = 2,
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
    clock: str = "wall",
) -> Measurement:
    """Time every runnable variant once per repetition, in a new random order each repetition.

    Warm-up calls (compilation, allocator growth, lazy imports) are not timed. The garbage collector runs
    untimed before each repetition, so a collection triggered by one variant's garbage is not charged to the
    next; collections a variant triggers itself stay in its time, as they would in training. Both clocks are
    read around every call; ``clock`` names the one the ratios use. A variant's ``prepare`` runs untimed
    before each of its calls, its ``settle`` untimed after.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    runnable = [v for v in variants if v.fn is not None and v.pending is None]
    start = time.perf_counter()
    for v in runnable:
        for _ in range(warmup):
            if v.prepare is not None:
                v.prepare()
            v.fn()
            if v.settle is not None:
                v.settle()
    for v in runnable:
        if v.check is not None:
            problem = v.check()
            if problem:
                v.pending = problem
    runnable = [v for v in runnable if v.pending is None]
    wall: Dict[str, List[float]] = {v.key: [] for v in runnable}
    cpu: Dict[str, List[float]] = {v.key: [] for v in runnable}
    settled: Dict[str, List[float]] = {v.key: [] for v in runnable if v.settle is not None}
    rng = random.Random(seed)
    wall_clock = CLOCKS["wall"]
    for rep in range(repetitions):
        order = list(runnable)
        rng.shuffle(order)
        gc.collect()
        for v in order:
            cpu_clock = time.thread_time if v.thread_clock else CLOCKS["cpu"]
            if v.prepare is not None:
                v.prepare()
            # The wall clock is read innermost: a CPU-time read is a system call (several microseconds with
            # cold caches), which would otherwise be charged to every wall sample.
            c0 = cpu_clock()
            w0 = wall_clock()
            v.fn()
            w1 = wall_clock()
            c1 = cpu_clock()
            wall[v.key].append(w1 - w0)
            cpu[v.key].append(c1 - c0)
            if v.settle is not None:
                v.settle()
                settled[v.key].append(wall_clock() - w1)
        if progress is not None and (rep + 1) % max(1, repetitions // 10) == 0:
            progress(f"repetition {rep + 1}/{repetitions}")
    samples, other = (wall, cpu) if clock == "wall" else (cpu, wall)
    return Measurement(samples, other, settled, clock, repetitions, warmup, time.perf_counter() - start)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def paired_ratios(samples: Dict[str, List[float]], key: str, baseline: str) -> List[float]:
    """time[key][r] / time[baseline][r] for every repetition r."""
    return [t / b for t, b in zip(samples[key], samples[baseline], strict=True)]


def summary(values: Sequence[float]) -> Dict[str, float]:
    return {
        "median": statistics.median(values) if values else float("nan"),
        "p25": percentile(values, 25),
        "p75": percentile(values, 75),
    }


def record_samples(benchmark, samples: Sequence[float], extra_info: Dict[str, object]) -> None:
    """Hand samples measured by `run_interleaved` to a pytest-benchmark fixture, as if it had timed them.

    pytest-benchmark has no public call for adding externally timed rounds, and its own timing loops cannot
    interleave variants across tests; ``_make_stats`` is the one private call used here. If a future
    pytest-benchmark drops it, the samples still reach the JSON through ``extra_info`` and the fixture times
    a no-op once, so the test passes but pytest-benchmark's own table is meaningless (said in extra_info).
    """
    benchmark.extra_info.update(extra_info)
    make_stats = getattr(benchmark, "_make_stats", None)
    if make_stats is None or not samples:
        benchmark.extra_info["note"] = (
            "pytest-benchmark timed a no-op; see samples_s and bench/results/latest.json"
        )
        benchmark.extra_info["samples_s"] = list(samples)
        benchmark.pedantic(lambda: None, rounds=1)
        return
    stats = make_stats(1)
    for seconds in samples:
        stats.update(seconds)
    benchmark._mode = "interleaved (bench/harness.py)"  # marks the fixture as used, as pedantic() would
