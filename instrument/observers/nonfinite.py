"""NonFinite: where the first NaN/Inf of a rollout came from, found without a host sync per iteration.

Why this shape: testing ``torch.isfinite(x).all()`` each iteration and branching on it costs one host sync per
iteration, which stalls the device pipeline. Instead each iteration's tensors are kept by reference (see
`instrument.observers.buffer`) and, at log time, reduced in one batched pass to per-iteration, per-channel
counts of non-finite elements; the first iteration, the first channel and the totals are found with device
ops and handed to the logger like any metric. The human-readable message needs those values on the host, so it
is written from the committed record (`committed`), after the logger's own transfer: in warn mode from a record
the writer thread has already built (checked without waiting, at the next commit or when the session closes),
so the training thread never waits; with ``raise_on_nonfinite=True`` the commit waits for its record (the one
deliberate host sync, after the transfer has started) and raises `NonFiniteError`.
"""

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from instrument.checks import check_int
from instrument.core.context import StepContext
from instrument.core.devices import to_device
from instrument.core.dtensors import by_kind, global_value
from instrument.core.observer import Observer, over_ranks
from instrument.errors import ConfigurationError, NonFiniteError
from instrument.observers.buffer import IterationBuffer, ModifiedInPlaceError
from instrument.observers.grad_counts import grad_counts
from instrument.observers.gradient_stats import Patterns, select_parameters
from instrument.observers.layout import check_channel_dim, said_channel_dim
from instrument.observers.options import check_limit

__all__ = ["NonFinite", "nonfinite_counts"]

log = logging.getLogger("instrument")


def nonfinite_counts(states: Tensor, channel_dim: int = 1, scratch: bool = False) -> Tensor:
    """Non-finite elements per iteration and channel of ``states`` [T, *state]: an int64 [T, C] tensor.

    ``channel_dim`` indexes the state's own dimensions; a state with fewer dimensions than that has one channel.
    ``scratch=True`` lets it overwrite ``states`` (a stacked copy the caller owns).

    How: ``x - x`` is 0 for a finite value and NaN for NaN and +-Inf; ``nan_to_num(nan=1)`` turns that into
    a 0/1 indicator whose sum is the count. On CPU (torch 2.13, one thread, 1.2M float32 values) that is 0.8 ms
    against 5 ms for ``isfinite(x).sum()``, whose kernels are not vectorised there; on a GPU both are one
    bandwidth-bound pass.
    """
    if not (states.is_floating_point() or states.is_complex()):
        return torch.zeros(states.shape[0], 1, dtype=torch.long, device=states.device)
    dims = states.dim() - 1
    if dims < 2 or not -dims <= channel_dim < dims:
        x = states.reshape(states.shape[0], 1, 1, -1)
    else:
        c = channel_dim % dims + 1
        before = after = 1
        for size in states.shape[1:c]:
            before *= size
        for size in states.shape[c + 1:]:
            after *= size
        x = states.reshape(states.shape[0], before, states.shape[c], after)
    if x.is_complex():
        per_channel = x.shape[1] * x.shape[3]
        return per_channel - torch.isfinite(x).sum(dim=3).sum(dim=1)
    # float32 sums of 0/1 are exact below 2**24 terms; half precision would overflow at 65504
    wide = x.dtype == torch.float64 or x.shape[3] >= 2**24
    indicator = x.sub_(x) if scratch and x.data_ptr() == states.data_ptr() else x - x
    torch.nan_to_num_(indicator, nan=1.0)
    rows = indicator.sum(dim=3, dtype=torch.float64 if wide else torch.float32)
    return rows.long().sum(dim=1)


class NonFinite(Observer):
    """Finds the first NaN/Inf of each logged rollout: the iteration, the channel and where it was seen.

    It answers "where did the NaN come from?". On logging steps it checks, for every iteration, the state
    (``next_state``), ``dx`` and every probe value the iteration delivered, and at the end of the step the
    gradients of the covered model. When something is non-finite the ``instrument`` logger says so once per
    run for the rollout's values and once for the gradients, naming the step, the rollout iteration, the
    channel(s) and the sources (state, dx, probe, parameter); under ``Instrumentation(grad_scaler=...)``
    non-finite gradients are a loss-scale overflow (GradScaler skips that step), said once at INFO, not raised;
    with ``raise_on_nonfinite=True`` the step's commit raises `instrument.NonFiniteError` with that message
    instead (the step's values are committed first, so they are written).

    Sources (``<source>`` below): ``state``, ``dx`` and ``probe.<probe>``. Iterations are 0-based and are the
    rollout's: each context's ``step_index`` where it is past the observer calls so far (a watched call counted
    but not delivered, an explicit evolver that numbers its iterations), else the count of those calls (an
    explicit evolver that leaves it at 0); for a probe recorded only in some iterations too (its first recording
    at call 5 is iteration 5).

    Metric keys (``<name>`` defaults to ``nonfinite``):

    ===================================== ======== ==============================================================
    key                                   kind     meaning
    ===================================== ======== ==============================================================
    ``<name>/first_iteration``            scalar   first iteration with a non-finite value anywhere; -1 if none
    ``<name>/count``                      scalar   non-finite elements over the rollout, all sources together
    ``<name>/count/<source>``             scalar   non-finite elements of one source over the rollout
    ``<name>/first_iteration/<source>``   scalar   that source's first iteration with a non-finite value; -1
    ``<name>/first_channel/<source>``     scalar   lowest non-finite channel at that iteration; -1 if none
    ``<name>/channels/<source>``          scalar   how many channels were non-finite at that iteration
    ``<name>/grad_count``                 scalar   non-finite gradient elements (when gradients are checked)
    ``<name>/grad_count/<param>``         scalar   non-finite elements of one parameter's gradient
    ``<name>/incomplete``                 scalar   1 in a step where a source was dropped (below), on any rank; else 0
    ``<name>/loss_scale``                 scalar   GradScaler's scale after the step (with a ``grad_scaler`` given)
    ===================================== ======== ==============================================================

    Args:
        channel_dim: which dimension of a state (and of a probe value) holds channels (1 for [B, C, H, W]; -1
            for [N, features]); values with fewer dimensions count as one channel.
        gradients: check gradients at the end of the step (of ``module``, or of the watched modules).
        module: the model whose gradients are checked; None: the modules watched with ``inst.watch``.
        include, exclude: parameter-name regular expressions, as `GradientStats` takes them.
        dx: check ``dx`` (computed as ``next_state - previous_state`` when the caller did not give it).
        probes: check the probe values each iteration delivers.
        raise_on_nonfinite: raise `NonFiniteError` at the commit of a step with a non-finite value, instead of
            warning once.
        max_elements: reduce the kept tensors early once they hold this many elements (bounds memory).
        name: the key prefix.

    Under ``torch.distributed`` the counts of observed values are summed over ranks; gradient counts and first
    iterations/channels take the largest rank's value (still -1 only when every rank was finite; a gradient DDP
    averaged is the same on every rank, and a sum counted it once per rank).

    A source whose tensor is changed in place after it was observed (an environment that writes the next
    observation into the same buffer) is caught at log time: that source's values of the step are dropped,
    ``<name>/incomplete`` is logged as 1 (the totals then cover the other sources only), one warning names the
    source, and from then on that source is checked as it comes. The other sources, the totals, the report and
    ``raise_on_nonfinite`` work as in any step, on every rank alike.
    """

    default_name = "nonfinite"
    wants_loss_scale = True  # the session hands it `loss_scale` (Instrumentation(grad_scaler=...))

    def __init__(
        self,
        channel_dim: Optional[int] = None,
        gradients: bool = True,
        module: Optional[nn.Module] = None,
        include: Patterns = None,
        exclude: Patterns = None,
        dx: bool = True,
        probes: bool = True,
        raise_on_nonfinite: bool = False,
        max_elements: Optional[int] = 64 * 2**20,
        name: str = "",
    ) -> None:
        super().__init__(name)
        check_int("NonFinite channel_dim", channel_dim, none=True,
                  why="1 for [B, C, H, W], -1 for channels-last; None: the session's",
                  fix="bind e.g. NonFinite.channel_dim = 1")
        if module is not None and not isinstance(module, nn.Module):
            raise ConfigurationError(
                f"NonFinite(module=...) takes a torch.nn.Module, got {type(module).__name__}; pass the model "
                f"whose gradients to check, or leave it out to check the modules watched with inst.watch."
            )
        select_parameters([], include, exclude)  # bad patterns fail here, not at the first step
        self.channel_dim = channel_dim
        self.gradients = gradients
        self.module = module
        self.include, self.exclude = include, exclude
        self.check_dx = dx
        self.check_probes = probes
        self.raise_on_nonfinite = raise_on_nonfinite
        self.max_elements = check_limit(f"NonFinite({self.name!r})", "max_elements", max_elements, 64 * 2**20)
        self._buffers: Dict[str, IterationBuffer] = {}
        self._calls = 0  # the iteration index the next observe call appends at (at least: `observe`)
        self._rows: Dict[str, List[int]] = {}  # per source, the iteration of each row it appended
        self._shape: Optional[torch.Size] = None  # the state shape channel_dim was checked against
        self._params: List[Tuple[str, nn.Parameter]] = []
        # Committed steps whose record has not been read yet (warn mode), each with whether its gradients were
        # read under an enabled GradScaler (`_amp`).
        self._pending: List[Tuple[Any, bool]] = []
        self._said: Set[str] = set()  # what was reported once per run: "values", "gradients", "overflow"
        self._amp = False  # this logging step's gradients were checked under an enabled GradScaler
        # Set by Instrumentation(grad_scaler=...): non-finite gradients then are a loss-scale overflow, which
        # GradScaler answers by skipping the optimizer step, not a divergence.
        self.loss_scale: Optional[Any] = None
        self._said_dropped: Set[str] = set()  # sources whose in-place change was warned about
        self._dropped: Set[str] = set()  # sources caught changed in place in this step

    # ------------------------------------------------------------------ per logging step
    def reset(self) -> None:
        # A buffer that caught an in-place change outlives the step, unbatched (see the class doc); the others
        # are made again when their source next appears (probe names may change from step to step).
        self._buffers = {source: buffer for source, buffer in self._buffers.items() if not buffer.batched}
        for buffer in self._buffers.values():
            buffer.clear()
        self._dropped = set()
        self._params = []
        self._calls, self._rows = 0, {}

    def attach(self, modules: Sequence[nn.Module]) -> None:
        if self.gradients:
            covered = [self.module] if self.module is not None else list(modules)
            self._params = select_parameters(covered, self.include, self.exclude)

    def _append(self, source: str, value: Tensor) -> None:
        buffer = self._buffers.get(source)
        if buffer is None:
            buffer = self._buffers[source] = IterationBuffer(self._reduce, max_elements=self.max_elements)
        try:
            buffer.append(value)
        except ModifiedInPlaceError:  # caught while draining early: as at log time, this step's values of it go
            self._dropped.add(source)

    def _reduce(self, states: Tensor, scratch: bool = False) -> Tensor:
        said = said_channel_dim(self)  # the observer's, else the session's, else 1
        return nonfinite_counts(states, 1 if said is None else said, scratch)

    def observe(self, context: StepContext) -> None:
        state = context.next_state
        if state.shape != self._shape:  # metadata only: a channel_dim that names no channel dimension is refused
            said = said_channel_dim(self)
            if said is not None and state.dim() >= 2:  # an [N, features] state too: channel_dim=0 is its batch
                check_channel_dim(self.name, said, state.shape)
            self._shape = state.shape
        # The rollout's index: a watched call counted but not delivered (docs/observers.md) leaves a gap, and the
        # iterations after it keep theirs. An explicit evolver that leaves step_index at 0 is counted instead.
        index = max(self._calls, context.step_index)
        rows = self._rows.get("state")
        if rows is None:
            rows = self._rows["state"] = []
            if self.check_dx:
                self._rows["dx"] = rows  # the same iterations
        rows.append(index)  # `log` maps rows to iterations only when they differ
        self._append("state", state)
        if self.check_dx:
            # Taken now, per iteration (not from kept (previous, next) pairs at log time, as UpdateNorm does): a
            # rollout that reuses its state buffers in place would then lose dx with the state, and a chain of
            # mixed dtypes or a broadcast first state would be differenced in the stack's dtype and shape.
            self._append("dx", context.dx)
        if self.check_probes:
            for probe, value in context.probes.items():
                source = f"probe.{probe}"
                self._rows.setdefault(source, []).append(index)
                self._append(source, value)
        self._calls = index + 1

    def log(self, logger, step: int) -> None:
        metrics: Dict[str, Tensor] = {}
        tables: Dict[str, Tensor] = {}
        dropped: List[str] = []
        for source, buffer in self._buffers.items():
            if source in self._dropped:
                dropped.append(source)
                continue
            try:
                table = buffer.results(pad=0)  # [T, C] non-finite counts; none in a channel a probe lacked then
            except ModifiedInPlaceError:  # the buffer now reduces as it comes; this step's values of it go
                dropped.append(source)
                continue
            if table is not None:
                tables[source] = table
        if tables:
            # Sources of one table shape (the state and dx always) are summarised together: one set of kernels
            # for all of them instead of one per source (launches are most of this on a GPU).
            groups: Dict[Any, List[str]] = {}
            for source, table in tables.items():
                groups.setdefault((table.shape, table.device), []).append(source)
            found: Dict[str, Tuple[Tensor, ...]] = {}
            firsts, counts = [], []
            for names in groups.values():
                summary = _first_nonfinite(torch.stack([tables[name] for name in names]))
                firsts.append(summary[1])
                counts.append(summary[0])
                for i, name in enumerate(names):
                    found[name] = tuple(column[i] for column in summary)
            for source, rows in self._rows.items():
                if source in found and rows[-1] != len(rows) - 1:  # recorded in some iterations only: its rows
                    count, first, first_channel, channels = found[source]  # are mapped to those iterations
                    at = to_device(torch.tensor(rows), first.device)  # no host sync on a GPU
                    first = torch.where(first >= 0, at[first.clamp_min(0)], -1)
                    found[source] = (count, first, first_channel, channels)
                    firsts = [found[name][1].view(1) for name in tables]
            for source in tables:
                count, first, first_channel, channels = found[source]
                metrics[f"count/{source}"] = count
                metrics[f"first_iteration/{source}"] = first
                metrics[f"first_channel/{source}"] = first_channel
                metrics[f"channels/{source}"] = channels
            every = firsts[0] if len(firsts) == 1 else torch.cat(firsts)
            none = torch.iinfo(every.dtype).max
            earliest = torch.where(every >= 0, every, none).amin()
            metrics["first_iteration"] = torch.where(earliest == none, -1, earliest)
            metrics["count"] = (counts[0] if len(counts) == 1 else torch.cat(counts)).sum()
        # A sparse gradient (nn.Embedding(sparse=True)) is checked through its stored values: isfinite has no
        # sparse kernel, so it failed the whole log, losing every other count of the step. Coalesced first: an
        # embedding's gradient holds one row per looked-up index, repeats included, and a row looked up 3 times
        # counted its non-finite elements 3 times (more than the parameter holds).
        # host sync: on a GPU, coalescing learns how many distinct rows there are (sparse gradients, logging steps).
        grads = [(name, p.grad if p.grad.layout == torch.strided else p.grad.coalesce()._values())  # under no_grad
                 for name, p in self._params if p.grad is not None]
        self._amp = bool(grads) and self.loss_scale is not None and self.loss_scale.enabled
        if grads:
            # DTensor gradients (FSDP2): every rank gets the whole parameters' counts (`global_value`); plain ones
            # beside them (fully_shard on a submodule only) counted apart, each kind with its own fused kernel
            mixed = by_kind([g for _, g in grads], lambda group: grad_counts(group).unbind())
            per_param = global_value(grad_counts([g for _, g in grads])) if mixed is None else torch.stack(
                [count.to(grads[0][1].device) for count in mixed])
            metrics["grad_count"] = per_param.sum()
            metrics.update(zip([f"grad_count/{name}" for name, _ in grads], per_param.unbind(), strict=True))
        scale = self.loss_scale.current() if self._amp else None  # None: no scale() call yet
        if scale is not None:  # the scale after the step's update(): below 1, overflows are not GradScaler's to fix
            logger.log_metrics({"loss_scale": scale}, step=step, prefix=self.name)
        if metrics:
            # Every value is an int64 tensor, and on one process the reduce ops change nothing: the logger then
            # stages the call as one block (one stack and conversion) instead of key by key (a few kernels each).
            # Gradient counts take the largest rank's: DDP's averaged gradients and FSDP2's global counts are the
            # same on every rank (a sum counted each element once per rank: more than the parameter holds).
            reduce = {key: ("sum" if key.startswith("count") else "max") for key in metrics}
            logger.log_metrics(metrics, step=step, prefix=self.name, reduce=over_ranks(logger, reduce))
        if tables or dropped:  # max over ranks: marked wherever a rank dropped one; every rank logs the key
            logger.log_metrics({"incomplete": 1.0 if dropped else 0.0}, step=step, prefix=self.name,
                               reduce=over_ranks(logger, {"incomplete": "max"}))
        for buffer in self._buffers.values():
            buffer.clear()
        self._dropped = set()
        self._calls, self._rows = 0, {}
        new = [source for source in dropped if source not in self._said_dropped]
        if new:
            self._said_dropped.update(new)
            log.warning(
                "instrument: NonFinite(%r): the %s tensors were modified in place after they were observed (an "
                "environment or rollout that reuses its buffers), so the references kept for the batched check no "
                "longer hold the observed values; their counts of step %d are dropped (%s/incomplete = 1, the "
                "other sources are checked and logged), and from now on they are checked as they come",
                self.name, ", ".join(new), step, self.name,
            )

    # ------------------------------------------------------------------ after the commit (host values)
    @property
    def reported(self) -> bool:
        """Everything this observer reports once per run was reported (later records need not be read)."""
        return "values" in self._said and ("gradients" in self._said or not self.gradients)

    def committed(self, record: Any) -> None:
        """The step was committed; ``record`` is the logger's `CommittedStep` (or None: nothing was staged)."""
        amp, self._amp = self._amp, False
        if self.raise_on_nonfinite:
            if record is None:
                return
            # host sync: raising at this step needs its values; the logger's transfer has started, and this
            # waits for the writer thread to have built the step's record from it.
            built = record.result()
            if built is None:
                return
            message = self._report_of(built, amp, once=False)
            if message is not None:
                raise NonFiniteError(message)
            return
        if self.reported:
            return
        if record is not None:
            self._pending.append((record, amp))
        self._report([(r, a) for r, a in self._pending if r.record is not None or r.dropped])

    def close(self) -> None:
        """The session closed (every committed record is built): report what is still pending."""
        if not self.reported:
            self._report([(r, a) for r, a in self._pending if r.result(timeout=0) is not None or r.dropped])
        self._pending = []
        self.reset()  # the covered parameters and kept states go: the observer may outlive the model
        # "Once per run": an observer handed to the next session (a notebook re-run) reports that run's first
        # non-finite values too.
        self._said, self._said_dropped = set(), set()

    def _report(self, ready: List[Tuple[Any, bool]]) -> None:
        for entry in ready:
            self._pending.remove(entry)
            handle, amp = entry
            built = handle.record
            if self.reported or built is None:
                continue
            message = self._report_of(built, amp, once=True)
            if message is not None:
                log.warning("instrument: %s (each kind reported once per run)", message)
        if self.reported:
            self._pending = []

    def _report_of(self, built: Any, amp: bool, once: bool) -> Optional[str]:
        """The report of one committed step, None when it has nothing to report; each kind in it is marked said.
        ``once`` (warn mode) leaves out the kinds said before, so a NaN in the state after gradient trouble is
        still said. Gradients that are a loss-scale overflow are said at INFO instead (`_overflow`)."""
        values, gradients = self._parts(built.scalars)
        if gradients is not None and self._overflow(built.scalars, amp):
            self._say_overflow(gradients, built.step)
            gradients = None
        if once:
            values = None if "values" in self._said else values
            gradients = None if "gradients" in self._said else gradients
        self._said.update(kind for kind, part in (("values", values), ("gradients", gradients)) if part)
        return self._message(built.scalars, built.step, values, gradients)

    def _overflow(self, scalars: Mapping[str, float], amp: bool) -> bool:
        """Non-finite gradients of this step are a loss-scale overflow: under an enabled GradScaler whose scale
        is still 1 or more. A scale below 1 (a skip at step after step: a loss or gradients that are not finite
        at any scale) makes them a divergence again, as torch's GradScaler documentation reads it."""
        return amp and scalars.get(self.name + "/loss_scale", 1.0) >= 1.0

    def _say_overflow(self, gradients: str, step: int) -> None:
        if "overflow" in self._said:
            return
        self._said.add("overflow")
        log.info(
            "instrument: NonFinite(%r): %s at step %d under torch.amp.GradScaler: a loss-scale overflow, on which "
            "GradScaler skips the optimizer step and lowers its scale; expected now and then with mixed precision "
            "(a skip at every step means the loss itself is not finite). Counted in %s/grad_count; not reported "
            "as a divergence. (Said once.)", self.name, gradients, step, self.name,
        )

    def _message(self, scalars: Mapping[str, float], step: int, values: Optional[str],
                 gradients: Optional[str]) -> Optional[str]:
        """The report of one step's host scalars from its parts (`_parts`), None when both are."""
        parts = [part for part in (values, gradients) if part]
        if not parts:
            return None
        incomplete = scalars.get(self.name + "/incomplete", 0.0) > 0
        note = " (incomplete: a source changed in place after it was observed is not counted)" if incomplete else ""
        scale = scalars.get(self.name + "/loss_scale")
        if gradients and scale is not None and scale < 1.0:
            parts[-1] += (f" (GradScaler's loss scale fell to {scale:.3g}: it skipped optimizer step after step, so "
                          f"the loss or its gradients are not finite at any scale)")
        elif gradients and self.loss_scale is None:
            parts[-1] += (" (with torch.amp.GradScaler that is a loss-scale overflow, on which the optimizer step "
                          "is skipped: pass Instrumentation(grad_scaler=scaler) to have it told apart)")
        return f"non-finite values at step {step}{note}: " + "; ".join(parts)

    def _parts(self, scalars: Mapping[str, float]) -> Tuple[Optional[str], Optional[str]]:
        """(the rollout values' report, the gradients' report) of one step's host scalars; None where finite."""
        head = self.name + "/"
        count = scalars.get(head + "count", 0.0)
        grad_count = scalars.get(head + "grad_count", 0.0)
        values = gradients = None
        if count > 0:
            first = int(scalars[head + "first_iteration"])
            where = []
            for key, value in scalars.items():
                if key.startswith(head + "first_iteration/") and int(value) == first:
                    source = key[len(head + "first_iteration/"):]
                    channel = int(scalars.get(f"{head}first_channel/{source}", -1))
                    channels = int(scalars.get(f"{head}channels/{source}", 0))
                    more = f" ({channels} channels non-finite there)" if channels > 1 else ""
                    where.append(f"{source} channel {channel}{more}")
            also = [
                key[len(head + "count/"):] for key, value in scalars.items()
                if key.startswith(head + "count/") and value > 0
                and int(scalars.get(head + "first_iteration/" + key[len(head + "count/"):], -1)) != first
            ]
            values = (
                f"first at rollout iteration {first} in {', '.join(where)}; {int(count)} non-finite elements "
                f"over the rollout" + (f" (later also in {', '.join(also)})" if also else "")
            )
        if grad_count > 0:
            bad = [
                f"{key[len(head + 'grad_count/'):]} ({int(value)})" for key, value in scalars.items()
                if key.startswith(head + "grad_count/") and value > 0
            ]
            shown = ", ".join(bad[:_NAMED])  # a NaN loss makes every gradient NaN: 1,000 names said nothing more
            more = f" and {len(bad) - _NAMED} more parameters (see {head}grad_count/*)" if len(bad) > _NAMED else ""
            gradients = f"{int(grad_count)} non-finite gradient elements in {shown}{more}"
        return values, gradients


_NAMED = 8  # the parameters a report names, in order; the rest are counted (each has its grad_count/<name> key)


def _first_nonfinite(tables: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """[S, T, C] counts of S sources -> per source ([S] each): the count over the rollout, the first iteration
    with one (-1 if none), the lowest non-finite channel at that iteration (-1) and how many channels were."""
    per_iteration = tables.sum(dim=2)  # [S, T]
    bad = per_iteration > 0
    first = torch.where(bad.any(dim=1), bad.to(torch.int8).argmax(dim=1), -1)
    at = first.clamp_min(0).view(-1, 1, 1).expand(-1, 1, tables.shape[2])
    row = tables.gather(1, at).squeeze(1) > 0  # [S, C]: the non-finite channels at that iteration
    if row.shape[1]:
        first_channel = torch.where(row.any(dim=1), row.to(torch.int8).argmax(dim=1), -1)
    else:  # a state with no elements (zero channels): nothing can be non-finite, and argmax has nothing to take
        first_channel = torch.full_like(first, -1)
    return per_iteration.sum(dim=1), first, first_channel, row.sum(dim=1)
