"""The RL component extension point: batch-level metrics driven by the training iteration.

An RL component sees whole collected batches and loss dictionaries, not rollout iterations (that is what
`instrument.Observer` is for). `RLLogging` drives every component through one training iteration::

    rl.attach(inst)                               # components get nothing yet
    for iteration in range(n):
        with rl.timer("collection"):
            batch = collect()                     # the user's collector / rollout
        rl.observe_batch(batch)                   # -> component.on_batch(batch, frames)
        with rl.timer("optimization"):
            losses = update(batch)
        rl.observe_losses(losses)                 # -> component.on_losses(losses)   (any number of times)
        rl.end_iteration()                        # evaluation when due; on logging iterations:
                                                  # -> component.log(logger, step); logger.commit(step)
    rl.close()                                    # -> component.close()

Rules a component follows:

- ``on_batch`` and ``on_losses`` keep results on the device and accumulate them over the logging interval;
  no ``.item()``: the logger moves everything to the host in one batched transfer at commit.
- ``log`` hands tensors to the logger under the component's key prefix and starts a new interval.
- ``state_dict``/``load_state_dict`` hold what a resumed run needs to continue exactly (counters, schedules);
  they return plain Python values so any checkpoint format (torch.save, JSON, TorchRL's) can store them.
"""

from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from instrument.logger.logger import Logger

__all__ = ["RLComponent"]


class RLComponent:
    """Base class of the RL metrics; every hook defaults to doing nothing.

    Attributes:
        prefix: the key prefix this component logs under (e.g. ``collection/main``).
    """

    prefix: str = ""

    def on_batch(self, batch: Any = None, frames: Optional[int] = None) -> None:
        """Look at one collected batch (TensorDict or mapping of tensors)."""

    def on_losses(self, losses: Any) -> None:
        """Look at one dict / TensorDict of losses and training statistics."""

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
