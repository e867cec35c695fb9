"""One session: RLLogging's components are driven by the Instrumentation (its cadence, its one commit per step,
its failure ledger), each built-in component is called only through the RLComponent interface, Evaluation is
one of them, and the progress bar reads declared keys."""

import collections
import inspect
import io
import json
import logging
import sys

import pytest
import torch

import instrument
from instrument import ConfigurationError, Logger
from instrument.backends.progress import ProgressBar
from instrument.rl import (
    CollectionMetrics,
    Counters,
    Episode,
    Evaluation,
    RLComponent,
    RLLogging,
    TrainMetrics,
)
from instrument.rl.bar import ProgressComponent
from instrument.rl.timing import StageTiming

INTERFACE = {"attach", "on_batch", "on_losses", "end_iteration", "log", "state_dict", "load_state_dict", "close"}


class StepKeeper(instrument.Backend):
    """Every committed record, in order: a step written twice shows up twice."""

    def __init__(self) -> None:
        self.records = []

    def write(self, record) -> None:
        self.records.append(record)

    @property
    def steps(self):
        return [r.step for r in self.records]


def observe(rl: RLLogging, value: float = 1.0) -> None:
    done = torch.zeros(4, 2, dtype=torch.bool)
    done[1, 0] = True
    rl.observe_batch(reward=torch.full((4, 2), value), done=done)
    rl.observe_losses({"loss": torch.tensor(value)})


def loop(rl: RLLogging, n: int) -> None:
    """n iterations, then wait until the logger's writer thread has handed every commit to the backends."""
    for _ in range(n):
        with rl.iteration():
            observe(rl)
    assert rl.logger.flush(timeout=60)


@pytest.mark.parametrize("framed", [False, True], ids=["plain-loop", "inside-inst.step"])
def test_one_cadence_the_sessions_logging_steps_each_committed_once(framed):
    keeper = StepKeeper()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=3)
    rl = RLLogging(progress=None).attach(inst)
    for i in range(10):
        if framed:
            with inst.step(i) as s, rl.iteration():
                observe(rl)
                if s.active:
                    inst.logger.log_metrics({"user/value": float(i)}, step=i)
        else:
            loop(rl, 1)
    rl.close()
    inst.close()
    expected = [s for s in range(10) if inst.is_logging_step(s)]
    assert expected == [0, 3, 6, 9]
    assert keeper.steps == expected  # the session's cadence, one commit per step
    for record in keeper.records:  # the RL values and the user's are in the one record of the step
        assert record.scalars["counters/iterations"] == record.step + 1
        assert record.scalars["collection/main/reward/mean"] == 1.0
        if framed:
            assert record.scalars["user/value"] == float(record.step)


def test_closing_inside_the_last_logging_step_keeps_its_values():
    keeper = StepKeeper()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=1)
    rl = RLLogging(progress=None).attach(inst)
    with inst.step(0), rl.iteration():
        observe(rl)
    with inst.step(1):
        with rl.iteration():
            observe(rl)
        rl.close()
    inst.close()
    assert keeper.steps == [0, 1]
    assert keeper.records[1].scalars["counters/iterations"] == 2.0


def test_a_log_interval_that_disagrees_with_the_session_is_refused():
    inst = instrument.Instrumentation(backends=[], log_interval=5)
    with pytest.raises(ConfigurationError, match="one session has one cadence"):
        RLLogging(log_interval=2, progress=None).attach(inst)
    RLLogging(log_interval=5, progress=None).attach(inst)  # the same cadence is fine
    second = RLLogging(progress=None, collection=None)
    with pytest.raises(ConfigurationError, match="'training' is already registered"):
        second.attach(inst)  # one set per session; further metrics go in RLLogging(components=[...])
    assert not second.attached
    inst.close()


class Broken(RLComponent):
    prefix = "broken"

    def on_batch(self, batch=None, frames=None):
        raise RuntimeError("broken on_batch")

    def log(self, logger, step):
        raise RuntimeError("broken log")


def test_a_failing_component_is_counted_in_inst_failures_and_the_others_still_log(caplog):
    keeper = StepKeeper()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=2)
    rl = RLLogging(progress=None, components=[Broken()]).attach(inst)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        loop(rl, 5)  # 5 on_batch failures, 3 log failures (steps 0, 2, 4)
    assert inst.failures == {"extra0": 8}
    assert rl.failures == {"extra0": 8}
    assert sum("component 'extra0' failed" in r.message for r in caplog.records) == 1
    assert keeper.steps == [0, 2, 4]
    assert [r.scalars["counters/frames"] for r in keeper.records] == [8.0, 24.0, 40.0]
    assert all("train/main/loss" in r.scalars for r in keeper.records)
    rl.close()
    inst.close()


def spy(cls):
    """A subclass of ``cls`` that counts the calls of each method made from outside the component itself."""

    def wrap(name, fn):
        def method(self, *args, **kwargs):
            caller = sys._getframe(1).f_locals.get("self")
            if caller is not self:
                self.calls[name] += 1
            return fn(self, *args, **kwargs)

        return method

    namespace = {}
    for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
        if not (name.startswith("__") and name.endswith("__")):
            namespace[name] = wrap(name, fn)

    def init(self, *args, **kwargs):
        self.calls = collections.Counter()
        cls.__init__(self, *args, **kwargs)

    namespace["__init__"] = init
    return type(f"Spy{cls.__name__}", (cls,), namespace)


def runner(deterministic: bool, max_steps: int, render: bool) -> Episode:
    """An episode runner (the EpisodeRunner callable): a fixed episode, so the logged values are known."""
    return Episode(return_=2.0 if deterministic else 1.0, length=3)


def test_built_in_components_are_called_only_through_the_rl_component_interface():
    keeper = StepKeeper()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=2)
    collection = spy(CollectionMetrics)()
    training = spy(TrainMetrics)()
    counters = spy(Counters)()
    evaluation = spy(Evaluation)(every_frames=24)
    bar = ProgressBar(enabled=True, stream=io.StringIO())
    rl = RLLogging(
        collection=collection, training=training, counters=counters, evaluation=evaluation, progress=bar
    )
    rl.timing = spy(StageTiming)()
    rl.progress_component = progress = spy(ProgressComponent)(bar)
    rl.attach(inst, eval_runner=runner)
    loop(rl, 5)  # logging steps 0, 2, 4; evaluations due at 24 frames (iteration 2) and 48 (after 5: no)
    state = rl.state_dict()
    rl.load_state_dict(state)
    rl.close()
    inst.close()

    for comp in (collection, training, counters, evaluation, rl.timing, progress):
        outside = set(comp.calls) - INTERFACE
        assert not outside, f"{type(comp).__name__}: called from outside through {sorted(outside)}"
        assert comp.calls["attach"] == 1 and comp.calls["close"] == 1
        assert comp.calls["on_batch"] == 5 and comp.calls["on_losses"] == 5
        assert comp.calls["end_iteration"] == 5
    for comp in (collection, training, counters, evaluation):
        assert comp.calls["log"] == 3  # the session's logging steps 0, 2, 4, nothing more
    for comp in (rl.timing, progress):
        assert comp.calls["log"] == 0  # registered with logs=False: they stage nothing
    # Evaluation went through the interface: end_iteration saw it due, log ran it at that logging step.
    assert keeper.steps == [0, 2, 4]
    evaluated = [r.step for r in keeper.records if "eval/deterministic/return" in r.scalars]
    assert evaluated == [2]
    record = keeper.records[1]
    assert record.scalars["eval/deterministic/return"] == 2.0 and record.scalars["eval/stochastic/return"] == 1.0
    assert record.timings["evaluation"]["count"] == 1.0
    assert evaluation.runs == 1 and evaluation.next_due == 48


def test_an_evaluation_off_the_cadence_is_committed_through_the_session():
    keeper = StepKeeper()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=0)  # only evaluations log
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=16)).attach(inst, eval_runner=runner)
    for i in range(4):  # 8 frames per iteration: due after iterations 1 and 3
        with inst.step(i), rl.iteration():
            observe(rl)
    rl.close()
    inst.close()
    assert keeper.steps == [1, 3]
    assert all(r.scalars["eval/deterministic/length"] == 3.0 for r in keeper.records)


def test_add_component_and_commit_step_on_a_bare_session():
    class Steps:
        def __init__(self):
            self.logged, self.closed = [], 0

        def log(self, logger, step):
            self.logged.append(step)
            logger.log_metrics({"seen": float(step)}, step=step)

        def close(self):
            self.closed += 1

    keeper = StepKeeper()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=2)
    comp = Steps()
    handle = inst.add_component(comp, name="steps")
    for i in range(4):
        with inst.step(i):
            pass
    assert inst.commit_step(7).scalars["seen"] == 7.0  # a step no block frames
    with inst.step(8):
        assert inst.commit_step(8) is None  # the open block commits, once
        with pytest.raises(ConfigurationError, match=r"commit_step\(9\) inside the open `with inst.step\(8\)`"):
            inst.commit_step(9)
    with pytest.raises(ConfigurationError, match="already registered"):
        inst.add_component(Steps(), name="steps")
    handle.remove()
    with inst.step(10):
        inst.logger.log_metrics({"user": 1.0}, step=10)
    assert comp.logged == [0, 2, 7, 8]  # not at step 10: removed
    assert inst.flush(timeout=60)
    assert keeper.steps == [0, 2, 7, 8, 10] and "seen" not in keeper.records[-1].scalars
    handle2 = inst.add_component(comp, name="steps")
    inst.close()
    assert comp.closed == 1 and handle2.name == "steps"
    with pytest.raises(ConfigurationError, match="needs a log"):
        instrument.Instrumentation(backends=[]).add_component(object())


def test_progress_bar_reads_its_declared_keys():
    stream = io.StringIO()
    bar = ProgressBar(
        enabled=True, stream=stream, reward_keys={"len": "{collection}/episode/length/mean"}, window=3
    )
    rl = RLLogging(collection=CollectionMetrics(group="cartpole", time_dim=0), progress=bar)
    rl.attach(Logger([]))
    assert bar.shown_keys() == {"frames": "counters/frames", "len": "collection/cartpole/episode/length/mean"}
    loop(rl, 3)  # env 0's episodes: 2 steps, then 2 carried + 2 in each later batch
    assert bar.bar.n == 24 and bar.recent_reward == pytest.approx((2 + 4 + 4) / 3)
    rl.close()
    assert "len 3.333" in stream.getvalue()


def test_progress_bar_default_keys_follow_the_collection_group_and_plain_lists_keep_working():
    bar = ProgressBar(enabled=False)
    assert bar.shown_keys() == {
        "frames": "counters/frames",
        "return": "collection/main/episode/return/mean",
        "reward": "collection/main/reward/mean",
    }
    RLLogging(collection=CollectionMetrics(group="cartpole"), progress=bar).attach(Logger([]))
    assert bar.shown_keys()["return"] == "collection/cartpole/episode/return/mean"
    listed = ProgressBar(reward_keys=["x/episode/return/mean", "y/reward"], frames_key="steps")
    assert listed.shown_keys() == {"frames": "steps", "return": "x/episode/return/mean", "reward": "y/reward"}
    with pytest.raises(ConfigurationError, match=r"ProgressBar key '\{colection\}/reward' has a placeholder"):
        ProgressBar(reward_keys={"reward": "{colection}/reward"})
    with pytest.raises(ConfigurationError, match="mapping label -> key or a list of keys"):
        ProgressBar(reward_keys="collection/main/reward/mean")


def test_frames_without_a_batch_are_counted_and_measure_nothing():
    keeper = StepKeeper()
    rl = RLLogging(progress=None).attach(Logger([keeper]))
    with rl.iteration():
        rl.observe_batch(None, frames=5)  # asynchronous collection: TorchRLHook passes only the frames
    with rl.iteration():
        observe(rl)
    assert rl.logger.flush(timeout=60)
    assert [r.scalars["counters/frames"] for r in keeper.records] == [5.0, 13.0]
    assert "collection/main/reward/mean" not in keeper.records[0].scalars
    assert rl.failures == {}
    with pytest.raises(ConfigurationError, match="got neither a batch nor frames"):
        rl.observe_batch()  # neither a batch nor frames: a mistake, said so
    with pytest.raises(ConfigurationError, match=r"unknown batch keyword\(s\) \['rewards'\]"):
        rl.observe_batch(rewards=torch.ones(2))


def test_progress_bar_total_can_be_set_while_drawing():
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream)
    rl = RLLogging(progress=bar).attach(Logger([]))
    bar.set_total(16)
    loop(rl, 2)
    rl.close()
    assert "16/16" in stream.getvalue().replace(".0", "")


def test_evaluation_is_set_before_attach():
    rl = RLLogging(progress=None)
    rl.evaluation = Evaluation()
    rl.attach(Logger([]))
    with pytest.raises(ConfigurationError, match="set after attach"):
        rl.evaluation = Evaluation()


def test_a_later_batch_without_the_reward_key_is_a_fault_not_the_end_of_training(caplog):
    """The first batches had a reward; iteration 2's lacks it. That batch's collection values are skipped with
    one report (the first batch's ConfigurationError would still propagate), training goes on, and the
    counters count every batch's frames."""
    inst = instrument.Instrumentation(backends=[], log_interval=1)
    rl = RLLogging(progress=None).attach(inst)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for iteration in range(4):
            with rl.iteration():
                if iteration == 2:
                    rl.observe_batch(done=torch.zeros(8, dtype=torch.bool))
                else:
                    rl.observe_batch(reward=torch.ones(8), done=torch.zeros(8, dtype=torch.bool))
    assert rl.counters.frames == 32
    assert inst.failures == {"collection": 1}
    assert "found no reward" in caplog.text
    rl.close()
    inst.close()
    fresh = instrument.Instrumentation(backends=[], log_interval=1)
    first = RLLogging(progress=None).attach(fresh)
    with pytest.raises(ConfigurationError, match="found no reward"):
        with first.iteration():
            first.observe_batch(done=torch.zeros(8, dtype=torch.bool))
    first.close()
    fresh.close()


def test_an_evaluation_without_a_runner_still_stops_the_run_when_it_first_falls_due():
    """Only data methods (on_batch, on_losses) turn a later ConfigurationError into a fault: Evaluation.log
    returned early (not due) at iterations 0 and 1, and its missing runner must still stop the run at 2."""
    from instrument.rl import Evaluation

    inst = instrument.Instrumentation(backends=[], log_interval=1)
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=16)).attach(inst)
    with pytest.raises(ConfigurationError, match="Evaluation has no episode runner"):
        for _ in range(6):
            with rl.iteration():
                rl.observe_batch(reward=torch.ones(8), done=torch.zeros(8, dtype=torch.bool))
    assert rl.counters.iterations == 2
    rl.close()
    inst.close()


def test_a_loop_committing_through_rl_logging_logs_its_hyperparameters_once(tmp_path):
    """RLLogging commits through inst.commit_step; the session's hyperparameters are logged there too, once."""
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=2, log_dir=str(tmp_path),
                                      hyperparams={"lr": 0.1, "envs": 8})
    rl = RLLogging(progress=None).attach(inst)
    loop(rl, 5)
    rl.close()
    inst.close()
    lines = [json.loads(line) for line in (inst.run.dir / "metrics.jsonl").read_text().splitlines()]
    params = [line["hyperparameters"] for line in lines if "hyperparameters" in line]
    assert len(params) == 1 and params[0]["lr"] == 0.1 and params[0]["envs"] == 8
    assert [line["step"] for line in lines if "metrics" in line] == [0, 2, 4]


def test_a_resumed_loop_whose_last_steps_reach_close_logs_its_hyperparameters(tmp_path):
    """A resumed CleanRL-style loop (no step blocks) whose iterations after the checkpoint are written only at
    close: its changed hyperparameters were never logged (close committed past the session)."""
    def session(resume, lr):
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=10, resume=resume,
                                          log_dir=str(tmp_path), run_name="r", hyperparams={"lr": lr})
        return inst, RLLogging(progress=None).attach(inst)

    inst, rl = session(False, 3e-4)
    loop(rl, 11)
    state = rl.state_dict()
    rl.close()
    inst.close()
    inst, rl = session(True, 1e-4)
    rl.load_state_dict(state)
    loop(rl, 5)  # iterations 11..15: no logging iteration, written at close
    rl.close()
    inst.close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [line["hyperparameters"]["lr"] for line in lines if "hyperparameters" in line] == [3e-4, 1e-4]
    assert [line["step"] for line in lines if "metrics" in line] == [0, 10, 15]
