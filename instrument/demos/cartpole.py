"""A vectorised CartPole-v1 in torch and a REINFORCE policy for it.

The environment is a batch of independent carts stepped as one tensor op, so an episode is a rollout whose
state is [num_envs, 4] and whose condition is the action: the same shape of problem the instrumentation
observes in an NCA, but with an explicit evolver loop. Plain torch, no gym dependency, seeded end to end.
"""

import contextlib
import math
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import gin
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from instrument.checks import check_int, check_number
from instrument.demos.device import demo_device

__all__ = ["CartPole", "Policy", "Trajectory", "rollout_episode", "discounted_returns", "train_cartpole"]


class CartPole:
    """``num_envs`` CartPole-v1 systems (Euler integration, gym's constants) stepped together.

    There is deliberately NO auto-reset: a terminated cart keeps being integrated and keeps reporting
    ``done=True``. The training loop tracks an ``alive`` mask instead and ignores everything after an
    environment's first ``done``, which keeps every environment on the same time index (one episode = one
    batched rollout) and avoids mixing two episodes in one row.
    """

    def __init__(
        self,
        num_envs: int = 256,
        device: Union[str, torch.device] = "cpu",
        generator: Optional[torch.Generator] = None,
        gravity: float = 9.8,
        masscart: float = 1.0,
        masspole: float = 0.1,
        length: float = 0.5,
        force_mag: float = 10.0,
        tau: float = 0.02,
        x_threshold: float = 2.4,
        theta_threshold_degrees: float = 12.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.generator = generator
        self.dtype = dtype
        self.gravity = gravity
        self.masscart = masscart
        self.masspole = masspole
        self.total_mass = masscart + masspole
        self.length = length  # half the pole's length, as in gym
        self.polemass_length = masspole * length
        self.force_mag = force_mag
        self.tau = tau
        self.x_threshold = x_threshold
        self.theta_threshold = theta_threshold_degrees * 2.0 * math.pi / 360.0
        self.state = torch.zeros(num_envs, 4, device=self.device, dtype=dtype)

    def reset(self) -> Tensor:
        """Start every environment from a state drawn uniformly in [-0.05, 0.05]^4; returns obs [N, 4]."""
        u = torch.rand(self.num_envs, 4, generator=self.generator, device=self.device, dtype=self.dtype)
        self.state = u * 0.1 - 0.05
        return self.state.clone()

    def step(self, action: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Apply ``action`` [N] (0 = left, 1 = right); returns (obs [N, 4], reward [N], done [N] bool).

        The reward is 1 for every step, the terminating one included, as in gym.
        """
        x, x_dot, theta, theta_dot = self.state.unbind(dim=1)
        force = torch.where(action == 1, self.force_mag, -self.force_mag).to(self.dtype)
        costheta = torch.cos(theta)
        sintheta = torch.sin(theta)
        temp = (force + self.polemass_length * theta_dot**2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta**2 / self.total_mass)
        )
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        self.state = torch.stack([x, x_dot, theta, theta_dot], dim=1)
        done = (x.abs() > self.x_threshold) | (theta.abs() > self.theta_threshold)
        reward = torch.ones(self.num_envs, device=self.device, dtype=self.dtype)
        return self.state.clone(), reward, done


class Policy(nn.Module):
    """MLP 4 -> hidden -> hidden -> 2 with tanh; ``forward(obs)`` returns action logits."""

    def __init__(self, obs_dim: int = 4, hidden: int = 64, num_actions: int = 2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_actions)

    def forward(self, obs: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(obs))
        h = torch.tanh(self.fc2(h))
        return self.head(h)


class Trajectory(NamedTuple):
    """One batched episode. ``alive[t, n]`` is True while env n had not yet terminated before step t."""

    log_probs: Tensor  # [T, N], log pi(a_t | s_t), differentiable
    rewards: Tensor  # [T, N], already zeroed where not alive
    alive: Tensor  # [T, N] bool, non-increasing in t
    lengths: Tensor  # [N] long, episode lengths (= alive.sum(0))


def rollout_episode(
    env: CartPole,
    policy: nn.Module,
    max_steps: int = 200,
    observer: Optional[Callable[[Any], Any]] = None,
    generator: Optional[torch.Generator] = None,
) -> Trajectory:
    """Run one batched episode from ``env.reset()`` for at most ``max_steps`` steps.

    Actions are sampled from the policy's categorical distribution with ``generator`` (reproducible without
    touching the global RNG). The loop stops early once every environment has terminated. With ``observer``
    each step is handed over as ``StepContext(previous_state=obs, next_state=next_obs, condition=action
    [N, 1] float, step_index=t)``; the observer sees every environment, terminated ones included.
    """
    step_context: Any = None
    if observer is not None:
        from instrument.core.context import StepContext

        step_context = StepContext
    obs = env.reset()
    alive = torch.ones(env.num_envs, dtype=torch.bool, device=obs.device)
    log_probs: List[Tensor] = []
    rewards: List[Tensor] = []
    alives: List[Tensor] = []
    for t in range(max_steps):
        logp_all = F.log_softmax(policy(obs), dim=-1)
        action = torch.multinomial(logp_all.detach().exp(), 1, generator=generator).squeeze(1)
        next_obs, reward, done = env.step(action)
        if observer is not None:
            observer(
                step_context(
                    previous_state=obs,
                    next_state=next_obs,
                    condition=action.to(obs.dtype).unsqueeze(1),
                    step_index=t,
                )
            )
        log_probs.append(logp_all.gather(1, action.unsqueeze(1)).squeeze(1))
        rewards.append(reward * alive.to(reward.dtype))
        alives.append(alive)
        alive = alive & ~done
        obs = next_obs
        if not bool(alive.any()):
            break
    alive_mask = torch.stack(alives)
    return Trajectory(
        log_probs=torch.stack(log_probs),
        rewards=torch.stack(rewards),
        alive=alive_mask,
        lengths=alive_mask.sum(dim=0),
    )


def discounted_returns(rewards: Tensor, gamma: float = 0.99) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{t+1} along dim 0 of ``rewards`` [T, N]."""
    returns = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def _reinforce_loss(traj: Trajectory, gamma: float) -> Tensor:
    """Policy-gradient loss with reward-to-go, a per-timestep mean baseline and normalised advantages."""
    alive = traj.alive.to(traj.rewards.dtype)
    returns = discounted_returns(traj.rewards, gamma)
    baseline = (returns * alive).sum(dim=1, keepdim=True) / alive.sum(dim=1, keepdim=True).clamp(min=1.0)
    advantage = (returns - baseline) * alive
    n_alive = alive.sum().clamp(min=1.0)
    std = ((advantage**2).sum() / n_alive).sqrt()
    advantage = advantage / (std + 1e-8)
    return -(traj.log_probs * advantage.detach() * alive).sum() / n_alive


def train_cartpole(
    instrumentation: Any = None,
    steps: int = 100,
    num_envs: int = 256,
    max_steps: int = 200,
    lr: float = 1e-2,
    gamma: float = 0.99,
    seed: int = 0,
    hidden: int = 64,
    rl_logging: Any = None,
    device: Any = "cpu",
) -> Dict[str, Any]:
    """Train `Policy` on `CartPole` with REINFORCE; returns first/final mean episode length and timings.

    ``seed`` fixes the policy init (global RNG), the resets (the env's generator) and the action sampling (a
    second generator), so two runs with the same arguments are identical. With ``instrumentation`` each step
    runs inside ``inst.step(step)`` and the episode is observed through ``s.observer``; the caller closes it.

    ``rl_logging`` (an `instrument.rl.RLLogging`) adds the standard RL metrics: each step's batched episode is
    one collected batch ([time, envs], the alive mask as the collector mask, each env's episode ending at its
    last alive step), the REINFORCE loss its training metrics, the rollout and the update its timed stages,
    and its `Evaluation`, when bound, runs the policy in gymnasium's own CartPole-v1.

    ``device``: where the environments, the policy and the generators live (`instrument.demos.device`:
    ``'cpu'``, ``'cuda'``, ``'auto'``...). The policy is initialised on the CPU and moved; resets and actions are
    drawn by generators on the device, so a GPU run is seeded too, with its own numbers.
    """
    for name, value, least, why, fix in (
        ("steps", steps, 1, "", 100), ("num_envs", num_envs, 1, "environments run in parallel", 256),
        ("max_steps", max_steps, 1, "the longest episode", 200), ("hidden", hidden, 1, "the policy's width", 64),
    ):
        check_int(f"train_cartpole {name}", value, least=least, why=why, fix=f"bind e.g. train_cartpole.{name} = {fix}")
    check_number("train_cartpole lr", lr, above=0, most=sys.float_info.max, expected="a finite number > 0",
                 fix="bind e.g. train_cartpole.lr = 1e-2")  # 1e999 reads as infinity: no learning rate
    check_number("train_cartpole gamma", gamma, least=0, most=1, fix="bind e.g. train_cartpole.gamma = 0.99")
    dev = demo_device("train_cartpole", device)
    torch.manual_seed(seed)
    env = CartPole(num_envs=num_envs, device=dev, generator=torch.Generator(dev).manual_seed(seed))
    actions_rng = torch.Generator(dev).manual_seed(seed + 1)
    policy = Policy(hidden=hidden).to(dev)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    inst = instrumentation
    rl = rl_logging
    if rl is not None and not rl.attached:
        from instrument.rl.runner import GymnasiumRunner

        runner = GymnasiumRunner("CartPole-v1", policy, seed=seed) if rl.evaluation is not None else None
        rl.attach(inst, eval_runner=runner)

    def stage(name: str):
        return rl.timer(name) if rl is not None else contextlib.nullcontext()

    def train_step(observer: Optional[Callable[[Any], Any]]) -> Tuple[Tensor, Tensor]:
        with stage("collection"):
            traj = rollout_episode(env, policy, max_steps, observer=observer, generator=actions_rng)
        with stage("optimization"):
            loss = _reinforce_loss(traj, gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if rl is not None:
            # Every env's episode ends at its last alive step (terminated, or truncated at max_steps).
            ended = traj.alive & ~torch.cat([traj.alive[1:], torch.zeros_like(traj.alive[:1])])
            rl.observe_batch(reward=traj.rewards, done=ended, mask=traj.alive)
            rl.observe_losses({"loss": loss.detach()})
        return loss.detach(), traj.lengths

    mean_lengths: List[Tensor] = []  # tensors: no host sync per step beyond the rollout's early stop
    start = time.perf_counter()
    cpu_start = time.process_time()
    for step in range(steps):
        if inst is None:
            with rl.iteration() if rl is not None else contextlib.nullcontext():
                _, lengths = train_step(None)
        else:
            with inst.step(step) as s, rl.iteration() if rl is not None else contextlib.nullcontext():
                loss, lengths = train_step(s.observer)
                inst.logger.log_metrics(
                    {"loss": loss, "episode_length": lengths.float().mean()}, step=step, prefix="train"
                )
        mean_lengths.append(lengths.float().mean())
    if rl is not None:
        rl.close()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start  # less skewed than wall time on a busy machine
    history = torch.stack(mean_lengths).tolist() if mean_lengths else []
    return {
        "first_mean_length": history[0] if history else float("nan"),
        "final_mean_length": history[-1] if history else float("nan"),
        "mean_lengths": history,
        "steps": steps,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "policy": policy,
    }


# gin at the edge: a config that imports this module (`import instrument.demos.cartpole`) can bind these;
# registered as copies, so calling them from Python ignores bindings.
gin.external_configurable(train_cartpole, name="train_cartpole")
