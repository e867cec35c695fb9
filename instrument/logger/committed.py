"""What `Logger.commit` returns: a handle on a step that the writer thread builds later."""

from typing import Any, Optional

from instrument.backends.base import StepRecord

__all__ = ["CommittedStep"]


class CommittedStep:
    """What `Logger.commit` returns: the step at once, the `StepRecord` once the writer has built it.

    Reading a `StepRecord` attribute (``scalars``, ``images``, ...) waits until the writer thread has
    converted this step (not until the backends wrote it; use `Logger.flush` for that; it is built once the
    records before it are written, so a slow backend's earlier writes delay it). ``result(timeout)``
    does the same explicitly and returns None if the step was dropped (``on_full="drop"``) or not built in time.
    """

    __slots__ = ("step", "seq", "record", "dropped", "_writer")

    def __init__(self, step: int, writer: Any) -> None:
        self.step = step
        self.seq = 0
        self.record: Optional[StepRecord] = None
        self.dropped = False
        self._writer = writer

    def result(self, timeout: Optional[float] = None) -> Optional[StepRecord]:
        self._writer.wait(self.seq, timeout, self._ready)
        return self.record

    def _ready(self) -> bool:
        """Built (the backends may still be writing it), or dropped."""
        return self.record is not None or self.dropped

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in StepRecord.__dataclass_fields__ and name not in (
            "flat_scalars", "is_empty"
        ):
            raise AttributeError(name)
        record = self.result()
        if record is None:
            raise LookupError(f"step {self.step} was dropped before it was written (on_full='drop'), or was read on "
                              f"the logger's own writer thread (in a backend) before it was built.")
        return getattr(record, name)

    def __repr__(self) -> str:
        state = "dropped" if self.dropped else ("built" if self.record is not None else "pending")
        return f"CommittedStep(step={self.step}, {state})"
