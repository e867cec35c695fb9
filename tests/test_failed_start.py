"""A start that fails leaves nothing that blocks its own run_name.

Real backends that cannot open (MLflow at a port nobody listens on, TensorBoard whose folder is a plain file)
next to backends that did open and write (TensorBoard, JSONL, the run log, W&B offline, MLflow's local
store): the error is raised, the run folder the start made is gone, and a second start with the same
run_name runs and logs (read back from its files). What existed before the start is left byte for byte.
"""

import json
import logging
import os
import socket
import textwrap
import threading
from pathlib import Path

import pytest

import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.errors import ConfigurationError
from tests.conftest import read_scalars, run_child

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unopenable(tmp_path: Path, kind: str):
    """A real backend that cannot open, and the name its error carries."""
    if kind == "mlflow":
        pytest.importorskip("mlflow")
        from instrument.backends.mlflow import MlflowBackend

        uri = f"http://127.0.0.1:{_free_port()}"
        return MlflowBackend(tracking_uri=uri, timeout=1, max_retries=0), r"MlflowBackend: .*127\.0\.0\.1"
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    return TensorBoardBackend(log_dir=str(blocker)), r"TensorBoardBackend(#2)?: .*blocker"  # #2: a second one


def _log_and_close(inst, values):
    for step, x in enumerate(values):
        with inst.step(step):
            inst.logger.log_metrics({"x": x}, step)
    inst.close()


def _jsonl(path: Path):
    return [(row["step"], row["metrics"]["x"]) for row in map(json.loads, path.read_text().splitlines())]


def _tree(path: Path):
    """Every file under ``path`` with its bytes: what 'left alone' means."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["tensorboard", "mlflow"])
def test_a_failed_start_removes_its_run_folder_and_the_run_name_works_again(tmp_path, kind, caplog):
    log_dir = tmp_path / "runs"
    bad, names = _unopenable(tmp_path, kind)
    with pytest.raises(ConfigurationError, match=names + ".*on_backend_error='warn'"):
        instrument.Instrumentation(backends=[TensorBoardBackend(), JsonlBackend(), bad], run_name="r",
                                   log_dir=str(log_dir), run_log=True, log_interval=1)
    assert not (log_dir / "r").exists()  # the event file, metrics.jsonl and the run log were written, then removed
    assert "removed what it had written to" in caplog.text and str(log_dir / "r") in caplog.text
    again = instrument.Instrumentation(backends=[TensorBoardBackend(), JsonlBackend()], run_name="r",
                                       log_dir=str(log_dir), log_interval=1)
    _log_and_close(again, [1.5, 2.5])
    assert _jsonl(log_dir / "r" / "metrics.jsonl") == [(0, 1.5), (1, 2.5)]
    assert read_scalars(log_dir / "r")["x"] == {0: 1.5, 1: 2.5}


def test_what_existed_before_a_failed_start_is_left_alone(tmp_path):
    log_dir = tmp_path / "runs"
    other = instrument.Instrumentation(backends=[JsonlBackend()], run_name="other", log_dir=str(log_dir),
                                       log_interval=1)
    _log_and_close(other, [7.0])
    (log_dir / "notes.txt").write_text("mine")
    (log_dir / "r").mkdir()  # an empty folder made beforehand: emptied again, not removed
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "old.jsonl").write_text('{"step": 0}\n')
    before = _tree(log_dir)
    bad, names = _unopenable(tmp_path, "tensorboard")
    backends = [TensorBoardBackend(log_dir=str(outside / "tb")), JsonlBackend(path=str(outside / "m.jsonl")),
                JsonlBackend(), bad]
    with pytest.raises(ConfigurationError, match=names):
        instrument.Instrumentation(backends=backends, run_name="r", log_dir=str(log_dir))
    assert (log_dir / "r").is_dir() and not any((log_dir / "r").iterdir())
    assert _tree(log_dir) == before
    # Files a backend was pointed to outside the run folder are the user's: never removed.
    assert list((outside / "tb").glob("events.out.tfevents.*")) and (outside / "m.jsonl").exists()
    assert (outside / "old.jsonl").read_text() == '{"step": 0}\n'


def test_a_resumed_run_that_fails_to_start_keeps_its_folder(tmp_path):
    first = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path),
                                       log_interval=1)
    _log_and_close(first, [1.0, 2.0])
    before = _tree(tmp_path / "r")
    bad, names = _unopenable(tmp_path, "tensorboard")
    with pytest.raises(ConfigurationError, match=names):
        instrument.Instrumentation(backends=[JsonlBackend(), bad], run_name="r", log_dir=str(tmp_path), resume=True)
    assert _tree(tmp_path / "r") == before


def test_a_failed_start_with_the_default_run_name_leaves_no_folder(tmp_path):
    bad, names = _unopenable(tmp_path, "tensorboard")
    with pytest.raises(ConfigurationError, match=names):
        instrument.Instrumentation(backends=[JsonlBackend(), TensorBoardBackend(), bad], log_dir=str(tmp_path / "runs"))
    assert list((tmp_path / "runs").iterdir()) == []


def test_on_backend_error_warn_changes_nothing(tmp_path):
    bad, _ = _unopenable(tmp_path, "tensorboard")
    inst = instrument.Instrumentation(backends=[JsonlBackend(), bad], run_name="r", log_dir=str(tmp_path / "runs"),
                                      on_backend_error="warn", log_interval=1)
    _log_and_close(inst, [3.0])
    assert _jsonl(tmp_path / "runs" / "r" / "metrics.jsonl") == [(0, 3.0)]


def test_a_bad_option_after_the_run_log_started_leaves_no_folder(tmp_path):
    with pytest.raises(ConfigurationError, match="queue_size"):
        instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), run_log=True,
                                   queue_size=0)
    assert not (tmp_path / "r").exists()
    instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path)).close()


def test_mlflow_and_wandb_that_opened_are_ended_failed_and_the_mlflow_store_stays(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from instrument.backends.mlflow import MlflowBackend
    from instrument.backends.wandb import WandbBackend
    from tests.wandb_reader import read_run

    log_dir = tmp_path / "runs"
    bad, names = _unopenable(tmp_path, "tensorboard")
    with pytest.raises(ConfigurationError, match=names):
        instrument.Instrumentation(backends=[MlflowBackend(), WandbBackend(mode="offline", project="p"), bad],
                                   run_name="r", log_dir=str(log_dir))
    assert not (log_dir / "r").exists()  # W&B's offline run lived there; it was finished first
    assert (log_dir / "mlflow.db").is_file()  # MLflow's store is per log_dir, shared by its runs: kept
    again = instrument.Instrumentation(backends=[MlflowBackend(), WandbBackend(mode="offline", project="p")],
                                       run_name="r", log_dir=str(log_dir), log_interval=1)
    _log_and_close(again, [4.0])
    client = MlflowClient(tracking_uri=f"sqlite:///{log_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    (finished,) = [r for r in runs if r.info.status == "FINISHED"]
    assert [m.value for m in client.get_metric_history(finished.info.run_id, "x")] == [4.0]
    rows, _ = read_run(log_dir / "r")
    assert [row["x"] for row in rows if "x" in row] == [4.0]


class _SlowToClose(instrument.Backend):
    """Opens and writes like any backend, but its close waits until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def open(self, run) -> None:
        run.dir.mkdir(parents=True, exist_ok=True)
        (run.dir / "slow.txt").write_text("opened")

    def write(self, record) -> None:
        pass

    def close(self) -> None:
        self.release.wait(60)


def test_a_writer_still_closing_keeps_the_folder_and_the_error_is_raised(tmp_path, caplog):
    slow = _SlowToClose()
    bad, names = _unopenable(tmp_path, "tensorboard")
    try:
        with pytest.raises(ConfigurationError, match=names):
            instrument.Instrumentation(backends=[slow, bad], run_name="r", log_dir=str(tmp_path), open_timeout=0.5)
        assert (tmp_path / "r" / "slow.txt").exists()  # removing it under a live writer could lose files
        assert "still closing" in caplog.text and "delete it before starting run_name='r' again" in caplog.text
    finally:
        slow.release.set()


class _HangingOpen(instrument.Backend):
    """A server that never answers the open: only the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def open(self, run) -> None:
        self.release.wait(120)

    def write(self, record) -> None:
        pass


def test_a_start_that_fails_after_a_hanging_open_still_raises(tmp_path, caplog):
    """open_timeout lets the start go on past an open that hangs; when the start then fails, closing what
    started must not wait for that open: the error comes, and the folder its writer may still write stays."""
    monitor = instrument.SystemMonitor(gpu=False)
    first = instrument.Instrumentation(backends=[], run_name="first", log_dir=str(tmp_path), system_monitor=monitor)
    hanging = _HangingOpen()
    raised = []

    def start() -> None:
        try:  # the monitor already runs for `first`: ConfigurationError, after the logger started
            instrument.Instrumentation(backends=[JsonlBackend(), hanging], run_name="r", log_dir=str(tmp_path),
                                       open_timeout=0.5, system_monitor=monitor)
        except ConfigurationError as exc:
            raised.append(exc)

    starter = threading.Thread(target=start)
    try:
        starter.start()
        starter.join(60)  # a liveness bound, not a timing: before the fix this waited for the open forever
        assert not starter.is_alive() and len(raised) == 1
        assert (tmp_path / "r").exists() and "delete it before starting run_name='r' again" in caplog.text
    finally:
        hanging.release.set()
        starter.join(60)
        first.close()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root removes read-only folders")
def test_a_folder_that_cannot_be_removed_is_reported_and_the_error_still_raised(tmp_path, caplog):
    class Locking(instrument.Backend):
        def open(self, run) -> None:
            (run.dir / "locked").mkdir(parents=True)
            (run.dir / "locked" / "f").write_text("x")
            (run.dir / "locked").chmod(0o500)

        def write(self, record) -> None:
            pass

    bad, names = _unopenable(tmp_path, "tensorboard")
    try:
        with pytest.raises(ConfigurationError, match=names):
            instrument.Instrumentation(backends=[Locking(), bad], run_name="r", log_dir=str(tmp_path))
        assert "could not be removed" in caplog.text and "delete it before" in caplog.text
    finally:
        (tmp_path / "r" / "locked").chmod(0o700)


INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if SIGINT came ignored
    import instrument
    from instrument.backends.jsonl import JsonlBackend

    class Status(instrument.Backend):
        def write(self, record):
            pass

        def on_exit(self, status):
            print("on_exit", status, flush=True)

    class CtrlC(instrument.Backend):
        def open(self, run):
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, while the session waits for the opens

        def write(self, record):
            pass

    try:
        instrument.Instrumentation(backends=[instrument.TensorBoardBackend(), JsonlBackend(), Status(), CtrlC()],
                                   run_name="r", log_dir=sys.argv[1], run_log=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
    """
)


def test_ctrl_c_during_the_start_leaves_no_folder(tmp_path):
    done = run_child(tmp_path, INTERRUPTED, str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["on_exit killed", "KeyboardInterrupt"], done.stdout + done.stderr
    assert not (tmp_path / "runs" / "r").exists()
    again = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path / "runs"),
                                       log_interval=1)
    _log_and_close(again, [5.0])
    assert _jsonl(tmp_path / "runs" / "r" / "metrics.jsonl") == [(0, 5.0)]


def test_the_removal_is_said_at_warning_level(tmp_path, caplog):
    bad, names = _unopenable(tmp_path, "tensorboard")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with pytest.raises(ConfigurationError, match=names):
            instrument.Instrumentation(backends=[JsonlBackend(), bad], run_name="r", log_dir=str(tmp_path / "x"))
    (record,) = [r for r in caplog.records if "removed what it had written" in r.getMessage()]
    assert record.levelno == logging.WARNING and "run_name='r' can be used again" in record.getMessage()
