"""The observer extension point.

An observer is a small diagnostic that watches a rollout on logging steps only. Its lifecycle, in terms of the
training loop that `Instrumentation` drives::

    for step in range(n_steps):
        with inst.step(step) as s:              # logging step?  -> for each observer: reset(); attach(modules)
            for i in range(n_iter):             # the user's rollout
                x = update_rule(x)              #   -> for each observer: observe(StepContext(..., step_index=i))
            loss.backward(); opt.step()         #   (never again during checkpoint recomputation)
        # leaving a logging step                -> for each observer: detach() (always, also if the step raised);
        #                                          then, if it did not raise: observe_gradients(...) if gradient
        #                                          probes recorded any; log(logger, step); logger.commit(step);
        #                                          then committed(record).
        #                                          If it raised: nothing is committed, and what the step staged
        #                                          (log_metrics, timers, media) is discarded (Logger.mark)
    inst.close()                                # -> for each observer: close()

On a non-logging step none of these methods is called and nothing is attached to any module.

Rules an observer follows:

- ``observe`` runs under ``torch.no_grad()`` and receives detached tensors; keep results on the device
  (no ``.item()``, ``.cpu()`` or ``float(tensor)`` in ``observe``: the logger moves everything to the
  host in one batched transfer at commit).
- ``log`` hands device tensors to the logger (``logger.log_metrics``, ``log_image``, ``log_heatmap``,
  ``log_histogram``); the logger prefixes nothing on its own, so use ``self.name`` as the key prefix.
- An exception raised by an observer is reported once and the observer is skipped for the rest of that step;
  training and the other observers carry on.
"""

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Protocol, Sequence, Tuple, runtime_checkable

from torch import Tensor, nn

from instrument.core.context import StepContext
from instrument.errors import ConfigurationError

if TYPE_CHECKING:
    from instrument.logger.logger import Logger

__all__ = ["Observer", "StepObserver", "check_observers", "distributed", "over_ranks"]


@runtime_checkable
class StepObserver(Protocol):
    """Anything an explicit evolver can call once per iteration: ``observer(context) -> None``."""

    def __call__(self, context: StepContext) -> None: ...


class _DefaultName:
    """``Observer.name`` before (or without) ``__init__``: the class's default name. A subclass whose __init__
    skips super().__init__() still has one (the prefix of its keys, the key of its failures). Only ``__get__``,
    so the name ``__init__`` sets on the instance wins, and nothing else about attribute lookup changes (an
    ``nn.Module`` mix-in's own ``__getattr__`` still finds its submodules)."""

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        return cls.default_name or _snake_case(cls.__name__)


class Observer:
    """Base class for diagnostics; override `observe` and `log`, and `reset` if you keep state (an observer that
    only reads the watched modules' parameters or gradients overrides `attach` and `log` alone).

    Attributes:
        name: the metric key prefix and the name used in error reports. Defaults to the class's
            ``default_name`` (snake_case of the class name for the built-ins).
        probes: names of embedded probes this observer reads from ``context.probes``; the session checks
            that each exists in a watched model.
        hook_seconds: seconds this logging step spent in hooks the observer registered itself (in `attach`),
            which run inside the user's forward where the session cannot time them. An observer with hooks of
            its own adds each call's time and sets it to 0 in `reset`; the session adds it to the observer's
            ``instrument/overhead/<name>`` and to the step's ``instrument/overhead/instrument`` after `detach`.
    """

    default_name: str = ""
    name: str = _DefaultName()  # type: ignore[assignment]  # set by __init__; the default until then
    probes: Tuple[str, ...] = ()
    hook_seconds: float = 0.0

    def __init__(self, name: str = "") -> None:
        self.name = name or self.default_name or _snake_case(type(self).__name__)


    def reset(self) -> None:
        """Forget everything from the previous logging step."""

    def attach(self, modules: Sequence[nn.Module]) -> None:
        """A logging step starts (after `reset`): ``modules`` are the ones watched with ``inst.watch``, in
        watch order. An observer that needs hooks or snapshots of its own takes them here, and only here, so
        non-logging steps stay untouched; whatever it registers it removes in `detach`."""

    def detach(self) -> None:
        """The logging step is over, also when it raised; called before `log`. Remove what `attach` added."""

    def observe(self, context: StepContext) -> None:
        """Look at one rollout iteration. Keep results on the device. Not overridden, it is never called: an
        observer that reads only parameters or gradients (in `log`, `observe_gradients`) needs none."""

    def observe_gradients(self, gradients: Mapping[str, Sequence[Tensor]]) -> None:
        """Gradients recorded by gradient probes (``Probe(name, grad=True)``) in this logging step.

        ``gradients[name][i]`` is the gradient of the value the probe recorded at iteration ``i``. Called once
        after the step's backward, before `log`, and only when some gradient was recorded.
        """

    def log(self, logger: "Logger", step: int) -> None:
        """Hand this step's results to the logger."""

    def committed(self, record: Any) -> None:
        """The logging step was committed; ``record`` is what ``logger.commit`` returned (a `CommittedStep`:
        its ``record`` attribute is the built `StepRecord` once the writer thread has converted it, None
        before; ``result()`` waits for it, which is a host sync), or None when nothing was staged. For work
        that needs the step's host values (a message, a decision); most observers need nothing here."""

    def close(self) -> None:
        """The session closed (every committed step's record is built). Release what the observer holds."""

    def __call__(self, context: StepContext) -> None:
        self.observe(context)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _snake_case(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and (not name[i - 1].isupper() or (i + 1 < len(name) and name[i + 1].islower())):
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def distributed(logger: Any) -> bool:
    """Whether ``logger`` reduces over a process group of more than one rank (each commit a collective)."""
    reducer = getattr(logger, "reducer", None)
    return reducer is not None and reducer.active()


def over_ranks(logger: Any, ops: Mapping[str, str]) -> Any:
    """The ``reduce=`` of an observer's ``log_metrics``: ``ops`` (key -> ``"min"``, ``"max"``...) when
    ``logger`` reduces over a process group of more than one rank, else ``"mean"``. On one process the op
    changes nothing, and a plain call takes the logger's fastest staging path (one block per call)."""
    return ops if distributed(logger) else "mean"


def check_observers(observers: Any) -> List[Any]:
    """``observers`` as a list, or a `ConfigurationError` unless it holds observer instances or callables taking a
    `StepContext` (a single observer, or a class where an instance goes, is named with the fix). One instance
    listed twice would see every iteration twice; two `Observer`s of one name would write one key each and
    their values would be averaged into one series, a number of neither: both are refused. So is a name that ends
    with ``/``: ``log_metrics`` strips it from a prefix (``stats/`` writes ``stats/...``, the keys of an observer
    named ``stats``) while its media keep it (``stats//mean``), so names are compared as the logger writes them."""
    if isinstance(observers, (Observer, type, str, bytes, Mapping)) or not hasattr(observers, "__iter__"):
        raise ConfigurationError(
            f"observers must be a list of instrument.Observer instances, got {observers!r} "
            f"({type(observers).__name__}); e.g. observers=[IterationStats()] (in gin: [@IterationStats()])."
        )
    observers = list(observers)  # once: a generator would be used up by these checks
    names: Dict[str, Any] = {}
    for obs in observers:
        if isinstance(obs, type):
            raise ConfigurationError(
                f"observers must hold instances, got the class {obs.__name__}; call it: {obs.__name__}() "
                f"(in gin: @{obs.__name__}(), note the ())."
            )
        if not callable(obs) and not hasattr(obs, "observe"):
            raise ConfigurationError(
                f"observers must be instrument.Observer instances or callables taking a StepContext, "
                f"got {type(obs).__name__}."
            )
        if sum(other is obs for other in observers) > 1:
            raise ConfigurationError(
                f"observers lists one {type(obs).__name__} instance twice, which would see every iteration twice; "
                f"list it once (two of a kind need two instances with different names)."
            )
        if isinstance(obs, Observer):
            if isinstance(obs.name, str) and obs.name.endswith("/"):
                fixed = obs.name.rstrip("/")
                raise ConfigurationError(
                    f"{type(obs).__name__} is named {obs.name!r}, which ends with '/': log_metrics strips it from "
                    f"the prefix (its scalars go to {fixed + '/...'!r}, the keys of an observer named {fixed!r}) but "
                    f"its media tags keep it (e.g. {obs.name + '/mean'!r}). Name it without the trailing '/'"
                    + (f", e.g. {type(obs).__name__}(name={fixed!r})." if fixed else ".")
                )
            other = names.setdefault(obs.name, obs)
            if other is not obs:
                raise ConfigurationError(
                    f"two observers are named {obs.name!r} ({type(other).__name__} and {type(obs).__name__}): each "
                    f"logs its keys under its name, so their values would be averaged into one series that belongs "
                    f"to neither. Name one of them, e.g. {type(obs).__name__}(name='{obs.name}_2') (in gin, with a "
                    f"scope: second/{type(obs).__name__}.name = '{obs.name}_2' and @second/{type(obs).__name__}())."
                )
    return observers
