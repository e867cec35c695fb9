"""RL metric keys never merge two statistics into one series: two components of one prefix, extra entries or
objective names that repeat a key of the component's own, and training entries that flatten to one name."""

import pytest
import torch

import instrument
from instrument import ConfigurationError, Logger
from instrument.rl import CollectionMetrics, Counters, RLComponent, RLLogging, TrainMetrics


def two_rewards(rl: RLLogging, n: int = 2) -> None:
    """Iterations whose batches hold a reward of 1.0 at ("next", "reward") and 100.0 at ("next", "reward_b")."""
    for _ in range(n):
        with rl.iteration():
            rl.observe_batch({"next": {"reward": torch.ones(2, 4, 1), "reward_b": torch.full((2, 4, 1), 100.0),
                                       "done": torch.zeros(2, 4, 1, dtype=torch.bool)}})
    rl.logger.flush()


class Custom(RLComponent):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix


def test_two_components_of_one_prefix_are_refused_when_the_set_is_made():
    # two CollectionMetrics left at group="main" (one per environment): rewards 1.0 and 100.0 read 50.5, and so did
    # their min and max
    with pytest.raises(ConfigurationError, match=r"'collection' and 'extra0' are two CollectionMetrics logging "
                                                 r"under the prefix 'collection/main'.*group="):
        RLLogging(collection=CollectionMetrics(mask_key=None), components=[CollectionMetrics(mask_key=None)],
                  progress=None)
    with pytest.raises(ConfigurationError, match=r"'counters' and 'extra0' are two Counters.*register one Counters"):
        RLLogging(components=[Counters()], progress=None)  # beside the set's own counters
    # a subclass logs its base's keys: compared as its base (a review: it still averaged the two environments)
    with pytest.raises(ConfigurationError, match="'collection' and 'extra0' are two CollectionMetrics"):
        RLLogging(collection=Subclassed(mask_key=None), components=[CollectionMetrics(mask_key=None)], progress=None)
    with pytest.raises(ConfigurationError, match="lists one CollectionMetrics instance twice"):
        metrics = CollectionMetrics()
        RLLogging(collection=metrics, components=[metrics], progress=None)
    with pytest.raises(ConfigurationError, match="must be RLComponent instances, got NoneType"):
        RLLogging(components=[None], progress=None)  # only the built-ins are turned off by None
    # counters that are not logged leave their prefix free; components with no prefix name their keys themselves;
    # a component of another class may add keys under a built-in's prefix, and two components whose keys depend on
    # what they log may share one (a review: refusing those was too broad)
    RLLogging(counters=None, components=[Counters(), Custom(""), Custom(""), Custom("collection/main"),
                                         Custom("custom"), Custom("custom/"), TrainMetrics(include=["loss_a"])],
              progress=None)
    # what the error says to do: one group per environment, each written on its own
    history = instrument.RunHistoryBackend()
    env_b = CollectionMetrics(group="env_b", reward_key=("next", "reward_b"), mask_key=None)
    rl = RLLogging(collection=CollectionMetrics(mask_key=None), components=[env_b], progress=None)
    two_rewards(rl.attach(Logger([history])))
    rl.close_session()
    for stat in ("mean", "min", "max"):
        assert list(history.metrics[f"collection/main/reward/{stat}"]) == [(0, 1.0), (1, 1.0)]
        assert list(history.metrics[f"collection/env_b/reward/{stat}"]) == [(0, 100.0), (1, 100.0)]


class Subclassed(CollectionMetrics):
    pass


def test_a_collection_set_after_the_set_was_made_is_checked_at_attach_and_close_still_closes():
    rl = RLLogging(collection=None, components=[CollectionMetrics(mask_key=None)], progress=None)
    rl.collection = CollectionMetrics(mask_key=None)
    with pytest.raises(ConfigurationError, match=r"'collection' and 'extra0' are two CollectionMetrics"):
        rl.attach(Logger([]))
    assert not rl.attached
    closed = []
    rl.extra.append(Closing(closed))
    rl.close()  # a review: the close of a set whose attach was refused raised the same error, closing nothing
    assert closed == [True]


class Closing(RLComponent):
    prefix = ""

    def __init__(self, closed):
        self.closed = closed

    def close(self):
        self.closed.append(True)


def test_two_components_of_one_class_and_prefix_are_refused_by_add_component_too(tmp_path):
    """The prefix check covered the members of one RLLogging set only: two CollectionMetrics registered with
    inst.add_component (the docs' other route) still averaged rewards 1.0 and 100.0 into 50.5 (a review)."""
    inst = instrument.Instrumentation(backends=[], log_dir=str(tmp_path), run_name="r")
    inst.add_component(CollectionMetrics(mask_key=None), name="env_a")
    with pytest.raises(ConfigurationError, match=r"'env_a' and 'env_b' are two CollectionMetrics logging under "
                                                 r"the prefix 'collection/main'.*group="):
        inst.add_component(CollectionMetrics(mask_key=None), name="env_b")
    with pytest.raises(ConfigurationError, match="are two CollectionMetrics"):  # not the default name's clash first
        inst.add_component(CollectionMetrics(mask_key=None))
    with pytest.raises(ConfigurationError, match="are two Subclassed"):  # a subclass logs its base's keys
        inst.add_component(Subclassed(mask_key=None), name="env_c")
    inst.add_component(CollectionMetrics(group="b", mask_key=None), name="env_b")  # its own group: fine
    inst.add_component(CollectionMetrics(mask_key=None), name="quiet", logs=False)  # logs nothing: fine
    # components whose keys depend on what they log may share a prefix (a review: disjoint ones were refused)
    inst.add_component(TrainMetrics(include=["loss_actor"]), name="actor")
    inst.add_component(TrainMetrics(include=["loss_critic"]), name="critic")
    inst.close()


def vector_batch():
    n, t = 2, 4
    return {"next": {"reward": torch.ones(n, t, 1), "done": torch.zeros(n, t, 1, dtype=torch.bool),
                     "shaped": torch.full((n, t, 1), 10.0),
                     "vec": torch.stack([torch.ones(n, t), 2 * torch.ones(n, t)], -1)}}


@pytest.mark.parametrize("name", ["reward", "episode/return", "episode/length", "reward/obj1", "episode/return/obj0",
                                  "reward/x"])
def test_an_extra_entry_named_like_a_statistic_of_the_component_is_refused(name):
    # keys={"reward": ...} replaced the reward statistics: reward/mean read the extra's 10.0 instead of 1.0; under a
    # vector reward, reward/<objective> and episode/return/<objective> are its objectives' statistics
    names = ["x", "y"] if name == "reward/x" else None
    with pytest.raises(ConfigurationError, match=rf"extra entry '{name}'.*component's own.*keys=\{{'extra/{name}'"):
        CollectionMetrics(keys={name: ("next", "shaped")}, reward_weights=[1.0, 1.0], objective_names=names)
    if name not in ("reward", "episode/return", "episode/length"):  # a scalar reward has no objective to clash with,
        CollectionMetrics(keys={name: ("next", "shaped")})
        CollectionMetrics(keys={name: ("next", "shaped")}, reward_weights=[1.0])  # nor does a one-objective one


@pytest.mark.parametrize("names", [["x", "x"], ["x", ""], "xy", ["x", 1]])
def test_objective_names_that_would_share_a_key_are_refused(names):
    # objective_names=["x", "x"] kept only objective 1 under reward/x/...; objective 0 was lost
    with pytest.raises(ConfigurationError, match="objective_names must be unique, non-empty strings"):
        CollectionMetrics(reward_weights=[1.0, 1.0], objective_names=names)


def test_extra_entries_and_objectives_named_apart_are_each_written():
    with pytest.raises(ConfigurationError, match="extra entry 'reward'"):  # the review's two cases, then the fix
        CollectionMetrics(group="a", keys={"reward": ("next", "shaped")})
    with pytest.raises(ConfigurationError, match="objective_names must be unique"):
        CollectionMetrics(group="b", reward_key=("next", "vec"), reward_weights=[1.0, 1.0], objective_names=["x", "x"])
    history = instrument.RunHistoryBackend()
    logger = Logger([history])
    shaped = ("next", "shaped")
    extra = CollectionMetrics(group="a", keys={"extra/reward": shaped, "episode/success": shaped}, mask_key=None)
    objectives = CollectionMetrics(group="b", reward_key=("next", "vec"), reward_weights=[1.0, 1.0],
                                   objective_names=["x", "y"], mask_key=None)
    for metrics in (extra, objectives):
        metrics.update(vector_batch())
        metrics.log(logger, 0)
    logger.commit(0)
    logger.close()
    last = {key: series[-1][1] for key, series in history.metrics.items()}
    assert last["collection/a/reward/mean"] == 1.0 and last["collection/a/extra/reward/mean"] == 10.0
    assert last["collection/a/episode/success/max"] == 10.0
    assert last["collection/b/reward/x/mean"] == 1.0 and last["collection/b/reward/y/mean"] == 2.0
    assert last["collection/b/reward/mean"] == 3.0


def history_of(*calls, reduce_stats=False):
    """What a TrainMetrics fed ``calls`` (one on_losses each) writes at step 0, and the errors the calls raised."""
    history = instrument.RunHistoryBackend()
    logger = Logger([history])
    metrics = TrainMetrics(group="g", reduce_stats=reduce_stats)
    errors = []
    for losses in calls:
        try:
            metrics.on_losses(losses)
        except ConfigurationError as exc:
            errors.append(str(exc))
    metrics.log(logger, 0)
    logger.commit(0)
    logger.close()
    return {key: series[-1][1] for key, series in history.metrics.items()}, errors


def test_two_training_entries_of_one_call_that_flatten_to_one_name_are_not_merged():
    # {"a/b": 1, "a": {"b": 3}} gave train/main/a/b = 2.0, one average of two different statistics
    got, errors = history_of({"a/b": torch.tensor(1.0), "a": {"b": torch.tensor(3.0)}, "c": 2.0},
                             {"a/b": 5.0, "c": 4.0})  # one value per name: a/b is that entry's
    assert got == {"train/g/c": 3.0, "train/g/a/b": 5.0}
    assert len(errors) == 1 and "2 entries flatten to the name 'a/b'" in errors[0]
    assert "the other entries were added" in errors[0]


@pytest.mark.parametrize("first", ["entry", "statistic"])
def test_a_training_entry_named_like_another_entrys_statistic_is_refused(first):
    # reduce_stats=True and the user's own 'adv/max' beside 'adv': adv/max read 4.5, the true max 6.0 was lost
    updates = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])]
    if first == "entry":
        got, errors = history_of(*({"adv": adv, "adv/max": adv.max()} for adv in updates), reduce_stats=True)
        assert got == {"train/g/adv": 3.5, "train/g/adv/min": 1.0, "train/g/adv/max": 6.0}
        assert len(errors) == 2 and "entry 'adv/max' would be logged as train/g/adv/max" in errors[0]
    else:  # the statistic's entry came first: it keeps its series, 'adv' is refused
        got, errors = history_of({"adv/max": updates[0].max()}, *({"adv": adv} for adv in updates),
                                 reduce_stats=True)
        assert got == {"train/g/adv/max": 3.0, "train/g/adv/max/min": 3.0, "train/g/adv/max/max": 3.0}
        assert len(errors) == 2 and "entry 'adv' would log its max as train/g/adv/max" in errors[0]
    # without min and max the two keys are apart
    got, errors = history_of(*({"adv": adv, "adv/max": adv.max()} for adv in updates))
    assert got == {"train/g/adv": 3.5, "train/g/adv/max": 4.5} and errors == []


def test_under_rl_logging_a_clash_stops_the_first_call_and_is_a_reported_fault_later(caplog):
    history = instrument.RunHistoryBackend()
    rl = RLLogging(collection=None, training=TrainMetrics(reduce_stats=True), progress=None).attach(Logger([history]))
    with pytest.raises(ConfigurationError, match="'adv/max' would be logged as train/main/adv/max"):
        rl.observe_losses({"adv": torch.tensor([1.0, 2.0]), "adv/max": 2.0})  # set up wrong: fix the names
    for losses in ({"adv": torch.tensor([3.0])}, {"adv": torch.tensor([9.0]), "a/b": 1.0, "a": {"b": 2.0}}):
        with rl.iteration():  # worked once: a loss dict that changes mid-run is a fault, not the end of training
            rl.observe_losses(losses)
    rl.close_session()
    assert rl.failures == {"training": 1}
    assert "2 entries flatten to the name 'a/b'" in caplog.text
    # the true maxima (the first call's adv values count, its refused 'adv/max' entry does not), and no a/b
    assert [value for _, value in history.metrics["train/main/adv/max"]] == [3.0, 9.0]
    assert "train/main/a/b" not in history.metrics
