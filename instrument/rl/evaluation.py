"""Evaluation: every N frames, run the policy deterministically and stochastically and log the episodes.

Keys (under ``eval/<mode>/``, ``<mode>`` in ``deterministic``, ``stochastic``):

============  ===================================================================================
key           meaning
============  ===================================================================================
``return``    mean return over the evaluation episodes
``length``    mean episode length in steps (at most ``max_steps``)
``video``     the first episode rendered as a video ([T, H, W, C] uint8), when ``video`` is on and
              the mode is in ``video_modes``; TensorBoard, W&B and MLflow show it (GIFs, Pillow)
============  ===================================================================================

Both modes run on the same schedule: when `Counters.frames` reaches the next multiple of ``every_frames``.
`Evaluation` is an RL component: at the end of an iteration (``end_iteration``) it checks the schedule and, when
an evaluation is due, asks for that iteration to be logged; it runs the episodes when the step is logged
(``log``), timed as ``timing/evaluation``, and closes its runner with the set.
An *episode runner* does the work, so any environment fits: a callable
``runner(deterministic: bool, max_steps: int, render: bool) -> Episode``. `GymnasiumRunner` runs a torch
policy in a gymnasium environment (``render_mode="rgb_array"`` needs no display); TorchRL users get
`instrument.rl.torchrl.TorchRLRunner`.

Evaluation runs under ``torch.no_grad()`` and inside ``torch.random.fork_rng``, so the stochastic episodes do
not shift the random stream the training loop sees: turning evaluation on does not change training.
"""

import dataclasses
import numbers
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from instrument.checks import check_int
from instrument.errors import ConfigurationError, require
from instrument.rl.component import RLComponent

__all__ = ["Episode", "EpisodeRunner", "Evaluation", "GymnasiumRunner", "select_action"]

MODES = ("deterministic", "stochastic")


@dataclasses.dataclass
class Episode:
    """One evaluation episode: its return, its length and, when rendered, its frames ``[T, H, W, C]``."""

    return_: Union[float, Tensor]
    length: Union[int, Tensor]
    frames: Optional[Union[np.ndarray, Tensor]] = None


EpisodeRunner = Callable[[bool, int, bool], Episode]


class Evaluation(RLComponent):
    """Runs evaluation episodes on a frame schedule and logs them under ``eval/<mode>/``.

    Args:
        every_frames: evaluate each time the frame count reaches a further multiple of this.
        max_steps: the longest an evaluation episode may run.
        episodes: episodes per mode; return and length are their means.
        modes: which of ``("deterministic", "stochastic")`` to run, on the same schedule.
        video: render the first episode of each mode in ``video_modes`` and log it as a video.
        video_modes: the modes that get a video.
        fps: frames per second of the logged video.
        video_stride: keep every n-th pixel in both directions (smaller files; 1 keeps the full frame).
        at_start: also evaluate after the first iteration.
        runner: the episode runner; may be set later (``evaluation.runner = ...``) once the policy exists.
    """

    prefix = "eval"

    def __init__(
        self,
        every_frames: int = 10_000,
        max_steps: int = 500,
        episodes: int = 1,
        modes: Sequence[Literal["deterministic", "stochastic"]] = MODES,
        video: bool = False,
        video_modes: Sequence[Literal["deterministic", "stochastic"]] = ("deterministic",),
        fps: int = 30,
        video_stride: int = 1,
        at_start: bool = False,
        runner: Optional[EpisodeRunner] = None,
    ) -> None:
        for name, value, example in (
            ("every_frames", every_frames, 10_000),
            ("max_steps", max_steps, 500),
            ("episodes", episodes, 1),
            ("fps", fps, 30),
            ("video_stride", video_stride, 1),
        ):
            check_int(f"Evaluation.{name}", value, least=1, fix=f"bind e.g. Evaluation.{name} = {example}")
        unknown = [m for m in list(modes) + list(video_modes) if m not in MODES]
        if unknown or not modes:
            raise ConfigurationError(
                f"Evaluation.modes must be a non-empty subset of {MODES}, got {list(modes)!r}."
            )
        self.every_frames, self.max_steps, self.episodes = every_frames, max_steps, episodes
        self.modes = tuple(modes)
        self.video, self.video_modes = video, tuple(video_modes)
        self.fps, self.video_stride = fps, video_stride
        self.at_start = at_start
        self.runner = runner
        self.next_due = 0 if at_start else every_frames
        self.runs = 0
        self._due_at: Optional[int] = None  # the frame count of an evaluation that is due, until it runs

    def due(self, frames: int) -> bool:
        return frames >= self.next_due

    # ------------------------------------------------------------------ RLComponent
    def end_iteration(self, counters) -> bool:
        """Check the schedule (one read of ``counters.frames``); True when an evaluation is due."""
        frames = counters.frames
        if self.due(frames):
            self._due_at = frames
        return self._due_at is not None

    def log(self, logger, step: int) -> None:
        """Run the evaluation that is due, if any, and stage its results at ``step``."""
        frames, self._due_at = self._due_at, None
        if frames is None:
            return
        with logger.timer("evaluation"):
            self.run(logger, step, frames)

    def close(self) -> None:
        """Close the runner (its environment) when it has a ``close``."""
        close = getattr(self.runner, "close", None)
        if callable(close):
            close()

    def run(
        self, logger, step: int, frames: int, runner: Optional[EpisodeRunner] = None
    ) -> Dict[str, Episode]:
        """Run every mode now, stage the results at ``step``, and schedule the next evaluation after ``frames``.

        `log` calls this when an evaluation is due; call it yourself to evaluate outside the schedule."""
        runner = runner or self.runner
        if runner is None:
            raise ConfigurationError(
                "Evaluation has no episode runner; set evaluation.runner = GymnasiumRunner(env, policy) (or "
                "TorchRLRunner) once the policy exists, or pass eval_runner=... to RLLogging.attach()."
            )
        self.next_due = (frames // self.every_frames + 1) * self.every_frames
        self.runs += 1
        results: Dict[str, Episode] = {}
        with torch.random.fork_rng(devices=_devices()), torch.no_grad():
            for mode in self.modes:
                episodes: List[Episode] = []
                for i in range(self.episodes):
                    render = self.video and i == 0 and mode in self.video_modes
                    episodes.append(runner(mode == "deterministic", self.max_steps, render))
                first = episodes[0]
                results[mode] = first
                logger.log_metrics(
                    {
                        "return": _mean([e.return_ for e in episodes]),
                        "length": _mean([e.length for e in episodes]),
                    },
                    step=step,
                    prefix=f"{self.prefix}/{mode}",
                )
                if self.video and mode in self.video_modes and first.frames is not None and len(first.frames):
                    frames_ = first.frames[:, :: self.video_stride, :: self.video_stride]
                    logger.log_video(f"{self.prefix}/{mode}/video", frames_, step=step, fps=self.fps)
        return results

    def state_dict(self) -> Dict[str, Any]:
        return {"next_due": int(self.next_due), "runs": int(self.runs)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        source = "Evaluation.state_dict() (RLLogging.state_dict()['evaluation'])"
        if not isinstance(state, dict) or "next_due" not in state:
            got = f"keys {sorted(state)}" if isinstance(state, dict) else f"{type(state).__name__} {state!r:.80}"
            raise ConfigurationError(
                f"Evaluation.load_state_dict: the state lacks 'next_due' (the frame count the next evaluation is "
                f"due at); got {got}. Load the state {source} returned."
            )
        for key, value in (("next_due", state["next_due"]), ("runs", state.get("runs", 0))):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ConfigurationError(
                    f"Evaluation.load_state_dict: {key} must be a non-negative int, got {value!r} "
                    f"({type(value).__name__}); {source} holds plain ints: load the state it returned."
                )
        self.next_due = int(state["next_due"])
        self.runs = int(state.get("runs", 0))

    def __repr__(self) -> str:
        return (
            f"Evaluation(every_frames={self.every_frames}, max_steps={self.max_steps}, modes={self.modes}, "
            f"video={self.video})"
        )


def _devices() -> List[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _mean(values: Sequence[Any]) -> Union[float, Tensor]:
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, numbers.Real) for v in values):
        return float(sum(values)) / len(values)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in values]).mean()


def select_action(output: Any, deterministic: bool) -> Tensor:
    """The action from a policy's output: a torch Distribution (its mode, or a sample), or logits (argmax, or a
    sample of the categorical distribution they define). A tuple's first element is used."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, torch.distributions.Distribution):
        return output.mode if deterministic else output.sample()
    if isinstance(output, Tensor):
        if deterministic:
            return output.argmax(dim=-1)
        return torch.distributions.Categorical(logits=output).sample()
    raise TypeError(
        f"the policy returned {type(output).__name__}; GymnasiumRunner expects a torch Distribution or a "
        f"tensor of logits (optionally as the first element of a tuple)."
    )


class GymnasiumRunner:
    """Runs a torch policy for one episode in a gymnasium environment, rendering rgb frames on request.

    Args:
        env: an environment id (made with ``render_mode="rgb_array"``), a ``gymnasium.Env`` made with that
            render mode, or a callable returning one.
        policy: ``policy(observation[1, ...]) -> Distribution | logits``; see `select_action`.
        seed: the first episode's reset seed; each later episode adds one, so evaluations are reproducible.
        device: where observations go before the policy sees them.
    """

    def __init__(
        self,
        env: Any,
        policy: Callable[[Tensor], Any],
        seed: Optional[int] = 0,
        device: Union[str, torch.device, None] = None,
    ) -> None:
        if isinstance(env, str):  # fail at start, naming the extra, not at the first evaluation
            require("gymnasium", "rl", "GymnasiumRunner")
        self._env_spec = env
        self._env = None
        self.policy = policy
        self.seed = seed
        self.device = torch.device(device) if device is not None else None
        self._episode = 0

    @property
    def env(self):
        if self._env is None:
            spec = self._env_spec
            if isinstance(spec, str):
                gym = require("gymnasium", "rl", "GymnasiumRunner")
                self._env = gym.make(spec, render_mode="rgb_array")
            elif callable(spec) and not hasattr(spec, "step"):
                self._env = spec()
            else:
                self._env = spec
        return self._env

    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        env = self.env
        seed = None if self.seed is None else self.seed + self._episode
        self._episode += 1
        obs, _ = env.reset(seed=seed)
        device = self.device or _device_of(self.policy)
        discrete = hasattr(env.action_space, "n")
        frames: List[np.ndarray] = []
        total, length = 0.0, 0
        for _ in range(max_steps):
            if render:
                frames.append(np.asarray(env.render()))
            x = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device).unsqueeze(0)
            action = select_action(self.policy(x), deterministic)[0]
            # host sync: gymnasium steps on the host, so each evaluation action is read back.
            host = action.cpu().numpy()
            obs, reward, terminated, truncated, _ = env.step(int(host) if discrete else host)
            total += float(reward)
            length += 1
            if terminated or truncated:
                break
        if render:
            frames.append(np.asarray(env.render()))
        return Episode(return_=total, length=length, frames=np.stack(frames) if frames else None)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def _device_of(module: Any) -> torch.device:
    try:
        return next(module.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")
