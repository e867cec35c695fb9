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
    log.flush()  # backends are written on the logger's writer thread
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
    assert observer._states.results() is None


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


def test_small_states_are_batched_and_match_per_iteration_values():
    states = [torch.randn(256, 4) for _ in range(30)]
    batched = _observe(instrument.IterationStats(channel_dim=-1), states)
    one_by_one = instrument.IterationStats(channel_dim=-1)
    one_by_one._states.batched = False
    eager = _observe(one_by_one, states)
    assert batched.scalars.keys() == eager.scalars.keys()
    for key, value in eager.scalars.items():
        assert batched.scalars[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    np.testing.assert_array_equal(batched.images["iteration_stats/mean"], eager.images["iteration_stats/mean"])


def test_memory_cap_drains_early_and_keeps_iteration_order():
    states = [torch.full((4, 2), float(i)) for i in range(10)]
    observer = instrument.UpdateNorm(max_elements=40)  # 2 tensors x 8 elements per iteration: drains every 3
    record = _observe(observer, states)
    assert record.histograms["update_norm/l2"].shape == (9,)
    assert record.scalars["update_norm/l2/first"] == pytest.approx(np.sqrt(2.0))


def test_in_place_change_after_observe_is_detected_not_logged(caplog):

    keep = Keep()
    inst = instrument.Instrumentation([instrument.IterationStats(channel_dim=-1)], backends=[keep], log_interval=1)
    for step in range(2):
        with inst.step(step) as s:
            x = torch.zeros(8, 3)
            for i in range(4):
                nxt = x + 1
                s.observer(instrument.StepContext(x, nxt, step_index=i))
                if step == 0:
                    nxt.mul_(100.0)  # a rollout that updates its state in place after observing it
                x = nxt
    inst.close()
    assert "modified in place after it was observed" in caplog.text
    assert [r.step for r in keep.records] == [1]  # the corrupted step logged nothing
    assert keep.records[0].scalars["iteration_stats/max/c0"] == 4.0  # the next step reduced as it came
