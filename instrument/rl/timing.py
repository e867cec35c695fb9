"""Stage timing for RL iterations: the `StageTiming` component and its `StageClock`.

Keys (under ``timing/<stage>/``, each with ``mean``, ``min``, ``max`` in seconds and ``count``, over the
intervals measured since the previous commit; see `instrument.Logger.timer`):

=================  =======================================================================================
stage              what it measures
=================  =======================================================================================
``collection``     waiting for the collector / running the rollout that produced the batch
``optimization``   the updates on that batch
``evaluation``     evaluation episodes (only on iterations where evaluation runs)
``iteration``      one whole iteration up to logging: collection + optimisation + the loop's own code
=================  =======================================================================================

Not to be confused with `instrument.logger.timer`, which measures one interval (wall time on the CPU, CUDA
events on a GPU, nothing read before commit) and stages it with the logger. This module only decides *which*
intervals an RL iteration has and where they start and stop: a plain loop uses ``with rl.timer("collection"):
...``; trainer integrations start a stage in one hook and stop it in another, which is what `StageClock`'s
``start(name)`` / ``stop(name)`` pairs around the logger's timers add.
"""

from typing import TYPE_CHECKING, Dict, Optional

from instrument.errors import ConfigurationError
from instrument.rl.component import RLComponent

if TYPE_CHECKING:
    from instrument.logger.logger import Logger
    from instrument.logger.timer import Timer

__all__ = ["StageClock", "StageTiming", "STAGES"]

STAGES = ("collection", "optimization", "evaluation", "iteration")


class StageClock:
    """Starts and stops named logger timers from different call sites.

    Stopping a stage that is not running does nothing (a trainer may skip optimisation on an iteration);
    starting one that is already running restarts it.
    """

    def __init__(self, logger: "Logger") -> None:
        self.logger = logger
        self._running: Dict[str, Timer] = {}

    def start(self, name: str) -> None:
        self._running.pop(name, None)
        timer = self.logger.timer(name)
        timer.__enter__()
        self._running[name] = timer

    def stop(self, name: str) -> None:
        timer = self._running.pop(name, None)
        if timer is not None:
            timer.__exit__(None, None, None)

    def running(self, name: str) -> bool:
        return name in self._running

    def cancel_all(self) -> None:
        """Forget every running stage without recording it (a run that ends mid-stage)."""
        self._running.clear()


class StageTiming(RLComponent):
    """The timing component of `RLLogging`: owns the `StageClock` of the attached logger.

    It stages nothing itself (the logger stages its timers at every commit, under ``timing/``); it makes the
    clock when the set is attached and, at close, drops the stages still running, so a run that ends
    mid-stage records no half-measured interval.
    """

    prefix = "timing"

    def __init__(self) -> None:
        self._clock: Optional[StageClock] = None

    def attach(self, logger: "Logger") -> None:
        self._clock = StageClock(logger)

    @property
    def clock(self) -> StageClock:
        if self._clock is None:
            raise ConfigurationError("RLLogging is not attached; call rl.attach(instrumentation) first.")
        return self._clock

    def close(self) -> None:
        if self._clock is not None:
            self._clock.cancel_all()
