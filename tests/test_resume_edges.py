"""Edges of the run lock, the checkpointed step and the JSONL resume: a close that gave up keeps the run until
its writer stops, a JSONL file that cannot be rewritten beside itself is cut in place, a checkpointed step whose
block raised is not written by a later signal, Ctrl-C while closing still closes, and a bad ``last_step`` is
refused. Read back from JSONL files; signals are real, in child processes."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import instrument
from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.backends.jsonl import JsonlBackend
from instrument.errors import ConfigurationError
from instrument.probes import hooks

ROOT = Path(__file__).resolve().parents[1]
WAIT = 60.0  # a bound for polling, never a timing assertion


def _steps(path: Path, key: str = "v"):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [(r["step"], r["metrics"][key]) for r in rows if "step" in r and key in r["metrics"]]


class Hung(Backend):
    """Blocks in its first write until released (a remote that does not answer)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, record):
        self.entered.set()
        self.release.wait(WAIT)


def test_a_close_that_gave_up_keeps_the_run_until_its_writer_has_stopped(tmp_path):
    hung = Hung()
    inst = instrument.Instrumentation(backends=[hung, JsonlBackend()], run_name="r", log_dir=str(tmp_path),
                                      log_interval=1)
    for step in range(4):
        with inst.step(step):
            inst.log({"v": float(step)})
        if step == 1:
            state = inst.state_dict()
    assert hung.entered.wait(WAIT)
    try:
        inst.close(timeout=0.1)  # gives up: steps 1..3 still wait behind the hung write
        with pytest.raises(ConfigurationError, match="still writes .*close.*gave up"):
            instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), resume=True)
    finally:
        hung.release.set()
    deadline = time.monotonic() + WAIT
    while (tmp_path / "r" / ".instrument-lock").exists():  # released by the writer as it stops
        assert time.monotonic() < deadline, "the run was never released"
        time.sleep(0.01)
    resumed = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path),
                                         resume=True, log_interval=1)
    resumed.load_state_dict(state)
    with resumed.step(2):
        resumed.log({"v": 102.0})
    resumed.close()
    # the first process's steps were all written before the resume cut them: nothing interleaved or repeated
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [(0, 0.0), (1, 1.0), (2, 102.0)]


def test_a_jsonl_file_that_cannot_be_rewritten_beside_itself_is_cut_in_place(tmp_path, caplog):
    backend = JsonlBackend()
    backend.open(RunInfo("r", tmp_path))
    for step in range(6):
        backend.write(StepRecord(step=step, scalars={"v": float(step)}))
        backend.write_system(StepRecord(step=step, scalars={"system/x": float(step)}))
    backend.close()
    (tmp_path / "r" / "metrics.jsonl.resume.tmp").mkdir()  # where the rewrite goes cannot be made
    backend = JsonlBackend()
    backend.open(RunInfo("r", tmp_path))
    backend.on_resume(3)  # it wrote nothing and left the old steps 3..5 for the resumed ones to follow
    backend.write(StepRecord(step=3, scalars={"v": 103.0}))
    backend.close()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["metrics"]["v"]) for r in rows if "step" in r] == [(0, 0.0), (1, 1.0), (2, 2.0),
                                                                             (3, 103.0)]
    assert [r["system_step"] for r in rows if "system_step" in r] == list(range(6))  # every sample kept
    assert "cut it in place" in caplog.text


_FAILED_BLOCK = """
import os, signal, sys
import instrument
from instrument.backends.jsonl import JsonlBackend
inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=sys.argv[1], log_interval=10)
for step in range(11):
    try:
        with inst.step(step):
            inst.log({"v": float(step)})
            if step == 10:
                inst.state_dict()  # counts step 10 as written, should the process be stopped now
                raise RuntimeError("the block fails after its checkpoint")
    except RuntimeError:
        pass
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_checkpointed_step_whose_block_raised_is_not_written_by_a_later_sigterm(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", _FAILED_BLOCK, str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == -signal.SIGTERM, child.stderr
    # step 10 failed, so it is not written; steps 1..9 were never logged under 10 (it wrote their mean there)
    assert 10 not in [step for step, _ in _steps(tmp_path / "r" / "metrics.jsonl")]


_RETRIED_ITERATION = """
import os, signal, sys
import numpy as np
import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.rl import CollectionMetrics, RLLogging
inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=sys.argv[1], log_interval=1)
rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
for attempt in range(3):
    try:
        with rl.iteration():  # no inst.step block: each iteration commits at its end, at its index
            rl.observe_batch(reward=np.full((2, 4), float(attempt)), done=np.zeros((2, 4), bool))
            inst.logger.log_metrics({"v": float(attempt)}, rl.step)
            if attempt == 1:
                rl.state_dict()  # counts step 1 as committed: this iteration commits it at its end...
                raise RuntimeError("...but it fails first")
            if attempt == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # inside the retry of iteration 1, before its commit
    except RuntimeError:
        pass
"""


def test_a_checkpoint_counting_an_rl_iterations_commit_is_kept_by_its_retry_when_a_sigterm_stops_it(tmp_path):
    """An iteration with no `inst.step` block that raises does not use its step up: the next one retries it.
    The checkpoint saved in the failed one counted that step, so a signal during the retry writes it with what
    was staged for it, and the run resumed from that checkpoint (after step 1) leaves no gap."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", _RETRIED_ITERATION, str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == -signal.SIGTERM, child.stderr
    # what the failed attempt staged goes with the next logged iteration (RLLogging.iteration): mean of 1 and 2
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [(0, 0.0), (1, 1.5)]


def test_ctrl_c_while_close_undoes_the_hooks_still_closes_the_logger_and_releases_the_run(tmp_path, monkeypatch):
    inst = instrument.Instrumentation(observers=[instrument.IterationStats()], backends=[JsonlBackend()],
                                      run_name="r", log_dir=str(tmp_path), log_interval=1)
    inst.watch(torch.nn.Identity())
    with inst.step(0):
        inst.log({"v": 1.0})
    real = hooks.StateWatch.detach

    def interrupted(self, *args, **kwargs):  # Ctrl-C landing while close() undoes the hooks
        monkeypatch.setattr(hooks.StateWatch, "detach", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(hooks.StateWatch, "detach", interrupted)
    with pytest.raises(KeyboardInterrupt):
        inst.close()
    assert not (tmp_path / "r" / ".instrument-lock").exists()
    with pytest.raises(ConfigurationError, match="closed"):
        inst.logger.log_metrics({"v": 2.0}, step=1)  # the logger was closed all the same
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [(0, 1.0)]
    instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), resume=True).close()


@pytest.mark.parametrize("last", ["5", 2.5, -3, True, float("nan")])
def test_a_last_step_that_is_not_a_step_is_refused_before_anything_changes(tmp_path, last):
    logger = instrument.Logger([JsonlBackend()], RunInfo("r", tmp_path))
    with pytest.raises(ConfigurationError, match=r"last_step must be None or an int >= 0.*got"):
        logger.resume_after(last)
    assert logger.last_step is None
    logger.log_metrics({"v": 1.0}, step=0)
    logger.close()


def test_a_resumed_tensorboard_file_sorts_after_the_crashed_processes_file(tmp_path):
    """TensorBoard reads a run's event files in name order: a resumed file named in the crashed process's second,
    with a pid that sorts lower, was read first, its purge marker hid nothing, and every re-run step showed twice
    (a review found it). The earlier file here is named one second ahead, with a pid that sorts after any."""
    import shutil
    import socket

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from instrument.backends.tensorboard import TensorBoardBackend

    scratch = tmp_path / "scratch"
    earlier = SummaryWriter(log_dir=str(scratch))
    for step in range(11):
        earlier.add_scalar("v", float(step), step)
    earlier.close()
    (made,) = scratch.glob("events.out.tfevents.*")
    run = tmp_path / "r"
    run.mkdir()
    name = f"events.out.tfevents.{int(time.time()) + 1:010d}.{socket.gethostname()}.{'9' * 12}.0"
    shutil.move(str(made), str(run / name))
    logger = instrument.Logger([TensorBoardBackend()], instrument.RunInfo("r", tmp_path))
    logger.resume_after(5)
    for step in range(6, 11):
        logger.log_metrics({"v": 100.0 + step}, step=step, commit=True)
    logger.close()
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("v")] == [(s, float(s)) for s in range(6)] + [
        (s, 100.0 + s) for s in range(6, 11)]  # each step once, the re-run ones with their new values


def _interrupted_run(tmp_path, last: int = 8, saved_at: int = 6):
    """A run that committed steps 0..``last`` (every step logs) and saved its state at ``saved_at``."""
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), log_interval=1)
    for step in range(last + 1):
        with inst.step(step):
            inst.log({"v": float(step)})
        if step == saved_at:
            state = inst.state_dict()
    inst.close()
    return state


def test_a_resumed_session_that_committed_a_step_before_loading_is_refused_whatever_the_checkpoints_step(tmp_path):
    """A review found a resumed session that logged step 0 (an evaluation first, say) and then loaded a later
    checkpoint accepted: its step 0 stayed in the run's files beside the interrupted run's, out of order ([0, ..,
    6, 0, 7, ..]). Only a checkpoint older than the committed step was refused."""
    state = _interrupted_run(tmp_path)
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), log_interval=1,
                                      resume=True)
    with inst.step(0):
        inst.log({"v": 100.0})
    with pytest.raises(ConfigurationError, match=r"after this Instrumentation committed step 0 in the run it "
                                                 r"continues.*resuming at the checkpoint's step 6 keeps both"):
        inst.load_state_dict(state)
    inst.close()
    assert [step for step, _ in _steps(tmp_path / "r" / "metrics.jsonl")] == [*range(9), 0]  # nothing was cut


def test_loading_a_checkpoint_with_values_staged_is_refused_and_keeps_them(tmp_path):
    """Values staged and not committed when the checkpoint was loaded went into the first step after it,
    averaged into its means (a review read 31.0 at step 9 for a run that logged 8.0 there)."""
    state = _interrupted_run(tmp_path)
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), log_interval=1,
                                      resume=True)
    inst.logger.log_metrics({"v": 100.0}, step=0)
    with pytest.raises(ConfigurationError, match=r"called with values staged for step 0 and not yet committed: the "
                                                 r"first commit after resuming at the checkpoint's step 6"):
        inst.load_state_dict(state)
    assert inst.logger.has_pending  # nothing changed: still staged, and the run was not cut
    inst.logger.commit()
    inst.close()
    assert _steps(tmp_path / "r" / "metrics.jsonl")[-1] == (0, 100.0)
    assert [step for step, _ in _steps(tmp_path / "r" / "metrics.jsonl")] == [*range(9), 0]
