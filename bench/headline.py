"""`make bench-headline`: the issue-13 target rows, one small interleaved group per workload and mode.

The full matrix (`make bench`) interleaves some 60 variants, so one repetition spans many seconds and the
machine's drift between a variant and its baseline is large (quartiles about +-10 % on a shared 2-core
machine). Here each group holds only a bare step, the same step with logging (sink and real TensorBoard),
the hand-written ``.item()`` code and, for NCA script/compile, the embedded probe, timed interleaved with
more repetitions: a repetition spans about a second, so the paired ratios are steadier. Same variants,
same harness, same ratio definition (median of per-repetition ratios to ``bare``).

Each timed call of those rows is one logging step, and the logger's flush runs untimed after it: the row is
what the step costs the training thread. What the writer thread then does (rendering heatmaps, encoding PNGs,
writing event files) runs beside the next steps of a loop that logs every step, and in Python it takes the
GIL from the training thread for whatever part of it holds the GIL. The NCA groups also time that regime:
``log-tb x4`` is four logging steps back to back with the flush timed after them, against ``bare x4``, four
bare steps (`BURST`).

Usage: ``python -m bench.headline [--reps N]``; writes bench/results/headline.{json,md}.
"""

import argparse
import json
import tempfile
from pathlib import Path
from typing import Dict, List

import torch

from bench.harness import Variant, paired_ratios, run_interleaved, summary
from bench.report import setup_line
from bench.workloads import build_variants, close_sessions

__all__ = ["BURST", "GROUPS", "burst_variants", "main"]

GROUPS = {
    f"{workload}/{mode}": [f"{workload}/{mode}/{kind}" for kind in kinds]
    for workload, modes in (("nca", ("eager", "script", "compile")), ("rl", ("eager", "script", "compile")))
    for mode in modes
    for kinds in [
        ("bare", "off", "log", "log-tb")
        + (("naive",) if mode == "eager" else ())
        + (("probe-log",) if workload == "nca" and mode != "eager" else ())
    ]
}
RESULTS = Path(__file__).parent / "results"
BURST = 4  # logging steps back to back in the ``log-tb x4`` rows (NCA groups only: an RL step takes ~10x longer)


def burst_variants(bare: Variant, logged: Variant) -> List[Variant]:
    """``bare x4`` and ``log-tb x4``: BURST calls in a row, the logger's flush timed after the last."""

    def repeat(v: Variant):
        def fn() -> None:
            for _ in range(BURST):
                v.fn()
            if v.settle is not None:
                v.settle()

        return fn

    base = Variant(key=f"{bare.key} x{BURST}", baseline=f"{bare.key} x{BURST}", fn=repeat(bare),
                   describe=f"{BURST} bare steps")
    burst = Variant(key=f"{logged.key} x{BURST}", baseline=base.key, fn=repeat(logged),
                    describe=f"{BURST} logging steps back to back, then the flush, all timed (a loop logging "
                             f"every step: the writer thread's work runs beside the next steps)")
    return [base, burst]


def measure(reps: int, warmup: int) -> List[Dict[str, object]]:
    rows: List[Dict[str, object]] = []
    for group, keys in GROUPS.items():
        with tempfile.TemporaryDirectory(prefix="instrument-headline-") as tmp:
            variants = build_variants(keys, tmp=tmp)
            if group.startswith("nca/"):
                by_key = {v.key: v for v in variants}
                variants += burst_variants(by_key[f"{group}/bare"], by_key[f"{group}/log-tb"])
            try:
                measured = run_interleaved(variants, reps, warmup=warmup)
            finally:
                close_sessions()  # before the folder goes; untimed
            for v in variants:
                if v.key == v.baseline or v.key not in measured.samples:
                    continue
                ratio = summary(paired_ratios(measured.samples, v.key, v.baseline))
                rows.append({"key": v.key, "ratio": ratio, "describe": v.describe})
                print(f"{v.key:32s} {ratio['median']:.3f} ({ratio['p25']:.3f}-{ratio['p75']:.3f})", flush=True)
    return rows


def markdown(rows: List[Dict[str, object]], reps: int) -> str:
    lines = [
        "# instrument headline rows (one interleaved group per workload and mode)",
        "",
        f"{setup_line(reps)} Ratio: median of per-repetition ratios to the group's `bare` step (`x{BURST}` "
        f"rows: to `bare x{BURST}`), 25th-75th percentile in brackets.",
        "",
        "| variant | ratio vs bare | what it is |",
        "|---|---|---|",
    ]
    for row in rows:
        r = row["ratio"]
        lines.append(f"| `{row['key']}` | {r['median']:.3f} ({r['p25']:.3f}-{r['p75']:.3f}) | {row['describe']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=60, help="repetitions per group (default 60)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per variant first (default 3)")
    args = parser.parse_args()
    if args.reps < 1 or args.warmup < 1:
        parser.error(f"--reps and --warmup must be >= 1, got {args.reps} and {args.warmup}")
    torch.set_num_threads(1)
    rows = measure(args.reps, args.warmup)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "headline.json").write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=2))
    (RESULTS / "headline.md").write_text(markdown(rows, args.reps))
    print(f"written: {RESULTS / 'headline.json'} and {RESULTS / 'headline.md'}")


if __name__ == "__main__":
    main()
