"""Weights & Biases: offline by default, so no account or network is needed until a user binds ``mode``."""

import io
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from instrument.backends.argv import redacted_argv
from instrument.backends.base import USER_HEAD, Backend, RunInfo, StepRecord, strip_user, under_user
from instrument.backends.drops import Drops, finite, utf8, utf8_keys
from instrument.backends.hparams import split_name, unflatten_params
from instrument.backends.video import encode_gif, raise_failures, write_each
from instrument.backends.wandb_log import offline_config, offline_keys, offline_last_step
from instrument.checks import check_number
from instrument.core.names import numbered
from instrument.errors import ConfigurationError, require
from instrument.terminal.samples import cell, columns

SCALAR = "scalar"  # the kind named in `_renamed` for a scalar moved off a media value's key
# W&B keeps the top-level keys that start with "_" for itself (_step, _runtime, _timestamp, _wandb): a value
# logged under one is silently replaced by W&B's own or replaces it. Keys under system/ are the system monitor's
# (W&B plots them against its seconds). Such a key of ours goes under user/, where a user's metric under a timer's
# key goes too (`StepRecord.flat_scalars`, `under_user`).
_RENAMED_HEADS = ("_", "system/", USER_HEAD)


_CONFIG = "operative_config"  # the run.config key of the operative gin config text
# The run.config key of the names escaped keys took (`Drops.key_state`), read back by a resumed run. It starts with
# "_": W&B's UI hides it, and no hyperparameter takes it (those go under user/).
_KEYS = "_instrument_keys"


def _underscored(key: str) -> bool:
    """A name whose first part in run.config (`split_name`: ``/`` and ``.`` separate, empty parts go) starts with
    ``_``: ``_lr``, and ``/_wandb`` or ``._x`` too."""
    return split_name(key)[0].startswith("_")


def _reserved(key: str) -> bool:
    return key[:1] == "_" or key.startswith("system/")


__all__ = ["WandbBackend"]

log = logging.getLogger("instrument")

_MODES = ("offline", "online", "disabled", "shared")
_EXIT_STATUSES = ("killed", "failed")


class WandbBackend(Backend):
    """Logs each committed step with ``run.log(..., step=step, commit=True)``.

    Images are logged as ``wandb.Image`` under the same key every step, so the W&B UI shows a step slider.
    Videos are logged as ``wandb.Video`` GIFs (encoded with Pillow, so no extra is needed; the files land in
    the run's ``media/videos``); a video that cannot be encoded costs that video only.
    Needs ``pip install 'torch-instrument[wandb]'``; the SDK is imported only when the run opens.

    Args:
        project: W&B project.
        mode: ``"offline"`` (default: written under the run directory, sync later with ``wandb sync``),
            ``"online"``, ``"disabled"`` or ``"shared"``.
        entity, group, tags, notes: passed to ``wandb.init``.
        dir: where W&B writes its files; None means the run directory.
        flush_secs: how often W&B's service writes its buffered data to the run's ``.wandb`` file (W&B's
            ``x_transaction_log_flush_interval`` setting; W&B's default is 15). 0 writes only when a 32 KiB
            block fills or the run finishes.
        run: a W&B run already started (``wandb.run`` in a sweep agent or a notebook, or what your own
            ``wandb.init`` returned): instrument logs into it and never finishes it; you do, after
            `Instrumentation.close`. The other arguments, which only configure ``wandb.init``, are then
            unused. W&B drops a row whose ``step`` is below the run's current step, so if you also call
            ``run.log`` yourself, pass the same ``step=``.

    Durability: W&B's service keeps the last partial block of the ``.wandb`` file in memory and writes it
    every ``flush_secs``; W&B has no call that forces it sooner, so a process killed without `close` loses
    at most the last ``flush_secs`` of steps. `close` calls ``run.finish``, which writes everything; after
    `on_exit` ("killed"/"failed") it finishes with exit code 1, so W&B marks the run failed, not finished.

    Step axes: training metrics use ``step=`` (the training step). System-monitor metrics (``system/...``)
    are plotted against ``system/seconds`` (``define_metric``); W&B keeps one history row per step, so they
    ride on the next training row (the newest sample wins) instead of advancing W&B's step, which would make
    W&B drop the next training step. The samples left at `close` (after the process's last training row) have
    no row to ride on: the newest of each goes into the run summary, and none is in the history. A row of
    their own would take the step after the last one, which the next training step needs: a resumed run
    (online, where W&B counts it; offline, from the earlier folders) then skipped that step, so a job that
    closed normally and resumed lost one training step at every resume. Validation samples are logged as a
    ``wandb.Table`` under their tag.

    Resume (``Instrumentation(resume=True)``): ``wandb.init(id=<kept id>, resume="allow")``. Steps the run
    already holds are not written again (W&B cannot replace a step). Online, W&B knows the run's last step.
    Offline, each process writes its own ``offline-run-<time>-<id>`` folder and W&B knows nothing of the
    earlier ones, so `open` reads the last ``_step`` of their ``run-<id>.wandb`` files
    (`instrument.backends.wandb_log`; a torn last record after a kill is ignored, an unreadable file costs
    one warning and every step is written). ``wandb sync`` of the folders, oldest first, then gives each
    step once. Each process's last row is a training row (see Step axes), so the next training step is the
    resumed run's first.

    Reuse: one instance given to run after run (`open` again after `close`) starts each with nothing of the
    run before (`_new_run`): its folder (unless ``dir`` was given), held steps, key names, exit code.
    """

    sdk_exit_hook = True  # wandb stops its service process at exit: close the logger before that

    @property
    def remote(self) -> bool:
        """Online (or shared): ``wandb.init`` waits for W&B's servers, so the logger calls this backend on a
        thread of its own (`Backend.remote`). Offline and disabled runs write local files only."""
        return self.mode in ("online", "shared")

    def __init__(
        self,
        project: str = "instrument",
        mode: str = "offline",
        entity: Optional[str] = None,
        group: Optional[str] = None,
        tags: Optional[Sequence[str]] = None,
        notes: Optional[str] = None,
        dir: Optional[str] = None,
        flush_secs: float = 2.0,
        run: Any = None,
    ) -> None:
        if run is not None and not (hasattr(run, "log") and hasattr(run, "config") and hasattr(run, "finish")):
            raise ConfigurationError(
                f"WandbBackend(run=...) takes a started W&B run (wandb.run or the result of wandb.init), got "
                f"{type(run).__name__}; start one with wandb.init(...) first, or leave run=None."
            )
        if mode not in _MODES:
            raise ConfigurationError(
                f"WandbBackend.mode must be one of {_MODES}, got {mode!r}; 'offline' needs no account."
            )
        self.flush_secs = check_number("WandbBackend.flush_secs", flush_secs, least=0, noun="a number of seconds",
                                       fix="bind e.g. WandbBackend.flush_secs = 2.0")
        self.project, self.mode, self.entity, self.group = project, mode, entity, group
        self.tags, self.notes = list(tags or []), notes
        self._given_dir = dir  # None: each run's own folder, also when the backend is given to a later run
        self._external = run  # the user's run: logged into, never finished
        self._wandb = None
        self._new_run()

    def _new_run(self) -> None:
        """Everything that belongs to one run, fresh at every `open`: one instance given to run after run (or to
        a resume, then a new run) kept the earlier run's folder (the new W&B run was written into it), its last
        step (the new run's first steps were skipped as held), its keys' names and its exit code. What the user
        gave stays."""
        self.dir = self._given_dir  # resolved in `open`
        self.run = None
        self._exit_code = 0
        self._said_underscore = False  # hyperparameters starting with "_" moved under user/ (`log_hyperparams`)
        self._system: dict = {}
        self._drops = Drops(self.name)
        self._keys_saved = 0  # the version of the escaped keys' names in run.config (`_save_keys`)
        self._scalar_keys: set = set()  # every scalar key logged so far: media never take one (`_media_key`)
        self._renamed: dict = {}  # (kind, key) -> the W&B key a value of that kind and key is logged under
        self._media_names: set = set()  # W&B keys media values took under their own name
        self._resumed: set = set()  # keys a resumed offline run's earlier folders hold (`_free`)
        self._here: set = set()  # keys this process logged a value under (`_free`)
        self._moved_names: set = set()  # W&B keys made for values moved off a taken key (``reward/histogram``)
        self._written: Optional[int] = None  # a resumed offline run: the last step its earlier folders hold

    def open(self, run: RunInfo) -> None:
        wandb = self._wandb = require("wandb", "wandb", "WandbBackend")
        if self._external is None:  # the user's run (run=) is the same W&B run at every open: its keys stay
            self._new_run()
        else:
            self.run = self._external
            self.dir = getattr(self.run, "dir", self.dir)
            self.run.define_metric("system/seconds")
            self.run.define_metric("system/*", step_metric="system/seconds")
            return
        path = (Path(self.dir) if self.dir else run.dir).resolve()  # absolute: W&B's service has its own cwd
        path.mkdir(parents=True, exist_ok=True)
        self.dir = str(path)
        # Older W&B (before the setting existed) writes on its own fixed schedule.
        flush_field = "x_transaction_log_flush_interval"
        flush = {flush_field: self.flush_secs} if flush_field in getattr(wandb.Settings, "model_fields", {}) else {}
        with redacted_argv(run.argv):  # W&B records sys.argv in the run's metadata: let it see the redacted one
            self.run = wandb.init(
                project=self.project, entity=self.entity, name=run.name, group=self.group, tags=self.tags,
                notes=self.notes, dir=self.dir, mode=self.mode, reinit="create_new",
                settings=wandb.Settings(console="off", silent=True, **flush), **_resume(run, self.name),
            )
        self.run.define_metric("system/seconds")
        self.run.define_metric("system/*", step_metric="system/seconds")
        if _resume(run, self.name) and getattr(self.run, "offline", False):
            self._written = offline_last_step(self.run)
            self._scalar_keys, self._media_names = offline_keys(self.run)
            self._resumed = self._scalar_keys | self._media_names  # maybe names of values moved before: kept
            keys = offline_config(self.run, _KEYS)
        else:  # online, W&B may hand a resumed run its config
            keys = self.run.config.get(_KEYS) if _resume(run, self.name) else None
        if isinstance(keys, str):  # the names escaped keys took before: each key's series goes on under its name
            self._drops.restore_keys(keys)
            self._keys_saved = self._drops.version

    def _save_keys(self) -> None:
        """The names escaped keys took (`utf8_keys`), into run.config when they changed: a resumed run reads them
        back at `open`, so each key keeps its name."""
        if self._drops.version != self._keys_saved:
            self.run.config.update({_KEYS: self._drops.key_state()}, allow_val_change=True)
            self._keys_saved = self._drops.version

    def _holds(self, step: int) -> bool:
        """Whether the run already holds ``step``: online W&B knows its last step; a resumed offline run
        learnt it from its earlier folders at `open`."""
        return step < self.run.step or (self._written is not None and step <= self._written)

    @property
    def resume_id(self) -> Optional[str]:
        return self.run.id if self.run is not None else None

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        """The run's config, nested (``optim/lr`` -> ``{"optim": {"lr": ...}}``, ``Model.depth`` ->
        ``{"Model": {"depth": ...}}``) so W&B's config panel and its run table group it; the operative gin
        config verbatim under ``operative_config``."""
        # W&B writes a NaN config value as null: as a string, like JSONL's "nan" (inf survives as it is). A key
        # that starts with "_" is W&B's (its own metadata is run.config["_wandb"], which a hyperparameter of that
        # name replaced, and the UI hides the rest): it goes under user/, as such a metric does, said once.
        values = {under_user(k, _underscored) if isinstance(k, str) else k: "nan" if isinstance(v, float) and v != v
                  else v for k, v in params.items()}
        moved = [k for k in params if isinstance(k, str) and _underscored(strip_user(k))]
        if moved and not self._said_underscore:
            self._said_underscore = True
            log.warning("instrument: WandbBackend logs the hyperparameters %s under user/ in run.config: W&B keeps the "
                        "keys starting with '_' for itself (JSONL, MLflow and TensorBoard keep them as they are). "
                        "(Said once.)", moved)
        values = unflatten_params(values)
        if config_text:
            if _CONFIG in values:  # a hyperparameter of that name (or under it) is kept, beside the config text
                name = numbered(_CONFIG, values.__contains__)
                values[name] = values.pop(_CONFIG)
                log.warning("instrument: WandbBackend logs the hyperparameter %r as %r in run.config: %r holds the "
                            "operative gin config text there (JSONL, MLflow and TensorBoard keep it as %r).",
                            _CONFIG, name, _CONFIG, _CONFIG)
            values[_CONFIG] = config_text
        self.run.config.update(values, allow_val_change=True)

    def write(self, record: StepRecord) -> None:
        """One row per step. Each media value is converted on its own: one that cannot be converted (a
        histogram with no finite value, an image W&B refuses) is dropped with one warning per key and the rest
        of the row is logged. A media value whose key is also a scalar's goes under ``<key>/<kind>``."""
        if self._holds(record.step):  # a resumed run already holds it: not written again (W&B would drop it)
            return
        wandb, drops = self._wandb, self._drops
        # Keys UTF-8 cannot encode (os.fsdecode names) escaped: W&B's protobuf would refuse the whole row.
        scalars: dict = self._scalar_names(utf8_keys(drops, "scalar", record.flat_scalars()))
        self._scalar_keys.update(scalars)
        if self._resumed:
            self._here.update(scalars)
        sources = {
            "image": {k: v for k, v in utf8_keys(drops, "image", record.images).items() if v is not None},
            "histogram": {k: v for k, v in utf8_keys(drops, "histogram", record.histograms).items() if v.size},
            "text": utf8_keys(drops, "text", record.texts),
            "video": utf8_keys(drops, "video", record.videos),
            "table": utf8_keys(drops, "samples table", record.samples),
        }
        convert = {
            "image": lambda k, v: _image(wandb, v),
            "histogram": lambda k, v: _histogram(wandb, drops, k, v),
            "text": lambda k, v: wandb.Html(f"<pre>{_escape(utf8(drops, 'text', k, v))}</pre>"),
            "video": lambda k, v: _video(wandb, *v),
            "table": lambda k, v: _table(wandb, drops, k, v),
        }
        videos: dict = {}
        failed = write_each(sources["video"], lambda key, frames, fps: videos.__setitem__(
            key, convert["video"](key, (frames, fps))))
        media = {
            "image": drops.each("image", sources["image"].items(), convert["image"], "an HWC image"),
            "histogram": drops.each("histogram", sources["histogram"].items(), convert["histogram"],
                                    "real numbers, at least one finite, within the float range"),
            "text": drops.each("text", sources["text"].items(), convert["text"], "a str"),
            "video": videos,
            "table": drops.each("samples table", sources["table"].items(), convert["table"],
                                "rows of strings and numbers"),
        }
        data = dict(scalars)
        made: Dict[str, Tuple[str, str]] = {}  # W&B key -> (kind, key): a value made again for a retry (`_log`)
        for kind, values in media.items():
            for key, value in values.items():
                name = self._media_key(kind, key, data)
                data[name], made[name] = value, (kind, key)
                if self._resumed:
                    self._here.add(name)
        if self._system:
            data = {**self._system, **data}
        self._log(data, scalars, record.step,
                  lambda name: convert[made[name][0]](made[name][1], sources[made[name][0]][made[name][1]]))
        self._system = {}
        self._save_keys()
        raise_failures(self.name, record.step, failed)

    def _log(self, data: dict, scalars: dict, step: int, remake: Callable[[str], Any]) -> None:
        """``run.log`` the row. If W&B refuses it while serialising a media value, each media value is made again
        (``remake``: a W&B media object that failed once stays bound to the failed file) and staged on its own
        (``commit=False``); the ones W&B refuses are dropped, named. Then the scalars (and system samples)
        commit the row. So one value never costs the step its numbers or its other media values."""
        try:
            self.run.log(data, step=step, commit=True)
            return
        except Exception:
            plain = {k: v for k, v in data.items() if k in scalars or k in self._system}
            if len(plain) == len(data):
                raise
        for key in data.keys() - plain.keys():
            try:
                self.run.log({key: remake(key)}, step=step, commit=False)
            except Exception as exc:
                self._drops.drop("media value", key, f"a value run.log refused ({type(exc).__name__}: {exc})",
                                 "a value W&B can serialise")
        self.run.log(plain, step=step, commit=True)  # raises again when W&B itself is the problem

    def _unreserved(self, key: str) -> str:
        """``key``, or ``user/<key>`` (one warning) for a key W&B keeps for itself: one that starts with ``_``
        (``_step``), and one under ``system/``, where the system monitor's samples go and which W&B plots against
        their seconds. A key already under ``user/`` that reduces to such a key moves one level further
        (`under_user`), so two keys never become one and the choice is the same at every step."""
        name = under_user(key, _reserved)
        if name is not key and ("reserved", key) not in self._renamed:
            self._renamed[("reserved", key)] = name
            log.warning("instrument: WandbBackend logs %r as %r: %s", key, name,
                        "W&B plots every key under system/ against the system monitor's seconds, and a system "
                        "sample of that name would replace it in a row." if strip_user(key).startswith("system/")
                        else "W&B keeps the keys that start with '_' (_step, _runtime, _timestamp...) for itself "
                        "and would silently replace the value.")
        return name

    def _media_key(self, kind: str, key: str, data: dict) -> str:
        """The W&B key of a media value: its own key (``user/<key>`` if W&B reserves it, see `_unreserved`),
        unless a scalar of the run (or another value of this row) has it: W&B keeps one value per key in a
        row, so the media value would silently replace the scalar. Then ``<key>/<kind>`` (e.g.
        ``reward/histogram``), for the rest of the run, with one warning."""
        renamed = self._renamed.get((kind, key))
        if renamed is not None:
            return renamed
        original, key = key, self._unreserved(key)
        if key not in data and key not in self._scalar_keys and key not in self._moved_names:
            self._renamed[(kind, original)] = key  # fixed at first use: a later scalar of that name moves instead
            self._media_names.add(key)
            return key
        name = self._free(f"{key}/{kind}", data)
        self._renamed[(kind, original)] = name
        self._media_names.add(name)  # and a scalar of that name goes under ``<name>/scalar``
        log.warning(
            "instrument: WandbBackend logs the %s %r as %r: a scalar (or another value) of the run already has the "
            "key %r, and W&B keeps one value per key in a row, so one would silently replace the other.",
            kind, key, name, key,
        )
        return name

    def _free(self, name: str, row: Any) -> str:
        """``name``, numbered (``_2``, ...) while this row or the run has it; taken for good: a value the user
        logs under that name later moves instead (one key never mixes two series)."""
        base, number = name, 1
        while name in row or name in self._moved_names or (
                (name in self._scalar_keys or name in self._media_names)
                and (name not in self._resumed or name in self._here)):
            number += 1
            name = f"{base}_{number}"
        self._moved_names.add(name)
        return name

    def _scalar_names(self, scalars: dict) -> dict:
        """The scalars under their W&B keys: ``user/<key>`` for a key W&B reserves (`_unreserved`); a scalar
        whose key a media value of the run, or a value moved off its own key, already holds goes under
        ``<key>/scalar`` (numbered while that is taken too; one warning), so no W&B key ever holds both a number
        and a media value, or two series."""
        if (self._media_names.isdisjoint(scalars) and self._moved_names.isdisjoint(scalars)
                and not any(key.startswith(_RENAMED_HEADS) for key in scalars)):
            return scalars
        out = {}
        for key, value in scalars.items():
            name = self._renamed.get((SCALAR, key))
            if name is None:
                name = self._unreserved(key)
                if name in self._media_names or name in self._moved_names:
                    moved = self._free(f"{name}/scalar", scalars)
                    self._renamed[(SCALAR, key)] = moved
                    log.warning("instrument: WandbBackend logs the scalar %r as %r: a media value of the run (or a "
                                "value moved off its own key) already has the key %r, and W&B keeps one kind of "
                                "value per key.", key, moved, name)
                    name = moved
            out[name] = value
        return out

    def write_system(self, record: StepRecord) -> None:
        self._system = {**self._system, **utf8_keys(self._drops, "system scalar", record.scalars)}
        self._save_keys()

    def flush(self) -> None:
        """W&B has no call that writes its buffer sooner; its service does so every ``flush_secs``."""

    def on_exit(self, status: str) -> None:
        """Make `close` finish the run with exit code 1: W&B then marks it failed instead of finished."""
        if status not in _EXIT_STATUSES:
            raise ConfigurationError(
                f"WandbBackend.on_exit got status {status!r}; expected one of {_EXIT_STATUSES}."
            )
        self._exit_code = 1

    def close(self) -> None:
        """Finish the run instrument started (a ``run=`` passed in is left running: it is the caller's)."""
        run, self.run = self.run, None
        system, self._system = self._system, {}
        if run is not None:
            try:
                if system:  # samples after the last training row: the newest in the summary, no row (class doc)
                    run.summary.update(system)
            finally:
                if run is not self._external:
                    run.finish(exit_code=self._exit_code)  # writes the buffered block and the exit record

    def __repr__(self) -> str:
        return f"WandbBackend(project={self.project!r}, mode={self.mode!r})"


def _video(wandb, frames, fps: int):
    """A ``wandb.Video`` from GIF bytes encoded with Pillow: W&B's own encoding of raw frames needs moviepy."""
    return wandb.Video(io.BytesIO(encode_gif(frames, fps)), format="gif")


def _histogram(wandb, drops: Drops, key: str, values: Any):
    """A ``wandb.Histogram`` of the finite values (NaN and inf left out with one warning per key; none finite
    raises `DroppedValue`), binned here in float64: W&B's own ``np.histogram`` refuses a non-finite range."""
    values = finite(drops, "histogram", key, values)
    lo, hi = float(values.min()), float(values.max())
    with np.errstate(over="ignore"):
        wide = not np.isfinite(hi - lo)
    # A range wider than the largest float (e.g. -1e308 to 1e308): the edges computed on halves, then doubled.
    if lo == hi:  # one value: numpy's own range for it, +-0.5 (where the magnitude leaves room for that)
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo / 2, hi / 2, 65) * 2 if wide else np.linspace(lo, hi, 65)
    # A range narrow for its magnitude (a constant -3.4e38 mask, ids near 1e17) has fewer distinct floats than
    # 65: numpy refuses repeated edges ("Too many bins"), so keep the distinct ones, at least one bin's worth.
    edges = np.unique(edges)
    if edges.size < 2:  # one float wide: the neighbouring floats, staying finite at the ends of the range
        with np.errstate(over="ignore"):
            low, high = np.nextafter(lo, -np.inf), np.nextafter(hi, np.inf)
        edges = np.array([low if np.isfinite(low) else lo, high if np.isfinite(high) else hi])
    counts, edges = np.histogram(values, bins=edges)
    return wandb.Histogram(np_histogram=(counts, edges))


def _table(wandb, drops: Drops, tag: str, table: Any):
    """A ``wandb.Table`` of every sample; text cells UTF-8 cannot encode are written with escapes. W&B refuses
    a column that mixes numbers and text (a NaN score, an int beyond int64, both written as text by `cell`), so
    such a column is written as text throughout."""
    raw = columns(table.rows)
    cols = [utf8(drops, "samples table", tag, str(c)) for c in raw]
    rows = [[_text_cell(drops, tag, cell(r.get(c))) for c in raw] for r in table.rows]
    for j in range(len(raw)):
        kinds = {isinstance(row[j], str) for row in rows if row[j] is not None}
        if kinds == {True, False}:
            for row in rows:
                if row[j] is not None and not isinstance(row[j], str):
                    row[j] = str(row[j])
    return wandb.Table(columns=cols, data=rows)


def _text_cell(drops: Drops, tag: str, value: Any) -> Any:
    return utf8(drops, "samples table", tag, value) if isinstance(value, str) else value


def _resume(run: RunInfo, name: str) -> dict:
    """``wandb.init`` arguments that continue the run whose id the run folder kept (offline too)."""
    run_id = (run.resume or {}).get(name)
    return {"id": run_id, "resume": "allow"} if run_id else {}


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _image(wandb: Any, pixels: Any) -> Any:
    """A ``wandb.Image`` of an [H, W, 3 or 4] uint8 array, handed over as a PIL image: from an array W&B squeezes
    every dimension of size 1, so a 1-pixel-high or -wide image came out as another shape (a [9, 1, 3] column
    stored as [9, 3, 3])."""
    from PIL import Image

    return wandb.Image(Image.fromarray(pixels, "RGBA" if pixels.shape[-1] == 4 else "RGB"))
