"""instrument: zero-overhead-when-off instrumentation for PyTorch rollouts.

Data flows one way: probe -> observer -> logger -> backend.

    import instrument
    inst = instrument.Instrumentation(observers=[instrument.IterationStats(), instrument.UpdateNorm()])
    inst.watch(model.update_rule)                  # its forward is one rollout iteration
    for step in range(n_steps):
        with inst.step(step) as s:                 # observers run only on logging steps
            state = model(seed, n_iter)
            loss = ...; loss.backward(); opt.step()
            inst.logger.log_metrics({"loss": loss.detach()}, step=step, prefix="train")
    inst.close()

gin configuration lives in `instrument.config`, the one module that imports gin; importing the package imports it, so
the public classes are gin-configurable under their own names.
"""

from instrument import config  # noqa: F401  (registers the configurables with gin)
from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.backends.console import ConsoleBackend
from instrument.backends.history import RunHistoryBackend
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.backends.wandb import WandbBackend
from instrument.core.context import StepContext
from instrument.core.observer import Observer, StepObserver
from instrument.errors import (
    ConfigurationError,
    InstrumentError,
    MissingExtraError,
    ProbeError,
    StepOrderError,
)
from instrument.logger.logger import Logger
from instrument.logger.reduce import CrossRankReducer
from instrument.logger.timer import Timer
from instrument.monitors.system import SystemMonitor
from instrument.observers.iteration_stats import IterationStats
from instrument.observers.update_norm import UpdateNorm
from instrument.probes.probe import Probe
from instrument.probes.script import freeze, script
from instrument.session import Instrumentation, StepScope, WatchHandle
from instrument.terminal.runlog import RunLog, setup_run_logging
from instrument.terminal.table import Column, StepTable

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Column",
    "ConfigurationError",
    "ConsoleBackend",
    "CrossRankReducer",
    "InstrumentError",
    "Instrumentation",
    "IterationStats",
    "JsonlBackend",
    "Logger",
    "MissingExtraError",
    "MlflowBackend",
    "Observer",
    "Probe",
    "ProbeError",
    "RunHistoryBackend",
    "RunInfo",
    "RunLog",
    "StepContext",
    "StepObserver",
    "StepOrderError",
    "StepRecord",
    "StepScope",
    "StepTable",
    "SystemMonitor",
    "TensorBoardBackend",
    "Timer",
    "UpdateNorm",
    "WandbBackend",
    "WatchHandle",
    "__version__",
    "freeze",
    "script",
    "setup_run_logging",
]
