"""RL metric keys never merge two statistics into one series: two components of one prefix, extra entries or
objective names that repeat a key of the component's own, and training entries that flatten to one name."""

import pytest
import torch

import instrument
from instrument import ConfigurationError, Logger
from instrument.rl import CollectionMetrics, Evaluation, RLComponent, RLLogging


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
    with pytest.raises(ConfigurationError, match=r"'collection' \(CollectionMetrics\) and 'extra0' \(Collection"
                                                 r"Metrics\) both log under the prefix 'collection/main'.*group="):
        RLLogging(collection=CollectionMetrics(mask_key=None), components=[CollectionMetrics(mask_key=None)],
                  progress=None)
    with pytest.raises(ConfigurationError, match="prefix 'collection/main'"):  # as log_metrics writes it
        RLLogging(components=[Custom("collection/main/")], progress=None)
    with pytest.raises(ConfigurationError, match="prefix 'custom'.*another prefix"):
        RLLogging(components=[Custom("custom"), Custom("custom")], progress=None)
    with pytest.raises(ConfigurationError, match="lists one CollectionMetrics instance twice"):
        metrics = CollectionMetrics()
        RLLogging(collection=metrics, components=[metrics], progress=None)
    with pytest.raises(ConfigurationError, match="must be RLComponent instances, got NoneType"):
        RLLogging(components=[None], progress=None)  # only the built-ins are turned off by None
    # counters that are not logged leave their prefix free; components with no prefix name their keys themselves
    RLLogging(counters=None, components=[Custom("counters"), Custom(""), Custom("")], progress=None)
    # what the error says to do: one group per environment, each written on its own
    history = instrument.RunHistoryBackend()
    env_b = CollectionMetrics(group="env_b", reward_key=("next", "reward_b"), mask_key=None)
    rl = RLLogging(collection=CollectionMetrics(mask_key=None), components=[env_b], progress=None)
    two_rewards(rl.attach(Logger([history])))
    rl.close_session()
    for stat in ("mean", "min", "max"):
        assert list(history.metrics[f"collection/main/reward/{stat}"]) == [(0, 1.0), (1, 1.0)]
        assert list(history.metrics[f"collection/env_b/reward/{stat}"]) == [(0, 100.0), (1, 100.0)]


def test_an_evaluation_set_after_the_set_was_made_is_checked_at_attach():
    rl = RLLogging(components=[Custom("eval")], progress=None)
    rl.evaluation = Evaluation(every_frames=8)
    with pytest.raises(ConfigurationError, match=r"'evaluation' \(Evaluation\) and 'extra0' \(Custom\)"):
        rl.attach(Logger([]))
    assert not rl.attached



def vector_batch():
    n, t = 2, 4
    return {"next": {"reward": torch.ones(n, t, 1), "done": torch.zeros(n, t, 1, dtype=torch.bool),
                     "shaped": torch.full((n, t, 1), 10.0),
                     "vec": torch.stack([torch.ones(n, t), 2 * torch.ones(n, t)], -1)}}


@pytest.mark.parametrize("name", ["reward", "episode/return", "episode/length", "reward/x", "reward/",
                                  "episode/return/x"])
def test_an_extra_entry_named_like_a_statistic_of_the_component_is_refused(name):
    # keys={"reward": ...} replaced the reward statistics: reward/mean read the extra's 10.0 instead of 1.0
    with pytest.raises(ConfigurationError, match=rf"extra entry '{name}'.*component's own.*keys=\{{'extra/{name}'"):
        CollectionMetrics(keys={name: ("next", "shaped")})


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
