"""Turning interleaved samples into ratios, budget checks, a JSON file and a Markdown table."""

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import tomllib
import torch

from bench.harness import Measurement, Variant, paired_ratios, summary
from bench.workloads import MODES, observer_costs

__all__ = [
    "BUDGETS_FILE",
    "RESULTS_DIR",
    "load_budgets",
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
        "budgets": ("nonlogging", "checkpointed_nonlogging", "checkpointed_logging_excess"),
        "targets": ("nonlogging", "logging"),
    }.items():
        missing = [k for k in keys if k not in data.get(section, {})]
        if missing:
            raise ValueError(f"{path}: [{section}] lacks {missing}; every budget lives in this one file.")
    return data


def rows(variants: Sequence[Variant], measured: Measurement) -> List[Dict[str, Any]]:
    out = []
    for v in variants:
        row: Dict[str, Any] = {"key": v.key, "baseline": v.baseline, "describe": v.describe}
        samples = measured.samples.get(v.key)
        if v.pending or not samples:
            row["pending"] = v.pending or "not run"
        else:
            ratios = paired_ratios(measured.samples, v.key, v.baseline)
            row["ratio"] = summary(ratios)
            row["seconds"] = summary(samples)
            row["samples_s"] = samples
            row["ratio_other_clock"] = summary(paired_ratios(measured.other, v.key, v.baseline))
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

    def add(name: str, key: str, value: Optional[float], limit: float, enforced: bool, rule: str) -> None:
        if value is None:
            return
        checks.append(
            {
                "name": name,
                "key": key,
                "value": value,
                "limit": limit,
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
                ratio = _ratio(by_key, key)
                add("budget: non-logging", key, ratio, budgets["nonlogging"], True, "<= bare x budget")
                add("target: non-logging", key, ratio, targets["nonlogging"], False, "<= bare x target")
            key = f"{workload}/{mode}/log"
            add("target: logging", key, _ratio(by_key, key), targets["logging"], False, "<= bare x target")
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
    return checks


def _load() -> Dict[str, float]:
    try:
        one, five, _ = os.getloadavg()
        return {"load1": one, "load5": five}
    except OSError:
        return {}


def build_report(variants: Sequence[Variant], measured: Measurement, limits, load_before) -> Dict[str, Any]:
    table = rows(variants, measured)
    return {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "env": {
                k: os.environ.get(k)
                for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
            },
            "load_before": load_before,
            "load_after": _load(),
        },
        "clock": measured.clock,
        "repetitions": measured.repetitions,
        "warmup": measured.warmup,
        "harness_seconds": measured.seconds,
        "rows": table,
        "observer_costs": observer_costs(measured.samples),
        "checks": check_budgets(table, limits),
    }


def _fmt_ratio(r: Dict[str, float]) -> str:
    return f"{r['median']:.3f} ({r['p25']:.3f}-{r['p75']:.3f})"


def markdown(report: Dict[str, Any]) -> str:
    m = report["machine"]
    load = m.get("load_before", {})
    lines = [
        f"# instrument benchmark ({report['created']})",
        "",
        f"CPU, {m['cpus']} cores, torch {m['torch']} ({m['torch_threads']} thread), Python {m['python']}; "
        f"{report['repetitions']} repetitions, variants interleaved in shuffled order, "
        f"{report['clock']} clock; "
        f"load average before: {load.get('load1', float('nan')):.2f} (1 min), "
        f"after: {m.get('load_after', {}).get('load1', float('nan')):.2f}.",
        "",
        "Ratio = median over repetitions of (variant time / baseline time in the same repetition), "
        "25th-75th percentile in brackets. Baseline: the `bare` row of the same workload and mode.",
        "",
        "| variant | ratio vs bare | median step | what it is |",
        "|---|---|---|---|",
    ]
    for row in report["rows"]:
        if "pending" in row:
            lines.append(f"| `{row['key']}` | {row['pending']} | | {row['describe']} |")
        else:
            ms = row["seconds"]["median"] * 1e3
            ratio = _fmt_ratio(row["ratio"])
            lines.append(f"| `{row['key']}` | {ratio} | {ms:.1f} ms | {row['describe']} |")
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
            "| check | variant | ratio | limit | result |",
            "|---|---|---|---|---|",
        ]
        for c in report["checks"]:
            verdict = "ok" if c["ok"] else ("EXCEEDED" if c["enforced"] else "missed")
            lines.append(f"| {c['name']} | `{c['key']}` | {c['value']:.3f} | {c['limit']:.3f} | {verdict} |")
    return "\n".join(lines) + "\n"


def write(report: Dict[str, Any], directory: Path = RESULTS_DIR) -> Dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "latest.json", "md": directory / "latest.md"}
    paths["json"].write_text(json.dumps(report, indent=1, default=float))
    paths["md"].write_text(markdown(report))
    return paths
