"""`RLLogging`: the standard RL logging set, composed from the RL components and driven by the session.

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

One session: `attach` registers every component with the `Instrumentation` (`Instrumentation.add_component`),
so the session's failure ledger guards them (their failures are in ``inst.failures``), the session's cadence
decides which iterations log (``inst.is_logging_step(iteration)``), and the session commits: at the exit of
an open ``with inst.step(k)`` block, or through ``inst.commit_step(step)`` when no block frames the
iteration. Each component is called only through the `RLComponent` methods.

Steps: the logger step of iteration k is k (``step_unit="iterations"``, the same numbering as ``inst.step(k)``)
or the frame count after its batch (``step_unit="frames"``). A logging iteration (a logging step of the
session, and, with no process group, every iteration whose evaluation was due) stages every component's values
and commits them in one batched transfer, once per step (W&B drops a second write to a step). With frames, a logging
iteration that kept no frame since the last commit has that commit's step: it is deferred, its values stay
accumulated and are committed by the next iteration whose frame count is higher.

Attached to a bare `Logger` (no session), it guards its components itself, logs every ``log_interval``-th
iteration (default 1) and commits the logger itself.

Resume: `state_dict` holds the counters, the evaluation schedule and, when attached to a session, the session's
state (last committed step); after `load_state_dict` the next iteration continues the numbering, so no step is
logged twice (``Instrumentation(resume=True)``). Saved inside an iteration, that iteration counts as done. A load
refused (a bad state, or one older than what the session or logger already committed) changes nothing
(`instrument.rl.resume`).

A component that raises is reported once and skipped; the others and the commit go on. A configuration error
propagates (it needs fixing), unless the component's ``on_batch`` or ``on_losses`` has worked before.
"""

import contextlib
import functools
import threading
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Tuple

from instrument.backends.base import StepRecord
from instrument.backends.progress import ProgressBar
from instrument.checks import check_int
from instrument.core.step_components import ComponentHandle, StepComponents
from instrument.errors import ConfigurationError
from instrument.logger.logger import Logger
from instrument.logger.timer import Timer
from instrument.rl.bar import ProgressComponent
from instrument.rl.batch import KeywordBatch
from instrument.rl.collection import CollectionMetrics
from instrument.rl.component import RLComponent, check_components, step_disagreement
from instrument.rl.counters import Counters
from instrument.rl.evaluation import EpisodeRunner, Evaluation
from instrument.rl.ranks import distributed
from instrument.rl.resume import check_resume_point, load_state, saved_state
from instrument.rl.timing import StageClock, StageTiming
from instrument.rl.training import TrainMetrics
from instrument.session.checkpoint import check_session_state

__all__ = ["RLLogging", "DEFAULT"]

_STEP_UNITS = ("iterations", "frames")


class _Default:
    """Marks a component argument left at its default (a fresh default instance); None turns it off."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


def _locked(method):
    """Runs ``method`` under the set's lock: a collector thread and the training thread may both feed one set
    (two threads counting at once lost about 1 update in 200 of frames and episodes)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class RLLogging:
    """Collection, training, counter, timing, evaluation and progress logging for an RL loop or trainer.

    Args:
        collection: `CollectionMetrics` (default: a fresh one); None turns it off.
        training: `TrainMetrics` (default: a fresh one); None turns it off.
        counters: `Counters` (default: a fresh one); None stops logging them (they are still counted; the
            progress bar, which reads the logged counts, then shows no frames).
        evaluation: `Evaluation`, or None (the default) for no evaluation.
        progress: `ProgressBar` (default: one that shows only on a terminal); None turns it off.
        components: further `RLComponent` instances, driven like the built-in ones; each logs under its own prefix.
        log_interval: for a bare `Logger`: log every n-th iteration (None: 1; 0 logs only evaluations).
            Attached to an `Instrumentation`, its ``log_interval`` decides (one session, one cadence): leave
            this None or give the same value.
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
        step_unit: Literal["iterations", "frames"] = "iterations",
        total_frames: Optional[int] = None,
    ) -> None:
        if step_unit not in _STEP_UNITS:
            raise ConfigurationError(f"RLLogging.step_unit must be one of {_STEP_UNITS}, got {step_unit!r}.")
        check_int("RLLogging.log_interval", log_interval, least=0, none=True, expected="None or an int >= 0",
                  why="0: evaluations only; None: 1, or the attached session's",
                  fix="bind e.g. RLLogging.log_interval = 10")
        self.collection = CollectionMetrics() if collection is DEFAULT else collection
        self.training = TrainMetrics() if training is DEFAULT else training
        self._logger: Optional[Logger] = None
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
        self.extra: List[RLComponent] = list(components)  # a generator is read once; checked with the set below
        self.timing = StageTiming()
        # the component that drives the progress bar backend through the set's lifecycle
        self.progress_component = ProgressComponent(self.progress) if self.progress is not None else None
        self.log_interval = log_interval
        self.step_unit = step_unit
        self.total_frames = total_frames
        self.instrumentation = None
        self._owns_session = False
        self._own = StepComponents("RL component")  # the guard when no session is attached
        self._handles: List[ComponentHandle] = []
        self._closed = False
        self._lock = threading.RLock()  # one thread at a time through the components (`_locked`)
        self._session_state: Optional[Dict[str, Any]] = None  # from load_state_dict, for a later attach
        self._check_at_attach = False  # a state was loaded before attach: checked there (`resume`)
        self._deferred = False  # step_unit="frames": a logging iteration waits for its frame count to move on
        self._failed_at: Optional[int] = None  # the step of an iteration that raised in its `inst.step` block
        self._unlogged = False  # an iteration completed since the last one logged here (or attach / load)
        # `iteration` blocks: whether the loop uses them, and whether one is open (a collector thread's batch
        # between two blocks belongs to no iteration yet: a state saved then does not count one as done)
        self._blocks, self._in_block = False, False
        check_components(self.members)  # again at attach: `collection` or `evaluation` may be set in between

    # ------------------------------------------------------------------ wiring
    def attach(self, target: Any = None, eval_runner: Optional[EpisodeRunner] = None) -> "RLLogging":
        """Log through ``target``: an `Instrumentation` (its components from now on), a bare `Logger`, or None
        for a new default Instrumentation (closed with this set).

        Returns self, so ``rl = RLLogging(...).attach(inst)`` reads as one line.
        """
        if self._logger is not None:
            raise ConfigurationError("this RLLogging is already attached; create another one for another run.")
        check_components(self.members)
        if target is None:
            from instrument.session import Instrumentation

            interval = {} if self.log_interval is None else {"log_interval": self.log_interval}
            made = Instrumentation(**interval)
            try:
                self._attach(made, eval_runner)
            except BaseException:  # refused (a loaded state, a runner): the session made for it is closed again
                made.close()
                raise
            self._owns_session = True
            return self
        return self._attach(target, eval_runner)

    def _attach(self, target: Any, eval_runner: Optional[EpisodeRunner]) -> "RLLogging":
        if isinstance(target, Logger):
            logger = target
        elif isinstance(getattr(target, "logger", None), Logger) and hasattr(target, "add_component"):
            logger = target.logger
            if self.log_interval is not None and self.log_interval != target.log_interval:
                raise ConfigurationError(
                    f"RLLogging.log_interval={self.log_interval} but the Instrumentation it is attached to "
                    f"logs every {target.log_interval} steps; one session has one cadence: bind "
                    f"Instrumentation.log_interval and leave RLLogging.log_interval None."
                )
        else:
            raise ConfigurationError(
                f"RLLogging.attach takes an Instrumentation or a Logger, got {type(target).__name__}."
            )
        if target is not logger and self._session_state is not None:  # from load_state_dict: a refused one
            check_session_state(target, self._session_state)  # leaves the session as it was
        elif self._check_at_attach:  # a bare Logger, or no session part: where the loaded counters go on
            check_resume_point(self, logger, attaching=True)
        if eval_runner is not None:
            self._set_runner(eval_runner)
        if self.progress_component is not None:  # the bar's key templates follow this set's prefixes
            self.progress_component.total_frames = self.total_frames
            self.progress_component.prefixes = {"counters": self.counters.prefix}
            if self.collection is not None:
                self.progress_component.prefixes["collection"] = self.collection.prefix
        register = target.add_component if target is not logger else self._own.add
        handles: List[ComponentHandle] = []
        try:
            for name, comp, logs in self.members:
                handles.append(register(comp, name, logs))
                handles[-1].lock = self._lock  # the session's calls too (`log` at a step's end): one thread at a time
        except BaseException:  # e.g. a second RLLogging on one session: leave the session as it was
            for handle in handles:
                handle.remove()
            raise
        if target is not logger:
            self.instrumentation = target
            if self._session_state is not None:
                target.load_state_dict(self._session_state)
        self._session_state, self._check_at_attach = None, False
        self._logger = logger
        self._handles = handles
        for handle in handles:
            handle.call("attach", logger)
        return self

    @property
    def evaluation(self) -> Optional[Evaluation]:
        """The `Evaluation` component, or None; set it before `attach` (attaching registers the components)."""
        return self._evaluation

    @evaluation.setter
    def evaluation(self, evaluation: Optional[Evaluation]) -> None:
        if self._logger is not None:
            raise ConfigurationError(
                "RLLogging.evaluation is set after attach(); set it before, so the session drives it."
            )
        self._evaluation = evaluation

    @property
    def members(self) -> List[Tuple[str, RLComponent, bool]]:
        """``(name, component, logs)`` of every component of the set, in the order they are called."""
        named: List[Tuple[str, Any, bool]] = [
            ("evaluation", self.evaluation, True),
            ("collection", self.collection, True),
            ("training", self.training, True),
            ("counters", self.counters, self.log_counters),
        ]
        named += [(f"extra{i}", c, True) for i, c in enumerate(self.extra)]
        named += [("timing", self.timing, False), ("progress", self.progress_component, False)]
        off = ("evaluation", "collection", "training", "progress")  # None turns these off; a None extra is refused
        return [(n, c, logs) for n, c, logs in named if c is not None or n not in off]

    @property
    def components(self) -> List[Tuple[str, RLComponent]]:
        """``(name, component)`` of the components whose values are logged."""
        return [(n, c) for n, c, logs in self.members if logs]

    @property
    def attached(self) -> bool:
        return self._logger is not None

    def close_session(self) -> None:
        """Close everything this set logs through: the Instrumentation (or bare Logger) it is attached to,
        which closes every backend (W&B ``finish`` included). Idempotent, like the closes it calls."""
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
    def iteration_index(self) -> int:
        """The index of the iteration in progress (iterations completed so far)."""
        return self.counters.iterations

    @property
    def step(self) -> int:
        """The logger step of the iteration in progress."""
        return self.counters.iterations if self.step_unit == "iterations" else self.counters.frames

    # ------------------------------------------------------------------ the iteration
    def timer(self, name: str) -> Timer:
        """The logger's timer ``name`` (``timing/<name>/...``): ``with rl.timer("collection"): ...``."""
        return self.logger.timer(name)

    @property
    def clock(self) -> StageClock:
        """The timing component's clock: ``start(stage)`` / ``stop(stage)`` from different call sites."""
        return self.timing.clock

    @contextlib.contextmanager
    def iteration(self, eval_runner: Optional[EpisodeRunner] = None) -> Iterator["RLLogging"]:
        """One training iteration: timed as ``timing/iteration``; `end_iteration` runs when the block exits
        normally. A failed one (it raised) is not logged; what it observed goes with the next logged iteration,
        and inside its own `inst.step(k)` block it uses step k up, so the next iteration is k + 1."""
        self.clock.start("iteration")
        self._blocks = self._in_block = True
        with self._lock:  # a failed iteration before: counted now, so `rl.step` is this block's (and a 2nd failure's)
            self._settle_failed(getattr(self.instrumentation, "open_step", None))
        try:
            yield self
        except BaseException:
            self._in_block = False
            self.clock.cancel_all()
            self.counters.counting = False
            if self.step_unit == "iterations" and getattr(self.instrumentation, "open_step", None) == self.step:
                self._failed_at = self.step  # counted at the next iteration if the loop goes on past it
            raise
        self.clock.stop("iteration")
        try:
            self.end_iteration(eval_runner)
        finally:
            self._in_block = False

    @_locked
    def observe_batch(self, batch: Any = None, *, frames: Optional[int] = None, **tensors: Any) -> None:
        """Count and measure one collected batch (a TensorDict, a mapping, or ``reward=``/``done=``/``mask=``
        tensors as keywords). ``frames``, when given, is the batch's frame count including frame skip; with
        no batch at all (asynchronous collection) only the frames are counted."""
        self._check_attached()
        if batch is None and frames is None and not tensors:  # a mistake of the call, whichever batch it is
            raise ConfigurationError(
                "observe_batch() got neither a batch nor frames: pass the collected batch (a TensorDict or a "
                "mapping, or reward=/done= tensors), or frames=N alone for asynchronous collection."
            )
        data = KeywordBatch(batch, **tensors) if tensors else batch
        for handle in self._handles:
            handle.call("on_batch", data, frames)

    @_locked
    def observe_losses(self, losses: Any) -> None:
        """Reduce one dict / TensorDict of losses and statistics (once per update, or once per batch)."""
        self._check_attached()
        for handle in self._handles:
            handle.call("on_losses", losses)

    @_locked
    def end_iteration(self, eval_runner: Optional[EpisodeRunner] = None) -> Optional[StepRecord]:
        """Close the iteration; on a logging iteration (the session's cadence, or a component asking, as a due
        evaluation does) every component stages its values and the step is committed once.

        ``eval_runner``, when given, becomes the evaluation's runner. Returns the committed record, or None
        when nothing was committed here (also when an open ``with inst.step(k)`` block commits at its exit).
        """
        self._check_attached()
        if eval_runner is not None:
            self._set_runner(eval_runner)
        inst = self.instrumentation
        open_step = inst.open_step if inst is not None else None  # the open block's step, logging or not
        self._settle_failed(open_step)
        index = self.counters.iterations
        step = self.step
        asked = False
        for handle in self._handles:
            asked = bool(handle.call("end_iteration", self.counters)) or asked
        self._unlogged = True
        if open_step is not None and open_step != step:
            raise step_disagreement(self.step_unit, index, step, open_step)
        if asked and distributed(self._logger):  # each rank's frames differ: a due evaluation waits for the
            asked = False  # next logging iteration, which every rank commits, so the collectives stay paired
        if not (asked or self._deferred or self._is_logging_iteration(index)):
            return None
        # Under a process group every commit is a collective, so no rank may decide on its own to skip one.
        if self.step_unit == "frames" and open_step is None and not distributed(self._logger):
            last = self._logger.last_step
            if last is not None and step <= last:
                # no frames kept since the last commit: committing again at that step would write two records
                # there (W&B drops the second); the values stay accumulated for the next step past it.
                self._deferred = True
                return None
            self._deferred = False
        self._unlogged = False
        if inst is None:
            self._own.log(self._logger, step)
            return self._logger.commit(step, paired=self.step_unit != "frames")  # ranks count their own frames
        return inst.commit_step(step)  # inside the open block: None, the block commits at its exit

    def _settle_failed(self, open_step: Optional[int]) -> None:
        """Count an iteration that raised in its block once the loop opens the next step (a retry: the same)."""
        failed, self._failed_at = self._failed_at, None
        if failed is not None and open_step == failed + 1:
            self.counters.iterations += 1

    def _is_logging_iteration(self, index: int) -> bool:
        if self.instrumentation is not None:
            return self.instrumentation.is_logging_step(index)
        interval = 1 if self.log_interval is None else self.log_interval
        return interval > 0 and index % interval == 0

    def _set_runner(self, runner: EpisodeRunner) -> None:
        if self.evaluation is None:
            raise ConfigurationError(
                "an eval_runner was given but RLLogging.evaluation is None; bind an Evaluation."
            )
        self.evaluation.runner = runner

    # ------------------------------------------------------------------ resume and shutdown
    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to go on counting and scheduling (plain values; see Resume in the module doc).

        The set's parts are read under its lock; the session's part, which first waits (up to 10 s) for the
        backends to write what was committed, outside it, so a collector thread's `observe_batch` goes on
        meanwhile (`instrument.rl.resume`)."""
        return saved_state(self)

    @_locked
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from `state_dict`'s state: all of it, or, refused (a `ConfigurationError` saying why), none of
        it, the session's part included: the counters, the schedule, the components and the session stay as
        they were."""
        load_state(self, state)

    @property
    def failures(self) -> Dict[str, int]:
        """Component name -> number of calls that raised (also in ``inst.failures`` when attached to one)."""
        counts, names = (self.instrumentation or self._own).failures, {name for name, _, _ in self.members}
        return {name: n for name, n in counts.items() if name in names}

    @_locked
    def close(self) -> None:
        """Commit what is staged and what the iterations since the last logging one gathered (at the last
        iteration's step), then close the components (the progress bar; W&B and the other backends close with the
        logger) and the session if this set made it. Idempotent. Call it before ``inst.close()``."""
        if self._closed:
            return
        self._closed = True
        if self._logger is None:  # never attached: only the components' own resources
            unattached = StepComponents("RL component")
            for name, comp, _ in self.members:  # closed only: an attach its checks refused closes too
                unattached.add(comp, name, logs=False)
            unattached.close()
            return
        timing = [h for h in self._handles if h.component is self.timing]
        for handle in timing:  # stages still running are dropped before anything is committed
            handle.call("close")
        inst = self.instrumentation
        active = inst.active_step if inst is not None else None
        at = active if active is not None else self._tail_step()
        if active is None and at is not None and inst is not None:
            inst.commit_step(at)  # the components log there, and the session's config goes first if it has not
        elif at is not None:  # inside a logging step (its block commits), or a bare logger's last iterations
            for handle in self._handles:
                if handle.logs:
                    handle.call("log", self._logger, at)
            if active is None:
                self._logger.commit(at, paired=self.step_unit != "frames")
        elif active is None and self._logger.has_pending and not distributed(self._logger):
            # what is staged, at no new step; under a process group `has_pending` differs by rank (media are
            # rank 0's), so the logger's own close commits it there, on every rank alike
            self._logger.commit()
        for handle in self._handles:
            if handle.component is not self.timing:
                handle.call("close")
            handle.remove()
        if self._owns_session:
            inst.close()

    def _tail_step(self) -> Optional[int]:
        """The step of the last completed iteration when no commit reached it (what the components gathered
        since the last logging iteration is then written there at close), else None."""
        inst = self.instrumentation
        interval = inst.log_interval if inst is not None else self.log_interval
        if not (self._unlogged and self.counters.iterations) or interval == 0:  # 0: logging is off
            return None
        if self.step_unit == "frames" and distributed(self._logger):  # ranks' frame counts (their steps) differ
            return None
        step = self.counters.iterations - 1 if self.step_unit == "iterations" else self.counters.frames
        last = self._logger.last_step
        return step if last is None or step > last else None

    def _check_attached(self) -> None:
        if self._closed:
            raise ConfigurationError("this RLLogging is closed; create a new one for another run.")
        if self._logger is None:
            raise ConfigurationError("RLLogging is not attached; call rl.attach(instrumentation) first.")

    def __repr__(self) -> str:
        parts = "".join(f"{n}={c!r}, " for n, c in self.components if n != "evaluation")
        return f"RLLogging({parts}evaluation={self.evaluation!r}, step_unit={self.step_unit!r})"
