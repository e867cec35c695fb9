"""Runs that do not collide: unique default names, refused reuse, no path outside log_dir; the lifecycle."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.errors import ConfigurationError
from instrument.session.run_folder import default_run_name
from tests.wandb_reader import exit_codes

ROOT = Path(__file__).resolve().parents[1]


def test_default_names_are_unique_within_one_second():
    names = {default_run_name() for _ in range(200)}
    assert len(names) == 200
    stamp, _, suffix = next(iter(names)).rpartition("-")
    assert len(stamp) == len("20260101-120000") and len(suffix) == 6


def test_two_sessions_started_at_once_get_two_folders(tmp_path):
    a = instrument.Instrumentation(backends=[JsonlBackend()], log_dir=str(tmp_path))
    b = instrument.Instrumentation(backends=[JsonlBackend()], log_dir=str(tmp_path))
    for inst in (a, b):
        with inst.step(0):
            inst.logger.log_metrics({"x": 1.0}, 0)
        inst.close()
    assert a.run.dir != b.run.dir
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.run.name, b.run.name])


@pytest.mark.parametrize("name", ["..", "../evil", "a/b", "a\\b", "/tmp/abs", "x..y", "", " "])
def test_run_names_that_could_leave_log_dir_are_refused(tmp_path, name):
    with pytest.raises(ConfigurationError, match="run_name"):
        instrument.Instrumentation(backends=[JsonlBackend()], run_name=name, log_dir=str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "evil").exists()



@pytest.mark.parametrize("name", ["a\nb", "tab\there", "esc\x1b[31m", "del\x7f", "cr\r"])
def test_run_names_with_control_characters_are_refused(tmp_path, name):
    # A newline in the folder name split the CLI's "logs:" line; an escape recolours the terminal.
    with pytest.raises(ConfigurationError, match=r"contains the control character .*printable characters only"):
        instrument.Instrumentation(backends=[JsonlBackend()], run_name=name, log_dir=str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


def test_a_control_character_in_run_name_bound_in_gin_is_a_configuration_error(tmp_path):
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "instrument", "run", "nca", "--bind", "train_nca.steps = 1",
                          "--bind", "Instrumentation.run_name = 'a\\nb'"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 2 and "contains the control character '\\n'" in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())

def test_an_existing_run_name_is_refused_unless_resuming(tmp_path):
    first = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path))
    with first.step(0):
        first.logger.log_metrics({"x": 1.0}, 0)
    first.close()
    with pytest.raises(ConfigurationError, match="already exists.*resume=True") as refused:
        instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path))
    assert "--bind 'Instrumentation.resume = True'" in str(refused.value)  # what a CLI user writes
    # an empty folder made beforehand is not a run
    (tmp_path / "empty").mkdir()
    instrument.Instrumentation(backends=[], run_name="empty", log_dir=str(tmp_path)).close()


def test_every_backend_writes_inside_the_run_folder(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from instrument.backends.mlflow import MlflowBackend
    from instrument.backends.wandb import WandbBackend

    outside = set(Path.cwd().rglob("*"))
    inst = instrument.Instrumentation(
        backends=[TensorBoardBackend(), JsonlBackend(), WandbBackend(), MlflowBackend()],
        run_name="inside", log_dir=str(tmp_path / "logs"), run_log=True,
    )
    with inst.step(0):
        inst.logger.log_metrics({"x": 1.0}, 0)
    inst.close()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(tmp_path / "logs") for p in written)
    run_files = {p.relative_to(tmp_path / "logs").parts[0] for p in written}
    # the MLflow store is per log_dir, with the lock its first use is made under
    assert run_files <= {"inside", "mlflow.db", ".mlflow.db.lock", "mlartifacts"}, run_files
    assert set(Path.cwd().rglob("*")) - outside <= set(tmp_path.rglob("*"))


def test_calls_after_close_raise_a_clear_error(tmp_path):
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="c", log_dir=str(tmp_path))
    with inst.step(0):
        inst.logger.log_metrics({"x": 1.0}, 0)
    inst.close()
    with pytest.raises(ConfigurationError, match="closed"):
        inst.step(10)
    with pytest.raises(ConfigurationError, match="closed"):
        inst.commit_step(10)
    with pytest.raises(ConfigurationError, match="after this logger was closed"):
        inst.logger.log_metrics({"x": 2.0}, 10)
    with pytest.raises(ConfigurationError, match="after this logger was closed"):
        inst.logger.log_text("t", "hello", 10)
    with pytest.raises(ConfigurationError, match="after this logger was closed"):
        inst.logger.commit(10)
    with pytest.raises(ConfigurationError, match="after this logger was closed"):
        inst.logger.log_hyperparams({"a": 1})
    lines = (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "step" in line] == [0]


_FAILING = """
import sys
import instrument
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.wandb import WandbBackend
inst = instrument.Instrumentation(backends=[MlflowBackend(), WandbBackend()], run_name="boom",
                                  log_dir=sys.argv[1], log_interval=1)
with inst.step(0):
    inst.logger.log_metrics({"x": 1.0}, 0)
raise RuntimeError("the experiment broke")
"""


def test_a_process_that_raises_is_failed_in_mlflow_and_wandb(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FAILING), str(logs)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 1 and "the experiment broke" in proc.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{logs / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics == {"x": 1.0}
    assert exit_codes(logs / "boom") == [1]


def test_cli_exits_non_zero_and_mlflow_says_failed_when_the_experiment_raises(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    (tmp_path / "boom.py").write_text(textwrap.dedent("""
        import gin

        @gin.configurable
        def boom(instrumentation):
            with instrumentation.step(0):
                instrumentation.logger.log_metrics({"x": 1.0}, 0)
            raise RuntimeError("the experiment broke")
    """))
    (tmp_path / "boom.gin").write_text(textwrap.dedent("""
        import boom
        run.experiment = @boom
        Instrumentation.log_dir = 'logs'
        Instrumentation.run_name = 'b'
        Instrumentation.backends = [@MlflowBackend()]
    """))
    proc = subprocess.run([sys.executable, "-m", "instrument", "run", "boom.gin"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode != 0 and "the experiment broke" in proc.stderr, proc.stdout + proc.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    assert run.info.status == "FAILED"


def _env():
    import os

    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own W&B service, not ours
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="offline", WANDB_SILENT="true")
    return env


class _Unopenable(instrument.Backend):
    """A real backend whose destination cannot be created: its folder is a plain file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = []

    def open(self, run) -> None:
        (self.path / "metrics.txt").open("a").close()

    def write(self, record) -> None:
        self.records.append(record)


def test_a_backend_that_cannot_open_is_an_error_at_start(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    good = JsonlBackend()
    with pytest.raises(ConfigurationError, match=r"could not open _Unopenable: NotADirectoryError.*"
                                                  r"on_backend_error='warn'"):
        instrument.Instrumentation(backends=[good, _Unopenable(blocker)], run_name="r", log_dir=str(tmp_path))
    assert good._fd is None  # the backend that did open was closed again


def test_on_backend_error_warn_runs_without_it(tmp_path, caplog):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    bad = _Unopenable(blocker)
    inst = instrument.Instrumentation(backends=[JsonlBackend(), bad], run_name="r", log_dir=str(tmp_path),
                                      on_backend_error="warn")
    with inst.step(0):
        inst.logger.log_metrics({"x": 1.0}, 0)
    inst.close()
    assert bad.records == [] and inst.failures == {"_Unopenable": 1}
    assert "_Unopenable" in caplog.text and "open()" in caplog.text
    assert json.loads((tmp_path / "r" / "metrics.jsonl").read_text())["metrics"] == {"x": 1.0}


def test_unreachable_mlflow_server_is_an_error_at_start_naming_the_fix(tmp_path):
    pytest.importorskip("mlflow")
    import socket

    from instrument.backends.mlflow import MlflowBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = MlflowBackend(tracking_uri=f"http://127.0.0.1:{port}", timeout=1, max_retries=0)
    with pytest.raises(ConfigurationError, match=r"MlflowBackend: .*127\.0\.0\.1.*fix: start the server"):
        instrument.Instrumentation(backends=[backend], run_name="m", log_dir=str(tmp_path))


@pytest.mark.parametrize("bad", [{"on_backend_error": "ignore"}, {"open_timeout": 0}])
def test_bad_open_options_are_refused(tmp_path, bad):
    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        instrument.Instrumentation(backends=[], log_dir=str(tmp_path), **bad)


def test_rl_demo_without_the_rl_extra_fails_at_start_naming_it(tmp_path, monkeypatch):
    from instrument.demos.cartpole import train_cartpole
    from instrument.errors import MissingExtraError
    from instrument.rl import Evaluation, RLLogging

    monkeypatch.setitem(sys.modules, "gymnasium", None)  # what Python does when a package is not installed
    inst = instrument.Instrumentation(backends=[], log_dir=str(tmp_path), log_interval=1)
    rl = RLLogging(evaluation=Evaluation(every_frames=1000), progress=None)
    with pytest.raises(MissingExtraError, match=r"torch-instrument\[rl\]"):
        train_cartpole(instrumentation=inst, steps=1, num_envs=2, max_steps=5, rl_logging=rl)
    inst.close()


_RACER = """
import os, sys, time
import instrument
from instrument.errors import ConfigurationError
while time.time() < float(sys.argv[2]):
    pass
try:
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], run_name="same", log_dir=sys.argv[1],
                                      log_interval=1)
except ConfigurationError as exc:
    print("refused", exc)
    sys.exit(0)
for step in range(3):
    with inst.step(step):
        inst.log({"pid": float(os.getpid())})
inst.close()
print("ran")
"""


def test_two_processes_started_at_once_with_one_run_name_never_share_its_folder(tmp_path):
    """A review found both starting and writing into one folder in 4 of 7 tries (a job array resubmitted):
    the folder was checked, then written, with nothing exclusive in between."""
    import time

    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    for attempt in range(3):
        runs = tmp_path / f"runs{attempt}"
        start = str(time.time() + 4.0)  # both past their imports, then released together
        procs = [subprocess.Popen([sys.executable, str(script), str(runs), start], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert sorted(out.split()[0] for out in outs) == ["ran", "refused"], outs
        lines = [json.loads(line) for line in (runs / "same" / "metrics.jsonl").read_text().splitlines()]
        pids = {line["metrics"]["pid"] for line in lines if "metrics" in line}
        assert len(pids) == 1
        assert not (runs / "same" / ".instrument-starting").exists()  # released once the start was done


def test_a_start_that_holds_the_folder_refuses_another_and_a_failed_start_releases_it(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".instrument-starting").write_text("1234\n")
    with pytest.raises(ConfigurationError, match=r"run 'r' is being started by another process .*delete it"):
        instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path))
    (tmp_path / "r" / ".instrument-starting").unlink()
    with pytest.raises(ConfigurationError):  # a start that fails (a bad option): the folder is left as it was
        instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path), on_full="x")
    assert list((tmp_path / "r").iterdir()) == []
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path))
    inst.close()
    assert ".instrument-starting" not in [p.name for p in (tmp_path / "r").iterdir()]


def test_a_run_kept_in_memory_leaves_no_empty_run_folder_and_can_still_be_resumed(tmp_path):
    """A run whose only backend is the in-memory history created ``<log_dir>/<timestamp>`` and left it empty,
    one more folder at every notebook cell run. A folder its start made and nothing wrote to is removed at
    close; one that holds anything (a backend's file) stays, and so does one that existed before."""
    def run(backends, **kwargs):
        inst = instrument.Instrumentation(backends=backends, log_interval=1, log_dir=str(tmp_path), **kwargs)
        with inst.step(0):
            inst.logger.log_metrics({"loss": 1.0}, step=0)
        inst.close()
        return inst

    for _ in range(2):
        run([instrument.RunHistoryBackend()])
    assert list(tmp_path.iterdir()) == []
    run([instrument.RunHistoryBackend()], run_name="mem")
    assert not (tmp_path / "mem").exists()
    resumed = run([instrument.RunHistoryBackend()], run_name="mem", resume=True)  # this process's run, as it was
    assert resumed.run.dir == tmp_path / "mem" and not (tmp_path / "mem").exists()
    run([instrument.RunHistoryBackend(), instrument.JsonlBackend()], run_name="file")
    assert [p.name for p in (tmp_path / "file").iterdir()] == ["metrics.jsonl"]
    (tmp_path / "made-before").mkdir()
    run([instrument.RunHistoryBackend()], run_name="made-before")
    assert (tmp_path / "made-before").is_dir()
