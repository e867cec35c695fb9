"""The run's folder: its name (unique by default, never outside ``log_dir``), what a resumed run reads back,
and its removal when the start that created it fails.

Everything a run writes locally lives in ``<log_dir>/<run_name>``; this module decides that name and refuses
names that could escape ``log_dir`` or land in another run's folder. Because a used name is refused, a start
that fails after some backends wrote there would block its own ``run_name``: `removed_if_start_fails` undoes it.
"""

import contextlib
import itertools
import json
import logging
import os
import secrets
import shutil
import time
import unicodedata
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from instrument.errors import ConfigurationError
from instrument.logger import shutdown
from instrument.logger.ranks import rank, same_on_all_ranks
from instrument.logger.writer import running_writers
from instrument.session import run_lock

__all__ = ["default_run_name", "check_run_name", "run_name_for", "resume_ids", "save_ids", "first_start", "RUN_FILE",
           "removed_if_start_fails", "release", "is_used"]

log = logging.getLogger("instrument")


def default_run_name() -> str:
    """The start time plus a short random suffix (``YYYYmmdd-HHMMSS-xxxxxx``): unique even for jobs started
    in the same second, and still sorted by time in a directory listing."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_run_name(name: Any) -> str:
    """``name`` if it is one plain folder name; a `ConfigurationError` for anything that could reach outside
    ``log_dir`` (``..``, a path separator, an absolute path) or is not a usable folder name (control characters
    such as a newline or a tab, more than 255 bytes)."""
    seps = [sep for sep in ("/", "\\", os.sep, os.altsep) if sep]
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"run_name must be a non-empty string, got {name!r}.")
    if name in (".", "..") or ".." in name or any(sep in name for sep in seps) or os.path.isabs(name) or "\0" in name:
        raise ConfigurationError(
            f"run_name {name!r} is not a plain folder name: it must not contain '..', a path separator or be "
            f"an absolute path (nothing is written outside log_dir). Put the folder part in log_dir instead, "
            f"e.g. log_dir='runs/project', run_name='trial-1'."
        )
    control = list(dict.fromkeys(c for c in name if unicodedata.category(c) == "Cc"))
    if control:  # a newline splits every log line that names the run, a tab or an escape garbles a terminal
        raise ConfigurationError(
            f"run_name {name!r} contains the control character{'s' * (len(control) > 1)} "
            f"{', '.join(repr(c) for c in control)}; a run name is a folder name printed in logs and terminals. "
            f"Use printable characters only, e.g. run_name='trial-1'."
        )
    if len(name.encode("utf-8", "surrogateescape")) > 255:  # the usual file-system limit of one name
        raise ConfigurationError(
            f"run_name is {len(name)} characters long ({name[:40]!r}...); a folder name holds at most 255 bytes. "
            f"Use a shorter run_name, and log what describes the run as hyperparams."
        )
    return name


# Held in the run folder while a run starts (O_EXCL): two processes started with one run_name at the same
# moment would both find the folder unused, and then write into it together.
CLAIM_FILE = ".instrument-starting"


def is_used(folder: Path) -> bool:
    """Whether anything but a start's claim or the writer lock is in ``folder`` (or it is not a folder)."""
    if folder.is_dir():
        return any(child.name not in (CLAIM_FILE, run_lock.LOCK_FILE) for child in folder.iterdir())
    return folder.exists()


# Run folders this process's starts claimed and have not finished starting -> whether the folder existed before.
_claims: Dict[Path, bool] = {}
# Run folders this process's starts made, removed at `release` if nothing was written there (a run whose only
# backend is in memory), and those so removed: resuming one in this process makes it again.
_made: Set[Path] = set()
_emptied: Set[Path] = set()


def _claim(run_dir: Path) -> Optional[str]:
    """Take the run folder for this start (`CLAIM_FILE`, created exclusively): None when taken (or when the
    folder cannot be made: the backends then say why), else why it is refused (another start holds it, or wrote
    there after the check)."""
    existed = run_dir.is_dir()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / CLAIM_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return (f"run {run_dir.name!r} is being started by another process in {str(run_dir.parent)!r} "
                f"({run_dir / CLAIM_FILE} exists); two runs would mix their steps in one folder. Choose another "
                f"run_name, or leave it unset for a unique default. (If no other process is starting it, that file "
                f"was left by a start that was killed: delete it.)")
    except OSError:
        return None
    with contextlib.suppress(OSError), os.fdopen(fd, "w") as f:  # the pid is for people; a full disk leaves it out
        f.write(f"{os.getpid()}\n")
    if is_used(run_dir):  # another run finished its start (and wrote) between our check and the claim
        _release(run_dir)
        return (f"run {run_dir.name!r} already exists in {str(run_dir.parent)!r} (another process started it a "
                f"moment ago); choose another run_name, or leave it unset for a unique default.")
    _claims[run_dir] = existed
    return None


def _release(run_dir: Path) -> None:
    with contextlib.suppress(OSError):
        (run_dir / CLAIM_FILE).unlink()


def run_name_for(run_name: Optional[str], root: Path, resume: bool) -> Tuple[str, str, bool]:
    """The run's folder name: checked, and never one that another run already wrote to (unless resuming); and
    the run's id with whether its folder holds it (`run_id_of`), rank 0's on every rank.

    Rank 0 checks and claims the folder (`_claim`) before any rank goes on (one broadcast of the name and the
    outcome): another rank's run log written there first would otherwise make rank 0 refuse its own run, and
    a refusal is raised on every rank alike. Rank 0 also takes the folder's writer lock (`run_lock`), new run
    or resumed, held until `release`: a process still writing the run refuses every other."""
    if run_name is None:
        if resume:
            raise ConfigurationError("resume=True needs the run_name of the run to continue.")
        name = default_run_name()
        while is_used(root / name):  # a suffix collision: vanishingly rare, but never share a folder
            name = default_run_name()
    else:
        name = check_run_name(run_name)
    ident = run_id_of(root / name, resume) if rank() == 0 else ("", False)  # before `_emptied` forgets it
    refusal: Optional[str] = None
    if not resume and rank() == 0:  # rank 0 writes; others may see its files
        if run_name is not None and is_used(root / name):
            refusal = (f"run {name!r} already exists in {str(root)!r} ({root / name} is not empty); a new run "
                       f"would mix its steps with the old one. Choose another run_name, leave it unset for a unique "
                       f"default, or pass resume=True to continue that run (from the command line: "
                       f"--bind 'Instrumentation.resume = True').")
        else:
            refusal = _claim(root / name)
            if refusal is None:
                refusal = run_lock.lock(root / name)
                if refusal is not None and _claims.pop(root / name, None) is not None:
                    _release(root / name)
    elif rank() == 0 and (root / name) in _emptied and not (root / name).exists():
        _emptied.discard(root / name)  # a run of this process that wrote nothing on disk: resumed as it was
        (root / name).mkdir(parents=True)
        _claims[root / name] = False  # made by this start: removed if it fails, or if it stays empty
        refusal = run_lock.lock(root / name)
    elif rank() == 0 and (root / name).is_dir():  # a missing run is refused by `resume_ids`
        refusal = run_lock.lock(root / name)
    name, refusal, ident = same_on_all_ranks((name, refusal, ident))  # every rank names the run as rank 0 does
    if refusal is not None:
        raise ConfigurationError(refusal)
    return name, ident[0], ident[1]


RUN_FILE = "run.json"  # in the run folder: the backends' run ids, so that a resumed run continues the same runs,
# the run's own id ("run_id"), which its checkpoints carry: a checkpoint of another folder is told apart by it
# even where both runs have one name (two experiments' "r" in two log_dirs), and a copy of the folder keeps it;
# and, with a system monitor, when the run first started (`first_start`).

# This process's runs -> their id: a run kept in memory, whose folder was removed at close (`_emptied`), is
# resumed in this process with the id its checkpoints carry.
_ids: Dict[Path, str] = {}


def run_id_of(run_dir: Path, resume: bool) -> Tuple[str, bool]:
    """The run's id and whether the run folder holds it: a new run's is made here; a resumed run's is read from
    its `RUN_FILE` (or this process's, for a run kept in memory: `_ids`), or made afresh when the folder holds
    none (False then: a run started by an instrument without run ids, one no checkpoint was saved of, or a run
    file that was lost)."""
    ident: Optional[str] = None
    if resume:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a bad run file is refused by `resume_ids`
            found = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8")).get("run_id")
            ident = found if isinstance(found, str) and found else None
        ident = ident or (_ids.get(run_dir) if run_dir in _emptied else None)
    kept = ident is not None or not resume
    ident = ident or secrets.token_hex(8)
    _ids[run_dir] = ident
    return ident, kept


def resume_ids(run_dir: Path) -> Dict[str, str]:
    """The backends' run ids of the run in ``run_dir`` (`RUN_FILE`), to resume it; refuses a missing run."""
    if not run_dir.is_dir():
        what = "is a file, not a run folder" if run_dir.exists() else "does not exist"
        raise ConfigurationError(
            f"resume=True, but there is no run {run_dir.name!r} in {str(run_dir.parent)!r} ({run_dir} {what}); "
            f"pass the run_name and log_dir of the run to continue, or resume=False to start a new one."
        )
    path = run_dir / RUN_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids = data.get("backends", {})
        if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in ids.values()):
            raise ValueError(f"a backend's run id is not a string: {ids!r}")
        return {str(k): str(v) for k, v in ids.items()}
    except (ValueError, AttributeError) as exc:
        raise ConfigurationError(f"{path} is not a run file written by instrument ({exc}); remove it to resume "
                                 f"without the backends' run ids (W&B and MLflow then start new runs).") from exc


def first_start(run_dir: Path, resume: bool) -> float:
    """When the run in ``run_dir`` first started (``time.time()``): the ``"started"`` its `RUN_FILE` kept when
    resuming; else, resuming, the earliest time the run's own files record (`_earliest_written`); else now (a
    new run, or one whose earlier processes wrote nothing that says when).

    A resumed run without ``"started"`` (made before it was kept, or its run file lost) already holds system
    samples: counted from now, the new steps started below theirs, and TensorBoard's server hid every earlier
    one. Counted from when its files were first written, they are above them (a run made before ``"started"``
    stepped in seconds since each process's start, far below milliseconds since the run's first file)."""
    if resume:
        try:
            started = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8")).get("started")
            if isinstance(started, (int, float)) and not isinstance(started, bool) and started > 0:
                return float(started)
        except (OSError, ValueError, AttributeError):
            pass
        earliest = _earliest_written(run_dir)
        if earliest is not None:
            return min(earliest, time.time())
    return time.time()


def _earliest_written(run_dir: Path) -> Optional[float]:
    """The earliest wall time the run folder's own files record: a TensorBoard event file's name holds the
    whole second it was made in (``events.out.tfevents.<seconds>.<host>...``, in the folder and its ``system``
    run), a JSONL line its ``"time"``. None when neither is there."""
    times: List[float] = []
    for folder in (run_dir, run_dir / "system"):
        for path in folder.glob("events.out.tfevents.*"):
            with contextlib.suppress(IndexError, ValueError):
                times.append(float(path.name.split(".")[3]))
    with contextlib.suppress(OSError, ValueError, AttributeError), \
            (run_dir / "metrics.jsonl").open(encoding="utf-8") as lines:
        for line in itertools.islice(lines, 64):  # the first lines: a record's "time" comes within a few
            found = json.loads(line).get("time") if line.strip() else None
            if isinstance(found, (int, float)) and not isinstance(found, bool) and found > 0:
                times.append(float(found))
                break
    return min(times) if times else None


def save_ids(run_dir: Path, backends: Sequence[Any], quiet: bool = False, run_id: Optional[str] = None,
             force: bool = False, started: Optional[float] = None) -> bool:
    """Write the open backends' run ids (``Backend.resume_id``) and the run's ``run_id`` to `RUN_FILE`,
    atomically, when a backend has an id, ``started`` is given, or ``force``; True once written. ``started``
    (`first_start`) is written when the file has none. ``quiet``: a file that cannot be written (a full disk at
    close) is said in a warning instead of raised. Ids already in the file are kept unless a backend of that
    name has one now (a closed W&B backend no longer has its id), and so is the run id already there when
    ``run_id`` is None."""
    ids = {b.name: b.resume_id for b in backends if getattr(b, "resume_id", None)}
    if not ids and not force and started is None:
        return False
    kept: Any = {}
    try:
        ids = {**resume_ids(run_dir), **ids}
        kept = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (ConfigurationError, OSError, ValueError):  # no run folder or file yet, or not a run file of ours
        pass
    data = {**(kept if isinstance(kept, dict) else {}), "backends": ids}
    found = data.get("run_id")
    run_id = run_id or (found if isinstance(found, str) and found else None)
    if run_id:
        data["run_id"] = run_id
    else:
        data.pop("run_id", None)
    if started is not None:
        data.setdefault("started", started)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / (RUN_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, run_dir / RUN_FILE)
        return True
    except OSError as exc:
        if not quiet:
            raise
        log.warning("instrument: could not save the run's ids to %s (%s); resume=True would start new W&B and "
                    "MLflow runs, and refuse this run's checkpoints as another folder's", run_dir / RUN_FILE, exc)
        return False


@contextlib.contextmanager
def removed_if_start_fails(run_dir: Path, resume: bool, close: Callable[[str], None]) -> Iterator[None]:
    """Around a session's start: if it raises (any exception, Ctrl-C too), ``close(status)`` ends what did
    open (``"killed"`` for Ctrl-C, else ``"failed"``), then the run folder is put back as it was, and the
    original exception goes on.

    Only a folder this start made is touched: one that did not exist (removed) or was empty (emptied again),
    on rank 0, when not resuming. Anything that existed before is left alone, and so is everything outside
    the folder (a backend pointed elsewhere, MLflow's store in ``log_dir``). A folder that cannot be removed,
    or where a writer thread started meanwhile is still running (it may still write there), is left with a
    warning; the start's own error is raised either way.
    """
    claimed = run_dir in _claims  # by `run_name_for`, on rank 0
    existed = _claims.pop(run_dir) if claimed else run_dir.is_dir()
    owned = claimed or (not resume and rank() == 0 and not is_used(run_dir))  # rank 0 writes; others read
    writers = set(running_writers())
    try:
        yield
    except BaseException as exc:
        try:
            try:
                close("killed" if shutdown.interrupted(exc) else "failed")
            except Exception as close_exc:  # the start's own error matters more; say it and go on
                log.warning("instrument: closing a session whose start failed raised %s: %s",
                            type(close_exc).__name__, close_exc)
        finally:  # also after a second Ctrl-C inside close: never leave the claim behind
            try:
                if claimed:
                    _release(run_dir)
                if owned and run_dir.exists():
                    _undo_folder(run_dir, existed, [t for t in running_writers() if t not in writers])
            finally:  # after the folder is put back: no other process starts in it while it is undone
                run_lock.unlock(run_dir)
        raise
    if claimed:  # started: what it wrote keeps the folder taken (`is_used`)
        _release(run_dir)
        if not existed:
            _made.add(run_dir)


def release(run_dir: Path) -> None:
    """The session closed: another process may now resume the run (`run_lock`). A folder its start made that
    stayed empty (no backend, run log or run file wrote there) is removed, so a run kept in memory leaves no
    empty ``<log_dir>/<run_name>`` behind; ``rmdir`` removes only an empty folder, so anything written there
    since, by anyone, keeps it."""
    run_lock.unlock(run_dir)  # removes the lock file first
    if run_dir in _made:
        _made.discard(run_dir)
        try:
            run_dir.rmdir()
        except OSError:  # not empty (the common case), or gone
            return
        _emptied.add(run_dir)


def _undo_folder(run_dir: Path, existed: bool, writers: Sequence[Any]) -> None:
    name = run_dir.name
    if writers:  # it may still write there: removing the folder under it would lose or mix files
        log.warning("instrument: the start of run %r failed; its writer is still closing, so %s was left in "
                    "place: delete it before starting run_name=%r again", name, str(run_dir), name)
        return
    error: Optional[OSError] = None
    for attempt in range(3):  # a service that closes its files a moment later (W&B) gets another try
        try:
            for child in list(run_dir.iterdir()) if existed else [run_dir]:
                _remove(child)
            error = None
            break
        except OSError as exc:
            error = exc
            time.sleep(0.2 * (attempt + 1))
    if error is not None or is_used(run_dir):
        log.warning("instrument: the start of run %r failed and %s could not be removed (%s): delete it before "
                    "starting run_name=%r again", name, str(run_dir), error or "it is not empty", name)
    else:
        log.warning("instrument: the start of run %r failed; removed what it had written to %s, so "
                    "run_name=%r can be used again", name, str(run_dir), name)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass  # gone already
