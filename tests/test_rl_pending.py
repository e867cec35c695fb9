"""CollectionMetrics keeps batches and reduces them together (instrument.rl.pending): the logged values are those of
reducing every batch as it comes and of a float64 reference, and a non-logging batch dispatches few ops."""

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from instrument import Logger
from instrument.rl import CollectionMetrics

P = "collection/main/"


def logged(component, step: int = 0):
    logger = Logger([])
    component.log(logger, step)
    record = logger.commit(step)
    return {} if record is None else record.scalars


def one_at_a_time(**kwargs) -> CollectionMetrics:
    metrics = CollectionMetrics(**kwargs)
    metrics._pending.max_batches = 1  # every batch reduced as it comes: the behaviour before batches were kept
    return metrics


def batches(n=7, t=5, envs=3, k=1, seed=0):
    """Rewards in quarters (their float64 sums are exact in any order), random ends and a mask, [T, envs]."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        reward = torch.randint(-8, 9, (t, envs, k), generator=g).float() / 4
        done = torch.rand(t, envs, generator=g) < 0.3
        mask = torch.rand(t, envs, generator=g) < 0.9
        yield reward.squeeze(-1) if k == 1 else reward, done, mask


def reference(data, weights=None):
    """float64 per-step rewards and whole episodes (returns, lengths), one environment and step at a time."""
    steps, returns, lengths = [], [], []
    open_r, open_n = {}, {}
    for reward, done, mask in data:
        r = reward.double() if reward.dim() == 3 else reward.double().unsqueeze(-1)
        w = torch.tensor(weights or [1.0], dtype=torch.float64)
        for t in range(r.shape[0]):
            for e in range(r.shape[1]):
                if not mask[t, e]:
                    continue
                value = float((r[t, e] * w).sum())
                steps.append(value)
                open_r[e], open_n[e] = open_r.get(e, 0.0) + value, open_n.get(e, 0) + 1
                if done[t, e]:
                    returns.append(open_r.pop(e))
                    lengths.append(open_n.pop(e))
    return steps, returns, lengths


def test_kept_batches_log_what_one_at_a_time_and_a_float64_reference_log():
    data = list(batches())
    kept, each = CollectionMetrics(time_dim=0), one_at_a_time(time_dim=0)
    for reward, done, mask in data:
        kept.update(reward=reward, done=done, mask=mask)
        each.update(reward=reward, done=done, mask=mask)
    assert len(kept._pending) == len(data)  # nothing reduced before log
    got, before = logged(kept), logged(each)
    assert got == before
    steps, returns, lengths = reference(data)
    assert got[P + "reward/mean"] == sum(steps) / len(steps)
    assert (got[P + "reward/min"], got[P + "reward/max"]) == (min(steps), max(steps))
    assert got[P + "episode/return/mean"] == sum(returns) / len(returns)
    assert (got[P + "episode/return/min"], got[P + "episode/return/max"]) == (min(returns), max(returns))
    assert got[P + "episode/length/mean"] == sum(lengths) / len(lengths)
    assert got[P + "episode/count"] == len(returns)
    # episodes in progress carry over the logging step into the next interval
    more = list(batches(seed=1))
    for reward, done, mask in more:
        kept.update(reward=reward, done=done, mask=mask)
        each.update(reward=reward, done=done, mask=mask)
    assert logged(kept, 1) == logged(each, 1)


def test_a_buffer_refilled_in_place_after_it_was_observed_counts_what_it_held():
    data = list(batches())
    reward, done, mask = (torch.zeros_like(x) for x in data[0])
    metrics = CollectionMetrics(time_dim=0)
    for r, d, m in data:  # one collector buffer, refilled for every batch
        reward.copy_(r), done.copy_(d), mask.copy_(m)
        metrics.update(reward=reward, done=done, mask=mask)
    reward.fill_(1e9), done.fill_(True), mask.fill_(True)
    steps, returns, _ = reference(data)
    got = logged(metrics)
    assert (got[P + "reward/mean"], got[P + "reward/max"]) == (sum(steps) / len(steps), max(steps))
    assert got[P + "episode/return/mean"] == sum(returns) / len(returns)


def test_weights_changed_between_batches_weigh_each_batch_as_before():
    data = list(batches(k=2))
    kept = CollectionMetrics(time_dim=0, reward_weights=[1.0, 0.5])
    each = one_at_a_time(time_dim=0, reward_weights=[1.0, 0.5])
    for i, (reward, done, mask) in enumerate(data):
        kept.reward_weights = each.reward_weights = [1.0, 0.5 * (i % 3)]  # annealed
        kept.update(reward=reward, done=done, mask=mask)
        each.update(reward=reward, done=done, mask=mask)
    assert logged(kept) == logged(each)


def test_a_layout_change_is_warned_at_its_batch_and_bounds_and_layouts_drain(caplog):
    kept, each = CollectionMetrics(time_dim=0), one_at_a_time(time_dim=0)
    kept._pending.max_elements = 40  # drained every few batches
    for seed, envs in enumerate((3, 3, 3, 2, 2, 4)):
        for i, (reward, done, mask) in enumerate(batches(n=2, envs=envs, seed=seed)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="instrument"):
                kept.update(reward=reward, done=done, mask=mask)
            assert ("layout changed" in caplog.text) == (seed == 3 and i == 0)  # warned once, at its batch
            each.update(reward=reward, done=done, mask=mask)
    assert kept._warned_reset
    assert logged(kept) == logged(each)


def test_extra_keys_flattened_and_running_returns_from_the_batch_log_as_before():
    kept = CollectionMetrics(time_dim=0, keys={"value": "value"})
    each = one_at_a_time(time_dim=0, keys={"value": "value"})
    for reward, done, mask in batches():
        batch = {"next": {"reward": reward, "done": done, "episode_reward": reward.cumsum(0),
                          "step_count": torch.ones_like(reward, dtype=torch.int64)},
                 "collector": {"mask": mask}, "value": reward.unsqueeze(-1).expand(-1, -1, 2) * 3}
        kept.update(batch)
        each.update(batch)
    got = logged(kept)
    assert got == logged(each) and P + "value/mean" in got and P + "episode/return/mean" in got


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_kept_batch_dispatches_a_dozen_ops_whatever_its_size(with_mask):
    """Reduced as it came, a [128, 64] batch with its episodes dispatched 98 ops (torch 2.13, CPU); kept: a
    clone of what the caller owns, the done flags and the layout's views."""
    metrics = CollectionMetrics(time_dim=0)
    reward, done = torch.rand(128, 64), torch.rand(128, 64) < 0.05
    mask = torch.ones(128, 64, dtype=torch.bool) if with_mask else None
    metrics.update(reward=reward, done=done, mask=mask)  # the first batch: carries made
    with _Ops() as ops:
        metrics.update(reward=reward, done=done, mask=mask)
    assert ops.n <= 16, ops.n


def test_training_values_are_kept_as_copies_and_logged_as_a_float64_reference():
    from instrument.rl import TrainMetrics

    metrics = TrainMetrics(reduce_stats=True)
    running = torch.zeros(())  # a statistic the loop updates in place after each call
    values = []
    for i in range(300):  # past the 1024-tensor bound with three entries a call
        loss = torch.tensor(i / 4, dtype=torch.float16 if i % 2 else torch.float32)
        running.fill_(-i / 8)
        metrics.on_losses({"loss": loss, "stat": running, "n": torch.tensor(i)})
        values.append((i / 4, -i / 8, i))
    running.fill_(1e9)
    got = logged(metrics)
    for j, name in enumerate(("loss", "stat", "n")):
        column = [v[j] for v in values]
        assert got[f"train/main/{name}"] == sum(column) / len(column)
        assert (got[f"train/main/{name}/min"], got[f"train/main/{name}/max"]) == (min(column), max(column))


def test_a_loss_call_dispatches_a_few_ops_per_entry():
    from instrument.rl import TrainMetrics

    metrics = TrainMetrics()
    loss = torch.tensor(1.5)
    metrics.on_losses({"loss": loss})
    with _Ops() as ops:
        metrics.on_losses({"loss": loss})
    assert ops.n <= 4, ops.n  # detach, view, clone (12 when each call was reduced as it came)


class _Large(TorchDispatchMode):
    """The copies and concatenations of 2**20 elements or more a call makes."""

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if isinstance(out, torch.Tensor) and out.numel() >= 2**20 and ("clone" in name or "cat" in name):
            self.made.append(name)
        return out


def test_a_batch_too_large_to_keep_after_a_kept_one_is_neither_kept_nor_concatenated():
    # A review found that only a first batch was reduced as it came: after a small kept one, a [64, 2**15] batch
    # was copied and then concatenated twice (about three times its size at once; the code before kept none).
    from instrument.rl.training import TrainMetrics

    def batch(t):
        return {"next": {"reward": torch.ones(64, t), "done": torch.zeros(64, t, dtype=torch.bool)}}

    made = {}
    for first in (False, True):
        metrics = CollectionMetrics(time_dim=-1, mask_key=None, episode_reward_key=None, step_count_key=None)
        if first:
            metrics.on_batch(batch(4))
        with _Large() as large:
            metrics.on_batch(batch(2**15))
        made[first] = large.made
        assert logged(metrics)[P + "reward/mean"] == 1.0
    assert made[True] == made[False] and not any("cat" in name for name in made[True]), made
    losses = TrainMetrics()
    losses.on_losses({"a": torch.tensor(1.0)})
    with _Large() as large:
        losses.on_losses({"a": torch.zeros(2**21)})
    assert large.made == []
