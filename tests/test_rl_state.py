"""RLLogging.load_state_dict refuses a state that is not what state_dict returned, saying which key and why,
instead of resuming from a count it made up (3.7 -> 3, "7" -> 7, -50) or raising a bare KeyError; a refused load,
whichever part refuses, changes nothing; and state_dict leaves a collector thread free while the session flushes."""

import copy
import logging
import threading

import numpy as np
import pytest
import torch

import instrument
from instrument import ConfigurationError
from instrument.rl import Evaluation, RLComponent, RLLogging


def saved_state(tmp_path):
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path, run_name="saved")
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=100)).attach(inst)
    for _ in range(3):
        with rl.iteration():
            rl.observe_batch(reward=np.ones((4, 2)), done=np.zeros((4, 2), bool))
    state = rl.state_dict()
    rl.close()
    inst.close()
    assert state["counters"] == {"frames": 24, "iterations": 3, "episodes": 0}
    assert state["evaluation"] == {"next_due": 100, "runs": 0}
    return state


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s["counters"].__setitem__("frames", 3.7),
         r"Counters\.load_state_dict: frames must be a non-negative int, got 3\.7 \(float\); Counters\.state_dict\(\) "
         r"\(RLLogging\.state_dict\(\)\['counters'\]\) holds plain ints: load the state it returned"),
        (lambda s: s["counters"].__setitem__("frames", -50), r"frames must be a non-negative int, got -50 \(int\)"),
        (lambda s: s["counters"].__setitem__("iterations", "7"), r"iterations must be a non-negative int, got '7'"),
        (lambda s: s["counters"].__setitem__("episodes", True), r"episodes must be a non-negative int, got True"),
        (lambda s: s["counters"].pop("episodes"), r"Counters\.load_state_dict: the state lacks \['episodes'\]"),
        (lambda s: s.pop("counters"),
         r"RLLogging\.load_state_dict: the state lacks 'counters'; got keys \['components', 'evaluation', "
         r"'session', 'version'\]\. Load the dict RLLogging\.state_dict\(\) returned"),
        (lambda s: s["evaluation"].pop("next_due"),
         r"Evaluation\.load_state_dict: the state lacks 'next_due' \(the frame count the next evaluation is due "
         r"at\); got keys \['runs'\]\. Load the state Evaluation\.state_dict\(\) "
         r"\(RLLogging\.state_dict\(\)\['evaluation'\]\) returned"),
        (lambda s: s["evaluation"].__setitem__("next_due", 1e20),
         r"Evaluation\.load_state_dict: next_due must be a non-negative int, got 1e\+20 \(float\)"),
        (lambda s: s["evaluation"].__setitem__("runs", -1), r"runs must be a non-negative int, got -1"),
    ],
)
def test_a_state_that_is_not_what_state_dict_returned_is_refused_by_key(tmp_path, change, match):
    state = saved_state(tmp_path)
    bad = copy.deepcopy(state)
    change(bad)
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path, run_name="resumed")
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=100)).attach(inst)
    with pytest.raises(ConfigurationError, match=match):
        rl.load_state_dict(bad)
    assert rl.counters.state_dict() == {"frames": 0, "iterations": 0, "episodes": 0}  # nothing half-loaded
    rl.load_state_dict(state)  # the state as saved loads, numpy ints too
    assert rl.counters.state_dict() == state["counters"] and rl.evaluation.state_dict() == state["evaluation"]
    rl.close()
    inst.close()


def test_numpy_integer_counts_load_as_ints(tmp_path):
    state = saved_state(tmp_path)
    state["counters"] = {k: np.int64(v) for k, v in state["counters"].items()}  # e.g. read back from an npz
    rl = RLLogging(progress=None)
    rl.load_state_dict(state)
    assert rl.counters.state_dict() == {"frames": 24, "iterations": 3, "episodes": 0}
    assert all(type(v) is int for v in rl.counters.state_dict().values())


# ------------------------------------------------------------------ a checkpoint saved inside an iteration
T, N, ITERATIONS, INTERVAL = 4, 2, 10, 3


def _batch(iteration):
    import torch

    g = np.random.default_rng(iteration)
    return torch.from_numpy(g.standard_normal((T, N))), torch.from_numpy(g.random((T, N)) < 0.3)


def _session(folder, resume=False):
    from instrument.rl import CollectionMetrics

    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=INTERVAL, log_dir=str(folder),
                                      run_name="r", resume=resume, overhead_budget=None)
    return inst, RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)


def _iterate(inst, rl, iteration, save=None):
    reward, done = _batch(iteration)
    state = None
    with inst.step(iteration), rl.iteration():
        if save == "before":
            state = rl.state_dict()
        rl.observe_batch(reward=reward, done=done)
        if save == "after":
            state = rl.state_dict()
    return state


def _written(folder):
    import json

    lines = [json.loads(line) for line in (folder / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "metrics" in line]
    return steps, {line["step"]: line["metrics"] for line in lines if "metrics" in line}


def run_and_resume(tmp_path, session, iterate, iterations, save_at, lost=2):
    """The same run uninterrupted (folder ``a``), and in folder ``b`` checkpointed inside iteration ``save_at``
    (``iterate(inst, rl, k, save)`` returns the state when ``save``), ``lost`` more iterations that a killed
    process would lose, then resumed from the checkpoint in a new session and run to the end."""
    inst, rl = session(tmp_path / "a")
    for iteration in range(iterations):
        iterate(inst, rl, iteration, False)
    rl.close()
    inst.close()
    inst, rl = session(tmp_path / "b")
    checkpoint = None
    for iteration in range(save_at + 1 + lost):
        state = iterate(inst, rl, iteration, iteration == save_at)
        checkpoint = state if iteration == save_at else checkpoint
    rl.close()
    inst.close()
    inst, rl = session(tmp_path / "b", resume=True)
    rl.load_state_dict(checkpoint)
    for iteration in range(rl.step, iterations):
        iterate(inst, rl, iteration, False)
    rl.close()
    inst.close()


@pytest.mark.parametrize("save_at, where", [(6, "after"), (6, "before"), (7, "after")])
def test_a_checkpoint_saved_inside_an_iteration_resumes_without_a_repeated_step_or_a_batch_counted_twice(
        tmp_path, save_at, where):
    """Inside `with inst.step(k), rl.iteration():` the saved counters held the iteration's batch but not the
    iteration, while the session counted the open logging step as committed: the resumed run wrote that step
    again and counted the batch twice (counters/frames 88 instead of 80 at step 9). Against the same run
    uninterrupted, read back from JSONL."""
    run_and_resume(tmp_path, _session, lambda inst, rl, k, save: _iterate(inst, rl, k, where if save else None),
                   ITERATIONS, save_at)
    (steps_a, a), (steps_b, b) = _written(tmp_path / "a"), _written(tmp_path / "b")
    assert steps_b == steps_a == [0, 3, 6, 9]  # no step written twice
    if where == "before":  # its batch never counted: the resumed run goes on with the next iteration
        _, done = _batch(save_at)
        a[9] = {**a[9], "counters/frames": a[9]["counters/frames"] - T * N,
                "counters/episodes": a[9]["counters/episodes"] - int(done.sum())}
    counters = [key for key in a[9] if key.startswith("counters/")]
    assert len(counters) == 3 and {key: b[9][key] for key in counters} == {key: a[9][key] for key in counters}
    if where == "after" and save_at % INTERVAL == 0:  # saved at a logging step with its batch: no value lost
        # (the rewards, not episode returns: episodes in progress are not checkpointed, docs/rl.md)
        for step in steps_a:
            kept = [key for key in a[step] if key.startswith(("counters/", "collection/main/reward/"))]
            assert {key: b[step][key] for key in kept} == {key: a[step][key] for key in kept}, step


@pytest.mark.parametrize("step_unit", ["iterations", "frames"])
def test_a_checkpoint_saved_inside_an_iteration_with_no_step_block_keeps_the_step_that_iteration_commits(
        tmp_path, step_unit, caplog):
    """With no `inst.step` block (frames, or a loop that leaves it out) a logging iteration commits at its end
    through `commit_step`. A checkpoint saved inside it counted the iteration as done, but the session's last
    step was the step before: the resumed run cut the iteration's step from the files and never logged it again
    (a review found step 6, or frames 140, missing). Against the same run uninterrupted, read back from JSONL."""
    from instrument.rl import CollectionMetrics

    def session(folder, resume=False):
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=INTERVAL,
                                          log_dir=str(folder), run_name="r", resume=resume, overhead_budget=None)
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, step_unit=step_unit)
        return inst, rl.attach(inst)

    def iterate(rl, iteration, save=False):
        reward, done = _batch(iteration)
        with rl.iteration():
            rl.observe_batch(reward=reward, done=done)
            return rl.state_dict() if save else None

    inst, rl = session(tmp_path / "a")
    for iteration in range(ITERATIONS):
        iterate(rl, iteration)
    rl.close()
    inst.close()
    inst, rl = session(tmp_path / "b")
    checkpoint = [iterate(rl, iteration, save=iteration == 6) for iteration in range(9)][6]  # 7, 8: lost
    rl.close()
    inst.close()
    inst, rl = session(tmp_path / "b", resume=True)
    rl.load_state_dict(checkpoint)
    assert rl.counters.iterations == 7
    for iteration in range(7, ITERATIONS):
        iterate(rl, iteration)
    rl.close()
    inst.close()
    (steps_a, a), (steps_b, b) = _written(tmp_path / "a"), _written(tmp_path / "b")
    logged = [0, 3, 6, 9]  # the iterations that log; counting frames, at the frames after them
    assert steps_b == steps_a == (logged if step_unit == "iterations" else [T * N * (k + 1) for k in logged])
    untimed = {step: {key: v for key, v in values.items() if not key.startswith("timing/")}
               for step, values in a.items()}
    assert {step: {key: b[step].get(key) for key in values} for step, values in untimed.items()} == untimed
    # what was staged at the save is that step's, and committed by it: no warning that the checkpoint loses it
    assert not [r for r in caplog.records if "called with values staged" in r.getMessage()]


# ------------------------------------------------------------------ a refused load changes nothing
class _Batches(RLComponent):
    """An extra component with a state of its own: the batches it has seen."""

    prefix = "batches"

    def __init__(self) -> None:
        self.seen = 0

    def on_batch(self, batch=None, frames=None) -> None:
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state) -> None:
        if type(state.get("seen")) is not int:
            raise ConfigurationError(f"Batches.load_state_dict: seen must be an int, got {state!r}")
        self.seen = state["seen"]


def _live(folder, resume=False):
    from instrument.rl import CollectionMetrics

    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=2, log_dir=str(folder),
                                      run_name="r", resume=resume, overhead_budget=None)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, components=[_Batches()],
                   evaluation=Evaluation(every_frames=10**6))
    return inst, rl.attach(inst)


def _where(inst, rl):
    return (rl.counters.state_dict(), rl.evaluation.state_dict(), rl.extra[0].state_dict(), inst.logger.last_step)


def _run(inst, rl, iterations):
    for k in iterations:
        with inst.step(k), rl.iteration():
            rl.observe_batch(reward=np.ones((4, 2)), done=np.zeros((4, 2), bool))


def test_an_older_state_refused_by_the_session_changes_nothing(tmp_path):
    """The session refused the state (it had committed later steps), but the counters and the evaluation were
    loaded first and stayed loaded, then the extra components, so the next `with inst.step(7)` iteration failed:
    "RLLogging logs iteration 3 at step 3 inside `with inst.step(7)`" (a review). The session's state is checked
    before any part is loaded."""
    inst, rl = _live(tmp_path)
    _run(inst, rl, range(3))
    old = rl.state_dict()
    _run(inst, rl, range(3, 7))
    before = _where(inst, rl)
    assert before[0] == {"frames": 56, "iterations": 7, "episodes": 0} and before[2:] == ({"seen": 7}, 6)
    with pytest.raises(ConfigurationError, match=r"after this Instrumentation committed step 6: resuming at the "
                                                 r"checkpoint's step 2"):
        rl.load_state_dict(old)
    assert _where(inst, rl) == before
    _run(inst, rl, [7])  # the run goes on where it was
    rl.close()
    inst.close()
    assert _written(tmp_path)[0] == [0, 2, 4, 6, 7]


def test_a_component_refusing_its_state_leaves_the_counters_and_the_session_as_they_were(tmp_path):
    """The extra components were loaded one by one after the counters, the session last: one refusing its state
    left the counters loaded and the session not resumed, so the next iterations logged steps the files already
    held, counted from the checkpoint. Loaded together now: all or none."""
    inst, rl = _live(tmp_path)
    _run(inst, rl, range(5))
    state = rl.state_dict()
    rl.close()
    inst.close()
    bad = copy.deepcopy(state)
    bad["components"]["extra0"] = {"seen": "5"}
    inst, rl = _live(tmp_path, resume=True)
    fresh = _where(inst, rl)
    with pytest.raises(ConfigurationError, match="Batches.load_state_dict: seen must be an int"):
        rl.load_state_dict(bad)
    assert _where(inst, rl) == fresh == ({"frames": 0, "iterations": 0, "episodes": 0},
                                         {"next_due": 10**6, "runs": 0}, {"seen": 0}, None)
    rl.load_state_dict(state)
    assert _where(inst, rl) == (state["counters"], state["evaluation"], {"seen": 5}, 4)
    _run(inst, rl, range(rl.step, 7))
    rl.close()
    inst.close()
    assert _written(tmp_path)[0] == [0, 2, 4, 6]  # every step once: nothing written twice


def test_a_session_state_refused_at_attach_leaves_the_session_as_it_was(tmp_path):
    """Loaded before `attach`, the session's state is applied when the set is attached. Refused then, after the
    components were registered, the session kept them: a set attached next was refused ("the same keys")."""
    inst, rl = _live(tmp_path)
    _run(inst, rl, range(2))
    old = rl.state_dict()
    _run(inst, rl, range(2, 5))
    rl.close()
    waiting = RLLogging(progress=None)
    waiting.load_state_dict(old)  # applied to the session at attach
    with pytest.raises(ConfigurationError, match="after this Instrumentation committed step 4"):
        waiting.attach(inst)
    assert not waiting.attached
    other = RLLogging(progress=None).attach(inst)  # nothing of the refused set was left registered
    other.close()
    inst.close()


# ------------------------------------------------------------------ a checkpoint beside a collector thread
class _Gate(instrument.Backend):
    """Once armed, holds every flush (what a checkpoint waits for) until released: a slow remote backend."""

    name = "gate"

    def __init__(self) -> None:
        self.armed = False
        self.flushing, self.release = threading.Event(), threading.Event()

    def write(self, record) -> None:
        pass

    def flush(self) -> None:
        if self.armed:
            self.flushing.set()
            self.release.wait(60)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def test_a_checkpoint_waiting_for_the_backends_holds_neither_the_collector_nor_the_training_thread(tmp_path):
    """`rl.state_dict()` held the set's lock while the session flushed the backends (up to 10 s): a collector
    thread's `observe_batch` waited all that time (1.45 s behind a backend whose write took 1.5 s, in a review).
    Now both go on while the checkpoint waits, the training thread even commits a logging step, and the state
    saved still agrees with itself: its counters count exactly the iterations up to the session's last step."""
    from instrument.rl import CollectionMetrics

    gate, said = _Gate(), _Said()
    inst = instrument.Instrumentation(backends=[gate], log_interval=1, log_dir=str(tmp_path), run_name="r",
                                      flush_secs=3600.0, overhead_budget=None)  # no flush but the checkpoint's
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    reward, done = np.ones((4, 2)), np.zeros((4, 2), bool)
    with rl.iteration():  # step 0
        rl.observe_batch(reward=reward, done=done)
    inst.flush()
    gate.armed = True
    saved, seen = {}, {}
    saver = threading.Thread(target=lambda: saved.update(state=rl.state_dict()))
    logging.getLogger("instrument").addHandler(said)
    saver.start()
    try:
        assert gate.flushing.wait(60)  # the checkpoint is waiting for the backends now

        def collect():
            rl.observe_batch(reward=reward, done=done)
            seen["while the checkpoint waited"] = saver.is_alive() and not said.messages

        collector = threading.Thread(target=collect)
        collector.start()
        collector.join(60)
        with rl.iteration():  # step 1, committed while the checkpoint waits
            rl.observe_batch(reward=reward, done=done)
        seen["training"] = saver.is_alive() and not said.messages
    finally:
        gate.release.set()
        saver.join(60)
        logging.getLogger("instrument").removeHandler(said)
    assert seen == {"while the checkpoint waited": True, "training": True}, said.messages
    state = saved["state"]
    assert state["session"]["last_step"] == 1  # committed before the checkpoint returned: read again with it
    assert state["counters"] == {"frames": 3 * 8, "iterations": 2, "episodes": 0}
    rl.close()
    inst.close()


def _logger_at(steps):
    logger = instrument.Logger([])
    for step in range(steps):
        logger.log_metrics({"x": 1.0}, step=step)
        logger.commit(step)
    return logger


def test_a_state_loaded_before_attach_to_a_bare_logger_is_checked_at_attach():
    """The review's case: loaded first, then attached to a Logger that had committed step 4, the state was never
    checked and the loop died at iteration 0 with a StepOrderError. Now attach refuses, naming both steps, and
    leaves the set unattached; attached to a logger it follows, the same set runs."""
    old = {"version": 1, "counters": {"frames": 8, "iterations": 1, "episodes": 0}, "components": {}}
    rl = RLLogging(progress=None)
    rl.load_state_dict(old)
    logger = _logger_at(5)
    with pytest.raises(ConfigurationError, match=r"RLLogging\.attach: this logger has already committed step 4, "
                                                 r"but the state resumes after step 0 \(iterations\).*the "
                                                 r"set was not attached"):
        rl.attach(logger)
    assert not rl.attached and rl.counters.iterations == 1
    fresh = _logger_at(1)  # step 0 committed: the state resumes after it
    rl.attach(fresh)
    for _ in range(2):
        with rl.iteration():
            rl.observe_batch(reward=np.ones(2), done=np.zeros(2, bool))
    assert fresh.last_step == 2
    rl.close()
    logger.close()
    fresh.close()


class _LiveBuffer(RLComponent):
    """The nn.Module idiom: state_dict returns the live tensor, load_state_dict copies into it."""

    prefix = "live"

    def __init__(self) -> None:
        self.buf = torch.tensor([5.0])

    def state_dict(self):
        return {"buf": self.buf}

    def load_state_dict(self, state) -> None:
        self.buf.copy_(torch.as_tensor(state["buf"]))


class _AssignsThenRefuses(RLComponent):
    prefix = "partial"

    def __init__(self) -> None:
        self.a, self.b = 1, 2

    def state_dict(self):
        return {"a": self.a, "b": self.b}

    def load_state_dict(self, state) -> None:
        self.a = state["a"]
        if not isinstance(state["b"], int):
            raise ConfigurationError(f"b must be an int, got {state['b']!r}")
        self.b = state["b"]


def test_a_refused_load_gives_back_live_tensors_and_a_field_assigned_before_the_refusal():
    """The review's cases: a component that assigned a field and then refused kept it (a: 1 -> 9), and one whose
    state_dict returns its live tensor got the new value back on rollback (5.0 -> 9.0). Now both are as before."""
    live, partial = _LiveBuffer(), _AssignsThenRefuses()
    rl = RLLogging(progress=None, components=[live, partial]).attach(instrument.Logger([]))
    state = rl.state_dict()
    state["components"] = {"extra0": {"buf": torch.tensor([9.0])}, "extra1": {"a": 9, "b": "x"}}
    with pytest.raises(ConfigurationError, match="b must be an int"):
        rl.load_state_dict(state)
    assert live.buf.tolist() == [5.0]
    assert (partial.a, partial.b) == (1, 2)
    rl.close()


def test_a_refused_load_gives_a_tensordict_state_back_as_a_tensordict():
    """A review found the rollback's copy of a TensorDict state made a plain dict: the component given it back
    raised an AttributeError that hid the refusal, and kept the state it was refused."""
    tensordict = pytest.importorskip("tensordict")
    from instrument.rl.component import load_together

    class Running:
        def __init__(self):
            self.td = tensordict.TensorDict({"mean": torch.zeros(3)}, batch_size=[])

        def state_dict(self):
            return self.td.clone()

        def load_state_dict(self, state):
            assert state.batch_size == torch.Size([])  # the TensorDict API
            self.td = state.clone()

    class Refuses:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            if state:
                raise ValueError("refused")

    running = Running()
    with pytest.raises(ValueError, match="refused"):
        load_together([(running, tensordict.TensorDict({"mean": torch.ones(3)}, batch_size=[])), (Refuses(), {"x": 1})])
    assert isinstance(running.td, tensordict.TensorDict) and running.td["mean"].tolist() == [0.0, 0.0, 0.0]
