"""Resume: a run killed between checkpoints continues in the same folder and the same backend runs, with no
duplicate and no missing step, read back from the files a user would open."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.errors import ConfigurationError
from tests.wandb_reader import read_history

ROOT = Path(__file__).resolve().parents[1]

_TRAIN = """
import json, os, sys, time
import instrument
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.backends.wandb import WandbBackend
from tests.wandb_reader import read_history

log_dir, phase = sys.argv[1], sys.argv[2]
resume = phase == "resume"
wandb_backend = WandbBackend()
inst = instrument.Instrumentation(
    backends=[TensorBoardBackend(), JsonlBackend(), MlflowBackend(), wandb_backend], run_name="r",
    log_dir=log_dir, log_interval=10, resume=resume)
ckpt = os.path.join(log_dir, "ckpt.json")
start = 0
if resume:
    state = json.load(open(ckpt))
    inst.load_state_dict(state["inst"])
    start = state["step"] + 1
for step in range(start, 60 if resume else 36):
    with inst.step(step) as s:
        if s.active:
            inst.logger.log_metrics({"v": step + (1000 if resume else 0)}, step)
    if step == 20 and not resume:
        json.dump({"inst": inst.state_dict(), "step": step}, open(ckpt, "w"))
if not resume:
    inst.flush()
    # W&B's service writes its file every flush_secs: wait until step 30 is on disk, as in a longer run
    deadline = time.monotonic() + 120
    while True:
        try:
            if any(row.get("_step") == 30 for row in read_history(wandb_backend.run.settings.sync_file)):
                break
        except Exception:  # a record the service is still writing
            pass
        if time.monotonic() > deadline:
            os._exit(4)
        time.sleep(0.2)
    os._exit(3)  # a crash between checkpoints: steps 30 (and 21..35) were run after the checkpoint at 20
inst.close()
"""


def _run(log_dir: Path, phase: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own W&B service, not ours
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="offline", WANDB_SILENT="true")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_TRAIN), str(log_dir), phase], env=env,
                          capture_output=True, text=True, timeout=300, cwd=log_dir.parent)


def test_a_crashed_run_resumes_with_no_duplicate_and_no_missing_step(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "logs"
    logs.mkdir()
    first = _run(logs, "first")
    assert first.returncode == 3, first.stderr
    ids = json.loads((logs / "r" / "run.json").read_text())["backends"]
    assert set(ids) == {"MlflowBackend", "WandbBackend"}
    second = _run(logs, "resume")
    assert second.returncode == 0, second.stderr
    assert json.loads((logs / "r" / "run.json").read_text())["backends"] == ids  # the same runs continued

    resumed = [(0, 0.0), (10, 10.0), (20, 20.0), (30, 1030.0), (40, 1040.0), (50, 1050.0)]
    # TensorBoard: the same directory; steps after the checkpoint are overwritten (purged, then written again)
    acc = EventAccumulator(str(logs / "r"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("v")] == resumed
    # ... also as `tensorboard --logdir` serves it (the plugin accumulator purges from a run's second START
    # on only: with one marker, the re-run steps 30 were shown twice there)
    assert _served_scalars(logs, "r", "v") == resumed
    # JSONL: the file is cut at the first step after the checkpoint, then appended
    lines = [json.loads(x) for x in (logs / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["metrics"]["v"]) for x in lines if "step" in x] == resumed
    # MLflow: the same run; steps it already held are not written again
    client = MlflowClient(tracking_uri=f"sqlite:///{logs / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    assert run.info.run_id == ids["MlflowBackend"] and run.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "v"))
    assert history == [(0, 0.0), (10, 10.0), (20, 20.0), (30, 30.0), (40, 1040.0), (50, 1050.0)]
    # W&B (offline): the resumed process logs to the same run id in a second folder, and does not write again
    # the steps the first folder holds (read back from both files)
    run_id = ids["WandbBackend"]
    offline = sorted((logs / "r" / "wandb").glob("offline-run-*"))  # named by start time: in order
    assert len(offline) == 2 and all(folder.name.endswith(run_id) for folder in offline)
    crashed = read_history(offline[0] / f"run-{run_id}.wandb")
    continued = read_history(offline[1] / f"run-{run_id}.wandb", timeout=60.0)
    assert [(row["_step"], row["v"]) for row in crashed] == resumed[:3] + [(30, 30.0)]
    assert [(row["_step"], row["v"]) for row in continued] == [(40, 1040.0), (50, 1050.0)]
    steps = [row["_step"] for row in crashed + continued]
    assert sorted(steps) == sorted(set(steps)) == [0, 10, 20, 30, 40, 50]  # every step exactly once


def _served_scalars(logdir: Path, run: str, tag: str):
    """``(step, value)`` of a scalar as TensorBoard's server reads it (event multiplexer + data provider)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

    multiplexer = plugin_event_multiplexer.EventMultiplexer(size_guidance={"tensors": 0, "scalars": 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    scalars = provider.read_scalars(context.RequestContext(), experiment_id="", plugin_name="scalars",
                                    downsample=10_000)
    return [(point.step, point.value) for point in scalars[run][tag]]


def test_resume_needs_an_existing_run_and_a_name(tmp_path):
    with pytest.raises(ConfigurationError, match="no run 'nope'"):
        instrument.Instrumentation(backends=[], run_name="nope", log_dir=str(tmp_path), resume=True)
    with pytest.raises(ConfigurationError, match="needs the run_name"):
        instrument.Instrumentation(backends=[], log_dir=str(tmp_path), resume=True)


def test_load_state_dict_refuses_what_state_dict_did_not_write(tmp_path):
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="s", log_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="Instrumentation.state_dict"):
        inst.load_state_dict({"step": 3})
    inst.close()


def test_state_dict_keeps_the_last_committed_step(tmp_path):
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="s", log_dir=str(tmp_path))
    for step in range(12):
        with inst.step(step):
            inst.logger.log_metrics({"x": 1.0}, step)
    state = inst.state_dict()
    inst.close()
    assert state["last_step"] == 10 and state["run_name"] == "s"
    again = instrument.Instrumentation(backends=[JsonlBackend()], run_name="s", log_dir=str(tmp_path), resume=True)
    again.load_state_dict(state)
    with pytest.raises(instrument.StepOrderError):
        again.logger.log_metrics({"x": 1.0}, 9)  # before the checkpoint: already written
    with again.step(20):
        again.logger.log_metrics({"x": 2.0}, 20)
    again.close()
    steps = [json.loads(x).get("step") for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 10, 20]


def test_rl_logging_state_carries_the_session_state(tmp_path):
    from instrument.rl import RLLogging

    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="rl", log_dir=str(tmp_path))
    rl = RLLogging(progress=None).attach(inst)
    for step in range(3):
        with inst.step(step * 10):
            inst.logger.log_metrics({"x": 1.0}, step * 10)
    state = rl.state_dict()
    rl.close()
    inst.close()
    assert state["session"]["last_step"] == 20
    again = instrument.Instrumentation(backends=[JsonlBackend()], run_name="rl", log_dir=str(tmp_path), resume=True)
    rl2 = RLLogging(progress=None)
    rl2.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint round trip; the session comes later
    rl2.attach(again)
    assert again.state_dict()["last_step"] == 20
    rl2.close()
    again.close()


def test_a_run_file_with_a_null_id_or_a_run_path_that_is_a_file_is_named_plainly(tmp_path):
    """A review found a null id resumed as the string 'None' (then 'Run with id=None not found'), and a run
    path that is a file reported as missing."""
    import json as _json

    from instrument.session.run_folder import resume_ids

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text(_json.dumps({"backends": {"MlflowBackend": None}}))
    with pytest.raises(instrument.ConfigurationError, match=r"run.json is not a run file written by instrument"):
        resume_ids(tmp_path / "r")
    (tmp_path / "f").write_text("x")
    with pytest.raises(instrument.ConfigurationError, match=r"is a file, not a run folder"):
        resume_ids(tmp_path / "f")


def test_a_checkpoint_saved_inside_a_logging_steps_block_keeps_that_step(tmp_path):
    """The step commits when its block exits, so state_dict() inside it said the step before: resuming at the
    next step cut the saved step out of JSONL (and TensorBoard) and nothing wrote it again."""

    def run(resume, state=None):
        inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path),
                                          log_interval=10, resume=resume)
        start = 0
        if resume:
            inst.load_state_dict(state["inst"])
            start = state["step"] + 1
        for step in range(start, 40 if resume else 26):
            with inst.step(step) as s:
                if s.active:
                    inst.log({"v": float(step)})
                if step == 20 and not resume:  # a checkpoint at the end of step 20's body
                    state = {"inst": inst.state_dict(), "step": step}
        inst.close("killed" if not resume else None)
        return state

    state = run(False)
    assert state["inst"]["last_step"] == 20
    run(True, state)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["metrics"]["v"]) for r in rows if "metrics" in r] == [(0, 0.0), (10, 10.0), (20, 20.0),
                                                                               (30, 30.0)]


def test_a_running_heatmap_colour_range_goes_on_after_a_resume(tmp_path):
    """color_range="running" is the range of every heatmap of its tag so far: the checkpoint keeps it, so the
    same matrix is drawn alike before and after a resume (it started again, drawing [[4, 5]] at full contrast).
    A checkpoint saved before the ranges were kept still loads (they start again); a bad one is refused."""
    import io

    import numpy as np
    from PIL import Image

    from instrument.backends.tensorboard import TensorBoardBackend
    from tests.conftest import event_accumulator

    wide, narrow = np.array([[0.0, 10.0]]), np.array([[4.0, 5.0]])

    def session(resume):
        return instrument.Instrumentation(backends=[TensorBoardBackend()], run_name="s", log_dir=str(tmp_path),
                                          resume=resume)

    inst = session(False)
    for step, matrix in ((0, wide), (10, narrow)):
        with inst.step(step):
            inst.logger.log_heatmap("h", matrix, step, color_range="running")
    state = json.loads(json.dumps(inst.state_dict()))  # a checkpoint round trip
    inst.close()
    assert state["heatmap_ranges"] == {"h": [0.0, 10.0]}
    again = session(True)
    again.load_state_dict(state)
    with again.step(20):
        again.logger.log_heatmap("h", narrow, 20, color_range="running")
    again.close()
    images = {e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
              for e in event_accumulator(tmp_path / "s").Images("h")}
    np.testing.assert_array_equal(images[20], images[10])

    old = {key: value for key, value in state.items() if key != "heatmap_ranges"}
    for bad in ({"h": [1.0, 0.0]}, {"h": [0.0, float("inf")]}, [0.0, 1.0], {"h": "01"}):
        late = session(True)
        with pytest.raises(ConfigurationError, match="'heatmap_ranges'"):
            late.load_state_dict({**state, "heatmap_ranges": bad})
        late.load_state_dict(old)  # refused before anything changed; a checkpoint without them loads
        assert late.logger._ranges == {}
        late.close()
    # A review found a second load of a state without them (an earlier checkpoint of an older instrument, which a
    # second load may take) keeping the first load's ranges, taken from steps after the second one's.
    twice = session(True)
    twice.load_state_dict(state)
    assert twice.logger._ranges == {"h": (0.0, 10.0)}
    twice.load_state_dict({**old, "last_step": 0})
    assert twice.logger._ranges == {}
    twice.close()
