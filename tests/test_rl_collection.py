"""CollectionMetrics on hand-made batches with known answers: masks, episodes ending mid-batch and across
batches, vector rewards with weights, TorchRL and plain-tensor layouts."""

import logging
import math

import pytest
import torch

from instrument import ConfigurationError, Logger
from instrument.rl import CollectionMetrics

TensorDict = pytest.importorskip("tensordict").TensorDict  # the 'torchrl' extra

P = "collection/main/"

# Two environments, four steps, time last (TorchRL layout). Env 0 ends an episode at t=1 (return 1+2,
# length 2)
# and carries 3+4 into the next batch; env 1 ends at t=3 (return 100, length 4).
REWARD = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
DONE = torch.tensor([[False, True, False, False], [False, False, False, True]])


def logged(component, step: int = 0):
    logger = Logger([])
    component.log(logger, step)
    record = logger.commit(step)
    return {} if record is None else record.scalars


def torchrl_batch(reward=REWARD, done=DONE, **extra):
    td = TensorDict(
        {"next": {"reward": reward.unsqueeze(-1), "done": done.unsqueeze(-1)}, **extra},
        batch_size=reward.shape,
    )
    return td.refine_names(None, "time")


def test_rewards_and_episodes_of_one_torchrl_batch():
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch())
    got = logged(metrics)
    assert got[P + "reward/mean"] == pytest.approx(110 / 8)
    assert got[P + "reward/min"] == 1.0 and got[P + "reward/max"] == 40.0
    assert got[P + "episode/return/mean"] == pytest.approx(51.5)
    assert got[P + "episode/return/min"] == 3.0 and got[P + "episode/return/max"] == 100.0
    assert got[P + "episode/length/mean"] == 3.0
    assert got[P + "episode/length/min"] == 2.0 and got[P + "episode/length/max"] == 4.0
    assert got[P + "episode/count"] == 2.0


def test_an_episode_spanning_two_batches_is_carried_over():
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch())
    logged(metrics)
    second_reward = torch.tensor([[5.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 1.0]])
    second_done = torch.tensor([[True, False, False, False], [False, False, False, False]])
    metrics.update(torchrl_batch(second_reward, second_done))
    got = logged(metrics, step=1)
    assert got[P + "episode/return/mean"] == 12.0  # 3 + 4 carried, + 5
    assert got[P + "episode/length/mean"] == 3.0
    assert got[P + "episode/count"] == 1.0


def test_masked_steps_never_count():
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch(collector={"mask": mask}))
    got = logged(metrics)
    assert got[P + "reward/mean"] == pytest.approx((1 + 2 + 3 + 10 + 20) / 5)
    assert got[P + "reward/max"] == 20.0
    # env 1's done sits on a padded step: no episode ends there
    assert got[P + "episode/count"] == 1.0
    assert got[P + "episode/return/mean"] == 3.0


def test_statistics_cover_the_whole_logging_interval():
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch())
    metrics.update(torchrl_batch(REWARD * 2, torch.zeros_like(DONE)))
    got = logged(metrics)
    assert got[P + "reward/max"] == 80.0 and got[P + "reward/min"] == 1.0
    assert got[P + "reward/mean"] == pytest.approx(330 / 16)
    assert got[P + "episode/count"] == 2.0


def test_vector_rewards_are_scalarised_with_weights_and_each_objective_logged():
    reward = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])  # one env, three steps, two objectives
    done = torch.tensor([[[False], [False], [True]]])
    metrics = CollectionMetrics(reward_weights=[1.0, -0.5], objective_names=["speed", "energy"])
    metrics.update({"next": {"reward": reward, "done": done}})
    got = logged(metrics)
    assert [got[P + f"reward/{s}"] for s in ("mean", "min", "max")] == [1.0, 0.0, 2.0]
    assert [got[P + f"reward/speed/{s}"] for s in ("mean", "min", "max")] == [3.0, 1.0, 5.0]
    assert [got[P + f"reward/energy/{s}"] for s in ("mean", "min", "max")] == [4.0, 2.0, 6.0]
    assert got[P + "episode/return/mean"] == 3.0
    assert got[P + "episode/return/speed/mean"] == 9.0 and got[P + "episode/return/energy/mean"] == 12.0


def test_reward_weights_rebound_or_given_as_a_tensor_scalarise_with_the_weights_of_the_batch():
    """The weights tensor is made once per device and dtype (a tensor made from a list on a GPU is a blocking copy
    per batch); weights rebound between batches (annealed) are used at once, and the cache keeps one entry, also
    for weights given as a tensor (a review found a cache keyed on the weights themselves growing per batch)."""
    reward = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    done = torch.tensor([[[False], [False], [True]]])
    metrics = CollectionMetrics(reward_weights=[1.0, -0.5])
    for w in (0.0, 0.25, 0.5, 0.5, 1.0):
        metrics.reward_weights = [1.0, -w]
        metrics.update({"next": {"reward": reward, "done": done}})
        got = logged(metrics)
        assert got[P + "reward/max"] == pytest.approx(5.0 - 6.0 * w)
    assert len(metrics._weights) == 1
    metrics = CollectionMetrics(reward_weights=torch.tensor([1.0, -0.5]))
    for _ in range(3):
        metrics.update({"next": {"reward": reward, "done": done}})
    assert logged(metrics)[P + "reward/max"] == 2.0 and len(metrics._weights) == 1


def test_vector_rewards_without_weights_fail_with_the_fix():
    reward = torch.ones(1, 3, 2)
    done = torch.zeros(1, 3, 1, dtype=torch.bool)
    with pytest.raises(ConfigurationError, match=r"has 2 objectives.*reward_weights = \[w_1, \.\.\., w_2\]"):
        CollectionMetrics().update({"next": {"reward": reward, "done": done}})
    with pytest.raises(ConfigurationError, match="has 3 weights but the reward has 2 objectives"):
        CollectionMetrics(reward_weights=[1, 1, 1]).update({"next": {"reward": reward, "done": done}})


def test_running_returns_in_the_batch_are_read_at_done():
    # RewardSum / StepCounter style: the batch carries the running return and length; they win over a re-sum.
    td = torchrl_batch()
    td.set(
        ("next", "episode_reward"),
        torch.tensor([[7.0, 70.0, 0.0, 0.0], [1.0, 2.0, 3.0, 500.0]]).unsqueeze(-1),
    )
    td.set(("next", "step_count"), torch.tensor([[1, 9, 1, 2], [1, 2, 3, 40]]).unsqueeze(-1))
    metrics = CollectionMetrics()
    metrics.update(td)
    got = logged(metrics)
    assert got[P + "episode/return/min"] == 70.0 and got[P + "episode/return/max"] == 500.0
    assert got[P + "episode/length/min"] == 9.0 and got[P + "episode/length/max"] == 40.0


def test_plain_tensors_time_first_and_one_step_per_call_agree_with_the_batch():
    first = CollectionMetrics(time_dim=0)
    first.update(reward=REWARD.T, done=DONE.T)  # [T, envs]
    per_step = CollectionMetrics(time_dim=None)
    for t in range(REWARD.shape[1]):
        per_step.update(reward=REWARD[:, t], done=DONE[:, t])
    reference = CollectionMetrics()
    reference.update(torchrl_batch())
    expected = logged(reference)
    assert logged(first) == expected
    assert logged(per_step) == expected


def test_a_one_step_envs_by_time_batch_of_plain_tensors_keeps_its_env_axis():
    """[envs, time] plain tensors with one step in a call ([E, 1]) were read as TorchRL's trailing singleton,
    batch [E]: time was the env axis, so episodes were summed across envs (returns 20 and 200 for 3..300),
    and an explicit time_dim=1 was refused as out of range. Now time_dim=1 keeps the step axis, and so does a
    run whose earlier plain batches were [E, T]."""
    reference = CollectionMetrics()
    reference.update(torchrl_batch())
    expected = logged(reference)
    explicit = CollectionMetrics(time_dim=1)
    for t in range(REWARD.shape[1]):
        explicit.update(reward=REWARD[:, t:t + 1], done=DONE[:, t:t + 1])
    assert logged(explicit) == expected
    remembered = CollectionMetrics()  # time last ('auto'): [E, 3], then [E, 1]
    remembered.update(reward=REWARD[:, :3], done=DONE[:, :3])
    remembered.update(reward=REWARD[:, 3:], done=DONE[:, 3:])
    assert logged(remembered) == expected


def test_no_finished_episode_logs_nan_and_a_zero_count():
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch(done=torch.zeros_like(DONE)))
    got = logged(metrics)
    assert math.isnan(got[P + "episode/return/mean"]) and math.isnan(got[P + "episode/length/max"])
    assert got[P + "episode/count"] == 0.0
    assert got[P + "reward/mean"] == pytest.approx(110 / 8)


def test_extra_keys_and_mean_only():
    td = torchrl_batch(action=torch.tensor([[[0.0, 1.0]] * 4, [[2.0, 3.0]] * 4]))
    metrics = CollectionMetrics(group="cartpole", keys={"action": "action"}, reduce_stats=False)
    metrics.update(td)
    got = logged(metrics)
    assert got["collection/cartpole/action/mean"] == 1.5
    assert "collection/cartpole/reward/min" not in got and "collection/cartpole/reward/mean" in got


def test_missing_reward_and_bad_shapes_are_explained():
    with pytest.raises(ConfigurationError, match=r"found no reward at \('next', 'reward'\)"):
        CollectionMetrics().update({"next": {"done": DONE}})
    with pytest.raises(ConfigurationError, match=r"does not start with the batch shape \(2, 4\)"):
        CollectionMetrics().update(reward=torch.ones(3, 4), done=DONE)
    with pytest.raises(ConfigurationError, match="group must be a non-empty name"):
        CollectionMetrics(group="a/b")


def test_nothing_leaves_the_device_before_commit():
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch())
    kept = [f for f in metrics._pending._rows[0] if f is not None]  # kept until log (instrument.rl.pending)
    assert kept and all(isinstance(f, torch.Tensor) for f in kept)
    metrics._pending.drain()
    assert isinstance(metrics._reward.total, torch.Tensor) and isinstance(metrics._episodes, torch.Tensor)


def test_a_bad_time_dim_is_refused_when_built_or_at_the_first_batch_naming_the_binding():
    with pytest.raises(ConfigurationError, match=r"CollectionMetrics.time_dim must be an int.*got 'last'"):
        CollectionMetrics(time_dim="last")
    metrics = CollectionMetrics(time_dim=7)
    with pytest.raises(ConfigurationError, match=r"CollectionMetrics.time_dim=7 is out of range .* in \[-2, 1\]"):
        metrics.update(reward=torch.ones(3, 2), done=torch.zeros(3, 2, dtype=torch.bool))


def test_a_single_objective_reward_takes_its_one_weight_and_a_wrong_count_is_refused():
    """reward_weights were ignored for a single-objective reward: [0.5] logged the reward 2.0 unweighted, and three
    weights against one objective said nothing (two objectives with three weights were refused)."""
    reward = torch.full((4, 2), 2.0)  # [T, envs]: both environments end an episode of 4 steps at the last one
    done = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 1]], dtype=torch.bool)
    weighted = CollectionMetrics(time_dim=0, reward_weights=[0.5])
    weighted.update(reward=reward, done=done)
    got = logged(weighted)
    assert got[P + "reward/mean"] == 1.0 and got[P + "episode/return/mean"] == 4.0  # 4 steps of 2.0 * 0.5
    assert not [key for key in got if "obj0" in key]  # no per-objective keys for a single objective
    with pytest.raises(ConfigurationError, match=r"has 3 weights but the reward has 1 objective .*batch \(4, 2\).*"
                                                 r"or none \(reward_weights=None\)"):
        CollectionMetrics(time_dim=0, reward_weights=[0.5, 2.0, 1.0]).update(reward=reward, done=done)
    # from the batch's running returns (TorchRL RewardSum) too: one weight scales every statistic of the reward
    td = torchrl_batch(reward=torch.full((2, 4), 2.0), done=done.T)
    td.set(("next", "episode_reward"), torch.arange(1.0, 9.0).view(2, 4, 1) * 2.0)
    weighted = CollectionMetrics(reward_weights=[0.5])
    weighted.update(td)
    assert logged(weighted)[P + "episode/return/mean"] == pytest.approx((8.0 + 16.0) / 2 * 0.5)


def test_auto_time_dim_says_once_when_it_guesses_the_layout_of_plain_tensors(caplog):
    """CleanRL's [T, N] buffers under the default time_dim='auto' were read as [envs, time] without a word: episodes
    summed across environments (a return of 1.75 for 7.18). Where 'auto' guesses (two or more batch dimensions,
    none named 'time') it says so once, naming the shape, the dimension taken and the fix; where the layout is
    known (time_dim bound, a named TensorDict) it says nothing, and no result changes."""
    g = torch.Generator().manual_seed(0)
    reward, done = torch.rand(16, 3, generator=g), torch.rand(16, 3, generator=g) < 0.2
    said = []
    with caplog.at_level(logging.WARNING, logger="instrument"):
        guessed = CollectionMetrics()
        for _ in range(3):
            guessed.update(reward=reward, done=done)
        said.append([r.getMessage() for r in caplog.records])
        caplog.clear()
        known = [CollectionMetrics(time_dim=0), CollectionMetrics(time_dim=-1), CollectionMetrics(time_dim=None),
                 CollectionMetrics()]
        known[0].update(reward=reward, done=done)
        for _ in range(3):
            known[1].update(reward=reward, done=done)
        known[2].update(reward=reward[0], done=done[0])
        known[3].update(torchrl_batch())  # [envs, time] named by TorchRL
        said.append([r.getMessage() for r in caplog.records])
    assert len(said[0]) == 1, said[0]
    assert ("time_dim='auto'" in said[0][0] and "shape (16, 3)" in said[0][0] and "last one (1) as time" in said[0][0]
            and "CollectionMetrics.time_dim = 0 for [time, envs] (CleanRL)" in said[0][0])
    assert said[1] == []
    assert logged(guessed) == logged(known[1])  # what 'auto' reads is unchanged: the last dimension


def test_auto_time_dim_says_once_when_a_plain_batch_has_one_dimension(caplog):
    """The review's case: a per-step loop passing reward/done [N] (one step of N environments) under time_dim='auto'
    had them read as one environment's [time]: episodes summed across environments (a return mean of 12.88 for
    12.08), and nothing said, though [N] is as ambiguous as [T, N]. Now it says so once, naming the shape and the
    fix; with time_dim bound, or a TensorDict (TorchRL's one-dimension batch is [time]), it says nothing."""
    g = torch.Generator().manual_seed(0)
    reward, done = torch.rand(16, 4, generator=g), torch.rand(16, 4, generator=g) < 0.2
    said = []
    with caplog.at_level(logging.WARNING, logger="instrument"):
        per_step = CollectionMetrics()
        for t in range(16):
            per_step.update(reward=reward[t], done=done[t])
        said.append([r.getMessage() for r in caplog.records])
        caplog.clear()
        for time_dim in (None, 0, -1):
            CollectionMetrics(time_dim=time_dim).update(reward=reward[0], done=done[0])
        CollectionMetrics().update(TensorDict({"next": {"reward": reward[:, :1], "done": done[:, :1]}},
                                              batch_size=[16]))
        said.append([r.getMessage() for r in caplog.records])
    assert len(said[0]) == 1, said[0]
    assert ("time_dim='auto' got a batch of shape (4,)" in said[0][0]
            and "CollectionMetrics.time_dim = None when each call holds one step of every environment" in said[0][0])
    assert said[1] == []


def _vector_batch(episode_objectives):
    g = torch.Generator().manual_seed(0)
    reward = torch.rand(2, 6, 3, generator=g, dtype=torch.float64)
    done = torch.zeros(2, 6, 1, dtype=torch.bool)
    done[:, -1] = True
    running = reward.sum(-1, keepdim=True).cumsum(1) if episode_objectives == 1 else reward[..., :2].cumsum(1)
    return reward, {"next": {"reward": reward, "done": done, "episode_reward": running}}


def test_a_scalar_episode_reward_beside_a_weighted_vector_reward_is_taken_as_it_is():
    """The review's case: a vector reward [*, 3] with 3 weights and an episode reward [*, 1] (a scalar running
    return) worked before the weights were checked (weights on the reward, the episode reward as it is), then was
    refused at the first batch, saying the reward (which has 3) had 1 objective. It works as before again; an
    episode reward whose objectives do not match is refused naming the episode reward."""
    reward, batch = _vector_batch(1)
    metrics = CollectionMetrics(reward_weights=[1.0, 0.5, 0.2], time_dim=-1)
    metrics.update(batch)
    got = logged(metrics)
    weighted = (reward * torch.tensor([1.0, 0.5, 0.2], dtype=torch.float64)).sum(-1)
    assert got[P + "reward/mean"] == pytest.approx(weighted.mean().item())
    assert got[P + "episode/return/mean"] == pytest.approx(reward.sum((1, 2)).mean().item())
    _, batch = _vector_batch(2)
    with pytest.raises(ConfigurationError, match=r"reward_weights has 3 weights but the episode reward has 2 "
                                                 r"objectives \(the episode reward at \('next', 'episode_reward'\)"):
        CollectionMetrics(reward_weights=[1.0, 0.5, 0.2], time_dim=-1).update(batch)


def test_episodes_summed_after_batches_that_carried_their_own_running_returns_leave_out_the_unknown_starts():
    """Batches that carry both running returns and lengths (RewardSum + StepCounter) are read at done and sum no
    rewards, so the carried episode sums stood still meanwhile. A later batch without them (the transforms taken
    off, an evaluation collector) summed its first episodes from the stale carry (3 steps from before) or from its
    own start: lengths 5 and 7 where the episodes had run 4 and 11 steps. Those first episodes are now counted
    but left out of the return and length statistics, as after a layout change."""
    ones = torch.ones(2, 3)
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch(ones, torch.zeros(2, 3, dtype=torch.bool)))  # summed: 3 steps under way
    logged(metrics)
    done_a = torch.tensor([[False, True, False, False], [False, False, False, False]])
    given = torchrl_batch(torch.ones(2, 4), done_a)
    given.set(("next", "episode_reward"), torch.tensor([[4.0, 5.0, 1.0, 2.0], [4.0, 5.0, 6.0, 7.0]]).unsqueeze(-1))
    given.set(("next", "step_count"), torch.tensor([[4, 5, 1, 2], [4, 5, 6, 7]]).unsqueeze(-1))
    metrics.update(given)
    got = logged(metrics)
    assert got[P + "episode/count"] == 1 and got[P + "episode/length/max"] == 5.0
    done_b = torch.tensor([[False, True, False, True], [False, False, False, True]])
    metrics.update(torchrl_batch(torch.ones(2, 4), done_b))
    got = logged(metrics)
    assert got[P + "episode/count"] == 3  # every end is counted
    # the one whole episode: env 0's second, t = 2..3
    assert got[P + "episode/return/mean"] == 2.0 and got[P + "episode/length/max"] == 2.0
    metrics.update(torchrl_batch(torch.ones(2, 4), done_b))  # from here on the carry is known again
    got = logged(metrics)
    assert got[P + "episode/count"] == 3 and got[P + "episode/length/max"] == 4.0
    assert got[P + "episode/return/mean"] == pytest.approx((2 + 2 + 4) / 3, rel=1e-12)


def test_batches_with_running_returns_that_were_all_padding_leave_the_carried_episodes_exact():
    """A batch that carried running returns and lengths but whose collector mask was all False had no step: the
    carried sums are still exact, so the next summed batch measures its episodes whole (a review of the change
    above found them left out)."""
    metrics = CollectionMetrics()
    metrics.update(torchrl_batch(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)))  # 3 steps under way
    padding = torchrl_batch(torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.bool))
    padding.set(("next", "episode_reward"), torch.ones(2, 4, 1))
    padding.set(("next", "step_count"), torch.ones(2, 4, 1, dtype=torch.int64))
    padding.set(("collector", "mask"), torch.zeros(2, 4, dtype=torch.bool))
    metrics.update(padding)
    done = torch.tensor([[False, True, False, False], [False, False, False, True]])
    metrics.update(torchrl_batch(torch.ones(2, 4), done))
    got = logged(metrics)
    assert got[P + "episode/count"] == 2
    assert got[P + "episode/length/min"] == 5.0 and got[P + "episode/length/max"] == 7.0  # 3 + 2 and 3 + 4
    assert got[P + "episode/return/mean"] == 6.0
