"""Two backends, or two live sessions, that would write one file: refused before a record is written twice.

Two ``JsonlBackend()`` without a path both default to ``<run dir>/metrics.jsonl`` (and two ``TensorBoardBackend()``
to the run folder): every record went into the file twice, steps 0, 0, 1, 1... Two sessions of one process given
one explicit JSONL path interleaved their lines, and one's resume would cut the other's.
"""

import json
import re

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


# ------------------------------------------------------------ two open sessions of one process, any backend's files
# Only JsonlBackend refused another session's file: two sessions given one TensorBoard folder (a notebook cell run
# again while the first session was still open, or dropped without close()) both wrote it, and TensorBoard showed
# both runs' steps as one run. Every backend's `writes_to` paths are now held from its open to its close.

SESSION_HOLDS = r"would write .*{}, which .*another session in this process still writes.*close the other session"
WAIT = 60.0


def _tensorboard_run(inst, steps, value=float):
    for step in steps:
        with inst.step(step):
            inst.logger.log_metrics({"x": value(step)}, step)


@pytest.mark.parametrize("given", ["log_dir", "writer"])
def test_two_open_sessions_are_refused_one_tensorboard_folder_until_the_first_closes(tmp_path, given):
    """The first session's backend names the folder, or writes through the user's own SummaryWriter there (its
    `writes_to` is that writer's folder): either way a second session's TensorBoardBackend on it is refused, and
    so is one whose `system` subfolder it is; a backend of the refused start that did open lets its folder go."""
    from torch.utils.tensorboard import SummaryWriter

    from tests.conftest import read_scalars

    folder, other = tmp_path / "tb", tmp_path / "tb2"
    writer = SummaryWriter(str(folder)) if given == "writer" else None
    backend = TensorBoardBackend(writer=writer) if writer else TensorBoardBackend(log_dir=str(folder))
    first = instrument.Instrumentation(backends=[backend], log_dir=str(tmp_path), run_name="a", log_interval=1)
    _tensorboard_run(first, [0])
    with pytest.raises(ConfigurationError, match=r"could not open TensorBoardBackend#2: ConfigurationError: "
                                                 r"TensorBoardBackend#2 .*" + SESSION_HOLDS.format(r"tb\b")):
        instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(other)),
                                             TensorBoardBackend(log_dir=str(folder))],
                                   log_dir=str(tmp_path), run_name="b", log_interval=1)
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigurationError, match=SESSION_HOLDS.format("system")):  # the first's system samples' run
        instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder / "system"))],
                                   log_dir=str(tmp_path), run_name="b", log_interval=1)
    beside = instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(other))], log_dir=str(tmp_path),
                                        run_name="b", log_interval=1)  # the refused start let `other` go
    _tensorboard_run(beside, [0], value=lambda step: -1.0)
    beside.close()
    _tensorboard_run(first, [1, 2])  # the first session still writes its folder, alone
    first.close()
    if writer:
        writer.close()
    assert read_scalars(folder)["x"] == {0: 0.0, 1: 1.0, 2: 2.0}
    later = instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder))], log_dir=str(tmp_path),
                                       run_name="c", log_interval=1)
    _tensorboard_run(later, [5])  # closed: the folder is free for a later session
    later.close()
    assert read_scalars(folder)["x"] == {0: 0.0, 1: 1.0, 2: 2.0, 5: 5.0}
    assert read_scalars(other)["x"] == {0: -1.0}


def test_a_backend_added_to_another_session_on_a_held_folder_is_left_out_and_reported(tmp_path, caplog):
    from tests.conftest import read_scalars

    folder = tmp_path / "tb"
    first = instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder))], log_dir=str(tmp_path),
                                       run_name="a", log_interval=1)
    second = instrument.Instrumentation(backends=[JsonlBackend()], log_dir=str(tmp_path), run_name="b",
                                        log_interval=1)
    added = TensorBoardBackend(log_dir=str(folder))
    second.logger.add_backend(added)
    assert not second.logger.flush(timeout=WAIT)  # its open failed
    assert added not in second.logger.backends
    assert "another session in this process still writes" in caplog.text
    _tensorboard_run(second, [7])
    _tensorboard_run(first, [0])
    second.close()
    first.close()
    assert read_scalars(folder)["x"] == {0: 0.0}
    assert _steps(tmp_path / "b" / "metrics.jsonl") == [7]


def test_a_backend_whose_open_failed_lets_its_folder_go(tmp_path):
    """A TensorBoardBackend whose folder cannot be made (a file is in the way) fails to open: under
    on_backend_error='warn' its session goes on without it, and the folder it named is free for another session,
    which then holds it like any other."""
    from tests.conftest import read_scalars

    folder = tmp_path / "tb"
    folder.write_text("a file where the folder goes")
    failed = instrument.Instrumentation(backends=[JsonlBackend(), TensorBoardBackend(log_dir=str(folder))],
                                        log_dir=str(tmp_path), run_name="a", log_interval=1,
                                        on_backend_error="warn")
    assert [type(b) for b in failed.logger.backends] == [JsonlBackend]
    folder.unlink()
    second = instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder))], log_dir=str(tmp_path),
                                        run_name="b", log_interval=1)  # `failed` is still open
    with pytest.raises(ConfigurationError, match=SESSION_HOLDS.format(r"tb\b")):
        instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder))], log_dir=str(tmp_path),
                                   run_name="c", log_interval=1)
    _tensorboard_run(second, [3])
    _tensorboard_run(failed, [4])
    second.close()
    failed.close()
    assert read_scalars(folder)["x"] == {3: 3.0}
    assert _steps(tmp_path / "a" / "metrics.jsonl") == [4]


class _Hung(instrument.Backend):
    """Blocks in its first write until released (a remote that does not answer)."""

    def __init__(self) -> None:
        import threading

        self.release, self.entered = threading.Event(), threading.Event()

    def write(self, record):
        self.entered.set()
        self.release.wait(WAIT)


def test_a_close_that_gave_up_keeps_the_folder_until_its_writer_has_written_it(tmp_path):
    """The writer of a close that timed out still writes the steps queued behind the hung call, into the folder:
    it stays taken until that writer has closed its backends, then it is free."""
    import threading

    from tests.conftest import read_scalars

    folder, hung = tmp_path / "tb", _Hung()
    first = instrument.Instrumentation(backends=[hung, TensorBoardBackend(log_dir=str(folder))],
                                       log_dir=str(tmp_path), run_name="a", log_interval=1)
    _tensorboard_run(first, range(3))
    assert hung.entered.wait(WAIT)
    stopped = threading.Event()
    try:
        first.close(timeout=0.1)  # gives up: the hung write holds steps 0..2
        first.logger.when_stopped(stopped.set)
        with pytest.raises(ConfigurationError, match=SESSION_HOLDS.format(r"tb\b")):
            instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder))], log_dir=str(tmp_path),
                                       run_name="b", log_interval=1)
    finally:
        hung.release.set()
    assert stopped.wait(WAIT)
    later = instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=str(folder))], log_dir=str(tmp_path),
                                       run_name="b", log_interval=1)
    _tensorboard_run(later, [9])
    later.close()
    assert read_scalars(folder)["x"] == {0: 0.0, 1: 1.0, 2: 2.0, 9: 9.0}  # nothing mixed in while both ran


def test_one_tensorboard_backend_given_to_two_open_sessions_is_refused_to_the_second(tmp_path):
    """One instance, one run at a time: the second session's writer would have opened it again, replacing the
    first session's event writer under it."""
    from tests.conftest import read_scalars

    shared = TensorBoardBackend(log_dir=str(tmp_path / "tb"))
    first = instrument.Instrumentation(backends=[shared], log_dir=str(tmp_path), run_name="a", log_interval=1)
    with pytest.raises(ConfigurationError, match="is already open for another session in this process"):
        instrument.Instrumentation(backends=[shared], log_dir=str(tmp_path), run_name="b", log_interval=1)
    _tensorboard_run(first, [1, 2])
    first.close()
    assert read_scalars(tmp_path / "tb")["x"] == {1: 1.0, 2: 2.0}


@pytest.mark.parametrize("make", [JsonlBackend, TensorBoardBackend], ids=["jsonl", "tensorboard"])
def test_one_backend_without_a_path_given_to_two_open_sessions_is_refused_to_the_second(tmp_path, make):
    """A review found one ``JsonlBackend()`` (or ``TensorBoardBackend()``), whose folder is each run's own, let
    into a second open session: the two runs hold no path in common, but the second open took the instance's file
    (writer) from the first, and every step of both runs went into the second run. Closed, it serves the next."""
    from tests.conftest import read_scalars

    shared = make()
    first = instrument.Instrumentation(backends=[shared], log_dir=str(tmp_path), run_name="a", log_interval=1)
    with pytest.raises(ConfigurationError, match="is already open for another session in this process: one backend "
                                                 "object writes one run at a time"):
        instrument.Instrumentation(backends=[shared], log_dir=str(tmp_path), run_name="b", log_interval=1)
    _tensorboard_run(first, [1, 2])
    first.close()
    later = instrument.Instrumentation(backends=[shared], log_dir=str(tmp_path), run_name="c", log_interval=1)
    _tensorboard_run(later, [5])
    later.close()
    if make is JsonlBackend:
        assert _steps(tmp_path / "a" / "metrics.jsonl") == [1, 2] and _steps(tmp_path / "c" / "metrics.jsonl") == [5]
    else:
        assert read_scalars(tmp_path / "a")["x"] == {1: 1.0, 2: 2.0} and read_scalars(tmp_path / "c")["x"] == {5: 5.0}
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").rglob("*.jsonl"))


FORKED = """
import json, os, sys
import instrument
from instrument import TensorBoardBackend
from instrument.errors import ConfigurationError

root = sys.argv[1]

def session(name, folder):
    return instrument.Instrumentation(backends=[TensorBoardBackend(log_dir=os.path.join(root, folder))],
                                      log_dir=root, run_name=name, log_interval=1)

def step(inst, n):
    with inst.step(n):
        inst.logger.log_metrics({"x": float(n)}, n)

def refusal(name, folder):
    try:
        session(name, folder)
    except ConfigurationError as exc:
        return str(exc)
    return None

parent = session("parent", "tb")
step(parent, 0)
pid = os.fork()
if pid == 0:  # the child: the parent's writer still writes tb, and the child cannot tell when it stops
    said = {"parent": os.getppid(), "parents": refusal("child-tb", "tb")}
    own = session("child-own", "own")  # a folder of its own: held in the child as in any process
    said["own"] = refusal("child-again", "own")
    step(own, 1)
    own.close()
    print(json.dumps(said), flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
step(parent, 2)
parent.close()
later = session("later", "tb")  # the parent let it go: the child never held it
step(later, 3)
later.close()
print(json.dumps({"child status": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def test_a_forked_child_is_refused_the_folders_its_parent_holds_and_holds_its_own(tmp_path):
    """A forked child inherits no open backend, but its parent's writer goes on writing the parent's folders, and
    the child cannot tell when it stops: the child refuses them, naming the parent, for as long as it runs. What
    the child opens itself is held there as in any process (its own lock: another thread may have held the
    parent's at the fork); the parent's folder is the parent's to let go."""
    from tests.conftest import read_scalars, run_child

    done = run_child(tmp_path, FORKED, str(tmp_path), timeout=WAIT * 2)
    assert done.returncode == 0, done.stderr
    child, parent = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert parent == {"child status": 0}
    assert re.search(rf"would write .*tb, which .* of a session of process {child['parent']} wrote "
                     rf"when this process was forked from it.*Give this run its own path", child["parents"] or "")
    assert re.search(SESSION_HOLDS.format("own"), child["own"] or ""), child["own"]
    assert read_scalars(tmp_path / "tb")["x"] == {0: 0.0, 2: 2.0, 3: 3.0}  # nothing of the child's
    assert read_scalars(tmp_path / "own")["x"] == {1: 1.0}
