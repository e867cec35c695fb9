"""Built-in observers against float64 NumPy references."""

import numpy as np
import pytest
import torch

import instrument
from instrument.observers.stats import channel_stats


class Keep(instrument.Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def _observe(observer, states, condition=None):
    keep = Keep()
    log = instrument.Logger([keep])
    observer.reset()
    with torch.no_grad():
        for i, (a, b) in enumerate(zip(states, states[1:], strict=False)):
            observer(instrument.StepContext(a, b, condition=condition, step_index=i))
    observer.log(log, step=0)
    log.commit()
    return keep.records[0]


def test_channel_stats_matches_numpy_float64():
    x = torch.randn(4, 7, 9, 11) * 3 + 1
    ref = x.double().numpy().transpose(1, 0, 2, 3).reshape(7, -1)
    got = channel_stats(x).double().numpy()
    np.testing.assert_allclose(got, np.stack([ref.mean(1), ref.std(1), ref.min(1), ref.max(1)]), rtol=1e-5, atol=1e-6)
    flat = torch.randn(64, 4)
    np.testing.assert_allclose(channel_stats(flat, channel_dim=-1)[0].numpy(), flat.double().numpy().mean(0),
                               rtol=1e-5, atol=1e-6)


def test_iteration_stats_heatmaps_cover_every_iteration_and_channel():
    states = [torch.randn(2, 3, 4, 4) for _ in range(6)]
    observer = instrument.IterationStats(max_channels=2)
    record = _observe(observer, states)
    assert record.scalars["iteration_stats/iterations"] == 5.0
    assert {k for k in record.scalars if k.startswith("iteration_stats/mean/")} == {
        "iteration_stats/mean/c0", "iteration_stats/mean/c1"}
    assert set(record.images) == {f"iteration_stats/{s}" for s in ("mean", "std", "min", "max")}
    assert record.scalars["iteration_stats/max/c1"] == pytest.approx(float(states[-1][:, 1].max()))
    # reset forgets the previous step
    observer.reset()
    assert observer._rows == []


def test_update_norm_and_alive_fraction():
    a = torch.zeros(2, 4, 3, 3)
    b = a.clone()
    b[0, 3, 0, 0] = 1.0  # one alive cell in sample 0
    b[1, 0] = 2.0  # sample 1 changes 9 cells by 2
    record = _observe(instrument.UpdateNorm(), [a, b])
    assert record.scalars["update_norm/l2/mean"] == pytest.approx((1.0 + 6.0) / 2)
    assert record.scalars["update_norm/alive/last"] == pytest.approx(1 / 18)
    assert record.histograms["update_norm/l2"].shape == (1,)


def test_update_norm_on_flat_rl_states_has_no_alive_metric():
    states = [torch.zeros(8, 4), torch.ones(8, 4)]
    record = _observe(instrument.UpdateNorm(name="obs_delta"), states)
    assert record.scalars["obs_delta/l2/last"] == pytest.approx(2.0)
    assert not any("alive" in k for k in record.scalars)


def test_observer_names_and_protocol():
    assert instrument.IterationStats().name == "iteration_stats"
    assert instrument.UpdateNorm("u").name == "u"

    class MyFancyObserver(instrument.Observer):
        def observe(self, context):
            pass

    assert MyFancyObserver().name == "my_fancy_observer"
    assert isinstance(MyFancyObserver(), instrument.StepObserver)
    with pytest.raises(NotImplementedError, match="must implement observe"):
        instrument.Observer().observe(None)


def test_step_context_validates_and_detaches():
    with pytest.raises(TypeError, match=r"StepContext.next_state must be a torch.Tensor or None, got list"):
        instrument.StepContext(torch.zeros(1), [1.0])
    with pytest.raises(TypeError, match="needs both previous_state and next_state"):
        instrument.StepContext(torch.zeros(1), None)
    ctx = instrument.StepContext(torch.zeros(2), torch.ones(2), dx=torch.full((2,), 5.0), freeze_channels=[0],
                                 probes={"h": torch.ones(1, requires_grad=True)})
    assert torch.equal(ctx.dx, torch.full((2,), 5.0)) and ctx.freeze_channels == (0,)
    assert not ctx.probes["h"].requires_grad
