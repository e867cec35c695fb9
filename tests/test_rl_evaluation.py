"""Evaluation's parts: a video needs rgb frames (refused with the fix, as early as it can be told), and each mode and
each video is guarded on its own, so one that fails costs the others nothing. Real gymnasium environments; the
values are read back from what the logger committed and from JSONL."""

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import instrument
from instrument import ConfigurationError, InvalidValueError, Logger
from instrument.rl import CollectionMetrics, Episode, Evaluation, GymnasiumRunner, RLLogging

gym = pytest.importorskip("gymnasium")  # the `rl` extra (in `dev`); a GPU host running `pytest -m cuda` may lack it

os.environ.setdefault("SDL_AUDIODRIVER", "dummy")  # pygame (CartPole rendering) without a sound card

NO_RGB = r"render_mode=None, so its render\(\) returns None; expected render_mode='rgb_array'"
MAKE_IT = r"gymnasium\.make\('CartPole-v1', render_mode='rgb_array'\)"


def policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def test_an_env_made_without_rgb_rendering_is_refused_when_it_becomes_a_video_runner(tmp_path):
    """The review's case: every evaluation failed with an IndexError (None frames stacked into an object array)
    and the stochastic mode was never logged. The environment object says its render mode: refused before
    training, at attach or when the Evaluation is made with it, naming the fix."""
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), evaluation=Evaluation(every_frames=8, video=True),
                   progress=None)
    with pytest.raises(ConfigurationError, match=NO_RGB + ".*" + MAKE_IT):
        rl.attach(inst, eval_runner=GymnasiumRunner(gym.make("CartPole-v1"), policy()))
    inst.close()
    with pytest.raises(ConfigurationError, match=NO_RGB):
        Evaluation(video=True, runner=GymnasiumRunner(gym.make("CartPole-v1"), policy()))
    Evaluation(video=False, runner=GymnasiumRunner(gym.make("CartPole-v1"), policy()))  # no video: no frames needed
    Evaluation(video=True, runner=GymnasiumRunner(gym.make("CartPole-v1", render_mode="rgb_array"), policy()))


class NoFrames:
    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        return Episode(return_=3.0 if deterministic else 4.0, length=5)


class ObjectFrames:
    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        frames = np.stack([None, None]) if render else None  # what render() of an env without render_mode gave
        return Episode(return_=3.0 if deterministic else 4.0, length=5, frames=frames)


class GrayFrames:
    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        frames = np.zeros((5, 8, 8), np.uint8) if render else None  # grayscale [T, H, W]
        return Episode(return_=3.0 if deterministic else 4.0, length=5, frames=frames)


@pytest.mark.parametrize(
    "runner, match",
    [
        (lambda: GymnasiumRunner(lambda: gym.make("CartPole-v1"), policy(), seed=3), NO_RGB + ".*" + MAKE_IT),
        (NoFrames, r"the episode runner returned no frames for the rendered deterministic episode"),
        (ObjectFrames, r"frames \(eval/deterministic/video\) are a ndarray of shape \(2,\) and dtype object"),
        (GrayFrames, r"frames \(eval/deterministic/video\) are a ndarray of shape \(5, 8, 8\) and dtype uint8; "
                     r"expected rgb frames \[T, H, W, C\]"),
    ],
    ids=["factory-env-without-render-mode", "no-frames", "object-frames", "grayscale-frames"],
)
def test_frames_that_are_not_rgb_are_a_fault_and_both_modes_are_still_staged(runner, match):
    """A factory's environment is known only once made: checked at the first rendered episode, before it starts,
    and the episode is run again unrendered, so the deterministic mode keeps its metrics (with the seed it would
    have had) and the stochastic mode runs. A runner that returns no frames, or not [T, H, W, C], likewise. Found
    during training, it is an `InvalidValueError` (a fault the session reports and counts), not a
    `ConfigurationError` that would stop the run hours in."""
    evaluation = Evaluation(every_frames=8, max_steps=40, video=True, runner=runner())
    logger = Logger([])
    with pytest.raises(InvalidValueError, match=match) as raised:
        evaluation.run(logger, step=0, frames=8)
    assert not isinstance(raised.value, ConfigurationError)
    record = logger.commit(0)
    logger.close()
    got = record.scalars
    assert set(got) >= {f"eval/{mode}/{key}" for mode in ("deterministic", "stochastic")
                        for key in ("return", "length")}
    assert not record.videos
    if isinstance(evaluation.runner, GymnasiumRunner):  # the same episodes as an evaluation without video
        reference = Evaluation(every_frames=8, max_steps=40, runner=GymnasiumRunner(
            lambda: gym.make("CartPole-v1"), policy(), seed=3)).run(Logger([]), step=0, frames=8)
        assert got["eval/deterministic/length"] == reference["deterministic"].length
        assert got["eval/stochastic/return"] == reference["stochastic"].return_


class DeterministicFails:
    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        if deterministic:
            raise RuntimeError("the deterministic policy broke")
        return Episode(return_=4.0, length=6)


class RenderFails:
    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        if render:
            raise RuntimeError("the renderer broke")
        return Episode(return_=3.0 if deterministic else 4.0, length=6)


@pytest.mark.parametrize(
    "runner, video, modes",
    [(DeterministicFails, False, ("stochastic",)), (RenderFails, True, ("deterministic", "stochastic"))],
    ids=["a-mode-fails", "its-video-fails"],
)
def test_one_failing_part_of_an_evaluation_costs_the_others_nothing(tmp_path, runner, video, modes):
    """A failing first mode stopped the evaluation before the second ran; a failing render lost its mode's return
    and length too. Now each is a part of its own: the rest is logged at every evaluation, the failure is
    reported once and counted."""
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=tmp_path)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None,
                   evaluation=Evaluation(every_frames=8, video=video)).attach(inst, eval_runner=runner())
    for k in range(2):
        with inst.step(k), rl.iteration():
            rl.observe_batch(reward=torch.ones(4, 2), done=torch.zeros(4, 2, dtype=torch.bool))
    rl.close()
    inst.close()
    logged = {line["step"]: line["metrics"] for line in map(json.loads, path.read_text().splitlines())
              if "metrics" in line}
    assert inst.failures == {"evaluation": 2}
    for step in (0, 1):
        assert {key for key in logged[step] if key.startswith("eval/")} == {
            f"eval/{mode}/{key}" for mode in modes for key in ("return", "length")}
        assert logged[step]["eval/stochastic/return"] == 4.0


def jsonl_steps(path) -> dict:
    return {line["step"]: line["metrics"] for line in map(json.loads, path.read_text().splitlines())
            if "metrics" in line}


@pytest.mark.parametrize("runner", [NoFrames, GrayFrames, lambda: GymnasiumRunner(
    lambda: gym.make("CartPole-v1"), policy(), seed=3)], ids=["no-frames", "grayscale-frames", "factory-env"])
def test_a_video_problem_found_during_training_drops_the_video_not_the_run_or_the_step(tmp_path, runner):
    """The review's case: a ConfigurationError at the first evaluation (maybe hours in) stopped training, and the
    evaluation step's eval, counter and collection metrics never reached the files. Now the loop goes on, every
    metric of every step is written, and the failure is counted at each evaluation."""
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=tmp_path)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None,
                   evaluation=Evaluation(every_frames=16, max_steps=20, video=True)).attach(inst, eval_runner=runner())
    for k in range(4):
        with inst.step(k), rl.iteration():
            rl.observe_batch(reward=torch.ones(4, 2), done=torch.zeros(4, 2, dtype=torch.bool))
    rl.close()
    inst.close()
    logged = jsonl_steps(path)
    assert sorted(logged) == [0, 1, 2, 3]
    assert inst.failures == {"evaluation": 2}
    for step in (1, 3):  # evaluations at 16 and 32 frames
        assert {"eval/deterministic/return", "eval/stochastic/return", "counters/frames"} <= set(logged[step])
        assert logged[step]["counters/frames"] == 8 * (step + 1)
        assert not any(key.endswith("/video") for key in logged[step])


class Seeds(gym.Wrapper):
    """Records each reset's seed."""

    def __init__(self, env, seeds):
        super().__init__(env)
        self.seeds = seeds

    def reset(self, **kwargs):
        self.seeds.append(kwargs.get("seed"))
        return super().reset(**kwargs)


class FailingRender(Seeds):
    def render(self):
        raise RuntimeError("no display")


def test_a_rendered_episode_that_fails_is_run_again_as_a_run_without_video_would_run_it(tmp_path):
    """The review's case: the re-run took the next seed and the random state the failed try had moved on, so the
    logged returns differed from video=False (57.5 against 72.0) and every later evaluation shifted. Now the
    numbers and the reset seeds (each episode's, re-runs aside) are those of a run with video=False."""
    def run(video):
        seeds = []
        env = FailingRender(gym.make("CartPole-v1", render_mode="rgb_array"), seeds)
        path = tmp_path / f"video{video}.jsonl"
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                          log_dir=tmp_path / str(video))
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, evaluation=Evaluation(
            every_frames=16, episodes=2, video=video, max_steps=200)).attach(
            inst, eval_runner=GymnasiumRunner(env, policy(), seed=100))
        torch.manual_seed(1)
        for k in range(3):
            with inst.step(k), rl.iteration():
                rl.observe_batch(reward=torch.ones(4, 4), done=torch.zeros(4, 4, dtype=torch.bool))
        rl.close()
        inst.close()
        evals = {step: {key: value for key, value in metrics.items() if key.startswith("eval/")}
                 for step, metrics in jsonl_steps(path).items()}
        return evals, seeds, inst.failures

    plain, plain_seeds, plain_failures = run(False)
    rendered, rendered_seeds, failures = run(True)
    assert plain_failures == {} and failures == {"evaluation": 3}
    assert all(len(metrics) == 4 for metrics in plain.values())
    assert rendered == plain
    assert plain_seeds == list(range(100, 112))
    assert sorted(set(rendered_seeds)) == plain_seeds  # each failed try's seed is used again by its re-run


class FailingStep(gym.Wrapper):
    """Records each reset's seed; its fifth step raises once (a transient environment error)."""

    def __init__(self, env, seeds):
        super().__init__(env)
        self.seeds, self.steps = seeds, 0

    def reset(self, **kwargs):
        self.seeds.append(kwargs.get("seed"))
        return super().reset(**kwargs)

    def step(self, action):
        self.steps += 1
        if self.steps == 5:
            raise RuntimeError("a transient environment error")
        return super().step(action)


def test_an_unrendered_episode_that_raises_uses_up_its_seed():
    """A review of the re-run found an episode without video that raised leaving its seed to the next episode (the
    stochastic mode then ran the deterministic one's seed), which shifted every later evaluation's seeds and
    numbers. Only a rendered try, which is run again, keeps its seed."""
    seeds = []
    runner = GymnasiumRunner(FailingStep(gym.make("CartPole-v1"), seeds), policy(), seed=100)
    with pytest.raises(RuntimeError, match="transient"):
        runner(True, 50, False)
    for deterministic in (True, False, True):
        runner(deterministic, 50, False)
    assert seeds == [100, 101, 102, 103]


def test_a_default_session_made_by_an_attach_that_is_refused_is_closed_again(tmp_path, monkeypatch):
    """``attach()`` without a target makes its own Instrumentation; refused after that (here: a video runner
    that cannot render), it left that session open: its writer thread and its run folder's lock stayed until the
    process ended."""
    from instrument.logger.writer import running_writers

    monkeypatch.chdir(tmp_path)
    before = set(running_writers())
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), evaluation=Evaluation(every_frames=8, video=True),
                   progress=None, log_interval=1)
    with pytest.raises(ConfigurationError, match=NO_RGB):
        rl.attach(None, eval_runner=GymnasiumRunner(gym.make("CartPole-v1"), policy()))
    assert set(running_writers()) == before and not rl.attached


def test_a_resumed_run_evaluates_with_the_seeds_and_returns_of_the_uninterrupted_one(tmp_path):
    """GymnasiumRunner seeds episode k with seed + k, and that count was not in the state: a resumed run evaluated
    from seed 100 again, replaying the first evaluations' returns (34, 42, 60 where the uninterrupted run logged 66,
    81, 49). Evaluation.state_dict now holds the runner's count, also when the runner is set after the load."""

    def run(name, iterations, state=None, runner_after_load=False):
        seeds = []
        path = tmp_path / f"{name}.jsonl"
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                          log_dir=tmp_path / name)
        runner = GymnasiumRunner(Seeds(gym.make("CartPole-v1"), seeds), policy(), seed=100)
        evaluation = Evaluation(every_frames=16, max_steps=200)
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, evaluation=evaluation)
        rl.attach(inst, eval_runner=None if runner_after_load else runner)
        if state is not None:
            rl.load_state_dict(state)
        if runner_after_load:
            evaluation.runner = runner
        torch.manual_seed(1)
        for _ in range(iterations):
            with rl.iteration():
                rl.observe_batch(reward=torch.ones(4, 4), done=torch.zeros(4, 4, dtype=torch.bool))
        saved = rl.state_dict()
        rl.close()
        inst.close()
        returns = {step: metrics["eval/deterministic/return"] for step, metrics in jsonl_steps(path).items()
                   if "eval/deterministic/return" in metrics}
        return returns, seeds, saved

    whole, whole_seeds, _ = run("whole", 6)
    assert whole_seeds == list(range(100, 112)) and len(set(whole.values())) > 1
    first, first_seeds, state = run("first", 3)
    assert state["evaluation"]["runner"] == {"episode": 6}
    for later in (False, True):
        second, second_seeds, _ = run(f"second{later}", 3, state, runner_after_load=later)
        assert second_seeds == list(range(106, 112))
        assert {**first, **second} == whole


class VectorReturns:
    def __call__(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        return Episode(return_=torch.tensor([1.0, 2.0]), length=7)


def test_an_episode_return_that_is_not_one_value_is_named_and_costs_its_mode_the_return_only(tmp_path):
    """With episodes > 1 a runner's vector return failed as torch's "shape '[]' is invalid for input of size 2",
    naming neither the key nor what was expected, and the mode's length went with it."""
    logger = Logger([])
    evaluation = Evaluation(every_frames=8, episodes=2, modes=("deterministic",))
    with pytest.raises(InvalidValueError, match=r"eval/deterministic/return: the episode runner returned Tensor of "
                                                r"shape \[2\].*for episode 0; expected a real number or a one-element"):
        evaluation.run(logger, 0, 8, runner=VectorReturns())
    scalars = logger.commit(0).scalars
    assert scalars == {"eval/deterministic/length": 7.0}


class ModuleRunner(nn.Module):
    """A runner that holds its policy: an nn.Module, with torch's own state_dict."""

    def __init__(self, weight):
        super().__init__()
        self.policy = nn.Linear(1, 1)
        nn.init.constant_(self.policy.weight, weight)

    def forward(self, deterministic: bool, max_steps: int, render: bool) -> Episode:
        return Episode(return_=self.policy.weight.item(), length=1)


def test_the_runner_s_state_is_its_evaluation_state_only_and_a_refused_one_is_said_once(tmp_path):
    """The evaluation's state took any runner's state_dict: an nn.Module runner put its weights in the RL state
    (not JSON any more) and a load overwrote the policy of the run it was loaded into. A runner keeps a state
    through evaluation_state() and load_evaluation_state() only. A state loaded before the runner is set, and
    refused by it, is said once, at that set, not at every later one."""
    import json

    evaluation = Evaluation(runner=ModuleRunner(3.0))
    state = evaluation.state_dict()
    assert "runner" not in state and json.loads(json.dumps(state)) == state
    other = Evaluation(runner=ModuleRunner(7.0))
    other.load_state_dict({**state, "runner": {"episode": 5}})  # a runner without an evaluation state ignores it
    assert other.runner.policy.weight.item() == 7.0
    with pytest.raises(ConfigurationError, match="'runner' must be the dict"):
        Evaluation().load_state_dict({"next_due": 4, "runs": 0, "runner": [5]})
    later = Evaluation()
    later.load_state_dict({"next_due": 4, "runs": 1, "runner": {"episode": -3}})
    with pytest.raises(ConfigurationError, match="expected {'episode': <a non-negative int>}"):
        later.runner = GymnasiumRunner(gym.make("CartPole-v1"), policy(), seed=0)
    later.runner = runner = GymnasiumRunner(gym.make("CartPole-v1"), policy(), seed=0)  # said once, not again
    assert later.state_dict() == {"next_due": 4, "runs": 1, "runner": {"episode": 0}} and runner._episode == 0


def test_the_runner_is_still_found_where_it_was():
    from instrument.rl import evaluation, runner

    assert evaluation.GymnasiumRunner is runner.GymnasiumRunner and evaluation.select_action is runner.select_action
