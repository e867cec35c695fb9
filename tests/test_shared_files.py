"""Two backends, or two live sessions, that would write one file: refused before a record is written twice.

Two ``JsonlBackend()`` without a path both default to ``<run dir>/metrics.jsonl`` (and two ``TensorBoardBackend()``
to the run folder): every record went into the file twice, steps 0, 0, 1, 1... Two sessions of one process given
one explicit JSONL path interleaved their lines, and one's resume would cut the other's.
"""

import json

import pytest

import instrument
from instrument import JsonlBackend, TensorBoardBackend
from instrument.errors import ConfigurationError


def _steps(path):
    return [json.loads(line).get("step") for line in path.read_text().splitlines()]


def _run(inst, steps):
    for step in steps:
        with inst.step(step):
            inst.logger.log_metrics({"x": float(step)}, step)
    inst.close()


@pytest.mark.parametrize("make", [JsonlBackend, TensorBoardBackend], ids=["jsonl", "tensorboard"])
def test_two_default_file_backends_of_one_session_are_refused_and_the_run_name_stays_free(tmp_path, make):
    kind = make.__name__
    with pytest.raises(ConfigurationError, match=rf"{kind} and {kind}#2 would both write .*{tmp_path / 'r'}.*"
                                                 rf"Give one of them its own path"):
        instrument.Instrumentation(backends=[make(), make()], log_dir=str(tmp_path), run_name="r", log_interval=1)
    assert not (tmp_path / "r").exists()  # refused before anything opened: the run name is free again
    inst = instrument.Instrumentation(backends=[JsonlBackend(), JsonlBackend(str(tmp_path / "eval.jsonl"))],
                                      log_dir=str(tmp_path), run_name="r", log_interval=1)
    _run(inst, range(3))
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [0, 1, 2]  # each record once in each file
    assert _steps(tmp_path / "eval.jsonl") == [0, 1, 2]


def test_a_backend_added_later_that_shares_a_file_is_refused(tmp_path):
    inst = instrument.Instrumentation(backends=[JsonlBackend()], log_dir=str(tmp_path), run_name="r", log_interval=1)
    try:
        with pytest.raises(ConfigurationError, match=r"JsonlBackend and JsonlBackend#2 would both write"):
            inst.logger.add_backend(JsonlBackend(str(tmp_path / "r" / "." / "metrics.jsonl")))  # the same file
        assert len(inst.logger.backends) == 1
    finally:
        _run(inst, [0, 1])
    assert _steps(tmp_path / "r" / "metrics.jsonl") == [0, 1]


def test_two_live_sessions_of_one_process_are_refused_one_jsonl_path_until_the_first_closes(tmp_path):
    shared = tmp_path / "shared.jsonl"
    first = instrument.Instrumentation(backends=[JsonlBackend(str(shared))], log_dir=str(tmp_path), run_name="a",
                                       log_interval=1)
    with pytest.raises(ConfigurationError, match=r"JsonlBackend.*would write .*shared\.jsonl, which .*another "
                                                 r"session in this process still writes.*close the other session"):
        instrument.Instrumentation(backends=[JsonlBackend(str(shared))], log_dir=str(tmp_path), run_name="b",
                                   log_interval=1)
    assert not (tmp_path / "b").exists()
    _run(first, [0, 1])
    second = instrument.Instrumentation(backends=[JsonlBackend(str(shared))], log_dir=str(tmp_path), run_name="b",
                                        log_interval=1)
    _run(second, [5])  # after a close the file is free: a later run appends to it, as before
    assert _steps(shared) == [0, 1, 5]



def test_a_file_held_by_a_session_no_longer_reachable_is_refused_with_a_way_out(tmp_path):
    """A notebook cell whose session raised before close(): its logger keeps writing the file (its writer thread,
    a system monitor), so the file is not given to the next run; the refusal says what can be done without the
    session: another path, or a new process."""
    import gc

    path = tmp_path / "shared.jsonl"

    def train(name, fail):
        inst = instrument.Instrumentation(backends=[JsonlBackend(path=str(path))], log_dir=str(tmp_path),
                                          run_name=name, overhead_budget=None)
        with inst.step(0):
            inst.log({"loss": 1.0})
        if fail:
            raise RuntimeError("training failed before close()")
        inst.close()

    with pytest.raises(RuntimeError):
        train("first", fail=True)
    gc.collect()
    with pytest.raises(ConfigurationError, match=r"A session you no longer hold \(a notebook cell that raised "
                                                 r"before close\(\)\) keeps writing.*give this run another path"):
        train("second", fail=False)
    path = tmp_path / "other.jsonl"  # another path is the way out
    train("third", fail=False)
    assert 0 in _steps(path)


def test_a_tensorboard_backend_given_to_run_after_run_writes_each_run_into_its_own_folder(tmp_path):
    """It kept the folder of its first run: every later run's events went there, and TensorBoard showed the
    runs as one (JsonlBackend without a path already took each run's own folder)."""
    from tests.conftest import read_scalars

    tensorboard = TensorBoardBackend()
    for name, value in (("first", 1.0), ("second", 2.0)):
        inst = instrument.Instrumentation(backends=[tensorboard], log_dir=str(tmp_path), run_name=name,
                                          overhead_budget=None)
        inst.logger.log_metrics({"x": value}, step=0, commit=True)
        inst.close()
    assert read_scalars(tmp_path / "first")["x"] == {0: 1.0}
    assert read_scalars(tmp_path / "second")["x"] == {0: 2.0}


@pytest.mark.parametrize("second", ["tensorboard", "jsonl"])
def test_a_backend_pointed_at_tensorboards_system_folder_is_refused(tmp_path, second):
    """TensorBoardBackend writes the system monitor's samples to ``<log_dir>/system``, a run of its own. A second
    TensorBoardBackend given that folder wrote its training steps into it (TensorBoard showed them as the system
    run's, and its resume marker would have hidden samples there); a JsonlBackend whose file was that path made
    every system sample fail. Both are refused now; a file inside the folder is no event file and stays allowed."""
    from instrument.backends.base import StepRecord
    from tests.conftest import read_scalars

    system = tmp_path / "r" / "system"
    other = TensorBoardBackend(log_dir=str(system)) if second == "tensorboard" else JsonlBackend(path=str(system))
    with pytest.raises(ConfigurationError, match=rf"TensorBoardBackend and {type(other).__name__}(#2)? would both "
                                                 rf"write {system}: .*the system samples' run"):
        instrument.Instrumentation(backends=[TensorBoardBackend(), other], log_dir=str(tmp_path), run_name="r")
    assert not (tmp_path / "r").exists()
    logger = instrument.Logger([TensorBoardBackend(), JsonlBackend(path=str(system / "eval.jsonl"))],
                               instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"loss": float(step)}, step=step)
        logger.commit(step)
        logger.write_system(StepRecord(step, {"system/cpu": 10.0 * step, "system/seconds": float(step)}))
    logger.close()
    assert logger.failures == {}
    assert read_scalars(system) == {"system/cpu": {1: 10.0, 2: 20.0}, "system/seconds": {1: 1.0, 2: 2.0}}
    assert read_scalars(tmp_path / "r") == {"loss": {1: 1.0, 2: 2.0}}
    lines = [json.loads(line) for line in (system / "eval.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "step" in line] == [1, 2]
    assert [line["system_step"] for line in lines if "system_step" in line] == [1, 2]
