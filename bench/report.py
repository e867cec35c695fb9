"""Turning interleaved samples into ratios, budget checks, a JSON file and a Markdown table."""

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (the dev extra installs it there)
    import tomli as tomllib
import torch

from bench.harness import Measurement, Variant, paired_ratios, summary
from bench.scalar_rows import BASELINE as SCALARS_BASELINE
from bench.scalar_rows import SCALAR_WORKLOAD
from bench.workloads import HEADLINE, MODES, OWN_COST, device

__all__ = [
    "BUDGETS_FILE",
    "RESULTS_DIR",
    "load_budgets",
    "target_of",
    "build_report",
    "check_budgets",
    "markdown",
    "write",
]

BENCH_DIR = Path(__file__).resolve().parent
BUDGETS_FILE = BENCH_DIR / "budgets.toml"
RESULTS_DIR = BENCH_DIR / "results"


def load_budgets(path: Path = BUDGETS_FILE) -> Dict[str, Dict[str, float]]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    for section, keys in {
        "budgets": (
            "nonlogging",
            "checkpointed_nonlogging",
            "checkpointed_logging_excess",
            "tensorboard_logging_excess",
            "scalars_vs_summarywriter",
        ),
        "targets": ("nonlogging", "logging_tensorboard", "logging", "probe_logging", "scalars_us", "staging_us"),
    }.items():
        missing = [k for k in keys if k not in data.get(section, {})]
        if missing:
            raise ValueError(f"{path}: [{section}] lacks {missing}; every budget lives in this one file.")
    return data


# Targets per row kind (issue 13's Targets table): (name in the report, [targets] entry, unit).
_RATIO_TARGETS = {
    "off": ("target: non-logging", "nonlogging"),
    "probe-off": ("target: non-logging", "nonlogging"),
    HEADLINE: ("target: logging step, real TensorBoard", "logging_tensorboard"),
    "log": ("target: logging step, sink backend", "logging"),
    "probe-log": ("target: probe on a logging step", "probe_logging"),
}
_US_TARGETS = {
    "tb+jsonl+console": ("target: training thread, 100 scalars", "scalars_us"),
    "tb+jsonl+console[tensor]": ("target: training thread, 100 scalars", "scalars_us"),
    "staging": ("target: staging + commit, 100 floats", "staging_us"),
}


def target_of(key: str, targets: Dict[str, float]) -> Optional[Dict[str, Any]]:
    """The issue-13 target that applies to row ``key`` (name, limit, unit ``x`` or ``us``), or None."""
    workload, mode, kind = key.split("/", 2)
    if workload == SCALAR_WORKLOAD:
        found, unit = _US_TARGETS.get(kind), "us"
    elif mode == "ckpt" or (kind.startswith("probe-") and workload != "nca"):
        found, unit = None, "x"  # not in issue 13's table; RL probe rows are not in this matrix
    else:
        found, unit = _RATIO_TARGETS.get(kind), "x"
    if found is None:
        return None
    return {"name": found[0], "limit": float(targets[found[1]]), "unit": unit}


def measured_value(row: Dict[str, Any], unit: str) -> Optional[float]:
    """A row's median in the unit of its target: ratio (``x``) or training-thread microseconds (``us``)."""
    if "ratio" not in row:
        return None
    return row["ratio"]["median"] if unit == "x" else row["seconds"]["median"] * 1e6


def rows(variants: Sequence[Variant], measured: Measurement) -> List[Dict[str, Any]]:
    out = []
    for v in variants:
        row: Dict[str, Any] = {"key": v.key, "baseline": v.baseline, "describe": v.describe}
        if v.group:
            row["group"] = v.group
        samples = measured.samples.get(v.key)
        if v.pending or not samples:
            row["pending"] = v.pending or "not run"
        else:
            base = measured.baseline_of(v)
            if base != v.baseline:  # timed again in the row's own group: those are the samples it pairs with
                row["baseline_samples_s"] = measured.samples[base]
            row["ratio"] = summary(paired_ratios(measured.samples, v.key, base))
            row["seconds"] = summary(samples)
            row["samples_s"] = samples
            row["ratio_other_clock"] = summary(paired_ratios(measured.other, v.key, base))
            if measured.settle.get(v.key):
                row["settle_s"] = summary(measured.settle[v.key])
            if measured.faults.get(v.key):
                row["faults"] = {**summary(measured.faults[v.key]), "max": max(measured.faults[v.key])}
        out.append(row)
    return out


def _ratio(by_key: Dict[str, Dict[str, Any]], key: str) -> Optional[float]:
    row = by_key.get(key)
    return row["ratio"]["median"] if row and "ratio" in row else None


def check_budgets(table: List[Dict[str, Any]], limits: Dict[str, Dict[str, float]]) -> List[Dict[str, Any]]:
    """Every budget (enforced) and target (reported) that applies to a measured row."""
    by_key = {row["key"]: row for row in table}
    budgets, targets = limits["budgets"], limits["targets"]
    checks: List[Dict[str, Any]] = []

    def add(
        name: str, key: str, value: Optional[float], limit: float, enforced: bool, rule: str, unit: str = "x"
    ) -> None:
        if value is None:
            return
        checks.append(
            {
                "name": name,
                "key": key,
                "value": value,
                "limit": limit,
                "unit": unit,
                "enforced": enforced,
                "ok": value <= limit,
                "rule": rule,
            }
        )

    for workload, modes in MODES.items():
        for mode in modes:
            if mode == "ckpt":
                continue
            for kind in ("off", "probe-off"):
                key = f"{workload}/{mode}/{kind}"
                add("budget: non-logging", key, _ratio(by_key, key), budgets["nonlogging"], True, "<= bare x budget")
            tb, sink = _ratio(by_key, f"{workload}/{mode}/{HEADLINE}"), _ratio(by_key, f"{workload}/{mode}/log")
            if sink is not None:
                add(
                    "budget: TensorBoard over sink",
                    f"{workload}/{mode}/{HEADLINE}",
                    tb,
                    sink + budgets["tensorboard_logging_excess"],
                    True,
                    f"<= ({workload}/{mode}/log ratio) + excess",
                )
    add(
        "budget: checkpointed non-logging",
        "nca/ckpt/off",
        _ratio(by_key, "nca/ckpt/off"),
        budgets["checkpointed_nonlogging"],
        True,
        "<= bare checkpointed x budget",
    )
    plain_log, ckpt_log = _ratio(by_key, "nca/eager/log"), _ratio(by_key, "nca/ckpt/log")
    if plain_log is not None:
        add(
            "budget: checkpointed logging",
            "nca/ckpt/log",
            ckpt_log,
            plain_log + budgets["checkpointed_logging_excess"],
            True,
            "<= (nca/eager/log ratio) + excess",
        )
    for kind in ("tb+jsonl+console", "tb+jsonl+console[tensor]"):
        key = f"{SCALAR_WORKLOAD}/x100/{kind}"
        add(
            "budget: training thread vs SummaryWriter",
            key,
            _ratio(by_key, key),
            budgets["scalars_vs_summarywriter"],
            True,
            f"<= {SCALARS_BASELINE} x budget",
        )
    for row in table:
        target = target_of(row["key"], targets)
        if target is not None:
            unit = target["unit"]
            rule = "<= bare x target" if unit == "x" else "training-thread us per logging step <= target"
            add(target["name"], row["key"], measured_value(row, unit), target["limit"], False, rule, unit)
    return checks


def _load() -> Dict[str, float]:
    try:
        one, five, _ = os.getloadavg()
        return {"load1": one, "load5": five}
    except OSError:
        return {}


def build_report(
    variants: Sequence[Variant], measured: Measurement, limits, load_before, quick: bool = False,
    subset: bool = False,
) -> Dict[str, Any]:
    """``subset``: only some rows were selected (pytest ``-k``), so the report must not replace the full one."""
    table = rows(variants, measured)
    return {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": quick,
        "subset": subset,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": device_name(),
            "env": {
                k: os.environ.get(k)
                for k in (
                    "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "INSTRUMENT_BENCH_DEVICE"
                )
            },
            "load_before": load_before,
            "load_after": _load(),
        },
        "clock": measured.clock,
        "repetitions": measured.repetitions,
        "warmup": measured.warmup,
        "harness_seconds": measured.seconds,
        "targets": dict(limits["targets"]),
        "rows": table,
        "observer_costs": observer_costs(measured.samples),
        "checks": check_budgets(table, limits),
    }


def _fmt_ratio(r: Dict[str, float]) -> str:
    return f"{r['median']:.3f} ({r['p25']:.3f}-{r['p75']:.3f})"


def _fmt_us(r: Dict[str, float]) -> str:
    return f"{r['median'] * 1e6:,.0f} ({r['p25'] * 1e6:,.0f}-{r['p75'] * 1e6:,.0f})"


def _fmt_value(value: float, unit: str) -> str:
    return f"{value:.3f}x" if unit == "x" else f"{value:,.0f} us"


def _target_cell(row: Dict[str, Any], targets: Dict[str, float]) -> str:
    """``<= 1.06x: met`` / ``<= 50 us: missed``; blank for rows without an issue-13 target."""
    target = target_of(row["key"], targets)
    if target is None:
        return ""
    limit = target["limit"]
    text = f"<= {limit:.2f}x" if target["unit"] == "x" else f"<= {limit:g} us"
    value = measured_value(row, target["unit"])
    if value is None:
        return text
    return f"{text}: {'met' if value <= limit else '**missed**'}"


def _label(row: Dict[str, Any]) -> str:
    key = f"`{row['key']}`" + (" (own group)" if row.get("group") else "")
    return f"{key} **headline**" if row["key"].endswith("/" + HEADLINE) else key


def _faults(row: Dict[str, Any]) -> str:
    f = row.get("faults")
    return f"{f['median']:,.0f} (max {f['max']:,})" if f else "-"


def markdown(report: Dict[str, Any]) -> str:
    m = report["machine"]
    load = m.get("load_before", {})
    targets = report.get("targets", {})
    matrix = [row for row in report["rows"] if not row["key"].startswith(SCALAR_WORKLOAD + "/")]
    scalars = [row for row in report["rows"] if row["key"].startswith(SCALAR_WORKLOAD + "/")]
    lines = [f"# instrument benchmark ({report['created']})", ""]
    if report.get("quick"):
        lines += [
            "**QUICK MODE** (`INSTRUMENT_BENCH_QUICK=1`): a smoke test of the bench with few repetitions. "
            "The figures are noisy and not for comparison; run `make bench` for them.",
            "",
        ]
    elif report.get("subset"):
        lines += [
            "**A SUBSET** of the rows (selected with `-k`): bench/results/latest.md keeps the last full run.",
            "",
        ]
    lines += [
        f"{m.get('device', 'cpu')}; CPU, {m['cpus']} cores, torch {m['torch']} ({m['torch_threads']} thread), "
        f"Python {m['python']}; "
        f"{report['repetitions']} repetitions, variants interleaved in shuffled order, "
        f"{report['clock']} clock; "
        f"load average before: {load.get('load1', float('nan')):.2f} (1 min), "
        f"after: {m.get('load_after', {}).get('load1', float('nan')):.2f}.",
        "",
        "Ratio = median over repetitions of (variant time / baseline time in the same repetition), "
        "25th-75th percentile in brackets. Baseline: the `bare` row of the same workload and mode. "
        f"The **headline** logging row is `{HEADLINE}` (a real TensorBoard backend); `log` is the same step "
        "with a sink backend. Target: issue 13's target for that row, and whether this run met it. "
        "Page faults: the training thread's minor page faults per step, median (max); a step that faults "
        "thousands of pages is paying for memory that another row's allocator calls handed back to the "
        "kernel. Rows marked (own group) are timed in an interleaved group of their own after the rest, "
        "their baseline timed again beside them (docs/benchmarks.md).",
        "",
        "| variant | ratio vs bare | median step | page faults | target | what it is |",
        "|---|---|---|---|---|---|",
    ]
    for row in matrix:
        target = _target_cell(row, targets)
        if "pending" in row:
            lines.append(f"| {_label(row)} | {row['pending']} | | | {target} | {row['describe']} |")
        else:
            ms = row["seconds"]["median"] * 1e3
            ratio = _fmt_ratio(row["ratio"])
            lines.append(f"| {_label(row)} | {ratio} | {ms:.1f} ms | {_faults(row)} | {target} | {row['describe']} |")
    if scalars:
        lines += [
            "",
            "## Training-thread time per logging step: 100 scalars",
            "",
            "Microseconds the calling thread spends per logging step handing over 100 scalars, median "
            "(25th-75th percentile); ratio vs `SummaryWriter.add_scalar` x100 in the same repetition. "
            "Drain: the untimed `flush()` after the step (work left to a background writer thread), "
            "for orientation.",
            "",
            "| row | us per logging step | vs SummaryWriter x100 | target | drain after the step (untimed) "
            "| what it is |",
            "|---|---|---|---|---|---|",
        ]
        for row in scalars:
            if "pending" in row:
                lines.append(f"| {_label(row)} | {row['pending']} | | {_target_cell(row, targets)} | | |")
                continue
            drain = _fmt_us(row["settle_s"]) + " us" if "settle_s" in row else "-"
            lines.append(
                f"| {_label(row)} | {_fmt_us(row['seconds'])} | {_fmt_ratio(row['ratio'])} | "
                f"{_target_cell(row, targets)} | {drain} | {row['describe']} |"
            )
    if report["observer_costs"]:
        lines += [
            "",
            "## Each observer's own cost per logging step (eager)",
            "",
            "(logging step with only that observer) - (logging step with no observer), "
            "paired per repetition.",
            "",
            "| observer | % of a bare step | ms per logging step |",
            "|---|---|---|",
        ]
        for name, c in report["observer_costs"].items():
            lines.append(
                f"| {name} | {100 * c['fraction_median']:+.1f}% ({100 * c['fraction_p25']:+.1f} to "
                f"{100 * c['fraction_p75']:+.1f}) | {c['ms_median']:.2f} |"
            )
    if report["checks"]:
        lines += [
            "",
            "## Budgets (enforced by `make bench-check`) and targets (reported)",
            "",
            "| check | variant | measured | limit | result |",
            "|---|---|---|---|---|",
        ]
        for c in report["checks"]:
            verdict = "ok" if c["ok"] else ("EXCEEDED" if c["enforced"] else "missed")
            unit = c.get("unit", "x")
            lines.append(
                f"| {c['name']} | `{c['key']}` | {_fmt_value(c['value'], unit)} | {_fmt_value(c['limit'], unit)} "
                f"| {verdict} |"
            )
    return "\n".join(lines) + "\n"


def write(report: Dict[str, Any], directory: Path = RESULTS_DIR) -> Dict[str, Path]:
    """``latest.{json,md}``; a quick-mode run writes ``quick.{json,md}`` and a run of selected rows (``-k``)
    ``subset.{json,md}``, so that neither replaces the last full run's figures."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = "quick" if report.get("quick") else "subset" if report.get("subset") else "latest"
    paths = {"json": directory / f"{stem}.json", "md": directory / f"{stem}.md"}
    paths["json"].write_text(json.dumps(report, indent=1, default=float))
    paths["md"].write_text(markdown(report))
    return paths


def device_name() -> str:
    """Where the workloads ran: ``cpu``, or e.g. ``cuda (NVIDIA H100 80GB HBM3)``."""
    dev = device()
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def setup_line(reps: int) -> str:
    """Where and how a group-by-group run (`bench.headline`, `bench.hostbound`) was timed, for its report."""
    return (f"{device_name()}; {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, Python "
            f"{platform.python_version()}; {reps} repetitions per group.")


def observer_costs(samples: Dict[str, List[float]]) -> Dict[str, Dict[str, float]]:
    """Each observer's own cost per logging step: (log[X] - log[]) / bare, paired per repetition."""
    from bench.harness import summary

    costs: Dict[str, Dict[str, float]] = {}
    for workload in MODES:
        base, empty = f"{workload}/eager/bare", f"{workload}/eager/log[]"
        if base not in samples or empty not in samples:
            continue
        for name in OWN_COST:
            key = f"{workload}/eager/log[{name}]"
            if key not in samples:
                continue
            triples = zip(samples[key], samples[empty], samples[base], strict=True)
            fractions = [(t - e) / b for t, e, b in triples]
            millis = [(t - e) * 1e3 for t, e in zip(samples[key], samples[empty], strict=True)]
            costs[f"{workload}/{name}"] = {
                **{f"fraction_{k}": v for k, v in summary(fractions).items()},
                **{f"ms_{k}": v for k, v in summary(millis).items()},
            }
    return costs
