"""The life of one logging step of `Instrumentation`: begin (mark the staged table, attach hooks, turn probes
on), end (detach, run the observers' log and the step components, commit once) and the failed step.

A step whose body raised keeps nothing it staged (`Logger.discard_staged`). Under a process group it still
commits, with what was staged before the step: every rank commits at every logging step, so that each commit's
collective pairs with the same step on every rank (a rank that skipped one would pair its later commits with
other ranks' later steps, mixing their values, and leave the others waiting at close).
"""

import inspect
import logging
import threading
import time
from typing import Any, Callable, List, Optional

from instrument.core.context import StepContext, same_view
from instrument.core.overhead import OverheadMeter, over_budget
from instrument.errors import ConfigurationError, StepOrderError
from instrument.probes import record
from instrument.probes.embedded import check_probe_requests
from instrument.session.scope import StepScope

__all__ = ["StepLifecycle", "run_all"]

NO_FLUSH = object()  # no checkpoint counted the open step (`StepLifecycle._flush_checkpointed`)

log = logging.getLogger("instrument")


class StepLifecycle:
    """Mixin of `Instrumentation` (uses its logger, dispatcher, watches, probe sets and overhead meter)."""

    def _begin(self, scope: StepScope) -> None:
        if self._current is not None:
            raise ConfigurationError(
                f"inst.step({scope.step}) entered while step {self._current.step} is still open; steps do not nest."
            )
        if scope.step == self._block_committed and self.logger.on_step_regression == "raise":
            raise StepOrderError(
                f"inst.step({scope.step}) is entered again, but its block already ran and committed logging step "
                f"{scope.step}: every backend would hold two records of that step (W&B keeps only the first). Use a "
                f"new step number for each training step (the same `with inst.step(k)` block once per k), or pass "
                f"on_step_regression='warn' to write it again with a warning."
            )
        check_probe_requests(self.observers, self.probe_names)
        meter = self._overhead
        if meter is not None:
            meter.enter(scope.step)
            self._dispatch.clock = meter
        scope._mark = self.logger.mark()
        self._observed_twice = (0, "")  # (`_observe`)
        self._current, self._step_thread = scope, threading.get_ident()
        try:  # whatever stops the start (Ctrl-C in an observer's reset or attach) ends it like a failed step
            if self._loss_scale is not None:
                self._loss_scale.begin()
            self._dispatch.begin(self.watched_modules)
            self._probes_on()
            for watch in self._watches:
                watch.attach()
            if meter is not None:
                meter.begun()
        except BaseException:
            self._detach_all(failed=True)
            if self._loss_scale is not None:
                self._loss_scale.end()
            self._current = None
            self._stop_clock(failed=True)
            self._commit_failed(scope.step)
            raise

    def _end(self, scope: StepScope, failed: bool) -> None:
        if not self._closed:
            try:
                self._end_open(scope, failed)
            except ConfigurationError:
                if not self._closed:
                    raise
                # Closed while this block ended (from another thread, or by an observer's log): the logger
                # refused the rest. Not the caller's error; the step is not written (waiting for it in close()
                # could deadlock: this thread may wait for the writer or a lock the closing one holds).
                log.warning("instrument: the session was closed while logging step %d was ending (from another "
                            "thread, or by code that step ran); that step is not written.", scope.step)
            return
        # Closed from another thread while this block ran: nothing commits, and what the step attached (the
        # observers' own hooks, and hooks or probes a close during `_begin` could not yet see) comes off here, on
        # the thread that runs the model.
        self._current, self._flush_on_commit = None, NO_FLUSH
        try:
            self._detach_all(failed=True)
        finally:
            if self._loss_scale is not None:
                self._loss_scale.end()
            self._stop_clock(True)

    def _end_open(self, scope: StepScope, failed: bool) -> None:
        meter = self._overhead
        committed = detached = False
        try:
            if meter is not None:
                meter.ending()
            recorder = self._recorder
            detached = True  # `_detach_all` runs every part, whatever one of them raises
            self._detach_all(failed)
            if not failed:
                self._report_mixed(scope.step)
                gradients = None
                if recorder is not None:
                    gradients = recorder.gradients_in_forward_order()
                    if gradients and self._loss_scale is not None:  # of the loss, not of the loss times its scale
                        gradients = self._loss_scale.unscale(gradients)
                    if recorder.recorded and not recorder.delivered:
                        log.warning(
                            "instrument: embedded probes recorded values in step %d but no observer call "
                            "delivered them; watch the module whose forward is one rollout iteration (called "
                            "from TorchScript code, it must be scripted with instrument.script), or call "
                            "s.observer(StepContext(...)) each iteration", scope.step,
                        )
                    elif recorder.pending:
                        self._report_undelivered(sorted(recorder.pending), scope.step)
                self._dispatch.end(self.logger, scope.step, gradients)
                if meter is not None:
                    self._report_overhead(meter, scope.step)
                self._components.log(self.logger, scope.step, meter)
                started = time.perf_counter()
                handle = self.logger.commit(scope.step)
                committed = True
                self._block_committed = scope.step
                if meter is not None:
                    meter.commit_seconds(time.perf_counter() - started)
                self._dispatch.committed(handle)
                self._flush_checkpointed()  # after the commit is timed: a checkpoint's wait is not the commit's cost
            else:
                self._discard(scope)
                self._commit_failed(scope.step)
        except BaseException:
            # Interrupted before its commit (Ctrl-C in an observer's log or detach, a SystemExit in a component):
            # a failed step. What it staged must not ride into the next logging step's record as its own.
            if not detached:  # interrupted before the hooks came off: they would run in the next, non-logging steps
                try:
                    self._detach_all(failed=True)
                except BaseException:
                    log.debug("instrument: undoing logging step %d's hooks failed", scope.step, exc_info=True)
            if not failed and not committed:
                failed = True
                self._discard(scope)
                self._commit_failed(scope.step)
            raise
        finally:
            self._current = None
            if self._loss_scale is not None:
                self._loss_scale.end()
            self._flush_on_commit = NO_FLUSH  # a checkpoint's promise ends with its block, committed or not
            self._stop_clock(failed)

    def _claim_close(self, interrupted: Optional[BaseException]) -> bool:
        """Mark the session closed; False when another thread's close() did first (while this one ended its step
        inside the block): that close does the rest, so observers and components are closed once. ``interrupted``
        (a Ctrl-C while this one ended its step) is raised then. From another thread, the open block's own exit
        then ends its step, committing nothing."""
        claim = object()  # dict.setdefault is one C call: no lock a signal handler's close() or a fork could block on
        already = self.__dict__.setdefault("_close_claim", claim) is not claim
        self._closed = True
        if already and interrupted is not None:
            raise interrupted
        return not already

    def _flush_checkpointed(self) -> None:
        """A checkpoint saved inside this block counted its step as committed (`Instrumentation.state_dict`):
        now that it is, wait until it is written (bounded as the checkpoint's own flush), so a process killed
        hard after the block keeps the step the checkpoint promised."""
        wait, self._flush_on_commit = self._flush_on_commit, NO_FLUSH
        if wait is not NO_FLUSH and wait != 0:
            self._flush_for_checkpoint(wait, "the block a checkpoint was saved in")

    def _report_undelivered(self, names: List[str], step: int) -> None:
        """Probe values recorded after the step's last observer call reach no observer: said once per probe."""
        new = [name for name in names if name not in self._said_undelivered]
        if not new:
            return
        self._said_undelivered.update(new)
        log.warning(
            "instrument: embedded probe(s) %s recorded values in logging step %d after its last observer call, so "
            "no observer saw them: a probe's value reaches observers in the StepContext of the iteration it was "
            "recorded in. A probe in a module called after the rollout (a readout head) is not seen; call "
            "s.observer(StepContext(...)) after that module too, or log the value yourself. (Said once per probe.)",
            ", ".join(repr(name) for name in new), step,
        )

    def _observe(self, context: StepContext) -> None:
        """``s.observer`` on a logging step: the dispatcher, after one check. A loop that hands over the state a
        watched module's call just returned, which its hook already delivered, has that iteration observed twice;
        such calls are counted and said at the step's end (`_report_mixed`)."""
        for watch in self._watches:
            last = watch.last_delivered
            if last is not None and same_view(context.next_state, last):
                self._observed_twice = (self._observed_twice[0] + 1, watch.name)
                break
        self._dispatch(context)

    def _report_mixed(self, step: int) -> None:
        """Two watched modules that both delivered iterations feed the observers one stream; a loop that hands
        ``s.observer`` the states a watched module's hook delivered has them observed twice: each said once."""
        twice, self._observed_twice = self._observed_twice, (0, "")
        if twice[0] and not self._twice_said:
            self._twice_said = True
            log.warning(
                "instrument: in logging step %d, s.observer was handed %d state(s) that watched module %s had "
                "just returned, which its hook had already delivered: each of those iterations is observed twice "
                "(IterationStats' iterations counts them twice, heatmap rows and video frames repeat, and "
                "iteration labels such as StateHistogram's it<i> and NonFinite's first_iteration count them "
                "twice). Do one of the two: watch the module with state=False (its probes still record) and keep "
                "the s.observer calls, or drop them. (Said once.)", step, twice[0], twice[1],
            )
        called = [(watch.name, watch.iterations) for watch in self._watches if watch.iterations]
        if len(called) < 2 or self._mixed_said:
            return
        self._mixed_said = True
        log.warning(
            "instrument: in logging step %d the watched modules %s all delivered iterations to the same observers, "
            "which see them as one rollout of %d iterations: their states are mixed in every statistic "
            "(IterationStats' iterations, UpdateNorm's l2/first and l2/last...), and states of different shapes "
            "fail those observers' log. Watch one module per rollout with state=True (the module whose forward "
            "is one iteration), the others with state=False, or give each rollout its own Instrumentation. "
            "(Said once.)", step, ", ".join(f"{name} ({n} calls)" for name, n in called), sum(n for _, n in called),
        )

    def _commit_failed(self, step: int) -> None:
        """Under a process group a failed step still commits (see the module docstring); a fault here is said,
        never raised over the step's own exception."""
        if not self.logger.reducer.active():
            return
        try:
            self.logger.commit(step)
        except Exception:
            log.warning("instrument: the commit of failed step %d (which keeps the ranks' commits paired) raised",
                        step, exc_info=True)

    def _stop_clock(self, failed: bool) -> None:
        self._dispatch.clock = None
        if self._overhead is not None:
            self._overhead.discard() if failed else self._overhead.exit()

    def _report_overhead(self, meter: OverheadMeter, step: int) -> None:
        """Log the overhead of the newest logging step measured before this one whose clocks can be read; warn
        once over the budget. Several steps readable at once (CUDA events that completed late) would be averaged
        into one value by the logger at this one step: only the newest is logged, every one is judged."""
        ready = meter.ready()
        if ready:
            self.logger.log_metrics(ready[-1][1], step)
        for measured, scalars, warm in ready:
            message = over_budget(measured, scalars, self.overhead_budget, self.log_interval)
            if message and warm and not self._overhead_warned:
                self._overhead_warned = True
                log.warning("instrument: %s", message)

    def _discard(self, scope: StepScope) -> None:
        """The body of step ``scope.step`` raised: what it staged is dropped (said once per session), and a
        checkpoint taken inside it no longer has a signal's close write the step."""
        self.logger.keep_on_shutdown(None)  # only this step can be kept and not committed: it is the open one
        dropped = self.logger.discard_staged(scope._mark) if scope._mark is not None else []
        if dropped:
            report = log.debug if self._discard_reported else log.warning
            self._discard_reported = True
            report(
                "instrument: step %d raised; the %d value(s) staged in it (%s) are discarded, not carried to a "
                "later step. Later discards are logged at DEBUG level.",
                scope.step, len(dropped), ", ".join(sorted(dropped)[:5]),
            )

    def _detach_all(self, failed: bool = False) -> None:
        """Every part runs, whatever an earlier one raised (Ctrl-C in an observer's detach): hooks, probes left on
        or the process-wide recorder left installed would outlive the step and the session. The first
        exception is raised once everything is undone."""
        parts = [self._dispatch.finish]
        parts += [lambda watch=watch: watch.detach(report=not failed) for watch in self._watches]  # a step that
        parts.append(self._release_probes)  # raised may not have reached the module: no report then
        run_all(parts)

    def _release_probes(self) -> None:
        """Probes off and the recorder uninstalled (also from `close`: a step cut short may have left them)."""
        if self.__dict__.pop("_probes_turned_on", False):  # only probes this session turned on: a step refused
            run_all([probes.off for probes in self._probe_sets])  # because another session's is open leaves it on
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            self._dispatch.recorder = None
            record.uninstall(recorder)

    def _probes_on(self) -> None:
        if not self._probe_sets:
            return
        if self._recorder is None:
            self._recorder = record.Recorder(owner=self)  # what it says once, it says once per session
            record.install(self._recorder)
            self._dispatch.recorder = self._recorder
        self._recorder.clock = self._dispatch.clock  # the overhead meter on a measured logging step: records timed
        self._probes_turned_on = True  # before the first on(): one that raises half way is turned off again
        for probes in self._probe_sets:
            probes.on()


def run_all(parts: List[Callable[[], Any]]) -> None:
    """Call every part in order; the first exception any raised (Ctrl-C included) is raised after the last."""
    first: Optional[BaseException] = None
    for part in parts:
        try:
            part()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


def stop_monitor(monitor: Any, timeout: Optional[float]) -> Optional[float]:
    """Stop the session's system monitor within half of the close's ``timeout`` when its ``stop`` takes one (a
    `SystemMonitor`'s does): a hung sample neither holds the close longer nor leaves the logger's writer no time.
    Returns what is left of ``timeout``, for the logger."""
    started = time.monotonic()
    try:
        bounded = timeout is not None and "timeout" in inspect.signature(monitor.stop).parameters
    except (TypeError, ValueError):  # no signature to read
        bounded = False
    monitor.stop(timeout=timeout / 2) if bounded else monitor.stop()
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
