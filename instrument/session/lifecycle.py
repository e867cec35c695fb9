"""The life of one logging step of `Instrumentation`: begin (mark the staged table, attach hooks, turn probes
on), end (detach, run the observers' log and the step components, commit once) and the failed step.

A step whose body raised keeps nothing it staged (`Logger.discard_staged`). Under a process group it still
commits, with what was staged before the step: every rank commits at every logging step, so that each commit's
collective pairs with the same step on every rank (a rank that skipped one would pair its later commits with
other ranks' later steps, mixing their values, and leave the others waiting at close).
"""

import logging
import time

from instrument.core.overhead import OverheadMeter, over_budget
from instrument.errors import ConfigurationError
from instrument.probes import record
from instrument.probes.embedded import check_probe_requests
from instrument.session.scope import StepScope

__all__ = ["StepLifecycle"]

log = logging.getLogger("instrument")


class StepLifecycle:
    """Mixin of `Instrumentation` (uses its logger, dispatcher, watches, probe sets and overhead meter)."""

    def _begin(self, scope: StepScope) -> None:
        if self._current is not None:
            raise ConfigurationError(
                f"inst.step({scope.step}) entered while step {self._current.step} is still open; steps do not nest."
            )
        check_probe_requests(self.observers, self.probe_names)
        meter = self._overhead
        if meter is not None:
            meter.enter(scope.step)
            self._dispatch.clock = meter
        scope._mark = self.logger.mark()
        self._current = scope
        try:  # whatever stops the start (Ctrl-C in an observer's reset or attach) ends it like a failed step
            self._dispatch.begin(self.watched_modules)
            self._probes_on()
            for watch in self._watches:
                watch.attach()
        except BaseException:
            self._detach_all(failed=True)
            self._current = None
            self._stop_clock(failed=True)
            self._commit_failed(scope.step)
            raise
        if meter is not None:
            meter.begun()

    def _end(self, scope: StepScope, failed: bool) -> None:
        meter = self._overhead
        if meter is not None:
            meter.ending()
        try:
            recorder = self._recorder
            self._detach_all(failed)
            if not failed:
                gradients = None
                if recorder is not None:
                    gradients = recorder.gradients_in_forward_order()
                    if recorder.recorded and not recorder.delivered:
                        log.warning(
                            "instrument: embedded probes recorded values in step %d but no observer call "
                            "delivered them; watch the module whose forward is one rollout iteration (called "
                            "from TorchScript code, it must be scripted with instrument.script), or call "
                            "s.observer(StepContext(...)) each iteration", scope.step,
                        )
                self._dispatch.end(self.logger, scope.step, gradients)
                if meter is not None:
                    self._report_overhead(meter, scope.step)
                self._components.log(self.logger, scope.step)
                started = time.perf_counter()
                handle = self.logger.commit(scope.step)
                if meter is not None:
                    meter.commit_seconds(time.perf_counter() - started)
                self._dispatch.committed(handle)
            else:
                self._discard(scope)
                self._commit_failed(scope.step)
        finally:
            self._current = None
            self._stop_clock(failed)

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
        """Log the overhead of the logging steps measured before this one; warn once over the budget."""
        for measured, scalars, warm in meter.ready():
            self.logger.log_metrics(scalars, step)
            message = over_budget(measured, scalars, self.overhead_budget, self.log_interval)
            if message and warm and not self._overhead_warned:
                self._overhead_warned = True
                log.warning("instrument: %s", message)

    def _discard(self, scope: StepScope) -> None:
        """The body of step ``scope.step`` raised: what it staged is dropped (said once per session)."""
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
        self._dispatch.finish()
        for watch in self._watches:
            watch.detach(report=not failed)  # a step that raised may not have reached the module
        if self.__dict__.pop("_probes_turned_on", False):  # only probes this session turned on: a step refused
            for probes in self._probe_sets:  # because another session's is open must leave that one's on
                probes.off()
        if self._recorder is not None:
            record.uninstall(self._recorder)
            self._recorder = None
            self._dispatch.recorder = None

    def _probes_on(self) -> None:
        if not self._probe_sets:
            return
        if self._recorder is None:
            self._recorder = record.Recorder()
            record.install(self._recorder)
            self._dispatch.recorder = self._recorder
        self._probes_turned_on = True  # before the first on(): one that raises half way is turned off again
        for probes in self._probe_sets:
            probes.on()

