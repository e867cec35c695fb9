"""TrainMetrics: any dict / TensorDict of losses reduced to scalars with stable names."""

import numpy as np
import pytest
import torch

from instrument import Logger
from instrument.rl import TrainMetrics

TensorDict = pytest.importorskip("tensordict").TensorDict  # the 'torchrl' extra


def logged(component, step: int = 0):
    logger = Logger([])
    component.log(logger, step)
    record = logger.commit(step)
    return {} if record is None else record.scalars


def test_nested_tensordict_and_dict_entries_get_joined_names_and_means_over_updates():
    metrics = TrainMetrics(group="ppo")
    metrics.update(
        TensorDict({"loss_actor": torch.tensor(1.0), "stats": {"ratio": torch.tensor([1.0, 3.0])}}, [])
    )
    metrics.update(
        {
            "loss_actor": torch.tensor(3.0),
            "stats": {"ratio": torch.tensor([[2.0, 2.0]])},
            ("extra", "lr"): 0.5,
            "clipped": torch.tensor([True, False, False, False]),
        }
    )
    got = logged(metrics)
    assert got == {
        "train/ppo/loss_actor": 2.0,
        "train/ppo/stats/ratio": 2.0,
        "train/ppo/extra/lr": 0.5,
        "train/ppo/clipped": 0.25,
    }


def test_reduce_stats_adds_min_and_max_and_the_next_interval_starts_fresh():
    metrics = TrainMetrics(reduce_stats=True)
    metrics.update({"loss": torch.tensor([1.0, 5.0]), "kl": np.float32(0.25)})
    metrics.update({"loss": torch.tensor(-1.0)})
    got = logged(metrics)
    assert got["train/main/loss"] == pytest.approx(5 / 3)
    assert got["train/main/loss/min"] == -1.0 and got["train/main/loss/max"] == 5.0
    assert got["train/main/kl"] == 0.25
    metrics.update({"loss": torch.tensor(7.0)})
    assert logged(metrics, 1) == {
        "train/main/loss": 7.0,
        "train/main/loss/min": 7.0,
        "train/main/loss/max": 7.0,
    }


def test_include_exclude_and_skipped_entries():
    metrics = TrainMetrics(include=["loss"], exclude=["loss/debug"])
    metrics.update(
        {
            "loss": {"a": torch.tensor(1.0), "debug": torch.tensor(9.0)},
            "entropy": torch.tensor(2.0),
            "nothing": None,
        }
    )
    metrics.update({"loss": {"a": torch.empty(0)}})  # empty tensors count as no value
    assert logged(metrics) == {"train/main/loss/a": 1.0}


def test_bad_inputs_are_explained():
    with pytest.raises(
        TypeError, match=r"takes a dict or TensorDict.*wrap a single loss as \{'loss': loss\}"
    ):
        TrainMetrics().update(torch.tensor(1.0))
    with pytest.raises(TypeError, match="training entry 'name' has type str"):
        TrainMetrics().update({"name": "ppo"})
