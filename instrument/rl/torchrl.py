"""TorchRL integration: `RLLogging` as a `torchrl.trainers.Trainer` hook, and a TorchRL evaluation runner.

Needs ``pip install 'torch-instrument[torchrl]'``; this module is imported only when used, so instrument itself
never pays for importing TorchRL. One call adds the standard RL logging to a trainer::

    from instrument.rl.torchrl import instrument_trainer
    hook = instrument_trainer(trainer, instrumentation=inst, eval_env=eval_env, policy=actor)
    trainer.train()                    # metrics go to inst's backends; W&B finished at shutdown

`TorchRLHook` implements TorchRL's trainer-hook interface (``register``, ``state_dict``, ``load_state_dict``).
Each part of the set runs at the stage where its data exists (see ``Trainer.train`` / ``optim_steps``):

=============================  =====================================================================
trainer stage                  what runs
=============================  =====================================================================
``setup``                      start the ``iteration`` and ``collection`` timers
``batch_process``              stop ``collection`` (the collector has just yielded the batch)
``pre_steps_log``              counters (frames from ``trainer.collected_frames``), collection metrics
``pre_optim_steps``            start ``optimization``
``post_optim_complete_log``    training metrics from the averaged loss TensorDict
``post_steps``                 stop ``optimization``
``post_steps_log``             evaluation when due, logging and the commit; restart the timers
``shutdown``                   commit what is left, close the bar and (by default) the session
=============================  =====================================================================

Registering also calls ``trainer.register_module(name, hook)``, so ``trainer.state_dict()`` carries the counters
and evaluation schedule, and ``trainer.load_state_dict()`` resumes them: the step numbering continues.
"""

from typing import Any, Callable, Dict, Optional

import torch

from instrument.errors import ConfigurationError, require
from instrument.rl.evaluation import Episode
from instrument.rl.rl_logging import RLLogging

require("torchrl", "torchrl", "instrument.rl.torchrl")

from torchrl.trainers import TrainerHookBase  # noqa: E402  (after the friendly missing-extra check)

__all__ = ["TorchRLHook", "TorchRLRunner", "instrument_trainer"]


class TorchRLHook(TrainerHookBase):
    """Drives an `RLLogging` set from a TorchRL ``Trainer``'s hook stages.

    Args:
        rl: the logging set; None means ``RLLogging()`` with its defaults.
        instrumentation: where it logs (an `Instrumentation` or a `Logger`) if ``rl`` is not attached yet;
            None makes a default `Instrumentation`, closed at the trainer's shutdown.
        eval_runner: the episode runner of ``rl.evaluation`` (e.g. a `TorchRLRunner`).
        close_on_shutdown: at the trainer's shutdown, close the session too (every backend, W&B ``finish``
            included); False leaves that to the caller's ``inst.close()``.
    """

    def __init__(
        self,
        rl: Optional[RLLogging] = None,
        instrumentation: Any = None,
        eval_runner: Optional[Callable[[bool, int, bool], Episode]] = None,
        close_on_shutdown: bool = True,
    ) -> None:
        self.rl = rl if rl is not None else RLLogging()
        self.close_on_shutdown = close_on_shutdown
        self._instrumentation = instrumentation
        self._eval_runner = eval_runner
        self._trainer = None
        self._trainer_frames = 0
        self._collected = None  # this iteration's batch as the collector made it (`on_batch_process`)

    # ------------------------------------------------------------------ TrainerHookBase
    def register(self, trainer, name: str = "instrument") -> None:
        if self._trainer is not None:
            raise ConfigurationError("this TorchRLHook is already registered with a trainer.")
        if not self.rl.attached:
            self.rl.attach(self._instrumentation, eval_runner=self._eval_runner)
        elif self._eval_runner is not None and self.rl.evaluation is not None:
            self.rl.evaluation.runner = self._eval_runner
        if self.rl.progress is not None and self.rl.progress.total_frames is None:
            self.rl.progress.set_total(trainer.total_frames)
        self._trainer = trainer
        self._trainer_frames = int(trainer.collected_frames)
        trainer.register_module(name, self)
        trainer.register_op("setup", self.on_setup)
        trainer.register_op("batch_process", self.on_batch_process)
        _run_first(getattr(trainer, "_batch_process_ops", None))
        trainer.register_op("pre_steps_log", self.on_pre_steps_log)
        trainer.register_op("pre_optim_steps", self.on_pre_optim_steps)
        trainer.register_op("post_optim_complete_log", self.on_post_optim_complete_log)
        trainer.register_op("post_steps", self.on_post_steps)
        trainer.register_op("post_steps_log", self.on_post_steps_log)
        trainer.register_op("shutdown", self.on_shutdown)

    def state_dict(self) -> Dict[str, Any]:
        return {"rl": self.rl.state_dict(), "trainer_frames": int(self._trainer_frames)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.rl.load_state_dict(_plain(state_dict["rl"]))
        self._trainer_frames = int(state_dict.get("trainer_frames", self.rl.counters.frames))

    # ------------------------------------------------------------------ stages
    def on_setup(self) -> None:
        self.rl.clock.start("iteration")
        self.rl.clock.start("collection")

    def on_batch_process(self, batch):
        self.rl.clock.stop("collection")
        self._collected = batch  # before any other op: ReplayBufferTrainer's flattens [N, T] into [N * T]
        return None  # the batch is not changed

    def on_pre_steps_log(self, batch) -> None:
        collected = int(self._trainer.collected_frames)
        frames, self._trainer_frames = max(collected - self._trainer_frames, 0), collected
        # The hooks get the batch as the batch_process ops left it. A flattened one has lost its time dimension,
        # so episodes would be cut across environments: observe the collector's own batch instead.
        seen, self._collected = self._collected, None
        self.rl.observe_batch(seen if seen is not None else batch, frames=frames)  # None: asynchronous, frames
        return None

    def on_pre_optim_steps(self) -> None:
        self.rl.clock.start("optimization")

    def on_post_optim_complete_log(self, optim_steps: int, average_losses) -> None:
        if average_losses is not None:
            self.rl.observe_losses(average_losses)
        return None

    def on_post_steps(self) -> None:
        self.rl.clock.stop("optimization")

    def on_post_steps_log(self, batch) -> None:
        self.rl.clock.stop("iteration")
        self.rl.end_iteration()
        self.rl.clock.start("iteration")
        self.rl.clock.start("collection")
        return None

    def on_shutdown(self) -> None:
        if self.close_on_shutdown:
            self.rl.close_session()
        else:
            self.rl.close()

    def __repr__(self) -> str:
        return f"TorchRLHook(rl={self.rl!r})"


class TorchRLRunner:
    """Runs a TorchRL policy for one evaluation episode with ``env.rollout``.

    Deterministic episodes run under ``ExplorationType.DETERMINISTIC`` (the distribution's mode), stochastic
    ones under ``ExplorationType.RANDOM`` (samples). With ``render``, the frames are the rollout's
    ``pixels_key`` entry (e.g. ``GymEnv(..., from_pixels=True, pixels_only=False)``); the return stays on the device.
    """

    def __init__(self, env, policy, pixels_key: Any = "pixels") -> None:
        self.env = env
        self.policy = policy
        self.pixels_key = pixels_key

    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        from torchrl.envs.utils import ExplorationType, set_exploration_type

        mode = ExplorationType.DETERMINISTIC if deterministic else ExplorationType.RANDOM
        batched = len(self.env.batch_size) > 0
        with set_exploration_type(mode):
            # A batched env runs until every environment has ended an episode (stopping at the first done
            # would average the others' unfinished episodes in), and each one's first episode is measured.
            rollout = self.env.rollout(max_steps, self.policy, break_when_any_done=not batched,
                                       break_when_all_done=batched)
        reward = rollout.get(("next", "reward"))
        time_axis = len(rollout.batch_size) - 1
        frames = rollout.get(self.pixels_key, None) if render else None
        if frames is not None and frames.dim() == 5:  # a batched env: the first one's episode
            frames = frames[0]
        if not batched:
            return Episode(return_=reward.sum(dim=time_axis).float().mean(), length=int(rollout.batch_size[-1]),
                           frames=frames)
        done = rollout.get(("next", "done")).to(torch.int64)
        first = (done.cumsum(time_axis) - done) == 0  # the steps up to and including each env's first done
        returns = torch.where(first, reward, torch.zeros_like(reward)).sum(dim=time_axis)
        lengths = first.sum(dim=time_axis, dtype=torch.float32)
        return Episode(return_=returns.float().mean(), length=lengths.mean(), frames=frames)

    def close(self) -> None:
        if not self.env.is_closed:
            self.env.close()


def instrument_trainer(
    trainer,
    rl: Optional[RLLogging] = None,
    instrumentation: Any = None,
    eval_env=None,
    policy=None,
    name: str = "instrument",
    close_on_shutdown: bool = True,
) -> TorchRLHook:
    """Add the standard RL logging to a TorchRL trainer in one call; returns the registered hook.

    ``eval_env`` and ``policy`` make a `TorchRLRunner` for ``rl.evaluation`` (an `Evaluation` is created with
    its defaults when ``rl`` has none).
    """
    rl = rl if rl is not None else RLLogging()
    runner = None
    if eval_env is not None:
        if policy is None:
            raise ConfigurationError(
                "instrument_trainer got eval_env but no policy to evaluate; pass policy=actor."
            )
        if rl.evaluation is None:
            from instrument.rl.evaluation import Evaluation

            rl.evaluation = Evaluation()
        runner = TorchRLRunner(eval_env, policy)
    hook = TorchRLHook(
        rl, instrumentation=instrumentation, eval_runner=runner, close_on_shutdown=close_on_shutdown
    )
    hook.register(trainer, name=name)
    return hook


def _run_first(ops: Any) -> None:
    """Move the op registered last (ours) to the front of a trainer's batch_process ops, so it sees the batch
    before other ops (a replay buffer's) replace it. Left as it is where TorchRL keeps them otherwise."""
    if isinstance(ops, list) and len(ops) > 1:
        ops.insert(0, ops.pop())


def _plain(value: Any) -> Any:
    """TorchRL checkpoints may hand back TensorDicts / NonTensorData / 0-d tensors; make them plain again."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "data") and not hasattr(value, "shape"):
        return value.data
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        return value.item()  # a checkpoint value, read at load time (not a metric)
    return value
