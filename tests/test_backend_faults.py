"""Backends under real faults: a file-size limit, a run directory that goes away, a server that never answers.

Each test drives a backend directly (open/write/close with `StepRecord`s), so what it proves does not depend
on the logger's writer thread, and reads the result back with the destination's own reader.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from instrument import ConfigurationError, JsonlBackend, MlflowBackend, RunInfo, TensorBoardBackend, WandbBackend
from instrument.backends.base import StepRecord
from instrument.backends.tensorboard import _event_thread
from tests.conftest import read_scalars
from tests.wandb_reader import exit_codes, read_run

ROOT = Path(__file__).resolve().parent.parent


def _lines(path: Path):
    """Every line of a JSONL file, parsed: fails on a torn or otherwise unparsable line."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


# --- JSONL -----------------------------------------------------------------------------------------------

_LIMITED_WRITER = textwrap.dedent(
    """
    import resource, signal, sys
    from instrument import JsonlBackend, RunInfo
    from instrument.backends.base import StepRecord

    path, limit = sys.argv[1], int(sys.argv[2])
    # A real file-size limit (RLIMIT_FSIZE binds root too). Ignoring SIGXFSZ turns the write past the limit
    # into a short write followed by EFBIG, which is what a full disk looks like to the writer.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    backend = JsonlBackend(path=path)
    backend.open(RunInfo("limited"))
    failed = []
    for step in range(200):
        try:
            backend.write(StepRecord(step=step, scalars={"loss": 1.0 / (step + 1), "pad": 0.123456789 * step}))
        except OSError as exc:
            failed.append((step, exc.errno))
    backend.close()
    print(len(failed), failed[0][1] if failed else None)
    """
)


def test_jsonl_under_a_file_size_limit_leaves_only_whole_lines(tmp_path):
    import errno

    path = tmp_path / "metrics.jsonl"
    limit = 4000  # not a multiple of the line length: some write is cut in the middle of a line
    out = subprocess.run([sys.executable, "-c", _LIMITED_WRITER, str(path), str(limit)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    n_failed, first_errno = int(out[0]), int(out[1])
    assert n_failed > 0 and first_errno == errno.EFBIG  # the limit was really hit, and every write past it
    assert path.stat().st_size <= limit
    lines = _lines(path)
    steps = [line["step"] for line in lines]
    assert steps == list(range(len(steps))) and len(steps) == 200 - n_failed
    assert lines[-1]["metrics"]["loss"] == 1.0 / len(steps)

    # Reopened without the limit, the file takes more whole lines after the old ones.
    backend = JsonlBackend(path=str(path))
    backend.open(RunInfo("again"))
    for step in (500, 501):
        backend.write(StepRecord(step=step, scalars={"loss": 0.5}))
    backend.flush()
    backend.flush()  # repeated flushes are harmless
    backend.close()
    assert [line["step"] for line in _lines(path)] == steps + [500, 501]


def test_jsonl_retries_after_a_failed_write(tmp_path):
    """The run directory disappears (as root, chmod would not stop us; a missing directory does): the write
    raises, and once the directory is back the next record is written to a new file there."""
    run_dir = tmp_path / "run"
    backend = JsonlBackend()
    backend.open(RunInfo("run", tmp_path))
    backend.write(StepRecord(step=0, scalars={"x": 0.0}))
    path = run_dir / "metrics.jsonl"
    path.rename(tmp_path / "kept.jsonl")
    run_dir.rmdir()
    run_dir.write_text("a file where the directory was")  # every open below it now fails: ENOTDIR
    backend.close()  # the old descriptor still points at kept.jsonl; close it so the next write reopens
    with pytest.raises(OSError):
        backend.write(StepRecord(step=1, scalars={"x": 1.0}))
    with pytest.raises(OSError):
        backend.write(StepRecord(step=2, scalars={"x": 2.0}))
    run_dir.unlink()
    run_dir.mkdir()
    backend.write(StepRecord(step=3, scalars={"x": 3.0}))
    backend.close()
    assert [line["step"] for line in _lines(tmp_path / "kept.jsonl")] == [0]
    assert [line["step"] for line in _lines(path)] == [3]


def test_jsonl_removes_a_partial_last_line_on_open(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    whole = json.dumps({"step": 0, "metrics": {"x": 1.0}}) + "\n"
    path.write_bytes(whole.encode() + b'{"step": 1, "metr')  # a process died in the middle of this line
    backend = JsonlBackend(path=str(path))
    with caplog.at_level("WARNING", logger="instrument"):
        backend.open(RunInfo("resumed"))
    assert "partial line (17 bytes" in caplog.text
    backend.write(StepRecord(step=1, scalars={"x": 2.0}))
    backend.close()
    assert [(line["step"], line["metrics"]["x"]) for line in _lines(path)] == [(0, 1.0), (1, 2.0)]


def test_jsonl_partial_file_without_any_newline_is_emptied(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "me')
    backend = JsonlBackend(path=str(path))
    backend.open(RunInfo("resumed"))
    backend.write(StepRecord(step=0, scalars={"x": 2.0}))
    backend.close()
    assert [line["step"] for line in _lines(path)] == [0]


# --- TensorBoard -----------------------------------------------------------------------------------------


def _break_dir(run_dir: Path, aside: Path) -> None:
    """Make ``run_dir`` unwritable in a way that binds root too: chmod does not stop root, so the directory
    is moved aside and a plain file takes its name (every write below it fails with ENOTDIR, and creating
    the directory again fails with EEXIST)."""
    run_dir.rename(aside)
    run_dir.write_text("not a directory")


def _restore_dir(run_dir: Path, aside: Path) -> None:
    run_dir.unlink()
    aside.rename(run_dir)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # TB's writer thread dies
def test_tensorboard_reopens_a_new_event_file_when_the_directory_is_back(tmp_path):
    run_dir, aside = tmp_path / "run", tmp_path / "aside"
    backend = TensorBoardBackend()
    backend.open(RunInfo("run", tmp_path))
    backend.log_hyperparams({"lr": 0.1})
    for step in range(3):
        backend.write(StepRecord(step=step, scalars={"loss": float(step)}))

    _break_dir(run_dir, aside)
    failed = []
    for step in range(3, 6):
        try:
            backend.write(StepRecord(step=step, scalars={"loss": float(step)}))
        except OSError:
            failed.append(step)
    assert failed == [3, 4, 5]  # the dead writer raises once, then every attempt to reopen raises
    _restore_dir(run_dir, aside)

    for step in range(6, 10):
        backend.write(StepRecord(step=step, scalars={"loss": float(step)}))
    backend.write_system(StepRecord(step=7, scalars={"system/cpu_percent": 50.0}))
    backend.flush()
    backend.close()

    assert backend.reopened == 1
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    scalars = read_scalars(run_dir)
    assert scalars["loss"] == {s: float(s) for s in (0, 1, 2, 6, 7, 8, 9)}
    assert read_scalars(run_dir / "system")["system/cpu_percent"] == {7: 50.0}  # the system samples' own run


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_close_raises_a_write_it_could_not_make(tmp_path, monkeypatch):
    run_dir, aside = tmp_path / "run", tmp_path / "aside"
    backend = TensorBoardBackend(flush_every_commit=False)
    backend.open(RunInfo("run", tmp_path))
    backend.flush()
    thread = _event_thread(backend._writer)
    report = threading.excepthook

    def slow_report(args):  # TensorBoard's dying thread reports its error after the caller already saw it
        time.sleep(0.3)
        report(args)

    monkeypatch.setattr(threading, "excepthook", slow_report)
    _break_dir(run_dir, aside)
    backend.write(StepRecord(step=0, scalars={"loss": 0.0}))  # only queued: TensorBoard writes it later
    with pytest.raises(OSError):
        backend.close()
    # close returns once that thread is over: its report belongs to this fault, not to whatever runs next
    assert thread is not None and not thread.is_alive()
    backend.close()  # a second close has nothing left to do
    _restore_dir(run_dir, aside)


# --- MLflow ----------------------------------------------------------------------------------------------

_HTTP_SETTINGS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nothing listens there now


def test_mlflow_refused_connection_raises_and_later_records_retry_the_open(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")  # the user's own setting comes back afterwards
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    uri = f"http://127.0.0.1:{_free_port()}"
    backend = MlflowBackend(tracking_uri=uri, timeout=1, max_retries=1, backoff_factor=0, retry_after=0)
    with pytest.raises(Exception, match="127.0.0.1"):  # returns at all: MLflow's defaults wait ~4 minutes
        backend.open(RunInfo("unreachable", tmp_path))
    assert backend.run_id is None
    with pytest.raises(Exception, match="127.0.0.1"):  # the next record tries to open the run again
        backend.write(StepRecord(step=0, scalars={"loss": 1.0}))
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    backend.close()  # nothing was created, nothing to end


def test_mlflow_server_that_never_answers_is_given_up_and_then_skipped(tmp_path):
    pytest.importorskip("mlflow")
    # A loopback socket that listens but never accepts: the kernel completes the TCP handshake, the HTTP
    # request is sent, and no answer ever comes. Only the read timeout ends the wait.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        backend = MlflowBackend(tracking_uri=uri, timeout=1, max_retries=0, retry_after=3600)
        with pytest.raises(Exception, match="timeout|timed out|Read"):
            backend.open(RunInfo("silent", tmp_path))
        # Within retry_after the next call does not wait for the same dead server again.
        with pytest.raises(ConnectionError, match="skipped"):
            backend.write(StepRecord(step=0, scalars={"loss": 1.0}))
    assert not any(k in os.environ for k in _HTTP_SETTINGS)


def test_mlflow_open_that_failed_is_retried_by_the_next_record(tmp_path):
    """A sqlite store whose directory is a plain file cannot be opened (MLflow would create a missing one);
    once the directory is there the next record (retry_after=0: no wait between tries) opens the run and is
    written, read back with MlflowClient."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    db = tmp_path / "later" / "mlflow.db"
    uri = f"sqlite:///{db}"
    db.parent.write_text("not a directory")
    backend = MlflowBackend(tracking_uri=uri, artifact_location=(tmp_path / "art").as_uri(), retry_after=0)
    with pytest.raises(Exception):  # noqa: B017 - sqlalchemy's OperationalError, wrapped by MLflow
        backend.open(RunInfo("late", tmp_path))
    db.parent.unlink()
    db.parent.mkdir()
    backend.write(StepRecord(step=4, scalars={"loss": 0.25}))
    backend.on_exit("failed")
    backend.close()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(backend.run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "late"
    assert [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "loss")] == [(4, 0.25)]


# --- W&B -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, code", [(None, 0), ("killed", 1), ("failed", 1)])
def test_wandb_run_ends_with_the_exit_code_of_how_it_ended(tmp_path, status, code):
    pytest.importorskip("wandb")
    backend = WandbBackend(project="tests")
    backend.open(RunInfo("ended", tmp_path))
    for step in range(3):
        backend.write(StepRecord(step=step, scalars={"loss": float(step)}))
    backend.flush()
    if status:
        backend.on_exit(status)
    backend.close()
    rows, _ = read_run(tmp_path / "ended")
    assert [(row["_step"], row["loss"]) for row in rows] == [(s, float(s)) for s in range(3)]
    assert exit_codes(tmp_path / "ended") == [code]


_WANDB_WRITER = textwrap.dedent(
    """
    import sys, time
    from instrument import RunInfo, WandbBackend
    from instrument.backends.base import StepRecord

    backend = WandbBackend(project="tests", flush_secs=0.5)
    backend.open(RunInfo("killed", sys.argv[1]))
    for step in range(300):
        backend.write(StepRecord(step=step, scalars={f"m{i}": step + i / 100 for i in range(10)}))
    print("logged", flush=True)
    time.sleep(300)  # killed long before this ends; close() never runs
    """
)


def test_wandb_steps_reach_the_file_without_close_and_survive_sigkill(tmp_path):
    """W&B keeps the last partial block of its ``.wandb`` file in memory; with ``flush_secs`` its service
    writes it while the run is still going, so a process killed without close keeps every step."""
    pytest.importorskip("wandb")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    child = subprocess.Popen([sys.executable, "-c", _WANDB_WRITER, str(tmp_path)], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "logged"
        run_dir = tmp_path / "killed"
        steps = []
        for _ in range(600):  # wait (at most a minute) for the service to write the buffered block
            try:
                steps = [row["_step"] for row in read_run(run_dir, timeout=0)[0]]
            except Exception:  # noqa: BLE001 - the file may be mid-write; read it again
                steps = []
            if len(steps) == 300:
                break
            time.sleep(0.1)
        assert steps == list(range(300))
    finally:
        child.send_signal(signal.SIGKILL)  # W&B's service watches this pid and exits with it
        child.wait()
    rows, _ = read_run(run_dir, timeout=0)
    assert [row["_step"] for row in rows] == list(range(300))
    assert rows[-1]["m9"] == pytest.approx(299.09)
    assert exit_codes(run_dir) == []  # it really ended without close


def test_wandb_bad_options_name_what_was_expected():
    with pytest.raises(ConfigurationError, match=r"mode must be one of .*got 'offine'; 'offline' needs no"):
        WandbBackend(mode="offine")
    with pytest.raises(ConfigurationError, match=r"flush_secs must be a number of seconds >= 0, got -1"):
        WandbBackend(flush_secs=-1)
    with pytest.raises(ConfigurationError, match=r"on_exit got status 'ok'"):
        WandbBackend().on_exit("ok")


def test_jsonl_file_deleted_during_the_run_is_created_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    backend = JsonlBackend(path=str(path))
    backend.open(RunInfo("deleted"))
    backend.write(StepRecord(step=0, scalars={"x": 0.0}))
    path.unlink()  # e.g. a cleanup job; an open descriptor would go on writing to the deleted file
    backend.write(StepRecord(step=1, scalars={"x": 1.0}))
    backend.close()
    assert [line["step"] for line in _lines(path)] == [1]


def test_jsonl_folder_removed_during_the_run_is_made_again(tmp_path):
    """Alone (no other backend re-creating the run folder): the next write makes the folder and the file."""
    path = tmp_path / "run" / "metrics.jsonl"
    backend = JsonlBackend(path=str(path))
    backend.open(RunInfo("removed"))
    backend.write(StepRecord(step=0, scalars={"x": 0.0}))
    shutil.rmtree(tmp_path / "run")
    backend.write(StepRecord(step=1, scalars={"x": 1.0}))
    backend.close()
    assert [line["step"] for line in _lines(path)] == [1]


def test_jsonl_cut_mid_line_by_someone_else_drops_the_partial_line_before_the_next_one(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    backend = JsonlBackend(path=str(path))
    backend.open(RunInfo("r", tmp_path))
    for step in range(3):
        backend.write(StepRecord(step=step, scalars={"loss": float(step)}))
    os.truncate(path, path.stat().st_size - 10)  # another process cuts the file in the middle of step 2's line
    for step in range(3, 6):
        backend.write(StepRecord(step=step, scalars={"loss": float(step)}))
    backend.close()
    assert [line["step"] for line in _lines(path)] == [0, 1, 3, 4, 5]  # step 2 was destroyed; 3 is whole
    assert "ended in a partial line" in caplog.text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_jsonl_into_a_pipe_writes_every_line_and_flushes_without_a_failure(tmp_path):
    """A path that is not a regular file (a FIFO, /dev/stdout piped on): fsync failed with EINVAL at every
    flush, so flush() said False and failures counted a problem that was not one."""
    from instrument import Logger

    fifo = tmp_path / "lines"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.extend(open(fifo).read().splitlines()), daemon=True)
    reader.start()
    logger = Logger([JsonlBackend(path=str(fifo))], RunInfo("p", tmp_path))
    for step in range(5):
        logger.log_metrics({"loss": step / 2}, step=step)
        logger.commit(step)
    assert logger.flush(30) is True
    logger.close()
    reader.join(30)
    assert logger.failures == {}
    assert [json.loads(line)["metrics"]["loss"] for line in received] == [step / 2 for step in range(5)]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="Linux's /dev/full")
def test_jsonl_on_a_full_device_reports_the_full_device(tmp_path, caplog):
    """The ftruncate that cuts a torn line back failed too (EINVAL on a device) and its error replaced the real
    one (ENOSPC) in the report."""
    from instrument import Logger

    logger = Logger([JsonlBackend(path="/dev/full")], RunInfo("f", tmp_path), on_backend_error="warn")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.commit(0)
    assert logger.flush(30) is False
    logger.close()
    assert logger.failures["JsonlBackend"] >= 1
    assert "No space left on device" in caplog.text and "Invalid argument" not in caplog.text



@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_jsonl_into_a_pipe_resumes_without_reading_it(tmp_path):
    """on_resume read the file to find where to cut: on a FIFO this process also writes, the read never ended."""
    fifo = tmp_path / "lines"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.extend(open(fifo).read().splitlines()), daemon=True)
    reader.start()
    backend = JsonlBackend(path=str(fifo))
    backend.open(RunInfo("p", tmp_path))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (backend.on_resume(3), done.set()), daemon=True)
    worker.start()
    assert done.wait(30), "on_resume blocked on the pipe"
    backend.write(StepRecord(3, {"loss": 1.5}))
    backend.close()
    reader.join(30)
    assert [json.loads(line)["step"] for line in received] == [3]


def test_a_backend_failing_in_flush_on_exit_or_close_is_told_what_that_costs_it(tmp_path, caplog):
    """Each report says what follows: a close or on_exit that raised is not followed by "the next record" (the
    report used to say so for every method but log_hyperparams)."""
    import logging

    from instrument import Logger
    from instrument.backends.base import Backend

    def failing(method):
        def boom(self, *args):
            raise RuntimeError(f"{method} boom")

        name = f"Fails{method.title().replace('_', '')}"
        return type(name, (Backend,), {"write": lambda self, record: None, method: boom})()

    backends = [failing(method) for method in ("flush", "on_exit", "close")]
    logger = Logger(backends, RunInfo("f", tmp_path), on_backend_error="warn")
    with caplog.at_level(logging.ERROR, logger="instrument"):
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.commit()
        logger.close(status="failed")
    said = {r.getMessage().split(" failed in ")[1].split("()")[0]: r.getMessage() for r in caplog.records
            if " failed in " in r.getMessage()}
    assert sorted(said) == ["close", "flush", "on_exit"], said
    assert "next record again" not in said["close"] and "not closed again" in said["close"], said["close"]
    assert "next record again" not in said["on_exit"] and "closed next" in said["on_exit"], said["on_exit"]
    assert "flushed again" in said["flush"], said["flush"]
