"""Collection metrics: rewards and finished episodes of the collected batches.

Keys (under ``collection/<group>/``; ``<stat>`` is ``mean``, ``min``, ``max`` with ``reduce_stats=True``,
else only ``mean``). Every statistic covers the whole logging interval, not only the last batch.

==============================  ===========================================================================
key                             meaning
==============================  ===========================================================================
``reward/<stat>``               per-step reward (scalarised with ``reward_weights`` when it is a vector,
                                times its one weight when it is not), over the steps the collector mask keeps
``reward/<objective>/<stat>``   each objective of a vector reward, unweighted
``episode/return/<stat>``       return of each episode that ended in the interval (scalarised)
``episode/return/<obj>/<stat>`` each objective's episode return (vector rewards only)
``episode/length/<stat>``       length in steps of each episode that ended in the interval
``episode/count``               number of episodes that ended in the interval
``<name>/<stat>``               any extra batch entry bound in ``keys`` (all its elements, masked)
==============================  ===========================================================================

An extra entry may not be named like the component's own statistics (``reward``, ``episode/return``,
``episode/length``, or ``reward/<objective>`` and ``episode/return/<objective>`` of a vector reward's objectives;
``reward/clipped`` is fine), and objective names are unique, non-empty strings: either would write two
statistics to one key, one replacing the other. Both are refused with a `ConfigurationError` when the component
is made.

Episode statistics are NaN when no episode ended in the interval (a mean of nothing does not exist; TensorBoard
and W&B draw a gap); ``episode/count`` says 0 then.

Episode returns come from ``episode_reward_key`` when the batch has it (TorchRL's ``RewardSum`` writes
``("next", "episode_reward")``); otherwise they are summed from the rewards, carrying unfinished episodes over
to the next batch, vectorised over time (each episode summed on its own in float64, so an inf or NaN reward
stays in its episode; no Python loop over steps).

Batches are kept (copied, time first) and reduced together at the logging step or a bound
(`instrument.rl.pending`), with the same results as reducing each as it comes, for fewer ops per batch.
"""

import logging
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from instrument.checks import check_int, is_int
from instrument.core.devices import to_device
from instrument.errors import ConfigurationError
from instrument.rl.batch import (
    KeywordBatch,
    NestedKey,
    batch_shape_of,
    entry,
    flag_entry,
    infer_batch_shape,
    lookup,
    resolve_time_dim,
    split_features,
    time_dim_guessed,
)
from instrument.rl.component import RLComponent
from instrument.rl.pending import PendingBatches
from instrument.rl.ranks import log_reduced
from instrument.rl.running_stats import STATS, RunningStats, episode_buckets, wide_dtype

__all__ = ["CollectionMetrics"]

log = logging.getLogger("instrument")

_OWN = ("reward", "episode/return", "episode/length")  # the statistics of every batch (see the key table)
_PER_OBJECTIVE = ("reward/", "episode/return/")  # where each objective of a vector reward goes
_NOW = "now"  # weights in a device tensor, which may change in place: batches reduced at once (`_keep`)


class CollectionMetrics(RLComponent):
    """Reward and episode statistics of collected batches, on plain tensors or TensorDicts.

    Args:
        group: the ``<group>`` in ``collection/<group>/`` (e.g. one per environment or agent group).
        reward_key, done_key, mask_key: where the per-step reward, the end-of-episode flag and the collector
            mask (steps that count; padded steps are False) live in a batch.
        episode_reward_key: the running episode return (TorchRL ``RewardSum``); used at ``done`` when present.
        step_count_key: the running episode length (TorchRL ``StepCounter``); used at ``done`` when present.
        reward_weights: weights that scalarise a vector reward ``[*batch, K]``, one per objective; required when
            K > 1. A single-objective reward takes one weight (``[w]``: the reward and returns are logged times w)
            or none. An episode reward of one objective beside a vector reward is a scalar return: taken as it is.
        objective_names: names of the K objectives in metric keys (default ``obj0``, ``obj1``, ...); unique.
        keys: extra batch entries to reduce, ``{metric name: batch key}``; a name may not be one of the
            component's own statistics (see the module doc: ``reward``, ``episode/return``, ``reward/<objective>``).
        reduce_stats: log mean, min and max (True) or only the mean (False).
        time_dim: the batch dimension that is time: ``"auto"`` (the TensorDict dimension named ``time``, else
            the last one, as TorchRL collectors lay batches out), an int, or None when each call holds one step
            of every environment. ``"auto"`` warns once when it has to guess (two or more batch dimensions, none
            named ``time``: plain tensors): bind 0 for CleanRL's ``[time, envs]`` buffers, -1 for ``[envs, time]``;
            and for plain tensors of one dimension (``[envs]`` of a per-step loop looks like ``[time]``): bind None.
    """

    exclusive_prefix = True  # two at one group log the same keys (`instrument.core.step_components.same_keys`)

    def __init__(
        self,
        group: str = "main",
        reward_key: NestedKey = ("next", "reward"),
        done_key: NestedKey = ("next", "done"),
        mask_key: Optional[NestedKey] = ("collector", "mask"),
        episode_reward_key: Optional[NestedKey] = ("next", "episode_reward"),
        step_count_key: Optional[NestedKey] = ("next", "step_count"),
        reward_weights: Optional[Sequence[float]] = None,
        objective_names: Optional[Sequence[str]] = None,
        keys: Optional[Mapping[str, NestedKey]] = None,
        reduce_stats: bool = True,
        time_dim: Union[int, str, None] = "auto",
    ) -> None:
        if not group or "/" in group:
            raise ConfigurationError(
                f"CollectionMetrics.group must be a non-empty name without '/', got {group!r}."
            )
        if reward_weights is not None and len(reward_weights) == 0:
            raise ConfigurationError(
                "CollectionMetrics.reward_weights is empty; bind one weight per objective."
            )
        if (
            objective_names is not None
            and reward_weights is not None
            and len(objective_names) != len(reward_weights)
        ):
            raise ConfigurationError(
                f"CollectionMetrics got {len(objective_names)} objective_names for {len(reward_weights)} "
                f"reward_weights; bind one name per objective."
            )
        _check_names(objective_names, keys, reward_weights)
        self.group = group
        self.prefix = f"collection/{group}"
        self.reward_key, self.done_key, self.mask_key = reward_key, done_key, mask_key
        self.episode_reward_key, self.step_count_key = episode_reward_key, step_count_key
        self.reward_weights = (reward_weights if reward_weights is None or isinstance(reward_weights, Tensor)
                               else list(reward_weights))
        self._weights: Dict[Any, Any] = {}  # (device, dtype) -> (weights, their tensor there) (`_scalarise`)
        self.objective_names = list(objective_names) if objective_names is not None else None
        self.keys = dict(keys or {})
        self.reduce_stats = reduce_stats
        if time_dim not in ("auto", None):
            check_int("CollectionMetrics.time_dim", time_dim, expected="an int, 'auto' or None",
                      why="the batch dimension that is time; 'auto': TorchRL's last, None: one step per call",
                      fix="bind e.g. CollectionMetrics.time_dim = 0")
        self.time_dim = time_dim
        self._reward = RunningStats()
        self._objectives = RunningStats()
        self._ep_return = RunningStats()
        self._ep_objectives = RunningStats()
        self._ep_length = RunningStats()
        self._extra: Dict[str, RunningStats] = {name: RunningStats(flatten=True) for name in self.keys}
        self._episodes: Optional[Tensor] = None
        self._carry_return: Optional[Tensor] = None
        self._carry_length: Optional[Tensor] = None
        # After a layout change, per environment: its episode in progress began before (start unknown), so the
        # first one it ends is counted but left out of the return and length statistics.
        self._unknown_start: Optional[Tensor] = None
        # Whether the batches since the last summed one that carried running returns and lengths had a valid step.
        self._read_steps: Optional[Tensor] = None  # a bool on the device (no sync); None: no such batch
        self._warned_reset = False
        self._said_layout = False  # time_dim="auto" guessed the time dimension of a batch (`time_dim_guessed`)
        self._rank: Optional[int] = None  # the rank of the last plain-tensor batch (`_plain_shape`)
        # Batches kept until reduced together; the helper reaches `_process` only through this component.
        self._pending = PendingBatches(lambda fields, key: self._process(fields, key))

    # ------------------------------------------------------------------ input
    def update(
        self,
        batch: Any = None,
        *,
        reward: Optional[Tensor] = None,
        done: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        episode_reward: Optional[Tensor] = None,
    ) -> None:
        """Add one batch: a TensorDict / mapping, or the tensors as keywords (keywords win over the batch).
        For a loop without `RLLogging`; the set itself calls `on_batch`."""
        self.on_batch(
            KeywordBatch(batch, reward=reward, done=done, mask=mask, episode_reward=episode_reward)
        )

    def on_batch(self, batch: Any = None, frames: Optional[int] = None) -> None:
        """Add one batch (a TensorDict, a mapping or a `KeywordBatch`). Frames counted without a batch
        (``batch=None, frames=n``: asynchronous collection) leave nothing to measure."""
        if batch is None and frames is not None:
            return
        reward = entry(batch, "reward", self.reward_key)
        done = flag_entry(batch, "done", self.done_key)
        mask = flag_entry(batch, "mask", self.mask_key)
        episode_reward = entry(batch, "episode_reward", self.episode_reward_key)
        if reward is None:
            raise ConfigurationError(
                f"CollectionMetrics found no reward at {self.reward_key!r} in the batch; pass reward=... or "
                f"bind CollectionMetrics.reward_key to where your batch keeps it."
            )
        shape = batch_shape_of(batch)
        if shape is None:
            shape = self._plain_shape(done, reward)
        rewards = split_features(reward.detach(), shape, f"reward at {self.reward_key!r}")
        valid = (
            None if mask is None else split_features(mask, shape, "the collector mask")[..., 0].to(torch.bool)
        )
        values = self._weight_values()
        scalar = self._scalarise(rewards, values=values)
        extras = []
        for name, key in self.keys.items():
            value = lookup(batch, key)
            if value is None:
                raise ConfigurationError(f"CollectionMetrics.keys[{name!r}] = {key!r} is not in the batch.")
            extras.append(split_features(value.detach(), shape, f"{key!r}"))
        ended = returns = lengths = None
        t: Optional[int] = -1  # -1: no episode is summed from these rewards, so the batch is kept flattened
        if done is not None:
            ended = split_features(done, shape, f"done at {self.done_key!r}").to(torch.bool).any(dim=-1)
            step_count = lookup(batch, self.step_count_key) if self.step_count_key else None
            if episode_reward is not None:  # running returns in the batch (TorchRL RewardSum): read them at done
                returns = split_features(
                    episode_reward.detach(), shape, f"episode reward at {self.episode_reward_key!r}"
                )
                self._scalar_returns(returns, True, rewards.shape[-1], values, check=True)  # refused now
            if step_count is not None:  # running lengths in the batch (TorchRL StepCounter)
                lengths = split_features(step_count, shape, f"step count at {self.step_count_key!r}")[..., 0]
            if returns is None or lengths is None:
                self._say_layout(batch, shape)
                t = resolve_time_dim(batch, self.time_dim, shape)
        objectives = None if scalar is rewards else rewards  # kept for the episodes' and objectives' sums
        self._keep((scalar, objectives, valid, ended, returns, lengths, *extras), t, len(shape), values)

    def _keep(self, fields: Sequence[Optional[Tensor]], t: Optional[int], n: int, values: Any) -> None:
        """Lay one batch out time first (``t``; None: one step per call; -1: flattened) and keep it until the
        batches are reduced together (`instrument.rl.pending`)."""
        if t == -1:
            laid = tuple(None if f is None else f.reshape((-1,) + tuple(f.shape[n:])) for f in fields)
        elif t is None:
            laid = tuple(None if f is None else f.unsqueeze(0) for f in fields)
        else:
            laid = tuple(None if f is None else f.movedim(t, 0) for f in fields)
        pending = self._pending
        key = (values, t == -1, tuple(None if f is None else (f.shape[1:], f.dtype, f.device) for f in laid))
        if len(pending) and key != pending.key:
            pending.drain()
        carry = self._carry_return
        rewards = laid[1] if laid[1] is not None else laid[0]
        if values is _NOW or (  # a layout change is warned at its batch
            t != -1 and carry is not None and (carry.shape != rewards.shape[1:] or carry.device != rewards.device)
        ):
            self._process(laid, key)
            return
        # Owned already: a weighted reward and the ``done`` flags (both made here); the rest is copied.
        pending.add(laid, key, (laid[1] is not None, False, False, True, False, False) + (False,) * len(self.keys))

    def _process(self, fields: Sequence[Optional[Tensor]], key: Any) -> None:
        """Reduce kept batches (concatenated; first dimension time, or flattened) into the running statistics."""
        scalar, rewards, valid, ended, returns, lengths, *extras = fields
        self._reward.add(scalar, valid)
        if rewards is not None and rewards.shape[-1] > 1:
            self._objectives.add(rewards, valid)
        for name, value in zip(self.keys, extras, strict=True):
            self._extra[name].add(value, valid)
        if ended is not None:
            self._add_episodes(scalar if rewards is None else rewards, ended, valid, returns, lengths, key[0])

    def _plain_shape(self, done: Optional[Tensor], reward: Tensor) -> Sequence[int]:
        """The batch shape of plain tensors. A ``done`` of ``[N, 1]`` is TorchRL's trailing singleton (batch
        ``[N]``) unless it is a time dimension of 1 (``[envs, time]`` with one step in this call): when
        ``time_dim`` names that dimension, or the run's earlier plain batches had that rank (``[E, 5]``, then
        ``[E, 1]``): read as ``[N]``, the env axis was taken for time and episodes summed across envs."""
        if done is None:
            return reward.shape
        shape = infer_batch_shape(done, reward)
        if len(shape) < done.dim():
            explicit = is_int(self.time_dim)
            if (explicit and not -len(shape) <= self.time_dim < len(shape)) or self._rank == done.dim():
                shape = done.shape
        self._rank = len(shape)
        return shape

    def _scalar_returns(self, returns: Tensor, given: bool, objectives: int, values: Any, check: bool = False):
        """The episode returns, scalarised like the reward. A running return the batch gives (``given``) of one
        objective beside a vector reward is already a scalar: taken as it is (as before weights were checked)."""
        if given and returns.shape[-1] == 1 and objectives > 1:
            return returns
        return self._scalarise(returns, ("episode reward", self.episode_reward_key) if given else None, values, check)

    def _weight_values(self) -> Any:
        """The reward weights of this batch: None, their values (read off the host), or `_NOW` (a device tensor,
        not read: the batch is reduced at once, with the weights as they are then)."""
        given = self.reward_weights
        if given is None:
            return None
        if isinstance(given, Tensor) and not given.is_cpu:
            return _NOW
        # The weights may be rebound or changed (annealed): compared by value (a CPU tensor's too: no device).
        return tuple(float(w) for w in (given.tolist() if isinstance(given, Tensor) else given))

    def _scalarise(self, rewards: Tensor, entry: Optional[Tuple[str, Any]] = None, values: Any = _NOW,
                   check: bool = False) -> Optional[Tensor]:
        """``rewards`` ``[*batch, K]`` weighted into ``[*batch, 1]`` with the weights ``values`` (`_weight_values`,
        those of the batch); ``entry``, ``(what, key)``, names them in messages (default: the reward). ``check``:
        only refuse what does not fit."""
        noun, key = entry or ("reward", self.reward_key)
        k = rewards.shape[-1]
        if self.reward_weights is None:
            if k == 1:
                return rewards
            raise ConfigurationError(
                f"the {noun} at {key!r} has {k} objectives (shape {tuple(rewards.shape)}); bind "
                f"CollectionMetrics.reward_weights = [w_1, ..., w_{k}] to scalarise it (each objective is "
                f"also logged on its own)."
            )
        if len(self.reward_weights) != k:  # for every k: a single-objective reward takes one weight, or none
            raise ConfigurationError(
                f"CollectionMetrics.reward_weights has {len(self.reward_weights)} weights but the {noun} has {k} "
                f"objective{'s' if k != 1 else ''} (the {noun} at {key!r} read as [*batch, K] with batch "
                f"{tuple(rewards.shape[:-1])}: the TensorDict's batch size, else inferred from done); bind exactly "
                f"one weight per objective"
                + (", or none (reward_weights=None) for a single-objective reward." if k == 1 else ".")
            )
        if check:
            return None
        wide = wide_dtype(rewards.device)  # as every sum of rewards (instrument.rl.running_stats)
        # Made once per device and dtype: a tensor made from a list on a GPU is a blocking copy, a host sync on
        # every observed batch.
        given = self.reward_weights
        if values is _NOW:  # a device tensor: moved (a no-op where it already is)
            weights = given.detach().to(device=rewards.device, dtype=wide)
        else:
            cached = self._weights.get((rewards.device, wide))
            if cached is None or cached[0] != values:
                cached = self._weights[(rewards.device, wide)] = (
                    values, to_device(torch.tensor(values, dtype=wide), rewards.device))
            weights = cached[1]
        return (rewards.to(wide) * weights).sum(dim=-1, keepdim=True)

    def _add_episodes(self, rewards, ended, valid, returns, lengths, values) -> None:
        ended_valid = ended if valid is None else ended & valid
        count = ended_valid.sum(dtype=torch.int64)
        self._episodes = count if self._episodes is None else self._episodes + count
        given = returns is not None
        whole_returns = whole_lengths = ended_valid
        summed = returns is None or lengths is None
        if rewards.shape[0]:  # a batch of no steps says nothing about the episodes under way
            if not summed:  # read at done, summing no reward: the carried sums stand still if it had a valid step
                stepped = valid.any() if valid is not None else torch.ones((), dtype=torch.bool, device=rewards.device)
                self._read_steps = stepped if self._read_steps is None else self._read_steps | stepped
            elif self._read_steps is not None:  # so the episodes under way began at a step not known here
                unknown = self._read_steps.to(rewards.device).expand(rewards.shape[1:-1]).contiguous()
                known, self._read_steps = self._unknown_start, None  # each environment's first end is left out
                self._unknown_start = unknown if known is None or known.shape != unknown.shape else known | unknown
        if summed:  # summed from the rewards (kept time first): one value per episode
            sums, counts, whole = self._episode_sums(rewards, ended, valid)
            if returns is None:
                returns, whole_returns = sums, whole
            if lengths is None:
                lengths, whole_lengths = counts, whole
        self._ep_return.add(self._scalar_returns(returns, given, rewards.shape[-1], values), whole_returns)
        if returns.shape[-1] > 1:
            self._ep_objectives.add(returns, whole_returns)
        self._ep_length.add(lengths.unsqueeze(-1), whole_lengths)

    def _say_layout(self, batch: Any, shape: Sequence[int]) -> None:
        """Warn once when ``time_dim="auto"`` guessed which dimension is time (`time_dim_guessed`)."""
        if not self._said_layout and time_dim_guessed(batch, self.time_dim, shape):
            self._said_layout = True
            if len(shape) == 1:
                log.warning(
                    "instrument: %s: time_dim='auto' got a batch of shape %s with one batch dimension and takes "
                    "it as time: one environment's steps. A per-step loop's batch, one step of every environment "
                    "([envs]), read this way has its episodes summed across environments. Bind "
                    "CollectionMetrics.time_dim = None when each call holds one step of every environment, 0 "
                    "when it holds one environment's steps (either silences this).", self.prefix, tuple(shape),
                )
            else:
                log.warning(
                    "instrument: %s: time_dim='auto' found no batch dimension named 'time' in a batch of shape %s, "
                    "so it takes the last one (%d) as time: TorchRL's [envs, time] layout. CleanRL's rollout "
                    "buffers are [time, envs], and read this way their episodes are summed across environments. "
                    "Bind CollectionMetrics.time_dim = 0 for [time, envs] (CleanRL), -1 to keep [envs, time] "
                    "(either silences this), or None when each call holds one step of every environment.",
                    self.prefix, tuple(shape), len(shape) - 1,
                )

    def _episode_sums(self, r: Tensor, d: Tensor, v: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """Every episode's return and length of time-first rewards ``r`` ``[T, *envs, K]`` (ends ``d``, mask
        ``v``), one per (environment, segment) bucket (`episode_buckets`), and which buckets are whole episodes."""
        if r.shape[0] == 0:  # no step: no episode, and no layout to go by (its environments may be any number)
            return r.new_zeros((0, r.shape[-1])), d.new_zeros(0, dtype=torch.int64), d.new_zeros(0, dtype=torch.bool)
        carry_r, carry_n = self._carry_return, self._carry_length
        if carry_r is not None and (carry_r.shape != r.shape[1:] or carry_r.device != r.device):
            if not self._warned_reset:
                log.warning(
                    "instrument: %s: the batch layout changed from %s to %s environments; the episodes in "
                    "progress began in earlier batches, so the first episode each environment ends is counted "
                    "but left out of the return and length statistics.",
                    self.prefix,
                    tuple(carry_r.shape[:-1]),
                    tuple(r.shape[1:-1]),
                )
                self._warned_reset = True
            carry_r = carry_n = None
            self._unknown_start = torch.ones(r.shape[1:-1], dtype=torch.bool, device=r.device)
        sums, counts, ends, _, self._carry_return, self._carry_length = episode_buckets(r, d, v, carry_r, carry_n)
        segment = torch.arange(sums.shape[1], device=r.device)
        whole = segment < ends.unsqueeze(-1)  # [E, T + 1]: the segments each environment ended
        if self._unknown_start is not None:  # the first end of each such environment: not a whole episode
            unknown = self._unknown_start.reshape(-1, 1)
            whole = whole & ~(unknown & (segment == 0))
            started = self._unknown_start.shape  # on the device: no sync to drop it
            self._unknown_start = self._unknown_start & (ends == 0).reshape(started)
        return sums.reshape(-1, sums.shape[-1]), counts.reshape(-1), whole.reshape(-1)

    # ------------------------------------------------------------------ output
    def log(self, logger, step: int) -> None:
        self._pending.drain()
        metrics: Dict[str, Tensor] = {}
        counts: Dict[str, Tensor] = {}  # how many values each key summarises: how ranks combine it
        ops: Dict[str, str] = {"episode/count": "sum"}  # min and max too, as they are emitted; the rest: mean
        stats = STATS if self.reduce_stats else ("mean",)

        def emit(name: str, acc: RunningStats, names: Optional[Sequence[str]] = None) -> None:
            if acc.empty:
                return
            summary = acc.summary()
            for stat in stats:
                value = summary[stat]
                if names is None:
                    pairs = [(f"{name}/{stat}", value.reshape(-1)[0] if value.dim() else value)]
                else:  # one value per objective
                    pairs = [(f"{name}/{obj}/{stat}", value[i]) for i, obj in enumerate(names)]
                for key, item in pairs:
                    metrics[key], counts[key] = item, acc.count
                    if stat in ("min", "max"):
                        ops[key] = stat
            acc.reset()

        emit("reward", self._reward)
        emit("reward", self._objectives, self._names(self._objectives))
        emit("episode/return", self._ep_return)
        emit("episode/return", self._ep_objectives, self._names(self._ep_objectives))
        emit("episode/length", self._ep_length)
        if self._episodes is not None:
            metrics["episode/count"] = self._episodes
            self._episodes = None
        for name, acc in self._extra.items():
            emit(name, acc)
        if metrics:
            log_reduced(logger, metrics, step, self.prefix, ops, counts)

    def _names(self, acc: RunningStats) -> Sequence[str]:
        if acc.empty:
            return []
        k = acc.total.shape[-1]
        return self.objective_names if self.objective_names is not None else [f"obj{i}" for i in range(k)]

    def reset_episodes(self) -> None:
        """Forget unfinished episodes (e.g. after the environments were reset outside the collector): the next
        episodes start with the next batch."""
        self._pending.drain()  # the episodes of the batches kept so far end or carry as before
        self._carry_return = self._carry_length = self._unknown_start = None
        self._read_steps = None

    def __repr__(self) -> str:
        return (
            f"CollectionMetrics(group={self.group!r}, reward_key={self.reward_key!r}, "
            f"done_key={self.done_key!r})"
        )


def _check_names(objective_names: Optional[Sequence[str]], keys: Optional[Mapping[str, NestedKey]],
                 reward_weights: Any) -> None:
    """Objective names and extra entries that would write two statistics to one key are refused (module doc)."""
    # statistics per objective only for a vector reward of two or more (reward_weights=[1.0] logs none)
    count = len(reward_weights) if reward_weights is not None and len(reward_weights) > 1 else 0
    objectives = ([] if not count else list(objective_names) if objective_names is not None
                  else [f"obj{i}" for i in range(count)])
    theirs = {f"{head}{objective}" for head in _PER_OBJECTIVE for objective in objectives}
    if objective_names is not None:
        names = list(objective_names)
        named = not isinstance(objective_names, str) and all(isinstance(n, str) and n for n in names)
        if not named or len(set(names)) != len(names):
            raise ConfigurationError(
                f"CollectionMetrics.objective_names must be unique, non-empty strings, one per objective, got "
                f"{objective_names!r}: each names the keys reward/<objective>/<stat> and episode/return/<objective>/"
                f"<stat>, so two equal names would write one objective's statistics over the other's."
            )
    for name, key in (keys or {}).items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"CollectionMetrics.keys maps metric names to batch keys; got the name {name!r} for {key!r}: use a "
                f"non-empty string, e.g. keys={{'action': {key!r}}}."
            )
        if name in _OWN or name in theirs:
            raise ConfigurationError(
                f"CollectionMetrics.keys names an extra entry {name!r} (for {key!r}), whose keys {name}/<stat> are "
                f"the component's own: reward/<stat> is the per-step reward, reward/<objective>/<stat> and "
                f"episode/return/<objective>/<stat> each objective's, episode/return/<stat> and episode/length/<stat> "
                f"the episodes'. The extra entry would replace that statistic. Name it otherwise, e.g. "
                f"keys={{'extra/{name}': {key!r}}}."
            )
