"""Observer edge cases read back against float64 NumPy references: a batch size that changes within one logging
step, an inf where the statistics take their shift from, a 0-d state."""

import numpy as np
import pytest
import torch

import instrument
from instrument.observers.stats import iteration_channel_stats


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
