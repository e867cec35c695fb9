"""Plug-ins are kept apart: no observer sees an iteration twice or shares its keys with another, no backend
changes what the others write, and every plug-in's failures and run id are its own.

Everything is read back from real backends (JSONL lines, two MLflow stores with MlflowClient)."""

import json
import logging

import pytest
import torch
from torch import nn

import instrument
from instrument import ConfigurationError
from instrument.backends.base import StepRecord
from instrument.rl import RLComponent, RLLogging


class Rule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return x + 0.1 * torch.tanh(self.conv(x))


def _metrics(path):
    return {line["step"]: line["metrics"] for line in map(json.loads, path.read_text().splitlines()) if "step" in line}


def _run(tmp_path, observers, backends=(), steps=2, iterations=3):
    inst = instrument.Instrumentation(observers=observers, backends=[instrument.JsonlBackend(), *backends],
                                      log_interval=1, log_dir=str(tmp_path), overhead_budget=None)
    rule = Rule()
    inst.watch(rule)
    for step in range(steps):
        with inst.step(step):
            x = torch.ones(2, 4, 5, 5)
            for _ in range(iterations):
                x = rule(x)
            inst.log({"loss": 1.0})
    inst.close()
    return inst, _metrics(inst.run.dir / "metrics.jsonl")


def test_observers_given_as_a_generator_are_all_kept(tmp_path):
    inst, metrics = _run(tmp_path, (o for o in [instrument.IterationStats()]))  # a check used it up, unnoticed
    assert len(inst.observers) == 1 and metrics[0]["iteration_stats/iterations"] == 3.0


def test_rl_components_given_as_a_generator_are_all_kept():
    class Extra(RLComponent):
        pass

    assert len(RLLogging(progress=None, components=(c for c in [Extra()])).extra) == 1


def test_one_observer_instance_listed_twice_is_refused():
    stats = instrument.IterationStats()
    with pytest.raises(ConfigurationError, match="lists one IterationStats instance twice"):
        instrument.Instrumentation(observers=[stats, stats], backends=[])


def test_two_observers_of_one_name_are_refused_with_how_to_name_them():
    with pytest.raises(ConfigurationError, match=r"two observers are named 'grad_stats'.*name='grad_stats_2'"):
        instrument.Instrumentation(observers=[instrument.GradientStats(per="global"),
                                              instrument.GradientStats(per="global")], backends=[])
    # named apart, both are written
    inst = instrument.Instrumentation(observers=[instrument.GradientStats(per="global"),
                                                 instrument.GradientStats(per="global", name="critic")], backends=[])
    inst.close()


def test_observer_names_are_compared_as_the_logger_writes_them():
    # log_metrics strips a prefix's trailing '/': 'stats' and 'stats/' would both write stats/... (averaged into
    # one series), while the second's heatmaps went to stats//mean
    with pytest.raises(ConfigurationError, match=r"named 'stats/', which ends with '/'.*\(name='stats'\)"):
        instrument.Instrumentation(observers=[instrument.IterationStats(name="stats"),
                                              instrument.IterationStats(name="stats/")], backends=[])
    with pytest.raises(ConfigurationError, match="ends with '/'"):  # alone too: its scalars and media disagree
        instrument.Instrumentation(observers=[instrument.IterationStats(name="stats//")], backends=[])


def test_one_component_instance_registered_twice_is_refused():
    class Counter:
        def log(self, logger, step):
            pass

    inst = instrument.Instrumentation(backends=[])
    counter = Counter()
    inst.add_component(counter)
    with pytest.raises(ConfigurationError, match="already registered"):
        inst.add_component(counter, name="again")
    inst.close()


class Scales(instrument.Backend):
    """A backend that changes the record it gets (as a careless user backend might)."""

    def write(self, record):
        record.scalars["injected"] = 1.0


class Rebinds(instrument.Backend):
    def write(self, record):
        record.scalars = {"x": 1000.0}


class ScalesImages(instrument.Backend):
    def write(self, record):
        for image in record.images.values():
            image *= 0


@pytest.mark.parametrize("careless", [Scales, Rebinds, ScalesImages])
def test_a_backend_cannot_change_the_record_every_other_backend_writes(tmp_path, caplog, careless):
    history = instrument.RunHistoryBackend()
    backend = careless()
    logger = instrument.Logger([backend, instrument.JsonlBackend(), history], instrument.RunInfo("r", tmp_path))
    image = torch.full((2, 2), 0.5)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for step in range(2):
            logger.log_metrics({"x": 1.0}, step=step)
            logger.log_image("img", image, step)
            handle = logger.commit(step)
        logger.close()
    assert _metrics(tmp_path / "r" / "metrics.jsonl") == {0: {"x": 1.0}, 1: {"x": 1.0}}
    assert history.series("x")[1].tolist() == [1.0, 1.0]
    assert handle.scalars == {"x": 1.0} and (handle.images["img"][..., :3] == 128).all()
    assert logger.failures == {careless.__name__: 2}  # refused in that backend alone, said once
    assert "read-only" in caplog.text


class ChangesSampleLists(instrument.Backend):
    """Changes the lists inside sample fields, and deletes the record's fields (a review: both went through)."""

    def __init__(self):
        self.refused = []

    def write(self, record):
        row = record.samples["val"].rows[0]
        for change in (lambda: row["input"].append(99), lambda: row["input"].sort(reverse=True),
                       lambda: row["input"].__setitem__(0, -5), lambda: row["nested"][1][1].pop(),
                       lambda: row["nested"][2]["k"].clear(), lambda: delattr(record, "scalars"),
                       lambda: delattr(record, "_frozen")):
            try:
                change()
            except (TypeError, AttributeError) as exc:
                self.refused.append("read-only" in str(exc))


class Reads(instrument.Backend):
    def __init__(self):
        self.seen = []

    def write(self, record):
        self.seen.append((dict(record.scalars), repr(record.samples["val"].rows[0])))


def test_a_backend_cannot_change_a_sample_field_or_delete_a_field_of_the_record(tmp_path):
    careless, reads = ChangesSampleLists(), Reads()
    logger = instrument.Logger([careless, reads, instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    row = {"input": torch.tensor([3, 1, 2]), "nested": ([0], [1, [2, 3]], {"k": [4]})}
    logger.log_samples("val", [row], step=0)
    logger.log_metrics({"x": 1.0}, step=0)
    handle = logger.commit(0)
    logger.close()
    assert careless.refused == [True] * 7 and logger.failures == {}
    written = "{'input': [3, 1, 2], 'nested': ([0], [1, [2, 3]], {'k': [4]})}"
    assert reads.seen == [({"x": 1.0}, written)] and repr(handle.samples["val"].rows[0]) == written
    line = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert line[0]["metrics"] == {"x": 1.0}
    import copy
    import pickle

    assert type(copy.copy(handle.samples["val"].rows[0]["input"])) is list
    assert pickle.loads(pickle.dumps(handle.samples["val"].rows[0]["nested"])) == ([0], [1, [2, 3]], {"k": [4]})


def test_a_record_reads_and_copies_as_plain_data():
    record = StepRecord(step=3, scalars={"a": 1.0}, timings={"t": {"mean": 0.5}}).freeze()
    assert json.loads(json.dumps(record.scalars)) == {"a": 1.0} and dict(record.scalars) == {"a": 1.0}
    import copy
    import pickle

    assert type(copy.deepcopy(record.scalars)) is dict and pickle.loads(pickle.dumps(record)).scalars == {"a": 1.0}
    with pytest.raises(TypeError, match="read-only"):
        record.timings["t"]["mean"] = 0.0


class Flaky(instrument.Backend):
    def __init__(self, fails_from):
        self.fails_from = fails_from

    def write(self, record):
        if record.step >= self.fails_from:
            raise RuntimeError(f"fails from step {self.fails_from}")


def test_two_backends_of_one_class_have_their_own_name_failures_and_first_report(tmp_path, caplog):
    first, second = Flaky(0), Flaky(2)
    logger = instrument.Logger([first, second], instrument.RunInfo("r", tmp_path))
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for step in range(4):
            logger.log_metrics({"x": 1.0}, step=step)
            logger.commit(step)
        logger.close()
    assert (first.name, second.name) == ("Flaky", "Flaky#2")
    assert logger.failures == {"Flaky": 4, "Flaky#2": 2}
    reported = [r.getMessage() for r in caplog.records if "failed in write()" in r.getMessage()]
    assert len(reported) == 2 and any("'Flaky#2'" in m for m in reported)  # the second's first failure is said


def test_a_number_given_in_one_logger_is_not_kept_by_the_instance_in_the_next(tmp_path):
    """A review found ``Flaky#2`` kept by the instance given alone to a later logger: its failures and its run id
    in ``run.json`` went under a name that a fresh instance of the class does not have."""

    class Named(instrument.Backend):
        name = "custom"  # a class attribute: numbered through an instance attribute

        def write(self, record):
            pass

    first, second, third, fourth = Flaky(99), Flaky(99), Named(), Named()
    instrument.Logger([first, second, third, fourth], instrument.RunInfo("a", tmp_path)).close()
    assert (second.name, fourth.name) == ("Flaky#2", "custom#2")
    alone = instrument.Logger([second, fourth], instrument.RunInfo("b", tmp_path))
    assert (second.name, fourth.name) == ("Flaky", "custom")
    alone.close()
    again = instrument.Logger([Flaky(99), second, Named(), fourth], instrument.RunInfo("c", tmp_path))
    assert (second.name, fourth.name) == ("Flaky#2", "custom#2")  # numbered afresh, never "Flaky#2#2"
    again.close()


def test_an_observer_and_a_backend_of_one_name_are_counted_apart(tmp_path):
    class Broken(instrument.Observer):
        def observe(self, context):
            raise RuntimeError("observer")

    class FlakyBackend(instrument.Backend):
        def write(self, record):
            raise RuntimeError("backend")

    inst, _ = _run(tmp_path, [Broken(name="FlakyBackend")], backends=[FlakyBackend()], steps=3)
    assert inst.failures == {"observer FlakyBackend": 3, "backend FlakyBackend": 3}


def test_two_mlflow_backends_resume_their_own_runs(tmp_path):
    mlflow = pytest.importorskip("mlflow")

    def backends():
        return [instrument.MlflowBackend(tracking_uri=f"sqlite:///{tmp_path}/{store}.db") for store in "ab"]

    a, b = backends()
    inst = instrument.Instrumentation(backends=[a, b], log_dir=str(tmp_path), run_name="r", log_interval=1)
    with inst.step(0):
        inst.logger.log_metrics({"x": 1.0}, step=0)
    state = inst.state_dict()
    inst.close()
    a2, b2 = backends()
    inst = instrument.Instrumentation(backends=[a2, b2], log_dir=str(tmp_path), run_name="r", resume=True,
                                      log_interval=1)
    inst.load_state_dict(state)
    with inst.step(1):
        inst.logger.log_metrics({"x": 2.0}, step=1)
    inst.close()
    assert (a2.run_id, b2.run_id) == (a.run_id, b.run_id) and inst.failures == {}
    for store, run_id in (("a", a.run_id), ("b", b.run_id)):
        client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/{store}.db")
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "x")] == [(0, 1.0), (1, 2.0)]


def test_an_observer_cannot_change_the_context_the_next_observer_sees(tmp_path):
    class Rebinds(instrument.Observer):
        def observe(self, context):
            context.next_state = context.next_state * 0

    seen = []
    inst, _ = _run(tmp_path, [Rebinds(), lambda c: seen.append(float(c.next_state.abs().sum()))], steps=1)
    assert seen and all(value > 0 for value in seen)  # the next observer saw the real state
    assert inst.failures == {"rebinds": 1}  # refused (read-only), said once, skipped for the step


def test_an_observer_whose_init_skips_super_still_logs_under_its_default_name(tmp_path):
    class Counter(instrument.Observer):
        def __init__(self):  # no super().__init__(): its name was missing, and every log raised
            self.seen = 0

        def observe(self, context):
            self.seen += 1

        def log(self, logger, step):
            logger.log_metrics({"seen": self.seen}, step=step, prefix=self.name)

        def reset(self):
            self.seen = 0

    inst, metrics = _run(tmp_path, [Counter()], steps=1)
    assert metrics[0]["counter/seen"] == 3.0 and inst.failures == {}


class ChangesSamples(instrument.Backend):
    def write(self, record):
        for table in record.samples.values():
            table.rows[0]["score"] = -999.0


class AddsSamples(instrument.Backend):
    def write(self, record):
        for table in record.samples.values():
            table.rows.append({"score": 1.0})


@pytest.mark.parametrize("careless", [ChangesSamples, AddsSamples])
def test_a_backend_cannot_change_the_samples_every_other_backend_writes(tmp_path, careless):
    logger = instrument.Logger([careless(), instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    logger.log_samples("val", [{"input": "a", "output": "b", "score": 0.5}], step=0)
    handle = logger.commit(0)
    logger.close()
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["samples"]["val"] == [{"input": "a", "output": "b", "score": 0.5}]
    assert [dict(row) for row in handle.samples["val"].rows] == [{"input": "a", "output": "b", "score": 0.5}]
    assert logger.failures == {careless.__name__: 1}


def test_the_default_name_changes_nothing_else_about_an_observers_attributes():
    class LinearProbe(instrument.Observer, nn.Module):  # an observer that owns a layer
        def __init__(self):
            instrument.Observer.__init__(self)
            nn.Module.__init__(self)
            self.head = nn.Linear(4, 2)

        def observe(self, context):
            pass

    probe = LinearProbe()
    assert isinstance(probe.head, nn.Linear) and probe.name == "linear_probe"  # nn.Module still finds its layer

    class Windowed(instrument.Observer):
        @property
        def window(self):
            return self._windw_size  # a typo inside a property

        def observe(self, context):
            pass

    with pytest.raises(AttributeError, match="_windw_size"):  # the typo is named, not the property
        _ = Windowed().window
