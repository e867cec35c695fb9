"""A checkpoint is consistent with the files: `Instrumentation.state_dict` waits until every step committed
before it is written, so a process killed hard right after saving (SIGKILL, an OOM kill, ``os._exit``) keeps
every step the checkpoint counts, and resuming from it loses none (it never writes them again)."""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import instrument
from instrument.backends.base import Backend
from instrument.backends.jsonl import JsonlBackend
from instrument.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]

# A backend slower than the loop, so that the writer thread is behind when the checkpoint is taken.
_CHILD = """
import os, sys, time, json
import instrument
from instrument.backends.base import Backend
from instrument.backends.jsonl import JsonlBackend

class Slow(Backend):
    name = "slow"
    def open(self, run): pass
    def write(self, record): time.sleep(0.15)
    def close(self): pass

inst = instrument.Instrumentation(backends=[Slow(), JsonlBackend()], run_name="r", log_dir=sys.argv[1],
                                  log_interval=1)
inside = sys.argv[2] == "inside"
for step in range(8):
    with inst.step(step):
        inst.log({"v": float(step)})
        if inside and step == 7:
            state = inst.state_dict()  # inside the block: step 7 counts as committed
if not inside:
    state = inst.state_dict()
print(json.dumps(state), flush=True)
os._exit(0)  # killed hard: no close, no atexit
"""


def _steps(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row["step"] for row in rows if "step" in row]


@pytest.mark.parametrize("where", ["after", "inside"])
def test_a_process_killed_right_after_its_checkpoint_keeps_every_step_the_checkpoint_counts(tmp_path, where):
    """Saved after the last block, or inside it (its step counts as committed when the block exits, so the
    block's commit is flushed before the block returns)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), where], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["last_step"] == 7
    assert _steps(tmp_path / "r" / "metrics.jsonl") == list(range(8))


class _Stalled(Backend):
    """Blocks its writes until released: a remote backend that stopped answering."""

    name = "stalled"

    def __init__(self) -> None:
        import threading
        self.release = threading.Event()

    def open(self, run) -> None:
        pass

    def write(self, record) -> None:
        self.release.wait(30)

    def close(self) -> None:
        pass


def test_a_checkpoint_waits_only_as_long_as_flush_timeout_and_says_what_is_pending(tmp_path, caplog):
    stalled = _Stalled()
    inst = instrument.Instrumentation(backends=[stalled, JsonlBackend()], run_name="r", log_dir=str(tmp_path),
                                      log_interval=1)
    try:
        for step in range(3):
            with inst.step(step):
                inst.log({"v": 1.0})
        with caplog.at_level(logging.WARNING, logger="instrument"):
            start = time.monotonic()
            state = inst.state_dict(flush_timeout=0.2)
            waited = time.monotonic() - start
        assert state["last_step"] == 2
        assert waited >= 0.2
        assert "still pending" in caplog.text and "flush_timeout" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="instrument"):
            assert inst.state_dict(flush_timeout=0)["last_step"] == 2  # 0: no wait, nothing said
        assert "pending" not in caplog.text
        with pytest.raises(ConfigurationError, match="state_dict: flush_timeout must be a number of seconds >= 0"):
            inst.state_dict(flush_timeout=-1)
    finally:
        stalled.release.set()
        inst.close()
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [0, 1, 2]


def test_a_checkpoint_between_logging_steps_says_the_staged_interval_is_not_in_it(tmp_path, caplog):
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), log_interval=5)
    try:
        for step in range(7):
            with inst.step(step):
                inst.log({"loss": float(step)})
        with caplog.at_level(logging.WARNING, logger="instrument"):
            assert inst.state_dict()["last_step"] == 5
            inst.state_dict()
        said = [r.getMessage() for r in caplog.records if "values staged up to step 6" in r.getMessage()]
        assert len(said) == 1 and "Save checkpoints at logging steps" in said[0]
    finally:
        inst.close()


def test_load_state_dict_after_steps_were_committed_is_refused_before_anything_is_cut(tmp_path):
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), log_interval=5)
    try:
        for step in range(16):
            with inst.step(step):
                inst.log({"v": float(step)})
        with pytest.raises(ConfigurationError, match="after this Instrumentation committed step 15"):
            inst.load_state_dict({"version": 1, "run_name": "r", "last_step": 5, "config_logged": True})
        inst.flush()
        assert _steps(tmp_path / "r" / "metrics.jsonl") == [0, 5, 10, 15]
    finally:
        inst.close()


def test_watch_after_close_is_refused(tmp_path):
    inst = instrument.Instrumentation(backends=[], log_dir=str(tmp_path))
    inst.close()
    with pytest.raises(ConfigurationError, match="this Instrumentation is closed"):
        inst.watch(torch.nn.Linear(2, 2))


def test_a_logging_step_entered_again_after_its_block_committed_is_refused(tmp_path):
    from instrument.errors import StepOrderError

    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), log_interval=1)
    try:
        scope = inst.step(8)
        with scope:
            inst.log({"loss": 6.5})
        with pytest.raises(StepOrderError, match=r"inst.step\(8\) is entered again"):
            with scope:
                inst.log({"loss": 88.0})
        with pytest.raises(StepOrderError, match="already ran and committed logging step 8"):
            with inst.step(8):
                pass
        with inst.step(9):  # the next step goes on
            inst.log({"loss": 1.0})
        inst.flush()
        rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["metrics"]["loss"]) for r in rows if "step" in r] == [(8, 6.5), (9, 1.0)]
    finally:
        inst.close()


def test_a_stuck_backend_costs_a_checkpoint_one_bounded_wait_said_once(tmp_path, caplog):
    stalled = _Stalled()
    inst = instrument.Instrumentation(backends=[stalled, JsonlBackend()], run_name="r", log_dir=str(tmp_path),
                                      log_interval=1)
    try:
        with caplog.at_level(logging.DEBUG, logger="instrument"):
            for step in range(3):
                with inst.step(step):
                    inst.log({"v": 1.0})
                    if step >= 1:
                        inst.state_dict(flush_timeout=0.1)  # inside the block: its exit would wait again
        said = [r for r in caplog.records if "still pending" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]  # once, then DEBUG
        assert not [r for r in said if "the block a checkpoint was saved in" in r.getMessage()]
    finally:
        stalled.release.set()
        inst.close()
