"""Tests for the demo workloads (instrument.demos): plain PyTorch, no instrumentation needed."""

import math
import re
import warnings
from typing import List

import pytest
import torch
import torch.nn.functional as F

import instrument
from instrument.demos.cartpole import CartPole, Policy, discounted_returns, rollout_episode, train_cartpole
from instrument.demos.nca import NCA, UpdateRule, make_seed, make_target, rollout, run_iterations, train_nca
from instrument.demos.torchrl_ppo import build_ppo_trainer


@pytest.fixture(autouse=True)
def _one_thread():
    """Keep the tests cheap and deterministic on a shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _trained_like_rule(seed: int = 0, channels: int = 16) -> UpdateRule:
    """An UpdateRule whose last layer is non-zero, so rollouts actually move (zero-init is the identity)."""
    torch.manual_seed(seed)
    rule = UpdateRule(channels=channels)
    with torch.no_grad():
        rule.conv2.weight.normal_(0.0, 0.05)
        rule.conv2.bias.normal_(0.0, 0.01)
    return rule


def _random_state(batch: int = 2, channels: int = 16, size: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, channels, size, size, generator=g)
    # make a dead region: alpha below threshold over the left half, so alive masking has something to do
    x[:, 3, :, : size // 2] = 0.05
    return x


# ---------------------------------------------------------------------------------------------------- NCA


def test_make_target_is_premultiplied_rgba_containing_the_seed():
    target = make_target(size=32)
    assert target.shape == (4, 32, 32)
    assert target.dtype == torch.float32
    alpha = target[3]
    assert set(alpha.unique().tolist()) == {0.0, 1.0}
    assert alpha[16, 16] == 1.0  # the seed cell is inside the shape
    assert 0.1 < alpha.mean() < 0.6  # a shape, not empty and not the whole canvas
    assert alpha[0].sum() == 0 and alpha[-1].sum() == 0  # margin to the border
    assert target.min() >= 0.0 and target.max() <= 1.0
    assert torch.all(target[:3][:, alpha == 0] == 0)  # premultiplied: no colour outside
    assert target[:3][:, alpha == 1].std(dim=1).gt(0.05).all()  # colour varies inside


def test_make_seed_has_one_live_cell():
    seed = make_seed(3, channels=16, size=20)
    assert seed.shape == (3, 16, 20, 20)
    assert seed[:, 3:, 10, 10].eq(1).all()
    assert seed[:, :3].eq(0).all()
    assert seed.sum() == 3 * 13


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_rule_shape_and_dtype(dtype):
    rule = _trained_like_rule().to(dtype)
    x = _random_state().to(dtype)
    y = rule(x)
    assert y.shape == x.shape
    assert y.dtype == dtype
    assert torch.isfinite(y).all()
    assert not torch.equal(y, x)


def test_update_rule_perception_has_48_features_and_zero_init_last_layer():
    rule = UpdateRule()
    assert rule.kernel.shape == (48, 1, 3, 3)
    assert rule.conv1.in_channels == 48 and rule.conv1.out_channels == 128
    assert rule.conv2.in_channels == 128 and rule.conv2.out_channels == 16
    assert rule.conv2.weight.abs().sum() == 0 and rule.conv2.bias.abs().sum() == 0


def test_zero_init_first_update_is_identity_up_to_alive_masking():
    rule = UpdateRule()
    x = _random_state()
    alive = F.max_pool2d(x[:, 3:4], kernel_size=3, stride=1, padding=1) > 0.1
    expected = x * alive.to(x.dtype)
    torch.manual_seed(0)
    y = rule(x)
    assert torch.equal(y, expected)
    assert not torch.equal(y, x)  # the dead half really was zeroed
    seed = make_seed(2, size=16)
    assert torch.equal(rule(seed), seed)  # the live seed cell survives unchanged


def test_seeded_rollout_is_bitwise_reproducible():
    model = NCA()
    model.update_rule = _trained_like_rule()
    seed = make_seed(2, size=16)
    outs = []
    for s in (123, 123, 124):
        torch.manual_seed(s)
        with torch.no_grad():
            outs.append(model(seed, 12))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])  # the fire mask really depends on the RNG


def test_torchscript_update_rule_matches_eager():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted_default = torch.jit.script(UpdateRule())
        rule = _trained_like_rule()
        scripted = torch.jit.script(rule)
    assert scripted_default is not None
    x = _random_state()
    torch.manual_seed(7)
    eager_out = rule(rule(x))
    torch.manual_seed(7)
    scripted_out = scripted(scripted(x))
    assert torch.equal(eager_out, scripted_out)


def test_nca_forward_calls_update_rule_once_per_iteration():
    model = NCA()
    calls: List[int] = []
    handle = model.update_rule.register_forward_hook(lambda mod, inp, out: calls.append(1))
    try:
        model(make_seed(1, size=12), 9)
        assert len(calls) == 9
        calls.clear()
        model(make_seed(1, size=12), 0)
        assert len(calls) == 0
    finally:
        handle.remove()
    model(make_seed(1, size=12), 3)
    assert len(calls) == 0  # the hook really is gone


def test_checkpointed_rollout_matches_plain_rollout_and_gradients():
    rule = _trained_like_rule()
    seed = make_seed(2, size=12)
    results = []
    for every in (0, 4):
        rule.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        out = run_iterations(rule, seed, 10, checkpoint_every=every)
        out[:, :4].square().mean().backward()
        results.append((out.detach(), rule.conv1.weight.grad.clone()))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][1].abs().sum() > 0


def test_rollout_calls_observer_once_per_iteration_in_order():
    pytest.importorskip("instrument.core.context")
    model = NCA()
    model.update_rule = _trained_like_rule()
    seen = []
    seed = make_seed(1, size=12)
    torch.manual_seed(0)
    out = rollout(model, seed, 6, observer=seen.append)
    assert [ctx.step_index for ctx in seen] == list(range(6))
    assert torch.equal(seen[0].previous_state, seed)
    assert torch.equal(seen[-1].next_state, out)
    for a, b in zip(seen, seen[1:], strict=False):
        assert torch.equal(a.next_state, b.previous_state)
    torch.manual_seed(0)
    assert torch.equal(rollout(model, seed, 6), out)  # observing does not change the rollout


def test_train_nca_short_run_returns_summary_and_is_reproducible():
    kwargs = dict(steps=3, batch_size=2, size=16, n_iter_min=6, n_iter_max=8, seed=5)
    first = train_nca(**kwargs)
    assert first["steps"] == 3
    assert math.isfinite(first["final_loss"]) and first["final_loss"] > 0
    assert first["seconds"] > 0
    assert len(first["losses"]) == 3
    second = train_nca(**kwargs)
    assert first["losses"] == second["losses"]
    checkpointed = train_nca(checkpoint_every=3, **kwargs)
    assert checkpointed["losses"] == pytest.approx(first["losses"], rel=1e-5)


# ----------------------------------------------------------------------------------------------- CartPole


def _gym_step(state, action):
    """Scalar reference: gym's CartPole-v1 equations, written out in plain floats."""
    x, x_dot, theta, theta_dot = state
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = masscart + masspole
    polemass_length = masspole * length
    force = force_mag if action == 1 else -force_mag
    cos, sin = math.cos(theta), math.sin(theta)
    temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
    thetaacc = (gravity * sin - cos * temp) / (length * (4.0 / 3.0 - masspole * cos**2 / total_mass))
    xacc = temp - polemass_length * thetaacc * cos / total_mass
    return [x + tau * x_dot, x_dot + tau * xacc, theta + tau * theta_dot, theta_dot + tau * thetaacc]


def test_cartpole_single_step_matches_hand_computation():
    env = CartPole(num_envs=3, dtype=torch.float64)
    states = [[0.0, 0.0, 0.0, 0.0], [0.1, 0.5, 0.05, -0.2], [-1.0, -0.3, -0.1, 0.7]]
    actions = [1, 0, 1]
    env.state = torch.tensor(states, dtype=torch.float64)
    obs, reward, done = env.step(torch.tensor(actions))
    # from rest, pushing right: temp = 10/1.1, thetaacc = -temp / (0.5 * (4/3 - 0.1/1.1)), xacc = ...
    assert obs[0].tolist() == pytest.approx([0.0, 0.19512195, 0.0, -0.29268293], abs=1e-7)
    for row, state, action in zip(obs.tolist(), states, actions, strict=True):
        assert row == pytest.approx(_gym_step(state, action), abs=1e-12)
    assert reward.tolist() == [1.0, 1.0, 1.0]
    assert done.tolist() == [False, False, False]


def test_cartpole_termination_and_reset():
    env = CartPole(num_envs=4, generator=torch.Generator().manual_seed(0))
    obs = env.reset()
    assert obs.shape == (4, 4) and obs.abs().max() <= 0.05
    limit = 12 * 2 * math.pi / 360
    env.state = torch.tensor(
        [
            [2.39, 1.0, 0.0, 0.0],  # x crosses +2.4
            [-2.39, -1.0, 0.0, 0.0],  # x crosses -2.4
            [0.0, 0.0, limit - 0.001, 1.0],  # theta crosses +12 degrees
            [0.0, 0.0, 0.0, 0.0],  # stays up
        ]
    )
    _, _, done = env.step(torch.tensor([1, 0, 1, 1]))
    assert done.tolist() == [True, True, True, False]
    again = CartPole(num_envs=4, generator=torch.Generator().manual_seed(0)).reset()
    assert torch.equal(obs, again)


def test_rollout_episode_masks_are_consistent():
    torch.manual_seed(0)
    env = CartPole(num_envs=32, generator=torch.Generator().manual_seed(0))
    traj = rollout_episode(env, Policy(), max_steps=60, generator=torch.Generator().manual_seed(1))
    T, N = traj.alive.shape
    assert N == 32 and 1 <= T <= 60
    assert traj.log_probs.shape == traj.rewards.shape == (T, N)
    assert traj.log_probs.requires_grad and (traj.log_probs <= 0).all()
    alive = traj.alive.to(torch.int64)
    assert traj.alive.dtype == torch.bool
    assert traj.alive[0].all()
    assert (alive[1:] <= alive[:-1]).all()  # once dead, dead forever
    assert torch.equal(traj.lengths, alive.sum(0))
    assert torch.equal(traj.rewards, traj.alive.to(traj.rewards.dtype))
    assert traj.lengths.min() >= 1 and traj.lengths.max() <= 60
    assert (traj.lengths < 60).any()  # a random policy drops some poles within 60 steps


def test_rollout_episode_is_reproducible_with_generators():
    def run():
        torch.manual_seed(0)
        env = CartPole(num_envs=16, generator=torch.Generator().manual_seed(2))
        return rollout_episode(env, Policy(), max_steps=40, generator=torch.Generator().manual_seed(3))

    a, b = run(), run()
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.log_probs.detach(), b.log_probs.detach())


def test_rollout_episode_calls_observer_with_action_condition():
    pytest.importorskip("instrument.core.context")
    torch.manual_seed(0)
    env = CartPole(num_envs=8, generator=torch.Generator().manual_seed(0))
    seen = []
    traj = rollout_episode(env, Policy(), max_steps=15, observer=seen.append)
    assert [ctx.step_index for ctx in seen] == list(range(traj.alive.shape[0]))
    assert seen[0].condition.shape == (8, 1)
    assert set(seen[0].condition.flatten().tolist()) <= {0.0, 1.0}
    assert seen[0].next_state.shape == (8, 4)


def test_discounted_returns():
    rewards = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    returns = discounted_returns(rewards, gamma=0.5)
    assert returns.tolist() == [[1.75, 1.0], [1.5, 0.0], [1.0, 0.0]]


def test_train_cartpole_short_run_returns_summary():
    result = train_cartpole(steps=3, num_envs=16, max_steps=30, seed=1)
    assert result["steps"] == 3
    for key in ("first_mean_length", "final_mean_length", "seconds"):
        assert math.isfinite(result[key])
    assert 1 <= result["first_mean_length"] <= 30
    assert 1 <= result["final_mean_length"] <= 30
    again = train_cartpole(steps=3, num_envs=16, max_steps=30, seed=1)
    assert again["mean_lengths"] == result["mean_lengths"]  # seeded end to end


# ------------------------------------------------------------------------- the instrumentation call pattern


class _Keep(instrument.Backend):
    def __init__(self) -> None:
        self.records: List[instrument.StepRecord] = []

    def write(self, record):
        self.records.append(record)


class _Counter(instrument.Observer):
    def reset(self) -> None:
        self.indices: List[int] = []

    def observe(self, context) -> None:
        self.indices.append(context.step_index)

    def log(self, logger, step) -> None:
        logger.log_metrics({"iterations": len(self.indices)}, step=step, prefix="counter")


def test_train_nca_drives_the_real_instrumentation():
    keep, counter = _Keep(), _Counter()
    inst = instrument.Instrumentation([counter], backends=[keep], log_interval=1)
    result = train_nca(inst, steps=2, batch_size=1, size=12, n_iter_min=4, n_iter_max=4)
    inst.close()
    assert [r.step for r in keep.records] == [0, 1]
    assert [r.scalars["counter/iterations"] for r in keep.records] == [4.0, 4.0]  # hooks fired inside the steps
    assert [r.scalars["train/loss"] for r in keep.records] == pytest.approx(result["losses"])
    assert len(result["model"].update_rule._forward_hooks) == 0  # and were removed afterwards


def test_train_cartpole_drives_the_real_instrumentation():
    keep, counter = _Keep(), _Counter()
    inst = instrument.Instrumentation([counter], backends=[keep], log_interval=1)
    result = train_cartpole(inst, steps=2, num_envs=8, max_steps=10)
    inst.close()
    assert [r.step for r in keep.records] == [0, 1]
    assert {"train/loss", "train/episode_length"} <= set(keep.records[0].scalars)
    assert counter.indices == list(range(len(counter.indices))) and counter.indices
    assert keep.records[-1].scalars["train/episode_length"] == pytest.approx(result["final_mean_length"])


@pytest.mark.parametrize(
    "demo, kwargs, said",
    [
        (train_nca, {"channels": 3}, "train_nca channels must be an int >= 4 (R, G, B and alpha"),
        (train_nca, {"hidden": 0}, "train_nca hidden must be an int >= 1"),
        (train_nca, {"fire_rate": 1.5}, "train_nca fire_rate must be a number in [0, 1]"),
        (train_nca, {"fire_rate": -0.1}, "train_nca fire_rate must be a number in [0, 1]"),
        (train_nca, {"checkpoint_every": -1}, "train_nca checkpoint_every must be an int >= 0 (0: off), got -1"),
        (train_nca, {"lr": 0}, "train_nca lr must be a finite number > 0, got 0"),
        (train_cartpole, {"max_steps": 0}, "train_cartpole max_steps must be an int >= 1"),
        (train_cartpole, {"num_envs": 0}, "train_cartpole num_envs must be an int >= 1"),
        (train_cartpole, {"steps": 0}, "train_cartpole steps must be an int >= 1"),
        (train_cartpole, {"hidden": -2}, "train_cartpole hidden must be an int >= 1"),
        (train_cartpole, {"gamma": 1.5}, "train_cartpole gamma must be a number in [0, 1]"),
        (train_cartpole, {"lr": -1.0}, "train_cartpole lr must be a finite number > 0"),
        (build_ppo_trainer, {"lr": float("inf")}, "build_ppo_trainer lr must be a finite number > 0, got inf"),
    ],
)
def test_demo_arguments_out_of_range_are_configuration_errors(demo, kwargs, said):
    # channels=3 / hidden=0 were tracebacks from inside the model; train_cartpole(num_envs=0) ran to the end
    # with nan metrics, and max_steps=0 was a RuntimeError from torch.stack.
    with pytest.raises(instrument.ConfigurationError, match=re.escape(said) + r".*bind e\.g\."):
        demo(**kwargs)


def test_a_demo_argument_out_of_range_bound_in_gin_is_named_where_it_was_bound(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    out = subprocess.run([sys.executable, "-m", "instrument", "run", "rl_cartpole", "--bind",
                          "train_cartpole.max_steps = 0"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "train_cartpole max_steps must be an int >= 1" in out.stderr
    assert "bound at --bind 'train_cartpole.max_steps = 0'" in out.stderr


@pytest.mark.parametrize(
    "device, said",
    [
        ("gpu", "train_nca device must name a torch device, got 'gpu'; bind e.g. train_nca.device = 'cpu'"),
        ("meta", "train_nca device must be one of cpu, cuda, mps (or 'auto'), got 'meta'"),
        (0.5, "train_nca device must be a device name or a torch.device, got 0.5 (float)"),
    ],
)
def test_a_device_the_demo_cannot_train_on_is_refused_before_anything_runs(device, said):
    with pytest.raises(instrument.ConfigurationError, match=re.escape(said)):
        train_nca(steps=1, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_cuda_on_a_machine_without_it_names_the_torch_build_and_the_fix():
    for demo, owner in ((train_nca, "train_nca"), (train_cartpole, "train_cartpole")):
        with pytest.raises(instrument.ConfigurationError, match=rf"{owner} device is 'cuda:1', but this torch sees "
                           rf"no CUDA device \(torch .*\); bind {owner}\.device = 'cpu'"):
            demo(steps=1, device="cuda:1")


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="auto is the CPU here")
def test_auto_trains_on_the_cpu_of_a_machine_without_a_gpu_with_the_same_numbers():
    kwargs = dict(steps=2, batch_size=1, size=12, n_iter_min=3, n_iter_max=3, seed=2)
    assert train_nca(device="auto", **kwargs)["losses"] == train_nca(**kwargs)["losses"]
    assert (train_cartpole(steps=2, num_envs=8, max_steps=10, device=torch.device("cpu"))["mean_lengths"]
            == train_cartpole(steps=2, num_envs=8, max_steps=10)["mean_lengths"])
