"""What `Instrumentation.load_state_dict` accepts, found by a review: a second load of a later checkpoint in one
session (the first load had cut the steps after it: they went missing from JSONL, TensorBoard and the history),
a checkpoint of another run folder whose run has the same name (it cut that run's files), and a whole checkpoint
or a state with a wrong field (a 174,731-character message naming neither). Read back from the JSONL file,
TensorBoard's EventAccumulator, the in-memory history and MLflow's local store."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import instrument
from instrument.backends.history import RunHistoryBackend
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.errors import ConfigurationError
from tests.conftest import read_scalars


def _steps(run_dir: Path):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["metrics"]["v"]) for r in rows if "step" in r and "v" in r["metrics"]]


def _session(log_dir, backends, resume=False):
    return instrument.Instrumentation(backends=backends, run_name="r", log_dir=str(log_dir), log_interval=1,
                                      resume=resume)


def _train(inst, steps, base, keep=()):
    states = {}
    for step in steps:
        with inst.step(step):
            inst.log({"v": base + step})
        if step in keep:
            states[step] = inst.state_dict()
    return states


@pytest.mark.parametrize("order", [(10, 20), (20, 10)])
def test_a_second_load_of_a_later_checkpoint_is_refused_and_an_earlier_one_is_where_the_run_goes_on(tmp_path, order):
    """Loaded 10 then 20, the first load had cut 11..29 and the run went on at 21: 11..20 were missing from
    JSONL, TensorBoard and the history (MLflow kept them). Loaded 20 then 10 (nothing committed), the refusal
    said this session had committed step 20."""
    from mlflow.tracking import MlflowClient

    from instrument.backends.mlflow import MlflowBackend

    history = RunHistoryBackend()
    inst = _session(tmp_path, [JsonlBackend(), TensorBoardBackend(), MlflowBackend(), history])
    states = _train(inst, range(30), 1000.0, keep=(10, 20))
    inst.close("killed")
    inst = _session(tmp_path, [JsonlBackend(), TensorBoardBackend(), MlflowBackend(), history], resume=True)
    first, second = order
    inst.load_state_dict(states[first])
    if second > first:
        with pytest.raises(ConfigurationError, match=r"already resumed this run in this session at step 10\. .*"
                                                     r"would leave steps 11 to 20 missing .*next step is 11"):
            inst.load_state_dict(states[second])
    else:
        inst.load_state_dict(states[second])  # nothing committed in between: the run goes on from step 10
    with pytest.raises(instrument.StepOrderError):
        inst.logger.log_metrics({"v": 0.0}, 9)  # before the checkpoint it goes on from
    _train(inst, range(11, 25), 2000.0)
    inst.close()
    resumed = [(s, 1000.0 + s) for s in range(11)] + [(s, 2000.0 + s) for s in range(11, 25)]
    run_dir = tmp_path / "r"
    assert _steps(run_dir) == resumed
    assert sorted(read_scalars(run_dir)["v"].items()) == resumed
    assert list(zip(*history.series("v"), strict=True)) == resumed
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    held = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "v"))
    assert held == [(s, 1000.0 + s) for s in range(30)]  # MLflow cannot replace: the steps it held are skipped
    # the run's id is in run.json beside the backends' ids, and in every checkpoint
    saved = json.loads((run_dir / "run.json").read_text())
    assert saved["run_id"] == states[10]["run_id"] == states[20]["run_id"] and "MlflowBackend" in saved["backends"]


def test_a_checkpoint_of_another_folder_with_the_same_run_name_is_refused_and_a_copied_folder_resumes(tmp_path):
    """Experiments A and B both run "r" in their own log_dir: B resumed with A's step-5 checkpoint was accepted
    and B's steps 6..30 vanished from JSONL and TensorBoard."""
    a, b, copy = tmp_path / "a", tmp_path / "b", tmp_path / "copy"
    inst = _session(a, [JsonlBackend(), TensorBoardBackend()])
    state_a = _train(inst, range(6), 100.0, keep=(5,))[5]
    inst.close()
    inst = _session(b, [JsonlBackend(), TensorBoardBackend()])
    _train(inst, range(31), 200.0, keep=(30,))
    inst.close()
    inst = _session(b, [JsonlBackend(), TensorBoardBackend()], resume=True)
    with pytest.raises(ConfigurationError, match=r"a checkpoint of another run folder: run 'r' with run id "
                                                 rf"'{state_a['run_id']}'.*{b / 'r'}', whose run id is .*log_dir"):
        inst.load_state_dict(state_a)
    inst.close()
    whole_b = [(s, 200.0 + s) for s in range(31)]
    assert _steps(b / "r") == whole_b and sorted(read_scalars(b / "r")["v"].items()) == whole_b
    # A copy of A's folder keeps its run.json, so A's checkpoint resumes it; so does A's own folder.
    shutil.copytree(a / "r", copy / "r")
    for log_dir in (copy, a):
        inst = _session(log_dir, [JsonlBackend(), TensorBoardBackend()], resume=True)
        inst.load_state_dict(state_a)
        _train(inst, range(6, 8), 300.0)
        inst.close()
        assert _steps(log_dir / "r") == [(s, 100.0 + s) for s in range(6)] + [(6, 306.0), (7, 307.0)]
    # A folder whose run.json was lost: refused, with the way to load it anyway.
    (a / "r" / "run.json").unlink()
    inst = _session(a, [JsonlBackend()], resume=True)
    with pytest.raises(ConfigurationError, match=r"holds no run id .*\{\*\*state, 'run_id': None\}"):
        inst.load_state_dict(state_a)
    inst.load_state_dict({**state_a, "run_id": None})
    inst.close()
    # A checkpoint saved before run ids (no 'run_id') still loads, and a new run may branch off another's.
    old = {key: value for key, value in state_a.items() if key != "run_id"}
    for log_dir, resume in ((copy, True), (tmp_path / "branch", False)):
        inst = _session(log_dir, [JsonlBackend()], resume=resume)
        inst.load_state_dict(old if resume else state_a)
        inst.close()


def test_a_run_kept_in_memory_resumes_from_its_checkpoint_in_the_same_process(tmp_path):
    """The id of a run whose folder holds nothing (removed at close) is this process's, not refused as lost;
    and a checkpoint of a run that saved none before it (its run.json absent) refuses another folder's."""
    history = RunHistoryBackend()
    inst = _session(tmp_path, [history])
    state = _train(inst, range(4), 0.0, keep=(1,))[1]
    inst.close("killed")
    assert not (tmp_path / "r").exists()
    inst = _session(tmp_path, [history], resume=True)
    inst.load_state_dict(state)
    _train(inst, range(2, 4), 10.0)
    inst.close()
    assert list(zip(*history.series("v"), strict=True)) == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    other = tmp_path / "other"
    _session(other, [JsonlBackend()]).close()  # never saved a checkpoint: no run id in its folder
    inst = _session(other, [JsonlBackend()], resume=True)
    with pytest.raises(ConfigurationError, match="another run folder.*holds no run id"):
        inst.load_state_dict(state)
    inst.close()


def test_a_whole_checkpoint_or_a_wrong_field_is_refused_with_what_is_wrong_and_what_to_pass(tmp_path):
    """The whole checkpoint gave a message with the model's full repr and no hint of the 'instrument' key; a
    version 2 or a missing last_step got the same text, naming neither."""
    inst = instrument.Instrumentation(backends=[JsonlBackend()], run_name="r", log_dir=str(tmp_path))
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    ckpt = {"model": model.state_dict(), "instrument": inst.state_dict(), "step": 20}
    with pytest.raises(ConfigurationError) as caught:
        inst.load_state_dict(ckpt)
    message = str(caught.value)
    assert len(message) < 600 and "key 'instrument' looks like instrument's state" in message
    assert "['model', 'instrument', 'step']" in message and "inst.load_state_dict(ckpt['instrument'])" in message
    with pytest.raises(ConfigurationError, match=r"key 'rl' -> key 'session' looks like"):
        inst.load_state_dict({"rl": {"version": 1, "session": ckpt["instrument"]}})
    for bad, match in [
        ({**ckpt["instrument"], "version": 2}, r"its 'version' is 2, expected 1"),
        ({"version": 1, "run_name": "r"}, r"without 'last_step'"),
        ({**ckpt["instrument"], "last_step": "20"}, r"'last_step' must be None or an int >= 0.*got '20'"),
        ({**ckpt["instrument"], "run_id": 7}, r"its 'run_id' is 7, expected a run id \(str\) or None"),
        (list(range(10_000)), r"got \[0, 1, 2, .*\.\.\. \(list, 58890 characters\)"),
    ]:
        with pytest.raises(ConfigurationError, match=match) as caught:
            inst.load_state_dict(bad)
        assert len(str(caught.value)) < 600
    inst.close()


def test_a_backend_the_checkpoints_session_did_not_have_is_named_with_what_it_lacks_and_keeps(tmp_path, caplog):
    """JSONL left out of one resume kept the steps of the branch that resume went back from, lacked that
    session's steps, and rejoined the run at the next resume without a word."""
    inst = _session(tmp_path, [JsonlBackend(), TensorBoardBackend()])
    first = _train(inst, range(16), 1000.0, keep=(10,))[10]
    inst.close("killed")
    inst = _session(tmp_path, [TensorBoardBackend()], resume=True)  # JSONL left out
    inst.load_state_dict(first)
    second = _train(inst, range(11, 26), 2000.0, keep=(20,))[20]
    inst.close("killed")
    caplog.clear()
    inst = _session(tmp_path, [JsonlBackend(), TensorBoardBackend()], resume=True)
    inst.load_state_dict(second)
    said = [r.getMessage() for r in caplog.records if "not among the backends" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("instrument: JsonlBackend is not among the backends of the session "
                                                 "that saved this checkpoint (TensorBoardBackend)")
    assert "none of the steps that session wrote up to step 20" in said[0]
    _train(inst, range(21, 23), 3000.0, keep=(22,))
    state = inst.state_dict()
    inst.close()
    caplog.clear()
    inst = _session(tmp_path, [JsonlBackend(), TensorBoardBackend()], resume=True)
    inst.load_state_dict(state)  # the same backends as the session that saved it: nothing to say
    inst.close()
    assert "not among the backends" not in caplog.text
    # JSONL keeps steps 11..15 of the branch the second session went back from, and lacks 16..20.
    kept = [(s, 1000.0 + s) for s in range(16)] + [(21, 3021.0), (22, 3022.0)]
    assert _steps(tmp_path / "r") == kept
    assert second["backends"] == ["TensorBoardBackend"] and state["backends"] == ["JsonlBackend", "TensorBoardBackend"]
