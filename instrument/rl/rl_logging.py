"""`RLLogging`: the standard RL logging set, composed from the RL components and driven per iteration.

One object (one gin binding) turns on collection, training, counter, timing, evaluation and progress logging::

    inst = instrument.Instrumentation(backends=[instrument.TensorBoardBackend()])
    rl = RLLogging(evaluation=Evaluation(every_frames=5_000)).attach(inst, eval_runner=GymnasiumRunner(...))
    for _ in range(n_iterations):
        with rl.iteration():                       # times the iteration; at exit: end_iteration()
            with rl.timer("collection"):
                batch = collect()
            rl.observe_batch(batch)                # TensorDict or mapping of tensors
            with rl.timer("optimization"):
                losses = update(batch)
            rl.observe_losses(losses)
    rl.close()

Steps: the logger step of iteration k is k (``step_unit="iterations"``, the same numbering as
``inst.step(k)``) or the frame count after its batch (``step_unit="frames"``). A logging iteration (every
``log_interval``-th, and every iteration that ran an evaluation) stages every component's values and commits
them in one batched transfer — unless it runs inside an open ``with inst.step(k)`` block, which commits on
exit,
so each step is committed once (W&B drops a second write to a committed step).

Resume: `state_dict` holds the counters and the evaluation schedule; after `load_state_dict` the next
iteration
continues the numbering, so no step is logged twice.

A component that raises is reported once and skipped; the other components and the commit still happen
(configuration errors, raised on the first batch, do propagate: they need fixing, not skipping).
"""

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from instrument.backends.base import StepRecord
from instrument.backends.progress import ProgressBar
from instrument.errors import ConfigurationError
from instrument.logger.logger import Logger
from instrument.logger.timer import Timer
from instrument.rl.collection import CollectionMetrics
from instrument.rl.component import RLComponent
from instrument.rl.counters import Counters
from instrument.rl.evaluation import EpisodeRunner, Evaluation
from instrument.rl.timing import StageClock
from instrument.rl.training import TrainMetrics

__all__ = ["RLLogging", "DEFAULT"]

log = logging.getLogger("instrument")

_STEP_UNITS = ("iterations", "frames")
_STATE_VERSION = 1


class _Default:
    """Marks a component argument left at its default (a fresh default instance); None turns it off."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


class RLLogging:
    """Collection, training, counter, timing, evaluation and progress logging for an RL loop or trainer.

    Args:
        collection: `CollectionMetrics` (default: a fresh one); None turns it off.
        training: `TrainMetrics` (default: a fresh one); None turns it off.
        counters: `Counters` (default: a fresh one); None stops logging them (they are still counted).
        evaluation: `Evaluation`, or None (the default) for no evaluation.
        progress: `ProgressBar` (default: one that shows only on a terminal); None turns it off.
        components: further `RLComponent` instances, driven like the built-in ones.
        log_interval: log every n-th iteration; None follows the attached Instrumentation's ``log_interval``
            (1 when attached to a bare Logger); 0 logs only evaluations.
        step_unit: ``"iterations"`` or ``"frames"``: what the logger's step counts.
        total_frames: the run's length, shown by the progress bar.
    """

    def __init__(
        self,
        collection: Optional[CollectionMetrics] = DEFAULT,
        training: Optional[TrainMetrics] = DEFAULT,
        counters: Optional[Counters] = DEFAULT,
        evaluation: Optional[Evaluation] = None,
        progress: Optional[ProgressBar] = DEFAULT,
        components: Sequence[RLComponent] = (),
        log_interval: Optional[int] = None,
        step_unit: str = "iterations",
        total_frames: Optional[int] = None,
    ) -> None:
        if step_unit not in _STEP_UNITS:
            raise ConfigurationError(f"RLLogging.step_unit must be one of {_STEP_UNITS}, got {step_unit!r}.")
        if log_interval is not None and (
            isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 0
        ):
            raise ConfigurationError(
                f"RLLogging.log_interval must be None or an int >= 0, got {log_interval!r}."
            )
        self.collection = CollectionMetrics() if collection is DEFAULT else collection
        self.training = TrainMetrics() if training is DEFAULT else training
        self.log_counters = counters is not None
        self.counters = Counters() if counters is DEFAULT or counters is None else counters
        self.evaluation = evaluation
        self.progress = ProgressBar() if progress is DEFAULT else progress
        for name, comp, kind in (
            ("collection", self.collection, CollectionMetrics),
            ("training", self.training, TrainMetrics),
            ("counters", self.counters, Counters),
            ("evaluation", self.evaluation, Evaluation),
            ("progress", self.progress, ProgressBar),
        ):
            if comp is not None and not isinstance(comp, kind):
                raise ConfigurationError(
                    f"RLLogging.{name} must be a {kind.__name__} or None, got {type(comp).__name__}."
                )
        for comp in components:
            if not isinstance(comp, RLComponent):
                raise ConfigurationError(
                    f"RLLogging.components must be RLComponent instances, got {type(comp).__name__}."
                )
        self.extra: List[RLComponent] = list(components)
        self.log_interval = log_interval
        self.step_unit = step_unit
        self.total_frames = total_frames
        self.instrumentation = None
        self._logger: Optional[Logger] = None
        self._owns_session = False
        self._clock: Optional[StageClock] = None
        self._failed: Dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ wiring
    def attach(self, target: Any = None, eval_runner: Optional[EpisodeRunner] = None) -> "RLLogging":
        """Log through ``target``: an `Instrumentation`, a `Logger`, or None for a new default
        Instrumentation.

        Returns self, so ``rl = RLLogging(...).attach(inst)`` reads as one line.
        """
        if self._logger is not None:
            raise ConfigurationError(
                "this RLLogging is already attached; create another one for another run."
            )
        if target is None:
            from instrument.session import Instrumentation

            target = Instrumentation()
            self._owns_session = True
        if isinstance(target, Logger):
            self._logger = target
        elif isinstance(getattr(target, "logger", None), Logger):
            self.instrumentation = target
            self._logger = target.logger
        else:
            raise ConfigurationError(
                f"RLLogging.attach takes an Instrumentation or a Logger, got {type(target).__name__}."
            )
        self._clock = StageClock(self._logger)
        if eval_runner is not None:
            if self.evaluation is None:
                raise ConfigurationError(
                    "an eval_runner was given but RLLogging.evaluation is None; bind an Evaluation."
                )
            self.evaluation.runner = eval_runner
        if self.progress is not None:
            if self.progress.total_frames is None:
                self.progress.total_frames = self.total_frames
            if self.collection is not None and self.collection.group != "main":
                self.progress.reward_keys = tuple(
                    k.replace("collection/main/", f"{self.collection.prefix}/")
                    for k in self.progress.reward_keys
                )
            self._logger.add_backend(self.progress)
        return self

    @property
    def attached(self) -> bool:
        return self._logger is not None

    def close_session(self) -> None:
        """Close everything this set logs through: the Instrumentation (or bare Logger) it is attached to,
        which
        closes every backend (W&B ``finish`` included). Idempotent, like the closes it calls."""
        self.close()
        if self.instrumentation is not None:
            self.instrumentation.close()
        elif self._logger is not None:
            self._logger.close()

    @property
    def logger(self) -> Logger:
        if self._logger is None:
            raise ConfigurationError("RLLogging is not attached; call rl.attach(instrumentation) first.")
        return self._logger

    @property
    def components(self) -> List[Tuple[str, RLComponent]]:
        named: List[Tuple[str, Any]] = [("collection", self.collection), ("training", self.training)]
        if self.log_counters:
            named.append(("counters", self.counters))
        named += [(f"extra{i}", c) for i, c in enumerate(self.extra)]
        return [(n, c) for n, c in named if c is not None]

    @property
    def iteration_index(self) -> int:
        """The index of the iteration in progress (iterations completed so far)."""
        return self.counters.iterations

    @property
    def step(self) -> int:
        """The logger step of the iteration in progress."""
        return self.counters.iterations if self.step_unit == "iterations" else self.counters.frames

    def is_logging_iteration(self, index: int) -> bool:
        interval = self.log_interval
        if interval is None:
            interval = (
                getattr(self.instrumentation, "log_interval", 1) if self.instrumentation is not None else 1
            )
        return interval > 0 and index % interval == 0

    # ------------------------------------------------------------------ the iteration
    def timer(self, name: str) -> Timer:
        """The logger's timer ``name`` (``timing/<name>/...``): ``with rl.timer("collection"): ...``."""
        return self.logger.timer(name)

    @property
    def clock(self) -> StageClock:
        if self._clock is None:
            raise ConfigurationError("RLLogging is not attached; call rl.attach(instrumentation) first.")
        return self._clock

    @contextlib.contextmanager
    def iteration(self, eval_runner: Optional[EpisodeRunner] = None) -> Iterator["RLLogging"]:
        """One training iteration: timed as ``timing/iteration``; `end_iteration` runs when the block exits
        normally (an exception skips it, so a failed iteration is neither counted nor logged)."""
        self.clock.start("iteration")
        try:
            yield self
        except BaseException:
            self.clock.cancel_all()
            raise
        self.clock.stop("iteration")
        self.end_iteration(eval_runner)

    def observe_batch(self, batch: Any = None, *, frames: Optional[int] = None, **tensors: Any) -> None:
        """Count and measure one collected batch (a TensorDict, a mapping, or ``reward=``/``done=``/``mask=``
        tensors as keywords). ``frames``, when given, is the batch's frame count including frame skip."""
        self._check_open()
        self.counters.on_batch(batch, frames, done=tensors.get("done"), mask=tensors.get("mask"))
        if self.collection is not None:
            self._guard("collection", self.collection.update, batch, **tensors)
        for i, comp in enumerate(self.extra):
            self._guard(f"extra{i}", comp.on_batch, batch, frames)

    def observe_losses(self, losses: Any) -> None:
        """Reduce one dict / TensorDict of losses and statistics (call it once per update, or once per
        batch)."""
        self._check_open()
        if self.training is not None:
            self._guard("training", self.training.update, losses)
        for i, comp in enumerate(self.extra):
            self._guard(f"extra{i}", comp.on_losses, losses)

    def end_iteration(self, eval_runner: Optional[EpisodeRunner] = None) -> Optional[StepRecord]:
        """Close the iteration: evaluate when due, and on logging iterations stage everything and commit.

        Returns the committed record, or None when nothing was committed here.
        """
        self._check_open()
        logger = self.logger
        index = self.counters.iterations
        step = self.step
        evaluated = False
        if self.evaluation is not None:
            frames = self.counters.frames
            if self.evaluation.due(frames):
                with logger.timer("evaluation"):
                    self.evaluation.run(logger, step, frames, eval_runner)
                evaluated = True
        self.counters.end_iteration()
        if not (evaluated or self.is_logging_iteration(index)):
            return None
        for name, comp in self.components:
            self._guard(name, comp.log, logger, step)
        return self._commit(step)

    def _commit(self, step: int) -> Optional[StepRecord]:
        open_step = getattr(self.instrumentation, "active_step", None)
        if open_step is None:
            return self.logger.commit(step)
        if open_step != step:
            raise ConfigurationError(
                f"RLLogging logs iteration {self.counters.iterations - 1} at step {step} "
                f"({self.step_unit}) inside "
                f"`with inst.step({open_step})`; the two must agree: use step_unit='iterations' and "
                f"inst.step(iteration), or end the inst.step block before rl.end_iteration()."
            )
        return None  # the open inst.step block commits this step when it exits

    # ------------------------------------------------------------------ resume and shutdown
    def state_dict(self) -> Dict[str, Any]:
        """Everything a resumed run needs to continue counting and scheduling; plain Python values only."""
        state: Dict[str, Any] = {"version": _STATE_VERSION, "counters": self.counters.state_dict()}
        if self.evaluation is not None:
            state["evaluation"] = self.evaluation.state_dict()
        comps = {name: comp.state_dict() for name, comp in self.components if name != "counters"}
        state["components"] = {k: v for k, v in comps.items() if v}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        version = state.get("version") if isinstance(state, dict) else None
        if version != _STATE_VERSION:
            raise ConfigurationError(
                f"RLLogging.load_state_dict expects a state from RLLogging.state_dict() (version "
                f"{_STATE_VERSION}), "
                f"got {type(state).__name__} with version {version!r}."
            )
        self.counters.load_state_dict(state["counters"])
        if self.evaluation is not None and "evaluation" in state:
            self.evaluation.load_state_dict(state["evaluation"])
        named = dict(self.components)
        for name, comp_state in state.get("components", {}).items():
            if name in named:
                named[name].load_state_dict(comp_state)

    @property
    def failures(self) -> Dict[str, int]:
        """Component name -> number of calls that raised."""
        return dict(self._failed)

    def close(self) -> None:
        """Commit what is still staged and release the components; closes the session if it made one.

        Idempotent. The progress bar closes here; the other backends (W&B ``finish`` included) close with the
        logger, i.e. in ``Instrumentation.close()`` — or here, when this RLLogging created its own session.
        """
        if self._closed:
            return
        self._closed = True
        if self._clock is not None:
            self._clock.cancel_all()
        for name, comp in self.components:
            self._guard(name, comp.close)
        runner = getattr(self.evaluation, "runner", None)
        if runner is not None and hasattr(runner, "close"):
            self._guard("evaluation", runner.close)
        if self._logger is None:
            return
        if self._owns_session:
            self.instrumentation.close()
            return
        if self.instrumentation is None or self.instrumentation.active_step is None:
            if self._logger.has_pending:
                self._logger.commit()
        if self.progress is not None:
            self.progress.close()  # the bar ends with the loop; the logger's own close() finds it closed

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this RLLogging is closed; create a new one for another run.")

    def _guard(self, name: str, fn, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except ConfigurationError:
            raise
        except Exception:
            count = self._failed[name] = self._failed.get(name, 0) + 1
            if count == 1:
                log.exception("instrument: RL component %r failed; it is skipped, the others carry on", name)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={c!r}" for n, c in self.components)
        return f"RLLogging({parts}, evaluation={self.evaluation!r}, step_unit={self.step_unit!r})"
