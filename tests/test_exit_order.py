"""At exit, instrument closes every open logger before the SDKs its backends opened are torn down.

atexit runs hooks last registered first. instrument registers its hook at the first Logger; an SDK registers its
own teardown when a backend first opens it (W&B stops its service process at exit). A Logger created after an
earlier one, or a backend added later, would be closed after its SDK was gone, losing every step still to be
written: an open that registers an exit hook moves instrument's hook behind it (`shutdown.keep_first_at_exit`);
hooks registered otherwise, such as a user's own, keep their order. Each test runs a real child process and reads
what its backends kept.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STEPS = 50


def run_child(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(source))
    env = {
        **os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline", "WANDB_SILENT": "true",
    }
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(STEPS), *args], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )


SDK_CHILD = """
    import atexit, os, sys
    from instrument.backends.base import Backend, RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger

    root, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class SdkLike(Backend):
        # Opens an "SDK" that registers its own teardown at exit, as W&B does; a write after it is lost.
        def __init__(self, label):
            self.label, self.alive, self.steps = label, False, []

        def open(self, run):
            self.alive = True
            atexit.register(self.teardown)

        def teardown(self):
            self.alive = False
            print("teardown", self.label, flush=True)

        def write(self, record):
            if self.alive:
                self.steps.append(record.step)

        def close(self):
            print("close", self.label, len(self.steps), "alive" if self.alive else "dead", flush=True)

    first = Logger([JsonlBackend(path=os.path.join(root, "first.jsonl"))])  # installs instrument's exit hook
    first.close()
    lg = Logger([SdkLike("b")], run=RunInfo(name="r", root=root))
    lg.add_backend(SdkLike("c"))
    lg.flush()  # c is open (its teardown registered) before anything below
    for s in range(steps):
        lg.log_metrics({"x": float(s)}, step=s)
        lg.commit()
    if mode == "open-during-exit":
        def late():  # registered after instrument's hook, so it runs first: a backend opens while atexit runs
            lg.add_backend(SdkLike("late"))
            lg.flush()
        atexit.register(late)
    print("done", flush=True)
"""


@pytest.mark.parametrize("mode", ["plain", "open-during-exit"])
def test_exit_closes_every_logger_before_the_sdk_teardowns_its_backends_registered_as_they_opened(tmp_path, mode):
    child = run_child(tmp_path, SDK_CHILD, mode)
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    closes = [line for line in lines if line.startswith("close")]
    # Each backend closed once, alive, with every committed step; its SDK torn down only after that.
    assert sorted(closes[:2]) == [f"close b {STEPS} alive", f"close c {STEPS} alive"], child.stdout
    assert lines.index("teardown b") > lines.index(f"close b {STEPS} alive")
    assert lines.index("teardown c") > lines.index(f"close c {STEPS} alive")
    if mode == "open-during-exit":  # the hook was not moved while atexit ran its list: it still ran, once
        assert closes[2:] == ["close late 0 alive"], child.stdout
    else:
        assert len(closes) == 2, child.stdout


WANDB_CHILD = """
    import os, sys
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.backends.wandb import WandbBackend
    from instrument.logger.logger import Logger

    root, steps, uri = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    first = Logger([JsonlBackend(path=os.path.join(root, "first.jsonl"))])  # installs instrument's hook before W&B's
    first.close()
    if sys.argv[4:] == ["user-init"]:  # the user starts W&B first: its exit hook exists before the backend opens
        import tempfile, wandb
        wandb.init(dir=tempfile.mkdtemp(), mode="offline").finish()
    backends = [WandbBackend(dir=root, mode="offline")]
    if uri:
        from instrument.backends.mlflow import MlflowBackend
        backends.append(MlflowBackend(tracking_uri=uri, run_name="exit"))
    lg = Logger(backends, run=RunInfo(name="r", root=root))
    for s in range(steps):
        lg.log_metrics({"x": float(s)}, step=s)
        lg.commit()
    # no close(): the exit closes the logger and keeps every committed step
"""


@pytest.mark.parametrize("user_init", [False, True])
def test_exit_keeps_every_committed_step_in_wandb_when_an_earlier_logger_installed_the_exit_hook(tmp_path, user_init):
    pytest.importorskip("wandb")
    from tests.wandb_reader import read_run

    child = run_child(tmp_path, WANDB_CHILD, "", *(["user-init"] if user_init else []))
    assert child.returncode == 0, child.stderr
    rows, _ = read_run(tmp_path, timeout=10)
    assert [(r["_step"], r["x"]) for r in rows if "x" in r] == [(s, float(s)) for s in range(STEPS)], child.stderr


def test_exit_keeps_every_committed_step_in_wandb_and_mlflow_and_ends_the_mlflow_run_finished(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from tests.wandb_reader import read_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    child = run_child(tmp_path, WANDB_CHILD, uri)
    assert child.returncode == 0, child.stderr
    rows, _ = read_run(tmp_path, timeout=10)
    assert [(r["_step"], r["x"]) for r in rows if "x" in r] == [(s, float(s)) for s in range(STEPS)], child.stderr
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert mlrun.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "x"))
    assert history == [(s, float(s)) for s in range(STEPS)]


USER_HOOK_CHILD = """
    import atexit, os, sys
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger

    root, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    lg = Logger([JsonlBackend()], RunInfo("r", root))

    def final():  # a user's own exit hook, registered after the Logger: it runs first, as atexit promises
        lg.log_metrics({"a": 999.0}, step=999)
        lg.commit()
        lg.close()

    atexit.register(final)
    if mode == "second-logger":
        Logger([JsonlBackend()], RunInfo("r2", root)).close()
    else:  # a backend added later, that registers no exit hook
        lg.add_backend(JsonlBackend(path=os.path.join(root, "extra.jsonl")))
        lg.flush()
"""


@pytest.mark.parametrize("mode", ["second-logger", "add-backend"])
def test_a_users_exit_hook_registered_after_the_logger_still_runs_before_it_closes(tmp_path, mode):
    done = run_child(tmp_path, USER_HOOK_CHILD, mode)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert any('"step": 999' in line for line in lines), done.stderr


SIGTERM_WHILE_AN_SDK_OPENS = """
    import atexit, os, signal, sys, time
    from instrument.backends.base import Backend, RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger import shutdown
    from instrument.logger.logger import Logger

    class SdkLike(Backend):
        def open(self, run):
            atexit.register(lambda: None)  # its teardown: instrument's hook is to move behind it

        def write(self, record):
            pass

    shutdown.TIMEOUT = 3.0
    root = sys.argv[1]
    lg = Logger([JsonlBackend()], RunInfo("r", root))
    lg.log_metrics({"a": 1.0}, step=1)
    lg.commit()
    lg.flush()
    with shutdown._lock:  # where the main thread is for a moment whenever a Logger is created or closed
        lg.add_backend(SdkLike())  # opens on the writer thread, which then moves the exit hook
        lg.log_metrics({"a": 2.0}, step=2)
        lg.commit()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two of these bytecodes
            pass
    print("survived", flush=True)
"""


def test_sigterm_while_the_main_thread_holds_the_registry_lock_and_an_sdk_opens_keeps_every_step(tmp_path):
    done = run_child(tmp_path, SIGTERM_WHILE_AN_SDK_OPENS)
    assert done.returncode == -15, done.stdout + done.stderr
    steps = [line for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert len(steps) == 2, steps
