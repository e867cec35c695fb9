"""Episode runners: what one returns (`Episode`), `GymnasiumRunner`, which runs a torch policy in a gymnasium
environment, and `select_action`, how it reads the policy's output. Episode k of a runner resets with ``seed + k``,
and the count is in its state (`GymnasiumRunner.evaluation_state`), which `Evaluation.state_dict` holds."""

import dataclasses
import numbers
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch
from torch import Tensor

from instrument.errors import ConfigurationError, require

__all__ = ["Episode", "EpisodeRunner", "GymnasiumRunner", "select_action"]

_UNKNOWN = object()  # an environment without a ``render_mode`` attribute: what it renders is seen from the frames


@dataclasses.dataclass
class Episode:
    """One evaluation episode: its return, its length and, when rendered, its frames ``[T, H, W, C]``."""

    return_: Union[float, Tensor]
    length: Union[int, Tensor]
    frames: Optional[Union[np.ndarray, Tensor]] = None


EpisodeRunner = Callable[[bool, int, bool], Episode]


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
        env: an environment id (made with ``render_mode="rgb_array"``), a ``gymnasium.Env``, or a callable
            returning one. For videos (``Evaluation(video=True)``) the environment must be made with
            ``render_mode="rgb_array"``; another is refused (`check_render`).
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

    def check_render(self, made_only: bool = False) -> None:
        """Raise a `ConfigurationError` when the environment cannot render rgb frames (its ``render_mode`` is not
        ``"rgb_array"``: ``render()`` then returns None). An id is made with that mode; with ``made_only``, an
        environment a factory has not made yet is left for the first rendered episode to check."""
        env = self._env if self._env is not None else self._env_spec
        if isinstance(env, str):
            return
        if callable(env) and not hasattr(env, "step"):  # a factory
            if made_only:
                return
            env = self.env
        mode = getattr(env, "render_mode", _UNKNOWN)
        if mode is _UNKNOWN or mode == "rgb_array":
            return
        spec = getattr(env, "spec", None)
        env_id = getattr(spec, "id", None) or "<env id>"
        raise ConfigurationError(
            f"Evaluation(video=True) needs rgb frames, but GymnasiumRunner's environment {env!s:.80} has "
            f"render_mode={mode!r}, so its render() returns {'None' if mode is None else 'no rgb frame'}; expected "
            f"render_mode='rgb_array'. Make it with gymnasium.make({env_id!r}, render_mode='rgb_array') (or pass "
            f"the id: GymnasiumRunner({env_id!r}, policy) makes it so), or turn the video off: "
            f"Evaluation(video=False)."
        )

    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        env = self.env
        if render:  # before the episode uses up its seed: an evaluation runs it again unrendered
            self.check_render()
        seed = None if self.seed is None else self.seed + self._episode
        try:
            episode = self._run(env, seed, deterministic, max_steps, render)
        except Exception:
            if not render:  # it used its seed: the next episode takes the next one, as it would have
                self._episode += 1
            raise  # a rendered try is run again unrendered with its seed (`Evaluation._episodes`)
        self._episode += 1
        return episode

    def evaluation_state(self) -> Dict[str, Any]:
        """The episodes run so far, which sets the next one's seed: a resumed run evaluates with the seeds the
        uninterrupted run would have used, not the first ones again (`Evaluation.state_dict` holds it). Any episode
        runner may define this and `load_evaluation_state` to keep a state of plain values across a resume."""
        return {"episode": int(self._episode)}

    def evaluation_state_after(self, episodes: int) -> Dict[str, Any]:
        """`evaluation_state` once ``episodes`` more episodes have run (`Evaluation.state_after_run`)."""
        return {"episode": int(self._episode) + int(episodes)}

    def load_evaluation_state(self, state: Dict[str, Any]) -> None:
        episode = state.get("episode") if isinstance(state, dict) else None
        if isinstance(episode, bool) or not isinstance(episode, numbers.Integral) or episode < 0:
            raise ConfigurationError(
                f"GymnasiumRunner.load_evaluation_state: expected {{'episode': <a non-negative int>}} as "
                f"GymnasiumRunner.evaluation_state() returns it (Evaluation.state_dict()['runner']), got "
                f"{state!r:.80}."
            )
        self._episode = int(episode)

    def _run(self, env: Any, seed: Optional[int], deterministic: bool, max_steps: int, render: bool) -> "Episode":
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
