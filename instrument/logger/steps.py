"""Records beside the interval commit: values at their own step, a failed step's values, a repeated step.

`Logger` inherits these from `StepRecords`; they work on its staged table under its locks.

- ``log_metrics(..., commit=True)`` (`_commit_own`): the values become one record at their own step; what
  else is staged stays staged for the next commit.
- A failed step (`mark` / `discard_staged`): the session marks the start of every step and, when the step's
  body raised, discards what was staged since, so no value of a failed step reaches a later step.
- A step committed twice: written again at that step, with a one-time warning (`_check_repeat`).
- A step lower than one committed: refused or warned about (`_step_regressed`).
- A commit's hand-over to the writer (`_submit`), and a hand-over cut short by Ctrl-C (`_take_back`): the step
  is not written and may be committed again, and what the interval staged before it stays staged.
"""

import logging
import numbers
from threading import get_ident
from typing import Any, Dict, List, Mapping, Optional

from torch import Tensor

from instrument.checks import check_int
from instrument.errors import InvalidValueError, StepOrderError
from instrument.logger.blocks import contributions
from instrument.logger.handover import handover
from instrument.logger.values import Wide, as_scalar, refuse_merged_keys, weighted
from instrument.logger.writer import CommittedStep

__all__ = ["LAZY", "MAX_STEP", "StepRecords", "check_commit_step", "check_step", "resume_step", "step_range_message"]

log = logging.getLogger("instrument")

LAZY = object()  # a mark whose snapshot is taken at the next staging call
# The largest step: TensorBoard, W&B and MLflow keep steps as signed 64-bit integers and refuse a larger one at
# write time (every step after it then fails in them while JSONL and the history keep it), so it is refused at
# the call, as a negative step is.
MAX_STEP = 2**63 - 1


def step_range_message(what: str, step: int) -> str:
    return (f"{what} must be between 0 and 2**63 - 1 (TensorBoard, W&B and MLflow store steps as signed 64-bit "
            f"integers), got {step}: steps count from 0. Number the loop from 0 (or offset it).")


def check_step(step: object) -> None:
    """Refuse a step that is not an int (NumPy and other integral types pass) in 0..2**63 - 1."""
    if type(step) is not int and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise InvalidValueError(f"step must be an int, got {type(step).__name__} ({step!r}).")
    if not 0 <= step <= MAX_STEP:  # type: ignore[operator]
        raise InvalidValueError(step_range_message("step", step))  # type: ignore[arg-type]


def check_commit_step(step: object) -> None:
    """`check_step` for ``commit(step)``, before anything is taken off the staged table: a step that is not an
    int in range is the caller's slip, and the values staged for it stay staged for a commit with a good one."""
    try:
        check_step(step)
    except InvalidValueError as exc:
        raise InvalidValueError(f"commit: {exc} Nothing was committed: the values staged since the last commit "
                                f"stay staged, for a commit with an int step.") from None


def resume_step(last_step: object) -> Optional[int]:
    """``last_step`` of a checkpoint (`StepRecords.resume_after`) as an int, or None; anything else is refused."""
    return check_int("resume_after: last_step", last_step, least=0, most=MAX_STEP, integral=True, none=True,
                     expected="None or an int >= 0 (a step a checkpoint's state_dict() counted as committed)",
                     fix="pass the 'last_step' of Instrumentation.state_dict() as it was saved")


_REPEAT = "\0repeated step"  # never a metric key: the empty key is refused
_OWN = "instrument/"  # the session's own keys (`instrument/overhead/...`): named after the user's


class StepRecords:
    """Mixin of `Logger` (uses its ``_lock``, ``_commit_lock``, staged table and writer)."""

    @property
    def last_step(self) -> Optional[int]:
        """The last committed step (None before the first): a caller whose step is computed, such as `RLLogging`
        counting frames, checks it moved past it, so it never commits one step twice."""
        return self._last_step

    def resume_after(self, last_step: Optional[int]) -> None:
        """Go on from a checkpoint whose last committed step was ``last_step`` (None: none was): later steps
        must follow it, and every backend is told before the next record that steps from ``last_step + 1`` on
        are written again (`Backend.on_resume`). `Instrumentation.load_state_dict` calls this. Anything but None
        or an int >= 0 is refused before anything changes."""
        last_step = resume_step(last_step)
        with self._lock:
            self._last_step = last_step
        if self.is_writer:
            self._writer.call("on_resume", 0 if last_step is None else int(last_step) + 1)

    def _commit_own(
        self, metrics: Mapping[str, Any], step: int, head: str, ops: Any
    ) -> Optional[CommittedStep]:
        """``log_metrics(..., commit=True)``: these values alone, as one record at ``step``."""
        if get_ident() == self._writer.ident and not self._gate(f"log_metrics(..., step={step}, commit=True)"):
            # the writer thread calling back while another thread commits: staged for the next commit instead
            reduce = {key: op for key, (op, _) in ops.items()} if ops is not None else "mean"
            weighed = {key: w for key, (_, w) in ops.items() if w is not None} if ops is not None else {}
            return self.log_metrics(metrics, step, head.rstrip("/"), reduce, weighed or None)
        if get_ident() != self._writer.ident:  # the common case, decided inline (`Logger._gate`)
            self._commit_lock.acquire()
        try:
            return self._hand_own(metrics, step, head, ops)
        finally:
            self._commit_lock.release()

    def _hand_own(self, metrics: Mapping[str, Any], step: int, head: str, ops: Any) -> Optional[CommittedStep]:
        """`_commit_own` under the commit lock: convert, then hand the record over."""
        totals: Dict[str, Any] = {}
        own_ops: Dict[str, str] = {}
        weights: Dict[str, Any] = {}
        on_device: Dict[str, None] = {}
        wide: Wide = {}
        odd = False
        for key, value in metrics.items():
            if type(key) is str:
                name = head + key
            else:
                name, odd = head + str(key), True
            op, weight = ("mean", None) if ops is None else ops[key]
            value = as_scalar(name, value, self._warn_once, wide)
            if weight is not None:
                weights[name] = weight = as_scalar(f"weight of {name}", weight, self._warn_once)
                value = weighted(value, weight)  # an ExactSum where two finite floats' product overflows, as staged
            totals[name] = value
            if op != "mean":
                own_ops[name] = op
            if isinstance(value, Tensor) or (weight is not None and type(weight) is not float):
                on_device[name] = None
        if odd:  # a key that is not a str: two keys may name one metric (1 and "1")
            refuse_merged_keys(metrics, head)
        collective = self.reducer.active()
        if not totals and not collective:
            return None
        with self._lock:
            if not self._accept(step, pending=False):
                return None
            step = int(step)
            self._check_repeat(step, totals)
            last, self._last_step = self._last_step, step
        # no snapshot: the interval's staged table was not taken, so a cut-short hand-over leaves it as it is
        return self._submit(step, (totals, {}, own_ops, weights, on_device, {}, {}, [], wide), collective, last,
                            None)

    def _check_repeat(self, step: int, names: Mapping[str, Any]) -> None:
        """A second record at the step last committed: written, but said once (W&B keeps only the first)."""
        if step == self._last_step and names and _REPEAT not in self._warned:
            self._warned[_REPEAT] = None
            unique = sorted(set(names))  # a key staged by several calls (blocks, timers) is named once
            shown = [n for n in unique if not n.startswith(_OWN)] + [n for n in unique if n.startswith(_OWN)]
            more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
            log.warning(
                "instrument: step %d is committed a second time (keys %s%s); MLflow and JSONL keep both records at "
                "that step, TensorBoard's event file holds both but its UI shows only the last one written for a "
                "step (a key in both shows the second value), W&B keeps only the first. Log values that belong to "
                "the next logging step without commit=True, or commit them at their own step. (Said once per run.)",
                step, shown[:5], more,
            )

    def _step_regressed(self, step: int, last: int) -> None:
        """A step lower than one committed: `StepOrderError`, or a warning under ``on_step_regression="warn"``."""
        message = (
            f"step {step} is lower than step {last}, which was already committed; steps must not go backwards "
            f"(W&B silently drops such data). Log with monotonically increasing steps"
        )
        if self.on_step_regression == "raise":
            raise StepOrderError(f"{message}, or pass on_step_regression='warn' to drop these values instead.")
        log.warning("instrument: %s. The values of this call are dropped (with everything staged, for a commit).",
                    message)

    def mark(self) -> tuple:
        """Remember what is staged now, so that `discard_staged` can drop what is staged after it.

        The session marks the start of every step and discards when the step's body raised. Cheap, whatever
        is pending: the staged table is copied only when something is staged after the mark (once per mark),
        and no timer is visited: a mark bumps the number its timers read at their next span, where each notes
        where it stood (`Timer.rewind`). A new mark replaces the previous one.
        """
        with self._lock:
            self._mark = self._marks[0] = self._marks[0] + 1  # never reused: a timer compares it with the last seen
            self._snapshot = LAZY
            return (self._mark,)

    def discard_staged(self, mark: tuple) -> List[str]:
        """Drop every value staged (from any thread) since ``mark``: they are never committed, at this step or
        a later one. Values staged before the mark stay. Returns the names dropped (timers as
        ``timer <name>``); nothing when a later mark replaced ``mark``."""
        (number,) = mark
        with self._lock:
            if number != self._mark:
                return []
            snapshot, self._snapshot, self._mark = self._snapshot, None, 0
            # Only timers measured since their last take can hold anything; each knows what it held at the mark.
            # .copy(): one C-level step, which another thread's timer entering itself cannot interrupt (a
            # Python-level walk allocates, which can run the collector, finalizers and another thread)
            dropped = [f"timer {name}" for name, t in self._timed.copy().items() if t.rewind(number)]
            if snapshot is None or snapshot is LAZY:
                return dropped
            totals, counts, ops, weights, on_device, media, pending, blocks, wide, tags = snapshot
            before = contributions(totals, counts, blocks)
            now = contributions(self._totals, self._counts, self._blocks)
            dropped += [name for name, n in now.items() if n != before[name]]
            dropped += [f"{kind} {tag}" for key, value in self._media.items() if media.get(key) is not value
                        for kind, tag in [key]]
            self._totals, self._counts, self._ops, self._weights = totals, counts, ops, weights
            self._on_device, self._media, self._pending_step, self._blocks = on_device, media, pending, blocks
            self._wide, self._tags = wide, tags  # the flags and media tags staged since the mark go with them
            return dropped

    def _submit(self, step: int, staged: tuple, collective: bool, last: Optional[int],
                snapshot: Any, paired: bool = True) -> Optional[CommittedStep]:
        handle: Optional[CommittedStep] = None
        try:
            handle = CommittedStep(step, self._writer)
            payload = handover(step, staged, self.reducer if collective else None, self._warn_once, paired,
                               self._final)
            if payload is None:
                return None
            if not self._writer.submit(handle, payload, wait=not self._final):
                log.warning("instrument: step %d was committed after the logger closed; it is not written", step)
                return None
        except BaseException as exc:
            if handle is None or not handle.seq:  # Ctrl-C (or an error) before the writer took the step: not written
                self._take_back(step, last, snapshot, exc)
            raise
        return handle

    def _take_back(self, step: int, last: Optional[int], snapshot: Any, exc: BaseException) -> None:
        """A commit interrupted before its hand-over (Ctrl-C while the transfer starts or the queue is full):
        the step is not written, so it may be committed again, and what a session's step found staged when it
        began (the interval's earlier values, `mark`) is staged again for the next commit, as for a step whose
        body raised. Only the step's own values are lost, and that is said."""
        with self._lock:
            if self._last_step == step:
                self._last_step = last
            kept = (isinstance(snapshot, tuple) and self._snapshot is LAZY
                    and not (self._totals or self._counts or self._blocks or self._media))
            if kept:  # nothing staged since the swap: the table is the snapshot again, the mark still live
                (self._totals, self._counts, self._ops, self._weights, self._on_device, self._media, pending,
                 self._blocks, self._wide, self._tags) = (
                    dict(snapshot[0]), dict(snapshot[1]), dict(snapshot[2]), dict(snapshot[3]), dict(snapshot[4]),
                    dict(snapshot[5]), snapshot[6], list(snapshot[7]), dict(snapshot[8]), dict(snapshot[9]))
                if pending is not None and (self._pending_step is None or pending > self._pending_step):
                    self._pending_step = pending  # an implicit commit (close()) writes them at their step
        # An error raised to the caller (ranks out of step) failed the commit; Ctrl-C or an exit interrupted it.
        how = "failed" if isinstance(exc, Exception) else "was interrupted"
        log.warning("instrument: the commit of step %d %s (%s) before it was handed to the writer, so "
                    "step %d is not written%s", step, how, type(exc).__name__, step,
                    "; the values staged before it began go with the next commit" if kept else
                    ", nor are the values it took")

    def _take_snapshot(self) -> None:
        """The staged table as it is, before the first value staged after a mark (under the lock)."""
        self._snapshot = (
            dict(self._totals), dict(self._counts), dict(self._ops), dict(self._weights), dict(self._on_device),
            dict(self._media), self._pending_step, list(self._blocks), dict(self._wide), dict(self._tags),
        )
