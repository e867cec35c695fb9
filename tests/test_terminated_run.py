"""A run terminated by SIGTERM keeps every committed step in every backend, and says it was killed.

A real child process trains with TensorBoard, JSONL, W&B (offline) and MLflow (a local sqlite store), prints
each step after committing it, and is sent a real SIGTERM once N steps are committed. Every backend is then
read back as a user would: EventAccumulator, the JSONL lines, W&B's own transaction log, `MlflowClient`.

A run made in a multiprocessing child and left open is closed by multiprocessing's finalizer as the child ends,
and ends as the child's target did: failed, killed or finished.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from tests.wandb_reader import exit_codes, read_run  # noqa: E402

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    import instrument

    root, uri = sys.argv[1], sys.argv[2]
    inst = instrument.Instrumentation(
        backends=[
            instrument.TensorBoardBackend(flush_every_commit=False),
            instrument.JsonlBackend(),
            instrument.WandbBackend(mode="offline", project="sigterm"),
            instrument.MlflowBackend(tracking_uri=uri, run_name="sigterm"),
        ],
        log_interval=1, run_name="child", log_dir=root, flush_secs=3600,
    )
    step = 0
    while True:
        with inst.step(step):
            inst.logger.log_metrics({"loss": torch.tensor(float(step) / 2)}, step=step)
        print(step, flush=True)
        step += 1
        time.sleep(0.005)
    """
)


def _assert_mlflow_run(uri: str, status: str, losses) -> None:
    """The one MLflow run of the store at ``uri`` ended ``status`` with exactly ``losses`` ((step, value) pairs)."""
    client = MlflowClient(tracking_uri=uri)
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"] or client.search_experiments()
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.status == status
    assert sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "loss")) == losses


def _terminate_after(child: subprocess.Popen, wanted: int, group: bool) -> str:
    """SIGTERM ``child`` (its whole process group with ``group``) once it printed ``wanted`` committed steps, one
    number per line; its stderr (empty when not piped)."""
    committed = -1
    try:
        for line in child.stdout:
            committed = int(line)
            if committed + 1 >= wanted:
                break
        (os.killpg if group else os.kill)(child.pid, signal.SIGTERM)
        _, stderr = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            (os.killpg if group else os.kill)(child.pid, signal.SIGKILL)
    assert committed + 1 == wanted, "the child stopped before committing the steps it was asked for"
    return stderr or ""


def test_sigterm_leaves_every_committed_step_in_tensorboard_jsonl_wandb_and_mlflow(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline", "WANDB_SILENT": "true",
    }
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), uri], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    wanted = 12
    _terminate_after(child, wanted, group=False)
    assert child.returncode == -signal.SIGTERM  # it still dies by the signal

    run = tmp_path / "child"
    jsonl = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line)]
    # Every committed step is there; a step committed after the last print and before the signal may be too.
    assert jsonl[:wanted] == list(range(wanted)) and jsonl == list(range(len(jsonl)))

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert tb == [(s, s / 2) for s in jsonl]

    rows, _ = read_run(run)
    assert [(r["_step"], r["loss"]) for r in rows if "loss" in r] == [(s, s / 2) for s in jsonl]

    _assert_mlflow_run(uri, "KILLED", [(s, s / 2) for s in jsonl])


def test_an_mlflow_server_that_never_answers_never_holds_the_training_thread(tmp_path, caplog):
    """The MLflow open hangs on a silent loopback socket (it listens, never answers) for its whole read timeout,
    on the writer thread. With on_backend_error="warn", Instrumentation() waits only open_timeout; then every
    step commits while that open is still hanging (the writer has not caught up), and the other backend gets
    every step once the open gives up."""
    import socket

    import torch

    import instrument

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        mlflow_backend = instrument.MlflowBackend(tracking_uri=uri, timeout=20, max_retries=0, retry_after=3600)
        inst = instrument.Instrumentation(
            backends=[instrument.JsonlBackend(), mlflow_backend], log_interval=1, log_dir=str(tmp_path),
            run_name="silent", on_backend_error="warn", open_timeout=0.2,
        )
        for step in range(20):
            with inst.step(step):
                inst.logger.log_metrics({"loss": torch.tensor(float(step))}, step=step)
        # Every step was handed over; the writer is still inside MLflow's open, so nothing could be written yet.
        assert not inst.flush(timeout=0.5)
        inst.close()  # waits for the open to give up (bounded by timeout=20), then writes everything else
    steps = [json.loads(line)["step"] for line in (tmp_path / "silent" / "metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line)]
    assert steps == list(range(20))
    assert "MlflowBackend" in inst.failures


REOPEN_CHILD = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    import instrument

    port, root = int(sys.argv[1]), sys.argv[2]
    mlflow_backend = instrument.MlflowBackend(tracking_uri=f"http://127.0.0.1:{port}", timeout=5, retry_after=0)
    inst = instrument.Instrumentation(  # nothing listens yet: the open is refused, and MLflow stays to reopen
        backends=[mlflow_backend, instrument.JsonlBackend()], run_name="r", log_dir=root, on_backend_error="warn",
    )
    silent = socket.socket()  # the server comes back, but never answers: each try to open takes its timeout
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind(("127.0.0.1", port))
    silent.listen(64)
    for step in range(10):
        inst.logger.log_metrics({"x": float(step)}, step=step)
        inst.logger.commit(step)
    print("committed", flush=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)
    """
)


def test_sigterm_while_mlflow_tries_to_reopen_costs_the_other_backends_no_step(tmp_path):
    """A reopening MLflow backend (its open was refused) is written after the others, and not at all once the
    logger closes: before, JSONL sat behind MLflow's tries against a silent server until SIGTERM's close bound
    ran out, and lost every step."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "child.py"
    script.write_text(REOPEN_CHILD)
    child = subprocess.run([sys.executable, str(script), str(port), str(tmp_path)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert child.returncode == -signal.SIGTERM, child.stderr[-2000:]
    assert "committed" in child.stdout
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "x" in json.loads(line).get("metrics", {})] == list(range(10))


DATALOADER_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    import instrument

    class Slow(instrument.Backend):  # a backend a little behind, so the queue holds steps when SIGTERM comes
        def write(self, record):
            time.sleep(0.02)

    root, uri = sys.argv[1], sys.argv[2]
    logger = instrument.Logger(
        [instrument.JsonlBackend(), instrument.MlflowBackend(tracking_uri=uri, run_name="group"), Slow()],
        run=instrument.RunInfo(name="child", root=root),
    )
    data = torch.utils.data.TensorDataset(torch.arange(10**6, dtype=torch.float32))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork",
                                         persistent_workers=True)
    step = 0
    while True:
        for (x,) in loader:
            logger.log_metrics({"loss": float(step) / 2}, step=step)
            logger.commit(step)
            print(step, flush=True)
            step += 1
    """
)


def test_sigterm_to_the_process_group_with_dataloader_workers_keeps_every_committed_step(tmp_path):
    """SLURM's scancel and preemption signal the whole group: the DataLoader workers die too, and torch's SIGCHLD
    handler raised into instrument's wait for the writer, which then ended the process with the close half done
    (the queued steps lost, the MLflow run left RUNNING)."""
    script = tmp_path / "child.py"
    script.write_text(DATALOADER_CHILD)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), uri], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    wanted = 40
    stderr = _terminate_after(child, wanted, group=True)
    assert child.returncode == -signal.SIGTERM, stderr
    jsonl = [json.loads(line)["step"] for line in (tmp_path / "child" / "metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line)]
    assert jsonl[:wanted] == list(range(wanted)) and jsonl == list(range(len(jsonl))), stderr
    _assert_mlflow_run(uri, "KILLED", [(s, s / 2) for s in jsonl])


FORKED_WORKER = textwrap.dedent(
    """
    import multiprocessing, sys
    import instrument

    def train(root, n):
        logger = instrument.Logger([instrument.JsonlBackend(), instrument.TensorBoardBackend()],
                                   run=instrument.RunInfo(name="worker", root=root))
        for step in range(n):
            logger.log_metrics({"loss": float(step)}, step=step)
            logger.commit(step)
        # no close(): the process ends with multiprocessing's os._exit, where atexit hooks never run

    if __name__ == "__main__":
        worker = multiprocessing.get_context("fork").Process(target=train, args=(sys.argv[1], 2000))
        worker.start()
        worker.join(120)
        sys.exit(worker.exitcode)
    """
)


def test_a_logger_made_in_a_forked_multiprocessing_worker_keeps_every_step_without_close(tmp_path):
    """A fork child of multiprocessing ends with os._exit: the atexit hook never ran, and the steps the writer
    had not written yet (dozens of 2000) were lost. multiprocessing's own finalizer closes the logger now."""
    script = tmp_path / "worker.py"
    script.write_text(FORKED_WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    jsonl = [json.loads(line)["step"] for line in (tmp_path / "worker" / "metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line)]
    assert jsonl == list(range(2000))
    acc = EventAccumulator(str(tmp_path / "worker"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(2000))


CHILD_ENDINGS = textwrap.dedent(
    """
    import multiprocessing, sys
    import instrument

    def train(root, uri, ending, wandb):
        backends = [instrument.MlflowBackend(tracking_uri=uri, run_name="child")]
        if wandb:
            backends.append(instrument.WandbBackend(mode="offline", project="child"))
        logger = instrument.Logger(backends, run=instrument.RunInfo(name="child", root=root))
        for step in range(2):
            logger.log_metrics({"loss": step / 2}, step=step)
            logger.commit(step)
        # no close(): multiprocessing's finalizer closes the logger as the child ends
        if ending == "raise":
            raise RuntimeError("the experiment broke")
        if ending == "exit3":
            sys.exit(3)
        if ending == "interrupt":
            raise KeyboardInterrupt

    def spawned(rank, root, uri):  # a session this time; torch's _wrap turns the exception into sys.exit(1)
        inst = instrument.Instrumentation(backends=[instrument.MlflowBackend(tracking_uri=uri, run_name="child")],
                                          log_interval=1, run_name="child", log_dir=root)
        for step in range(2):
            with inst.step(step):
                inst.logger.log_metrics({"loss": step / 2}, step=step)
        raise RuntimeError("the experiment broke")

    def task(args):
        train(*args)

    if __name__ == "__main__":
        how, method, ending, root, uri = sys.argv[1:6]
        args = (root, uri, ending, how == "process+wandb")
        if how == "torch":
            import torch.multiprocessing
            try:
                torch.multiprocessing.spawn(spawned, args=(root, uri), nprocs=1)
            except torch.multiprocessing.ProcessRaisedException as exc:
                print("raised", "the experiment broke" in str(exc))
        elif how == "pool":
            pool = multiprocessing.get_context(method).Pool(1)
            try:
                pool.map(task, [args])
            except RuntimeError as exc:
                print("raised", exc)
            pool.close()  # the worker ends when it is asked to, not by a terminate()
            pool.join()
        else:
            child = multiprocessing.get_context(method).Process(target=train, args=args)
            child.start()
            child.join(120)
            print("exitcode", child.exitcode)
    """
)


def _store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _end_a_child(tmp_path: Path, how: str, method: str, ending: str) -> str:
    """Run `CHILD_ENDINGS` and the child it starts (MLflow's store: `_store`); what the parent printed."""
    script = tmp_path / "parent.py"
    script.write_text(CHILD_ENDINGS)
    uri = _store(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = subprocess.run([sys.executable, str(script), how, method, ending, str(tmp_path), uri], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_multiprocessing_child_that_raises_ends_its_open_run_failed_with_every_committed_step(tmp_path, method):
    """A child never calls sys.excepthook (Process._bootstrap prints the error itself), so the finalizer that
    closes its open Logger ended the run FINISHED in MLflow and with exit code 0 in W&B."""
    assert _end_a_child(tmp_path, "process+wandb", method, "raise") == "exitcode 1"
    _assert_mlflow_run(_store(tmp_path), "FAILED", [(0, 0.0), (1, 0.5)])
    rows, _ = read_run(tmp_path / "child")
    assert [(r["_step"], r["loss"]) for r in rows if "loss" in r] == [(0, 0.0), (1, 0.5)]
    assert exit_codes(tmp_path / "child") == [1]


@pytest.mark.parametrize("ending, exitcode, status", [
    ("exit3", 3, "FAILED"),
    ("interrupt", 1, "KILLED"),
    ("return", 0, "FINISHED"),  # a guard: nothing in flight, nothing marked
])
def test_a_multiprocessing_child_ends_its_open_run_as_its_target_ended(tmp_path, ending, exitcode, status):
    assert _end_a_child(tmp_path, "process", "spawn", ending) == f"exitcode {exitcode}"
    _assert_mlflow_run(_store(tmp_path), status, [(0, 0.0), (1, 0.5)])


def test_a_torch_multiprocessing_spawn_child_that_raises_ends_its_open_run_failed(tmp_path):
    """torch's spawn catches the exception, hands its traceback to the parent and calls sys.exit(1)."""
    assert _end_a_child(tmp_path, "torch", "spawn", "raise") == "raised True"
    _assert_mlflow_run(_store(tmp_path), "FAILED", [(0, 0.0), (1, 0.5)])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_pool_task_that_raises_does_not_fail_the_run_its_worker_closes(tmp_path, method):
    """A guard: the pool catches the task's exception and the worker goes on, then ends normally; the run
    the task left open is closed FINISHED (the error reached the parent, not the worker's end)."""
    assert _end_a_child(tmp_path, "pool", method, "raise") == "raised the experiment broke"
    _assert_mlflow_run(_store(tmp_path), "FINISHED", [(0, 0.0), (1, 0.5)])


_NON_CHAINING_HOOK = textwrap.dedent(
    """
    import sys
    import instrument

    root, uri, hook = sys.argv[1:4]
    logger = instrument.Logger([instrument.MlflowBackend(tracking_uri=uri, run_name="main")],
                               run=instrument.RunInfo(name="main", root=root))
    if hook == "own":  # a crash reporter installed after the Logger, which does not call the hook before it
        sys.excepthook = lambda kind, value, tb: print("reported", kind.__name__, file=sys.stderr)
    for step in range(2):
        logger.log_metrics({"loss": step / 2}, step=step)
        logger.commit(step)
    raise RuntimeError("the experiment broke")  # no close(): the exit closes it
    """
)


@pytest.mark.parametrize("hook", ["own", "default"])
def test_an_uncaught_exception_past_a_non_chaining_excepthook_still_ends_the_run_failed(tmp_path, hook):
    """The later hook kept the exception from instrument's, and the exit closed the run FINISHED."""
    script = tmp_path / "main.py"
    script.write_text(_NON_CHAINING_HOOK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path), _store(tmp_path), hook], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert ("reported RuntimeError" in out.stderr) == (hook == "own")
    _assert_mlflow_run(_store(tmp_path), "FAILED", [(0, 0.0), (1, 0.5)])
