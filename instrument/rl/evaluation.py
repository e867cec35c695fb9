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
``runner(deterministic: bool, max_steps: int, render: bool) -> Episode``. `GymnasiumRunner`
(`instrument.rl.runner`) runs a torch policy in a gymnasium environment (``render_mode="rgb_array"`` needs no
display); TorchRL users get `instrument.rl.torchrl.TorchRLRunner`.

Evaluation runs under ``torch.no_grad()`` and inside ``torch.random.fork_rng``, so the stochastic episodes do
not shift the random stream the training loop sees: turning evaluation on does not change training.

Each mode and each video is a part of its own: one that raises costs the others nothing. A rendered episode that
fails is run again without rendering, with the random state it started from (and `GymnasiumRunner` with the same
reset seed), so its mode logs the return and length a run with ``video=False`` logs; a video that cannot be logged
leaves every metric staged. The first failure is raised once every part has had its turn (a `ConfigurationError`
first: it needs fixing, and propagates; any other is reported and counted by the session, which carries on).
A video needs rgb frames: `GymnasiumRunner` refuses an environment object made without ``render_mode="rgb_array"``
when it becomes the runner of an `Evaluation` with ``video=True``, a `ConfigurationError` before training. A video
problem found during training (no frames, frames not ``[T, H, W, C]``, an environment made by a factory without
that render mode) is an `InvalidValueError` naming what was received and the fix: the session reports it and
counts it in ``inst.failures``, the video is dropped, the step's metrics are written, and training goes on. A
factory's environment is not made at attach to be checked: a factory may need what is not ready then.
"""

import logging
import numbers
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from instrument.checks import check_int
from instrument.core.real import is_one_real
from instrument.errors import ConfigurationError, InvalidValueError
from instrument.rl.component import RLComponent

# The episode runners, with the episode they return; imported here too, where they were defined before.
from instrument.rl.runner import Episode, EpisodeRunner, GymnasiumRunner, select_action  # noqa: F401
from instrument.rl.timing import stage_timer

__all__ = ["Episode", "EpisodeRunner", "Evaluation"]

MODES = ("deterministic", "stochastic")

log = logging.getLogger("instrument")


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
        self._runner: Optional[EpisodeRunner] = None
        self._runner_state: Optional[Dict[str, Any]] = None  # a loaded runner state no runner has taken yet
        self.runner = runner
        self.next_due = 0 if at_start else every_frames
        self.runs = 0
        self._due_at: Optional[int] = None  # the frame count of an evaluation that is due, until it runs
        self._said: set = set()  # parts whose failure was reported here (not the raised one: the session reports it)

    @property
    def runner(self) -> Optional[EpisodeRunner]:
        """The episode runner. Set with ``video`` on, a runner that can tell already whether it renders rgb frames
        (`GymnasiumRunner.check_render`) is checked now: a `ConfigurationError` before training, not at the first
        evaluation."""
        return self._runner

    @runner.setter
    def runner(self, runner: Optional[EpisodeRunner]) -> None:
        check = getattr(runner, "check_render", None)
        if self.video and callable(check):
            check(made_only=True)
        pending, stateful = getattr(self, "_runner_state", None), _stateful(runner)
        if pending is not None and stateful:  # a resumed run's state, loaded before this runner was set
            self._runner_state = None  # taken once: a state the runner refuses is said once, not at every set
            runner.load_evaluation_state(pending)  # type: ignore[union-attr]
        self._runner = runner

    def due(self, frames: int) -> bool:
        return frames >= self.next_due

    def runs_at(self, frames: int) -> Optional[int]:
        """The frame count an evaluation run at the end of an iteration at ``frames`` would have, as
        `end_iteration` then decides it: ``frames`` when the schedule says due, else the count one that waits
        for a logging iteration fell due at; None when none is due. Changes nothing (`instrument.rl.resume`)."""
        return frames if self.due(frames) else self._due_at

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
        with stage_timer(logger, "evaluation"):  # host-side episodes: wall time (`instrument.rl.timing`)
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
        failed: List[Tuple[str, Exception]] = []  # (part, error): each mode and each video is a part of its own
        with torch.random.fork_rng(devices=_devices()), torch.no_grad():
            for mode in self.modes:
                try:
                    episodes, render_error = self._episodes(runner, mode)
                except Exception as exc:
                    failed.append((f"the {mode} episodes", exc))
                    continue
                first = episodes[0]
                results[mode] = first
                metrics: Dict[str, Any] = {}
                for key, values in (("return", [e.return_ for e in episodes]),
                                    ("length", [e.length for e in episodes])):
                    try:  # each on its own: a return the runner got wrong costs the mode its return only
                        metrics[key] = _mean(values, f"{self.prefix}/{mode}/{key}")
                    except InvalidValueError as exc:
                        failed.append((f"the {mode} episodes' {key}", exc))
                if metrics:
                    logger.log_metrics(metrics, step=step, prefix=f"{self.prefix}/{mode}")
                if render_error is not None:
                    failed.append((f"the {mode} video", _late(render_error)))
                elif self.video and mode in self.video_modes:
                    try:
                        self._log_video(logger, step, mode, first.frames)
                    except Exception as exc:
                        failed.append((f"the {mode} video", exc))
        if failed:
            self._raise(failed)
        return results

    def _episodes(self, runner: EpisodeRunner, mode: str) -> Tuple[List[Episode], Optional[Exception]]:
        """The episodes of ``mode``, and the error of its rendered episode, which is then run again unrendered: a
        video that fails costs its mode no metrics."""
        episodes: List[Episode] = []
        render_error: Optional[Exception] = None
        for i in range(self.episodes):
            render = self.video and i == 0 and mode in self.video_modes
            state = _rng_state() if render else None  # the re-run draws what the rendered try drew
            try:
                episodes.append(runner(mode == "deterministic", self.max_steps, render))
            except Exception as exc:
                if not render:
                    raise
                render_error = exc
                _set_rng_state(state)
                episodes.append(runner(mode == "deterministic", self.max_steps, False))
        return episodes, render_error

    def _log_video(self, logger, step: int, mode: str, frames: Any) -> None:
        tag = f"{self.prefix}/{mode}/video"
        fix = (
            "A gymnasium environment renders them when made with render_mode='rgb_array' "
            "(gymnasium.make(env_id, render_mode='rgb_array'), or pass GymnasiumRunner the id); TorchRL's with "
            "from_pixels=True. Or turn the video off: Evaluation(video=False)."
        )
        if frames is None:
            raise InvalidValueError(
                f"Evaluation(video=True): the episode runner returned no frames for the rendered {mode} episode "
                f"({tag}); expected Episode.frames of rgb frames [T, H, W, C]. {fix}"
            )
        dtype = getattr(frames, "dtype", None)
        objects = getattr(dtype, "kind", None) == "O"  # what np.stack makes of render() results that are None
        if getattr(frames, "ndim", None) != 4 or objects:
            got = f"a {type(frames).__name__} of shape {tuple(getattr(frames, 'shape', ()))} and dtype {dtype}"
            if objects:
                got += " (not frames: e.g. render() returned None)"
            raise InvalidValueError(
                f"Evaluation(video=True): the rendered {mode} episode's frames ({tag}) are {got}; expected rgb "
                f"frames [T, H, W, C]. {fix}"
            )
        stride = self.video_stride
        logger.log_video(tag, frames[:, ::stride, ::stride], step=step, fps=self.fps)

    def _raise(self, failed: List[Tuple[str, Exception]]) -> None:
        """Raise the first failure (a `ConfigurationError` first); the others are reported here, once per part."""
        raised = next((f for f in failed if isinstance(f[1], ConfigurationError)), failed[0])
        for failure in failed:
            part, exc = failure
            if failure is not raised and part not in self._said:
                self._said.add(part)
                log.error("instrument: %s: %s of the evaluation failed (%s: %s); the other parts were logged",
                          self.prefix, part, type(exc).__name__, exc)
        raise raised[1]

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"next_due": int(self.next_due), "runs": int(self.runs)}
        if _stateful(self._runner):  # which seeds the next episodes take (`GymnasiumRunner`): a resumed run's too
            state["runner"] = self._runner.evaluation_state()  # type: ignore[union-attr]
        elif self._runner_state is not None:  # loaded before a runner was set: kept for it
            state["runner"] = self._runner_state
        return state

    def state_after_run(self, frames: int) -> Dict[str, Any]:
        """`state_dict` as it will be once the evaluation runs at ``frames`` (`runs_at`): a checkpoint saved
        inside an iteration that counts the iteration as done, whose end runs that evaluation
        (`instrument.rl.resume`). Saved as before the run, the resumed run evaluated again at its first iteration,
        a step the uninterrupted run never logged, with the seeds the saved run had already used. The runner's
        state goes on past the run's episodes where the runner can say so (``evaluation_state_after(episodes)``,
        as `GymnasiumRunner` does); another runner's is saved as it is."""
        state = self.state_dict()
        state["next_due"] = (int(frames) // self.every_frames + 1) * self.every_frames
        state["runs"] += 1
        after = getattr(self._runner, "evaluation_state_after", None)
        if "runner" in state and _stateful(self._runner) and callable(after):
            state["runner"] = after(len(self.modes) * self.episodes)
        return state

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
        runner_state = state.get("runner")
        if runner_state is not None and not isinstance(runner_state, dict):
            raise ConfigurationError(
                f"Evaluation.load_state_dict: 'runner' must be the dict the runner's evaluation_state() returned, got "
                f"{type(runner_state).__name__} {runner_state!r:.80}; load the state {source} returned."
            )
        stateful = _stateful(self._runner)
        if runner_state is not None and stateful:
            self._runner.load_evaluation_state(runner_state)  # type: ignore[union-attr]  # refuses before any change
        self.next_due = int(state["next_due"])
        self.runs = int(state.get("runs", 0))
        # A runner set later (once the policy exists) gets it then (`runner`).
        self._runner_state = runner_state if runner_state is not None and not stateful else None

    def __repr__(self) -> str:
        return (
            f"Evaluation(every_frames={self.every_frames}, max_steps={self.max_steps}, modes={self.modes}, "
            f"video={self.video})"
        )


def _stateful(runner: Any) -> bool:
    """Whether ``runner`` keeps a state across a resume: both ``evaluation_state()`` and
    ``load_evaluation_state(state)``, names of their own, so that a runner that is an ``nn.Module`` (with torch's
    ``state_dict``) does not put its weights in the RL state, nor get them loaded from it."""
    return all(callable(getattr(runner, name, None)) for name in ("evaluation_state", "load_evaluation_state"))


def _devices() -> List[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _rng_state() -> Tuple[Tensor, List[Tensor]]:
    return torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in _devices()]


def _set_rng_state(state: Tuple[Tensor, List[Tensor]]) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    for device, device_state in zip(_devices(), cuda, strict=True):
        torch.cuda.set_rng_state(device_state, device)


def _late(exc: Exception) -> Exception:
    """A video's `ConfigurationError` found during training, as a fault the session reports and counts: a video
    set-up problem found hours in drops the video, not the run."""
    if not isinstance(exc, ConfigurationError):
        return exc
    late = InvalidValueError(f"{exc} The video is dropped; the metrics are logged and training goes on.")
    late.__cause__ = exc
    return late


def _mean(values: Sequence[Any], key: str) -> Union[float, Tensor]:
    """The mean of the episodes' values of ``key``: each a real number or a one-element tensor or array."""
    for i, v in enumerate(values):
        if not is_one_real(v):
            shape = f" of shape {list(v.shape)}" if isinstance(v, (Tensor, np.ndarray)) else ""
            raise InvalidValueError(
                f"{key}: the episode runner returned {type(v).__name__}{shape} ({v!r:.60}) for episode {i}; expected "
                f"a real number or a one-element tensor (Episode(return_=..., length=...), one value per episode)."
            )
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, numbers.Real) for v in values):
        return float(sum(values)) / len(values)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in values]).mean()
