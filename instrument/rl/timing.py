"""Stage timers for RL iterations, on top of the logger's own timers.

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

A plain loop uses ``with rl.timer("collection"): ...``. Trainer integrations start a stage in one hook and
stop
it in another, which is what `StageClock` adds: ``start(name)`` / ``stop(name)`` pairs around the logger's
`Timer` context managers (wall time on the CPU, CUDA events on a GPU, nothing read before commit).
"""

from typing import TYPE_CHECKING, Dict

if TYPE_CHECKING:
    from instrument.logger.logger import Logger
    from instrument.logger.timer import Timer

__all__ = ["StageClock", "STAGES"]

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
