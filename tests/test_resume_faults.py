"""Resume faults a review found: a run resumed while another process still writes it. Read back from the
files a user would open."""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _steps(path: Path, key: str = "v"):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [(r["step"], r["metrics"][key]) for r in rows if "step" in r and key in r["metrics"]]


def _run(log_dir, resume=False, **kwargs):
    return instrument.Instrumentation(backends=kwargs.pop("backends", None) or [JsonlBackend(), TensorBoardBackend()],
                                      run_name="r", log_dir=str(log_dir), log_interval=1, resume=resume, **kwargs)


# ---------------------------------------------------------------- one writer per run folder

_HOLDER = """
import sys, time
import instrument
from instrument.backends.jsonl import JsonlBackend
inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=sys.argv[1], log_interval=1,
                                  resume=sys.argv[2] == "1")
with inst.step(0 if sys.argv[2] == "0" else 5):
    inst.log({"v": 1.0})
inst.flush()
print("ready", flush=True)
time.sleep(600)
"""


def _holder(log_dir: Path, resume: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(log_dir), "1" if resume else "0"], env=_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_run_another_live_process_writes_is_refused_and_a_crashed_one_resumes(tmp_path):
    """resume=True on a folder another live process still wrote was accepted: its JSONL was cut under the live
    writer and both processes' steps interleaved in one file."""
    holder = _holder(tmp_path, resume=False)
    try:
        before = (tmp_path / "r" / "metrics.jsonl").read_bytes()
        with pytest.raises(ConfigurationError, match=rf"another process \(pid {holder.pid}\) is writing run 'r'"):
            _run(tmp_path, resume=True, backends=[JsonlBackend()])
        assert (tmp_path / "r" / "metrics.jsonl").read_bytes() == before  # untouched
    finally:
        holder.kill()  # a crash: the lock goes with the process
        holder.wait()
        holder.stdout.close()
    inst = _run(tmp_path, resume=True, backends=[JsonlBackend()])
    inst.load_state_dict({"version": 1, "run_name": "r", "last_step": 0})
    with inst.step(1):
        inst.log({"v": 2.0})
    inst.close()
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [(0, 1.0), (1, 2.0)]
    assert not (tmp_path / "r" / ".instrument-lock").exists()  # released and removed at close


def test_a_session_in_this_process_holds_the_run_until_it_closes(tmp_path):
    first = _run(tmp_path, backends=[JsonlBackend()])
    with pytest.raises(ConfigurationError, match=r"this process .* was not closed\. Close it"):
        _run(tmp_path, resume=True, backends=[JsonlBackend()])
    first.close()
    for _ in range(3):  # sequential sessions in one folder: each close lets the next resume
        _run(tmp_path, resume=True, backends=[JsonlBackend()]).close()


def _child_resumes(log_dir: str, out, inherited) -> None:
    inherited.close()  # the parent's session, inherited: closing it here must not release the parent's run
    try:
        _run(log_dir, resume=True, backends=[JsonlBackend()])
        out.put("resumed")
    except ConfigurationError as exc:
        out.put(str(exc))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_neither_takes_nor_releases_its_parents_run(tmp_path):
    inst = _run(tmp_path, backends=[JsonlBackend()])
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_resumes, args=(str(tmp_path), out, inst))
    child.start()
    said = out.get(timeout=60)
    child.join(60)
    assert f"another process (pid {os.getpid()}) is writing run 'r'" in said
    assert (tmp_path / "r" / ".instrument-lock").read_text() == f"{os.getpid()}\n"
    probe = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path), "1"], env=_env(), capture_output=True,
                           text=True, timeout=120)  # the child's exit left the parent's lock in place
    assert probe.returncode != 0 and f"pid {os.getpid()}" in probe.stderr
    inst.close()
