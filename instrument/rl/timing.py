"""Stage timing for RL iterations: the `StageTiming` component and its `StageClock`.

Keys (under ``timing/<stage>/``, each with ``mean``, ``min``, ``max`` in seconds and ``count``, over the
intervals measured since the previous commit; see `instrument.Logger.timer`):

=================  ===========  ==========================================================================
stage              clock        what it measures
=================  ===========  ==========================================================================
``collection``     wall time    waiting for the collector / running the rollout that produced the batch
``optimization``   GPU events   the updates on that batch (wall time on a run that never initialised CUDA)
``evaluation``     wall time    evaluation episodes (only on iterations where evaluation runs)
``iteration``      wall time    the ``rl.iteration()`` block's body: collection + optimisation + the loop's
                                own code; not the logging at its end (evaluation, components, commit)
=================  ===========  ==========================================================================

Not to be confused with `instrument.logger.timer`, which measures one interval (wall time on the CPU, CUDA
events on a GPU, nothing read before commit) and stages it with the logger. This module only decides *which*
intervals an RL iteration has, where they start and stop, and which clock times each: a plain loop uses ``with
rl.timer("collection"): ...``; trainer integrations start a stage in one hook and stop it in another, which is
what `StageClock`'s ``start(name)`` / ``stop(name)`` pairs around the logger's timers add.

The clocks: a logger timer left at its default (``cuda=None``) records CUDA events on the current stream once the
process has initialised CUDA, and events time the GPU's queue, not the host. Environment steps and evaluation
episodes run on the host (the policy's actions are read back at every step), so events would time them as the
GPU catching up with work queued before, or as nothing; and an iteration is the loop's wall time (its block's
body: the evaluation and the logging that end it, and code outside the block, are not in it, so its sum over a
run is less than the run's time). These `HOST_STAGES` are timed with ``time.perf_counter``
(``cuda=False``) on every device. ``optimization`` is GPU work: it stays on the logger's default, CUDA events of
the updates queued on the stream on a GPU. The host stages' timers are made with their clock when the set is
attached, so ``rl.timer(stage)``, `StageClock` and ``logger.timer(stage)`` all return the same wall-time timer.
"""

from threading import get_ident
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from instrument.errors import ConfigurationError
from instrument.rl.component import RLComponent

if TYPE_CHECKING:
    from instrument.logger.logger import Logger
    from instrument.logger.timer import Timer

__all__ = ["HOST_STAGES", "StageClock", "StageTiming", "STAGES", "stage_timer"]

STAGES = ("collection", "optimization", "evaluation", "iteration")
HOST_STAGES = ("collection", "evaluation", "iteration")  # wall time on every device (module docstring)


def stage_timer(logger: "Logger", name: str) -> "Timer":
    """The logger's timer of stage ``name``: wall time (``cuda=False``) for the `HOST_STAGES`, the logger's
    default (CUDA events once CUDA is initialised) for any other."""
    return logger.timer(name, cuda=False if name in HOST_STAGES else None)


class StageClock:
    """Starts and stops named logger timers from different call sites.

    Stopping a stage that is not running does nothing (a trainer may skip optimisation on an iteration);
    starting one that is already running restarts it: the span begun first is cancelled (`Timer.cancel`), not
    measured. A stage is started and stopped on one thread; `cancel_all` cancels the stages begun on its own
    thread and forgets the others (a timer's open spans belong to the thread that entered it).
    """

    def __init__(self, logger: "Logger") -> None:
        self.logger = logger
        self._running: Dict[str, Tuple[Timer, int]] = {}  # name: (timer, the thread that started it)

    def start(self, name: str) -> None:
        self._cancel(name)
        timer = stage_timer(self.logger, name)
        timer.__enter__()
        self._running[name] = (timer, get_ident())

    def stop(self, name: str) -> None:
        running = self._running.pop(name, None)
        if running is not None:
            running[0].__exit__(None, None, None)

    def running(self, name: str) -> bool:
        return name in self._running

    def cancel_all(self) -> None:
        """Forget every running stage without recording it (a run that ends mid-stage, a failed iteration)."""
        for name in list(self._running):
            self._cancel(name)

    def _cancel(self, name: str) -> None:
        running = self._running.pop(name, None)
        if running is not None and running[1] == get_ident():  # another thread's open span is out of reach
            running[0].cancel()


class StageTiming(RLComponent):
    """The timing component of `RLLogging`: owns the `StageClock` of the attached logger.

    It stages nothing itself (the logger stages its timers at every commit, under ``timing/``); it makes the
    clock and the host stages' timers (wall time, `HOST_STAGES`) when the set is attached and, at close, drops the
    stages still running, so a run that ends mid-stage records no half-measured interval.
    """

    prefix = "timing"

    def __init__(self) -> None:
        self._clock: Optional[StageClock] = None

    def attach(self, logger: "Logger") -> None:
        self._clock = StageClock(logger)
        for name in HOST_STAGES:  # made with their clock now: ``rl.timer(name)`` (cuda=None) keeps it
            stage_timer(logger, name)

    @property
    def clock(self) -> StageClock:
        if self._clock is None:
            raise ConfigurationError("RLLogging is not attached; call rl.attach(instrumentation) first.")
        return self._clock

    def close(self) -> None:
        if self._clock is not None:
            self._clock.cancel_all()
