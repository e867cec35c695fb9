"""`Instrumentation`: the session that ties probes, observers, the logger and its backends together.

It decides which steps log (``is_logging_step``), attaches hooks to watched modules and turns their embedded
probes on only for those steps and undoes both afterwards (also when the step raises), runs the observers'
lifecycle, runs the registered step components (`add_component`; the RL metrics are ones) and commits the
logger once per logging step. On every other step it does nothing at all: no hook is registered, no probe is
on, no observer runs, no value leaves the device.
"""

import collections
import dataclasses
import logging
import numbers
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Set, Union

from torch import nn

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.checks import check_int
from instrument.core.dispatch import Dispatcher, ObserverLike
from instrument.core.loss_scale import LossScale
from instrument.core.observer import check_observers
from instrument.core.overhead import OverheadMeter
from instrument.core.step_components import ComponentHandle, StepComponents
from instrument.errors import ConfigurationError, InvalidValueError
from instrument.logger import shutdown
from instrument.logger.lifecycle import check_timeout
from instrument.logger.logger import Logger
from instrument.logger.steps import MAX_STEP, step_range_message
from instrument.probes import record
from instrument.probes.compiled import unwrap
from instrument.probes.embedded import ProbeSet, check_unique_names
from instrument.probes.hooks import StateWatch
from instrument.session import dropped
from instrument.session.checkpoint import flush_for_checkpoint, load_session_state, session_state
from instrument.session.config_log import ConfigLog, ConfigSource
from instrument.session.lifecycle import NO_FLUSH, StepLifecycle, run_all, stop_monitor
from instrument.session.run_folder import (
    first_start,
    release,
    removed_if_start_fails,
    resume_ids,
    run_name_for,
    save_ids,
)
from instrument.session.scope import StepScope, WatchHandle

__all__ = ["Instrumentation", "set_config_source"]

log = logging.getLogger("instrument")

_config_source: Optional[ConfigSource] = None


def set_config_source(source: Optional[ConfigSource]) -> None:
    """Install the provider of the operative config that each session logs at its first step.

    ``source()`` returns ``({"Configurable.param": value}, config_text)``. `instrument.config` installs gin's
    operative config here when it is imported, so the session logs it without importing gin itself; None
    removes it (a run configured in plain Python then logs only its own hyperparameters).
    """
    global _config_source
    _config_source = source


class Instrumentation(StepLifecycle):
    """Observers, backends and a logging schedule for one training run.

    Args:
        observers: `Observer` instances (or plain ``callable(context)`` functions) run on logging steps.
        backends: where committed steps go; None means ``[TensorBoardBackend()]`` under ``runs/<run_name>``.
        log_interval: a step logs when ``step % log_interval == 0``; 0 turns logging off entirely (``inst.log``
            stages nothing; what you hand to ``inst.logger`` yourself is still written).
        run_name: the run's folder name; None means the start time plus a random suffix,
            ``YYYYmmdd-HHMMSS-xxxxxx`` (unique even for jobs started in the same second). A name with ``..``, a
            path separator or an absolute path is refused, and so is one whose folder is not empty (unless
            ``resume``): nothing is written outside ``log_dir`` and two runs never share a folder.
        log_dir: the folder that holds every run (``<log_dir>/<run_name>``); a leading ``~`` is the home folder.
        hyperparams: logged once at the first step, with the operative gin config when gin is in use (a run
            that commits only through ``inst.logger`` logs them at close).
        on_step_regression: ``"raise"`` or ``"warn"`` when a logged step goes backwards.
        system_monitor: e.g. `instrument.SystemMonitor()`: started here (on rank 0 only) and stopped by
            `close`; it writes ``system/...`` metrics on its own wall-clock axis.
        run_log: True writes a verbose DEBUG log file into the run folder and terse ``instrument`` messages to
            the terminal (`instrument.terminal.runlog.setup_run_logging`); a callable taking
            ``(run_dir=, run_name=)`` (e.g. gin's ``@setup_run_logging``) sets it up its own way. Closed with
            the session. One run log takes the messages at a time: the latest opened, until it is closed.
        queue_size, on_full, flush_secs: passed to the `Logger`: how many committed steps may wait for its
            writer thread, what a full queue does (``"block"`` or ``"drop"`` the oldest), and how soon a
            written step is flushed to disk (docs/backends.md).
        overhead_budget: logging steps measure their own cost, logged as ``instrument/overhead/...`` with a
            later logging step (`instrument.core.overhead`); the first time the fraction exceeds this budget one
            warning names what cost the most (`costliest`). None turns both off; 1.0 keeps the keys, never warns.
        channel_dim: the dimension of the watched states that holds channels, said once for every observer
            (1 for ``[B, C, H, W]``, -1 for channels-last ``[B, H, W, C]``). An observer's own ``channel_dim``
            wins; observers whose ``channel_dim`` is None take this one; with neither, each observer's
            documented default applies (docs/observers.md).
        on_backend_error: a backend that cannot open (a missing extra, a bad option, an unreachable server):
            ``"raise"`` (default) raises a `ConfigurationError` here naming the backend, the cause and the fix;
            ``"warn"`` reports it and runs without it. The opens run on the logger's writer thread; this waits
            for them at most ``open_timeout`` seconds, then warns and goes on. A start that raises (Ctrl-C
            too) closes what opened and removes the run folder it made, so ``run_name`` is free again; what
            existed before, and files a backend wrote outside the folder, stay (docs/backends.md).
        secret_keys: glob patterns (case-insensitive) of more key names whose values are redacted before
            anything is written, added to the usual ones (``*token*``, ``*secret*``, ``*password*``,
            ``*api_key*``, cloud and W&B credential names: `instrument.logger.params.SECRET_PATTERNS`); e.g.
            ``Instrumentation.secret_keys = ['*cookie*']`` in gin.
        resume: continue the run ``run_name`` in ``log_dir`` (docs/backends.md, "Resuming a run"). A run that
            another live process still writes is refused, new or resumed (`instrument.session.run_lock`).
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop (also settable later:
            ``inst.grad_scaler = scaler``): gradient probes and `GradientStats` then log the gradients of the loss,
            not of the scaled loss, and `NonFinite` tells a skipped step's overflow from a divergence
            (`instrument.core.loss_scale`, docs/observers.md "Mixed precision").

    A step whose body raises commits nothing: the values staged inside it (``log_metrics``, timers, media)
    are discarded, never carried to a later step, and no observer logs.

    Under `torch.distributed`, build it on every rank: only rank 0 opens backends, every rank takes part in
    the reduction at each commit, and the first step checks that all ranks hold the same operative config.
    """

    def __init__(
        self,
        observers: Sequence[ObserverLike] = (),
        backends: Optional[Sequence[Backend]] = None,
        log_interval: int = 10,
        run_name: Optional[str] = None,
        log_dir: str = "runs",
        hyperparams: Optional[Dict[str, Any]] = None,
        on_step_regression: Literal["raise", "warn"] = "raise",
        system_monitor: Optional[Any] = None,
        run_log: Union[bool, Callable[..., Any]] = False,
        queue_size: int = 64,
        on_full: Literal["block", "drop"] = "block",
        flush_secs: float = 2.0,
        overhead_budget: Optional[float] = 0.1,
        channel_dim: Optional[int] = None,
        resume: bool = False,
        on_backend_error: Literal["raise", "warn"] = "raise",
        open_timeout: float = 60.0,
        secret_keys: Sequence[str] = (),
        grad_scaler: Optional[Any] = None,
    ) -> None:
        check_int("channel_dim", channel_dim, none=True, why="1 for [B, C, H, W], -1 for [B, H, W, C]",
                  fix="bind e.g. Instrumentation.channel_dim = 1")
        overhead = OverheadMeter.for_budget(overhead_budget)  # None when off; raises on a bad budget first
        check_int("log_interval", log_interval, least=0, expected="a non-negative int", why="0 turns logging off",
                  fix="bind e.g. Instrumentation.log_interval = 10")
        observers = check_observers(observers)  # a list: a generator is read once
        if system_monitor is not None and (isinstance(system_monitor, type) or not hasattr(system_monitor, "start")):
            raise ConfigurationError(f"system_monitor must be None or an instance such as SystemMonitor() (in gin: "
                                     f"@SystemMonitor(), note the ()), got {system_monitor!r}.")
        if backends is None:
            from instrument.backends.tensorboard import TensorBoardBackend

            backends = [TensorBoardBackend()]
        self.observers: List[ObserverLike] = list(observers)
        self.channel_dim = channel_dim
        for obs in self.observers:  # observers whose own channel_dim is None fall back to the session's
            if hasattr(obs, "channel_dim"):
                obs.session_channel_dim = channel_dim
        self.log_interval = log_interval
        self.hyperparams = dict(hyperparams or {})  # before the run folder is claimed: nothing after it raises
        root = Path(log_dir).expanduser()  # '~/runs' is the home folder's, as a shell would read it
        name, self._run_id, self._run_id_kept = run_name_for(run_name, root, resume)  # rank 0 holds its lock now
        self._run_id_saved = resume and self._run_id_kept  # in run.json (`checkpoint.session_state` saves it)
        self._resumed_at: Optional[int] = None  # the last_step load_state_dict resumed at, -1 for None (`checkpoint`)
        self.run = RunInfo(name=name, root=root, resume=None)
        self.run_log: Any = None
        self._dispatch = Dispatcher(self.observers)
        self._components = StepComponents()
        self._watches: List[StateWatch] = []
        self._probe_sets: List[ProbeSet] = []
        self._recorder: Optional[record.Recorder] = None
        self._current: Optional[StepScope] = None
        self._scope: Optional[StepScope] = None  # the open `with inst.step(n)` block, logging or not
        self._closed = False
        self.overhead_budget = overhead_budget
        self._overhead = overhead
        self._overhead_warned = False
        self._discard_reported = False
        self._mixed_said = self._twice_said = False  # said by `_report_mixed`
        self._observed_twice = (0, "")  # this step's s.observer calls given a state a watch delivered, its name
        self._said_undelivered: Set[str] = set()  # probes whose values came after the last observer call
        self._flush_on_commit: Any = NO_FLUSH  # a checkpoint counted the open step: flush its commit (`_end`)
        self._block_committed: Optional[int] = None  # the step the last logging block committed (`_begin`)
        self._step_thread: Optional[int] = None  # the thread that opened the current logging block (`close`)
        self._said_staged = False  # a checkpoint left an unfinished interval's staged values out (`state_dict`)
        self._said_slow_checkpoint = False  # a checkpoint's flush timed out (`flush_for_checkpoint`)
        self.system_monitor = system_monitor
        self._loss_scale: Optional[LossScale] = None
        self.grad_scaler = grad_scaler  # checked before the run folder is claimed
        # SIGTERM during the start undoes it as Ctrl-C does, then ends the process (`shutdown.starting`)
        with shutdown.starting(), removed_if_start_fails(self.run.dir, resume, self._abort_start):
            if resume:  # a run file that cannot be read raises here, which releases the lock
                self.run = RunInfo(name=name, root=root, resume=resume_ids(self.run.dir))
            if system_monitor is not None:  # the origin of its steps, kept in run.json: they go on after a resume
                self.run = dataclasses.replace(self.run, started=first_start(self.run.dir, resume))
            if run_log:  # before the logger, so what backends print while opening is in the file too
                from instrument.terminal.runlog import setup_run_logging

                setup = setup_run_logging if run_log is True else run_log
                if not callable(setup):
                    raise ConfigurationError(f"run_log must be True, False or a callable, got {run_log!r}.")
                self.run_log = setup(run_dir=self.run.dir, run_name=self.run.name)
            self.logger = Logger(
                backends, self.run, on_step_regression=on_step_regression, queue_size=queue_size,
                on_full=on_full, flush_secs=flush_secs, on_backend_error=on_backend_error,
                open_timeout=open_timeout, secret_keys=secret_keys,
            )
            if self.logger.is_writer:
                self._run_id_saved |= save_ids(self.run.dir, self.logger.backends, run_id=self._run_id,
                                               started=self.run.started)  # what resume=True reads back
                if system_monitor is not None:
                    system_monitor.start(self.logger)
        self._config = ConfigLog(self, self.logger, lambda: _config_source)  # started: at close if not before
        dropped.say_dropped()  # earlier sessions that were never closed (a notebook cell run again)
        dropped.track(self, self.logger, self.run.dir)

    def _abort_start(self, status: str) -> None:
        """The start failed: end what did start (`removed_if_start_fails` then removes the new run folder)."""
        try:
            if getattr(self, "logger", None) is not None:
                self.logger.close(status, self.logger.open_timeout)  # bounded: an open may hang
        finally:
            if self.run_log is not None:
                self.run_log.close()

    # ------------------------------------------------------------------ public API
    def watch(
        self,
        module: nn.Module,
        *,
        freeze_channels: Optional[Sequence[int]] = None,
        name: str = "",
        state: Optional[bool] = None,
    ) -> WatchHandle:
        """Observe ``module`` on logging steps: its calls (state hook) and the `Probe`s embedded in it.

        With ``state=True`` (the default; ``None`` means True) each call becomes a `StepContext` with the
        probe values recorded during it, so the module's forward must be one rollout iteration. Eager and
        compiled modules get a forward hook. A ScriptModule's calls from Python are seen by a global forward
        hook (logging steps only); its calls from TorchScript code only through the call boundary that
        `instrument.script` compiles in (docs/probes.md, "Watching scripted and loaded models"). With
        ``state=False`` only the embedded probes are switched on; their values reach observers through
        ``s.observer(StepContext(...))`` calls (the explicit evolver style): for a model whose forward is a whole
        rollout, or whose loop calls ``s.observer`` itself. A ``torch.compile`` wrapper and its module are one.
        Nothing is registered on the module now: hooks exist and probes are on only inside logging steps.
        """
        if self._closed:
            raise ConfigurationError("this Instrumentation is closed, so watch() would observe nothing; create a new "
                                     "one for another run.")
        if state is not None and not isinstance(state, bool):
            raise ConfigurationError(f"watch(state=...) takes True, False or None, got {state!r} "
                                     f"({type(state).__name__}).")
        inner, watched = unwrap(module), [w.module for w in self._watches] + [p.module for p in self._probe_sets]
        if any(unwrap(m) is inner for m in watched):  # a compile wrapper and its module: one module, one hook
            raise ConfigurationError(f"{type(inner).__name__} is already watched (or its torch.compile wrapper is) "
                                     f"by this session: watch it once (new probes: remove() its handle, rewatch).")
        probes = ProbeSet(module, label=name or type(module).__name__)
        check_unique_names(self._probe_sets, probes)
        if state is False and not probes:
            raise ConfigurationError(
                f"watch({type(inner).__name__}, state=False) would observe nothing: state=False watches only the "
                f"instrument.Probe modules embedded in it, and it has none. Watch it with state=True (its forward "
                f"is one rollout iteration), or embed Probes in it."
            )
        watch = None
        if state is None or state:  # None means True
            watch = StateWatch(module, self._dispatch, freeze_channels=freeze_channels, name=name)
            self._watches.append(watch)
        if probes:
            self._probe_sets.append(probes)
        if self._current is not None:
            self._probes_on()
            if watch is not None:
                watch.attach()
        return WatchHandle(self, watch, probes if probes else None)

    @property
    def grad_scaler(self) -> Optional[Any]:
        """The ``torch.amp.GradScaler`` whose loss scale gradients are divided by (None: no loss scaling)."""
        return None if self._loss_scale is None else self._loss_scale.scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: Optional[Any]) -> None:
        if self._current is not None:
            raise ConfigurationError(
                f"grad_scaler was set inside logging step {self._current.step}; set it before the step starts "
                f"(right after making the scaler), so that the whole step reads its gradients one way."
            )
        self._loss_scale = None if scaler is None else LossScale(scaler)
        for obs in self.observers:  # observers that read parameters' gradients ask it whether they are scaled
            if getattr(type(obs), "wants_loss_scale", False):
                obs.loss_scale = self._loss_scale

    @property
    def watched_modules(self) -> List[nn.Module]:
        """The modules watched with `watch`, in watch order (each once); observers get them in ``attach``."""
        modules: List[nn.Module] = []
        for module in [w.module for w in self._watches] + [p.module for p in self._probe_sets]:
            if not any(m is module for m in modules):
                modules.append(module)
        return modules

    @property
    def probe_names(self) -> List[str]:
        """Names of the embedded probes in every watched model."""
        return [name for probes in self._probe_sets for name in probes.names]

    def is_logging_step(self, step: int) -> bool:
        return self.log_interval > 0 and step % self.log_interval == 0

    def step(self, step: int) -> StepScope:
        """Context manager for one training step; on logging steps it runs the observer lifecycle."""
        if self._closed:
            raise ConfigurationError("this Instrumentation is closed; create a new one for another run.")
        if type(step) is not int and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise InvalidValueError(f"inst.step takes an int step, got {type(step).__name__} ({step!r}).")
        if not 0 <= step <= MAX_STEP:
            raise InvalidValueError(step_range_message(f"inst.step({step}): the step", step))
        last = self.logger._last_step
        if last is not None and step < last and self.logger.on_step_regression == "raise":
            self.logger._step_regressed(step, last)  # at the start, before the body and the observers run
        if not self._config.logged:
            self._config.log()
        return StepScope(self, step, self.is_logging_step(step))

    def log(self, metrics: Mapping[str, Any], prefix: str = "", **options: Any) -> None:
        """Log scalars at the step of the open ``with inst.step(n)`` block (the ``wandb.log`` habit):
        ``inst.logger.log_metrics(metrics, step=n, prefix=prefix, **options)`` (``reduce``, ``weights``). On a
        non-logging step it is staged on the device and committed as the interval's mean at the next logging
        step. Outside a step block it raises `ConfigurationError`: there is no step to log at."""
        scope = self._scope
        if scope is None:
            raise ConfigurationError(
                "inst.log(...) was called outside a `with inst.step(n):` block, so there is no step to log at. "
                "Call it inside the block of the step it belongs to, or pass the step explicitly: "
                "inst.logger.log_metrics(metrics, step=n)."
            )
        if self.log_interval:  # 0: logging is off, and nothing staged here would ever reach a logging step
            self.logger.log_metrics(metrics, scope.step, prefix=prefix, **options)

    def add_component(self, component: Any, name: Optional[str] = None, logs: bool = True) -> ComponentHandle:
        """Register end-of-step work: ``component.log(logger, step)`` runs at the end of every logging step,
        right before the commit, and ``component.close()`` when the session closes. ``name`` (default: the class
        name) keys it in `failures`; a component that raises there is reported once and skipped, the others and
        the commit go on. With ``logs=False`` only its ``close`` and the handle's guarded ``call`` are used.
        Returns a `ComponentHandle`: ``remove()`` unregisters it; ``call(method, ...)`` runs another of its
        methods under the same guard. Refused once the session is closed (``log`` and ``close`` would not run)."""
        if self._closed:
            raise ConfigurationError("this Instrumentation is closed; create a new one for another run.")
        return self._components.add(component, name, logs)

    def commit_step(self, step: int) -> Optional[StepRecord]:
        """End logging step ``step`` where no ``with inst.step(...)`` block frames it: the components stage
        their values and the logger commits once. For loops whose step is known only at its end (`RLLogging`
        with ``step_unit="frames"``, an evaluation off the cadence). Inside the open block of the same step it
        does nothing and returns None: the block's exit does both, once (W&B drops a second write to a committed
        step). Returns the committed record."""
        if self._closed:
            raise ConfigurationError("this Instrumentation is closed; create a new one for another run.")
        if self._current is not None:
            if self._current.step != step:
                raise ConfigurationError(
                    f"commit_step({step}) inside the open `with inst.step({self._current.step})` block; "
                    f"commit the block's own step, or end the block first."
                )
            return None
        if not self._config.logged:  # a loop that commits only here (RLLogging) logs its config too
            self._config.log()
        self._components.log(self.logger, step)
        record = self.logger.commit(step, paired=False)  # the ranks' steps may differ here (RLLogging's frames)
        self._flush_checkpointed()  # a checkpoint counted this step ahead of its commit (`instrument.rl.resume`)
        return record

    @property
    def open_step(self) -> Optional[int]:
        """The step of the open ``with inst.step(...)`` block, logging or not, else None."""
        scope = self._scope
        return scope.step if scope is not None else None

    @property
    def active_step(self) -> Optional[int]:
        """The logging step whose ``with inst.step(...)`` block is open (it commits on exit), else None."""
        return self._current.step if self._current is not None else None

    @property
    def failures(self) -> Dict[str, int]:
        """Observer, backend and component name -> number of failures so far. A name that two kinds share (an
        observer named like a backend) is kept apart as ``"observer <name>"``, ``"backend <name>"``..."""
        kinds = (("observer", self._dispatch.failures), ("backend", self.logger.failures),
                 ("component", self._components.failures))
        seen = collections.Counter(name for _, counts in kinds for name in counts)
        return {name if seen[name] == 1 else f"{kind} {name}": count for kind, counts in kinds
                for name, count in counts.items()}

    def state_dict(self, flush_timeout: Optional[float] = 10.0) -> Dict[str, Any]:
        """What a checkpoint keeps to resume this run: its name and id (kept in the run folder's run.json), the
        last committed step, whether the config was logged, the heatmaps' ``color_range="running"`` ranges. Save
        it with the model; pass it to `load_state_dict` of ``Instrumentation(resume=True)``.

        It first waits (at most ``flush_timeout`` seconds; None: as long as it takes, 0: not at all) until
        every step committed before it is written and flushed by every backend. Resuming from this checkpoint
        never writes those steps again, so a process killed hard right after the save (SIGKILL, an OOM kill,
        ``os._exit``) would otherwise lose the ones still on the writer thread. Past the timeout (a slow remote
        backend) it says so and returns: the steps are still written unless the process dies first.

        Inside the open block of a logging step, that step counts as committed (it commits when the block
        exits): a checkpoint saved there resumes at the next step, and the step stays in the files. Counted
        as not yet committed, resuming cut it out of every backend and nothing wrote it again. For the same
        reason a SIGTERM before the block exits still commits it (`Logger.keep_on_shutdown`)."""
        return session_state(self, flush_timeout)

    def _flush_for_checkpoint(self, timeout: Optional[float], what: str = "state_dict()") -> bool:
        return flush_for_checkpoint(self, timeout, what)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict`: the next step must follow its last committed step, and
        every backend is told that steps after it are written again (`Backend.on_resume`). Resuming, a checkpoint
        of another run (another name, or another folder's run id) is refused before anything changes: its step
        would cut this run's files (a new run may start from another run's checkpoint: it has nothing to cut). So
        is a second load of a later step than one already loaded (the first had the steps after it cut); the same
        or an earlier one, before any step, is where the run goes on from. Call it before anything is logged: a
        resumed session that committed a step, or one with values staged, is refused. The hyperparameters are
        logged again at this process's first step (``config_logged`` is not restored): a value changed on
        resume, or a backend new to the run, would otherwise never get them."""
        load_session_state(self, state)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every committed step is written and flushed by every backend; see `Logger.flush`."""
        return self.logger.flush(timeout)

    def close(self, status: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Commit anything still staged, write and flush it, and close every backend. Idempotent. ``status``
        ``"killed"`` or ``"failed"`` tells the backends the run ended abnormally (`Backend.on_exit`); leaving a
        ``with`` block by an exception does that. The backends' run ids are saved again for ``resume=True``.
        ``timeout`` (seconds) bounds the wait for the logger's writer (None: until every step is written); a
        close that gives up says how many committed steps were not written and which backend call held it."""
        timeout = check_timeout("close", timeout)  # before anything closes: a bad value never half-closes
        if self._closed:
            return
        interrupted: Optional[BaseException] = None
        scope = self._current
        if scope is not None and self._step_thread == threading.get_ident():
            # Closed inside a logging step's block (an early stop): that step ends first, whole. A step whose
            # block is not open (left open by an interrupt nothing else caught) ends as failed: never committed.
            try:
                self._end(scope, failed=status is not None or self._scope is not scope)
            except Exception:
                log.exception("instrument: ending logging step %d at close failed", scope.step)
            except BaseException as exc:
                interrupted = exc
        if not self._claim_close(interrupted):  # another thread's close() ran while this one ended its step
            return
        dropped.untrack(self)
        try:  # hooks, probes and the recorder off even after a step cut short by Ctrl-C (they outlive the session)
            run_all([watch.detach for watch in self._watches] + [self._release_probes])
        except Exception:
            log.exception("instrument: undoing the session's hooks and probes at close failed")
        except BaseException as exc:  # Ctrl-C here: the logger is still closed and the run folder released,
            interrupted = exc  # then it is raised (a second close() would do nothing: the session is closed)
        try:
            self._components.close()
            if self.system_monitor is not None:  # within the timeout: what is left of it goes to the logger
                timeout = stop_monitor(self.system_monitor, timeout)
        finally:
            try:
                self.logger.close(status, timeout)
                if self.logger.is_writer:  # again: a backend that opened late (`Backend.reopens`) has its id now
                    save_ids(self.run.dir, self.logger.backends, quiet=True, run_id=self._run_id)
                self._dispatch.close()
            finally:
                # another process may resume the run once nothing of this one writes to it any more: now, or
                # after a close that gave up, when its writer thread has stopped
                run_dir = self.run.dir
                self.logger.when_stopped(lambda: release(run_dir))
                if self.run_log is not None:
                    self.run_log.close()
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> "Instrumentation":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = None
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            status = "killed"
        elif exc_type is not None and not (issubclass(exc_type, SystemExit) and exc.code in (None, 0)):
            status = "failed"
        self.close(status)

    def __repr__(self) -> str:
        return (
            f"Instrumentation(observers={self.observers!r}, backends={self.logger.backends!r}, "
            f"log_interval={self.log_interval}, run={str(self.run.dir)!r})"
        )
