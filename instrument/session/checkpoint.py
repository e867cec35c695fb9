"""A session's checkpoint: what `Instrumentation.state_dict` saves and `load_state_dict` resumes from.

A checkpoint is consistent with the files: the steps it counts as committed are written and flushed before it
is returned (bounded), and a step it counts while its block is still open is flushed when the block commits.
"""

import logging
import math
import numbers
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

from instrument.checks import check_number
from instrument.errors import ConfigurationError
from instrument.logger.steps import resume_step

if TYPE_CHECKING:
    from instrument.session.instrumentation import Instrumentation

__all__ = ["check_session_state", "flush_for_checkpoint", "load_session_state", "session_state"]

log = logging.getLogger("instrument")


def session_state(inst: "Instrumentation", flush_timeout: Optional[float]) -> Dict[str, Any]:
    """`Instrumentation.state_dict` (see its docstring): flushed first, the open logging step counted."""
    timeout = check_number("state_dict: flush_timeout", flush_timeout, least=0, none=True,
                           noun="a number of seconds", why="how long to wait for committed steps to be written",
                           fix="pass e.g. state_dict(flush_timeout=30.0), or None to wait until they are")
    timeout = None if timeout is None or math.isinf(timeout) else timeout
    written = True
    if timeout != 0 and not inst.logger._closed:
        written = flush_for_checkpoint(inst, timeout)
    last = inst.logger._last_step
    if inst._current is not None and (last is None or inst._current.step > last):
        if inst.logger._closed:  # closed under the open block (a signal, another thread): it never commits
            log.warning("instrument: state_dict() inside logging step %d, but the logger is already closed, "
                        "so that step is never written; the checkpoint counts only the steps before it",
                        inst._current.step)
        else:
            last = inst._current.step
            inst.logger.keep_on_shutdown(last)  # a signal before the block exits still writes it
            if written:  # and the block's commit is flushed at once (`_end`); not behind a backend that is stuck
                inst._flush_on_commit = timeout
    elif inst._current is None and inst.logger.has_pending and not inst._said_staged:
        inst._said_staged = True  # values of an unfinished interval: not in the checkpoint
        log.warning(
            "instrument: state_dict() was called with values staged%s for the next logging step "
            "(the interval's means): a checkpoint does not hold them, so a run resumed from it logs that "
            "step's means over the steps after the checkpoint only. Save checkpoints at logging steps (inside "
            "or right after `with inst.step(k)` of a logging step) to keep every interval whole. (Said once.)",
            "" if inst.logger._pending_step is None else f" up to step {inst.logger._pending_step}")
    return {"version": 1, "run_name": inst.run.name, "last_step": last, "config_logged": inst._config.logged}


def flush_for_checkpoint(inst: "Instrumentation", timeout: Optional[float], what: str = "state_dict()") -> bool:
    """The steps a checkpoint counts as committed, on disk before it is saved (`state_dict`). False when
    ``timeout`` passed first: said once per session, later at DEBUG."""
    started = time.monotonic()
    if inst.logger.flush(timeout) or inst.logger._closed or timeout is None or time.monotonic() - started < timeout:
        return True  # written (a backend that failed a write is reported and counted in `failures` already)
    report = log.debug if inst._said_slow_checkpoint else log.warning
    inst._said_slow_checkpoint = True
    report(
        "instrument: %s waited %s s for the steps a checkpoint counts as committed to be written, and some are "
        "still pending (%d queued behind the one a slow or unreachable backend is writing). They are written "
        "unless the process is killed first; resuming from the checkpoint would not write them again. Pass a "
        "longer state_dict(flush_timeout=...) to wait longer. (Said once; later at DEBUG.)",
        what, timeout, inst.logger._writer.pending,
    )
    return False


def load_session_state(inst: "Instrumentation", state: Dict[str, Any]) -> None:
    """`Instrumentation.load_state_dict` (see its docstring): refused before anything changes, or resumed."""
    check_session_state(inst, state)
    inst.logger.resume_after(state["last_step"])


def check_session_state(inst: "Instrumentation", state: Any) -> None:
    """Raise the error `load_session_state` would raise for ``state``, changing nothing: a caller that loads
    more than the session (`RLLogging.load_state_dict`) checks it before it loads any of it."""
    if inst._closed:
        raise ConfigurationError("this Instrumentation is closed, so load_state_dict() would resume nothing; "
                                 "create a new one with resume=True and load the checkpoint into it.")
    if not isinstance(state, dict) or state.get("version") != 1 or "last_step" not in state:
        raise ConfigurationError(
            f"Instrumentation.load_state_dict expects a dict from Instrumentation.state_dict(), got {state!r}."
        )
    saved = state.get("run_name", inst.run.name)
    committed, saved_step = inst.logger._last_step, state["last_step"]
    if committed is not None and (saved_step is None or (
            isinstance(saved_step, numbers.Integral) and not isinstance(saved_step, bool) and saved_step < committed)):
        raise ConfigurationError(
            f"load_state_dict was called after this Instrumentation committed step {committed}: resuming at "
            f"the checkpoint's step {saved_step!r} would cut this session's own steps "
            f"after it out of every backend. Call load_state_dict right after creating the Instrumentation, "
            f"before the first step."
        )
    if inst.run.resume is not None and saved != inst.run.name:  # a new run may branch off another's state
        raise ConfigurationError(
            f"load_state_dict got the checkpoint of run {saved!r}, but this Instrumentation continues run "
            f"{inst.run.name!r} in {str(inst.run.root)!r}; resuming at that checkpoint's step would cut run "
            f"{inst.run.name!r}'s steps after it. Load run {inst.run.name!r}'s own checkpoint, or pass "
            f"run_name={saved!r} (and its log_dir) to continue that run. (A run folder renamed on purpose: set "
            f"state['run_name'] = {inst.run.name!r} first.)"
        )
    resume_step(state["last_step"])
