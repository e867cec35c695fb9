"""gin at the edge: every configurable instrument offers, registered in this one module.

Core modules never import gin; ``import instrument`` imports this module, so the public classes are
configurable as they are. This module registers them under their class names (``Instrumentation``,
``IterationStats``, ``TensorBoardBackend``, ...) so a ``.gin`` file can say::

    Instrumentation.observers = [@IterationStats(), @UpdateNorm()]
    Instrumentation.backends = @backend_set()
    Instrumentation.log_interval = 25
    backend_set.tensorboard = @TensorBoardBackend()     # one line per backend; gin/backends/*.gin hold them

and `parse` loads such files with helpful errors: a misspelt parameter or an unknown configurable fails before
training starts, with gin's message naming the file and line.
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gin

from instrument.backends.base import Backend
from instrument.backends.console import ConsoleBackend
from instrument.backends.history import RunHistoryBackend
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.backends.wandb import WandbBackend
from instrument.monitors.system import SystemMonitor
from instrument.observers.iteration_stats import IterationStats
from instrument.observers.update_norm import UpdateNorm
from instrument.rl import CollectionMetrics, Counters, Evaluation, ProgressBar, RLLogging, TrainMetrics
from instrument.session import Instrumentation
from instrument.terminal.runlog import setup_run_logging
from instrument.terminal.table import Column

__all__ = ["parse", "operative_config", "backend_set", "run", "GIN_DIR"]

GIN_DIR = Path(__file__).resolve().parent / "configs"

# Registered in place (not as gin's usual subclass copies), so `instrument.Instrumentation()` itself picks up
# the bindings of a parsed .gin file, as the README's loop shows.
for _cls in (Instrumentation, IterationStats, UpdateNorm, TensorBoardBackend, WandbBackend, ConsoleBackend,
             JsonlBackend, MlflowBackend, SystemMonitor):
    gin.configurable(_cls.__name__)(_cls)

# Console table columns (one scope per column: `loss/Column.key = ...`, then `@loss/Column()`; or plain
# dict/tuple literals in ConsoleBackend.columns) and run logs (`Instrumentation.run_log = @setup_run_logging`).
# Column is a gin-side copy, not registered in place: an unscoped `Column.fmt = ...` binding must not change
# the columns ConsoleBackend builds itself (step, summary).
gin.external_configurable(Column, name="Column")
gin.external_configurable(setup_run_logging, name="setup_run_logging")


# RL instrumentation (instrument.rl) and the in-memory run history.
for _cls in (RLLogging, CollectionMetrics, TrainMetrics, Counters, Evaluation, ProgressBar,
             RunHistoryBackend):
    gin.configurable(_cls.__name__)(_cls)


@gin.configurable("TorchRLHook")
def torchrl_hook(
    rl: Optional[RLLogging] = None, instrumentation: Any = None, close_on_shutdown: bool = True
):
    """`instrument.rl.torchrl.TorchRLHook`, built on demand so importing this module never imports TorchRL."""
    from instrument.rl.torchrl import TorchRLHook

    return TorchRLHook(rl, instrumentation=instrumentation, close_on_shutdown=close_on_shutdown)


@gin.configurable
def backend_set(
    tensorboard: Optional[Backend] = None,
    wandb: Optional[Backend] = None,
    console: Optional[Backend] = None,
    jsonl: Optional[Backend] = None,
    mlflow: Optional[Backend] = None,
    extra: Sequence[Backend] = (),
) -> List[Backend]:
    """The backends bound one by one, so each ``gin/backends/<name>.gin`` adds its own by being included."""
    chosen = [b for b in (tensorboard, wandb, console, jsonl, mlflow) if b is not None] + list(extra)
    for b in chosen:
        if not isinstance(b, Backend):
            raise TypeError(f"backend_set got {type(b).__name__}; bind a backend instance, e.g. @TensorBoardBackend().")
    return chosen


@gin.configurable
def run(experiment=gin.REQUIRED, instrumentation: Optional[Instrumentation] = None) -> Dict[str, Any]:
    """Run a gin-bound experiment: ``experiment(instrumentation=...)`` and close the session afterwards."""
    inst = instrumentation if instrumentation is not None else Instrumentation()
    try:
        result = experiment(instrumentation=inst)
    finally:
        inst.close()
    return {"result": result, "run_dir": str(inst.run.dir), "log_root": str(inst.run.root)}


def _register_demos() -> None:
    from instrument.demos.cartpole import train_cartpole
    from instrument.demos.nca import train_nca

    gin.external_configurable(train_nca, name="train_nca")
    gin.external_configurable(train_cartpole, name="train_cartpole")


_register_demos()


def _register_rl_demos() -> None:
    from instrument.demos.torchrl_ppo import build_ppo_trainer, train_torchrl_ppo  # TorchRL only when run

    gin.external_configurable(train_torchrl_ppo, name="train_torchrl_ppo")
    gin.external_configurable(build_ppo_trainer, name="build_ppo_trainer")


_register_rl_demos()


def parse(config_files: Sequence[str] = (), bindings: Sequence[str] = ()) -> None:
    """Parse ``.gin`` files and ``Name.param = value`` bindings; includes resolve beside each file and in gin/."""
    for path in config_files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"gin config {path!r} does not exist (looked from {Path.cwd()}).")
        gin.add_config_file_search_path(str(Path(path).resolve().parent))
    gin.add_config_file_search_path(str(GIN_DIR))
    quiet = _QuietIncludeProbes()
    logging.getLogger().addFilter(quiet)
    try:
        gin.parse_config_files_and_bindings(list(config_files), list(bindings), finalize_config=False)
    finally:
        logging.getLogger().removeFilter(quiet)


class _QuietIncludeProbes(logging.Filter):
    """Drops gin's "Path not found" errors while it tries each search path for an include.

    gin logs one at ERROR on the root logger for every search path that does not hold an included file, even
    when a later path does; a file that is really missing still raises, naming the file and line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and record.msg == "Path not found: %s")


def operative_config() -> Tuple[Dict[str, Any], Optional[str]]:
    """The operative gin config as (``{"Configurable.param": value}``, text) for logging as hyperparameters.

    Empty when nothing was bound: a run configured in plain Python logs only its own hyperparameters.
    """
    if not gin.config_str().strip():
        return {}, None
    text = gin.operative_config_str()
    params: Dict[str, Any] = {}
    parser = gin.config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True))
    for statement in parser:
        if isinstance(statement, gin.config_parser.BindingStatement):
            scope = f"{statement.scope}/" if statement.scope else ""
            value = statement.value
            params[f"{scope}{statement.selector}.{statement.arg_name}"] = (
                value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
            )
    return params, text
