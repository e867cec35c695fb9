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

gin configuration lives at the edge, in `instrument.config`: importing the package registers the public classes
under their own names (``Instrumentation.log_interval``, or ``instrument.Instrumentation.log_interval``), and
`parse_config` parses ``.gin`` files or shipped configs by name (``instrument list``) with errors naming the file
and line. Importing the package imports neither the demos, nor `instrument.rl`, nor any optional SDK.
"""

from instrument.torch_floor import check_torch as _check_torch

# First: on a torch older than the floor, the imports below (or the first logging step) fail with torch's own
# messages, or compiled probes record nothing; this says which torch is needed instead.
_check_torch()

from instrument import config  # noqa: F401  (registers the configurables with gin)
from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.backends.console import ConsoleBackend
from instrument.backends.history import RunHistoryBackend
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.backends.wandb import WandbBackend
from instrument.config.parse import parse_config
from instrument.core.context import StepContext
from instrument.core.observer import Observer, StepObserver
from instrument.errors import (
    ConfigurationError,
    InstrumentError,
    InvalidValueError,
    MissingExtraError,
    NonFiniteError,
    ProbeError,
    StepOrderError,
)
from instrument.logger.logger import Logger
from instrument.logger.reduce import CrossRankReducer
from instrument.logger.timer import Timer
from instrument.monitors.system import SystemMonitor
from instrument.observers.activation_stats import ActivationStats
from instrument.observers.gradient_stats import GradientStats
from instrument.observers.iteration_stats import IterationStats
from instrument.observers.nonfinite import NonFinite
from instrument.observers.rollout_video import RolloutVideo
from instrument.observers.state_histogram import StateHistogram
from instrument.observers.update_norm import UpdateNorm
from instrument.probes.probe import Probe
from instrument.probes.script import freeze, script
from instrument.session import Instrumentation, StepScope, WatchHandle
from instrument.terminal.runlog import RunLog, setup_run_logging
from instrument.terminal.table import Column, StepTable

__version__ = "0.1.0"

__all__ = [
    "ActivationStats",
    "Backend",
    "Column",
    "ConfigurationError",
    "ConsoleBackend",
    "CrossRankReducer",
    "GradientStats",
    "InstrumentError",
    "Instrumentation",
    "InvalidValueError",
    "IterationStats",
    "JsonlBackend",
    "Logger",
    "MissingExtraError",
    "MlflowBackend",
    "NonFinite",
    "NonFiniteError",
    "Observer",
    "Probe",
    "ProbeError",
    "RolloutVideo",
    "RunHistoryBackend",
    "RunInfo",
    "RunLog",
    "StateHistogram",
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
    "parse_config",
    "script",
    "setup_run_logging",
]
