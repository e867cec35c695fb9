"""Property tests of the RL reductions against plain NumPy / Python references."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from instrument.rl.running_stats import RunningStats, episode_segments

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def masked_values(draw):
    n = draw(st.integers(0, 12))
    k = draw(st.integers(1, 3))
    values = draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=n * k, max_size=n * k))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return np.array(values, dtype=np.float32).reshape(n, k), np.array(mask, dtype=bool), cuts


@SETTINGS
@given(masked_values(), st.booleans())
def test_running_stats_over_chunks_equal_numpy_over_the_kept_values(case, flatten):
    values, mask, cuts = case
    acc = RunningStats(flatten=flatten)
    bounds = [0, *cuts, len(values)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        part = RunningStats(flatten=flatten)  # merged in, as an interval's batches are
        part.add(torch.from_numpy(values[lo:hi]), torch.from_numpy(mask[lo:hi]))
        acc.merge(part)
    if acc.empty:  # no chunk at all: nothing to summarise
        assert len(bounds) == 2 and len(values) == 0
        return
    got = {k: v.numpy() for k, v in acc.summary().items()}
    kept = values[mask]
    if flatten:
        kept = kept.reshape(-1, 1)
    for j in range(kept.shape[1] if kept.ndim == 2 else 1):
        column = kept[:, j] if kept.size else np.empty(0)
        if column.size == 0:
            assert all(math.isnan(float(got[s].reshape(-1)[j])) for s in ("mean", "min", "max"))
            continue
        # float32 sums: equal to the float64 mean up to rounding
        assert math.isclose(
            float(got["mean"].reshape(-1)[j]), column.astype(np.float64).mean(), rel_tol=1e-5, abs_tol=1e-3
        )
        assert float(got["min"].reshape(-1)[j]) == column.min()
        assert float(got["max"].reshape(-1)[j]) == column.max()


def naive_episodes(reward, done, valid):
    """(env, t) -> (return, length) by stepping through time, one env at a time."""
    out = {}
    t_len, envs = done.shape
    for e in range(envs):
        total, length = 0.0, 0
        for t in range(t_len):
            if not valid[t, e]:
                continue
            total += float(reward[t, e])
            length += 1
            if done[t, e]:
                out[(e, t)] = (total, length)
                total, length = 0.0, 0
    return out


@st.composite
def trajectories(draw):
    t_len = draw(st.integers(1, 14))
    envs = draw(st.integers(1, 3))
    reward = np.array(
        draw(st.lists(st.integers(-5, 5), min_size=t_len * envs, max_size=t_len * envs)), dtype=np.float32
    ).reshape(t_len, envs)
    done = np.array(draw(st.lists(st.booleans(), min_size=t_len * envs, max_size=t_len * envs))).reshape(
        t_len, envs
    )
    valid = np.array(draw(st.lists(st.booleans(), min_size=t_len * envs, max_size=t_len * envs))).reshape(
        t_len, envs
    )
    cuts = sorted(set(draw(st.lists(st.integers(1, t_len - 1), max_size=3)))) if t_len > 1 else []
    return reward, done, valid, cuts


@SETTINGS
@given(trajectories())
def test_episode_segments_over_any_batch_split_match_a_step_by_step_loop(case):
    reward, done, valid, cuts = case
    expected = naive_episodes(reward, done, valid)
    got = {}
    carry_r = carry_n = None
    bounds = [0, *cuts, reward.shape[0]]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        r = torch.from_numpy(reward[lo:hi]).unsqueeze(-1)
        returns, lengths, ended, carry_r, carry_n = episode_segments(
            r, torch.from_numpy(done[lo:hi]), torch.from_numpy(valid[lo:hi]), carry_r, carry_n
        )
        for t, e in zip(*np.nonzero(ended.numpy()), strict=True):
            got[(int(e), int(lo + t))] = (float(returns[t, e, 0]), int(lengths[t, e]))
    assert got == expected


def _logged(component):
    from instrument import Logger

    logger = Logger([])
    component.log(logger, 0)
    record = logger.commit(0)
    logger.close()
    return record.scalars


def test_half_precision_rewards_and_losses_are_summed_in_float64():
    """float16 / bfloat16 sums overflow or round away (65,536 rewards of 1.0 summed to inf in float16; a
    bfloat16 running mean of 3,000 losses in [1, 3] read 0.34): float64 references."""
    from instrument.rl import CollectionMetrics, TrainMetrics

    collection = CollectionMetrics()
    collection.update(reward=torch.ones(4096, 16, dtype=torch.float16), done=torch.zeros(4096, 16, dtype=torch.bool))
    assert _logged(collection)["collection/main/reward/mean"] == 1.0

    collection = CollectionMetrics()
    reward = torch.full((64,), 0.1, dtype=torch.bfloat16)
    for _ in range(200):
        collection.update(reward=reward, done=torch.zeros(64, dtype=torch.bool))
    assert _logged(collection)["collection/main/reward/mean"] == float(reward[0].double())

    losses = (torch.rand(3000, generator=torch.Generator().manual_seed(0)) * 2 + 1).to(torch.bfloat16)
    train = TrainMetrics()
    for loss in losses:
        train.update({"loss": loss})
    assert _logged(train)["train/main/loss"] == pytest.approx(losses.double().mean().item(), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_episode_after_a_large_reward_in_the_same_batch_keeps_its_return(dtype):
    """Returns are differences of cumulative sums over the batch: in float32 a goal bonus of 1e6 left the next
    episode's 0.1 as 0.0625 (float16: 4000 then 0.9 read 0.0)."""
    from instrument.rl import CollectionMetrics

    big, small = (1e6, 0.01) if dtype == torch.float32 else (100.0, 0.3)
    reward = torch.full((1, 20), small, dtype=dtype)
    reward[0, 4] = big  # ends the first episode
    done = torch.zeros(1, 20, dtype=torch.bool)
    done[0, 4] = done[0, 14] = True
    collection = CollectionMetrics()
    collection.update(reward=reward, done=done)
    scalars = _logged(collection)
    exact = reward.double().numpy()[0]
    assert scalars["collection/main/episode/return/min"] == pytest.approx(exact[5:15].sum(), rel=1e-12)
    assert scalars["collection/main/episode/return/max"] == pytest.approx(exact[:5].sum(), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weighted_vector_rewards_are_scalarised_in_float64(dtype):
    """(rewards * weights).sum(-1) ran in the reward's dtype: float16 objectives [4e4, 1.5] weighted [1, 1]
    read inf, bfloat16 lost digits."""
    from instrument.rl import CollectionMetrics

    reward = torch.tensor([[40000.0, 1.5], [3.0, 0.25]], dtype=dtype)
    weights = [1.0, 0.1]
    collection = CollectionMetrics(reward_weights=weights, time_dim=None)
    collection.update(reward=reward, done=torch.tensor([False, False]))
    exact = (reward.double().numpy() * np.array(weights)).sum(axis=1).mean()
    assert _logged(collection)["collection/main/reward/mean"] == pytest.approx(exact, rel=1e-12)


def test_integer_training_values_stay_exact_and_one_bad_entry_costs_only_itself():
    """An int64 count of 2**24 + 1 went through float32 (16777216); an entry that is not a number stopped
    every entry after it, at every update."""
    from instrument.rl import TrainMetrics

    train = TrainMetrics(reduce_stats=True)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"'schedule' has type str.*the other entries were added"):
            train.update({"loss": torch.tensor(0.5), "schedule": "cosine", "tokens": torch.tensor(2**24 + 1)})
    scalars = _logged(train)
    assert scalars["train/main/loss"] == 0.5
    assert scalars["train/main/tokens"] == scalars["train/main/tokens/max"] == float(2**24 + 1)


def test_an_entry_too_large_for_a_float_costs_only_itself_and_is_named():
    from instrument.rl import TrainMetrics

    train = TrainMetrics()
    with pytest.raises(TypeError, match=r"training entry 'huge': .*too large.*the other entries were added"):
        train.update({"a": 1.0, "huge": 10**400, "z": 2.0})
    assert set(_logged(train)) == {"train/main/a", "train/main/z"}


def _jsonl_session(tmp_path):
    import instrument
    from instrument.rl import CollectionMetrics, RLLogging

    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1, log_dir=tmp_path)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    return inst, rl, path


def _read_jsonl(path):
    import json

    out = {}
    for line in open(path):
        row = json.loads(line)
        if "step" in row and "metrics" in row:
            metrics = {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in row["metrics"].items()}
            out.setdefault(row["step"], {}).update(metrics)  # JSON has no NaN/inf: the backend writes strings
    return out


def _episode_sums(reward, done):
    """(env, end step) -> float64 sum of that episode's rewards, stepping through time (carry across calls
    is the caller's: one batch here)."""
    out, totals = {}, {}
    for t in range(reward.shape[0]):
        for e in range(reward.shape[1]):
            totals[e] = totals.get(e, 0.0) + float(reward[t, e])
            if done[t, e]:
                out[(e, t)] = totals.pop(e)
    return out, totals


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_nonfinite_reward_stays_in_its_own_episode(tmp_path, bad):
    """Returns were differences of one cumulative sum over the batch: inf - inf (or a NaN) made every later
    episode of that environment NaN, in the batch and through the carry in the next batches."""
    # env 0: A = [1, bad] ends at t=1, B = [1, 2, 3] ends at t=4, C = [0.5 | 1.5] spans two batches;
    # env 1: finite throughout, its own episodes [2, 2] and [2, 2, 2, 2].
    reward = np.array([[1.0, 2.0], [bad, 2.0], [1.0, 2.0], [2.0, 2.0], [3.0, 2.0], [0.5, 2.0]])
    done = np.array([[0, 0], [1, 1], [0, 0], [0, 0], [1, 0], [0, 1]], dtype=bool)
    expected, open_sums = _episode_sums(reward, done)
    returns, lengths, ended, carry_r, carry_n = episode_segments(
        torch.from_numpy(reward).unsqueeze(-1), torch.from_numpy(done), None, None, None
    )
    for (e, t), value in expected.items():
        got = float(returns[t, e, 0])
        assert got == value or (math.isnan(got) and math.isnan(value)), (e, t, got, value)
    assert float(carry_r[0, 0]) == open_sums[0] == 0.5 and int(carry_n[0]) == 1
    assert float(carry_r[1, 0]) == 0.0 and int(carry_n[1]) == 0  # env 1 ended at the last step

    inst, rl, path = _jsonl_session(tmp_path)
    with inst.step(0), rl.iteration():
        rl.observe_batch(reward=torch.from_numpy(reward), done=torch.from_numpy(done))
    with inst.step(1), rl.iteration():
        rl.observe_batch(reward=torch.tensor([[1.5, 7.0]], dtype=torch.float64), done=torch.tensor([[True, True]]))
    rl.close()
    inst.close()
    logged = _read_jsonl(path)
    finite = [v for v in expected.values() if math.isfinite(v)]
    if bad == math.inf:  # the inf episode is the max; every other episode is exact
        assert logged[0]["collection/main/episode/return/min"] == min(finite)
        assert logged[0]["collection/main/episode/return/max"] == math.inf
    else:
        assert math.isnan(logged[0]["collection/main/episode/return/min"])  # a NaN episode has no order
    # next batch: env 0's C = 0.5 + 1.5 (carried), env 1's new episode = 7.0
    assert logged[1]["collection/main/episode/return/min"] == 0.5 + 1.5
    assert logged[1]["collection/main/episode/return/max"] == 7.0
    assert logged[1]["collection/main/episode/return/mean"] == ((0.5 + 1.5) + 7.0) / 2


@pytest.mark.parametrize("bonus", [1e6, 1e12, 1e16])
def test_small_episodes_after_a_huge_bonus_keep_every_digit(tmp_path, bonus):
    """A difference of float64 cumulative sums after a 1e16 bonus read 3 x 0.001 as 0.0 (1e12: 0.0029296875)."""
    reward = np.array([[bonus], [0.001], [0.001], [0.001], [0.25], [0.002]])
    done = np.array([[1], [0], [0], [1], [0], [1]], dtype=bool)
    expected, _ = _episode_sums(reward, done)
    inst, rl, path = _jsonl_session(tmp_path)
    with inst.step(0), rl.iteration():
        rl.observe_batch(reward=torch.from_numpy(reward), done=torch.from_numpy(done))
    rl.close()
    inst.close()
    logged = _read_jsonl(path)[0]
    assert logged["collection/main/episode/return/min"] == expected[(0, 3)] == 0.001 + 0.001 + 0.001
    assert logged["collection/main/episode/return/max"] == expected[(0, 0)] == bonus
    assert logged["collection/main/episode/length/mean"] == 2.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_reward_buffer_refilled_in_place_keeps_what_was_already_counted(dtype):
    """One environment's 0-d reward, refilled in place between calls: with no batch dimension the first call kept
    the caller's own tensor as its sum (float64), minimum and maximum, so the refills changed them (a review)."""
    acc = RunningStats()
    reward = torch.zeros((), dtype=dtype)
    for value in (1.0, 2.0):
        reward.fill_(value)
        acc.add(reward)
    reward.fill_(5.0)  # the next step's reward lands before the summary
    summary = {k: float(v) for k, v in acc.summary().items()}
    assert (summary["mean"], summary["min"], summary["max"]) == (1.5, 1.0, 2.0), summary
