"""The RL component interface: batch-level metrics driven by the training iteration and the one session.

An RL component sees whole collected batches and loss dictionaries, not rollout iterations (that is what
`instrument.Observer` is for). Every RL part (collection, training, counters, timing, evaluation, the
progress bar) is one, and `RLLogging` calls each only through these methods::

    rl.attach(inst)                               # -> component.attach(logger); registered with the session
    for iteration in range(n):
        with rl.timer("collection"):
            batch = collect()                     # the user's collector / rollout
        rl.observe_batch(batch)                   # -> component.on_batch(batch, frames)
        with rl.timer("optimization"):
            losses = update(batch)
        rl.observe_losses(losses)                 # -> component.on_losses(losses)   (any number of times)
        rl.end_iteration()                        # -> component.end_iteration(counters): True asks for a log
                                                  # on a logging step (the session's cadence) or when asked:
                                                  # -> component.log(logger, step); one commit
    rl.close()                                    # -> component.close()

The session (`Instrumentation.add_component`) calls ``log`` right before its one commit per logging step,
under its one failure ledger; a component that raises is counted in ``inst.failures`` and skipped.

Rules a component follows:

- ``on_batch`` and ``on_losses`` keep results on the device and accumulate them over the logging interval;
  no ``.item()``: the logger moves everything to the host in one batched transfer at commit.
- ``log`` hands tensors to the logger under the component's key prefix and starts a new interval.
- ``end_iteration`` reads the counters only when it needs them (``counters.frames`` may cost a host sync).
- ``state_dict``/``load_state_dict`` hold what a resumed run needs to continue exactly (counters, schedules);
  they return plain Python values so any checkpoint format (torch.save, JSON, TorchRL's) can store them.
"""

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from instrument.core.step_components import same_keys, same_keys_message
from instrument.errors import ConfigurationError

if TYPE_CHECKING:
    from instrument.logger.logger import Logger
    from instrument.rl.counters import Counters

__all__ = ["RLComponent", "check_components", "load_together", "state_entry", "step_disagreement"]


class RLComponent:
    """Base class of the RL components; every hook defaults to doing nothing.

    Attributes:
        prefix: the key prefix this component logs under (e.g. ``collection/main``).
        exclusive_prefix: True for a class two of which at one prefix log the same keys (`CollectionMetrics`,
            `Counters`): a second one at a prefix is refused, its subclasses included (their values would be averaged
            into one series). Left False, components may share a prefix.
    """

    prefix: str = ""
    exclusive_prefix: bool = False

    def attach(self, logger: "Logger") -> None:
        """The set was attached: ``logger`` is where values will go (a component that adds a backend or
        starts timers does it here)."""

    def on_batch(self, batch: Any = None, frames: Optional[int] = None) -> None:
        """Look at one collected batch (TensorDict, mapping of tensors or `KeywordBatch`); ``frames``, when
        known, is its frame count including frame skip."""

    def on_losses(self, losses: Any) -> None:
        """Look at one dict / TensorDict of losses and training statistics."""

    def end_iteration(self, counters: "Counters") -> bool:
        """The iteration is over; ``counters`` hold the run's totals after it. Return True to have this
        iteration logged although it is not a logging step (an evaluation that is due does)."""
        return False

    def log(self, logger: "Logger", step: int) -> None:
        """Stage this interval's values with the logger and start a new interval."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def close(self) -> None:
        """Release resources at the end of the run."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self.prefix!r})"


def step_disagreement(step_unit: str, index: int, step: int, open_step: int) -> ConfigurationError:
    """The open ``inst.step(open_step)`` block and RLLogging's step of iteration ``index`` disagree."""
    if step_unit == "iterations":
        fix = (f"RLLogging counts iterations from 0 and this is iteration {index}"
               + (", so the loop looks 1-based: loop `for iteration in range(n)` (0-based), or"
                  if open_step == step + 1 else ";") + " open the block with `inst.step(rl.step)`.")
    else:
        fix = ("with step_unit='frames' the step is known only after the batch: drop the `with inst.step(...)` "
               "block; RLLogging commits through inst.commit_step (`inst.step(rl.step)` opened before the batch "
               "has the frame count before it).")
    return ConfigurationError(f"RLLogging logs iteration {index} at step {step} ({step_unit}) inside "
                              f"`with inst.step({open_step})`; the two must agree. {fix}")


def state_entry(state: Dict[str, Any], key: str, owner: str) -> Any:
    """``state[key]``, or a `ConfigurationError` naming the missing key and where such a state comes from."""
    if key not in state:
        raise ConfigurationError(
            f"{owner}.load_state_dict: the state lacks {key!r}; got keys {sorted(state)}. Load the dict "
            f"{owner}.state_dict() returned (saved with the checkpoint), not a part of it."
        )
    return state[key]


def load_together(parts: List[Tuple[Any, Any]], then: Optional[Callable[[], None]] = None) -> None:
    """``component.load_state_dict(state)`` for each ``(component, state)``, all or none: when one refuses its
    state, every part tried (the one that refused too: it may have assigned a field first) gets its own state
    back, and the error is raised. ``then``, when given, runs once all are loaded, as the last part: when it
    raises, every part gets its own state back too. The states put back are copies taken before any load
    (tensors cloned): a ``state_dict`` that returns live objects (``{"buf": self.buf}``, loaded with ``copy_``)
    would otherwise give back the new value."""
    befores = [_snapshot(component.state_dict()) for component, _ in parts]
    tried: List[Tuple[Any, Any]] = []
    try:
        for (component, state), before in zip(parts, befores, strict=True):
            tried.append((component, before))
            component.load_state_dict(state)
        if then is not None:
            then()
    except BaseException:
        for component, before in reversed(tried):
            component.load_state_dict(before)
        raise


def _snapshot(value: Any) -> Any:
    """A copy of a component's state that no later load can change: tensors cloned, containers copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):  # its own type (an OrderedDict stays one), every value copied
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = _snapshot(item)
        return copied
    if isinstance(value, Mapping):  # another mapping (a TensorDict): its own copy, so it keeps its type and API
        clone = getattr(value, "clone", None)
        for copied in (clone, lambda: copy.deepcopy(value)):
            if callable(copied):
                try:
                    return copied()
                except Exception:  # a clone or deepcopy that fails: the next way, then a plain dict
                    pass
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_snapshot(v) for v in value)
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied is given back as it is
        return value


def check_components(members: List[Tuple[str, Any, bool]]) -> None:
    """Check a set's ``(name, component, logs)`` members (`RLLogging.members`), else a `ConfigurationError`: each
    is an `RLComponent` instance; none is there twice (its methods would run twice per iteration); no two logging
    ones of one class share a key prefix (`same_keys`)."""
    prefixes: Dict[Tuple[type, str], Tuple[str, Any]] = {}
    for name, comp, logs in members:
        if not isinstance(comp, RLComponent):
            raise ConfigurationError(f"RLLogging.components must be RLComponent instances, got {type(comp).__name__}.")
        places = [n for n, other, _ in members if other is comp]
        if len(places) > 1:
            raise ConfigurationError(
                f"RLLogging lists one {type(comp).__name__} instance twice (as {places[0]!r} and {places[1]!r}), "
                f"so its methods would run twice per iteration; list it once."
            )
        prefix = same_keys(comp) if logs else None
        if prefix is None:
            continue
        first, other = prefixes.setdefault(prefix, (name, comp))
        if other is not comp:
            raise ConfigurationError(same_keys_message(f"RLLogging's components {first!r} and {name!r}", comp))

