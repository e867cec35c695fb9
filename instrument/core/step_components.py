"""Step components: work the session runs at the end of every logging step, right before its one commit.

An observer sees the rollout iterations inside a step; a *component* sees the step as a whole. It has
accumulated values of its own (batch statistics, losses, counters, an evaluation that is due) and stages them
when the step is logged::

    component.log(logger, step)     # at the end of every logging step, before logger.commit(step)
    component.close()               # once, when the session closes (or the component is removed)

Any object with those two methods is a component; the RL metrics (`instrument.rl.RLComponent`) are the ones
the library ships. `Instrumentation.add_component` registers one and returns a `ComponentHandle`: the handle
also calls the component's other methods under the same failure guard, so whoever feeds it data (e.g.
`RLLogging` with collected batches) shares the session's one ledger.

A component that raises is recorded in the `FailureLedger` (reported once, then counted; the counts are in
``Instrumentation.failures``) and skipped; the other components and the commit still happen. A
`ConfigurationError` propagates: it needs fixing, not skipping. The exception are the methods that take data
(`DATA_METHODS`: ``on_batch``, ``on_losses``): once one of them has returned normally for a component, a
`ConfigurationError` from it is a fault of the data like any other (a batch that lacks a key the earlier ones
had), recorded and skipped, so it never ends a run that was set up right.
"""

import contextlib
from typing import Any, Dict, List, Optional, Set, Tuple

from instrument.core.failures import FailureLedger
from instrument.errors import ConfigurationError

__all__ = ["ComponentHandle", "StepComponents", "DATA_METHODS"]

DATA_METHODS = ("on_batch", "on_losses")  # methods fed with data, see the module docstring
_UNLOCKED = contextlib.nullcontext()  # a handle's lock when no owner set one


class ComponentHandle:
    """One registered component. ``call(method, ...)`` runs one of its methods under the failure guard;
    ``remove()`` unregisters it (idempotent), also as a context manager.

    Attributes:
        name: the component's name in the failure counts.
        component: the registered object.
        logs: whether the session calls its ``log`` at the end of logging steps.
        lock: a lock (a re-entrant one) every call through the handle holds, ``log`` at a step's end and
            ``close`` included: set by an owner that feeds the component from several threads
            (`instrument.rl.RLLogging`); by default a no-op context.
    """

    def __init__(self, registry: "StepComponents", component: Any, name: str, logs: bool) -> None:
        self._registry = registry
        self.component = component
        self.name = name
        self.logs = logs
        self.worked: Set[str] = set()  # data methods (`DATA_METHODS`) that have returned at least once
        self.lock: Any = _UNLOCKED

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``component.<method>(*args, **kwargs)``; its result, or None when it raised (recorded, skipped)."""
        return self._registry.guarded(self, method, *args, **kwargs)

    def remove(self) -> None:
        if self in self._registry._handles:
            self._registry._handles.remove(self)

    def __enter__(self) -> "ComponentHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ComponentHandle({self.name!r}, {self.component!r})"


def same_keys(component: Any) -> Optional[Tuple[type, str]]:
    """``(class, prefix)`` of a component whose class says that two of it at one prefix log the same keys (a class
    attribute ``exclusive_prefix = True``: `CollectionMetrics`, `Counters`), so their values would be averaged into
    one series that belongs to neither (rewards 1.0 and 100.0 of two environments read 50.5, and so did their min
    and max); else None. The class is the base-most one that declares it, so a subclass compares equal to its
    base. The prefix is compared as ``log_metrics`` writes it (a trailing ``/`` stripped). Other components may share
    a prefix: which of their keys clash depends on what each logs (two ``TrainMetrics`` of one group with disjoint
    ``include``)."""
    prefix = getattr(component, "prefix", None)
    if not getattr(component, "exclusive_prefix", False) or not isinstance(prefix, str) or not prefix.rstrip("/"):
        return None
    declared = [c for c in type(component).__mro__ if vars(c).get("exclusive_prefix") is True]  # the base-most one
    return (declared[-1] if declared else type(component)), prefix.rstrip("/")


def same_keys_message(which: str, component: Any) -> str:
    kind, group = type(component).__name__, getattr(component, "group", None)
    fix = (f"give each its own group=, e.g. {kind}(group='{group}_2')" if isinstance(group, str)
           else f"register one {kind}")
    return (f"{which} are two {kind} logging under the prefix {component.prefix.rstrip('/')!r}: they log the same "
            f"keys, so their values would be averaged into one series that belongs to neither; {fix}.")


class StepComponents:
    """The ordered set of components of one session, and their failure ledger.

    Args:
        kind: what the components are, in failure messages (``"component"``, ``"RL component"``).
    """

    def __init__(self, kind: str = "component") -> None:
        self.ledger = FailureLedger(kind, "it is skipped, the others carry on")
        self._handles: List[ComponentHandle] = []

    def add(self, component: Any, name: Optional[str] = None, logs: bool = True) -> ComponentHandle:
        """Register ``component`` under ``name`` (default: its class name); its ``log`` runs at the end of
        every logging step when ``logs`` is True. Names are unique: they key the failure counts."""
        if logs and not callable(getattr(component, "log", None)):
            raise ConfigurationError(
                f"a step component needs a log(logger, step) method; {type(component).__name__} has none."
            )
        name = name or type(component).__name__
        if any(h.component is component for h in self._handles):  # its log would run twice in every step
            raise ConfigurationError(
                f"this {type(component).__name__} instance is already registered with this session; its log would "
                f"run twice at every logging step. Register it once (two of a kind need two instances)."
            )
        keys = same_keys(component) if logs else None
        twin = next((h for h in self._handles if h.logs and keys is not None and same_keys(h.component) == keys), None)
        if twin is not None:  # `RLLogging` checks its set first, naming its members; this covers add_component too
            raise ConfigurationError(same_keys_message(f"the components {twin.name!r} and {name!r}", component))
        if any(h.name == name for h in self._handles):
            raise ConfigurationError(
                f"a component named {name!r} is already registered with this session; pass another name."
            )
        handle = ComponentHandle(self, component, name, logs)
        self._handles.append(handle)
        return handle

    @property
    def handles(self) -> List[ComponentHandle]:
        return list(self._handles)

    def guarded(self, handle: ComponentHandle, method: str, *args: Any, **kwargs: Any) -> Any:
        """``handle.component.<method>(...)`` under the guard and the handle's lock; a data method that has
        worked for this handle turns a `ConfigurationError` into a fault (see the module docstring)."""
        with handle.lock:
            try:
                result = getattr(handle.component, method)(*args, **kwargs)
            except ConfigurationError as exc:
                if method not in handle.worked:
                    raise
                self.ledger.record(handle.name, method, exc)
                return None
            except Exception as exc:
                self.ledger.record(handle.name, method, exc)
                return None
        if method in DATA_METHODS:
            handle.worked.add(method)
        return result

    def log(self, logger: Any, step: int, clock: Any = None) -> None:
        """Every logging component stages its values at ``step``, in registration order. The handles' locks are
        held across the whole pass, so a feeding thread's batch lands wholly before or after it (a set's
        counters and statistics in one record agree). ``clock``: the session's overhead meter on a measured
        logging step (`instrument.core.overhead.OverheadMeter`), which times each component's ``log`` by name."""
        handles = list(self._handles)
        with contextlib.ExitStack() as held:
            for lock in {id(h.lock): h.lock for h in handles if h.logs}.values():
                held.enter_context(lock)
            for handle in handles:
                if handle.logs:
                    start = clock.mark() if clock is not None else None
                    handle.call("log", logger, step)
                    if clock is not None:
                        clock.component(handle.name, start)

    def close(self) -> None:
        """Close every component (each under the guard and its handle's lock, so one failing close costs the
        others nothing) and unregister them all."""
        handles, self._handles = self._handles, []
        for handle in handles:
            if callable(getattr(handle.component, "close", None)):  # closing never raises, whatever failed
                with handle.lock:
                    self.ledger.call(handle.name, "close", handle.component.close)

    @property
    def failures(self) -> Dict[str, int]:
        """Component name -> number of calls that raised."""
        return self.ledger.counts()

    def __len__(self) -> int:
        return len(self._handles)
