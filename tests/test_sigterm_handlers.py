"""SIGTERM when the program has a handler of its own, and SIGTERM while a session starts.

A preemption handler installed before the session (set a flag, stop at the next step, save a checkpoint: what
SLURM and torchrun jobs do) must find the loggers still open when training goes on: closing them first lost every
step the loop committed before it stopped, made a checkpoint saved in the open step count a step that was never
written, and under a process group left the signalled rank out of the commits' collectives, so the ranks paired
the wrong collectives and hung until the group's timeout. A handler that exits still closes every backend
"killed". A SIGTERM while the backends open ends the start as Ctrl-C does: what opened ends KILLED, the run
folder is put back, and the process still ends by the signal.

Real child processes, real signals; JSONL, TensorBoard (EventAccumulator) and MLflow (`MlflowClient`) read back.
"""

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import instrument  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FLAG_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    import instrument

    root, uri, how = sys.argv[1], sys.argv[2], sys.argv[3]
    calls = []

    def on_term(signum, frame):  # installed before the session, as a job's preemption handler is
        calls.append(signum)
        if how == "exit":
            sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    inst = instrument.Instrumentation(
        backends=[instrument.TensorBoardBackend(), instrument.JsonlBackend(),
                  instrument.MlflowBackend(tracking_uri=uri, run_name="flag")],
        log_interval=5, run_name="run", log_dir=root, overhead_budget=None, flush_secs=3600,
    )
    checkpoint = None
    for step in range(40):
        with inst.step(step):
            if step % 5 == 0:  # logging steps only: nothing is averaged over the steps between them
                inst.log({"loss": step / 2})
            if step == 13:
                os.kill(os.getpid(), signal.SIGTERM)  # preempted inside a (non-logging) step
            if calls and step % 5 == 0:  # the loop sees the flag at its next logging step and stops there
                checkpoint = inst.state_dict()  # the block's last statement, as the docs advise
        print(step, flush=True)
        if checkpoint is not None:
            break
    inst.close()
    print(json.dumps({"calls": len(calls), "checkpoint": checkpoint}), flush=True)
    """
)


def _run(tmp_path: Path, how: str, uri: str) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(FLAG_CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), str(tmp_path), uri, how], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=240)


def _steps(tmp_path: Path):
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    jsonl = [(line["step"], line["metrics"]["loss"]) for line in lines if "loss" in line.get("metrics", {})]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("loss")]
    return jsonl, tb


def _mlflow(uri: str):
    client = MlflowClient(tracking_uri=uri)
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"] or client.search_experiments()
    (mlrun,) = client.search_runs([experiment.experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "loss"))
    return mlrun.info.status, history


def test_a_flag_setting_sigterm_handler_finds_the_loggers_open_and_every_step_is_written(tmp_path):
    """The handler sets a flag and returns; the loop logs on to step 15, checkpoints in that step's block and
    stops. Step 15 is in every backend (the checkpoint counts it), and the run still ends KILLED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = _run(tmp_path, "flag", uri)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["calls"] == 1 and summary["checkpoint"]["last_step"] == 15
    assert "closed" not in done.stderr  # no "logged after the run was closed"
    want = [(s, s / 2) for s in (0, 5, 10, 15)]
    jsonl, tb = _steps(tmp_path)
    assert jsonl == want and tb == want
    status, history = _mlflow(uri)
    assert status == "KILLED" and history == want


def test_a_sigterm_handler_that_exits_still_closes_every_backend_killed(tmp_path):
    """``sys.exit(143)`` in the handler: the loggers are closed before it goes on; every committed step is kept
    and the open step (13, its block cut short) is not written."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = _run(tmp_path, "exit", uri)
    assert done.returncode == 143, done.stderr
    assert done.stdout.split() == [str(s) for s in range(13)]
    want = [(s, s / 2) for s in (0, 5, 10)]
    jsonl, tb = _steps(tmp_path)
    assert jsonl == want and tb == want
    status, history = _mlflow(uri)
    assert status == "KILLED" and history == want


START_CHILD = textwrap.dedent(
    """
    import sys, time
    import instrument

    root, uri = sys.argv[1], sys.argv[2]

    class SlowOpen(instrument.JsonlBackend):  # a backend whose open takes a while (W&B's service start)
        def open(self, run):
            super().open(run)
            print("opening", flush=True)
            time.sleep(30)

    instrument.Instrumentation(
        backends=[instrument.MlflowBackend(tracking_uri=uri, run_name="start"), SlowOpen()],
        run_name="job", log_dir=root,
    )
    print("started", flush=True)
    """
)


def test_sigterm_while_the_backends_open_ends_what_opened_killed_and_frees_the_run_name(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(START_CHILD)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), uri], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert child.stdout.readline().strip() == "opening"
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM, err  # it still ends by the signal
    assert "started" not in out
    assert not (tmp_path / "job").exists(), err  # the folder this start made is gone
    status, _ = _mlflow(uri)
    assert status == "KILLED"
    with instrument.Instrumentation(backends=[instrument.JsonlBackend()], run_name="job", log_dir=str(tmp_path)):
        pass  # the same run_name starts again


def _rank(rank: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # before the session
    # A short timeout: collectives paired wrongly fail in 20 s instead of hanging for gloo's 30 minutes.
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=5, run_name="ranks",
                                      log_dir=tmp, overhead_budget=None)
    try:
        for step in range(40):
            with inst.step(step):
                if step % 5 == 0:  # logging steps only
                    inst.log({"loss": float(step * 10 + rank)})
                if rank == 0 and step == 10:
                    os.kill(os.getpid(), signal.SIGTERM)  # this rank is preempted inside a logging step
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag)  # the ranks stop together
            if flag.item() > 0:
                break
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps({"stopped_at": step, "calls": len(stop)}))
    finally:
        inst.close()
        dist.destroy_process_group()


def test_a_rank_whose_sigterm_handler_sets_a_flag_keeps_the_ranks_commits_paired(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["stopped_at"] for r in results] == [10, 10] and [r["calls"] for r in results] == [1, 0]
    lines = [json.loads(line) for line in (tmp_path / "ranks" / "metrics.jsonl").read_text().splitlines()]
    means = [(line["step"], line["metrics"]["loss"]) for line in lines if "loss" in line.get("metrics", {})]
    assert means == [(s, s * 10 + 0.5) for s in (0, 5, 10)]  # step 10 too, the mean of both ranks
