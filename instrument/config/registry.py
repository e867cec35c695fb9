"""The gin registrations of instrument's own classes, and nothing else (plus the hook that hands the session
gin's operative config).

Every name is registered under the ``instrument`` module, so a ``.gin`` file may write it qualified
(``instrument.Instrumentation.log_interval = 25``) or, while unambiguous, short::

    Instrumentation.observers = [@IterationStats(), @UpdateNorm()]
    Instrumentation.backends = @backend_set()
    backend_set.tensorboard = @TensorBoardBackend()     # one line per backend; configs/backends/*.gin hold them

The classes are registered in place (not as gin's usual subclass copies), so ``instrument.Instrumentation()``
itself picks up the bindings of a parsed file. The RL classes register when `instrument.config.rl` is imported
(a config binding them starts with ``import instrument.config.rl``), or at `parse_config` once the user's code
has imported `instrument.rl`; so ``import instrument`` does not import the RL package, and `instrument.rl` never
imports gin. The demos register their own functions.
"""

import sys

import gin

from instrument import session
from instrument.backends.console import ConsoleBackend
from instrument.backends.history import RunHistoryBackend
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.progress import ProgressBar
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.backends.wandb import WandbBackend
from instrument.config import experiment
from instrument.config.parse import BEFORE_PARSE, MODULE, operative_config
from instrument.config.secrets import config_secrets
from instrument.logger.params import set_secret_source
from instrument.monitors.system import SystemMonitor
from instrument.observers.activation_stats import ActivationStats
from instrument.observers.gradient_stats import GradientStats
from instrument.observers.iteration_stats import IterationStats
from instrument.observers.nonfinite import NonFinite
from instrument.observers.rollout_video import RolloutVideo
from instrument.observers.state_histogram import StateHistogram
from instrument.observers.update_norm import UpdateNorm
from instrument.session import Instrumentation
from instrument.terminal.runlog import setup_run_logging
from instrument.terminal.table import Column

__all__ = ["MODULE", "RL_CLASSES", "backend_set", "register_rl", "run", "torchrl_hook"]

RL_CLASSES = ("RLLogging", "CollectionMetrics", "TrainMetrics", "Counters", "Evaluation")

for _cls in (Instrumentation, IterationStats, UpdateNorm, RolloutVideo, GradientStats, NonFinite,
             TensorBoardBackend, WandbBackend,
             ConsoleBackend, JsonlBackend, MlflowBackend, RunHistoryBackend, ProgressBar, SystemMonitor):
    gin.configurable(_cls.__name__, module=MODULE)(_cls)
for _cls in (ActivationStats, StateHistogram):
    gin.configurable(_cls.__name__, module=MODULE)(_cls)

# Console table columns (one scope per column: `loss/Column.key = ...`, then `@loss/Column()`; or plain
# dict/tuple literals in ConsoleBackend.columns) and run logs (`Instrumentation.run_log = @setup_run_logging`).
# Column is a gin-side copy, not registered in place: an unscoped `Column.fmt = ...` binding must not change
# the columns ConsoleBackend builds itself (step, summary).
gin.external_configurable(Column, name="Column", module=MODULE)
gin.external_configurable(setup_run_logging, name="setup_run_logging", module=MODULE)

# What a config binds to run an experiment; these names are the configurable versions of the plain functions.
backend_set = gin.configurable("backend_set", module=MODULE)(experiment.backend_set)
run = gin.configurable("run", module=MODULE)(experiment.run)
torchrl_hook = gin.configurable("TorchRLHook", module=MODULE)(experiment.torchrl_hook)

# The session logs the operative config at its first step through this hook (it never imports gin itself).
session.set_config_source(operative_config)
# ...and redacts the command line it records (W&B) with the config's secrets, a secret macro's value included.
set_secret_source(config_secrets)


def register_rl() -> None:
    """Make `instrument.rl`'s classes bindable (``RLLogging.evaluation = @Evaluation()``), in place, once.

    Called by `instrument.config.rl` (a ``.gin`` file's ``import instrument.config.rl`` line) and by
    `parse_config` when the user's code has already imported `instrument.rl`.
    """
    import instrument.rl as rl
    for name in RL_CLASSES:
        if name not in _rl_registered:
            gin.configurable(name, module=MODULE)(getattr(rl, name))
            _rl_registered.add(name)


_rl_registered: set = set()


def _register_rl_if_imported() -> None:
    """A user's code imported `instrument.rl` and now parses a config that binds its classes."""
    if "instrument.rl" in sys.modules:
        register_rl()


BEFORE_PARSE.append(_register_rl_if_imported)
