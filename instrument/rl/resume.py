"""`RLLogging`'s checkpoint: what `RLLogging.state_dict` saves, and `load_state_dict` loading all of it or none.

The state holds plain values, so any checkpoint format stores it::

    {"version": 1,
     "counters": {"frames": ..., "iterations": ..., "episodes": ...},   # Counters.state_dict()
     "evaluation": {"next_due": ..., "runs": ...},                      # with an Evaluation
     "components": {"training": {...}, "extra0": {...}},               # the other components' non-empty states
     "session": {"last_step": ..., ...}}                                # Instrumentation.state_dict(), attached to one

Saving: the set's own parts are read under its lock, one consistent view (a collector thread's batch is in it
whole or not at all). The session's part is taken outside the lock, and after them: the session first waits, up
to 10 s, until the backends have written every committed step, and a collector thread's `observe_batch` must
not wait that long. Batches observed meanwhile are not in the state, as if observed just after it. A step the
training thread commits or opens meanwhile (its ``inst.step(k)`` block opens and commits without the set's lock)
leaves the session's last step ahead of the counters, never behind them (they were read first), so with
``step_unit="iterations"`` the saved ``iterations`` are taken as at least the saved session's last step + 1: the
resumed run never logs a step the session holds twice, nor leaves a gap. A batch observed between two
`RLLogging.iteration` blocks (a collector thread's) does not count an iteration as done: no block is open.

Loading: the session's state is checked first; then every component's state is loaded with `load_together`
and, last, the session resumes (with no session state, the logger's last committed step is checked against the
step the state resumes after). Anything refused leaves every part as it was: a refused load changes nothing.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from instrument.errors import ConfigurationError
from instrument.rl.component import load_together, state_entry
from instrument.rl.ranks import distributed
from instrument.session.checkpoint import check_session_state, session_state

if TYPE_CHECKING:
    from instrument.rl.rl_logging import RLLogging

__all__ = ["STATE_VERSION", "check_resume_point", "load_state", "saved_state"]

STATE_VERSION = 1
_FLUSH_SECONDS = 10.0  # `Instrumentation.state_dict`'s default wait, for the commit of a step counted ahead
_OWN_PARTS = ("counters", "evaluation", "timing", "progress")  # saved apart, or not at all


def saved_state(rl: "RLLogging") -> Dict[str, Any]:
    """`RLLogging.state_dict`: the set's parts under its lock, the session's (which flushes) outside it."""
    with rl._lock:
        state, inst = _own_state(rl), rl.instrumentation
        if inst is None:
            return state
        seen, ahead = _progress(inst), _commits_at_end(rl)
    session = _session_state(inst, ahead)  # waits for the backends (up to 10 s): the set's lock is free meanwhile
    with rl._lock:
        if _progress(inst) != seen:  # another thread committed in between: both again, the counters first
            state, ahead = _own_state(rl), _commits_at_end(rl)
            session = _session_state(inst, ahead)
    last = session.get("last_step")  # `ahead` counted: the open iteration commits it at its end, with no block
    if rl.step_unit == "iterations" and isinstance(last, int):  # the session's step, read last, may be ahead
        state["counters"]["iterations"] = max(state["counters"]["iterations"], last + 1)
    state["session"] = session
    return state


def _own_state(rl: "RLLogging") -> Dict[str, Any]:
    """The counters, the evaluation schedule and the other components' states (under the set's lock)."""
    counters, inst = rl.counters.state_dict(), rl.instrumentation
    inside = rl._in_block or not rl._blocks  # a loop without `iteration` blocks: a batch since the last end
    done = (rl.counters.counting and inside) or (inst is not None and rl.step_unit == "iterations" and
                                                 inst.active_step == rl.step)  # inside an iteration: done
    if done:
        counters["iterations"] += 1
    state: Dict[str, Any] = {"version": STATE_VERSION, "counters": counters}
    if rl.evaluation is not None:  # an evaluation the iteration counted as done runs at its end: saved as run
        at = _evaluation_at_end(rl, counters["frames"]) if done else None
        state["evaluation"] = rl.evaluation.state_dict() if at is None else rl.evaluation.state_after_run(at)
    comps = {name: comp.state_dict() for name, comp, _ in rl.members if name not in _OWN_PARTS}
    state["components"] = {k: v for k, v in comps.items() if v}
    return state


def _evaluation_at_end(rl: "RLLogging", frames: int) -> Optional[int]:
    """The frame count of the evaluation the open iteration's end runs (`RLLogging.end_iteration`), or None: one
    is due, and the iteration commits, which a due evaluation asks for (under a process group only a logging
    iteration commits, and a due evaluation waits for one)."""
    at = rl.evaluation.runs_at(frames)
    if at is None or (distributed(rl._logger) and not rl._is_logging_iteration(rl.counters.iterations)):
        return None
    return at


def _session_state(inst: Any, ahead: Optional[int]) -> Dict[str, Any]:
    """The session's state with the step the open iteration commits at its end (`_commits_at_end`) counted as
    committed, as the session counts an open block's: the resumed run starts after it, so it is kept in the files
    instead of cut from them and never logged again. Its commit is flushed at once, and a signal before it
    still writes it (`session_state`'s ``ahead``)."""
    return session_state(inst, _FLUSH_SECONDS, ahead=ahead)


def _commits_at_end(rl: "RLLogging") -> Optional[int]:
    """The step the open `RLLogging.iteration` commits at its end through `Instrumentation.commit_step` (no
    logging block open), when `_own_state` counts it as done; None otherwise. `end_iteration`'s decision, made
    without its side effects: the cadence, a deferred step, a due evaluation (not under a process group)."""
    inst = rl.instrumentation
    if inst is None or inst._current is not None or not (rl._in_block and rl.counters.counting):
        return None
    due = rl._deferred or rl._is_logging_iteration(rl.counters.iterations)
    evaluation = rl.evaluation
    if not due and evaluation is not None and not distributed(rl._logger):
        due = evaluation.runs_at(rl.counters.frames) is not None
    return rl.step if due else None


def _progress(inst: Any) -> Tuple[Optional[int], Optional[int]]:
    """What the session's state reads that a commit changes: its last committed step and open logging step."""
    return inst.logger.last_step, inst.active_step


def load_state(rl: "RLLogging", state: Dict[str, Any]) -> None:
    """`RLLogging.load_state_dict` (under the set's lock): every part checked and loaded, or none."""
    version = state.get("version") if isinstance(state, dict) else None
    if version != STATE_VERSION:
        raise ConfigurationError(
            f"RLLogging.load_state_dict expects a state from RLLogging.state_dict() (version "
            f"{STATE_VERSION}), got {type(state).__name__} with version {version!r}."
        )
    inst = rl.instrumentation
    resumes_session = inst is not None and "session" in state
    if resumes_session:
        check_session_state(inst, state["session"])  # e.g. an older state into a session past it: before any part
    parts: List[Tuple[Any, Any]] = [(rl.counters, state_entry(state, "counters", "RLLogging"))]
    if rl.evaluation is not None and "evaluation" in state:
        parts.append((rl.evaluation, state["evaluation"]))
    components = state.get("components", {})
    if not isinstance(components, Mapping):
        raise ConfigurationError(
            f"RLLogging.load_state_dict: 'components' must be the dict RLLogging.state_dict() saved (component "
            f"name -> state), got {type(components).__name__} {components!r:.80}."
        )
    named = {name: comp for name, comp, _ in rl.members if name not in _OWN_PARTS}
    parts += [(named[name], part) for name, part in components.items() if name in named]

    def resume() -> None:  # last: when it refuses, `load_together` puts every part back
        if resumes_session:
            inst.load_state_dict(state["session"])
        elif rl.attached:
            check_resume_point(rl, rl.logger)

    load_together(parts, then=resume)
    rl._unlogged = False  # what the restored counters count was logged by the run that saved them
    if not rl.attached:  # checked when the set is attached: the session's part, else the resume point
        rl._session_state, rl._check_at_attach = state.get("session"), True


def check_resume_point(rl: "RLLogging", logger: Any, attaching: bool = False) -> None:
    """With no session state to resume (a bare `Logger`): the loaded counters' next step must follow the
    logger's last committed step, else the resumed iterations would log below steps already written (refused as
    a `StepOrderError` at their commit, or, counting frames, held back until the count passes it). Checked at
    the load, or, for a state loaded before the set was attached, at ``attach`` (``attaching``)."""
    last = logger.last_step
    after = rl.counters.iterations - 1 if rl.step_unit == "iterations" else rl.counters.frames
    if last is not None and last > after:
        where, outcome = ("RLLogging.attach", "the set was not attached") if attaching else (
            "RLLogging.load_state_dict", "nothing was loaded")
        raise ConfigurationError(
            f"{where}: this logger has already committed step {last}, but the state resumes "
            f"after step {after} ({rl.step_unit}), so the next iterations would log below steps already "
            f"written. Load a state into a set whose logger has not logged past it (a new run's, before its first "
            f"iteration); {outcome}."
        )
