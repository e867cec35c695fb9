"""Exceptions raised by instrument.

The hierarchy::

    InstrumentError                     base of everything instrument raises on purpose
    ├── ConfigurationError (ValueError) a bad argument, binding or combination, caught before training
    │   └── ProbeError                  a probe misuse: duplicate or unknown names, unsupported modes
    ├── StepOrderError (ValueError)     a step lower than one a backend already committed
    ├── InvalidValueError (ValueError, TypeError)  a logged value that can never be written (shape, type)
    ├── MissingExtraError (ImportError) an optional SDK is not installed (or fails to import); names the pip extra
    └── NonFiniteError (FloatingPointError)  NonFinite(raise_on_nonfinite=True) found a NaN/Inf

Failures inside observers and backends are not raised: they are reported once through the ``instrument``
logger and the run goes on. NonFiniteError is the one exception: the user asked for it to stop training.
"""

import sys
from typing import Any, Dict, Optional, Tuple

__all__ = ["InstrumentError", "ConfigurationError", "ProbeError", "StepOrderError", "InvalidValueError",
           "MissingExtraError", "NonFiniteError"]


class InstrumentError(Exception):
    """Base class of the errors instrument raises on purpose."""

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled as its class, message and attributes, so that it crosses processes (a multiprocessing
        ``Pool``'s result, ``concurrent.futures``): also an error whose ``__init__`` takes other arguments than
        the message (`MissingExtraError`, which the default ``cls(*args)`` could not build again: the pool's
        result thread died and ``pool.map`` waited forever), and one gin raised from inside a configurable
        (``Instrumentation(...)``, a backend) as a subclass made on the spot, which pickle cannot name: that one
        is pickled as the error it stands for, with gin's message (the parent saw only a ``PicklingError``)."""
        if _named(type(self)):
            return _rebuilt, (type(self), self.args, _state(self))
        named = next(c for c in type(self).__mro__ if _named(c))  # gin's proxy subclasses the error's own class
        # Its attributes are the error's: gin raises the proxy while handling it, so it is in the context chain
        # (looked for by its exact class, never another error handled around it; a chain may loop).
        original, seen = self.__context__, set()
        while original is not None and type(original) is not named and id(original) not in seen:
            seen.add(id(original))
            original = original.__context__
        state = _state(original) if type(original) is named else {}
        return _rebuilt, (named, (str(self),), {**state, **_state(self)})


class ConfigurationError(InstrumentError, ValueError):
    """A bad argument or combination, reported with what was received and what was expected."""


class ProbeError(ConfigurationError):
    """A probe is misused: duplicate names in one model, an unknown name, an unsupported mode."""


class StepOrderError(InstrumentError, ValueError):
    """A step lower than one already committed to a backend (W&B would silently drop it)."""


class InvalidValueError(InstrumentError, ValueError, TypeError):
    """A logged value that can never be written: wrong type, shape or dtype, a meta tensor, a bad timer name.

    Catchable as ValueError and as TypeError, which is what these checks raised before.
    """


class MissingExtraError(InstrumentError, ImportError):
    """An optional SDK is missing; the message says which ``pip install`` fixes it."""

    def __init__(self, package: str, extra: str, feature: str, broken: Optional[BaseException] = None) -> None:
        if broken is None:
            message = (f"{feature} needs the '{package}' package, which is not installed. "
                       f"Install it with: pip install 'torch-instrument[{extra}]'")
        else:  # installed, but its import failed: installing the extra again would change nothing
            message = (f"{feature} needs the '{package}' package, which is installed but failed to import: "
                       f"{type(broken).__name__}: {broken}. Fix that install: `pip check` names a missing or "
                       f"incompatible dependency; the versions the extra supports: pip install "
                       f"'torch-instrument[{extra}]'")
        super().__init__(message)
        self.package = package
        self.extra = extra
        self.name = package  # ImportError.name: what is missing, as Python's own ImportError names it


def require(package: str, extra: str, feature: str):
    """Import an optional SDK lazily, turning ImportError into a MissingExtraError: one that says the package is
    not installed when the import could not find it, and one that gives the import's own error when the package is
    there but something it imports is missing or broken (told by the name of the module that was not found)."""
    import importlib
    import importlib.util

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        missing = exc.name is not None and (package == exc.name or package.startswith(exc.name + "."))
        if missing:  # or a package that is there and names itself (``from pkg import gone`` in its __init__)
            try:
                missing = importlib.util.find_spec(exc.name) is None
            except (ImportError, ValueError):  # a parent that fails too, or a module set to None: not importable
                pass
        raise MissingExtraError(package, extra, feature, None if missing else exc) from exc


class NonFiniteError(InstrumentError, FloatingPointError):
    """`instrument.NonFinite` with ``raise_on_nonfinite=True`` found a NaN or Inf; raised at the step's commit.

    The message names the step, the rollout iteration, the channel(s) and where the value was seen. It is the
    one error an observer may raise into training (the dispatcher lets it through): the user asked to stop.
    """


def _named(cls: type) -> bool:
    """Whether pickle can find ``cls`` by its module and name."""
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _state(error: "InstrumentError") -> Dict[str, Any]:
    """The attributes an error's built-in base pickles (its ``__dict__``; ImportError's ``name`` and ``path``)."""
    reduced = super(InstrumentError, error).__reduce__()
    return dict(reduced[2]) if len(reduced) > 2 and reduced[2] else {}


def _rebuilt(cls: type, args: Tuple[Any, ...], state: Dict[str, Any]) -> BaseException:
    """An error of ``cls`` with ``args`` and ``state``, built without its own ``__init__`` (`InstrumentError`)."""
    builtins = [c for c in cls.__mro__ if c.__module__ == "builtins"]
    for base in builtins:  # the built-in base that lays the error out (OSError beside ValueError) makes it
        try:
            error = base.__new__(cls, *args)
        except TypeError:
            continue
        builtins[0].__init__(error, *args)  # as the error's own __init__ reached it (ImportError's ``msg``)
        for name, value in state.items():
            setattr(error, name, value)
        return error
    raise TypeError(f"cannot unpickle a {cls.__qualname__}: no built-in base of it can make one")
