"""A remote backend that overrides `Backend.write_many` gets the steps waiting in its lane in one call, so that a
server slower per request than the steps come keeps up instead of losing steps.

Real parts: the logger and its lanes; a real `mlflow server` process behind a loopback proxy that holds every chunk
a client sends for 150 ms (a distant server); two MLflow runs on local stores read back with `MlflowClient`.
"""

import re
import socket
import threading
import time

import numpy as np
import pytest

import instrument
from instrument.backends.base import PartialWriteError, RunInfo, SampleTable, StepRecord
from instrument.backends.video import MediaWriteError
from instrument.logger.lane import batches

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from tests.test_remote_lanes import Silent, _history, _steps  # noqa: E402


class Batching(instrument.Backend):
    """Records every call's steps; a flush waits for ``gate``, so that the steps after it wait in the lane."""

    remote = True

    def __init__(self, gate: threading.Event, fail=None):
        self.gate, self.fail, self.calls = gate, fail, []

    def flush(self):
        self.gate.wait(60)

    def write(self, record):
        self.calls.append(("write", [record.step]))

    def write_many(self, records):
        self.calls.append(("write_many", [record.step for record in records]))
        if self.fail is not None:
            raise self.fail


def _queued_behind_a_flush(inst, backend, steps: int = 10):
    """Commit ``steps`` steps while ``backend``'s flush (held by the test) holds its lane: they all wait in it.
    Returns the lane."""
    assert not inst.flush(timeout=0.2)  # the lane is held in that flush
    for step in range(steps):
        with inst.step(step):
            inst.logger.log_metrics({"loss": float(step)}, step=step)
    lane = inst.logger._writer._lanes.get(backend)
    while lane.pending < steps:
        time.sleep(0.01)
    return lane


def _held_then_released(backend, tmp_path, steps: int = 10):
    """A session whose ``steps`` steps waited in ``backend``'s lane behind a slow flush, then went on."""
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(), backend], log_interval=1,
                                      log_dir=str(tmp_path), run_name="batch", queue_size=64, flush_secs=3600)
    _queued_behind_a_flush(inst, backend, steps)
    backend.gate.set()
    return inst


def test_the_steps_waiting_behind_a_slow_call_go_to_write_many_in_one_call_in_order(tmp_path):
    backend = Batching(threading.Event())
    inst = _held_then_released(backend, tmp_path)
    assert inst.flush(timeout=30)
    inst.close()
    assert backend.calls == [("write_many", list(range(10)))]
    assert _steps(tmp_path / "batch" / "metrics.jsonl") == list(range(10))
    assert inst.failures == {}


@pytest.mark.parametrize("fault, lost", [(OSError("the server said 503"), 10),
                                         (MediaWriteError("3 images of steps 0-9 could not be written", steps=3), 3),
                                         (PartialWriteError("the metrics of steps 4-7 were refused", steps=4), 4)])
def test_a_write_many_that_raises_costs_each_step_it_held_or_each_with_a_failed_media_value(tmp_path, caplog, fault,
                                                                                           lost):
    """An exception loses every step of the call for that backend (each counted, as when written apart); a
    `MediaWriteError` says the steps' scalars were written: one failure per step with a value that failed."""
    backend = Batching(threading.Event(), fail=fault)
    inst = _held_then_released(backend, tmp_path)
    assert not inst.flush(timeout=30)
    inst.close()
    assert inst.failures == {"Batching": lost}
    said = [r for r in caplog.records if "failed in write_many()" in r.getMessage()]
    assert len(said) == 1  # reported once, the rest counted quietly
    assert _steps(tmp_path / "batch" / "metrics.jsonl") == list(range(10))


def _records():
    """Steps as a training loop commits them: scalars and a timer, an image, text, a samples table, a step of
    media only (its step is kept in a run tag, no metric history holds it), a training key under system/."""
    picture = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    table = SampleTable([{"input": "a", "output": "b", "score": 0.5}])
    return [
        StepRecord(step=0, scalars={"loss": 1.5, "acc/top1": 0.25}, timings={"fwd": {"mean": 0.1, "min": 0.1,
                                                                                      "max": 0.1, "count": 1.0}},
                   wall_time=1000.0),
        StepRecord(step=1, scalars={"loss": 1.25}, images={"state": picture}, texts={"note": "hello"},
                   wall_time=1001.0),
        StepRecord(step=2, scalars={"loss": 1.0, "system/gpu": 3.0}, samples={"val": table}, wall_time=1002.0),
        StepRecord(step=3, images={"state": picture + 1}, wall_time=1003.0),
    ]


def _read_run(store_root, run_name):
    client = MlflowClient(tracking_uri=f"sqlite:///{store_root / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.mlflow.runName = '{run_name}'")
    metrics = {key: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, key)]
               for key in run.data.metrics}

    def files(path=None):
        out = []
        for item in client.list_artifacts(run.info.run_id, path):
            out += files(item.path) if item.is_dir else [item.path]
        return out

    tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
    # MLflow names an image's files with a fresh uuid each time
    return metrics, sorted(re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<uuid>", path) for path in files()), tags


def test_mlflow_write_many_stores_what_writing_each_step_stores(tmp_path):
    """One batched call and four single ones leave the same metric histories (values, steps, timestamps), media
    files and run tags, read back with `MlflowClient`."""
    runs = {}
    for how in ("each", "many"):
        backend = instrument.MlflowBackend(run_name=how)
        root = tmp_path / how
        backend.open(RunInfo(how, root))
        records = [record.freeze() for record in _records()]
        if how == "each":
            for record in records:
                backend.write(record)
        else:
            backend.write_many(records)
        backend.close()
        runs[how] = _read_run(root, how)
    assert runs["each"] == runs["many"]
    metrics, files, tags = runs["many"]
    assert metrics["loss"] == [(0, 1.5, 1000000), (1, 1.25, 1001000), (2, 1.0, 1002000)]
    assert "user/system/gpu" in metrics and "timing/fwd/mean" in metrics
    assert any(path.startswith("text/note/") for path in files) and any(path.startswith("samples/") for path in files)
    assert tags["instrument.media_step"] == "3"


class Delayed:
    """A loopback proxy to ``port`` that holds every chunk a client sends for ``delay`` seconds before passing it
    on: each request to the server behind it takes at least that long, as to a distant server."""

    def __init__(self, port: int, delay: float) -> None:
        self.port, self.delay = port, delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, server, self.delay), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, delay: float) -> None:
        try:
            while data := source.recv(65536):
                time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def test_a_distant_tracking_server_gets_every_step_of_a_loop_faster_than_its_requests(mlflow_server, tmp_path):
    """150 steps 10 ms apart to a server 150 ms away: before, one request per step (at least 150 ms each) fell
    further behind with every step and lost most of them; now each request takes every step waiting."""
    uri, _ = mlflow_server
    proxy = Delayed(int(uri.rsplit(":", 1)[1]), 0.15)
    try:
        mlflow_backend = instrument.MlflowBackend(tracking_uri=proxy.uri, run_name="distant", max_retries=0)
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(), mlflow_backend], log_interval=1,
                                          log_dir=str(tmp_path), run_name="distant", queue_size=128)
        try:
            for step in range(150):
                with inst.step(step):
                    inst.logger.log_metrics({"loss": step / 4}, step=step)
                time.sleep(0.01)
            inst.close(timeout=120)
        finally:
            inst.close()
    finally:
        proxy.close()
    status, history = _history(uri, "distant")
    assert status == "FINISHED"
    assert history == [(step, step / 4) for step in range(150)]
    assert inst.failures == {}
    assert _steps(tmp_path / "distant" / "metrics.jsonl") == list(range(150))


class GatedMlflow(instrument.MlflowBackend):
    """MLflow on a local store, driven as a remote backend; a flush waits for ``gate``."""

    remote = True

    def __init__(self, gate: threading.Event, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate

    def flush(self):
        self.gate.wait(60)


def _loss_steps(root):
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return [m.step for m in client.get_metric_history(run.info.run_id, "loss")]


@pytest.mark.parametrize("behind", [False, True])
def test_each_step_whose_text_mlflow_cannot_store_counts_once_whether_or_not_its_lane_fell_behind(tmp_path, behind):
    """The artifact store lies under a regular file: every step's text fails and its scalars are written. Ten
    steps are ten failures, written one by one or caught up in one call (a review found 2 for the second)."""
    (tmp_path / "blocker").write_text("a file, not a folder")
    gate = threading.Event()
    if not behind:
        gate.set()
    backend = GatedMlflow(gate, run_name="texts", artifact_location=(tmp_path / "blocker" / "art").as_uri())
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(), backend], log_interval=1,
                                      log_dir=str(tmp_path), run_name="texts", queue_size=64, flush_secs=3600)
    if behind:
        assert not inst.flush(timeout=0.2)  # the lane is held in that flush
    for step in range(10):
        with inst.step(step):
            inst.logger.log_metrics({"loss": float(step)}, step=step)
            inst.logger.log_text("note", f"text {step}", step=step)
        if not behind:
            assert not inst.flush(timeout=30)
    if behind:
        lane = inst.logger._writer._lanes.get(backend)
        while lane.pending < 10:
            time.sleep(0.01)
        gate.set()
        assert not inst.flush(timeout=30)
    inst.close()
    assert inst.failures == {"GatedMlflow": 10}
    assert _loss_steps(tmp_path) == list(range(10))


def test_a_subclass_that_overrides_only_write_gets_every_step_through_it(tmp_path):
    """A lane hands steps to `write_many` only where it is defined no higher than `write`: a subclass of MLflow's
    that keeps even steps in its `write` keeps them also when its lane fell behind (a review found every step
    written then)."""

    class EvenOnly(instrument.MlflowBackend):
        remote = True
        gate = threading.Event()

        def flush(self):
            self.gate.wait(60)  # a slow call: the steps after it wait in the lane

        def write(self, record):
            if record.step % 2 == 0:
                super().write(record)

    class Batched(EvenOnly):
        def write_many(self, records):
            super().write_many([record for record in records if record.step % 2 == 0])

    assert not batches(EvenOnly) and batches(Batched) and batches(instrument.MlflowBackend)
    assert not batches(instrument.JsonlBackend)
    backend = EvenOnly(run_name="even")
    inst = instrument.Instrumentation(backends=[backend], log_interval=1, log_dir=str(tmp_path), run_name="even",
                                      queue_size=64, flush_secs=3600)
    _queued_behind_a_flush(inst, backend)
    EvenOnly.gate.set()
    inst.close()
    assert _loss_steps(tmp_path) == [0, 2, 4, 6, 8]


def test_a_close_that_gives_up_counts_the_steps_inside_the_call_under_way(tmp_path, caplog):
    """Steps handed to a `write_many` that hangs are not written either: the message counts them (it said 0)."""

    class Hanging(instrument.Backend):
        remote = True
        held, hung = threading.Event(), threading.Event()

        def flush(self):
            self.held.wait(60)  # a slow call: the steps after it wait in the lane

        def write(self, record):
            self.hung.wait(60)

        def write_many(self, records):
            self.hung.wait(60)

    backend = Hanging()
    inst = instrument.Instrumentation(backends=[backend], log_interval=1, log_dir=str(tmp_path), run_name="hung",
                                      queue_size=64, flush_secs=3600)
    try:
        lane = _queued_behind_a_flush(inst, backend)
        Hanging.held.set()  # the ten steps go to one write_many, which hangs
        while lane.in_call < 10:
            time.sleep(0.01)
        inst.close(timeout=0.5)
    finally:
        Hanging.held.set()
        Hanging.hung.set()
    (said,) = [r.getMessage() for r in caplog.records if "gave up after 0.5s" in r.getMessage()]
    assert "was still in write_many() with 10 record(s) on its own thread, and 10 record(s)" in said


def test_a_batch_whose_media_find_the_server_dead_waits_for_it_once(tmp_path, monkeypatch):
    """The artifact server accepts connections and never answers: the first step's text waits out the request
    timeout, and the other steps' media are skipped (retry_after), each counted, instead of waiting once per step
    (a review measured 20 waits in one call; with MLflow's defaults, 33 s each)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with Silent() as server:
        backend = instrument.MlflowBackend(run_name="dead", artifact_location=server.uri + "/artifacts",
                                           retry_after=3600)
        backend.open(RunInfo("dead", tmp_path))
        records = [StepRecord(step=i, scalars={"loss": float(i)}, texts={"note": f"text {i}"}).freeze()
                   for i in range(5)]
        with pytest.raises(MediaWriteError) as raised:
            backend.write_many(records)
        assert len(server.conns) == 1  # one request waited; the next four steps' texts were skipped
        backend.close()
    assert raised.value.steps == 5 and "steps 0-4" in str(raised.value)
    assert _loss_steps(tmp_path) == list(range(5))  # every step's scalars were written


def test_a_media_write_error_raised_bare_is_one_failing_step():
    assert MediaWriteError().steps == 1 and str(MediaWriteError("x", steps=3)) == "x"


def _wide(step: int, wall_time: float = 1000.0, **media) -> StepRecord:
    """A step of 400 metrics: 1,000 metrics to a request, so that steps share requests."""
    return StepRecord(step=step, scalars={f"k{j:03d}": float(step) for j in range(400)}, wall_time=wall_time,
                      **media).freeze()


def _series(root, key):
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
    texts = sorted(item.path for item in client.list_artifacts(run.info.run_id, "text/note"))
    return steps, texts


def test_a_metric_request_the_store_refuses_costs_only_the_steps_with_a_metric_in_it(tmp_path):
    """Six steps of 400 metrics go in three requests; the store refuses the second (step 3's timestamp is more than
    SQLite holds): steps 2-4 fail, and 0, 1 and 5 are written whole, media too (every step counted as lost before,
    although most were stored)."""
    backend = instrument.MlflowBackend(run_name="refused")
    backend.open(RunInfo("refused", tmp_path))
    records = [_wide(i, 1e30 if i == 3 else 1000.0 + i, texts={"note": f"text {i}"}) for i in range(6)]
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many(records)
    backend.close()
    assert raised.value.steps == 3 and not isinstance(raised.value, MediaWriteError)
    assert "'the metrics of steps 2-4'" in str(raised.value) and "of steps 0-5" in str(raised.value)
    assert _series(tmp_path, "k000") == ([0, 1, 2, 5], ["text/note/step_00000000.txt", "text/note/step_00000001.txt",
                                                       "text/note/step_00000005.txt"])
    assert _series(tmp_path, "k399")[0] == [0, 1, 5]  # step 2's first metrics went in the request that was stored


def test_a_call_whose_every_metric_request_fails_raises_what_the_store_raised(tmp_path):
    """Nothing of the call was written: its own exception, every step lost, as a single write raises it."""
    backend = instrument.MlflowBackend(run_name="none")
    backend.open(RunInfo("none", tmp_path))
    with pytest.raises(Exception, match="too large") as raised:
        backend.write_many([_wide(0, 1e30), _wide(1, 1e30)])
    backend.close()
    assert not isinstance(raised.value, PartialWriteError)


def test_a_metric_request_that_finds_the_server_gone_skips_the_rest_of_the_call(tmp_path, monkeypatch):
    """The second of four requests cannot reach the server: the third and fourth are not made (each would wait out
    the timeout again), nor step 1's text or the run tags; step 0 whole and step 1's metrics are stored."""
    backend = instrument.MlflowBackend(run_name="gone", retry_after=3600)
    backend.open(RunInfo("gone", tmp_path))
    sent, log_batch = [], backend.client.log_batch

    def once_then_gone(*args, **kwargs):
        sent.append(kwargs)
        if len(sent) > 1:
            raise ConnectionError("connection refused")
        return log_batch(*args, **kwargs)

    monkeypatch.setattr(backend.client, "log_batch", once_then_gone)
    records = [_wide(i, texts={"note": "text"} if i == 1 else {}) for i in range(8)]
    records[0] = StepRecord(step=0, scalars={**records[0].scalars, "odd name!": 1.0}, wall_time=1000.0).freeze()
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many(records)
    assert len(sent) == 2 and all("metrics" in kwargs for kwargs in sent)
    assert raised.value.steps == 7  # 1 (its text skipped), and 2-7
    assert "skipped (retry_after)" in str(raised.value)
    monkeypatch.undo()
    backend.close()
    assert _series(tmp_path, "k000") == ([0, 1, 2], [])  # step 2's first 200 metrics were in the first request
    assert _series(tmp_path, "k399")[0] == [0, 1]
    assert len(_series(tmp_path, "odd name_")[0]) == 1


def _refusing(monkeypatch, backend, method, refuse):
    """``backend.client.<method>`` raises where ``refuse(kwargs, args)`` says so; the real call otherwise."""
    real = getattr(backend.client, method)

    def call(*args, **kwargs):
        fault = refuse(args, kwargs)
        if fault is not None:
            raise fault
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.client, method, call)


def test_a_media_only_step_written_in_part_is_still_one_a_resume_does_not_write_again(tmp_path, monkeypatch):
    """Step 1 holds two texts; one is refused. Its other text is stored, so the run tag that tells a resume which
    media-only steps it holds names it (a review found it left out: a resume wrote the step again, twice its
    files)."""
    from instrument.backends.mlflow_store import LAST_STEP_TAG

    backend = instrument.MlflowBackend(run_name="part")
    backend.open(RunInfo("part", tmp_path))
    backend.write(_wide(0))
    _refusing(monkeypatch, backend, "log_text", lambda args, kwargs: OSError("no room") if "bad" in args[2] else None)
    with pytest.raises(MediaWriteError):
        backend.write(StepRecord(step=1, texts={"good": "g", "bad": "b"}, wall_time=1001.0).freeze())
    monkeypatch.undo()
    run_id = backend.run_id
    backend.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(run_id).data.tags[LAST_STEP_TAG] == "1"


@pytest.mark.parametrize("second", ["metrics", "media"])
def test_a_call_of_which_nothing_reached_the_server_raises_what_it_raised(tmp_path, monkeypatch, second):
    """The first request finds the server gone and the rest of the call is skipped: nothing was stored, so the
    call raises the ConnectionError itself (a review found a PartialWriteError saying the rest was written)."""
    backend = instrument.MlflowBackend(run_name="gone", retry_after=3600)
    backend.open(RunInfo("gone", tmp_path))
    _refusing(monkeypatch, backend, "log_batch",
              lambda args, kwargs: ConnectionError("connection refused") if "metrics" in kwargs else None)
    other = _wide(1, 1000.0) if second == "metrics" else StepRecord(step=1, texts={"note": "t"}).freeze()
    records = [StepRecord(step=0, scalars={f"k{j:04d}": 0.0 for j in range(1000)}, wall_time=999.0).freeze(), other]
    with pytest.raises(ConnectionError, match="connection refused"):
        backend.write_many(records)
    monkeypatch.undo()
    backend._unreachable_until = 0.0  # closed at once, not after retry_after
    backend.close()
    assert _series(tmp_path, "k000") == ([], [])


def test_the_message_names_the_metric_requests_skipped_and_no_run_tags_when_none_were_due(tmp_path, monkeypatch):
    """Steps 1-2 stored, the request with steps 3-5 finds the server gone, the one with steps 5-7 is skipped: the
    message names both (a review found the skipped steps unnamed, and run tags named that nobody was to send)."""
    backend = instrument.MlflowBackend(run_name="named", retry_after=3600)
    backend.open(RunInfo("named", tmp_path))
    backend.write(_wide(0))  # the keys' names are held: no run tag is due in the call below
    sent = []
    _refusing(monkeypatch, backend, "log_batch", lambda args, kwargs: sent.append(kwargs) or (
        ConnectionError("connection refused") if len(sent) == 2 else None))
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many([_wide(i) for i in range(1, 8)])
    said = str(raised.value)
    assert len(sent) == 2 and raised.value.steps == 5
    assert "'the metrics of steps 3-5': ConnectionError" in said and "'the metrics of steps 6-7': _Waiting" in said
    assert "run tags" not in said.split("could not be written")[1]
    monkeypatch.undo()
    backend.close()


def test_a_resumed_call_that_fails_counts_only_the_steps_the_run_did_not_hold(tmp_path, monkeypatch):
    """A resumed run holds steps 0-6; a call of steps 0-9 whose request is refused lost 7-9 only (a review found the
    lane counting 10: the exception said nothing of the 7 held)."""
    first = instrument.MlflowBackend(run_name="held")
    first.open(RunInfo("held", tmp_path))
    first.write_many([_wide(i) for i in range(7)])
    run_id = first.run_id
    backend = instrument.MlflowBackend(run_name="held")
    backend.open(RunInfo("held", tmp_path, resume={first.name: run_id}))
    _refusing(monkeypatch, backend, "log_batch",
              lambda args, kwargs: OSError("refused") if "metrics" in kwargs else None)
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many([_wide(i) for i in range(10)])
    assert raised.value.steps == 3 and isinstance(raised.value.__cause__, OSError)
    assert "steps 7-9 could not be written (OSError: refused)" in str(raised.value)
    monkeypatch.undo()
    backend.close()


def test_a_resumed_call_skipped_while_the_server_is_waited_for_counts_only_the_steps_the_run_did_not_hold(
        tmp_path, monkeypatch):
    """The run holds steps 0-4; a call of steps 2-9 comes while an earlier call's dead server is waited for
    (retry_after): steps 5-9 are lost, not 8 (a review found the skip raised before the count was made)."""
    first = instrument.MlflowBackend(run_name="held")
    first.open(RunInfo("held", tmp_path))
    first.write_many([_wide(i) for i in range(5)])
    run_id = first.run_id
    backend = instrument.MlflowBackend(run_name="held", retry_after=3600)
    backend.open(RunInfo("held", tmp_path, resume={first.name: run_id}))
    _refusing(monkeypatch, backend, "log_batch", lambda args, kwargs: ConnectionError("refused"))
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many([_wide(i) for i in range(3, 8)])
    assert raised.value.steps == 3  # 5-7 lost; 3 and 4 held
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many([_wide(i) for i in range(2, 10)])
    assert raised.value.steps == 5 and "skipped (retry_after)" in str(raised.value.__cause__)
    monkeypatch.undo()
    backend._unreachable_until = 0.0
    backend.close()


def test_a_step_with_nothing_mlflow_stores_is_not_lost_with_a_refused_one(tmp_path):
    """Step 0's metrics are refused; step 1 holds a histogram only (MLflow logs none): one step failed, as written
    apart (a review counted two: the call was taken for one of which nothing was stored)."""
    backend = instrument.MlflowBackend(run_name="empty")
    backend.open(RunInfo("empty", tmp_path))
    histogram = (np.array([1.0, 2.0]), np.array([0.0, 1.0, 2.0]))
    with pytest.raises(PartialWriteError) as raised:
        backend.write_many([_wide(0, 1e30), StepRecord(step=1, histograms={"h": histogram}, wall_time=1001.0).freeze()])
    backend.close()
    assert raised.value.steps == 1


def test_a_media_only_step_of_which_nothing_was_stored_is_one_a_resume_writes_again(tmp_path, monkeypatch):
    """Every text of step 1 is refused: the run tag that tells a resume which media-only steps it holds does not
    name it (it did, so a resume never wrote it)."""
    from instrument.backends.mlflow_store import LAST_STEP_TAG

    backend = instrument.MlflowBackend(run_name="none")
    backend.open(RunInfo("none", tmp_path))
    backend.write(_wide(0))
    _refusing(monkeypatch, backend, "log_text", lambda args, kwargs: OSError("no room"))
    with pytest.raises(MediaWriteError) as raised:
        backend.write(StepRecord(step=1, texts={"a": "x", "b": "y"}, wall_time=1001.0).freeze())
    assert "'text a'" in str(raised.value) and "'text b'" in str(raised.value)  # each value named
    monkeypatch.undo()
    run_id = backend.run_id
    backend.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert LAST_STEP_TAG not in client.get_run(run_id).data.tags


@pytest.mark.parametrize("text, unreachable", [
    ("API request to http://h/api failed with exception HTTPConnectionPool: Max retries exceeded", True),
    ("API request to http://h/api failed with timeout exception Read timed out.", True),
    ("API request to endpoint /api/2.0/mlflow/runs/log-batch failed with error code 503 != 200. Response body: ''",
     True),
    ("API request to endpoint /api/2.0/mlflow/runs/log-batch failed with error code 413 != 200. Response body: "
     "'<html>Request Entity Too Large</html>'", False),  # a proxy's refusal: the server is there
    ("RESOURCE_DOES_NOT_EXIST: Run 'x' not found", False),
])
def test_a_refusal_worded_as_a_failed_request_is_not_taken_for_an_unreachable_server(text, unreachable):
    """MLflow words a non-JSON answer as it words a transport failure; taken for one, a proxy's 413 made every
    later call wait out retry_after (a review read it in MLflow's rest_utils)."""
    from mlflow.exceptions import MlflowException

    from instrument.backends.mlflow_store import is_unreachable

    assert is_unreachable(MlflowException(text)) is unreachable


@pytest.mark.parametrize("then", ["next call", "close"])
def test_a_media_only_steps_run_tag_that_a_dead_server_kept_back_is_set_by_the_next_call_or_close(tmp_path,
                                                                                                 monkeypatch, then):
    """Step 0 (a text only) is stored; step 1's text finds the server gone, so the call's run tags are skipped: the
    tag that tells a resume the run holds step 0 was lost, and a resume wrote step 0 again (a review found it).
    It is now set by the next call that reaches the server, or by close."""
    from instrument.backends.mlflow_store import LAST_STEP_TAG

    backend = instrument.MlflowBackend(run_name="later", retry_after=3600)
    backend.open(RunInfo("later", tmp_path))
    _refusing(monkeypatch, backend, "log_text",
              lambda args, kwargs: ConnectionError("connection refused") if "/b/" in args[2] else None)
    with pytest.raises(MediaWriteError):
        backend.write_many([StepRecord(step=0, texts={"a": "x"}, wall_time=1000.0).freeze(),
                            StepRecord(step=1, texts={"b": "y"}, wall_time=1001.0).freeze()])
    monkeypatch.undo()
    run_id = backend.run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert LAST_STEP_TAG not in client.get_run(run_id).data.tags
    if then == "next call":
        backend._unreachable_until = 0.0  # the server is back
        backend.write(_wide(2))
        assert client.get_run(run_id).data.tags[LAST_STEP_TAG] == "0"
    backend.close()
    assert client.get_run(run_id).data.tags[LAST_STEP_TAG] == "0"
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_kept_back_run_tag_is_not_sent_to_a_server_a_call_just_found_gone(tmp_path, monkeypatch):
    """A media-only step's tag kept back by a dead server waits for the next call; a next call whose second metric
    request finds the server gone again does not send it (it would wait out the timeout once more)."""
    backend = instrument.MlflowBackend(run_name="again", retry_after=3600)
    backend.open(RunInfo("again", tmp_path))
    backend._media_step = 0  # what a call that found the server gone left for the next one
    tags, sent = [], []
    _refusing(monkeypatch, backend, "set_tag", lambda args, kwargs: tags.append(args) or None)
    _refusing(monkeypatch, backend, "log_batch", lambda args, kwargs: sent.append(kwargs) or (
        ConnectionError("connection refused") if len(sent) == 2 else None))
    with pytest.raises(PartialWriteError):
        backend.write_many([_wide(i) for i in range(1, 4)])
    assert tags == [] and backend._media_step == 0
    monkeypatch.undo()
    backend._unreachable_until = 0.0
    backend.close()
