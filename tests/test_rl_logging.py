"""RLLogging in a plain loop: schedule, commits inside inst.step, failure isolation, progress bar beside the
console, evaluation with video read back from TensorBoard, W&B offline and disabled."""

import io
import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import instrument
from instrument import ConfigurationError, Logger
from instrument.rl import Evaluation, GymnasiumRunner, ProgressBar, RLComponent, RLLogging
from tests.conftest import event_accumulator, read_scalars
from tests.conftest import tqdm_bar_active as bar_active
from tests.wandb_reader import read_run

os.environ.setdefault("SDL_AUDIODRIVER", "dummy")  # pygame (CartPole rendering) without a sound card


def batch(t: int = 4, envs: int = 2):
    done = torch.zeros(t, envs, dtype=torch.bool)
    done[1, 0] = True
    return {"reward": torch.ones(t, envs), "done": done}


def loop(rl: RLLogging, n: int, **observe) -> None:
    for _ in range(n):
        with rl.iteration():
            with rl.timer("collection"):
                data = batch()
            rl.observe_batch(reward=data["reward"], done=data["done"], **observe)
            with rl.timer("optimization"):
                loss = torch.tensor(1.0)
            rl.observe_losses({"loss": loss})
    rl.logger.flush()  # backends are written on the logger's writer thread


def test_a_plain_loop_logs_every_family_of_keys_to_tensorboard(tmp_path):
    inst = instrument.Instrumentation(
        backends=[instrument.TensorBoardBackend()], log_interval=2, log_dir=str(tmp_path)
    )
    rl = RLLogging(progress=None).attach(inst)
    loop(rl, 5)
    rl.close()
    inst.close()
    scalars = read_scalars(inst.run.dir)
    assert sorted(scalars["counters/frames"]) == [0, 2, 4]  # follows inst.log_interval
    assert scalars["counters/frames"][4] == 40.0 and scalars["counters/iterations"][4] == 5.0
    assert scalars["train/main/loss"][2] == 1.0
    assert scalars["collection/main/reward/mean"][0] == 1.0
    for stage in ("collection", "optimization", "iteration"):
        assert scalars[f"timing/{stage}/count"][2] == 2.0  # iterations 1 and 2 since the commit at step 0
        assert scalars[f"timing/{stage}/mean"][2] >= 0.0


def test_inside_inst_step_the_step_is_committed_once_by_the_scope():
    history = instrument.RunHistoryBackend()
    inst = instrument.Instrumentation(backends=[history], log_interval=1)
    rl = RLLogging(progress=None).attach(inst)
    for i in range(3):
        with inst.step(i):
            rl.observe_batch(reward=torch.ones(2), done=torch.zeros(2, dtype=torch.bool))
            inst.logger.log_metrics({"user/value": float(i)}, step=i)
            assert rl.end_iteration() is None  # the open scope commits, not RLLogging
    inst.close()
    assert [s for s, _ in history.metrics["counters/frames"]] == [0, 1, 2]
    assert [s for s, _ in history.metrics["user/value"]] == [0, 1, 2]


def test_frame_steps_inside_iteration_scopes_are_refused_with_the_fix():
    inst = instrument.Instrumentation(backends=[], log_interval=1)
    rl = RLLogging(progress=None, step_unit="frames").attach(inst)
    with pytest.raises(ConfigurationError, match=r"at step 2 \(frames\) inside `with inst.step\(0\)`"):
        with inst.step(0):
            rl.observe_batch(reward=torch.ones(2), done=torch.zeros(2, dtype=torch.bool))
            rl.end_iteration()


def test_frame_steps_standalone():
    history = instrument.RunHistoryBackend()
    rl = RLLogging(progress=None, step_unit="frames").attach(Logger([history]))
    loop(rl, 3)
    assert [s for s, _ in history.metrics["counters/frames"]] == [8, 16, 24]


class Broken(RLComponent):
    def log(self, logger, step):
        raise RuntimeError("boom")


def test_a_failing_component_is_reported_once_and_the_rest_is_logged(caplog):
    history = instrument.RunHistoryBackend()
    rl = RLLogging(progress=None, components=[Broken()]).attach(Logger([history]))
    with caplog.at_level(logging.ERROR, logger="instrument"):
        loop(rl, 3)
    assert rl.failures == {"extra0": 3}
    assert sum("RL component 'extra0' failed" in r.message for r in caplog.records) == 1
    assert len(history.metrics["counters/frames"]) == 3


def test_progress_bar_and_console_lines_coexist():
    stream = io.StringIO()  # one terminal for both, as in real life
    console = instrument.ConsoleBackend(keys=["counters/frames"], stream=stream)
    progress = ProgressBar(
        total_frames=40, enabled=True, stream=stream, reward_keys=["collection/main/reward/mean"]
    )
    rl = RLLogging(progress=progress).attach(Logger([console]))
    loop(rl, 5)
    assert bar_active()
    assert progress.bar.n == 40 and progress.recent_reward == pytest.approx(1.0)
    rl.close()
    assert not bar_active()
    screen = stream.getvalue().replace("\r", "\n").splitlines()
    # Each console line stands on its own line: written with tqdm.write, which clears the bar first. A plain
    # write would glue it to the end of the bar's last drawing.
    rows = [row.split() for row in screen]
    for frames in (8, 16, 24, 32, 40):
        assert [str(frames // 8 - 1), str(frames)] in rows, screen  # a whole table row: step, frames
    assert any("100%" in row and "40.0/40.0" in row and "reward 1" in row for row in screen)


def test_progress_bar_is_off_without_a_terminal_unless_bound_on():
    progress = ProgressBar(stream=io.StringIO())
    RLLogging(progress=progress).attach(Logger([]))
    assert progress.bar is None


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def forward(self, obs):
        return self.net(obs)


class VideoKeeper(instrument.Backend):
    """Keeps the videos of each committed step (the GIF in TensorBoard merges frames, so count them here)."""

    def __init__(self) -> None:
        self.records = {}

    def write(self, record) -> None:
        if record.videos:
            self.records[record.step] = dict(record.videos)


def test_evaluation_runs_both_modes_on_the_frame_schedule_and_writes_a_readable_video(tmp_path):
    videos = VideoKeeper()
    inst = instrument.Instrumentation(
        backends=[instrument.TensorBoardBackend(), videos], log_interval=100, log_dir=str(tmp_path)
    )
    runner = GymnasiumRunner("CartPole-v1", Policy(), seed=3)
    evaluation = Evaluation(every_frames=16, max_steps=30, video=True, video_stride=5, fps=10)
    rl = RLLogging(progress=None, evaluation=evaluation).attach(inst, eval_runner=runner)
    torch.manual_seed(1)
    loop(rl, 4)  # 8 frames per iteration: evaluations after iterations 1 and 3 (16 and 32 frames)
    after = torch.rand(3)
    rl.close()
    inst.close()
    scalars = read_scalars(inst.run.dir)
    assert sorted(scalars["eval/deterministic/return"]) == [1, 3]
    assert sorted(scalars["eval/stochastic/length"]) == [1, 3]
    assert sorted(scalars["counters/frames"]) == [0, 1, 3]  # evaluation iterations commit, besides step 0
    assert 1 <= scalars["eval/deterministic/length"][1] <= 30
    assert scalars["eval/deterministic/return"][1] == scalars["eval/deterministic/length"][1]  # +1 per step
    assert scalars["timing/evaluation/count"][3] == 1.0

    images = event_accumulator(inst.run.dir).Images("eval/deterministic/video")
    assert [e.step for e in images] == [1, 3]
    gif = Image.open(io.BytesIO(images[0].encoded_image_string))
    assert gif.format == "GIF" and gif.size == (120, 80)  # 600x400 CartPole frames, every 5th pixel
    assert gif.n_frames > 1
    # what the backends received: every state of the episode, the last one included, every 5th pixel
    frames, fps = videos.records[1]["eval/deterministic/video"]
    assert frames.shape == (scalars["eval/deterministic/length"][1] + 1, 80, 120, 3) and fps == 10
    assert frames.dtype == np.uint8 and 0 < frames.mean() < 255
    # evaluation ran inside fork_rng: the loop's random stream is the one it would have been without it
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(3))


def test_evaluation_without_a_runner_says_how_to_set_one():
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=1)).attach(Logger([]))
    with pytest.raises(
        ConfigurationError, match=r"no episode runner; set evaluation.runner = GymnasiumRunner"
    ):
        loop(rl, 1)


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_is_flushed_per_iteration_and_finished_at_close(tmp_path, mode):
    wandb_backend = instrument.WandbBackend(mode=mode)
    inst = instrument.Instrumentation(backends=[wandb_backend], log_interval=1, log_dir=str(tmp_path))
    rl = RLLogging(progress=None).attach(inst)
    loop(rl, 3)
    rl.close_session()
    assert wandb_backend.run is None and inst.failures == {}
    if mode == "offline":
        rows, _ = read_run(inst.run.dir)
        frames = [r["counters/frames"] for r in rows if "counters/frames" in r]
        assert frames == [8.0, 16.0, 24.0]
    else:
        assert not list(tmp_path.rglob("*.wandb"))


def test_attach_and_misuse_errors():
    with pytest.raises(ConfigurationError, match="takes an Instrumentation or a Logger, got int"):
        RLLogging(progress=None).attach(3)
    rl = RLLogging(progress=None)
    with pytest.raises(ConfigurationError, match="not attached"):
        rl.end_iteration()
    with pytest.raises(ConfigurationError, match="step_unit must be one of"):
        RLLogging(step_unit="episodes")
    rl.attach(Logger([]))
    rl.close()
    with pytest.raises(ConfigurationError, match="closed"):
        rl.observe_losses({"loss": 1.0})


def test_gymnasium_runner_accepts_distributions_and_numpy_frames():
    runner = GymnasiumRunner(
        "CartPole-v1", lambda obs: torch.distributions.Categorical(logits=torch.zeros(1, 2))
    )
    episode = runner(False, 5, True)
    assert 1 <= episode.length <= 5 and isinstance(episode.frames, np.ndarray)
    assert episode.frames.shape[1:] == (400, 600, 3) and episode.frames.dtype == np.uint8
    runner.close()


def test_the_progress_bar_keeps_averaging_returns_over_intervals_where_no_episode_ended():
    """A review found the bar switching to the per-step reward whenever the return was NaN (no episode ended
    in that interval), clearing its window each time: it showed the latest return, not the window's mean."""
    import io
    import math

    from instrument.backends.base import RunInfo, StepRecord
    from instrument.backends.progress import ProgressBar

    bar = ProgressBar(enabled=True, window=10, stream=io.StringIO())
    bar.open(RunInfo(name="r"))
    returns = []
    for step in range(20):
        ret = float(step) if step % 2 == 0 else math.nan
        if not math.isnan(ret):
            returns.append(ret)
        bar.write(StepRecord(step=step, scalars={"counters/frames": 100.0 * (step + 1),
                                                 "collection/main/episode/return/mean": ret,
                                                 "collection/main/reward/mean": 0.01}))
    assert bar.recent_reward == sum(returns[-10:]) / 10
    bar.close()


@pytest.mark.parametrize("session", [True, False])
def test_frame_steps_wait_for_the_frame_count_to_move_past_the_last_commit(tmp_path, session):
    """With step_unit="frames" an iteration that kept no frame has the step of the last commit: it was committed
    a second time there (JSONL and TensorBoard kept two records at one step, W&B dropped the second)."""
    import json

    path = tmp_path / "m.jsonl"
    backend = instrument.JsonlBackend(str(path))
    if session:
        target = instrument.Instrumentation(backends=[backend], log_interval=1, log_dir=tmp_path)
    else:
        target = Logger([backend])
    rl = RLLogging(collection=instrument.rl.CollectionMetrics(time_dim=None), progress=None, step_unit="frames")
    rl.attach(target)
    envs = 2
    kept = [envs, 0, envs, 0, 0, 1, envs]  # frames kept per iteration: 0 at iterations 1, 3 and 4
    losses = np.random.default_rng(0).standard_normal(len(kept))
    for it, n in enumerate(kept):
        with rl.iteration():
            mask = torch.arange(envs) < n
            rl.observe_batch(reward=torch.full((envs,), float(it)), done=torch.ones(envs, dtype=torch.bool), mask=mask)
            rl.observe_losses({"loss": torch.tensor(losses[it], dtype=torch.float64)})
    rl.close()
    target.close()
    rows = [json.loads(line) for line in open(path)]
    rows = [(r["step"], r["metrics"]) for r in rows if "step" in r and "metrics" in r]
    # the float64 reference: an iteration with frames commits itself and every deferred one before it
    expected, group, frames, episodes = [], [], 0, 0
    for it, n in enumerate(kept):
        group.append(it)
        if n:
            frames, episodes = frames + n, episodes + n
            rewards = [float(i) for i in group for _ in range(kept[i])]
            expected.append((frames, float(np.mean(losses[group])), it + 1, episodes, sum(rewards) / len(rewards)))
            group = []
    steps = [s for s, _ in rows]
    assert steps == sorted(set(steps)) == [e[0] for e in expected]  # strictly increasing, each step once
    for (_, got), (frames, loss, iterations, episodes, reward) in zip(rows, expected, strict=True):
        assert got["train/main/loss"] == pytest.approx(loss, rel=1e-12)
        assert got["counters/frames"] == frames and got["counters/iterations"] == iterations
        assert got["counters/episodes"] == episodes
        assert got["collection/main/reward/mean"] == reward


@pytest.mark.parametrize("step_unit", ["iterations", "frames"])
def test_close_writes_what_the_iterations_after_the_last_logging_one_gathered(tmp_path, step_unit):
    """With log_interval=10 and 25 iterations, the episodes, frames and losses of iterations 21..24 were never
    written: close() committed only what the logger already held. Read back from JSONL against what was fed."""
    import json

    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=10,
                                      log_dir=str(tmp_path))
    rl = RLLogging(progress=None, step_unit=step_unit).attach(inst)
    envs, episodes, losses = 4, 0, []
    for it in range(25):
        with rl.iteration():
            done = torch.tensor([it % 3 == 0] * envs)
            rl.observe_batch(reward=torch.ones(envs), done=done)
            rl.observe_losses({"loss": torch.tensor(float(it))})
        episodes += int(done.sum())
        losses.append(float(it))
    rl.close()
    inst.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    metrics = {r["step"]: r["metrics"] for r in records if "metrics" in r}
    steps = sorted(metrics)
    last = 24 if step_unit == "iterations" else 25 * envs
    assert steps[-1] == last and len(steps) == len(set(r["step"] for r in records if "metrics" in r))
    assert sum(m.get("collection/main/episode/count", 0) for m in metrics.values()) == episodes
    assert metrics[last]["counters/frames"] == 25 * envs and metrics[last]["counters/episodes"] == episodes
    assert metrics[last]["train/main/loss"] == pytest.approx(np.mean(losses[21:]), rel=1e-12)


def test_after_a_layout_change_the_first_episode_of_each_environment_is_counted_but_not_measured(
    tmp_path, caplog
):
    """The warning said unfinished episodes are dropped, but their tails were logged as whole episodes (return 2,
    length 2 for episodes of return 7, length 7). Episodes that start after the change are measured again."""
    import json

    from instrument.rl import CollectionMetrics

    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=str(tmp_path))
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0), rl.iteration():  # 2 envs, 5 steps, no episode ends
            rl.observe_batch(reward=torch.ones(5, 2), done=torch.zeros(5, 2, dtype=torch.bool))
        with inst.step(1), rl.iteration():  # 3 envs: every one ends at its 2nd step (start unknown), then again
            done = torch.zeros(5, 3, dtype=torch.bool)
            done[1] = True
            done[4] = True
            rl.observe_batch(reward=torch.arange(15.0).reshape(5, 3), done=done)
    rl.close()
    inst.close()
    records = {r["step"]: r["metrics"] for r in map(json.loads, path.read_text().splitlines()) if "metrics" in r}
    got = records[1]
    assert got["collection/main/episode/count"] == 6.0  # every end is counted
    # measured: only the episodes that began in this layout, steps 2..4 of each env (a float64 reference)
    rewards = torch.arange(15.0, dtype=torch.float64).reshape(5, 3)
    whole = rewards[2:].sum(0)
    assert got["collection/main/episode/return/mean"] == pytest.approx(float(whole.mean()), rel=1e-12)
    assert got["collection/main/episode/return/min"] == float(whole.min())
    assert got["collection/main/episode/length/mean"] == 3.0
    assert any("left out of the return and length" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("empty", [(0, 2), (0, 1), (0, 3, 1)], ids=["two-envs", "one-env", "a-feature-dim"])
def test_a_batch_of_no_steps_counts_nothing_and_breaks_nothing(tmp_path, caplog, empty):
    """A zero-step batch of another environment count read as a layout change that left the carried episodes
    inconsistent: every later reduction raised and the collection metrics were lost for the rest of the run. One
    with a feature dimension ([0, 3, 1]) failed to reshape, in the collection and the counters (a review)."""
    import json

    from instrument.rl import CollectionMetrics

    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=str(tmp_path))
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    dones = [[[0, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]], None, [[0, 1, 0], [0, 0, 0], [1, 0, 1], [0, 0, 0]],
             [[0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1]]]
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step, done in enumerate(dones):
            with inst.step(step), rl.iteration():
                if done is None:
                    rl.observe_batch(reward=torch.ones(empty), done=torch.zeros(empty, dtype=torch.bool))
                else:
                    rl.observe_batch(reward=torch.ones(4, 3), done=torch.tensor(done, dtype=torch.bool))
    rl.close()
    inst.close()
    assert rl.failures == {} and inst.failures == {}
    assert not [r for r in caplog.records if "layout changed" in r.getMessage()]
    records = {r["step"]: r["metrics"] for r in map(json.loads, path.read_text().splitlines()) if "metrics" in r}
    # float64 reference: rewards of 1, so an episode's return is its length; the empty batch adds no step
    ends = [(0, 2), (1, 4 + 1), (0, 2 + 3), (2, 4 + 3), (0, 1 + 4), (1, 3 + 4), (2, 1 + 4)]  # (env, length)
    by_step = {0: ends[:1], 2: ends[1:4], 3: ends[4:]}
    for step, episodes in by_step.items():
        lengths = np.array([n for _, n in episodes], dtype=np.float64)
        assert records[step]["collection/main/episode/count"] == len(episodes)
        assert records[step]["collection/main/episode/return/mean"] == pytest.approx(lengths.mean(), rel=1e-12)
        assert records[step]["collection/main/episode/length/max"] == lengths.max()
    assert records[1]["collection/main/episode/count"] == 0.0 and records[1]["counters/frames"] == 12.0
    assert records[3]["counters/frames"] == 36.0 and records[3]["counters/episodes"] == 7.0


def test_two_threads_feeding_one_set_lose_nothing(tmp_path):
    """A collector thread and the training thread may feed one RLLogging; without a lock about 1 update in 200
    was lost (frames and episodes counted by both at once)."""
    import json
    import threading

    from instrument.rl import CollectionMetrics

    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=str(tmp_path))
    rl = RLLogging(collection=CollectionMetrics(time_dim=None), progress=None).attach(inst)
    calls = 2000

    def feed():
        for _ in range(calls):
            rl.observe_batch(reward=torch.ones(2), done=torch.tensor([True, False]))
            rl.observe_losses({"loss": torch.tensor(1.0)})

    with inst.step(0), rl.iteration():
        threads = [threading.Thread(target=feed) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    rl.close()
    inst.close()
    metrics = json.loads(path.read_text().splitlines()[0])["metrics"]
    assert metrics["counters/frames"] == 2 * 2 * calls and metrics["counters/episodes"] == 2 * calls
    assert metrics["collection/main/episode/count"] == 2 * calls and inst.failures == {}


def test_a_collector_thread_and_logging_steps_of_the_session_count_every_episode_once(tmp_path):
    """The session stages the components at the end of each `with inst.step(k)` block; that call did not take
    the set's lock, so a collector thread inside observe_batch raced it: `None + Tensor` failures and most
    episodes lost. Every episode observed is in exactly one record."""
    import json
    import threading

    from instrument.rl import CollectionMetrics

    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=str(tmp_path), overhead_budget=None)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    rewards, done = torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.bool)
    done[1] = True  # 4 episodes per batch
    batches = 1500

    def collector():
        for _ in range(batches):
            torch.randn(32, 32) @ torch.randn(32, 32)  # some work between batches, as a real collector does
            rl.observe_batch(reward=rewards, done=done)

    thread = threading.Thread(target=collector)
    thread.start()
    step = 0
    while thread.is_alive():
        with inst.step(step):
            rl.end_iteration()
        step += 1
    thread.join()
    with inst.step(step):  # what the collector handed over after the last of those steps
        rl.end_iteration()
    rl.close()
    inst.close()
    records = [json.loads(line)["metrics"] for line in path.read_text().splitlines()]
    assert sum(r.get("collection/main/episode/count", 0) for r in records) == 4 * batches
    assert records[-1]["counters/frames"] == 8 * batches and inst.failures == {}


def test_close_writes_no_tail_when_logging_is_off_or_nothing_ran_since_a_resume(tmp_path):
    """close() wrote every key at the last iteration's step under Instrumentation(log_interval=0) ("0 turns
    logging off"), and a set resumed on a bare Logger and closed at once wrote the last step a second time."""
    import json

    from instrument.rl import CollectionMetrics

    def rows(path):
        return [(r["step"], r["metrics"].get("counters/iterations"))
                for r in map(json.loads, path.read_text().splitlines()) if "metrics" in r]

    off = tmp_path / "off.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(off))], log_interval=0,
                                      log_dir=str(tmp_path))
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    for _ in range(5):
        with rl.iteration():
            rl.observe_batch(reward=torch.ones(2, 2), done=torch.ones(2, 2, dtype=torch.bool))
    rl.close()
    inst.close()
    assert not off.exists() or rows(off) == []

    path = tmp_path / "m.jsonl"
    logger = Logger([instrument.JsonlBackend(str(path))])
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, log_interval=5).attach(logger)
    for _ in range(10):
        with rl.iteration():
            rl.observe_batch(reward=torch.ones(2, 2), done=torch.ones(2, 2, dtype=torch.bool))
    state = rl.state_dict()
    rl.close()
    logger.close()
    assert rows(path) == [(0, 1.0), (5, 6.0), (9, 10.0)]  # the tail: iterations 6..9 at step 9
    logger = Logger([instrument.JsonlBackend(str(path))])  # resumed on the same file, then stopped at once
    resumed = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, log_interval=5).attach(logger)
    resumed.load_state_dict(state)
    resumed.close()
    logger.close()
    assert rows(path) == [(0, 1.0), (5, 6.0), (9, 10.0)]
