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


def _summary(path: Path) -> dict:
    """The run summary's updates in the file at ``path`` (W&B writes them as summary records), the last wins."""
    import json

    out = {}
    for _, record in record_ends(path):
        if record.WhichOneof("record_type") == "summary":
            out.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.summary.update})
    return out


def _exit_codes(path: Path) -> list:
    return [record.exit.exit_code for _, record in record_ends(path) if record.WhichOneof("record_type") == "exit"]


def test_system_samples_left_at_close_of_a_resumed_offline_run_go_into_the_summary_and_take_no_step(tmp_path):
    pytest.importorskip("wandb")
    first = _write(tmp_path)
    run_id = first.stem[len("run-"):]
    backend = WandbBackend(project="tests")
    backend.open(RunInfo("r", tmp_path, resume={"WandbBackend": run_id}))
    backend.write(StepRecord(step=30, scalars={"v": 1030.0}))  # held by the first folder: not written
    backend.write_system(StepRecord(step=3, scalars={"system/cpu": 12.5, "system/seconds": 3.0}))
    second = Path(backend.run.settings.sync_file)
    backend.close()
    assert read_history(second, timeout=60.0) == []
    assert _summary(second)["system/cpu"] == 12.5 and _summary(second)["system/seconds"] == 3.0


def test_a_job_that_closes_normally_and_is_resumed_keeps_every_training_step(tmp_path):
    """With the system monitor, each job's close logged the samples left over as a row of their own at the step
    after its last, and the next job, resumed, counted that row as written and skipped its first training step:
    steps 0..4, 6..9, 11..14 of 0..14. Now those samples go into the run summary and every step is in a row."""
    pytest.importorskip("wandb")
    files, run_id = [], None
    for job in range(3):
        backend = WandbBackend(project="tests")
        backend.open(RunInfo("r", tmp_path, resume={"WandbBackend": run_id} if run_id else None))
        for step in range(5 * job, 5 * job + 5):
            backend.write_system(StepRecord(step=step, scalars={"system/cpu": float(step), "system/seconds": step}))
            backend.write(StepRecord(step=step, scalars={"v": 1000.0 * job + step}))
        backend.write_system(StepRecord(step=99, scalars={"system/cpu": 100.0 + job, "system/seconds": 99.0}))
        run_id, path = backend.run.id, Path(backend.run.settings.sync_file)
        backend.close()
        read_history(path, timeout=60.0)
        files.append(path)
    assert run_files(tmp_path / "r" / "wandb", run_id) == files
    rows = [row for path in files for row in read_history(path)]
    assert [(row["_step"], row.get("v")) for row in rows] == [(step, 1000.0 * (step // 5) + step) for step in range(15)]
    assert [row["system/cpu"] for row in rows] == [float(step) for step in range(15)]  # each rode on its row
    assert [_summary(path)["system/cpu"] for path in files] == [100.0, 101.0, 102.0]


def test_one_instance_given_to_a_new_run_after_a_resume_writes_every_step_of_it_into_its_own_folder(tmp_path):
    """One WandbBackend resumed run "a" (which held steps 0..4), closed, then opened a new run "b": it kept a's
    folder, so b's W&B run was written under a's, and a's last step, so b held only the steps above it (0..4
    skipped, without a word); b also kept a's keys (b's histogram "x" went under x/histogram, beside a scalar
    "x" of a) and a's exit code."""
    pytest.importorskip("wandb")
    import numpy as np

    first = WandbBackend(project="tests")
    first.open(RunInfo("a", tmp_path / "one"))
    for step in range(5):
        first.write(StepRecord(step=step, scalars={"v": float(step), "x": 1.0}))
    run_a = first.run.id
    first.close()
    reused = WandbBackend(project="tests")
    reused.open(RunInfo("a", tmp_path / "one", resume={"WandbBackend": run_a}))
    reused.write(StepRecord(step=4, scalars={"v": -1.0}))  # held: not written again
    reused.write(StepRecord(step=5, scalars={"v": 5.0}))
    reused.on_exit("killed")
    reused.close()
    reused.open(RunInfo("b", tmp_path / "two"))  # a new run through the same instance
    for step in range(8):
        reused.write(StepRecord(step=step, scalars={"v": 100.0 + step}, histograms={"x": np.arange(3.0)}))
    run_b, path = reused.run.id, Path(reused.run.settings.sync_file)
    reused.close()
    assert run_b != run_a
    rows = read_history(path, timeout=60.0)
    assert [(row["_step"], row["v"]) for row in rows] == [(step, 100.0 + step) for step in range(8)]
    assert path.parent.parent == (tmp_path / "two" / "b" / "wandb").resolve()
    assert not list((tmp_path / "one").rglob(f"run-{run_b}.wandb"))
    assert all(isinstance(row["x"], dict) and "x/histogram" not in row for row in rows)
    assert _exit_codes(path) == [0]
    held = run_files(tmp_path / "one" / "a" / "wandb", run_a)
    assert [[(row["_step"], row["v"]) for row in read_history(f, timeout=60.0)] for f in held] == [
        [(step, float(step)) for step in range(5)], [(5, 5.0)]]
    assert _exit_codes(held[1]) == [1]


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
