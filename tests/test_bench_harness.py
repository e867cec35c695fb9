"""The bench harness's interleaving: rows with a ``group`` are timed after the main matrix, in a group of their
own, against their baseline timed again beside them; every timed call's page faults are counted."""

import json
import sys
from pathlib import Path

import pytest

from bench.harness import Variant, paired_ratios, run_interleaved
from bench.report import markdown, rows, write


def _variants(calls):
    def step(name):
        return lambda: calls.append(name)

    return [
        Variant(key="w/m/bare", baseline="w/m/bare", fn=step("bare")),
        Variant(key="w/m/extra", baseline="w/m/bare", fn=step("extra")),
        Variant(key="w/m/peer", baseline="w/m/bare", fn=step("peer"), group="peers"),
        Variant(key="w/m/later", baseline="w/m/bare", fn=step("later"), group="peers", pending="not here"),
    ]


def test_a_grouped_row_is_timed_after_the_main_matrix_against_its_baseline_timed_beside_it():
    calls = []
    variants = _variants(calls)
    measured = run_interleaved(variants, repetitions=7, warmup=1)
    timed = calls[3:]  # after one warm-up call of each runnable variant
    first_peer = timed.index("peer")
    assert sorted(timed[:first_peer]) == ["bare"] * 7 + ["extra"] * 7  # the main matrix, complete, first
    assert sorted(timed[first_peer:]) == ["bare"] * 7 + ["peer"] * 7  # then the group, its baseline again
    assert "later" not in calls  # a pending row is never called
    assert set(measured.samples) == {"w/m/bare", "w/m/extra", "w/m/peer", "w/m/bare@peers"}
    assert all(len(s) == 7 for s in measured.samples.values())
    assert measured.baseline_of(variants[2]) == "w/m/bare@peers"
    assert measured.baseline_of(variants[1]) == "w/m/bare"


def test_the_report_pairs_a_grouped_row_with_the_baseline_of_its_own_group():
    variants = _variants([])
    measured = run_interleaved(variants, repetitions=5, warmup=1)
    # Made-up samples, so that pairing with the wrong baseline gives a different figure.
    measured.samples.update({"w/m/bare": [1.0] * 5, "w/m/bare@peers": [2.0] * 5, "w/m/peer": [3.0] * 5})
    table = {row["key"]: row for row in rows(variants, measured)}
    assert table["w/m/peer"]["ratio"]["median"] == 1.5
    assert paired_ratios(measured.samples, "w/m/peer", "w/m/bare@peers") == [1.5] * 5
    assert table["w/m/peer"]["group"] == "peers" and "group" not in table["w/m/extra"]
    assert table["w/m/peer"]["baseline_samples_s"] == [2.0] * 5 and "baseline_samples_s" not in table["w/m/extra"]
    assert table["w/m/later"]["pending"] == "not here"
    report = {
        "created": "now", "machine": {"cpus": 2, "torch": "x", "torch_threads": 1, "python": "3"},
        "repetitions": 5, "clock": "wall", "rows": list(table.values()), "observer_costs": {}, "checks": [],
    }
    assert "`w/m/peer` (own group)" in markdown(report)


def test_the_cpu_clock_swaps_the_samples_of_every_group():
    variants = _variants([])
    measured = run_interleaved(variants, repetitions=3, warmup=1, clock="cpu")
    assert measured.clock == "cpu"
    assert set(measured.samples) == set(measured.other) == {"w/m/bare", "w/m/extra", "w/m/peer", "w/m/bare@peers"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page faults of one thread: Linux's getrusage")
def test_the_page_faults_of_a_call_that_touches_new_memory_are_counted_for_it():
    held = []

    def touch():  # 64 MiB written, and kept, so the pages are new to this process each call
        block = bytearray(64 << 20)
        block[::4096] = b"\1" * len(block[::4096])
        held.append(block)

    variants = [
        Variant(key="w/m/bare", baseline="w/m/bare", fn=lambda: None),
        Variant(key="w/m/touch", baseline="w/m/bare", fn=touch),
    ]
    measured = run_interleaved(variants, repetitions=3, warmup=1)
    assert all(f >= 16384 // 2 for f in measured.faults["w/m/touch"])  # 16,384 pages of 4 KiB each call
    assert all(f < 1000 for f in measured.faults["w/m/bare"])
    held.clear()


@pytest.mark.parametrize(("quick", "subset", "stem"), [(False, False, "latest"), (True, False, "quick"),
                                                        (False, True, "subset"), (True, True, "quick")])
def test_only_a_full_run_replaces_the_latest_figures(tmp_path, quick, subset, stem):
    """A quick run or a run of rows selected with -k writes beside latest.{json,md}, never over it."""
    variants = _variants([])
    measured = run_interleaved(variants, repetitions=2, warmup=1)
    report = {
        "created": "now", "machine": {"cpus": 2, "torch": "x", "torch_threads": 1, "python": "3"},
        "repetitions": 2, "clock": "wall", "rows": rows(variants, measured), "observer_costs": {}, "checks": [],
        "quick": quick, "subset": subset,
    }
    paths = write(report, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.md"]
    assert paths["md"] == tmp_path / f"{stem}.md"
    assert ("A SUBSET" in paths["md"].read_text()) == (subset and not quick)


def test_the_host_bound_rows_count_no_op_on_a_non_logging_step_and_restore_the_workload_sizes(tmp_path,
                                                                                                monkeypatch):
    """`make bench-hostbound`, one repetition: a non-logging step dispatches exactly the bare step's ops, a
    logging step more, and four of them back to back four times as many (the ``x4`` row, per step); the tiny
    sizes it sets do not leak into the rest of the process (`make bench`)."""
    from bench import hostbound, workloads

    monkeypatch.setattr(hostbound, "RESULTS", tmp_path)
    monkeypatch.setitem(hostbound.GROUPS, "nca/eager", ("bare", "off", "log[]", "log[NonFinite]", "log"))
    before = dict(workloads.NCA_SIZE)
    hostbound.main(["--reps", "1", "--warmup", "1", "--groups", "nca/eager"])
    assert workloads.NCA_SIZE == before
    rows = {row["key"]: row for row in json.loads((tmp_path / "hostbound.json").read_text())["rows"]}
    assert rows["nca/eager/off"]["ops"] == 0 and rows["nca/eager/log[]"]["ops"] == 0
    assert rows["nca/eager/log[NonFinite]"]["ops"] > 0
    assert rows["nca/eager/log x4"]["ops"] == rows["nca/eager/log"]["ops"] > 0
    assert "nca/eager/log-tb x4" not in rows  # only the kinds the group has
    assert rows["nca/eager/log x4"]["ratio"] > 0
    assert "| `nca/eager/log[NonFinite]` | +" in (tmp_path / "hostbound.md").read_text()
    with pytest.raises(SystemExit):
        hostbound.main(["--groups", "nca/compile"])  # not a host-bound group: said, nothing run


def test_headline_burst_rows_run_the_step_back_to_back_and_time_the_flush():
    """`make bench-headline`'s ``x4`` rows: BURST calls of the step, then the logger's flush, inside the timed call
    (the untimed settle of the one-step rows would hide the writer thread's work)."""
    from bench.harness import Variant
    from bench.headline import BURST, burst_variants

    calls = []
    bare = Variant(key="nca/eager/bare", baseline="nca/eager/bare", fn=lambda: calls.append("bare"))
    logged = Variant(key="nca/eager/log-tb", baseline="nca/eager/bare", fn=lambda: calls.append("log"),
                     settle=lambda: calls.append("flush"))
    base, burst = burst_variants(bare, logged)
    assert (base.key, base.baseline) == (f"nca/eager/bare x{BURST}", f"nca/eager/bare x{BURST}")
    assert (burst.key, burst.baseline) == (f"nca/eager/log-tb x{BURST}", base.key)
    assert burst.settle is None and base.settle is None
    burst.fn()
    base.fn()
    assert calls == ["log"] * BURST + ["flush"] + ["bare"] * BURST


def test_the_host_bound_op_count_tells_views_from_kernels_by_the_op_not_by_its_name():
    """`+ops` dropped every op whose name contained a view's: "t.default" also dropped cat, sqrt and
    bitwise_not, "select" index_select, so `log[RolloutVideo]` read +18 where it dispatches +53. One-element
    host reads are counted apart (`+reads`): hand-written `.item()` is a device sync each on a GPU."""
    import torch

    from bench import hostbound

    x = torch.arange(12.0).reshape(3, 4)
    counter = hostbound._Count()
    with counter:
        torch.cat([x, x])
        x.index_select(0, torch.tensor([0, 2]))
        x.sqrt()
        torch.bitwise_not(torch.tensor([True]))
        x.t(), x[0], x[:, 1:], x.view(4, 3), x.unsqueeze(0), x.expand(2, 3, 4), x.detach()  # views: no kernel
        x[0, 0].item()
    launched = {name.replace("aten.", "") for name in counter.ops}
    assert {"cat.default", "index_select.default", "sqrt.default", "bitwise_not.default"} <= launched
    assert not launched & {"t.default", "select.int", "slice.Tensor", "view.default", "unsqueeze.default",
                           "expand.default", "detach.default"}, launched
    assert counter.reads == 1


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")  # scripted rows
def test_the_probe_rows_flush_their_logger_untimed_like_every_other_instrumented_row(monkeypatch):
    """`probe-off` / `probe-log` had no settle: their writer thread's work for a step ran while the next row
    was timed (about 2.5 ms of a 10 ms bare step, whichever row came next)."""
    from bench import hostbound, workloads

    monkeypatch.setattr(workloads, "NCA_SIZE", {**workloads.NCA_SIZE, **hostbound.SIZES["nca"]})
    try:
        variants = workloads.build_variants(["nca/script/probe-log", "nca/script/log"])
        by_key = {v.key: v for v in variants}
        assert by_key["nca/script/probe-log"].settle is not None
        assert by_key["nca/script/probe-log"].settle.__name__ == by_key["nca/script/log"].settle.__name__ == "flush"
    finally:
        workloads.close_sessions()


def test_make_bench_probes_runs_to_its_table_and_leaves_no_session_or_run_folder(tmp_path):
    """`bench/probe_overhead.py` entered `inst.step(0)` at every call, so its second warm-up call raised
    StepOrderError and `make bench-probes` printed no figure; its sessions were never closed (a warning per
    mode) and wrote run folders into the working directory."""
    import subprocess

    script = str(Path(__file__).resolve().parents[1] / "bench" / "probe_overhead.py")
    done = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", script, "--reps", "2", "--workloads", "nca,cartpole",
         "--batch", "1", "--size", "8", "--n-iter", "4", "--n-steps", "8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("nca ", "cartpole "))]
    assert [row[:2] for row in rows] == [["nca", "eager"], ["nca", "scripted"], ["cartpole", "eager"],
                                        ["cartpole", "scripted"]]
    assert all(float(value) > 0 for row in rows for value in row[2:])
    assert "dropped without close" not in done.stderr + done.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_phase_rows_time_every_phase_of_each_kind_and_restore_the_workload_sizes(tmp_path, monkeypatch):
    """`make bench-phases`, two rounds on the tiny NCA: every kind has every phase, the report is written, and
    the sizes it set do not leak into the rest of the process."""
    from bench import phases, workloads

    monkeypatch.setattr(phases, "RESULTS", tmp_path)
    before = dict(workloads.NCA_SIZE)
    medians = phases.main(["--reps", "2", "--warmup", "1", "--hostbound"])
    assert workloads.NCA_SIZE == before
    assert set(medians) == set(phases.KINDS)
    assert all(set(row) == set(phases.PHASES) for row in medians.values())
    saved = json.loads((tmp_path / "phases.json").read_text())
    assert saved["reps"] == 2 and saved["ms"]["bare"]["forward"] > 0
    assert "| `log-tb` |" in (tmp_path / "phases.md").read_text()
