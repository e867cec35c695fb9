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

try:
    import resource
except ImportError:  # Windows: no page-fault counts
    resource = None  # type: ignore[assignment]

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
        group: empty for the main matrix. A name puts the variant in an interleaved group of its own, timed
            after the main matrix with the same repetitions, its baseline timed again beside it (the ratio
            pairs the two): for peers whose side effects on the shared process would otherwise be charged to
            rows that have nothing to do with them (see `run_interleaved`).
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
    group: str = ""

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
    holds the wall seconds of each untimed ``Variant.settle`` call, for variants that have one. ``faults``
    holds the calling thread's minor page faults during each timed call (empty where the platform cannot
    count them). A variant of a named group is paired with its baseline's samples from that group, kept
    under ``"<baseline>@<group>"``: `baseline_of` gives the key to pair with.
    """

    samples: Dict[str, List[float]]
    other: Dict[str, List[float]]
    settle: Dict[str, List[float]]
    clock: str
    repetitions: int
    warmup: int
    seconds: float
    faults: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    paired_with: Dict[str, str] = dataclasses.field(default_factory=dict)

    def baseline_of(self, variant: Variant) -> str:
        """The samples key of ``variant``'s baseline, timed in the same interleaved group as ``variant``."""
        return self.paired_with.get(variant.key, variant.baseline)


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

    Variants with a ``group`` are timed after the others, each group interleaved on its own with its
    variants' baselines timed again beside them. Everything shares one process and one heap, and some peers
    change it for whoever runs next: wandb's protobuf messages make glibc hand all free heap memory back to
    the kernel (``malloc_trim``) about once per call, so every row timed after one would fault its memory in
    again, a cost that belongs to wandb and not to the row (docs/benchmarks.md, "Reading the table").
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
    by_key = {v.key: v for v in runnable}
    groups: Dict[str, List[Variant]] = {"": []}
    for v in runnable:
        groups.setdefault(v.group, []).append(v)
    measured = Measurement({}, {}, {}, clock, repetitions, warmup, 0.0)
    rng = random.Random(seed)
    for name, members in groups.items():
        timed = [(v, v.key) for v in members]
        if name:  # the baselines again, under their own keys: their main-matrix samples stay as they are
            for base in dict.fromkeys(v.baseline for v in members if v.baseline != v.key):
                if base in by_key and by_key[base].group != name:
                    timed.append((by_key[base], f"{base}@{name}"))
            keys = {key for _, key in timed}
            for v in members:
                if f"{v.baseline}@{name}" in keys:
                    measured.paired_with[v.key] = f"{v.baseline}@{name}"
        if timed:
            label = f"group {name!r}: " if name else ""
            _time_group(timed, repetitions, rng, measured, clock, label, progress)
    if clock != "wall":
        measured.samples, measured.other = measured.other, measured.samples
    measured.seconds = time.perf_counter() - start
    return measured


def _time_group(
    timed: Sequence, repetitions: int, rng: random.Random, out: Measurement, clock: str, label: str, progress
) -> None:
    """``repetitions`` interleaved rounds over ``timed`` (variant, samples key) pairs: wall samples go to
    ``out.samples``, the CPU clock's to ``out.other`` (swapped by the caller for ``clock="cpu"``)."""
    wall, cpu, settled, faults = out.samples, out.other, out.settle, out.faults
    for v, key in timed:
        wall[key], cpu[key] = [], []
        if v.settle is not None:
            settled[key] = []
        if resource is not None:
            faults[key] = []
    wall_clock = CLOCKS["wall"]
    minor = _minor_faults
    for rep in range(repetitions):
        order = list(timed)
        rng.shuffle(order)
        gc.collect()
        for v, key in order:
            cpu_clock = time.thread_time if v.thread_clock else CLOCKS["cpu"]
            if v.prepare is not None:
                v.prepare()
            # The wall clock is read innermost: a CPU-time read or a fault count is a system call (several
            # microseconds with cold caches), which would otherwise be charged to every wall sample.
            f0 = minor()
            c0 = cpu_clock()
            w0 = wall_clock()
            v.fn()
            w1 = wall_clock()
            c1 = cpu_clock()
            f1 = minor()
            wall[key].append(w1 - w0)
            cpu[key].append(c1 - c0)
            if f0 >= 0:
                faults[key].append(f1 - f0)
            if v.settle is not None:
                s0 = wall_clock()  # not w1: the CPU-clock and fault reads above are not the settle's
                v.settle()
                settled[key].append(wall_clock() - s0)
        if progress is not None and (rep + 1) % max(1, repetitions // 10) == 0:
            progress(f"{label}repetition {rep + 1}/{repetitions}")


def _minor_faults() -> int:
    """Minor page faults of the calling thread so far (of the process where threads are not counted apart);
    -1 where they cannot be counted."""
    if resource is None:
        return -1
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


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
