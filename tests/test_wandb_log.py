"""The shipped reader of W&B's offline transaction log (instrument/backends/wandb_log.py), checked against the
tests' own reader on a real offline run file, whole and cut at every kind of place a process killed while W&B's
service wrote could leave it; and the W&B backend resuming over a torn file and over one it cannot read."""

import logging
from pathlib import Path

import pytest

from instrument.backends.base import RunInfo, StepRecord
from instrument.backends.wandb import WandbBackend
from instrument.backends.wandb_log import last_step, run_files
from tests.wandb_reader import history_step, read_history, record_ends

STEPS = [0, 10, 20, 30, 40]
BIG = {20, 40}  # rows over two 32 KiB blocks: their records are split into first, middle and last fragments


def _write(folder: Path, run_id=None, steps=STEPS, offset: float = 0.0) -> Path:
    """A finished offline run of ``WandbBackend`` under ``folder`` (resumed when ``run_id`` is given)."""
    backend = WandbBackend(project="tests")
    backend.open(RunInfo("r", folder, resume={"WandbBackend": run_id} if run_id else None))
    for step in steps:
        wide = {f"wide/{i:05d}": float(i) for i in range(8000)} if step in BIG else {}
        backend.write(StepRecord(step=step, scalars={"v": step + offset, **wide}))
    sync_file = Path(backend.run.settings.sync_file)
    backend.close()
    read_history(sync_file, timeout=60.0)  # W&B's service may still be writing it: wait for its exit record
    return sync_file


def test_the_last_step_of_a_whole_file_and_of_every_cut_matches_the_tests_reader(tmp_path):
    pytest.importorskip("wandb")
    path = _write(tmp_path)
    assert [row["_step"] for row in read_history(path, timeout=60.0)] == STEPS
    data = path.read_bytes()
    ends = record_ends(path)
    assert len(data) > 4 * 32768 and any(b - a > 2 * 32768 for (a, _), (b, _) in zip(ends[:-1], ends[1:], strict=True))
    assert last_step(path) == 40
    kept = [(end, history_step(record)) for end, record in ends if history_step(record) is not None]
    cuts = set(range(0, len(data), 1009)) | {e + d for e, _ in ends for d in (-1, 0, 1)} | {len(data) - 1}
    torn = tmp_path / "torn.wandb"
    for cut in sorted(c for c in cuts if 0 <= c <= len(data)):
        torn.write_bytes(data[:cut])
        expected = max((step for end, step in kept if end <= cut), default=None)
        assert last_step(torn) == expected, cut
    # cut in the middle of the last history record (step 40, three fragments): step 30 is the last whole one
    (start,) = [end for end, step in kept if step == 30]
    (stop,) = [end for end, step in kept if step == 40]
    torn.write_bytes(data[: (start + stop) // 2])
    assert last_step(torn) == 30


def test_a_file_that_is_not_a_transaction_log_is_refused(tmp_path):
    pytest.importorskip("wandb")
    (tmp_path / "x.wandb").write_bytes(b"PK\x03\x04 not a W&B log")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        last_step(tmp_path / "x.wandb")
    (tmp_path / "x.wandb").write_bytes(b":W&")  # killed while writing the file header: nothing in it
    assert last_step(tmp_path / "x.wandb") is None


def _history(path: Path):
    return [(row["_step"], row["v"]) for row in read_history(path, timeout=60.0) if "v" in row]


def test_a_resumed_offline_run_over_a_torn_file_writes_from_the_first_step_it_lost(tmp_path):
    pytest.importorskip("wandb")
    first = _write(tmp_path)
    run_id = first.stem[len("run-"):]
    ends = record_ends(first)
    (cut,) = [end - 3 for end, record in ends if history_step(record) == 30]
    first.write_bytes(first.read_bytes()[:cut])  # killed while W&B wrote step 30: 30 and 40 are lost
    assert [history_step(r) for end, r in ends if end <= cut and history_step(r) is not None] == [0, 10, 20]
    second = _write(tmp_path, run_id, steps=[30, 40, 50], offset=1000.0)
    assert second.parent != first.parent and run_files(first.parent.parent, run_id) == [first, second]
    assert _history(second) == [(30, 1030.0), (40, 1040.0), (50, 1050.0)]


def test_an_earlier_folder_it_cannot_read_costs_a_warning_and_every_step_is_written(tmp_path, caplog):
    pytest.importorskip("wandb")
    first = _write(tmp_path)
    run_id = first.stem[len("run-"):]
    first.write_bytes(b"garbage, not a W&B log")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        second = _write(tmp_path, run_id, steps=[30, 40], offset=1000.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and run_id in warnings[0] and "not a W&B transaction log" in warnings[0]
    assert _history(second) == [(30, 1030.0), (40, 1040.0)]


def test_system_samples_left_at_close_of_a_resumed_offline_run_take_a_step_above_the_held_ones(tmp_path):
    pytest.importorskip("wandb")
    first = _write(tmp_path)
    run_id = first.stem[len("run-"):]
    backend = WandbBackend(project="tests")
    backend.open(RunInfo("r", tmp_path, resume={"WandbBackend": run_id}))
    backend.write(StepRecord(step=30, scalars={"v": 1030.0}))  # held by the first folder: not written
    backend.write_system(StepRecord(step=3, scalars={"system/cpu": 12.5, "system/seconds": 3.0}))
    second = Path(backend.run.settings.sync_file)
    backend.close()
    rows = read_history(second, timeout=60.0)
    assert [(row["_step"], row["system/cpu"], "v" in row) for row in rows] == [(41, 12.5, False)]


def test_a_resumed_offline_run_keeps_each_key_to_the_kind_it_took_before(tmp_path):
    """W&B keeps one kind of value per key: a histogram logged beside a scalar of its key goes under
    reward/histogram. A resumed run forgot that (the choice lived in memory) and logged the histogram under
    reward itself, so one W&B key mixed a number and a histogram. Now the earlier folders' keys are read back."""
    pytest.importorskip("wandb")
    import numpy as np

    first = WandbBackend(project="tests")
    first.open(RunInfo("r", tmp_path))
    for step in (0, 1):
        first.write(StepRecord(step=step, scalars={"reward": 1.0} if step == 0 else {"loss": 0.5},
                               histograms={"reward": np.arange(5.0), "hist": np.arange(3.0)}))
    run_id, first_file = first.run.id, Path(first.run.settings.sync_file)
    first.close()
    read_history(first_file, timeout=60.0)
    again = WandbBackend(project="tests")
    again.open(RunInfo("r", tmp_path, resume={"WandbBackend": run_id}))
    again.write(StepRecord(step=2, scalars={"hist": 2.0}, histograms={"reward": np.arange(4.0)}))
    again_file = Path(again.run.settings.sync_file)
    again.close()
    rows = read_history(first_file) + read_history(again_file, timeout=60.0)
    kinds = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith("_"):
                kinds.setdefault(key, set()).add("media" if isinstance(value, dict) else "number")
    assert all(len(kind) == 1 for kind in kinds.values()), kinds
    assert kinds["reward"] == {"number"} and kinds["reward/histogram"] == {"media"}
    assert kinds["hist"] == {"media"} and kinds["hist/scalar"] == {"number"}
    assert [row["_step"] for row in rows if "reward/histogram" in row] == [0, 1, 2]
