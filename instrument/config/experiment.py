"""What a ``.gin`` file binds to run an experiment: `run`, `backend_set` and the `TorchRLHook` factory.

Plain functions: `instrument.config.registry` makes them configurable (``run.experiment = @train_nca``,
``backend_set.tensorboard = @TensorBoardBackend()``), so they can also be called, and tested, without gin.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence

from instrument.backends.base import Backend
from instrument.errors import ConfigurationError
from instrument.session import Instrumentation

__all__ = ["run", "backend_set", "torchrl_hook", "BackendTypeError", "ExperimentTypeError", "MissingExperimentError"]


class BackendTypeError(ConfigurationError, TypeError):
    """`backend_set` got something that is not a `Backend` (still a TypeError, as it always was)."""


class MissingExperimentError(ConfigurationError, TypeError):
    """`run` has no experiment to run: the config binds no ``run.experiment``."""


class ExperimentTypeError(ConfigurationError, TypeError):
    """``run.experiment`` is not something to call: ``@train_nca()`` (already called) instead of ``@train_nca``."""


MISSING_EXPERIMENT = (
    "run has no experiment: the config binds no run.experiment. Bind the function that trains, e.g. "
    "run.experiment = @train_nca (with `import instrument.demos.nca` at the top of the file), or run a "
    "shipped config: instrument run nca."
)

_CLASSES = {"tensorboard": "TensorBoardBackend", "wandb": "WandbBackend", "console": "ConsoleBackend",
            "jsonl": "JsonlBackend", "mlflow": "MlflowBackend"}


def backend_set(
    tensorboard: Optional[Backend] = None,
    wandb: Optional[Backend] = None,
    console: Optional[Backend] = None,
    jsonl: Optional[Backend] = None,
    mlflow: Optional[Backend] = None,
    extra: Optional[Sequence[Backend]] = (),
) -> List[Backend]:
    """The backends bound one by one, so each shipped ``backends/<name>.gin`` adds its own by being included."""
    named = {"tensorboard": tensorboard, "wandb": wandb, "console": console, "jsonl": jsonl, "mlflow": mlflow}
    if isinstance(extra, (Backend, type, str)) or not hasattr(extra or (), "__iter__"):
        raise BackendTypeError(f"backend_set.extra got {extra!r}; expected a list of backend instances, e.g. "
                               f"[@JsonlBackend()] (note the brackets, the @ and the ()).")
    named.update((f"extra[{i}]", b) for i, b in enumerate(extra or ()))
    for param, b in named.items():  # the parameter first: the CLI finds where it was bound from the message
        if b is not None and not isinstance(b, Backend):
            raise BackendTypeError(
                f"backend_set.{param} got {type(b).__name__} ({b!r}); expected a backend instance such as "
                f"@{getattr(b, '__name__', None) or _CLASSES.get(param, 'JsonlBackend')}() (note the @ and the ())."
            )
    return [b for b in named.values() if b is not None]


def run(
    experiment: Optional[Callable[..., Any]] = None, instrumentation: Optional[Instrumentation] = None
) -> Dict[str, Any]:
    """Run ``experiment(instrumentation=...)`` and close the session afterwards.

    Returns the experiment's result, the run directory, the log root and the backends that were open (the CLI
    names a viewer for each). Without an experiment, or with one that is not callable, a started
    ``instrumentation`` is closed as a failed run before the error is raised. A KeyboardInterrupt (Ctrl-C)
    propagates once the run is closed ("killed"), carrying that dict as ``outcome`` (result None) and a note
    naming the run's folder.
    """
    if experiment is None or not callable(experiment):
        if instrumentation is not None:  # built for this run and started: it ends, as a failed run
            instrumentation.close("failed")
    if experiment is None:
        raise MissingExperimentError(MISSING_EXPERIMENT)
    if not callable(experiment):  # `parse_config` refuses `@train_nca()` first; this catches any other way
        shown = repr(experiment)
        raise ExperimentTypeError(
            f"run.experiment got {type(experiment).__name__} ({shown[:80] + '...' if len(shown) > 80 else shown}); "
            f"expected the function that trains, which run calls as experiment(instrumentation=...). Bind the "
            f"function itself, e.g. run.experiment = @train_nca (no parentheses: @train_nca() calls it first and "
            f"binds its result)."
        )
    inst = instrumentation if instrumentation is not None else Instrumentation()
    backends = list(inst.logger.backends)
    try:
        with inst:  # an exception ends the run "failed" ("killed" on Ctrl-C) in every backend, then propagates
            result = experiment(instrumentation=inst)
    except KeyboardInterrupt as exc:
        # What was committed before Ctrl-C is written and the run is closed: say where it is. ``exc.outcome``
        # is what this returns otherwise (result None), so the CLI names the folder and viewers as usual.
        exc.outcome = _outcome(None, inst, backends)
        if hasattr(exc, "add_note"):  # Python >= 3.11 (the CLI reads ``outcome`` on every version)
            exc.add_note(f"instrument: the steps committed before the interrupt are saved in {inst.run.dir}")
        raise
    return _outcome(result, inst, backends)


def _outcome(result: Any, inst: Instrumentation, backends: List[Backend]) -> Dict[str, Any]:
    backends = backends + [b for b in inst.logger.backends if not any(b is seen for seen in backends)]
    return {"result": result, "run_dir": str(inst.run.dir), "log_root": str(inst.run.root), "backends": backends}


def torchrl_hook(rl: Any = None, instrumentation: Any = None, close_on_shutdown: bool = True) -> Any:
    """`instrument.rl.torchrl.TorchRLHook`, built on demand so that registering it never imports TorchRL."""
    from instrument.rl.torchrl import TorchRLHook

    return TorchRLHook(rl, instrumentation=instrumentation, close_on_shutdown=close_on_shutdown)
