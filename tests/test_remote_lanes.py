"""A remote backend (`Backend.remote`) is called on a thread of its own: a slow or silent server costs that backend
alone its steps, never the training thread and never another backend.

Real parts: a loopback socket that accepts connections and never answers; a real `mlflow server` process, made
silent with SIGSTOP (it still accepts connections: the kernel queues them) and brought back with SIGCONT; a child
process killed with SIGTERM; every backend read back from what a user would open (JSONL lines, `MlflowClient`).
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import instrument
from instrument.backends.base import RunInfo

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from tests.test_terminated_run import _terminate_after  # noqa: E402

DROP_SAID = "dropped for it alone"


class Silent:
    """A loopback server that accepts connections, reads what comes, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def waiting(self) -> bool:
        """Whether a client connected and still waits for its answer (it has not given up and hung up)."""
        for conn in list(self.conns):
            try:
                while conn.recv(65536, socket.MSG_DONTWAIT):
                    pass
            except BlockingIOError:
                return True  # open, and everything it sent read: it waits for us
            except OSError:
                continue
        return False

    def __enter__(self) -> "Silent":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()  # a client still waiting gets its connection reset: its call fails at once
        for conn in self.conns:
            conn.close()


def _steps(path: Path, key: str = "loss") -> list:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row["step"] for row in rows if key in row.get("metrics", {})]


def _forty_steps_beside(remote, tmp_path: Path, name: str):
    """A session of JSONL and ``remote`` (whose open does not answer) that committed 40 logging steps through a
    queue of 4."""
    inst = instrument.Instrumentation(
        backends=[instrument.JsonlBackend(), remote], log_interval=1, log_dir=str(tmp_path), run_name=name,
        on_backend_error="warn", open_timeout=0.2, queue_size=4,
    )
    for step in range(40):
        with inst.step(step):
            inst.logger.log_metrics({"loss": float(step)}, step=step)
    return inst


def test_a_silent_mlflow_server_holds_neither_training_nor_the_other_backends(tmp_path, caplog):
    """40 steps go through a queue of 4 while MLflow's first request still waits for an answer: before, the writer
    sat in MLflow's open, the queue filled, and commit waited the whole request timeout (34 s in a review)."""
    caplog.set_level(logging.WARNING, logger="instrument")
    with Silent() as server:
        mlflow_backend = instrument.MlflowBackend(tracking_uri=server.uri, timeout=30, max_retries=0,
                                                  retry_after=3600)
        assert mlflow_backend.remote
        inst = _forty_steps_beside(mlflow_backend, tmp_path, "silent")
        assert mlflow_backend.run_id is None  # its open has not returned
        assert not server.conns or server.waiting(), "MLflow's open gave up: the loop waited for it"
        assert not inst.flush(timeout=0.5)  # MLflow has written nothing; the other backends are flushed
        assert _steps(tmp_path / "silent" / "metrics.jsonl") == list(range(40))
        # A close that gives up on the silent server names the call that held it.
        inst.close(timeout=0.5)
        said = [r.getMessage() for r in caplog.records if "gave up after 0.5s" in r.getMessage()]
        assert said and "'MlflowBackend' was still in open()" in said[0]
    dropped = [r for r in caplog.records if DROP_SAID in r.getMessage()]
    assert len(dropped) == 1 and "MlflowBackend" in dropped[0].getMessage()
    assert inst.failures["MlflowBackend"] >= 36  # each step dropped for it is counted
    assert list(inst.failures) == ["MlflowBackend"]


class RemoteJsonl(instrument.JsonlBackend):
    """A JSONL file driven like a remote backend: the lane's order, flush and close, read back from the file."""

    remote = True


class FailingRemote(instrument.Backend):
    remote = True

    def write(self, record):
        raise OSError("the server said 503")


def test_a_remote_backend_gets_every_step_in_order_and_flush_waits_for_it(tmp_path):
    local, remote = instrument.JsonlBackend(), RemoteJsonl(path=str(tmp_path / "remote.jsonl"))
    logger = instrument.Logger([local, remote], run=RunInfo(name="r", root=tmp_path), queue_size=16)
    for step in range(2000):
        logger.log_metrics({"loss": step / 3, "other": float(step)}, step=step)
        logger.commit(step)
    assert logger.flush(timeout=60)  # True only once the remote backend's own thread wrote and flushed
    remote_lines = (tmp_path / "remote.jsonl").read_text().splitlines()
    assert remote_lines == (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert _steps(tmp_path / "remote.jsonl") == list(range(2000))  # every step, once, in order (the bound was
    # never reached: a lane drops only for a backend that falls queue_size records behind)
    assert logger.close_backend(remote, timeout=60)  # waits for the lane to close it
    logger.log_metrics({"after": 1.0}, step=2000)
    logger.commit(2000)
    logger.close()
    assert (tmp_path / "remote.jsonl").read_text().splitlines() == remote_lines
    assert "after" in (tmp_path / "r" / "metrics.jsonl").read_text()
    assert logger.failures == {}


def test_a_remote_backend_that_raises_is_counted_and_flush_says_so_once(tmp_path, caplog):
    logger = instrument.Logger([instrument.JsonlBackend(), FailingRemote()], run=RunInfo(name="f", root=tmp_path))
    for step in range(5):
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit(step)
    assert not logger.flush(timeout=60)  # the lane's failures count in the flush that follows them
    assert logger.flush(timeout=60)  # and only in that one
    logger.close()
    assert logger.failures == {"FailingRemote": 5}
    assert [r.getMessage() for r in caplog.records].count(next(
        r.getMessage() for r in caplog.records if "FailingRemote" in r.getMessage())) == 1
    assert _steps(tmp_path / "f" / "metrics.jsonl", "x") == list(range(5))


class Recorder(instrument.Backend):
    """A remote backend that records its calls; ``gate`` (an Event) holds its writes, ``fail_open`` its open."""

    remote = True

    def __init__(self, gate=None, fail_open=False, on_write=None):
        self.gate, self.fail_open, self.on_write = gate, fail_open, on_write
        self.calls, self.steps = [], []

    def open(self, run):
        self.calls.append("open")
        if self.fail_open:
            raise OSError("the server said 503 at open")

    def write(self, record):
        self.calls.append("write")
        if self.gate is not None:
            self.gate.wait()
        self.steps.append(record.step)
        if self.on_write is not None:
            self.on_write(record.step)

    def flush(self):
        self.calls.append("flush")

    def close(self):
        self.calls.append("close")


def _commit(logger, steps) -> None:
    for step in steps:
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit(step)


def test_a_remote_backend_may_flush_or_close_the_logger_from_its_own_thread(tmp_path):
    """On its lane, a backend's `flush()` or `close_backend(self)` cannot wait for its own lane: False at once, as
    on the writer thread; before, the lane waited for itself for good."""
    answers = {}

    def call_back(step: int) -> None:
        if step == 1:
            answers["flush"] = logger.flush()
        if step == 2:
            answers["close_backend"] = logger.close_backend(remote)

    remote = Recorder(on_write=call_back)
    logger = instrument.Logger([remote, instrument.JsonlBackend()], run=RunInfo(name="own", root=tmp_path))
    _commit(logger, range(4))
    assert logger.flush(timeout=60)
    logger.close(timeout=60)
    assert answers == {"flush": False, "close_backend": False}
    assert remote.steps[:3] == [0, 1, 2] and remote.calls[-1] == "close"  # closed, once, after what came before
    assert remote.calls.count("close") == 1


def test_closing_a_local_backend_does_not_wait_for_a_stuck_remote_one(tmp_path):
    gate = threading.Event()
    remote, local = Recorder(gate=gate), instrument.JsonlBackend()
    logger = instrument.Logger([remote, local], run=RunInfo(name="stuck", root=tmp_path))
    try:
        _commit(logger, range(3))
        assert logger.close_backend(local, timeout=60)  # the writer reached it; the remote still waits
        assert not gate.is_set() and remote.steps == []
    finally:
        gate.set()
        logger.close(timeout=60)
    assert remote.steps == [0, 1, 2]


def test_a_remote_backend_that_could_not_open_makes_the_next_flush_false_and_can_be_added_again(tmp_path):
    logger = instrument.Logger([instrument.JsonlBackend()], run=RunInfo(name="late", root=tmp_path),
                               on_backend_error="warn")
    remote = Recorder(fail_open=True)
    assert logger.add_backend(remote)
    _commit(logger, [0])
    assert not logger.flush(timeout=60) and logger.flush(timeout=60)  # the failed open, said once
    assert remote not in logger.backends
    remote.fail_open = False
    assert logger.add_backend(remote)  # left out once, then added again: it gets the steps after that
    _commit(logger, [1, 2])
    assert logger.flush(timeout=60)
    logger.close()
    assert remote.steps == [1, 2] and remote.calls[:4] == ["open", "open", "write", "write"]
    assert remote.calls[-1] == "close" and set(remote.calls[4:-1]) == {"flush"}


def test_a_flush_counts_only_the_drops_of_steps_handed_over_before_it(tmp_path):
    """Steps dropped for a remote backend after a flush was queued are the next flush's to report."""
    gate = threading.Event()
    remote = Recorder(gate=gate)
    logger = instrument.Logger([remote, instrument.JsonlBackend()], run=RunInfo(name="drops", root=tmp_path),
                               queue_size=2)
    _commit(logger, [0])  # the remote's write of step 0 waits on the gate
    first = {}
    waiter = threading.Thread(target=lambda: first.setdefault("answer", logger.flush(timeout=120)))
    waiter.start()
    lane = logger._writer._lanes.current[id(remote)]
    deadline = time.monotonic() + 60
    while lane.submitted < 3 and time.monotonic() < deadline:  # open, write 0, and the flush queued behind it
        time.sleep(0.01)
    assert lane.submitted == 3
    _commit(logger, [1, 2, 3, 4])  # two of these find the lane full: steps 1 and 2 are dropped for it
    deadline = time.monotonic() + 60
    while lane.dropped < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    waiter.join(60)
    assert first == {"answer": True}  # step 0, all it was handed, is written and flushed
    assert not logger.flush(timeout=60)  # the drops of steps 1 and 2
    logger.close()
    assert remote.steps == [0, 3, 4] and logger.failures == {"Recorder": 2}


@pytest.mark.parametrize("fault", ["write", "close", "late open"])
def test_a_flush_behind_a_remote_backend_that_ended_reports_its_failure(tmp_path, fault):
    """A flush queued behind a remote backend's close (or an open that failed for good) is never made on its
    lane: it said True, and the next flush reported the failure instead."""
    gate = threading.Event()

    class Ending(Recorder):
        def open(self, run):
            if fault == "late open":
                gate.wait()
                raise OSError("the server said 503 at open")

        def write(self, record):
            gate.wait()
            if fault == "write":
                raise OSError("the server said 503")

        def close(self):
            if fault == "close":
                raise OSError("the server said 503 at close")

    remote = Ending()
    logger = instrument.Logger([instrument.JsonlBackend(), remote], run=RunInfo(name="end", root=tmp_path),
                               on_backend_error="warn", open_timeout=0.1)
    _commit(logger, [0])
    if fault != "late open":
        assert not logger.close_backend(remote, timeout=0.1)  # queued behind the write that waits on the gate
    threading.Timer(0.3, gate.set).start()
    assert not logger.flush(timeout=60)
    assert logger.flush(timeout=60)
    logger.close()
    assert logger.failures == {"Ending": 1}


def test_the_writer_waits_for_room_half_a_second_in_all_over_several_stuck_lanes(tmp_path):
    """Each lane counted its own 0.5 s: four remote backends that never answer held a commit 2 s."""
    gate = threading.Event()
    remotes = [Recorder(gate=gate) for _ in range(4)]
    for k, remote in enumerate(remotes):
        remote._name = f"stuck{k}"
    logger = instrument.Logger([instrument.JsonlBackend(), *remotes], run=RunInfo(name="four", root=tmp_path),
                               queue_size=2)
    try:
        _commit(logger, range(20))
        assert logger.flush(timeout=0.5) is False
        from instrument.logger.lane import PATIENCE

        # the writer's own account of its waits (not a timing of the test: 2 s before, in four 0.5 s waits)
        assert logger._writer._lanes.waited() < PATIENCE + 0.75
    finally:
        gate.set()
        logger.close(timeout=60)
    assert _steps(tmp_path / "four" / "metrics.jsonl", "x") == list(range(20))


def test_a_remote_backend_is_flushed_after_its_last_write_while_training_stalls(tmp_path):
    """A periodic flush is not queued behind another one waiting in the lane, yet one always follows the last
    write: before, the last steps of a busy lane waited for `close` to reach the disk."""

    class SlowRecorder(Recorder):
        def write(self, record):
            time.sleep(0.1)  # slower than the steps come: the lane falls behind while they do
            super().write(record)

    remote = SlowRecorder()
    logger = instrument.Logger([remote, instrument.JsonlBackend()], run=RunInfo(name="stall", root=tmp_path),
                               flush_secs=0.3, queue_size=64)
    for step in range(30):
        _commit(logger, [step])
        time.sleep(0.05)
    deadline = time.monotonic() + 60  # not a timing assertion: the flush is due 0.2 s after the last write
    while (len(remote.steps) < 30 or remote.calls[-1] != "flush") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remote.steps == list(range(30)) and remote.calls[-1] == "flush"
    logger.close()


def test_which_backends_are_remote():
    assert instrument.MlflowBackend(tracking_uri="http://localhost:5000").remote
    assert instrument.MlflowBackend(tracking_uri="postgresql://db/mlflow").remote
    for local in (None, "sqlite:///runs/mlflow.db", "file:/tmp/mlruns", "/tmp/mlruns"):
        assert not instrument.MlflowBackend(tracking_uri=local).remote, local
    assert instrument.WandbBackend(mode="online").remote
    assert not instrument.WandbBackend(mode="offline").remote
    assert not instrument.JsonlBackend().remote and not instrument.TensorBoardBackend().remote


# ---------------------------------------------------------------------------------------------- a real server
def _history(uri: str, run_name: str) -> tuple:
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.mlflow.runName = '{run_name}'")
    return run.info.status, [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]


def test_a_tracking_server_that_stops_answering_costs_mlflow_alone_and_catches_up(mlflow_server, tmp_path, caplog):
    """The server is stopped mid-run (SIGSTOP: connections are still accepted, nothing answers) and continued
    later: training and JSONL never wait; MLflow keeps what it had, falls behind, loses its oldest waiting steps
    (counted, said once), and gets the newest ones once the server answers again."""
    uri, server = mlflow_server
    caplog.set_level(logging.WARNING, logger="instrument")
    mlflow_backend = instrument.MlflowBackend(tracking_uri=uri, run_name="stopped", timeout=120, max_retries=0)
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(), mlflow_backend], log_interval=1,
                                      log_dir=str(tmp_path), run_name="stopped", queue_size=8)
    try:
        for step in range(10):
            with inst.step(step):
                inst.logger.log_metrics({"loss": step / 2}, step=step)
        assert inst.flush(timeout=60)
        os.killpg(server.pid, signal.SIGSTOP)
        try:
            for step in range(10, 50):
                with inst.step(step):
                    inst.logger.log_metrics({"loss": step / 2}, step=step)
            assert not inst.flush(timeout=1.0)  # MLflow's write waits on the stopped server
            assert _steps(tmp_path / "stopped" / "metrics.jsonl") == list(range(50))
        finally:
            os.killpg(server.pid, signal.SIGCONT)
        inst.close(timeout=120)
    finally:
        inst.close()
    status, history = _history(uri, "stopped")
    assert status == "FINISHED"
    steps = [s for s, _ in history]
    assert all(value == s / 2 for s, value in history)
    assert steps == sorted(set(steps)) and steps[:11] == list(range(11)) and steps[-1] == 49
    assert inst.failures == {"MlflowBackend": 50 - len(steps)} and len(steps) < 50
    assert len([r for r in caplog.records if DROP_SAID in r.getMessage()]) == 1


SIGTERM_CHILD = textwrap.dedent(
    """
    import sys, time
    import instrument

    root, uri = sys.argv[1], sys.argv[2]
    inst = instrument.Instrumentation(
        backends=[instrument.JsonlBackend(), instrument.MlflowBackend(tracking_uri=uri, run_name="remote-sigterm")],
        log_interval=1, run_name="child", log_dir=root, flush_secs=3600,
    )
    step = 0
    while True:
        with inst.step(step):
            inst.logger.log_metrics({"loss": step / 2}, step=step)
        print(step, flush=True)
        step += 1
        time.sleep(0.005)
    """
)


def test_sigterm_keeps_every_committed_step_on_a_tracking_server_and_ends_the_run_killed(mlflow_server, tmp_path):
    """The remote backend's lane is closed with the rest: the steps it had queued are written before the process
    dies by the signal, and the run ends KILLED."""
    uri, _ = mlflow_server
    script = tmp_path / "child.py"
    script.write_text(SIGTERM_CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), uri], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=tmp_path)
    wanted = 15
    _terminate_after(child, wanted, group=False)
    assert child.returncode == -signal.SIGTERM
    jsonl = _steps(tmp_path / "child" / "metrics.jsonl")
    assert jsonl[:wanted] == list(range(wanted)) and jsonl == list(range(len(jsonl)))
    status, history = _history(uri, "remote-sigterm")
    assert status == "KILLED"
    assert sorted(history) == [(s, s / 2) for s in jsonl]


def test_a_silent_server_holds_no_other_mlflow_backend(mlflow_server, tmp_path):
    """MLflow's HTTP settings are process-wide environment variables, set around each call: a call to a silent
    server held them (and a lock) for its whole timeout, so a second MLflow backend, on a live server and with a
    thread of its own, waited for it too; then, calls with other settings still waited (a retried open's
    retries=0 among them). No call waits for another's settings now."""
    uri, _ = mlflow_server
    with Silent() as silent:
        dead = instrument.MlflowBackend(tracking_uri=silent.uri, run_name="dead", timeout=30, max_retries=0)
        live = instrument.MlflowBackend(tracking_uri=uri, run_name="beside-dead", timeout=5, max_retries=1)
        inst = instrument.Instrumentation(backends=[dead, live], log_interval=1, log_dir=str(tmp_path),
                                          run_name="two", on_backend_error="warn", open_timeout=0.2)
        for step in range(20):
            with inst.step(step):
                inst.logger.log_metrics({"loss": step / 2}, step=step)
        deadline = time.monotonic() + 60  # not a timing assertion: the live server needs well under a second
        while len(_history_or_none(uri, "beside-dead")) < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert silent.waiting(), "the silent server's call gave up: the test proves nothing"
        assert _history(uri, "beside-dead")[1] == [(s, s / 2) for s in range(20)]
    inst.close(timeout=60)
    assert _history(uri, "beside-dead")[0] == "FINISHED"


def _history_or_none(uri: str, run_name: str) -> list:
    try:
        return _history(uri, run_name)[1]
    except ValueError:  # the run is not there yet
        return []


def test_wandb_online_against_a_silent_server_holds_neither_training_nor_the_other_backends(tmp_path, monkeypatch,
                                                                                             caplog):
    """W&B online (its base URL a loopback socket that never answers; no account, no network): ``wandb.init``
    waits on its lane while every step is committed and written to JSONL."""
    pytest.importorskip("wandb")
    caplog.set_level(logging.WARNING, logger="instrument")
    with Silent() as server:
        monkeypatch.setenv("WANDB_BASE_URL", server.uri)
        monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
        monkeypatch.setenv("WANDB_MODE", "online")
        monkeypatch.setenv("WANDB_INIT_TIMEOUT", "15")
        wandb_backend = instrument.WandbBackend(mode="online")
        assert wandb_backend.remote
        inst = _forty_steps_beside(wandb_backend, tmp_path, "online")
        # wandb.init has not returned: its service has not reached the server yet (a loaded machine) or waits
        # for its answer; had the loop waited for it, it would have given up and hung up.
        assert wandb_backend.run is None
        assert not server.conns or server.waiting(), "wandb.init gave up: the loop waited for it"
        assert not inst.flush(timeout=0.5)
        assert _steps(tmp_path / "online" / "metrics.jsonl") == list(range(40))
    inst.close(timeout=120)
    assert inst.failures["WandbBackend"] >= 36
    assert len([r for r in caplog.records if DROP_SAID in r.getMessage()]) == 1
