"""Resume faults a review found: a run resumed while another process still writes it, a checkpoint saved inside
a logging step and then SIGTERM, system samples hidden or removed by the resume, hyperparameters never logged
again, another run's checkpoint, and a user's own SummaryWriter closed by the resume. Each is read back from
the files a user would open."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import instrument
from instrument.backends.base import StepRecord
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.errors import ConfigurationError
from tests.conftest import read_scalars

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
    with pytest.raises(ConfigurationError,
                       match=r"this process .* was not closed, or its close\(timeout=...\) gave up.* Close it"):
        _run(tmp_path, resume=True, backends=[JsonlBackend()])
    first.close()
    for _ in range(3):  # sequential sessions in one folder: each close lets the next resume
        _run(tmp_path, resume=True, backends=[JsonlBackend()]).close()


_FORKED = """
import json, multiprocessing, os, sys
import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.errors import ConfigurationError

def child(inherited, out):
    inherited.close()  # the parent's session, inherited: closing it here must not release the parent's run
    try:
        instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=sys.argv[1], resume=True)
        out.put("resumed")
    except ConfigurationError as exc:
        out.put(str(exc))

inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=sys.argv[1])
ctx = multiprocessing.get_context("fork")
out = ctx.Queue()
proc = ctx.Process(target=child, args=(inst, out))
proc.start()
said = out.get(timeout=60)
proc.join(60)
print(json.dumps({"pid": os.getpid(), "child": said}), flush=True)
sys.stdin.readline()  # held until the test has tried to resume the run from another process
inst.close()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_neither_takes_nor_releases_its_parents_run(tmp_path):
    """Forked in a process of its own: a multi-threaded pytest process is no place to fork."""
    parent = subprocess.Popen([sys.executable, "-c", _FORKED, str(tmp_path)], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        said = json.loads(parent.stdout.readline())
        pid = said["pid"]
        assert f"another process (pid {pid}) is writing run 'r'" in said["child"]
        assert (tmp_path / "r" / ".instrument-lock").read_text() == f"{pid}\n"  # the child's close left it
        with pytest.raises(ConfigurationError, match=rf"another process \(pid {pid}\)"):
            _run(tmp_path, resume=True, backends=[JsonlBackend()])
    finally:
        parent.communicate("\n", timeout=120)
    assert parent.returncode == 0
    _run(tmp_path, resume=True, backends=[JsonlBackend()]).close()  # closed: free again


# ---------------------------------------------------------------- a checkpoint inside a step, then SIGTERM

_CKPT = """
import json, os, signal, sys
import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
d, resume = sys.argv[1], sys.argv[2] == "1"
inst = instrument.Instrumentation(backends=[JsonlBackend(), TensorBoardBackend()], run_name="r", log_dir=d,
                                  log_interval=10, resume=resume)
start = 0
if resume:
    ck = json.load(open(os.path.join(d, "ckpt.json")))
    inst.load_state_dict(ck["inst"])
    start = ck["step"] + 1
for step in range(start, 40):
    with inst.step(step):
        inst.log({"v": float(step)})
        if step == 20 and not resume:  # the checkpoint inside the logging step, as docs/backends.md suggests
            json.dump({"inst": inst.state_dict(), "step": step}, open(os.path.join(d, "ckpt.json"), "w"))
            os.kill(os.getpid(), signal.SIGTERM)  # preempted before the block exits
inst.close()
"""


def test_a_checkpoint_saved_inside_a_logging_step_keeps_that_step_when_sigterm_comes_before_the_block_ends(
        tmp_path):
    """The SIGTERM close did not commit the open step: step 20, which the checkpoint counts as written, was in
    no backend, and the resumed run (from step 21) never wrote it."""
    first = subprocess.run([sys.executable, "-c", _CKPT, str(tmp_path), "0"], env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == -signal.SIGTERM, first.stderr
    assert json.loads((tmp_path / "ckpt.json").read_text())["inst"]["last_step"] == 20
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [(0, 0.0), (10, 5.5), (20, 15.5)]  # the mean of 11..20
    second = subprocess.run([sys.executable, "-c", _CKPT, str(tmp_path), "1"], env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    expected = [(0, 0.0), (10, 5.5), (20, 15.5), (30, 25.5), (39, 35.0)]
    assert _steps(tmp_path / "r" / "metrics.jsonl") == expected
    assert sorted(read_scalars(tmp_path / "r")["v"].items()) == expected


# ---------------------------------------------------------------- system samples across a resume

def test_a_resume_keeps_the_system_samples_the_earlier_process_took(tmp_path):
    """TensorBoard's purge marker hid every system sample whose whole second was past the checkpoint's step
    (they share the run directory), and JSONL's cut removed the system lines written after the checkpoint."""
    inst = _run(tmp_path)
    for step in range(10):
        with inst.step(step):
            inst.log({"v": float(step)})
        inst.logger.write_system(StepRecord(step=step * 3, scalars={"system/seconds": step * 3.0}, wall_time=step))
        if step == 2:
            state = inst.state_dict()
    inst.close("killed")
    inst = _run(tmp_path, resume=True)
    inst.load_state_dict(state)
    for step in range(3, 5):
        with inst.step(step):
            inst.log({"v": 100.0 + step})
    inst.close()
    run = tmp_path / "r"
    resumed = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    assert sorted(read_scalars(run)["v"].items()) == resumed
    shown = [step for folder in (run, run / "system") if folder.is_dir()  # wherever TensorBoard shows them
             for step in read_scalars(folder).get("system/seconds", {})]
    assert sorted(shown) == [s * 3 for s in range(10)]
    assert "system/seconds" not in read_scalars(run)  # a run of their own, which no training purge reaches
    assert _steps(run / "metrics.jsonl") == resumed
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["system_step"] for r in rows if "system_step" in r] == [s * 3 for s in range(10)]
    assert not (run / "metrics.jsonl.resume.tmp").exists()


def test_a_jsonl_rewrite_left_by_a_crash_is_ignored(tmp_path):
    """A resume killed while rewriting left its temporary file: the file itself was never touched, and the
    next resume starts over."""
    backend = JsonlBackend()
    backend.open(instrument.backends.base.RunInfo("r", tmp_path))
    for step in range(4):
        backend.write(StepRecord(step=step, scalars={"v": float(step)}))
        backend.write_system(StepRecord(step=step, scalars={"system/x": 1.0}))
    backend.close()
    path = tmp_path / "r" / "metrics.jsonl"
    (tmp_path / "r" / "metrics.jsonl.resume.tmp").write_bytes(path.read_bytes()[:50])  # torn, half written
    backend = JsonlBackend()
    backend.open(instrument.backends.base.RunInfo("r", tmp_path))
    backend.on_resume(2)
    backend.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("step", r.get("system_step")) for r in rows] == [0, 0, 1, 1, 2, 3]
    assert not (tmp_path / "r" / "metrics.jsonl.resume.tmp").exists()


# ---------------------------------------------------------------- hyperparameters and the checkpoint's run

def test_a_resumed_run_logs_its_hyperparameters_again(tmp_path):
    """load_state_dict restored config_logged=True: a changed lr was recorded nowhere."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from instrument.backends.mlflow import MlflowBackend

    inst = _run(tmp_path, backends=[JsonlBackend(), MlflowBackend()], hyperparams={"lr": 0.1, "batch": 32})
    for step in range(3):
        with inst.step(step):
            inst.log({"v": float(step)})
    state = inst.state_dict()
    inst.close()
    inst = _run(tmp_path, resume=True, backends=[JsonlBackend(), MlflowBackend()],
                hyperparams={"lr": 0.05, "batch": 32})
    inst.load_state_dict(state)
    with inst.step(3):
        inst.log({"v": 3.0})
    inst.close()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["hyperparameters"] for r in rows if "hyperparameters" in r] == [{"lr": 0.1, "batch": 32},
                                                                              {"lr": 0.05, "batch": 32}]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    assert run.data.params == {"lr": "0.1", "batch": "32"}  # MLflow cannot change a param ...
    assert run.data.tags["instrument.param/lr"] == "0.05"  # ... the changed value is the run's tag


def test_load_state_dict_refuses_another_runs_checkpoint_before_changing_anything(tmp_path):
    states = {}
    for name in ("a", "b"):
        inst = instrument.Instrumentation(backends=[JsonlBackend(), TensorBoardBackend()], run_name=name,
                                          log_dir=str(tmp_path), log_interval=1)
        for step in range(5):
            with inst.step(step):
                inst.log({"v": float(step)})
            if step == 2:
                states[name] = inst.state_dict()
        inst.close()
    inst = instrument.Instrumentation(backends=[JsonlBackend(), TensorBoardBackend()], run_name="b",
                                      log_dir=str(tmp_path), log_interval=1, resume=True)
    with pytest.raises(ConfigurationError, match=r"checkpoint of run 'a', but this Instrumentation continues run "
                                                 r"'b'.*run_name='a'"):
        inst.load_state_dict(states["a"])
    inst.close()
    branch = instrument.Instrumentation(backends=[JsonlBackend()], run_name="c", log_dir=str(tmp_path))
    branch.load_state_dict(states["a"])  # a new run may start from another run's checkpoint: nothing to cut
    branch.close()
    whole = [(s, float(s)) for s in range(5)]
    assert _steps(tmp_path / "b" / "metrics.jsonl") == whole
    assert sorted(read_scalars(tmp_path / "b")["v"].items()) == whole


# ---------------------------------------------------------------- the user's own SummaryWriter

def test_a_resume_writes_its_purge_marker_through_the_users_writer_and_leaves_it_open(tmp_path):
    """on_resume closed the user's SummaryWriter and wrote into one of its own from then on."""
    from torch.utils.tensorboard import SummaryWriter

    from tests.test_resume import _served_scalars

    writer = SummaryWriter(str(tmp_path / "mine" / "r"))
    inst = _run(tmp_path, backends=[TensorBoardBackend(writer=writer)])
    for step in range(6):
        with inst.step(step):
            inst.log({"v": float(step)})
    inst.close()
    inst = _run(tmp_path, resume=True, backends=[TensorBoardBackend(writer=writer)])
    file_writer = writer.file_writer
    inst.load_state_dict({"version": 1, "run_name": "r", "last_step": 2})
    for step in range(3, 5):
        with inst.step(step):
            inst.log({"v": 100.0 + step})
    inst.close()
    assert writer.file_writer is file_writer
    writer.add_scalar("mine", 1.0, 7)  # still the user's, still open
    writer.close()
    resumed = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    scalars = read_scalars(tmp_path / "mine" / "r")
    assert sorted(scalars["v"].items()) == resumed and scalars["mine"] == {7: 1.0}
    assert _served_scalars(tmp_path / "mine", "r", "v") == resumed  # as `tensorboard --logdir` shows it
