"""The backend extension point: one destination for committed steps.

Lifecycle, driven by the `Logger`'s writer thread::

    backend.open(run)                          # once, before anything else: create files / runs here
    backend.log_hyperparams(params, config)    # at start: flattened params and the operative gin config
    for each logging step, in step order:
        backend.write(record)                  # host values only: floats, numpy images, histograms, text
        (or backend.write_many(records))       # a remote backend's lane catching up: several steps, in order
    now and then (system monitor samples):
        backend.write_system(record)           # its own axis: record.step is milliseconds since the run started
    at most flush_secs after a write, and on Logger.flush():
        backend.flush()                        # make what was written durable
    backend.on_resume(next_step)               # a resumed run: steps from next_step on are written again
    backend.on_exit(status)                    # only when the run ends abnormally ("killed" / "failed")
    backend.close()                            # once; flush and release

Every method is called on the logger's one writer thread, one call at a time, never concurrently with
another method of the same backend, so a backend needs no lock of its own. A backend never sees a device
tensor and never has to sync: it gets a `StepRecord` of host values. An exception raised by a backend is
reported once (and counted in ``Logger.failures``); the other backends still get the step, and the failing
one gets the next record again.
"""

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from instrument.errors import ConfigurationError

__all__ = [
    "USER_HEAD", "Backend", "PartialWriteError", "ReadOnlyDict", "RunInfo", "SampleTable", "StepRecord", "check_apart",
    "check_backends", "name_apart", "strip_user", "under_user",
]

log = logging.getLogger("instrument")

USER_HEAD = "user/"  # where a user's metric goes whose key a timer's statistic has (`StepRecord.flat_scalars`)
_SAID: Dict[str, None] = {}  # the keys warned of, once per process (a dict: its operations are atomic)


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """Where a run lives: ``root/name`` holds every local output of the run."""

    name: str
    root: Path = Path("runs")
    argv: Optional[Tuple[str, ...]] = None  # the command line with secrets redacted (set by the Logger)
    # None: a new run. Resuming: backend name -> the run id it kept (`Backend.resume_id`), maybe empty.
    resume: Optional[Dict[str, str]] = dataclasses.field(default=None, hash=False)
    # When the run first started (``time.time()``; kept in its run.json across resumes): the origin of the system
    # monitor's steps, so that they go on increasing in a resumed process. None: the monitor's own start.
    started: Optional[float] = None

    @property
    def dir(self) -> Path:
        return Path(self.root) / self.name


@dataclasses.dataclass(frozen=True)
class SampleTable:
    """Validation samples of one tag: rows like ``{"input", "output", "score", ...extra}`` (host values). In a
    record a backend gets, ``rows`` is a tuple of read-only dicts (`StepRecord.freeze`)."""

    rows: List[Dict[str, Any]]
    score_key: str = "score"


_SHARED = ("a StepRecord is shared by every backend and by the caller's CommittedStep, so it is read-only: copy "
           "what you change (scalars = dict(record.scalars); image = record.images[tag].copy())")


class ReadOnlyDict(dict):
    """A record's dict: reads as a dict (json, ``dict(...)``, ``{**d}``); changing it raises `TypeError`.
    A copy or an unpickled one is a plain dict."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(_SHARED)

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


class ReadOnlyList(list):
    """A list in a sample field of a record: reads as a list (json writes it as an array, ``str`` as ``[...]``);
    changing it raises `TypeError`. A copy or an unpickled one is a plain list."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(_SHARED)

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore
    append = extend = insert = remove = pop = clear = sort = reverse = _refuse  # type: ignore

    def __reduce__(self) -> Any:
        return list, (list(self),)


def _read_only(value: Any) -> Any:
    if isinstance(value, SampleTable):
        return SampleTable(tuple(_read_only(row) for row in value.rows), value.score_key)  # type: ignore[arg-type]
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    elif type(value) is tuple:  # a video's (frames, fps), or a tuple in a sample field (its lists made read-only)
        return tuple(_read_only(item) for item in value)
    elif isinstance(value, tuple):  # a named tuple in a sample field: kept as it is, its arrays read-only
        for item in value:
            _read_only(item)
    elif type(value) is dict:  # the record's own dicts; a user's container type in a sample field is kept as is
        return ReadOnlyDict((key, _read_only(item)) for key, item in value.items())
    elif type(value) is list:  # a sample field's list (a tensor or an array's values)
        return ReadOnlyList(_read_only(item) for item in value)
    return value


@dataclasses.dataclass
class StepRecord:
    """Everything committed for one step, on the host.

    Attributes:
        step: the training step.
        scalars: key -> float.
        images: tag -> uint8 array of shape [H, W, 3] or [H, W, 4].
        histograms: tag -> 1-D array of raw values: float64, or int64 / uint64 for integers (exact).
        texts: tag -> markdown/plain text.
        videos: tag -> uint8 array [T, H, W, C] and frames per second.
        samples: tag -> validation samples (`SampleTable`).
        timings: timer name -> ``{"mean", "min", "max", "count"}`` in seconds (`Logger.timer`).
        wall_time: seconds since the epoch at commit.

    Timings travel as their own field; backends that only know scalars write `flat_scalars`, which names
    them ``timing/<name>/<stat>``.
    """

    step: int
    scalars: Dict[str, float] = dataclasses.field(default_factory=dict)
    images: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    histograms: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    texts: Dict[str, str] = dataclasses.field(default_factory=dict)
    videos: Dict[str, "tuple[np.ndarray, int]"] = dataclasses.field(default_factory=dict)
    samples: Dict[str, SampleTable] = dataclasses.field(default_factory=dict)
    timings: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)
    wall_time: float = dataclasses.field(default_factory=time.time)

    def freeze(self) -> "StepRecord":
        """Make this record read-only (the writer does, before the first backend gets it): one backend that changed
        a value in place would change it for every backend after it. Its dicts then raise on change, its arrays
        are not writeable, and its fields cannot be rebound. Returns self."""
        for field in ("scalars", "images", "histograms", "texts", "videos", "samples", "timings"):
            object.__setattr__(self, field, _read_only(getattr(self, field)))
        object.__setattr__(self, "_frozen", True)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"cannot set StepRecord.{name}: {_SHARED}.")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_frozen"):  # ``del record._frozen`` would switch the freeze off
            raise AttributeError(f"cannot delete StepRecord.{name}: {_SHARED}.")
        object.__delattr__(self, name)

    def is_empty(self) -> bool:
        return not (
            self.scalars or self.images or self.histograms or self.texts or self.videos or self.samples
            or self.timings
        )

    def flat_scalars(self) -> Dict[str, float]:
        """The scalars and the timings as one dict, timings keyed ``timing/<name>/<stat>``.

        Those keys (``<stat>`` one of mean, min, max, count) are the timers' (`Logger.timer`): a scalar the user
        logged under one is always written as ``user/<key>``, at every step whether or not a timer of that name
        ran there, with one warning per key. So is a key of that form already under ``user/`` (a metric logged as
        ``user/timing/t/mean`` is written as ``user/user/timing/t/mean``): the renaming is then one-to-one and
        the same at every step (`under_user`), so no two of the user's series, and no user series and a timer,
        ever share a key. Any other ``timing/...`` metric is written as logged."""
        out: Dict[str, float] = {}
        for key, value in self.scalars.items():  # into a new dict: renamed in place, ``timing/t/mean`` would take
            if not (key.startswith(_TIMER_HEADS) and _is_timer_key(strip_user(key))):  # the place of a logged
                out[key] = value  # ``user/timing/t/mean`` before that one moved on, losing it
                continue
            name = USER_HEAD + key
            out[name] = value
            if key not in _SAID:
                _SAID[key] = None
                log.warning("instrument: the metric %r was logged under a key of the form [user/]timing/<name>/<stat>, "
                            "whose timing/ form holds the statistics of Logger.timer(%r); the backends write it as "
                            "%r at every step. Name the metric outside timing/ (or give it another last part) to "
                            "choose its key; said once per key.", key,
                            strip_user(key)[len("timing/"):].rpartition("/")[0], name)
        for timer, stats in self.timings.items():
            for stat, value in stats.items():
                out[f"timing/{timer}/{stat}"] = value
        return out


_TIMER_HEADS = ("timing/", USER_HEAD)


def strip_user(key: str) -> str:
    """``key`` without its leading ``user/`` parts (``user/user/_x`` -> ``_x``)."""
    while key.startswith(USER_HEAD):
        key = key[len(USER_HEAD):]
    return key


def under_user(key: str, reserved: Callable[[str], bool]) -> str:
    """``user/<key>`` when ``key`` with its leading ``user/`` parts taken off is ``reserved``, else ``key``.

    A backend that must move the keys some form holds (W&B's ``_step``, the timers' ``timing/t/mean``) moves
    them this way: the keys already under ``user/`` that reduce to such a form move one level further, so two
    different keys never end up as one and the choice depends on the key alone, the same at every step and in
    every process (a rename chosen by what else the step held switched a series between keys)."""
    return USER_HEAD + key if reserved(strip_user(key)) else key


def _is_timer_key(key: str) -> bool:
    """``timing/<name>/<stat>`` with a timer's statistic as ``<stat>``."""
    head, _, stat = key.rpartition("/")
    return stat in _TIMER_STATS and len(head) > len("timing/")


_TIMER_STATS = frozenset({"mean", "min", "max", "count"})


class PartialWriteError(RuntimeError):
    """Part of what a `Backend.write` or `Backend.write_many` call was given could not be written; the rest was.
    ``steps``: how many of the call's steps had something that failed; each counts as one failure of the
    backend, as when each step is written apart (any other exception from `Backend.write_many` counts every step
    of the call). `instrument.backends.video.MediaWriteError` is the one for media values."""

    def __init__(self, message: str = "", steps: int = 1) -> None:
        super().__init__(message)
        self.steps = steps


class Backend:
    """Base class for destinations. Override `write`; the other methods default to doing nothing.

    ``sdk_exit_hook``: True for a backend whose SDK tears itself down in an atexit hook, registered once per
    process, maybe before this backend opened it (W&B's service process). Instrument's exit hook is then
    moved behind it when the backend opens, so that the logger is closed, and every step written, first. (An
    ``open`` that registers an exit hook itself is seen without it.)

    ``reopens``: True for a backend whose ``open`` may fail for a while (a tracking server that does not
    answer) and which opens itself again on a later call, bounded by its own timeouts (MLflow). A `Logger`
    that goes on after a failed open (``on_backend_error="warn"``, or an open that outlasted
    ``open_timeout``) then keeps it in the run instead of leaving it out; a failure that is instrument's own
    error (a bad option, a missing extra) still leaves it out, since trying again would only repeat it.

    ``remote``: True for a backend whose calls wait on a server over the network (MLflow with a tracking
    server, W&B online). A `Logger` makes its calls on a thread of its own (`instrument.logger.lane`), so that
    a slow or silent server costs that backend alone its steps: it falls behind, and past ``queue_size``
    waiting records loses its oldest ones (counted in ``failures``), while the other backends never wait for it
    and the training thread at most half a second until it catches up.
    """

    sdk_exit_hook = False
    reopens = False
    remote = False

    def open(self, run: RunInfo) -> None:
        """Create files or remote runs. Called once, before anything else."""

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        """Record flattened hyperparameters (already redacted) and the operative config text."""

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement write(record)")

    def write_many(self, records: Sequence[StepRecord]) -> None:
        """Several steps at once, in step order: what waited in a remote backend's lane while its last call was
        under way (`instrument.logger.lane`). Override it in a backend whose every call is a request to a server,
        to send them in as few requests as the server takes (MLflow: one ``log_batch`` holds 1,000 metrics of
        any steps): a lane then keeps up with steps that come faster than one request each. Only a lane calls
        it, and only where a class defines it no higher than `write` (a subclass that overrides only ``write``
        gets every step through it); the default writes each record.

        An exception counts every record of the call as failed (lost for this backend; none is written
        again), except a `PartialWriteError` (a `MediaWriteError` among them), which says that the rest was
        written: one failure per step with something that failed (its ``steps``), as from `write`."""
        for record in records:
            self.write(record)

    def write_system(self, record: StepRecord) -> None:
        """System-monitor scalars (``system/...``) on their own axis: ``record.step`` is milliseconds since the
        run first started (`RunInfo.started`), increasing across the processes of a resumed run, not a training
        step, so it must not pass through a training-step order check.
        Called on the writer thread, like `write`. Default: ignored."""

    def flush(self) -> None:
        """Make what was written so far durable (flush files, sync buffers). Called on the writer thread at
        most ``flush_secs`` after a write and on `Logger.flush`. Default: nothing."""

    def on_exit(self, status: str) -> None:
        """The run is ending abnormally; called once, just before `close`. Default: nothing.

        ``status`` is ``"killed"`` (SIGTERM or SIGINT reached the process) or ``"failed"`` (an exception
        ended it). A backend with a notion of run status records it here (MLflow ends the run KILLED or
        FAILED, W&B finishes with a non-zero exit code); `close` still follows and must flush.
        """

    def close(self) -> None:
        """Flush and release. Called once."""

    @property
    def resume_id(self) -> Optional[str]:
        """The id of the remote run this backend opened (W&B, MLflow), kept in the run folder so that
        ``Instrumentation(resume=True)`` continues it (``run.resume[self.name]`` at `open`). Default: None."""
        return None

    def writes_to(self, run: RunInfo) -> Tuple[str, ...]:
        """The local files or folders this backend will write for ``run`` and shares with no other backend,
        resolved before it opens: a `Logger` refuses two backends that name one (`check_apart`), since both
        would write every record into it, and its writer holds them from just before this backend opens until
        it closes, refusing them to a backend of any other session of this process (`instrument.backends.held`).
        Default: none."""
        return ()

    def on_resume(self, next_step: int) -> None:
        """A resumed run goes on from ``next_step`` (`Instrumentation.load_state_dict`): steps from it on
        that the interrupted run already wrote are overwritten where the backend can (TensorBoard, JSONL) or
        skipped. Called on the writer thread before the next record. Default: nothing."""

    @property
    def name(self) -> str:
        """The class name; a second backend of one class in a logger is named ``<class>#2`` (`name_apart`)."""
        return self.__dict__.get("_name") or type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_backends(backends: Any) -> List["Backend"]:
    """``backends`` as a list, each an instance of `Backend`; else a `ConfigurationError` that says what was
    received (a single backend where a list goes, a class where an instance goes) and how to write it."""
    if isinstance(backends, (Backend, type, str, bytes, Mapping)) or not hasattr(backends, "__iter__"):
        raise ConfigurationError(
            f"backends must be a list of instrument Backend instances, got {backends!r} "
            f"({type(backends).__name__}); e.g. backends=[TensorBoardBackend()] (in gin: "
            f"[@TensorBoardBackend()], note the brackets, the @ and the ())."
        )
    items = list(backends)
    if len({id(b) for b in items}) != len(items):
        raise ConfigurationError(
            "backends lists one backend instance twice, which would write every record twice; list each once "
            "(two of a kind need two instances, e.g. JsonlBackend('a.jsonl'), JsonlBackend('b.jsonl'))."
        )
    for b in items:
        if isinstance(b, type):
            raise ConfigurationError(
                f"backends must hold Backend instances, got the class {b.__name__}; call it: {b.__name__}() "
                f"(in gin: @{b.__name__}(), note the ())."
            )
        if not isinstance(b, Backend):
            raise ConfigurationError(
                f"Logger backends must be instrument Backend instances, got {type(b).__name__}; "
                f"subclass instrument.Backend or use one of the built-in backends."
            )
    return items


def check_apart(backends: List["Backend"], run: RunInfo) -> None:
    """Refuse two backends of one logger that would write the same file or folder (`Backend.writes_to`): two
    ``JsonlBackend()`` without a path both default to ``<run dir>/metrics.jsonl`` and wrote every record twice.
    Across the sessions of one process, `instrument.backends.held` refuses them when the second one opens."""
    owners: Dict[str, Backend] = {}
    for backend in backends:
        taken = claim(owners, backend.writes_to(run), backend)
        if taken is not None:
            path, other = taken
            raise ConfigurationError(
                f"{other.name} and {backend.name} would both write {path}: every record would go into it "
                f"twice, or their records would be mixed (a TensorBoardBackend also writes the folder 'system' "
                f"in its log_dir: the system samples' run) (got {other!r} and {backend!r}; two backends of a run "
                f"need a path each). Give one of them its own path, e.g. JsonlBackend(path='eval.jsonl') or "
                f"TensorBoardBackend(log_dir='runs/tb2'), or list the backend once."
            )


def claim(owners: Dict[str, Any], paths: Sequence[str], claimant: Any) -> Optional[Tuple[str, Any]]:
    """Enter ``claimant`` as the owner of each of ``paths``; the first path another owns, with that owner (None:
    all of them are the claimant's now)."""
    for path in paths:
        other = owners.setdefault(path, claimant)
        if other is not claimant:
            return path, other
    return None


def name_apart(backend: "Backend", others: List["Backend"]) -> None:
    """Give ``backend`` a name none of ``others`` has (``JsonlBackend#2``): the name keys its failure counts and
    its run id in ``run.json``, so two of one class would share one count (one's first failure unreported) and
    one resumed run id. A backend whose subclass defines ``name`` as a property keeps it.

    A number is the name in that logger only: an instance given to a later logger starts again from its own name
    (one numbered ``#2`` beside another JSONL backend once kept ``#2`` alone in the next run, whose resume then
    looked for its run id under a name a fresh instance does not have)."""
    numbered = backend.__dict__.pop("_numbered", None)  # (attribute, name before) of an earlier logger's number
    if numbered is not None:
        attribute, before = numbered
        if before is None:
            backend.__dict__.pop(attribute, None)
        else:
            backend.__dict__[attribute] = before
    taken = {other.name for other in others if other is not backend}
    base = backend.name
    if base not in taken:
        return
    number = 2
    while f"{base}#{number}" in taken:
        number += 1
    attribute = getattr(type(backend), "name", None)
    if attribute is Backend.__dict__["name"]:
        backend._numbered = ("_name", backend.__dict__.get("_name"))
        backend._name = f"{base}#{number}"
    elif not isinstance(attribute, property):  # a class attribute: an instance attribute shadows it
        backend._numbered = ("name", backend.__dict__.get("name"))
        backend.name = f"{base}#{number}"
