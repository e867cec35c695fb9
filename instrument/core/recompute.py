"""Noticing the forward replays that instrument cannot handle, and saying so once.

Recomputation that runs inside autograd's backward pass (every mode of ``torch.utils.checkpoint``, and any
implementation built on autograd Functions or saved-tensor hooks) is recognised by `in_recompute` and skipped.
What cannot be recognised is forward code re-run *outside* backward, e.g. a hand-written checkpoint that
replays a chunk before calling backward: to the hooks it looks like new iterations. Two symptoms of such
combinations are detectable without cost on non-logging steps and without keeping tensors alive:

- *replay*: a watched module receives, as its state argument, the very tensor object it already received
  earlier in the same logging step (a rollout passes each iteration a new tensor; a replay passes the saved
  chunk input again). Identity is checked through weak references, so no memory is retained and a freed
  tensor whose ``id`` is reused cannot match.
- *all skipped*: a logging step in which every call ran inside backward, so observers saw nothing (the
  forward ran outside ``inst.step``, or inside a backward hook or custom autograd Function).

Each is reported once per watched module (or once per session for explicit evolvers), through the
``instrument`` logger, naming the observers affected. See docs/checkpointing.md.
"""

import logging
import weakref
from typing import Callable, Dict, Sequence

import torch
from torch import Tensor

__all__ = ["RecomputeGuard", "in_recompute"]

log = logging.getLogger("instrument")


def in_recompute() -> bool:
    """True while autograd runs a backward pass: forward code seen then is checkpoint recomputation.

    Holds for reentrant and non-reentrant ``torch.utils.checkpoint`` alike (measured on torch 2.13; see
    docs/checkpointing.md); ``torch.is_grad_enabled()`` cannot tell the two apart.
    """
    return torch._C._current_graph_task_id() != -1


class RecomputeGuard:
    """Per-logging-step bookkeeping for one watched module (or one dispatcher).

    Lifecycle: ``begin()`` when the step starts -> ``skipped()`` for each call seen during recomputation and
    ``check_input(tensor, output)`` for each observed call -> ``end(observed)`` when the step ends.

    Args:
        where: how the messages name the source, e.g. ``"watched module UpdateRule"``.
        observer_names: returns the names of the observers fed from this source (called only to warn).
    """

    def __init__(self, where: str, observer_names: Callable[[], Sequence[str]]) -> None:
        self.where = where
        self.observer_names = observer_names
        self.recomputed = 0
        self.warned: Dict[str, bool] = {}
        self._inputs: Dict[int, weakref.ref[Tensor]] = {}
        self._index: Dict[int, int] = {}
        self._last_output: weakref.ref[Tensor] | None = None
        self._count = 0

    def begin(self) -> None:
        self.recomputed = 0
        self._inputs.clear()
        self._index.clear()
        self._last_output = None
        self._count = 0

    def skipped(self) -> None:
        self.recomputed += 1

    def check_input(self, tensor: Tensor, output: Tensor) -> None:
        """Remember ``tensor`` (weakly) as the input of an observed iteration; warn on a replay.

        A rule that returns its input unchanged hands the next iteration the same object: that continuation
        (input is the previous call's output) is not a replay.
        """
        key = id(tensor)
        ref = self._inputs.get(key)
        last = self._last_output() if self._last_output is not None else None
        try:
            self._last_output = weakref.ref(output)
        except TypeError:
            self._last_output = None
        if ref is not None and ref() is tensor and last is not tensor:
            self._warn_once(
                "replay",
                f"instrument: {self.where} was called again, outside autograd's backward pass, on the "
                f"same input tensor it received at iteration {self._index[key]} of this logging step. A "
                f"custom checkpoint or recompute that re-runs forward outside backward does this, and "
                f"instrument cannot tell such a replay from new iterations: observers {self._names()} see "
                f"these iterations again (extra step_index values, doubled statistics). "
                f"torch.utils.checkpoint.checkpoint (use_reentrant=True or False) is supported as is. If you "
                f"run the module twice on one tensor on purpose (two rollouts from one seed), the extra "
                f"iterations are real. Reported once; see docs/checkpointing.md.",
            )
        else:
            try:
                self._inputs[key] = weakref.ref(tensor)
            except TypeError:  # not weak-referenceable (a tensor subclass); skip the check
                return
            self._index[key] = self._count
        self._count += 1

    def end(self, observed: int) -> None:
        """Warn once if every call of this logging step was a recomputation."""
        if self.recomputed and not observed:
            self._warn_once(
                "all_skipped",
                f"instrument: every call of {self.where} in this logging step ({self.recomputed}) ran "
                f"inside autograd's backward pass, which instrument treats as checkpoint recomputation and "
                f"skips, so observers {self._names()} saw no iteration. Run the rollout's forward pass "
                f"inside `with inst.step(step):`; forward code that runs inside backward for another reason "
                f"(a backward hook, a custom autograd Function) cannot be observed. Reported once; see "
                f"docs/checkpointing.md.",
            )
        self._inputs.clear()
        self._index.clear()
        self._last_output = None

    def _names(self) -> str:
        names = list(self.observer_names())
        return ", ".join(names) if names else "(none)"

    def _warn_once(self, kind: str, message: str) -> None:
        if not self.warned.get(kind):
            self.warned[kind] = True
            log.warning(message)
