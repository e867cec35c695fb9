"""`make bench-hostbound`: the regime of a GPU, measured on a CPU.

On a GPU the bench's small workloads are bound by host time (docs/benchmarks.md: the GPU is busy for 3 of an
NCA step's 15 ms), so what a logging step costs there is what it adds on the training thread: kernel launches
and Python. Most machines these benchmarks run on have no GPU. This shrinks the workloads (the NCA to a
1 x 16 x 4 x 4 state with 16 hidden units, CartPole to 4 environments; iterations and rollout length stay) so
that on a CPU too the arithmetic is negligible and a step's time is dispatch and Python, and reports per
variant of the eager and scripted modes:

* ``+ops``: the aten ops a step dispatches beyond its bare step, counted with a ``TorchDispatchMode``; view ops
  (by the op's schema: ``view``, ``t``, ``select``, ``slice``, ``detach``, ...) are left out, never by a part of
  the name (``index_select`` and ``cat`` are kernels): on a GPU each op counted is a kernel launch of several
  microseconds. A deterministic count, comparable across machines and runs.
* ``+reads``: the one-element host reads (``.item()``, ``_local_scalar_dense``) beyond the bare step, apart from
  ``+ops``. The logger's own become one stacked transfer on a GPU; hand-written ``.item()`` (the ``naive`` rows)
  is a blocking device sync each there. ``.tolist()`` dispatches no op on a CPU, so it is in neither count.
* ``+ms``: the host time it adds, the median over interleaved repetitions of (variant - bare) in the same
  repetition; ``ratio``: the median of (variant / bare).
* ``log-tb x4`` and ``log x4`` (NCA groups): four logging steps back to back with the logger's flush timed
  after them, against four bare steps (`bench.headline.burst_variants`); ``+ops`` and ``+ms`` per step. Here,
  as on a GPU, the training thread runs Python nearly all the time, so whatever of the writer thread's work
  holds the GIL is taken from it: these rows show on a CPU what a loop that logs every step pays on a GPU.

It predicts the direction of a change on a GPU and which part of a logging step costs launches; it does not
predict a GPU's ratios (its launches and Python run at other speeds). ``torch.compile`` rows are left out:
a dispatch mode would make Dynamo trace the step again.

Usage: ``python -m bench.hostbound [--reps N] [--groups nca/eager,rl/eager]``; writes
bench/results/hostbound.{json,md}.
"""

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import workloads
from bench.harness import run_interleaved
from bench.headline import BURST, burst_variants
from bench.report import setup_line

__all__ = ["GROUPS", "count_ops", "main"]

_KINDS = ("log[]", "log[IterationStats]", "log[UpdateNorm]", "log[GradientStats]", "log[NonFinite]",
          "log[ActivationStats]", "log[StateHistogram]", "log", "log-tb", "naive")
GROUPS = {
    "nca/eager": ("bare", "off", *_KINDS, "log[RolloutVideo]"),
    "rl/eager": ("bare", "off", *_KINDS),
    "nca/script": ("bare", "off", "log", "log-tb", "probe-off", "probe-log"),
    "rl/script": ("bare", "off", "log", "log-tb"),
}
BURSTS = ("log-tb", "log")  # the kinds also timed BURST steps back to back, flush timed, in the NCA groups
SIZES = {"nca": {"batch": 1, "size": 4, "hidden": 16}, "rl": {"envs": 4}}
RESULTS = Path(__file__).parent / "results"
# Not launches: view ops (the op's schema says so: view, t, select, slice, expand, unbind, detach, alias, ...)
# and one-element reads. Matched by op, never by a substring of its name: "select" would also drop
# index_select, "slice" slice_backward, "t.default" cat, sqrt and bitwise_not, which are all kernels.
_NOT_LAUNCHES = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten._unsafe_view.default})


def _is_launch(func) -> bool:
    return not (getattr(func, "is_view", False) or func in _NOT_LAUNCHES)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.reads = 0  # one-element host reads (.item()): left out of ops, counted apart

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif _is_launch(func):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(variant: workloads.Variant) -> collections.Counter:
    """The ops one call of ``variant`` dispatches (after its warm-up calls), by name; the one-element host
    reads (``.item()``) under the key ``"reads"``."""
    counter = _Count()
    with counter:
        variant.fn()
    if variant.settle is not None:
        variant.settle()
    return counter.ops + collections.Counter({_READS: counter.reads})


_READS = "reads"  # not an op name: kept out of the op sums below


def measure(groups: Sequence[str], reps: int, warmup: int) -> List[Dict[str, object]]:
    rows: List[Dict[str, object]] = []
    saved = {name: dict(sizes) for name, sizes in (("nca", workloads.NCA_SIZE), ("rl", workloads.RL_SIZE))}
    workloads.NCA_SIZE.update(SIZES["nca"])
    workloads.RL_SIZE.update(SIZES["rl"])
    try:
        for group in groups:
            keys = [f"{group}/{kind}" for kind in GROUPS[group]]
            with tempfile.TemporaryDirectory(prefix="instrument-hostbound-") as tmp:
                variants = [v for v in workloads.build_variants(keys, tmp=tmp) if v.fn is not None]
                by_key = {v.key: v for v in variants}
                bursts = [burst_variants(by_key[f"{group}/bare"], by_key[f"{group}/{kind}"])
                          for kind in BURSTS if group.startswith("nca/") and f"{group}/{kind}" in by_key]
                if bursts:  # one ``bare x4`` baseline for all of them
                    variants += [bursts[0][0], *(burst for _, burst in bursts)]
                try:
                    measured = run_interleaved(variants, reps, warmup=warmup)
                    ops_of = {v.key: count_ops(v) for v in variants if v.key in measured.samples}
                finally:
                    workloads.close_sessions()  # before the folder goes; untimed
                for v in variants:
                    if v.key == v.baseline or v.key not in measured.samples:
                        continue
                    steps = BURST if v.key.endswith(f" x{BURST}") else 1
                    base_ops, base_times = ops_of[v.baseline], measured.samples[v.baseline]
                    reads = (ops_of[v.key][_READS] - base_ops[_READS]) / steps
                    base_ops = base_ops - collections.Counter({_READS: base_ops[_READS]})
                    var_ops = ops_of[v.key] - collections.Counter({_READS: ops_of[v.key][_READS]})
                    added = var_ops - base_ops  # Counter subtraction keeps only what the variant adds
                    pairs = list(zip(measured.samples[v.key], base_times, strict=True))
                    row = {"key": v.key,
                           "ops": round((sum(var_ops.values()) - sum(base_ops.values())) / steps),
                           "reads": round(reads),
                           "top": [(name, round(n / steps)) for name, n in added.most_common(5)],
                           "ms": statistics.median(a - b for a, b in pairs) * 1e3 / steps,
                           "ratio": statistics.median(a / b for a, b in pairs),
                           "bare_ms": statistics.median(base_times) * 1e3 / steps, "describe": v.describe}
                    rows.append(row)
                    print(f"{v.key:34s} {row['ops']:+5d} ops  {row['ms']:+7.3f} ms  {row['ratio']:.3f}x", flush=True)
    finally:
        workloads.NCA_SIZE.update(saved["nca"])
        workloads.RL_SIZE.update(saved["rl"])
    return rows


def markdown(rows: List[Dict[str, object]], reps: int) -> str:
    lines = [
        "# instrument host-bound rows (the GPU's regime on a CPU: tiny workloads, time = dispatch + Python)",
        "",
        f"{setup_line(reps)} `+ops`: aten ops dispatched beyond the bare step (views and `.item()` left out; "
        "a kernel launch each on a GPU). `+ms`: median of the paired differences to the bare step in the same "
        "repetition; `ratio`: median of the paired ratios. `x4` rows: four logging steps back to back, the flush "
        "timed, against four bare steps (`+ops`, `+ms` and the bare step per step).",
        "",
        "`+reads`: one-element host reads (`.item()`) beyond the bare step, not in `+ops`: the Logger's own become "
        "one stacked transfer on a GPU, but hand-written `.item()` (the `naive` rows) is a blocking device sync "
        "each there, and its `.tolist()` calls dispatch no op at all on a CPU (a device copy and sync each on a GPU).",
        "",
        "| variant | +ops | +reads | +ms | ratio | bare step | most added ops | what it is |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        top = ", ".join(f"{n} {name.replace('aten.', '')}" for name, n in row["top"])
        lines.append(f"| `{row['key']}` | {row['ops']:+d} | {row.get('reads', 0):+d} | {row['ms']:+.3f} | "
                     f"{row['ratio']:.3f} | {row['bare_ms']:.2f} ms | {top} | "
                     f"{row['describe']} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40, help="repetitions per group (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per variant first (default 3)")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    args = parser.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        parser.error(f"--groups takes some of {', '.join(GROUPS)}, got {args.groups!r}")
    if args.reps < 1 or args.warmup < 1:
        parser.error(f"--reps and --warmup must be >= 1, got {args.reps} and {args.warmup}")
    if workloads.device().type != "cpu":
        parser.error("the host-bound rows are the CPU's stand-in for a GPU: leave INSTRUMENT_BENCH_DEVICE unset")
    torch.set_num_threads(1)
    rows = measure(groups, args.reps, args.warmup)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostbound.json").write_text(json.dumps({"reps": args.reps, "sizes": SIZES, "rows": rows}, indent=2))
    (RESULTS / "hostbound.md").write_text(markdown(rows, args.reps))
    print(f"written: {RESULTS / 'hostbound.json'} and {RESULTS / 'hostbound.md'}")


if __name__ == "__main__":
    main()
