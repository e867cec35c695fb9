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


def test_a_float8_entry_is_reduced_exactly_and_a_failed_interval_leaves_nothing_to_the_next():
    """torch has no min or max of float8 on a CPU: an entry of it failed the interval at log time, and the entries
    reduced before it stayed in their accumulators, so the next interval logged step 0's values with its own
    (loss 0.5 and min 0.0 where the reference is 1.0). float8 values are now reduced in float32, which holds them."""
    values = torch.tensor([0.5, 1.75, -3.0, 448.0]).to(torch.float8_e4m3fn)
    metrics = TrainMetrics(reduce_stats=True)
    metrics.update({"loss": torch.tensor(0.0), "q8": values})
    got = logged(metrics)
    exact = values.double().numpy()
    assert got["train/main/q8"] == pytest.approx(exact.mean(), rel=1e-12)
    assert got["train/main/q8/min"] == exact.min() and got["train/main/q8/max"] == exact.max()
    metrics.update({"loss": torch.tensor(1.0)})
    got = logged(metrics, 1)
    assert got["train/main/loss"] == 1.0 and got["train/main/loss/min"] == 1.0


@pytest.mark.parametrize("value, dtype", [(np.array([1 + 5j]), "complex128"), (np.array(["1.5", "2.5"]), "<U3"),
                                          (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64")])
def test_a_numpy_array_of_no_real_numbers_is_refused_by_name(value, dtype):
    """A complex array was logged as its real part (1.0, with only NumPy's ComplexWarning), strings were parsed and
    dates counted in days; the docs say such an entry is refused, naming it."""
    metrics = TrainMetrics()
    with pytest.raises(TypeError, match=rf"training entry 'x' is a NumPy array of dtype {dtype}.*expected real "
                                        r"numbers.*\(the other entries were added\)"):
        metrics.update({"x": value, "loss": 2.0})
    assert logged(metrics) == {"train/main/loss": 2.0}


def test_a_tuple_key_with_parts_that_are_not_str_is_joined_as_text():
    metrics = TrainMetrics()
    metrics.update({("loss", 0): 1.5, ("loss", 1): torch.tensor(2.5)})
    assert logged(metrics) == {"train/main/loss/0": 1.5, "train/main/loss/1": 2.5}
