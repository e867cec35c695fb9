"""StateHistogram: per-channel histograms read back from real TensorBoard event files vs float64 NumPy."""

import numpy as np
import pytest
import torch

import instrument
from instrument.errors import ConfigurationError
from instrument.observers.buffer import ModifiedInPlaceError
from tests.conftest import event_accumulator
from tests.test_checkpointing import Sink


def _states(shape=(3, 12, 6, 6), n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    out = [x]
    for i in range(n):
        x = torch.tanh(x + 0.5 * torch.randn(shape, generator=g)) * (i + 1)
        out.append(x)
    return out


def _run(tmp_path, observer, states, steps=(0,), watch_rule=None):
    inst = instrument.Instrumentation([observer], backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r")
    for step in steps:
        with inst.step(step) as s:
            for i in range(len(states) - 1):
                s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    return event_accumulator(tmp_path / "r")


def _check(hist, values: np.ndarray) -> None:
    """A TensorBoard histogram against float64 NumPy: count, min, max, sum, sum of squares."""
    v = values.astype(np.float64).reshape(-1)
    assert hist.num == v.size
    assert hist.min == pytest.approx(v.min(), rel=1e-7)
    assert hist.max == pytest.approx(v.max(), rel=1e-7)
    assert hist.sum == pytest.approx(v.sum(), rel=1e-6, abs=1e-6)
    assert hist.sum_squares == pytest.approx((v * v).sum(), rel=1e-6)
    assert sum(hist.bucket) == v.size


def test_last_and_chosen_iterations_match_float64_numpy(tmp_path):
    states = _states()
    acc = _run(tmp_path, instrument.StateHistogram(iterations=(0, -1, -3)), states, steps=(0, 3))
    tags = set(acc.Tags()["histograms"])
    channels = [f"c{k:02d}" for k in range(12)]  # 12 channels: zero-padded as IterationStats pads them
    assert tags == {f"state_hist/{c}{s}" for c in channels for s in ("", "/it0", "/it-3")}
    for k, c in enumerate(channels):
        for suffix, state in (("", states[-1]), ("/it0", states[1]), ("/it-3", states[-3])):
            events = acc.Histograms(f"state_hist/{c}{suffix}")
            assert [e.step for e in events] == [0, 3]
            _check(events[-1].histogram_value, state[:, k].double().numpy())


def test_flat_states_channel_dim_and_names(tmp_path):
    states = _states(shape=(64, 4), n=3)
    observer = instrument.StateHistogram(channel_dim=-1, channel_names=("x", "v", "theta", "omega"))
    acc = _run(tmp_path, observer, states)
    assert set(acc.Tags()["histograms"]) == {f"state_hist/{n}" for n in ("x", "v", "theta", "omega")}
    _check(acc.Histograms("state_hist/theta")[0].histogram_value, states[-1][:, 2].double().numpy())


def test_max_channels_and_a_rollout_too_short_for_an_index(tmp_path):
    states = _states(n=2)
    acc = _run(tmp_path, instrument.StateHistogram(iterations=(5, -1), max_channels=3), states)
    assert set(acc.Tags()["histograms"]) == {"state_hist/c0", "state_hist/c1", "state_hist/c2"}


def test_an_in_place_change_is_caught_then_states_are_copied():
    observer = instrument.StateHistogram()
    sink = Sink()
    logger = instrument.Logger([sink])
    x = torch.ones(2, 3, 4)
    observer.reset()
    observer.observe(instrument.StepContext(x, x))
    x.add_(1.0)
    with pytest.raises(ModifiedInPlaceError, match="modified in place after it was observed"):
        observer.log(logger, 0)
    observer.reset()
    observer.observe(instrument.StepContext(x, x))
    x.add_(1.0)
    observer.log(logger, 1)  # the copy holds the observed values
    logger.commit(1)
    logger.close()
    assert set(sink.records[-1].histograms["state_hist/c1"].tolist()) == {2.0}


def test_wrong_arguments_are_refused_clearly():
    with pytest.raises(ConfigurationError, match=r"distinct ints such as \(0, -1\).*got \(0, 0\)"):
        instrument.StateHistogram(iterations=(0, 0))
    with pytest.raises(ConfigurationError, match="got 'last'"):
        instrument.StateHistogram(iterations="last")
    with pytest.raises(ConfigurationError, match="without '/'"):
        instrument.StateHistogram(channel_names=("a/b",))
    observer = instrument.StateHistogram(channel_names=("a", "b"))
    observer.observe(instrument.StepContext(torch.zeros(2, 3), torch.zeros(2, 3)))
    with pytest.raises(ConfigurationError, match=r"got 2 channel_names \['a', 'b'\] for a state with 3 channels"):
        observer.log(instrument.Logger([]), 0)


def test_nothing_is_kept_for_iterations_not_chosen():
    observer = instrument.StateHistogram(iterations=(1, -2))
    observer.reset()
    states = _states(n=6)
    for i in range(6):
        observer.observe(instrument.StepContext(states[i], states[i + 1]))
    assert sorted(observer._kept) == [1] and len(observer._recent) == 2


def test_the_nca_demo_trains_bitwise_identically_with_both_new_observers(tmp_path):
    """Watched-module style on the real demo, plain and checkpointed: parameters and gradients bitwise equal with
    ActivationStats and StateHistogram on and off, and the checkpointed histograms equal the plain ones."""
    from instrument.demos.nca import train_nca

    kwargs = dict(steps=2, batch_size=2, size=12, n_iter_min=6, n_iter_max=6, seed=3)
    bare = train_nca(None, **kwargs)["model"]
    class Keep(instrument.Backend):
        def __init__(self):
            self.records = []

        def write(self, record):
            self.records.append(record)

    for every in (0, 3):
        backend = Keep()
        keep = backend.records
        inst = instrument.Instrumentation(
            [instrument.ActivationStats(), instrument.StateHistogram()], backends=[backend], log_interval=1,
        )
        watched = train_nca(inst, checkpoint_every=every, **kwargs)["model"]
        inst.close()
        assert inst.failures == {}
        for (name, p), q in zip(bare.named_parameters(), watched.parameters(), strict=True):
            assert torch.equal(p, q), name
            assert torch.equal(p.grad, q.grad), name
        assert {"activations/conv1/std", "activations/conv2/std"} <= set(keep[-1].scalars)
        if every == 0:
            plain = keep[-1].histograms
        else:
            assert plain.keys() == keep[-1].histograms.keys()
            assert all(np.array_equal(plain[k], keep[-1].histograms[k]) for k in plain)


def test_an_iteration_beyond_the_rollout_is_said_once_and_the_others_are_logged(tmp_path, caplog):
    """``iterations=(100,)`` on a 6-iteration rollout logged nothing and said nothing (a review found it)."""
    import logging

    states = _states(n=6)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        acc = _run(tmp_path, instrument.StateHistogram(iterations=(0, 100, -50), max_channels=1), states,
                   steps=(0, 1))
    said = [r.getMessage() for r in caplog.records if "has no state for iterations" in r.getMessage()]
    assert len(said) == 2 and "entry 100" in said[0] and "entry -50" in said[1] and "observed 6" in said[0]
    assert sorted(tag for tag in acc.Tags()["histograms"]) == ["state_hist/c0/it0"]
    _check(acc.Histograms("state_hist/c0/it0")[0].histogram_value, states[1][:, 0].numpy())


def test_a_complex_state_is_refused_with_what_to_observe_instead(caplog):
    """Its values reached the logger, which refused the histogram at the commit with a message about a metric,
    not about the state or what to observe instead."""
    import logging

    states = [torch.randn(2, 3, 4, 4, dtype=torch.complex64) for _ in range(3)]
    inst = instrument.Instrumentation([instrument.StateHistogram()], backends=[Sink()], log_interval=1)
    with caplog.at_level(logging.ERROR, logger="instrument"), inst.step(0) as s:
        for i in range(2):
            s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    assert inst.failures == {"state_hist": 1}
    assert "StateHistogram('state_hist') computes statistics of real values, got a complex tensor" in caplog.text
    assert "torch.view_as_real(x), or x.abs()" in caplog.text
