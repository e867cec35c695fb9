"""A short PPO run on gymnasium CartPole-v1 with a real TorchRL collector and Trainer, logged by `RLLogging`.

``instrument run rl_torchrl_ppo`` runs it. The trainer is TorchRL's own
(``torchrl.trainers.Trainer`` with GAE, a sub-batch sampler and a clipped PPO loss); instrument only adds one
hook (`instrument.rl.torchrl.TorchRLHook`). Needs ``pip install 'torch-instrument[torchrl]'``.
"""

import sys
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import gin
import torch
from torch import nn

from instrument.checks import check_number
from instrument.errors import require

__all__ = ["build_ppo_trainer", "run_trainer", "train_torchrl_ppo"]


def build_ppo_trainer(
    instrumentation: Any = None,
    rl_logging: Any = None,
    env_name: str = "CartPole-v1",
    total_frames: int = 4096,
    frames_per_batch: int = 256,
    epochs: int = 4,
    minibatch_size: int = 64,
    hidden: int = 64,
    lr: float = 3e-3,
    gamma: float = 0.99,
    lmbda: float = 0.95,
    clip_epsilon: float = 0.2,
    entropy_coef: float = 0.01,
    eval_pixels: bool = False,
    seed: int = 0,
    num_threads: Optional[int] = 1,
    save_trainer_file: Optional[str] = None,
) -> Tuple[Any, Any]:
    """Build the TorchRL PPO trainer with the RL logging hook registered; returns ``(trainer, hook)``.

    Args:
        instrumentation: the session metrics go to (the CLI passes it); None makes a default one.
        rl_logging: the `RLLogging` set (bind it in gin); None uses the standard set.
        eval_pixels: make the evaluation environment render frames, so ``Evaluation(video=True)`` has a video.
        save_trainer_file: where TorchRL checkpoints the trainer with its unified ``Checkpoint`` (our hook's
            counters included); resume with ``trainer.load_from_file(path)``.
    """
    check_number("build_ppo_trainer lr", lr, above=0, most=sys.float_info.max, expected="a finite number > 0",
                 fix="bind e.g. build_ppo_trainer.lr = 3e-3")  # 1e999 reads as infinity: no learning rate
    require("torchrl", "torchrl", "train_torchrl_ppo")
    from tensordict.nn import TensorDictModule
    from torchrl.checkpoint import Checkpoint
    from torchrl.collectors import Collector
    from torchrl.envs import Compose, GymEnv, RewardSum, StepCounter, TransformedEnv
    from torchrl.modules import ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE
    from torchrl.trainers import BatchSubSampler, DefaultOptimizationStepper, Trainer, ValueEstimatorHook

    from instrument.rl.rl_logging import RLLogging
    from instrument.rl.torchrl import TorchRLHook, TorchRLRunner

    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)

    def make_env(pixels: bool = False):
        # Categorical actions (an index), matching the Categorical policy below (the default is one-hot).
        kwargs = {"from_pixels": True, "pixels_only": False} if pixels else {}
        base = GymEnv(env_name, categorical_action_encoding=True, **kwargs)
        return TransformedEnv(base, Compose(StepCounter(), RewardSum()))

    env = make_env()
    env.set_seed(seed)
    n_obs = env.observation_spec["observation"].shape[-1]
    n_act = env.action_spec.space.n
    actor_net = nn.Sequential(nn.Linear(n_obs, hidden), nn.Tanh(), nn.Linear(hidden, n_act))
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
        spec=env.action_spec,
    )
    critic = ValueOperator(
        nn.Sequential(nn.Linear(n_obs, hidden), nn.Tanh(), nn.Linear(hidden, 1)), in_keys=["observation"]
    )
    collector = Collector(
        env,
        actor,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        auto_register_policy_transforms=False,
    )
    loss = ClipPPOLoss(actor, critic, clip_epsilon=clip_epsilon, entropy_coeff=entropy_coef)
    trainer = Trainer(
        collector=collector,
        total_frames=total_frames,
        frame_skip=1,
        optim_steps_per_batch=max(frames_per_batch // minibatch_size, 1),
        num_epochs=epochs,
        loss_module=loss,
        optimizer=torch.optim.Adam(loss.parameters(), lr=lr),
        optimization_stepper=DefaultOptimizationStepper(),
        progress_bar=False,
        clip_norm=1.0,
        auto_log_optim_steps=False,
        save_trainer_file=save_trainer_file,
        checkpoint=Checkpoint() if save_trainer_file else None,
    )
    ValueEstimatorHook(GAE(gamma=gamma, lmbda=lmbda, value_network=critic, average_gae=True)).register(
        trainer
    )
    BatchSubSampler(batch_size=minibatch_size).register(trainer)

    rl = rl_logging if rl_logging is not None else RLLogging()
    runner = None
    if rl.evaluation is not None:
        eval_env = make_env(pixels=eval_pixels)
        eval_env.set_seed(seed + 1)
        runner = TorchRLRunner(eval_env, actor)
    hook = TorchRLHook(rl, instrumentation=instrumentation, eval_runner=runner)
    hook.register(trainer)
    return trainer, hook


def train_torchrl_ppo(
    instrumentation: Any = None,
    rl_logging: Any = None,
    build: Callable[..., Tuple[Any, Any]] = build_ppo_trainer,
) -> Dict[str, Any]:
    """Build the trainer with ``build`` and train it; returns the final counters.

    The trainer's settings are ``build_ppo_trainer``'s arguments: bind them in gin as
    ``build_ppo_trainer.total_frames = 8192`` and so on.
    """
    trainer, hook = build(instrumentation=instrumentation, rl_logging=rl_logging)
    run_trainer(trainer)
    counters = hook.rl.counters.state_dict()
    return {
        "frames": counters["frames"],
        "episodes": counters["episodes"],
        "iterations": counters["iterations"],
    }


def run_trainer(trainer: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchRL's notices about its own future hook API
        trainer.train()


# gin at the edge: a config that imports this module (`import instrument.demos.torchrl_ppo`) can bind these;
# registered as copies, so calling them from Python ignores bindings.
gin.external_configurable(train_torchrl_ppo, name="train_torchrl_ppo")
gin.external_configurable(build_ppo_trainer, name="build_ppo_trainer")
