"""A session's checkpoint: what `Instrumentation.state_dict` saves and `load_state_dict` resumes from.

A checkpoint is consistent with the files: the steps it counts as committed are written and flushed before it
is returned (bounded), and a step it counts while its block is still open is flushed when the block commits.
"""

import logging
import math
import numbers
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from instrument.checks import check_int, check_number
from instrument.errors import ConfigurationError
from instrument.logger.lifecycle import wait_seconds
from instrument.logger.steps import MAX_STEP
from instrument.session.run_folder import RUN_FILE, is_used, save_ids

if TYPE_CHECKING:
    from instrument.session.instrumentation import Instrumentation

__all__ = ["check_session_state", "flush_for_checkpoint", "load_session_state", "session_state"]

log = logging.getLogger("instrument")


def session_state(inst: "Instrumentation", flush_timeout: Optional[float],
                  ahead: Optional[int] = None) -> Dict[str, Any]:
    """`Instrumentation.state_dict` (see its docstring): flushed first, the open logging step counted.

    ``ahead``: a step that no block frames but that the caller commits through `Instrumentation.commit_step`
    when its own unit of work ends (an open `RLLogging.iteration` counted as done by its checkpoint). It counts
    as committed as an open block's step does, and what is staged then is that step's own, so the warning about
    staged values left out is not given. Should that work raise, the promise stands: unlike a block's step, which
    its failure uses up, the step is retried by the next unit of work, whose commit (or a signal's close) keeps it."""
    timeout = check_number("state_dict: flush_timeout", flush_timeout, least=0, none=True,
                           noun="a number of seconds", why="how long to wait for committed steps to be written",
                           fix="pass e.g. state_dict(flush_timeout=30.0), or None to wait until they are")
    timeout = wait_seconds(timeout)  # inf, and what a thread's wait cannot take, as None
    written = True
    if timeout != 0 and not inst.logger._closed:
        written = flush_for_checkpoint(inst, timeout)
    last = inst.logger._last_step
    counted = inst._current.step if inst._current is not None else ahead  # committed when its work ends
    if counted is not None and (last is None or counted > last):
        if inst.logger._closed:  # closed under the open block (a signal, another thread): it never commits
            log.warning("instrument: state_dict() inside logging step %d, but the logger is already closed, "
                        "so that step is never written; the checkpoint counts only the steps before it", counted)
        else:
            last = counted
            inst.logger.keep_on_shutdown(last)  # a signal before the block exits still writes it
            if written:  # and the block's commit is flushed at once (`_end`); not behind a backend that is stuck
                inst._flush_on_commit = timeout
    elif counted is None and inst.logger.has_pending and not inst._said_staged:
        inst._said_staged = True  # values of an unfinished interval: not in the checkpoint
        log.warning(
            "instrument: state_dict() was called with values staged%s for the next logging step "
            "(the interval's means): a checkpoint does not hold them, so a run resumed from it logs that "
            "step's means over the steps after the checkpoint only. Save checkpoints at logging steps (inside "
            "or right after `with inst.step(k)` of a logging step) to keep every interval whole. (Said once.)",
            "" if inst.logger._pending_step is None else f" up to step {inst.logger._pending_step}")
    if not inst._run_id_saved and inst.logger.is_writer and is_used(inst.run.dir):  # the id the checkpoint names
        inst._run_id_saved = save_ids(inst.run.dir, [], quiet=True, run_id=inst._run_id, force=True)
    state = {"version": 1, "run_name": inst.run.name, "run_id": inst._run_id, "last_step": last,
             "config_logged": inst._config.logged}
    if inst.logger.is_writer:  # the backends that wrote its steps (`_say_left_out`)
        state["backends"] = [backend.name for backend in inst.logger.backends]
    ranges = dict(inst.logger._ranges)  # heatmap tag -> color_range="running" so far (writer thread: flushed)
    if ranges:
        state["heatmap_ranges"] = {tag: [lo, hi] for tag, (lo, hi) in ranges.items()}
    sizes = inst.logger._sizes.snapshot()  # heatmap tag -> its largest canvas so far: a resume keeps the size
    if sizes:
        state["heatmap_sizes"] = {tag: [height, width] for tag, (height, width) in sizes.items()}
    return state


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
    saved_step = check_session_state(inst, state)
    inst.logger.resume_after(saved_step)
    # The checkpoint's ranges replace whatever an earlier load set (a second load of an earlier state without
    # them must not keep ranges from later steps); one saved before they were kept has none: those start again.
    ranges = _heatmap_ranges(state["heatmap_ranges"]) if "heatmap_ranges" in state else {}
    inst.logger._ranges.clear()  # no heatmap drawn yet: load_state_dict comes before the first step
    inst.logger._ranges.update(ranges)
    inst.logger._sizes.replace(_heatmap_sizes(state["heatmap_sizes"]) if "heatmap_sizes" in state else {})
    inst._resumed_at = -1 if saved_step is None else saved_step
    _say_left_out(inst, state.get("backends"), saved_step)


def _say_left_out(inst: "Instrumentation", saved: Any, step: Optional[int]) -> None:
    """A backend of this session that the session which saved the checkpoint did not have: it lacks that
    session's steps, and its files keep what they held in that range (from a branch an earlier resume left)."""
    if step is None or not inst.logger.is_writer or not isinstance(saved, list):
        return
    absent = [backend.name for backend in inst.logger.backends if backend.name not in saved]
    if absent:
        log.warning(
            "instrument: %s %s not among the backends of the session that saved this checkpoint (%s), so %s none "
            "of the steps that session wrote up to step %d. What %s files hold up to step %d is kept (a resume "
            "cuts only the steps after the checkpoint): steps of a run an earlier resume went back from may be "
            "among them, and the run's other backends disagree there. Expected for a backend added to the run "
            "now; otherwise give every session of a run the same backends.",
            ", ".join(absent), "is" if len(absent) == 1 else "are", ", ".join(map(str, saved)) or "none",
            "it holds" if len(absent) == 1 else "they hold", step, "its" if len(absent) == 1 else "their", step)


def check_session_state(inst: "Instrumentation", state: Any) -> Optional[int]:
    """The checkpoint's last step, or the error `load_session_state` would raise for ``state``, changing
    nothing: a caller that loads more than the session (`RLLogging.load_state_dict`) checks it before it loads
    any of it."""
    if inst._closed:
        raise ConfigurationError("this Instrumentation is closed, so load_state_dict() would resume nothing; "
                                 "create a new one with resume=True and load the checkpoint into it.")
    saved_step = _checked(state)
    saved, saved_id = state.get("run_name", inst.run.name), state.get("run_id")
    committed, loaded = inst.logger._last_step, inst._resumed_at  # -1 stands for None below
    at, now = -1 if saved_step is None else saved_step, -1 if committed is None else committed
    if loaded is not None and at > now:  # the first load had the steps after it cut: nothing brings them back
        since = "" if now == loaded else f", and this session has committed steps up to {now} since"
        raise ConfigurationError(
            f"load_state_dict already resumed this run in this session at {_named(loaded)}{since}. Every backend "
            f"was told then to drop the interrupted run's steps after {_named(loaded)} (JSONL and the in-memory "
            f"history removed them, TensorBoard hides them; MLflow and W&B keep theirs and skip those steps), so "
            f"resuming now at the checkpoint's step {at} would leave {_steps(now + 1, at)} missing from those "
            f"backends. Load one checkpoint per session, right after creating the Instrumentation, and go on from "
            f"the one loaded first: restore its model and optimizer state, the run's next step is {now + 1}. "
            f"Loading the same checkpoint again, or an earlier one before any step, is accepted: the run then goes "
            f"on from it."
        )
    if inst.logger.has_pending:  # they would be committed with the first step after the checkpoint's
        pending = inst.logger._pending_step
        raise ConfigurationError(
            f"load_state_dict was called with values staged{'' if pending is None else f' for step {pending}'} "
            f"and not yet committed: the first commit after resuming at the checkpoint's {_named(at)} would take "
            f"them into that later step, mixed into its means. Call load_state_dict right after creating the "
            f"Instrumentation, before anything is logged."
        )
    if inst.run.resume is not None and loaded is None and committed is not None and at >= now:
        raise ConfigurationError(
            f"load_state_dict was called after this Instrumentation committed step {committed} in the run it "
            f"continues: those steps went into the run's files beside the interrupted run's own steps, and resuming "
            f"at the checkpoint's {_named(at)} keeps both there (a step twice, or steps out of order). Call "
            f"load_state_dict right after creating the Instrumentation, before the first step."
        )
    if committed is not None and at < now and (loaded is None or now != loaded):
        raise ConfigurationError(
            f"load_state_dict was called after this Instrumentation committed step {committed}: resuming at "
            f"the checkpoint's {_named(at)} would cut this session's own steps after it out of every backend. "
            f"Call load_state_dict right after creating the Instrumentation, before the first step."
        )
    if inst.run.resume is not None and saved != inst.run.name:  # a new run may branch off another's state
        raise ConfigurationError(
            f"load_state_dict got the checkpoint of run {saved!r}, but this Instrumentation continues run "
            f"{inst.run.name!r} in {str(inst.run.root)!r}; resuming at that checkpoint's step would cut run "
            f"{inst.run.name!r}'s steps after it. Load run {inst.run.name!r}'s own checkpoint, or pass "
            f"run_name={saved!r} (and its log_dir) to continue that run. (A run folder renamed on purpose: set "
            f"state['run_name'] = {inst.run.name!r} first.)"
        )
    if inst.run.resume is not None and saved_id is not None and saved_id != inst._run_id:
        here = (f"whose run id is {inst._run_id!r}" if inst._run_id_kept else
                f"whose {RUN_FILE} holds no run id (no checkpoint of it was saved, or the file was lost or replaced)")
        raise ConfigurationError(
            f"load_state_dict got a checkpoint of another run folder: run {saved!r} with run id {saved_id!r} (kept "
            f"in the {RUN_FILE} of the folder that saved it), but this Instrumentation continues the run in "
            f"{str(inst.run.dir)!r}, {here}. Two experiments may both name their run {saved!r} in different "
            f"log_dirs; resuming at that checkpoint's {_named(at)} would cut this run's steps after it. Pass the "
            f"log_dir of the run that saved the checkpoint (a copy of that folder keeps its run.json, and its id), "
            f"or load this run's own checkpoint. If this checkpoint is this folder's and its {RUN_FILE} was lost, "
            f"load it without the id: inst.load_state_dict({{**state, 'run_id': None}})."
        )
    return saved_step


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} to {last}"


def _named(step: int) -> str:
    return "the start (no step committed)" if step < 0 else f"step {step}"


_FIELDS = "{'version': 1, 'run_name': ..., 'run_id': ..., 'last_step': ..., 'config_logged': ...}"


def _checked(state: Any) -> Optional[int]:
    """The checkpoint's ``last_step``, or a `ConfigurationError` that names the field that is wrong or missing,
    what was expected, and (given a whole checkpoint) the key that holds instrument's state."""
    where = "Instrumentation.load_state_dict expects the dict Instrumentation.state_dict() returned"
    if not isinstance(state, dict):
        raise ConfigurationError(f"{where} ({_FIELDS}), got {_short(state)}.")
    if "version" not in state or "last_step" not in state:
        inner = _inner(state)
        if inner is not None:
            raise ConfigurationError(
                f"{where}, got a dict with the keys {_short(list(state))}: it has no 'version' and 'last_step', "
                f"but its {inner} looks like instrument's state. Pass that: e.g. "
                f"inst.load_state_dict(ckpt['instrument']), with the state_dict() saved under that key.")
        missing = [key for key in ("version", "last_step") if key not in state]
        raise ConfigurationError(
            f"{where} ({_FIELDS}), got a dict without {' and '.join(map(repr, missing))} (its keys: "
            f"{_short(list(state))}). Pass the state_dict() saved with the checkpoint as it was saved.")
    version = state["version"]
    if not (isinstance(version, numbers.Integral) and not isinstance(version, bool) and version == 1):
        raise ConfigurationError(
            f"{where}: its 'version' is {_short(state['version'])}, expected 1 (the only version this instrument "
            f"reads). A checkpoint of another instrument version needs that version, or its state made again.")
    for key, kind in (("run_name", "a run name (str)"), ("run_id", "a run id (str) or None")):
        value = state.get(key, "")
        if not isinstance(value, str) and not (value is None and key == "run_id"):
            raise ConfigurationError(f"{where}: its {key!r} is {_short(value)}, expected {kind}. Pass the "
                                     f"state_dict() saved with the checkpoint as it was saved.")
    _heatmap_ranges(state.get("heatmap_ranges", {}))
    _heatmap_sizes(state.get("heatmap_sizes", {}))
    return check_int("load_state_dict: the state's 'last_step'", state["last_step"], least=0, most=MAX_STEP,
                     integral=True, none=True, expected="None or an int >= 0 (the last step the checkpoint's "
                     "state_dict() counted as committed)", fix="pass the state_dict() saved with the checkpoint "
                     "as it was saved")


def _tag_pairs(value: Any, key: str, pair_of: str, wanted: str, fits: Callable[[Any, Any], bool],
               again: str) -> Dict[str, Tuple[Any, Any]]:
    """The state's ``key`` (heatmap tag -> a pair ``pair_of`` for which ``fits(a, b)``), or a `ConfigurationError`
    naming what is wrong; ``wanted`` says what fits, ``again`` what starts again when the key is dropped."""
    fix = f"Pass the state_dict() saved with the checkpoint as it was saved, or drop the key ({again})."
    if not isinstance(value, dict):
        raise ConfigurationError(f"load_state_dict: the state's {key!r} is {_short(value)}, expected a dict "
                                 f"heatmap tag -> {pair_of}. {fix}")
    pairs = {}
    for tag, pair in value.items():
        if not (isinstance(tag, str) and isinstance(pair, (list, tuple)) and len(pair) == 2 and fits(*pair)):
            raise ConfigurationError(f"load_state_dict: the state's {key!r} maps {_short(tag)} to {_short(pair)}, "
                                     f"expected a heatmap tag (str) -> {pair_of}, {wanted}. {fix}")
        pairs[tag] = (pair[0], pair[1])
    return pairs


def _heatmap_ranges(value: Any) -> Dict[str, Tuple[float, float]]:
    """The state's ``heatmap_ranges`` (heatmap tag -> ``[lo, hi]`` of ``color_range="running"``, finite and
    ``lo <= hi``) as the logger keeps them, or a `ConfigurationError` naming what is wrong."""
    def number(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    pairs = _tag_pairs(value, "heatmap_ranges", "[lo, hi]", "finite numbers with lo <= hi",
                       lambda lo, hi: number(lo) and number(hi) and lo <= hi, "the running colour ranges then start "
                       "again")
    return {tag: (float(lo), float(hi)) for tag, (lo, hi) in pairs.items()}


_MOST_PIXELS = 2**20  # a bound on a saved canvas side: a damaged checkpoint must not make every image huge
_MOST_AREA = 2**26  # and on its area (192 MiB of RGB): each side within bounds still made 3 TiB images


def _heatmap_sizes(value: Any) -> Dict[str, Tuple[int, int]]:
    """The state's ``heatmap_sizes`` (heatmap tag -> ``[height, width]`` of its largest canvas so far, whole
    numbers of pixels) as the logger keeps them, or a `ConfigurationError` naming what is wrong."""
    def pixels(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and 1 <= v <= _MOST_PIXELS

    pairs = _tag_pairs(value, "heatmap_sizes", "[height, width]", f"whole numbers of pixels from 1 to "
                       f"{_MOST_PIXELS}, at most {_MOST_AREA} in all",
                       lambda h, w: pixels(h) and pixels(w) and h * w <= _MOST_AREA,
                       "the heatmaps' canvas sizes then start again")
    return {tag: (int(h), int(w)) for tag, (h, w) in pairs.items()}


def _inner(state: Dict[Any, Any], depth: int = 2) -> Optional[str]:
    """Where in ``state`` (a whole checkpoint) a value that looks like instrument's state is: ``"key 'x'"``."""
    for key, value in list(state.items())[:100]:
        if isinstance(value, dict):
            if "version" in value and "last_step" in value:
                return f"key {key!r}"
            found = _inner(value, depth - 1) if depth > 1 else None
            if found is not None:
                return f"key {key!r} -> {found}"
    return None


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters (a whole checkpoint's repr is the model's weights)."""
    text = repr(value) if not isinstance(value, dict) else f"a dict with the keys {list(value)!r}"
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__}, {len(text)} characters)"
