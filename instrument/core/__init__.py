"""The core of the pipeline, underneath everything else: what an observer sees of one iteration
(`StepContext`), the observer extension point (`Observer`), the fan-out to observers (`Dispatcher`),
checkpoint-recomputation detection and the one failure ledger. Imports nothing above it."""

from instrument.core.context import StepContext
from instrument.core.dispatch import Dispatcher
from instrument.core.failures import FailureLedger
from instrument.core.observer import Observer, StepObserver
from instrument.core.recompute import RecomputeGuard, in_recompute

__all__ = ["Dispatcher", "FailureLedger", "Observer", "RecomputeGuard", "StepContext", "StepObserver", "in_recompute"]
