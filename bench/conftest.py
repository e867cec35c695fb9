"""`make bench`: one interleaved measurement for the session, reported through pytest-benchmark.

Flow: collection decides which rows run (``-k`` works) -> the first test asks for the ``matrix`` fixture,
which builds every selected variant (plus its baseline) and times them all interleaved (bench/harness.py)
-> each test hands its row's samples to pytest-benchmark -> at the end the ratios are written to
bench/results/latest.{json,md} (subset.{json,md} when ``-k`` selected only some rows) and printed; with
INSTRUMENT_BENCH_CHECK=1 an exceeded budget (bench/budgets.toml) makes the run exit non-zero.

Environment: INSTRUMENT_BENCH_REPS (repetitions, default 30), INSTRUMENT_BENCH_WARMUP (untimed calls per
variant, default 2), INSTRUMENT_BENCH_CLOCK (``wall``, the default, or ``cpu``: process CPU time, steadier on
a shared machine but blind to work done in other processes such as wandb's service), INSTRUMENT_BENCH_CHECK=1
(enforce budgets), INSTRUMENT_BENCH_QUICK=1 (a smoke test: 3 repetitions and 1 warm-up call unless set
explicitly, results to bench/results/quick.{json,md} so real figures are never replaced).
"""

import os
from typing import Any, Dict

import pytest
import torch

from bench import report as bench_report
from bench.harness import CLOCKS, run_interleaved
from bench.peers import finish_peers
from bench.workloads import all_keys, build_variants, close_sessions

_STATE: Dict[str, Any] = {}


def _int_env(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise pytest.UsageError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise pytest.UsageError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_mode() -> bool:
    return os.environ.get("INSTRUMENT_BENCH_CHECK", "") not in ("", "0")


def quick_mode() -> bool:
    return os.environ.get("INSTRUMENT_BENCH_QUICK", "") not in ("", "0")


def pytest_configure(config) -> None:
    _STATE["quick"] = quick_mode()
    _STATE["reps"] = _int_env("INSTRUMENT_BENCH_REPS", 3 if _STATE["quick"] else 30, 1)
    _STATE["warmup"] = _int_env("INSTRUMENT_BENCH_WARMUP", 1 if _STATE["quick"] else 2, 1)
    _STATE["clock"] = os.environ.get("INSTRUMENT_BENCH_CLOCK", "wall") or "wall"
    if _STATE["clock"] not in CLOCKS:
        raise pytest.UsageError(
            f"INSTRUMENT_BENCH_CLOCK must be one of {sorted(CLOCKS)}, got {_STATE['clock']!r}"
        )
    _STATE["limits"] = bench_report.load_budgets()  # a broken budgets file fails before anything is timed
    # TorchScript rows script on purpose, and torch.compile imports torch.utils.mkldnn, which uses
    # torch.jit.script_method: torch 2.13 warns that both are deprecated.
    config.addinivalue_line(
        "filterwarnings", r"ignore:`torch\.jit\.script(_method)?` is deprecated:DeprecationWarning"
    )
    # Dynamo probes `.grad` of non-leaf inputs while tracing the compiled rule (the previous iteration's
    # output); torch hides the resulting warning itself, but pyproject turns warnings into errors.
    config.addinivalue_line(
        "filterwarnings", r"ignore:The \.grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
    )
    # On CUDA (INSTRUMENT_BENCH_DEVICE=cuda) inductor suggests TF32 matmuls; the rows keep torch's default
    # precision, the same for every row.
    config.addinivalue_line("filterwarnings", r"ignore:TensorFloat32 tensor cores:UserWarning")


def pytest_collection_finish(session) -> None:
    # After -k/-m deselection: only the rows that will run are built and timed.
    _STATE["selected"] = [
        item.callspec.params["key"]
        for item in session.items
        if hasattr(item, "callspec") and "key" in item.callspec.params
    ]


@pytest.fixture(scope="session")
def matrix(request):
    torch.set_num_threads(1)
    tr = request.config.pluginmanager.get_plugin("terminalreporter")

    def progress(message: str) -> None:
        if tr is not None:
            tr.write_line(f"[bench] {message}")

    load_before = bench_report._load()
    progress(f"building {len(_STATE['selected'])} variants (compiles happen during warm-up)")
    variants = build_variants(_STATE["selected"])
    progress(
        f"timing {sum(v.pending is None for v in variants)} variants x {_STATE['reps']} repetitions, "
        f"interleaved, {_STATE['clock']} clock"
    )
    try:
        measured = run_interleaved(
            variants, _STATE["reps"], warmup=_STATE["warmup"], progress=progress, clock=_STATE["clock"]
        )
    finally:
        finish_peers()
        close_sessions()
    subset = set(_STATE["selected"]) != set(all_keys())
    result = bench_report.build_report(variants, measured, _STATE["limits"], load_before, quick=_STATE["quick"],
                                       subset=subset)
    _STATE["report"] = result
    return {row["key"]: row for row in result["rows"]}


def pytest_sessionfinish(session, exitstatus) -> None:
    result = _STATE.get("report")
    if result is None:
        return
    _STATE["paths"] = bench_report.write(result)
    exceeded = [c for c in result["checks"] if c["enforced"] and not c["ok"]]
    if exceeded and check_mode() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    result = _STATE.get("report")
    if result is None:
        return
    tr = terminalreporter
    quick = " -- QUICK MODE, smoke test only" if result.get("quick") else ""
    tr.section(f"instrument: ratios vs bare (interleaved){quick}")
    tr.write(bench_report.markdown(result))
    paths = _STATE.get("paths", {})
    if paths:
        tr.write_line(f"written: {paths['json']} and {paths['md']}")
    exceeded = [c for c in result["checks"] if c["enforced"] and not c["ok"]]
    if exceeded:
        what = "; ".join(f"{c['key']} {c['value']:.3f} > {c['limit']:.3f}" for c in exceeded)
        if check_mode():
            tr.write_line(
                f"BENCH CHECK FAILED: budget exceeded: {what} (bench/budgets.toml)", red=True, bold=True
            )
        else:
            tr.write_line(
                f"budgets exceeded (not enforced; `make bench-check` fails on these): {what}", yellow=True
            )
    elif check_mode():
        tr.write_line("bench check passed: every budget in bench/budgets.toml is met", green=True)
