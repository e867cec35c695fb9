"""Device-side reductions the RL metrics share: masked running statistics and episode segmentation.

Nothing here leaves the device. Statistics accumulate over a logging interval (count, sum, min, max) and are
handed to the logger as tensors, which moves them to the host in its one batched transfer at commit.

Sums (running totals, and each episode's return) are accumulated in float64 (float32 on MPS, which has no
float64), whatever the values' dtype: in float16 the sum of 65,536 rewards of 1.0 is inf, in bfloat16 a running
mean of 3,000 losses in [1, 3] read 0.34, and a float32 running total of many steps loses the last digits of each
small addition. min and max stay in the values' dtype, where they are exact.
Reductions use ``sum``/``amin``/``amax``: on CPU (torch 2.13) ``aminmax`` and ``std_mean`` over a [16, 4096]
tensor measured 9-13x slower than ``amin``/``amax`` and a two-pass mean/variance, for the same values.
"""

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["RunningStats", "episode_buckets", "episode_segments", "STATS", "wide_dtype"]

STATS = ("mean", "min", "max")


def _float(values: Tensor) -> Tensor:
    """Floating values as they are; integers and bools in float64 (float32 on MPS): exact up to 2**53. The 8-bit
    floats (float8_e4m3fn, float8_e5m2, ...) in float32, which holds each of their values: torch has no min or
    max of them on a CPU, so a float8 loss or reward failed its whole interval at log time."""
    if values.is_floating_point():
        return values if values.element_size() > 1 else values.float()
    return values.to(wide_dtype(values.device))


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype sums accumulate in (see the module docstring)."""
    return torch.float32 if device.type == "mps" else torch.float64


class RunningStats:
    """Count, sum, min and max of masked values, merged over calls, kept on the device.

    ``add(values, mask)`` takes values shaped ``[*batch, K]`` and an optional boolean mask shaped ``[*batch]``;
    it reduces over the batch dimensions, so the statistics have shape ``[K]`` (one per feature, e.g. per
    objective). With ``flatten=True`` everything (batch and features) is reduced to one value.

    ``summary()`` gives ``{"mean", "min", "max"}`` tensors; where nothing was counted they are NaN, because a
    mean of zero values does not exist (logged as NaN, drawn as a gap).
    """

    __slots__ = ("flatten", "count", "total", "low", "high")

    def __init__(self, flatten: bool = False) -> None:
        self.flatten = flatten
        self.reset()

    def reset(self) -> None:
        self.count: Optional[Tensor] = None
        self.total: Optional[Tensor] = None
        self.low: Optional[Tensor] = None
        self.high: Optional[Tensor] = None

    @property
    def empty(self) -> bool:
        return self.count is None

    def add(self, values: Tensor, mask: Optional[Tensor] = None) -> None:
        values = _float(values.detach())
        if values.dim() == 0:
            values = values.reshape(1)
        # flatten: every element at once (batch and features); else over the batch dimensions, per feature
        dims = tuple(range(values.dim() if self.flatten else values.dim() - 1))
        per_value = values.shape[-1] if self.flatten else 1  # elements a kept row counts
        if mask is None:
            count = torch.full((), _numel(values.shape[:-1]) * per_value, dtype=torch.int64, device=values.device)
            masked = low_in = high_in = values
        else:
            keep = mask.to(torch.bool).unsqueeze(-1)
            count = keep.sum(dtype=torch.int64)
            if per_value != 1:
                count = count * per_value
            inf = torch.full((), math.inf, dtype=values.dtype, device=values.device)
            masked = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
            low_in = torch.where(keep, values, inf)
            high_in = torch.where(keep, values, -inf)
        wide = wide_dtype(values.device)
        if values.numel() == 0:
            shape = () if self.flatten else values.shape[-1:]
            total = torch.zeros(shape, dtype=wide, device=values.device)
            low = torch.full(shape, math.inf, dtype=values.dtype, device=values.device)
            high = -low
        elif dims:
            total = masked.sum(dim=dims, dtype=wide)
            low, high = low_in.amin(dim=dims), high_in.amax(dim=dims)
        else:
            # Without batch dimensions the extremes are the values themselves: a copy, never the caller's tensor
            # (a reward buffer refilled in place would change what was already counted).
            total, low, high = masked.to(wide, copy=True), low_in.clone(), high_in.clone()
        if self.count is None:
            self.count, self.total, self.low, self.high = count, total, low, high
        else:
            self.count = self.count + count
            self.total = self.total + total
            self.low = torch.minimum(self.low, low)
            self.high = torch.maximum(self.high, high)

    def merge(self, other: "RunningStats") -> None:
        """Fold another accumulator in (as if its values had been added here)."""
        if other.count is None:
            return
        if self.count is None:
            self.count, self.total, self.low, self.high = other.count, other.total, other.low, other.high
            return
        self.count = self.count + other.count
        self.total = self.total + other.total
        self.low = torch.minimum(self.low, other.low)
        self.high = torch.maximum(self.high, other.high)

    def summary(self) -> Dict[str, Tensor]:
        if self.count is None:
            raise RuntimeError("RunningStats.summary() called before any add().")
        nan = torch.full((), math.nan, dtype=self.total.dtype, device=self.total.device)
        seen = self.count > 0
        return {
            "mean": self.total / self.count,  # 0/0 is NaN: nothing counted
            "min": torch.where(seen, self.low, nan),
            "max": torch.where(seen, self.high, nan),
        }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def episode_segments(
    reward: Tensor,
    done: Tensor,
    valid: Optional[Tensor],
    carry_return: Optional[Tensor],
    carry_length: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Episode returns and lengths at every step where an episode ends, with no Python loop over time.

    Args:
        reward: ``[T, *envs, K]`` rewards (time first).
        done: ``[T, *envs]`` bool: the transition at t ended an episode.
        valid: ``[T, *envs]`` bool or None: steps that count (a collector mask); invalid steps add nothing and
            their ``done`` is ignored.
        carry_return, carry_length: ``[*envs, K]`` / ``[*envs]`` partial episodes from earlier batches, or None.

    Returns:
        ``(returns [T, *envs, K], lengths [T, *envs], ended [T, *envs], carry_return, carry_length)``; returns
        and lengths are meaningful where ``ended`` is true (elsewhere they hold the return so far of the
        segment the step belongs to); the carries are the partial episodes after this batch.

    Each episode is summed on its own: a step's segment is the number of episode ends before it in its
    environment, and the (masked) rewards are added into one float64 bucket per (environment, segment)
    (float32 on MPS); the carry joins segment 0. A difference of one cumulative sum over the batch, as before,
    leaked an inf or NaN reward into every later episode of that environment (inf - inf) and lost the digits of
    a small episode after a large reward (3 x 0.001 after 1e16 read 0.0). Bucket counts come from shapes, so
    nothing reaches the host.
    """
    t_len = reward.shape[0]
    envs = reward.shape[1:-1]
    k = reward.shape[-1]
    if t_len == 0:
        wide = wide_dtype(reward.device)
        return (
            reward.to(wide),
            torch.zeros(done.shape, dtype=torch.int64, device=done.device),
            done.to(torch.bool),
            torch.zeros(reward.shape[1:], dtype=wide, device=reward.device) if carry_return is None else carry_return,
            torch.zeros(envs, dtype=torch.int64, device=reward.device) if carry_length is None else carry_length,
        )
    sums, counts, ends, bucket, carry_return, carry_length = episode_buckets(
        reward, done, valid, carry_return, carry_length
    )
    ended = done.to(torch.bool) if valid is None else done.to(torch.bool) & valid.to(torch.bool)
    returns = sums.reshape(-1, k)[bucket].reshape(reward.shape[:-1] + (k,))
    lengths = counts.reshape(-1)[bucket].reshape(done.shape)
    return returns, lengths, ended, carry_return, carry_length


def episode_buckets(
    reward: Tensor,
    done: Tensor,
    valid: Optional[Tensor],
    carry_return: Optional[Tensor],
    carry_length: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The per-episode sums behind `episode_segments` (same arguments; ``T`` at least 1), one bucket per
    (environment, segment): ``(sums [E, T + 1, K], counts [E, T + 1], ends [E], bucket [T, E], carry_return,
    carry_length)`` with ``E`` the environments flattened. Environment e's segments ``0 .. ends[e] - 1`` are the
    episodes it ended in the batch (segment 0 continues the carry); the others are its unfinished one and unused
    buckets. Statistics over whole episodes can be taken over the buckets directly (``T + 1`` per environment),
    without gathering them back to every step.
    """
    t_len = reward.shape[0]
    envs = reward.shape[1:-1]
    k = reward.shape[-1]
    wide = wide_dtype(reward.device)
    n_env = _numel(envs)
    per_env = t_len + 1  # segments an environment can have in this batch: one more than its ends
    flat_ended = done.to(torch.bool).reshape(t_len, n_env)
    flat_valid = None if valid is None else valid.to(torch.bool).reshape(t_len, n_env)
    if flat_valid is not None:
        flat_ended = flat_ended & flat_valid
    ended_int = flat_ended.to(torch.int64)
    ends_so_far = torch.cumsum(ended_int, dim=0)
    env_base = torch.arange(n_env, device=reward.device, dtype=torch.int64) * per_env
    bucket = (ends_so_far + env_base).sub_(ended_int)  # [T, E]: ends strictly before t: t's (env, segment)
    flat_bucket = bucket.reshape(-1)
    kept = reward.reshape(t_len * n_env, k).to(wide)
    if flat_valid is not None:
        kept = torch.where(flat_valid.reshape(-1, 1), kept, torch.zeros((), dtype=wide, device=reward.device))
    sums = torch.zeros(n_env * per_env, k, dtype=wide, device=reward.device)
    counts = torch.zeros(n_env * per_env, dtype=torch.int64, device=reward.device)
    if carry_return is not None:  # the carry continues segment 0
        sums.index_add_(0, env_base, carry_return.reshape(n_env, k).to(wide))
    if carry_length is not None:
        counts.index_add_(0, env_base, carry_length.reshape(n_env).to(torch.int64))
    sums.index_add_(0, flat_bucket, kept)
    if flat_valid is None:
        counts.index_add_(0, flat_bucket, torch.ones((), dtype=torch.int64, device=reward.device).expand(t_len * n_env))
    else:
        counts.index_add_(0, flat_bucket, flat_valid.reshape(-1).to(torch.int64))
    ends = ends_so_far[-1]
    open_bucket = ends + env_base  # the unfinished segment of each env
    return (
        sums.reshape(n_env, per_env, k),
        counts.reshape(n_env, per_env),
        ends,
        bucket,
        sums[open_bucket].reshape(reward.shape[1:]),
        counts[open_bucket].reshape(envs),
    )
