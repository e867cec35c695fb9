"""Observer edge cases read back against float64 NumPy references: a batch size that changes within one logging
step, an inf where the statistics take their shift from, a 0-d state, a diverging or vanishing float32 state; and
a channel count that changes within a step."""

import logging
import re

import numpy as np
import pytest
import torch

import instrument
from instrument import Instrumentation, StepContext
from instrument.observers.stats import iteration_channel_stats
from tests.conftest import iteration_stats_in_tensorboard
from tests.test_checkpointing import Sink


class Keep(instrument.Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def test_a_batch_size_that_changes_within_a_step_keeps_every_iterations_statistics():
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.IterationStats()], backends=[keep], log_interval=1)
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(16, 4, generator=generator) for _ in range(5)]
    states += [torch.randn(32, 4, generator=generator) + 3.0 for _ in range(3)]  # minibatches after the rollout
    with inst.step(0) as s:
        previous = torch.zeros(16, 4)
        for state in states:
            s.observer(instrument.StepContext(previous_state=previous, next_state=state))
            previous = state
    inst.close()
    scalars = keep.records[0].scalars
    assert scalars["iteration_stats/iterations"] == len(states)
    last = states[-1].double().numpy()
    for c in range(4):
        assert scalars[f"iteration_stats/mean/c{c}"] == pytest.approx(last[:, c].mean(), rel=1e-6)
        assert scalars[f"iteration_stats/std/c{c}"] == pytest.approx(last[:, c].std(), rel=1e-5)


def test_activation_stats_of_a_policy_run_on_two_batch_sizes_in_one_step_are_logged():
    keep = Keep()
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    inst = instrument.Instrumentation(observers=[instrument.ActivationStats()], backends=[keep], log_interval=1)
    inst.watch(policy)
    with inst.step(0), torch.no_grad():
        for batch in (16,) * 4 + (32,) * 2:  # a rollout, then minibatches of another size
            policy(torch.randn(batch, 4))
    inst.close()
    names = [k for k in keep.records[0].scalars if k.startswith("activations/")]
    assert names and all(np.isfinite(keep.records[0].scalars[k]) for k in names)


def test_an_inf_in_the_shift_sample_gives_an_inf_mean_not_nan():
    states = torch.randn(3, 4, 2, 8, 8)  # [T, B, C, H, W]
    states[:, 0, 1, 0, 0] = float("inf")  # where the shift reference is sampled from
    table = iteration_channel_stats(states)
    reference = states.double().numpy().mean(axis=(1, 3, 4))
    np.testing.assert_array_equal(table[:, 0].double().numpy()[:, 1], reference[:, 1])  # inf, as NumPy says
    np.testing.assert_allclose(table[:, 0].double().numpy()[:, 0], reference[:, 0], rtol=1e-5)


def test_a_0d_state_is_one_channel_of_one_value():
    values = torch.tensor([0.5, -1.0, 2.0])
    table = iteration_channel_stats(values)  # three iterations of a 0-d state
    assert table.shape == (3, 4, 1)
    np.testing.assert_array_equal(table[:, :, 0].numpy(), np.stack([values, 0 * values, values, values], 1))


@pytest.mark.parametrize("magnitude", [1e30, 1e20, 1e-20, 1e-30])
@pytest.mark.parametrize("shape, channel_dim", [((4, 3, 12, 12), 1), ((64, 5), -1)])
def test_the_std_of_a_diverging_or_vanishing_float32_state_is_neither_inf_nor_zero(magnitude, shape, channel_dim):
    """The squares of d = x - r overflow float32 beyond |d| ~ 1e19 and underflow below ~1e-23: the power-of-two
    scale keeps them in range while min and max (taken from x) were always right."""
    generator = torch.Generator().manual_seed(3)
    states = (magnitude * torch.randn(5, *shape, generator=generator, dtype=torch.float64)).float()
    table = iteration_channel_stats(states.clone(), channel_dim=channel_dim)
    x = np.moveaxis(states.double().numpy(), channel_dim % len(shape) + 1, 1)
    x = x.reshape(x.shape[0], x.shape[1], -1)  # [T, C, everything else]
    got = table.double().numpy()
    np.testing.assert_allclose(got[:, 1], x.std(axis=2), rtol=1e-5)
    np.testing.assert_allclose(got[:, 0], x.mean(axis=2), rtol=1e-4, atol=1e-5 * magnitude)
    np.testing.assert_array_equal(got[:, 2], x.min(axis=2))
    np.testing.assert_array_equal(got[:, 3], x.max(axis=2))


@pytest.mark.parametrize("magnitude", [1e30, 1e-30])
def test_activation_stats_of_a_diverging_or_vanishing_layer_match_float64(magnitude):
    from instrument.observers.activation_stats import _finish, batched_moments

    generator = torch.Generator().manual_seed(4)
    outputs = (magnitude * (2.0 + torch.randn(3, 16, 40, generator=generator, dtype=torch.float64))).float()
    got = _finish(batched_moments(outputs.clone())).double().numpy()  # [3, 4]: mean, std, absmax, zero_frac
    flat = outputs.double().numpy().reshape(3, -1)
    np.testing.assert_allclose(got[:, 1], flat.std(axis=1), rtol=1e-5)
    np.testing.assert_allclose(got[:, 0], flat.mean(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(got[:, 2], np.abs(flat).max(axis=1))


def test_a_diverging_nca_state_read_back_from_tensorboard_has_its_float64_std(tmp_path):
    generator = torch.Generator().manual_seed(5)
    states = [(1e20 * torch.randn(2, 3, 16, 16, generator=generator)).float() for _ in range(4)]
    scalars = iteration_stats_in_tensorboard(tmp_path, states)
    last = states[-1].double().numpy()
    for c in range(3):
        want = last[:, c].std()
        assert np.isfinite(scalars[f"iteration_stats/std/c{c}"][0])
        assert scalars[f"iteration_stats/std/c{c}"][0] == pytest.approx(want, rel=1e-5)


def _update_norm_of(states):
    """UpdateNorm over the rollout ``states`` (an explicit evolver): the backend that kept its record."""
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm()], backends=[keep], log_interval=1)
    with inst.step(0) as s:
        for i in range(len(states) - 1):
            s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    return keep


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int64, torch.float16, torch.bool])
def test_dx_of_integer_bool_and_half_states_is_their_exact_difference(dtype):
    """uint8 frames going from 100 to 9 read 165 (255 - 90) through UpdateNorm; int8 100 -> -100 read 56;
    float16 4e4 -> -4e4 read inf. dx is taken in float32 for such states, in StepContext and in UpdateNorm's
    batched pairs alike, against a float64 NumPy reference."""
    low, high = {torch.uint8: (9, 100), torch.int8: (-100, 100), torch.int64: (-(2**20), 2**20),
                 torch.float16: (-4e4, 4e4), torch.bool: (0, 1)}[dtype]
    generator = torch.Generator().manual_seed(6)
    picks = torch.randint(0, 2, (4, 3, 8), generator=generator).bool()
    states = [torch.where(p, torch.tensor(high), torch.tensor(low)).to(dtype) for p in picks]
    exact = [b.double().numpy() - a.double().numpy() for a, b in zip(states[:-1], states[1:], strict=True)]
    context = instrument.StepContext(states[0], states[1])
    np.testing.assert_array_equal(context.dx.double().numpy(), exact[0])
    keep = _update_norm_of(states)
    norms = [np.linalg.norm(d.reshape(d.shape[0], -1), axis=1).mean() for d in exact]
    scalars = keep.records[0].scalars
    assert scalars["update_norm/l2/last"] == pytest.approx(norms[-1], rel=1e-6)
    assert scalars["update_norm/l2/max"] == pytest.approx(max(norms), rel=1e-6)


def test_dx_of_an_integer_next_to_a_float64_state_keeps_float64():
    previous = torch.tensor([[1e-9 + 1.0]], dtype=torch.float64)
    following = torch.tensor([[1]], dtype=torch.int32)
    dx = instrument.StepContext(previous, following).dx
    assert dx.dtype == torch.float64 and dx.item() == 1.0 - (1e-9 + 1.0)


def test_dx_of_int64_states_and_of_a_0d_float64_side_is_exact():
    big = torch.tensor([2**24 + 1], dtype=torch.int64)
    assert instrument.StepContext(torch.tensor([0]), big).dx.tolist() == [float(2**24 + 1)]
    following = torch.tensor([1.0], dtype=torch.float16)
    previous = torch.tensor(1.0 + 1e-9, dtype=torch.float64)  # 0-d: result_type would have ignored it
    dx = instrument.StepContext(previous, following).dx
    assert dx.dtype == torch.float64 and dx.item() == 1.0 - (1.0 + 1e-9)


@pytest.mark.parametrize(
    ("make", "option", "got"),
    [
        (lambda: instrument.IterationStats(max_channels=-1), "max_channels", "-1 (int)"),  # cut a channel silently
        (lambda: instrument.IterationStats(max_channels=2.5), "max_channels", "2.5 (float)"),  # raised at log time
        (lambda: instrument.IterationStats(max_elements="64M"), "max_elements", "'64M' (str)"),
        (lambda: instrument.StateHistogram(max_channels=True), "max_channels", "True (bool)"),
        (lambda: instrument.UpdateNorm(max_elements=0), "max_elements", "0 (int)"),
        (lambda: instrument.UpdateNorm(alive_channel=3.0), "alive_channel", "3.0 (float)"),
        (lambda: instrument.NonFinite(max_elements=-5), "max_elements", "-5 (int)"),
    ],
)
def test_observer_limits_are_checked_when_built(make, option, got):
    """Each is refused at construction, naming the option, what was received and a value that works; a
    negative max_channels used to drop the last channel's scalars without a word."""
    with pytest.raises(instrument.ConfigurationError, match=rf"{option} must be .*got {re.escape(got)}; pass e\.g\."):
        make()


def test_observer_limits_accept_none_and_numpy_ints():
    assert instrument.IterationStats(max_channels=None, max_elements=None).max_channels is None
    assert type(instrument.StateHistogram(max_channels=np.int64(3)).max_channels) is int


WIDE_INTEGERS = [torch.int32, torch.int64, torch.uint32, torch.uint64]


def _counters(dtype, shape, seed):
    """Integers of ``dtype`` far beyond float32's 2**24 (2**30 for 32-bit ones, 2**40 for 64-bit), spread ~2."""
    base = 2**30 if dtype in (torch.int32, torch.uint32) else 2**40
    generator = torch.Generator().manual_seed(seed)
    return (base + torch.randint(0, 7, shape, generator=generator)).to(dtype)


def _float64_moments(ints):
    """Float64 NumPy mean and std of integers, offset by their minimum first (exact in int64): NumPy's own std of
    values near 2**40 is off by ~1e-9 relative (its float64 mean's rounding), more than the statistics are."""
    low = ints.min()
    offset = (ints - low).astype(np.float64)
    return float(low) + offset.mean(), offset.std()


@pytest.mark.parametrize("dtype", WIDE_INTEGERS)
def test_iteration_stats_of_integers_beyond_float32_match_float64_and_min_max_are_exact(dtype):
    """An int64 counter near 2**40 went through float32: std 0 and min = max = mean, all rounded to 2**40.
    int32, int64, uint32 and uint64 states are reduced in float64 now: read back against float64 NumPy."""
    states = [_counters(dtype, (4, 2, 8, 8), seed) for seed in range(4)]
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.IterationStats(images=False)], backends=[keep],
                                      log_interval=1)
    with inst.step(0) as s:
        for i in range(len(states) - 1):
            s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    scalars = keep.records[0].scalars
    last = np.moveaxis(states[-1].to(torch.int64).numpy(), 1, 0).reshape(2, -1)
    for c in range(2):
        mean, std = _float64_moments(last[c])
        assert std > 1.0  # what float32 read as 0
        assert scalars[f"iteration_stats/mean/c{c}"] == pytest.approx(mean, rel=1e-15)
        assert scalars[f"iteration_stats/std/c{c}"] == pytest.approx(std, rel=1e-12)
        assert scalars[f"iteration_stats/min/c{c}"] == float(last[c].min())  # exact
        assert scalars[f"iteration_stats/max/c{c}"] == float(last[c].max())
    # The kernel itself, every iteration: float64 for these, float32 still for small integers.
    stacked = torch.stack(states)
    got = iteration_channel_stats(stacked).numpy()
    x = np.moveaxis(stacked.to(torch.int64).numpy(), 2, 1).reshape(len(states), 2, -1)
    np.testing.assert_allclose(got[:, 1], [[_float64_moments(v)[1] for v in t] for t in x], rtol=1e-12)
    np.testing.assert_array_equal(got[:, 2], x.min(axis=2).astype(np.float64))
    np.testing.assert_array_equal(got[:, 3], x.max(axis=2).astype(np.float64))
    assert iteration_channel_stats(stacked.to(torch.int16) if dtype == torch.int32 else stacked.to(torch.uint8)
                                   ).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool])
def test_small_integer_states_are_shifted_by_a_whole_number_so_their_mean_is_exact(dtype):
    """A fractional shift reference rounded x - r in float32: int16 values -32768, 32767, 0 read a mean of
    -0.332899 instead of -1/3, in IterationStats and ActivationStats alike (a review)."""
    from instrument.observers.activation_stats import _finish, batched_moments

    values = {torch.int16: [-32768, 32767, 0], torch.uint8: [255, 0, 0, 1, 255, 2, 0], torch.bool: [1, 0, 0]}[dtype]
    x = torch.tensor(values).to(dtype)
    want_mean, want_std = np.mean(values), np.std(values)
    stats = iteration_channel_stats(x.reshape(1, 1, 1, -1))[0, :, 0]  # one iteration, [B=1, C=1, N]
    moments = _finish(batched_moments(x.reshape(1, -1)))[0]
    for mean, std in ((stats[0], stats[1]), (moments[0], moments[1])):
        assert mean.item() == pytest.approx(want_mean, rel=1e-7, abs=1e-7)
        assert std.item() == pytest.approx(want_std, rel=1e-6)


@pytest.mark.parametrize("dtype", WIDE_INTEGERS)
def test_activation_stats_of_integer_outputs_beyond_float32_match_float64(dtype):
    """batched_moments cast every non-float output to float32 as well: an int64 output near 2**40 read std 0."""

    class Count(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return x.to(dtype)

    outputs = [_counters(dtype, (4, 3, 8), seed) for seed in range(3)]
    keep = Keep()
    count = Count()
    inst = instrument.Instrumentation(observers=[instrument.ActivationStats(images=False)], backends=[keep],
                                      log_interval=1)
    inst.watch(count)
    with inst.step(0), torch.no_grad():
        for out in outputs:
            count(out)
    inst.close()
    scalars = keep.records[0].scalars
    mean, std = _float64_moments(outputs[-1].to(torch.int64).numpy().ravel())
    assert std > 1.0
    assert scalars["activations/Count/mean"] == pytest.approx(mean, rel=1e-15)
    assert scalars["activations/Count/std"] == pytest.approx(std, rel=1e-12)
    assert scalars["activations/Count/absmax"] == float(np.abs(outputs[-1].to(torch.int64).numpy()).max())


@pytest.mark.parametrize("dtype", WIDE_INTEGERS)
def test_update_norm_of_integers_beyond_float32_sees_a_change_of_one(dtype):
    """An int32 state at 2**30 changed by 1 everywhere read an update norm of 0: difference() took int32 (and
    uint32, uint64) differences in float32, which holds integers only to 2**24. Now float64, exact here."""
    base = 2**30 if dtype in (torch.int32, torch.uint32) else 2**50  # within 2**53: exact in float64
    generator = torch.Generator().manual_seed(7)
    steps = torch.randint(0, 3, (3, 2, 4, 3, 3), generator=generator)  # changes of 0, 1 or 2 per iteration
    states = [torch.full((2, 4, 3, 3), base, dtype=torch.int64)]
    for change in steps:
        states.append(states[-1] + change)
    states = [s.to(dtype) for s in states]
    exact = [d.reshape(2, -1).double().numpy() for d in steps]  # the changes, exact in float64
    np.testing.assert_array_equal(instrument.StepContext(states[0], states[1]).dx.numpy(), steps[0].double().numpy())
    norms = [np.linalg.norm(d, axis=1).mean() for d in exact]
    keep = _update_norm_of(states)
    scalars = keep.records[0].scalars
    assert norms[-1] > 1.0
    assert scalars["update_norm/l2/last"] == pytest.approx(norms[-1], rel=1e-12)
    assert scalars["update_norm/l2/first"] == pytest.approx(norms[0], rel=1e-12)
    assert scalars["update_norm/l2/max"] == pytest.approx(max(norms), rel=1e-12)


def test_update_norm_of_a_given_int64_dx_is_taken_in_float64():
    """A dx handed over as int64 (StepContext(dx=...)) was cast to float32 before its norm: 7 digits of 2**40 + k."""
    dx = 2**40 + torch.arange(72, dtype=torch.int64).reshape(2, 4, 3, 3)
    state = torch.zeros(2, 4, 3, 3)
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm()], backends=[keep], log_interval=1)
    with inst.step(0) as s:
        s.observer(instrument.StepContext(state, state, dx=dx))
    inst.close()
    want = np.linalg.norm(dx.reshape(2, -1).double().numpy(), axis=1).mean()
    assert keep.records[0].scalars["update_norm/l2/last"] == pytest.approx(want, rel=1e-14)


def test_update_norm_says_once_when_the_state_has_no_alive_channel(caplog):
    """``alive_channel=99`` on a 16-channel state logged no alive fraction, unsaid (a console column read nan)."""
    import logging

    observer = instrument.UpdateNorm(alive_channel=9, channel_dim=1)
    logger = instrument.Logger([])
    with caplog.at_level(logging.INFO, logger="instrument"):
        for _ in range(2):
            observer.reset()
            x = torch.zeros(2, 4, 3, 3)
            for i in range(3):
                observer.observe(instrument.StepContext(x, x + 1.0, step_index=i))
                x = x + 1.0
            observer.log(logger, 0)
    said = [r for r in caplog.records if "has no alive fraction" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING] and "alive_channel=9" in said[0].getMessage()
    default = instrument.UpdateNorm(channel_dim=1)  # 3, RGBA's alpha: an RGB state is said at INFO only
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="instrument"):
        default.observe(instrument.StepContext(torch.zeros(2, 3, 3, 3), torch.ones(2, 3, 3, 3)))
    assert [r.levelno for r in caplog.records if "has no alive fraction" in r.getMessage()] == [logging.INFO]
    logger.close()


def test_update_norm_of_a_complex_state_keeps_the_imaginary_part():
    """dx of a complex state was cast to float32 before its norm, dropping the imaginary part: 30 % low (a review).
    Against float64 (complex128) NumPy, read back from JSONL."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 4, 4, dtype=torch.complex64, generator=g)  # 5 channels: no alive fraction (complex)
    states = [x]
    for _ in range(3):
        states.append(states[-1] * (1 + 1j) + 0.1j)
    keep = _update_norm_of(states)
    scalars = keep.records[0].scalars
    norms = [np.linalg.norm((b.numpy().astype(np.complex128) - a.numpy().astype(np.complex128)).reshape(2, -1),
                            axis=1).mean() for a, b in zip(states[:-1], states[1:], strict=True)]
    assert scalars["update_norm/l2/first"] == pytest.approx(norms[0], rel=1e-6)
    assert scalars["update_norm/l2/last"] == pytest.approx(norms[-1], rel=1e-6)
    assert scalars["update_norm/l2/mean"] == pytest.approx(np.mean(norms), rel=1e-6)
    assert "update_norm/alive/last" not in scalars


def test_iteration_stats_refuses_a_complex_state_and_says_what_to_observe(caplog):
    """Its statistics silently dropped the imaginary part (torch's own UserWarning was the only sign)."""
    import logging

    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.IterationStats(images=False)], backends=[keep],
                                      log_interval=1)
    x = torch.randn(2, 3, 4, 4, dtype=torch.complex64)
    with caplog.at_level(logging.ERROR, logger="instrument"), inst.step(0) as s:
        s.observer(instrument.StepContext(x, x * 2))
    inst.close()
    assert inst.failures == {"iteration_stats": 1}
    (error,) = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert isinstance(error, instrument.InvalidValueError)
    assert "complex state (torch.complex64, shape [2, 3, 4, 4])" in str(error) and "view_as_real" in str(error)


@pytest.mark.parametrize("shape", [(0, 4, 5, 5), (2, 4, 0, 0), (3, 0), (2, 0, 4, 4)])
def test_states_with_no_elements_cost_no_observer_a_failure(shape, caplog):
    """UpdateNorm failed at every logging step on an empty batch (reshape could not infer -1) and StateHistogram
    on an empty batch or grid (the logger refuses an empty histogram); IterationStats' heatmaps of a state of no
    channels (the logger refuses a matrix of no columns); found by reviews."""
    import logging

    keep = Keep()
    observers = [instrument.UpdateNorm(), instrument.StateHistogram(), instrument.IterationStats()]
    inst = instrument.Instrumentation(observers=observers, backends=[keep], log_interval=1)
    x = torch.zeros(shape)
    with caplog.at_level(logging.INFO, logger="instrument"):
        for step in (0, 1):
            with inst.step(step) as s:
                s.observer(instrument.StepContext(x, x + 1))
                s.observer(instrument.StepContext(x + 1, x + 2))
    inst.close()
    assert inst.failures == {}
    for record in keep.records:
        norms = record.scalars["update_norm/l2/mean"]
        assert np.isnan(norms) if shape[0] == 0 else norms == 0.0  # no sample: NaN; samples of no values: 0
        assert not [key for key in record.histograms if key.startswith("state_hist/")]
        assert record.scalars["iteration_stats/iterations"] == 2.0
        assert len([key for key in record.images if key.startswith("iteration_stats/")]) == (4 if shape[1] else 0)
    said = [r.getMessage() for r in caplog.records if "no values, so no histogram" in r.getMessage()]
    assert len(said) == 1


def test_the_statistics_helpers_refuse_complex_values_instead_of_crashing():
    from instrument.observers.activation_stats import output_moments

    z = torch.randn(2, 3, 4, dtype=torch.complex64)
    for call in (lambda: output_moments(z), lambda: iteration_channel_stats(z.unsqueeze(0))):
        with pytest.raises(instrument.InvalidValueError, match=r"complex tensor \(torch\.complex64\).*view_as_real"):
            call()


def test_a_watched_call_counted_but_not_delivered_leaves_the_later_iterations_labels_as_they_are(tmp_path):
    """A call the session counts but cannot deliver (here a rule that starts changing its argument in place after
    the first logging step, documented) keeps the later calls' step_index; StateHistogram and NonFinite counted
    delivered calls instead, so `state_hist/c1/it2` held iteration 3's histogram and a NaN made at iteration 3
    read `first_iteration` 2. Read back from TensorBoard and JSONL against float64 NumPy."""
    import json
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Rule(torch.nn.Module):
        in_place, nan_at, calls = False, None, 0

        def forward(self, x):
            dx = 0.25 * torch.tanh(x + 1.0)
            if self.calls == self.nan_at:
                dx = dx.clone()
                dx[0, 2] = float("nan")
            self.calls += 1
            return x.add_(dx) if self.in_place else x + dx

    rule = Rule()
    inst = instrument.Instrumentation(
        observers=[instrument.StateHistogram(iterations=(2, -1)), instrument.NonFinite()],
        backends=[instrument.JsonlBackend(), instrument.TensorBoardBackend()], log_interval=1, run_name="r",
        log_dir=str(tmp_path))
    inst.watch(rule)
    logging.getLogger("instrument").disabled = True  # the documented warnings of the uncopied call
    try:
        for step in range(2):
            rule.in_place, rule.nan_at, rule.calls = step == 1, (3 if step == 1 else None), 0
            states = []
            with inst.step(step), torch.no_grad():
                x = torch.linspace(-1.0, 1.0, 6 * 4, dtype=torch.float32).reshape(6, 4)
                for _ in range(5):
                    x = rule(x)
                    states.append(x.double().numpy().copy())
        inst.close()
    finally:
        logging.getLogger("instrument").disabled = False
    events = EventAccumulator(str(tmp_path / "r"), size_guidance={"histograms": 0}).Reload()
    histograms = {key: {e.step: e.histogram_value for e in events.Histograms(key)}
                  for key in ("state_hist/c1/it2", "state_hist/c1")}
    channel = [state[:, 1] for state in states]  # step 1's states, float64
    assert histograms["state_hist/c1/it2"][1].sum == pytest.approx(channel[2].sum(), rel=1e-6)
    assert abs(histograms["state_hist/c1/it2"][1].sum - channel[3].sum()) > 0.1  # not the next iteration's
    assert histograms["state_hist/c1"][1].sum == pytest.approx(channel[4].sum(), rel=1e-6)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["metrics"] for r in records if "metrics" in r}
    for key in ("first_iteration", "first_iteration/state", "first_iteration/dx"):  # the NaN made in call 3
        assert logged[1][f"nonfinite/{key}"] == 3, key  # (calls 0-4; call 0 not delivered)
    assert logged[0]["nonfinite/first_iteration"] == -1


@pytest.mark.parametrize("inference", [False, True])
def test_iteration_stats_never_change_a_state_handed_out_as_a_transposed_view(inference):
    """An environment that keeps its state as [features, N] and hands out the [N, features] transpose: the
    channels-last path copied it with contiguous(), which is the caller's own tensor for such a view, and then
    shifted and squared it in place, so the rollout went on from the statistics' scratch values (reduced as it
    comes: under inference mode, or on a CPU for a large state). Checked against an uninstrumented twin and
    float64 NumPy."""

    class Env(torch.nn.Module):
        def forward(self, obs):  # [N, 4] -> [N, 4], laid out as [4, N]
            x, v, th, om = obs.unbind(1)
            return torch.stack([x + 0.02 * v, v + 0.1, th + 0.02 * om, om - 0.1]).T

    def rollout(env, inst=None):
        finals, seen = [], []
        for step in range(2):
            with (inst.step(step) if inst is not None else torch.no_grad()), \
                    (torch.inference_mode() if inference else torch.no_grad()):
                # reduced as it comes: under inference mode, or on a CPU once a state holds 2**17 elements
                n = 32 if inference else 2**15
                x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) / n + 5.0
                for _ in range(5):
                    x = env(x)
                    seen.append(x.double().numpy().copy())
                finals.append(x.clone())
        return finals, seen

    plain, _ = rollout(Env())
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.IterationStats(channel_dim=-1, images=False)],
                                      backends=[keep], log_interval=1)
    env = Env()
    inst.watch(env)
    logged, seen = rollout(env, inst)
    inst.close()
    for step in range(2):
        assert torch.equal(plain[step], logged[step])
        last = seen[5 * step + 4]  # each step's last state, as the rollout made it
        scalars = keep.records[step].scalars
        for c in range(4):
            assert scalars[f"iteration_stats/mean/c{c}"] == pytest.approx(last[:, c].mean(), rel=1e-6)
            assert scalars[f"iteration_stats/std/c{c}"] == pytest.approx(last[:, c].std(), rel=1e-5)
            assert scalars[f"iteration_stats/min/c{c}"] == pytest.approx(last[:, c].min(), rel=1e-6)


@pytest.mark.parametrize("style", ["explicit", "watched", "from a whole seed", "broadcast", "inference mode"])
def test_states_kept_in_a_preallocated_trajectory_buffer_lose_no_step(style):
    """``traj[t + 1] = rule(traj[t])``: writing the next slice moves the version counter every slice of ``traj``
    shares, so the kept references of the first logging step read as changed in place and its values were dropped
    (`nonfinite/incomplete` 1, UpdateNorm's and IterationStats' keys missing). Every step's values are now logged,
    checked against float64 NumPy."""
    batch, channels, size, iterations = 3, 4, 5, 4
    keep = Keep()
    inst = instrument.Instrumentation(
        observers=[instrument.IterationStats(images=False), instrument.UpdateNorm(),
                   instrument.NonFinite(gradients=False), instrument.StateHistogram(iterations=(1,))],
        backends=[keep], log_interval=1)
    class Rule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(channels, channels, 1)

        def forward(self, x):
            return x + 0.1 * torch.tanh(self.conv(x))

    rule = Rule()
    if style in ("watched", "from a whole seed"):
        inst.watch(rule)
    generator = torch.Generator().manual_seed(0)
    kept = []
    for step in range(2):
        seed = torch.randn(batch, channels, size, size, generator=generator)
        # (Under autograd torch itself refuses this: a saved slice reads as changed once the next one is written.)
        traj = torch.zeros(iterations + 1, batch, channels, size, size)  # made outside inference mode
        with inst.step(step) as s, (torch.inference_mode() if style == "inference mode" else torch.no_grad()):
            traj[0] = seed
            x = seed  # "from a whole seed": the first iteration's previous state is a whole tensor, the rest slices
            for t in range(iterations):
                traj[t + 1] = rule(x if style == "from a whole seed" else traj[t])
                if style == "broadcast":  # one sample's slice broadcast over the batch: reaches part of traj
                    s.observer(instrument.StepContext(traj[t, :1].expand_as(seed), traj[t + 1, :1].expand_as(seed),
                                                      step_index=t))
                elif style in ("explicit", "inference mode"):
                    s.observer(instrument.StepContext(traj[t], traj[t + 1], step_index=t))
                x = traj[t + 1]
        observed = traj[:, :1].expand_as(traj) if style == "broadcast" else traj
        kept.append(observed.detach().double().numpy().copy())
    inst.close()
    assert dict(inst.failures) == {}
    for step in range(2):
        scalars, states = keep.records[step].scalars, kept[step]
        assert scalars["nonfinite/incomplete"] == 0
        assert scalars["iteration_stats/iterations"] == iterations
        last = states[-1]
        for c in range(channels):
            assert scalars[f"iteration_stats/mean/c{c}"] == pytest.approx(last[:, c].mean(), abs=1e-6)
            assert scalars[f"iteration_stats/std/c{c}"] == pytest.approx(last[:, c].std(), rel=1e-5)
        norms = [np.sqrt(((states[t + 1] - states[t]) ** 2).reshape(batch, -1).sum(1)).mean()
                 for t in range(iterations)]
        assert scalars["update_norm/l2/first"] == pytest.approx(norms[0], rel=1e-5)
        assert scalars["update_norm/l2/last"] == pytest.approx(norms[-1], rel=1e-5)
        histogram = keep.records[step].histograms["state_hist/c1/it1"]  # iteration 1's next state: traj[2]
        np.testing.assert_allclose(np.sort(histogram), np.sort(states[2][:, 1].ravel()), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_alive_fraction_compares_as_the_models_own_alive_mask_does(dtype):
    """`update_norm/alive/*` counts the cells where torch's ``alpha > alive_threshold`` holds in the state's dtype
    (documented): the same cells as an NCA's own ``max_pool2d(alpha) > 0.1`` mask, also where the threshold rounds
    up in that dtype (bfloat16(0.1) = 0.10009765625)."""
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm()], backends=[keep], log_interval=1)
    threshold = torch.tensor(0.1, dtype=dtype)  # rounded to the dtype
    below = torch.nextafter(threshold.float(), torch.tensor(0.0)).to(dtype)
    above = torch.nextafter(threshold.float(), torch.tensor(1.0)).to(dtype)
    above = above if above > threshold else (threshold.float() * 1.01).to(dtype)
    state = torch.zeros(1, 4, 2, 2, dtype=dtype)
    state[0, 3] = torch.stack([threshold, threshold, below, above]).reshape(2, 2)
    mask = torch.nn.functional.max_pool2d(state[:, 3:4], 1) > 0.1  # the model's own mask, in its dtype
    with inst.step(0) as s:
        s.observer(instrument.StepContext(torch.zeros_like(state), state))
    inst.close()
    assert keep.records[0].scalars["update_norm/alive/last"] == pytest.approx(mask.double().mean().item())


def test_a_channel_dim_naming_the_batch_of_an_n_by_features_state_is_refused(caplog):
    """channel_dim=0 on an [N, features] state is its batch: NonFinite read the environments as channels (a NaN in
    feature 2 of environment 5 logged first_channel 5) and IterationStats fell back to dim 1, both unsaid, where
    docs/observers.md says it is refused (as StateHistogram did)."""
    import logging

    from instrument.errors import ConfigurationError

    keep = Keep()
    inst = instrument.Instrumentation(
        observers=[instrument.IterationStats(channel_dim=0, name="stats"),
                   instrument.NonFinite(channel_dim=0, gradients=False, name="nf")],
        backends=[keep], log_interval=1)
    state = torch.zeros(8, 4)
    state[5, 2] = float("nan")
    with caplog.at_level(logging.ERROR, logger="instrument"), inst.step(0) as s:
        s.observer(instrument.StepContext(torch.zeros(8, 4), state))
    inst.close()
    assert inst.failures == {"stats": 1, "nf": 1}
    refused = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert len(refused) == 2 and all(isinstance(e, ConfigurationError) and "channel_dim=0" in str(e) and
                                     "[8, 4]" in str(e) for e in refused)
    assert not any(key.startswith(("stats/", "nf/first_channel")) for r in keep.records for key in r.scalars)


def test_part_of_larger_tells_slices_and_broadcast_slices_from_whole_tensors():
    from instrument.core.storage import part_of_larger

    traj = torch.zeros(5, 3, 4)
    assert part_of_larger(traj[0]) and part_of_larger(traj[2]) and part_of_larger(traj[:, :, :2])
    assert part_of_larger(traj[1, :1].expand(100, 4))  # more elements than the storage, yet a part of it
    assert part_of_larger(traj[0, :1].expand(100, 4))  # offset 0 too
    whole = torch.zeros(3, 4)
    assert not any(part_of_larger(t) for t in (whole, whole.T, whole.reshape(4, 3), whole.unsqueeze(0),
                                               torch.zeros(1, 4).expand(100, 4), torch.zeros(0, 4), torch.tensor(1.0)))
    assert not part_of_larger(torch.zeros(2, 3).to_sparse())  # no plain storage: kept as it is


def test_a_differentiable_rollout_from_a_whole_seed_into_a_trajectory_buffer_loses_no_step():
    """``traj[t] = rule(x); x = traj[t]`` under autograd (a rule that saves nothing for backward, so torch allows
    it): the states reach observers detached, and a detached slice has no ``_base``, so the slice of the second
    iteration went unseen and the step was dropped (a review). Checked against float64 NumPy."""

    class Rule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.linspace(-0.1, 0.1, 4).reshape(4, 1, 1))

        def forward(self, x):
            return x + self.b

    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm(), instrument.IterationStats(images=False)],
                                      backends=[keep], log_interval=1)
    rule = Rule()
    inst.watch(rule)
    seed = torch.arange(2 * 4 * 3 * 3, dtype=torch.float32).reshape(2, 4, 3, 3) / 50.0
    with inst.step(0):
        traj = torch.zeros(5, 2, 4, 3, 3)
        x = seed
        for t in range(5):
            traj[t] = rule(x)
            x = traj[t]
        x.square().mean().backward()
    inst.close()
    assert dict(inst.failures) == {}
    states = [seed.double().numpy()] + [traj[t].detach().double().numpy() for t in range(5)]
    norms = [np.sqrt(((states[t + 1] - states[t]) ** 2).reshape(2, -1).sum(1)).mean() for t in range(5)]
    scalars = keep.records[0].scalars
    assert scalars["update_norm/l2/mean"] == pytest.approx(np.mean(norms), rel=1e-5)
    assert scalars["iteration_stats/mean/c1"] == pytest.approx(states[-1][:, 1].mean(), rel=1e-5)


def test_a_differentiable_rollout_handing_over_broadcast_slices_after_a_whole_seed_loses_no_step():
    """A rollout that starts from a whole seed and then hands over one sample of a trajectory buffer broadcast over
    the batch (``traj[t, :1].expand(...)``, offset 0 included) under autograd: the states reach observers
    detached, so the slice has no ``_base``, and a broadcast view spans more bytes than its storage holds, so the
    quick size check did not tell it either and the step was dropped as changed in place. Checked against
    float64."""
    batch, channels, size, iterations = 8, 4, 2, 4  # more samples than iterations: a view larger than traj
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm(), instrument.IterationStats(images=False)],
                                      backends=[keep], log_interval=1)
    bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, channels).reshape(channels, 1, 1))
    seed = torch.arange(channels * size * size, dtype=torch.float32).reshape(1, channels, size, size) / 20.0
    with inst.step(0) as s:
        traj = torch.zeros(iterations, 1, channels, size, size)
        x = seed.expand(batch, -1, -1, -1)  # a whole seed: not part of a larger storage
        for t in range(iterations):
            y = x[:1] + bias
            traj[t] = y  # written in place (every slice's version moves), under autograd
            # The first iteration hands over its own result (a whole tensor), the later ones the buffer's slice.
            nxt = (y if t == 0 else traj[t, :1]).expand(batch, -1, -1, -1)
            s.observer(instrument.StepContext(x, nxt, step_index=t))
            x = nxt
        traj.sum().backward()
    inst.close()
    assert dict(inst.failures) == {}
    states = [seed.double().numpy()] + [traj[t].detach().double().numpy() for t in range(iterations)]
    norms = [np.sqrt(((states[t + 1] - states[t]) ** 2).sum()) for t in range(iterations)]
    scalars = keep.records[0].scalars
    assert scalars["update_norm/l2/mean"] == pytest.approx(np.mean(norms), rel=1e-5)
    assert scalars["iteration_stats/iterations"] == iterations
    assert scalars["iteration_stats/mean/c1"] == pytest.approx(states[-1][:, 1].mean(), rel=1e-5)


def test_a_hooked_call_hands_observers_what_step_context_promises(tmp_path):
    """The hook builds its StepContext without the public constructor's checks: every tensor outside autograd,
    the condition too, the freeze channels a tuple, no probe values, and dx the exact difference."""
    seen = []

    class Rule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((1, 3, 1, 1), 0.5))

        def forward(self, x, condition):
            return x + self.w * x * condition

    rule = Rule()
    inst = instrument.Instrumentation(observers=[seen.append], backends=[], log_interval=1, log_dir=str(tmp_path),
                                      overhead_budget=None)
    inst.watch(rule, freeze_channels=[0])
    condition = torch.ones(2, 3, 4, 4, requires_grad=True)
    with inst.step(0):
        x = torch.rand(2, 3, 4, 4, requires_grad=True)
        for _ in range(2):
            x = rule(x, condition)
        x.sum().backward()
    inst.close()
    assert [c.step_index for c in seen] == [0, 1]
    for context in seen:
        assert not any(t.requires_grad for t in (context.previous_state, context.next_state, context.condition))
        assert context.freeze_channels == (0,) and dict(context.probes) == {} and context.dx_if_known is None
        expected = context.next_state.double() - context.previous_state.double()
        assert torch.equal(context.dx.double(), expected.float().double())
    assert torch.equal(seen[1].previous_state, seen[0].next_state)


def test_a_condition_keyword_that_is_not_a_tensor_is_not_handed_over_and_training_goes_on(tmp_path):
    """`rule(x, condition=2.0)`: the hook raised a TypeError into the training loop (telling the user to pass a
    state tensor). A number named condition is the module's business: observers see the call, condition None."""
    seen = []

    class Rule(torch.nn.Module):
        def forward(self, x, condition=1.0):
            return x * condition

    rule = Rule()
    inst = instrument.Instrumentation(observers=[seen.append], backends=[], log_interval=1, log_dir=str(tmp_path),
                                      overhead_budget=None)
    inst.watch(rule)
    with inst.step(0):
        x = rule(torch.ones(2, 3), condition=2.0)
        x = rule(x, torch.full((2, 3), 0.5))
    inst.close()
    assert torch.equal(x, torch.ones(2, 3))
    assert [c.condition for c in seen][0] is None and torch.equal(seen[1].condition, torch.full((2, 3), 0.5))


def test_a_number_named_condition_leaves_a_second_positional_tensor_as_the_condition(tmp_path):
    seen = []

    class Rule(torch.nn.Module):
        def forward(self, x, extra, condition=1.0):
            return x * extra * condition

    rule = Rule()
    inst = instrument.Instrumentation(observers=[seen.append], backends=[], log_interval=1, log_dir=str(tmp_path),
                                      overhead_budget=None)
    inst.watch(rule)
    extra = torch.full((2, 3), 0.5)
    with inst.step(0):
        rule(torch.ones(2, 3), extra, condition=2.0)
    inst.close()
    assert torch.equal(seen[0].condition, extra)


def test_iteration_stats_of_a_state_whose_channel_count_changes_within_a_step_say_why(caplog):
    """Its tables (heatmaps of iterations x channels) hold one channel count: a torch error about sizes named
    nothing of that. UpdateNorm, which reduces every channel to one norm, goes on."""
    sink = Sink()
    inst = Instrumentation([instrument.IterationStats(), instrument.UpdateNorm()], backends=[sink], log_interval=1)
    with caplog.at_level(logging.ERROR, logger="instrument"), inst.step(0) as s:
        for i in range(4):
            x = torch.rand(2, 4 if i < 2 else 3, 5, 5)
            s.observer(StepContext(x, torch.rand_like(x), step_index=i))
    inst.close()
    assert inst.failures == {"iteration_stats": 1}
    assert "reduce to tables of different shapes [(4, 3), (4, 4)]" in caplog.text
    assert "Keep the number of channels fixed within a logging step" in caplog.text
    assert "update_norm/l2/mean" in sink.records[-1].scalars


@pytest.mark.parametrize("alpha_first", [True, False])
def test_a_step_of_states_with_and_without_an_alpha_channel_logs_the_alive_fraction_of_those_with_one(alpha_first):
    """UpdateNorm read whether to log `alive/*` off the step's last shape: a step whose last iterations had no alpha
    channel (RGBA states, then RGB ones) logged none, and one whose first iterations had none logged a NaN mean.
    Both now log the fraction over the iterations that have one, as a float64 reference computes it."""
    keep = Keep()
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm()], backends=[keep], log_interval=1)
    generator = torch.Generator().manual_seed(3)
    rgba = [torch.rand(2, 4, 5, 5, generator=generator) for _ in range(4)]
    rgb = [torch.rand(2, 3, 5, 5, generator=generator) for _ in range(3)]
    states = rgba + rgb if alpha_first else rgb + rgba
    with inst.step(0) as s:
        for previous, state in zip([torch.zeros_like(states[0]), *states[:-1]], states, strict=True):
            if previous.shape != state.shape:
                previous = torch.zeros_like(state)
            s.observer(instrument.StepContext(previous_state=previous, next_state=state))
    inst.close()
    scalars = keep.records[0].scalars
    fractions = [(state[:, 3].double().numpy() > np.float32(0.1)).mean() for state in rgba]
    assert scalars["update_norm/alive/last"] == pytest.approx(fractions[-1], rel=1e-6)  # a float32 mean
    assert scalars["update_norm/alive/mean"] == pytest.approx(np.mean(fractions), rel=1e-6)
