"""MLflow: a local tracking store per log_dir by default (shared by its runs), so no server is needed."""

import contextlib
import logging
import re
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from instrument.backends.base import Backend, PartialWriteError, RunInfo, StepRecord, under_user
from instrument.backends.drops import Drops, utf8
from instrument.backends.mlflow_media import media_count, write_media
from instrument.backends.mlflow_names import MAX_IMAGE_KEY, MAX_KEY, NAMES_TAGGED, SYSTEM_HEADS, RunNames, is_system
from instrument.backends.mlflow_store import (
    LAST_STEP_TAG,
    check_uri,
    http_settings,
    is_file_store,
    is_remote,
    is_unreachable,
    last_step,
)
from instrument.backends.store_lock import held
from instrument.backends.video import MediaWriteError, raise_failures
from instrument.checks import check_int, check_number
from instrument.errors import ConfigurationError, require

__all__ = ["MlflowBackend"]

# MLflow's batch limits and name rules (mlflow/utils/validation.py).
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_CHANGED = "instrument.param/"  # run tags holding a param's later values (MLflow params cannot change)
log = logging.getLogger("instrument")

# MLflow's own bounds on these settings (mlflow/environment_variables.py, _validate_max_retries/backoff).
_MAX_RETRIES_LIMIT = 10
_MAX_BACKOFF_LIMIT = 120
_END_STATUS = {"killed": "KILLED", "failed": "FAILED"}
class _Waiting(ConnectionError):
    """A call skipped because the server was unreachable, or the run failed to open, within ``retry_after``."""


class MlflowBackend(Backend):
    """Logs metrics with `MlflowClient.log_batch`, params from the operative gin config, images as artifacts.

    Uses its own `MlflowClient` (no global ``mlflow.set_tracking_uri``), so several runs or backends in one
    process do not interfere. Needs ``pip install 'torch-instrument[mlflow]'``; imported when the run opens.

    Args:
        tracking_uri: None means one store per ``log_dir``, shared by its runs: ``sqlite:///<log_dir>/mlflow.db``
            with artifacts in ``<log_dir>/mlartifacts`` (no server; compare the runs with ``mlflow ui
            --backend-store-uri sqlite:///<log_dir>/mlflow.db``). Any
            MLflow URI works: ``http://host:5000``, ``sqlite:///path.db``, ``file:/path/mlruns`` (MLflow 3
            accepts file stores only with ``MLFLOW_ALLOW_FILE_STORE=true``).
        experiment_name: created when missing.
        run_name: None means the instrument run's name.
        tags: extra run tags.
        artifact_location: where a newly created experiment stores artifacts; None means
            ``<log_dir>/mlartifacts``
            with the default tracking URI and the server's default otherwise.
        timeout: seconds one HTTP request to a tracking server may take (connect, and then each read) before
            MLflow gives it up. MLflow's own default is 120.
        max_retries: retries of a failed request (connection refused, timeout, HTTP 429/5xx); MLflow's own
            default is 7, with backoff that reaches minutes.
        backoff_factor: seconds; retry ``n`` (n >= 2) first waits ``backoff_factor * 2 ** (n - 1)`` (plus up to
            a second of jitter). MLflow's own default is 2.
        retry_after: seconds during which, after a call failed to reach the server (or opening the run failed,
            whatever the cause), later calls fail at once instead of waiting for the same dead server again (0
            turns this off).

    Faults: every MLflow call of this backend to a server runs with ``MLFLOW_HTTP_REQUEST_TIMEOUT``,
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` set from the options above
    (calls made at once by several backends share the first one's: `mlflow_store.http_settings`),
    so one call against an unreachable server gives up after about ``(max_retries + 1) * timeout`` seconds
    plus backoff and raises. MLflow reads these from the process environment at each request, so they are set
    just around this backend's calls (another thread's MLflow calls made at that moment see them too). Driven
    by a `Logger` under ``on_backend_error="warn"``, or when opening outlasted ``open_timeout``, a backend
    whose opening failed because the store did not answer stays in the run (``reopens``): each later record
    tries to open the run again, at most once per ``retry_after`` seconds and without MLflow's own retries
    (whatever made the open fail: an unknown resume id too), and the records before it opens are not written
    to it (docs/backends.md). A bad option or a missing extra is not retried. `on_exit`
    ("killed"/"failed") makes `close` end the run KILLED or FAILED instead of FINISHED.

    What goes where: scalars -> metrics (training ``step``; system metrics use milliseconds since the run first
    started as their step); hyperparameters -> params (values cut to 6000 characters), the operative config ->
    ``config/operative_config.gin``; images -> ``log_image(key=, step=)`` (one image card per key, with a step
    slider; MLflow stores them under ``images/``); text -> ``text/<key>/step_<step:08d>.txt``; validation
    samples -> ``samples/<tag>/step_<step:08d>.json``; videos -> animated GIFs
    ``videos/<key>/step_<step:08d>.gif`` (encoded with Pillow; a video that cannot be written costs that video
    only). Histograms are not logged (MLflow has no such type). Names are sanitised to MLflow's allowed
    characters; two metric keys that would share a name are kept apart (`RunNames`).

    Reuse: one instance given to run after run (`open` again after `close`) starts each with nothing of the
    run before (`_new_run`): its store (unless ``tracking_uri`` was given), held steps, params, names, status.
    """

    reopens = True  # a store that did not answer at open is tried again at later records (class doc)

    @property
    def remote(self) -> bool:
        """A tracking server (or a database or plugin store): the logger calls it on a thread of its own, so
        that a server that does not answer costs this backend alone its steps (`Backend.remote`)."""
        return is_remote(self._given_uri)

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: str = "instrument",
        run_name: Optional[str] = None,
        tags: Optional[Mapping[str, Any]] = None,
        artifact_location: Optional[str] = None,
        timeout: int = 10,
        max_retries: int = 2,
        backoff_factor: int = 1,
        retry_after: float = 30.0,
    ) -> None:
        check_uri(tracking_uri)
        self.timeout = check_int("MlflowBackend.timeout", timeout, least=1, why="MLflow reads it as whole seconds",
                                 fix="bind e.g. MlflowBackend.timeout = 10")
        self.max_retries = check_int("MlflowBackend.max_retries", max_retries, least=0, most=_MAX_RETRIES_LIMIT,
                                     why="MLflow's limit", fix="bind e.g. MlflowBackend.max_retries = 2")
        self.backoff_factor = check_int("MlflowBackend.backoff_factor", backoff_factor, least=0,
                                        most=_MAX_BACKOFF_LIMIT, why="MLflow's limit",
                                        fix="bind e.g. MlflowBackend.backoff_factor = 1")
        self.retry_after = check_number(
            "MlflowBackend.retry_after", retry_after, least=0, noun="a number of seconds",
            fix="bind e.g. MlflowBackend.retry_after = 30.0, or 0 to try the server on every call",
        )
        self._given_uri = tracking_uri  # None: each run's own log_dir store, also when given to a later run
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location
        self._new_run(None)

    def _new_run(self, run: Optional[RunInfo]) -> None:
        """Everything that belongs to one run, fresh at every `open`: one instance given to run after run (or to
        a resume, then a new run) kept the earlier run's last step (the new run's first steps were skipped as
        held), its store, params, names and end status. What the user gave stays."""
        self.tracking_uri = self._given_uri  # resolved in `open` when None
        self._store_lock = None  # the default store's lock file, a Path (`open`)
        self.client = None
        self.run_id: Optional[str] = None
        self._entities = None
        self._run: Optional[RunInfo] = run
        self._artifacts: Optional[str] = self.artifact_location
        self._end_status = "FINISHED"
        self._unreachable_until = 0.0
        self._names = RunNames()  # every key's MLflow name, per kind, and the run tags that write them down
        self._written: Optional[int] = None  # resumed: the last training step the run already holds
        self._media_step: Optional[int] = None  # a media-only step written whose run tag is not set yet
        self._params: Dict[str, str] = {}  # param name -> the value the run holds (MLflow cannot change one)
        self._drops = Drops(self.name)
        self._said_system: set = set()  # training keys under system/ moved to user/ (`_training_key`), said once
        self._held_params: Optional[Tuple[Dict[str, Any], Optional[str]]] = None  # logged before the run opened

    @contextlib.contextmanager
    def _bounded(self, retries: Optional[int] = None) -> Iterator[None]:
        """MLflow's HTTP timeout, retries and backoff set to this backend's options (``retries`` instead of
        ``max_retries`` when given) for one call."""
        if time.monotonic() < self._unreachable_until:
            raise _Waiting(
                f"MlflowBackend: {self.tracking_uri} was unreachable (or the run failed to open) less than "
                f"{self.retry_after:g} s ago; this call was skipped (retry_after)"
            )
        settings = {
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.timeout),
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(self.max_retries if retries is None else retries),
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(self.backoff_factor),
        }
        # A local store makes no HTTP request: its calls need no settings, and never wait for a server's.
        with http_settings(settings) if is_remote(self.tracking_uri) else contextlib.nullcontext():
            try:
                yield
            except Exception as exc:
                if is_unreachable(exc):
                    self._unreachable_until = time.monotonic() + self.retry_after
                raise

    def open(self, run: RunInfo) -> None:
        require("mlflow", "mlflow", "MlflowBackend")
        self._new_run(run)
        if self.tracking_uri is None:  # one store per log_dir: the runs of a project compare in one `mlflow ui`
            root = run.root
            root.mkdir(parents=True, exist_ok=True)
            self.tracking_uri = f"sqlite:///{(root / 'mlflow.db').resolve()}"
            self._store_lock = root / ".mlflow.db.lock"  # its first use creates it: one process at a time
            if self._artifacts is None:
                self._artifacts = (root / "mlartifacts").resolve().as_uri()
        self._names.folders = {} if is_file_store(self.tracking_uri) else None  # a name there is a file
        self._start()

    def _ensure_open(self) -> None:
        if self.run_id is None:
            if self._run is None:
                raise RuntimeError("MlflowBackend: open(run) must be called before anything else")
            self._start(retries=0)  # opening failed before: try again, once per request, bounded
            log.warning("instrument: MlflowBackend opened its run %s on a later try; the records before this "
                        "one were not written to it (the hyperparameters were kept and are logged now)",
                        self.run_id)
            held, self._held_params = self._held_params, None
            if held is not None:
                self.log_hyperparams(*held)

    def _start(self, retries: Optional[int] = None) -> None:
        try:
            with self._bounded(retries):
                self._create_run(self._run)
        except _Waiting:  # not a try: the wait it is in must not be pushed out by every call that meets it
            raise
        except Exception:  # whatever the cause, the next try waits retry_after (calls until then fail at once)
            self._unreachable_until = max(self._unreachable_until, time.monotonic() + self.retry_after)
            raise

    def _create_run(self, run: RunInfo) -> None:
        from mlflow import entities
        from mlflow.tracking import MlflowClient

        self._entities = entities
        artifacts = self._artifacts
        with held(self._store_lock):  # the default store: created and migrated by one process at a time
            self.client = client = MlflowClient(tracking_uri=self.tracking_uri)
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                try:
                    experiment_id = client.create_experiment(self.experiment_name, artifact_location=artifacts)
                except Exception:  # created meanwhile by another process
                    experiment = client.get_experiment_by_name(self.experiment_name)
                    if experiment is None:
                        raise
                    experiment_id = experiment.experiment_id
            else:
                experiment_id = experiment.experiment_id
        resumed = (run.resume or {}).get(self.name)
        if resumed:  # continue the same run; steps it already has are not written again
            client.update_run(client.get_run(resumed).info.run_id, status="RUNNING")
            written = last_step(client, resumed)
            data = client.get_run(resumed).data
            self._params = dict(data.params)
            self._names.restore(data.tags, data.metrics, data.params)  # each key keeps its name (its series)
            # Last: a resume that raised before here has no run id, so the next record opens it again, whole.
            self._written, self.run_id = written, resumed
            return
        self.run_id = client.create_run(
            experiment_id, run_name=self.run_name or run.name, tags={**self.tags, **NAMES_TAGGED}
        ).info.run_id

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        """Params MLflow does not hold yet. MLflow refuses to change a param, and one refused param fails its
        whole batch: a value already held is not sent again, and a changed one goes to the run tag
        ``instrument.param/<name>`` (tags can change), with one warning; the param keeps its first value."""
        if self.run_id is None:  # kept until the run opens: a run without its params cannot be compared
            held_params, held_text = self._held_params or ({}, None)
            self._held_params = ({**held_params, **params}, config_text if config_text is not None else held_text)
        self._ensure_open()
        Param, RunTag = self._entities.Param, self._entities.RunTag
        drops = self._drops  # MLflow stores text as UTF-8: lone surrogates escaped
        items, changed = {}, []
        for key, value in params.items():
            name = self._names.name(key, "param", "hyperparameter")
            text = utf8(drops, "hyperparameter", key, str(value))[:_MAX_PARAM_VALUE]
            held = self._params.get(name)
            if held is None:
                items[name] = text
            elif held != text:
                changed.append(RunTag(f"{_CHANGED}{name}"[:MAX_KEY], text))
                drops.say(name, "changed param", logging.WARNING,
                          "instrument: MLflow cannot change the param %r once logged: it keeps %r; the new value %r "
                          "is set as the run tag %r (later changes of it are logged at DEBUG only).",
                          name, held, text, changed[-1].key)
        with self._bounded():
            batch = list(items.items())
            for i in range(0, len(batch), _PARAMS_PER_BATCH):
                part = batch[i : i + _PARAMS_PER_BATCH]
                self.client.log_batch(self.run_id, params=[Param(name, text) for name, text in part])
                self._params.update(part)  # held from now on (a batch that raised is sent again next time)
            if changed:
                self.client.log_batch(self.run_id, tags=changed)
            if config_text:
                text = utf8(drops, "text", "config/operative_config.gin", config_text)
                self.client.log_text(self.run_id, text, "config/operative_config.gin")
            self._write_name_tags()  # last: a tag that fails costs none of the above

    def _metrics(self, scalars: Mapping[str, float], step: int, wall_time: float) -> list:
        Metric = self._entities.Metric
        timestamp = int(wall_time * 1000)
        names, name = self._names.table("metric")[0], self._names.name
        return [Metric(names.get(k) or name(k, "metric"), float(v), timestamp, int(step)) for k, v in scalars.items()]

    def _send_metrics(self, items: list) -> None:
        for i in range(0, len(items), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _METRICS_PER_BATCH])

    def _write_name_tags(self) -> None:
        """The run tags of keys named since the last call, after everything of the call that named them (a tag
        that fails costs no value: it is sent again with the next record)."""
        RunTag = self._entities.RunTag
        while tags := self._names.take_tags(_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=[RunTag(key, value) for key, value in tags])
            self._names.taken(len(tags))

    def _training_key(self, key: str) -> str:
        """A training metric's key: ``user/<key>`` (one warning) for one under ``system/``, where the system
        monitor's samples go, on their seconds axis: one MLflow series would mix training steps and seconds. A
        key already under ``user/`` that reduces to such a key moves one level further (`under_user`)."""
        name = under_user(key, is_system)
        if name is not key and key not in self._said_system:
            self._said_system.add(key)
            log.warning("instrument: MlflowBackend logs the training metric %r as %r: MLflow keys under system/ "
                        "hold the system monitor's samples, stepped in seconds, and one series would mix the two. "
                        "(Said once per key.)", key, name)
        return name

    def _media_name(self, kind: str, key: str) -> str:
        """A media key's MLflow name, unique within its kind (two tags that sanitise alike would overwrite each
        other's files). An image's is ASCII and at most `MAX_IMAGE_KEY` long: it names the image's files."""
        if kind == "image":
            return self._names.name(key, kind, limit=MAX_IMAGE_KEY, flags=re.ASCII)
        return self._names.name(key, kind)

    @property
    def resume_id(self) -> Optional[str]:
        return self.run_id

    def write(self, record: StepRecord) -> None:
        self.write_many((record,))

    def write_many(self, records: Sequence[StepRecord]) -> None:
        """The steps' metrics in as few ``log_batch`` requests as MLflow takes (1,000 metrics of any steps in
        each), then each step's media: a lane catching up on a slow server sends what waited in one request.
        A request that fails costs the steps with a metric in it (their media are not sent: as when each step is
        written apart); the others are written, and `PartialWriteError` counts the steps that failed. A call of
        which nothing reached the store raises what the store raised, as a single write does (a resumed run's
        call that it was given steps the run already held: a `PartialWriteError` that counts only the others)."""
        self._ensure_open()
        given = len(records)
        if self._written is not None:  # a resumed run: MLflow holds these steps from before the crash (no duplicates)
            records = [record for record in records if record.step > self._written]
        if not records:
            return
        try:
            self._write_steps(records)
        except PartialWriteError:
            raise
        except Exception as exc:
            if len(records) == given:
                raise
            raise PartialWriteError(
                f"{self.name}: steps {records[0].step}-{records[-1].step} could not be written ({type(exc).__name__}: "
                f"{exc}); the {given - len(records)} step(s) before them were held by the run from before the resume.",
                steps=len(records)) from exc

    def _write_steps(self, records: Sequence[StepRecord]) -> None:
        failed: List[Tuple[str, Exception]] = []  # a media value that fails costs that value only
        with self._bounded():
            lost, sent = self._send_steps(records, failed)  # the records whose metrics failed; any stored
            metrics, unstored = bool(lost), set()  # unstored: media-only steps of which nothing was stored
            for i, record in enumerate(records):
                if i in lost:
                    continue
                if time.monotonic() < self._unreachable_until:  # a request of an earlier step found it dead
                    if media_count(record):  # not waited for again per step (as `_bounded` skips a later write)
                        failed.append((f"step {record.step} media", self._skipped("this step's media values")))
                        lost.add(i)
                        unstored.add(i)
                    continue
                sent = sent or media_count(record) > 0  # a media request made: its failures are named (MediaWriteError)
                media = write_media(self.client, self.run_id, record, self._media_name, self._drops, len(records) > 1)
                failed += media
                if media:
                    lost.add(i)
                    if len(media) >= media_count(record):
                        unstored.add(i)
                if any(is_unreachable(exc) for _, exc in media):
                    self._unreachable_until = time.monotonic() + self.retry_after
            if failed and not sent and len(lost) == len(records):  # nothing of the call reached the store
                raise failed[0][1]
            # a media-only step stored (whole or in part) is one a resume must not write again: no metric holds it
            bare = [r.step for i, r in enumerate(records) if i not in unstored and not r.scalars and not r.timings]
            if bare:  # kept until the tag is set: a call that cannot set it leaves it to the next one, or to close
                self._media_step = max(bare + [self._media_step or 0])
            try:
                due = self._media_step is not None or self._names.take_tags(1)
                if due and time.monotonic() < self._unreachable_until:  # not waited for again in this call
                    raise self._skipped("these run tags")
                self._set_media_step()
                self._write_name_tags()
            except Exception as exc:  # the name tags are sent again with the next record; the values are written
                failed.append(("the run tags of its last media-only step or its keys' MLflow names", exc))
            span = records[0].step if len(records) == 1 else f"{records[0].step}-{records[-1].step}"
            raise_failures(self.name, span, failed, "metric request(s), media value(s) or run tag(s)" if metrics
                           else "media value(s) or run tag(s)", steps=max(1, len(lost)),
                           error=PartialWriteError if metrics else MediaWriteError)

    def _skipped(self, what: str) -> "_Waiting":
        """What a call made after one of its requests found the server unreachable says of what it skipped."""
        return _Waiting(f"MlflowBackend: {self.tracking_uri} was unreachable less than {self.retry_after:g} s ago; "
                        f"{what} were skipped (retry_after)")

    def _set_media_step(self) -> None:
        """Set the run tag naming the last media-only step written, if one is waiting for it."""
        if self._media_step is not None:
            self.client.set_tag(self.run_id, LAST_STEP_TAG, str(self._media_step))
            self._media_step = None

    def _send_steps(self, records: Sequence[StepRecord], failed: List[Tuple[str, Exception]]) -> Tuple[set, bool]:
        """Every step's metrics, 1,000 to a request: the indices of the records with a metric in a request that
        failed or was skipped (each named in ``failed``), and whether a request was stored. Once one finds the
        server unreachable the rest are skipped (each would wait for it again)."""
        items = [(i, metric) for i, record in enumerate(records)
                 for metric in self._metrics(self._training_scalars(record), record.step, record.wall_time)]
        lost, skipped, stored = set(), set(), False

        def named(steps: set) -> str:
            first, last = records[min(steps)].step, records[max(steps)].step
            return f"the metrics of step {first}" if first == last else f"the metrics of steps {first}-{last}"

        for start in range(0, len(items), _METRICS_PER_BATCH):
            part = items[start : start + _METRICS_PER_BATCH]
            steps = {i for i, _ in part}
            if time.monotonic() < self._unreachable_until:  # an earlier request of this call found it dead
                skipped |= steps - lost
                lost |= steps
                continue
            try:
                self.client.log_batch(self.run_id, metrics=[metric for _, metric in part])
                stored = True
            except Exception as exc:
                lost |= steps
                failed.append((named(steps), exc))
                if is_unreachable(exc):
                    self._unreachable_until = time.monotonic() + self.retry_after
        if skipped:
            failed.append((named(skipped), self._skipped("these")))
        return lost, stored

    def _training_scalars(self, record: StepRecord) -> Dict[str, float]:
        scalars = record.flat_scalars()
        if any(key.startswith(SYSTEM_HEADS) for key in scalars):
            scalars = {self._training_key(key): value for key, value in scalars.items()}
        return scalars

    def write_system(self, record: StepRecord) -> None:
        self._ensure_open()
        with self._bounded():
            self._send_metrics(self._metrics(record.scalars, record.step, record.wall_time))
            self._write_name_tags()

    def flush(self) -> None:
        """Nothing to do: every call above has reached the store (or raised) when it returns."""

    def on_exit(self, status: str) -> None:
        """Make `close` end the run KILLED (``"killed"``) or FAILED (``"failed"``) instead of FINISHED."""
        if status not in _END_STATUS:
            raise ConfigurationError(
                f"MlflowBackend.on_exit got status {status!r}; expected one of {tuple(_END_STATUS)}."
            )
        self._end_status = _END_STATUS[status]

    def close(self) -> None:
        client, run_id = self.client, self.run_id
        self.client = None
        self._run = None  # no reopening after close
        if client is not None and run_id is not None:
            self._unreachable_until = 0.0  # the end status is worth one more bounded try
            with self._bounded():
                if self._media_step is not None:  # a media-only step's run tag no call could set
                    try:
                        client.set_tag(run_id, LAST_STEP_TAG, str(self._media_step))
                    except Exception as exc:  # the end status still counts, unless the server is gone
                        if is_unreachable(exc):
                            raise
                client.set_terminated(run_id, self._end_status)

    def __repr__(self) -> str:
        return (
            f"MlflowBackend(tracking_uri={self.tracking_uri!r}, experiment_name={self.experiment_name!r}, "
            f"run_name={self.run_name!r})"
        )
