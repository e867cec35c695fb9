"""MLflow: a local tracking store under the run directory by default, so no server is needed."""

import json
import math
import re
from typing import Any, Dict, List, Mapping, Optional

from instrument.backends.base import Backend, RunInfo, StepRecord
from instrument.errors import require

__all__ = ["MlflowBackend"]

# MLflow's batch limits and name rules (mlflow/utils/validation.py).
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_MAX_KEY = 250


class MlflowBackend(Backend):
    """Logs metrics with `MlflowClient.log_batch`, params from the operative gin config, images as artifacts.

    Uses its own `MlflowClient` (no global ``mlflow.set_tracking_uri``), so several runs or backends in one
    process do not interfere. Needs ``pip install 'torch-instrument[mlflow]'``; imported when the run opens.

    Args:
        tracking_uri: None means ``sqlite:///<run dir>/mlflow.db`` with artifacts in ``<run dir>/mlartifacts``
            (no server; browse with ``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``). Any
            MLflow URI works: ``http://host:5000``, ``sqlite:///path.db``, ``file:/path/mlruns`` (MLflow 3
            accepts file stores only with ``MLFLOW_ALLOW_FILE_STORE=true``).
        experiment_name: created when missing.
        run_name: None means the instrument run's name.
        tags: extra run tags.
        artifact_location: where a newly created experiment stores artifacts; None means
            ``<run dir>/mlartifacts``
            with the default tracking URI and the server's default otherwise.

    What goes where: scalars -> metrics (training ``step``; system metrics use whole seconds since the monitor
    started as their step); hyperparameters -> params (values cut to 6000 characters), the operative config ->
    ``config/operative_config.gin``; images -> ``images/<key>/step_<step>.png``; text ->
    ``text/<key>/step_<step>.txt``; validation samples -> ``samples/<tag>/step_<step>.json``. Histograms and
    videos are not logged (MLflow has no such type). Names are sanitised to MLflow's allowed characters.
    """

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: str = "instrument",
        run_name: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
        artifact_location: Optional[str] = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location
        self.client = None
        self.run_id: Optional[str] = None
        self._entities = None

    def open(self, run: RunInfo) -> None:
        require("mlflow", "mlflow", "MlflowBackend")
        from mlflow import entities
        from mlflow.tracking import MlflowClient

        self._entities = entities
        artifacts = self.artifact_location
        if self.tracking_uri is None:
            run.dir.mkdir(parents=True, exist_ok=True)
            self.tracking_uri = f"sqlite:///{(run.dir / 'mlflow.db').resolve()}"
            if artifacts is None:
                artifacts = (run.dir / "mlartifacts").resolve().as_uri()
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
        self.run_id = client.create_run(
            experiment_id, run_name=self.run_name or run.name, tags=self.tags
        ).info.run_id

    def log_hyperparams(self, params: Mapping[str, Any], config_text: Optional[str] = None) -> None:
        Param = self._entities.Param
        items = [Param(_safe_name(k), str(v)[:_MAX_PARAM_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _PARAMS_PER_BATCH])
        if config_text:
            self.client.log_text(self.run_id, config_text, "config/operative_config.gin")

    def _log_metrics(self, scalars: Mapping[str, float], step: int, wall_time: float) -> None:
        Metric = self._entities.Metric
        timestamp = int(wall_time * 1000)
        items = [Metric(_safe_name(k), float(v), timestamp, int(step)) for k, v in scalars.items()]
        for i in range(0, len(items), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _METRICS_PER_BATCH])

    def write(self, record: StepRecord) -> None:
        step = record.step
        self._log_metrics(record.flat_scalars(), step, record.wall_time)
        for key, image in record.images.items():
            if image is not None:
                self.client.log_image(
                    self.run_id, image, artifact_file=f"images/{_safe_name(key)}/step_{step:08d}.png"
                )
        for key, text in record.texts.items():
            self.client.log_text(self.run_id, text, f"text/{_safe_name(key)}/step_{step:08d}.txt")
        for tag, table in record.samples.items():
            columns = _columns(table.rows)
            data = {
                "columns": columns,
                "data": [[_jsonable(row.get(c)) for c in columns] for row in table.rows],
            }
            self.client.log_dict(self.run_id, data, f"samples/{_safe_name(tag)}/step_{step:08d}.json")

    def write_system(self, record: StepRecord) -> None:
        self._log_metrics(record.scalars, record.step, record.wall_time)

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")
            self.client = None

    def __repr__(self) -> str:
        return (
            f"MlflowBackend(tracking_uri={self.tracking_uri!r}, experiment_name={self.experiment_name!r}, "
            f"run_name={self.run_name!r})"
        )


def _safe_name(name: str) -> str:
    """A key MLflow accepts: allowed characters only, and a path that normalises to itself."""
    cleaned = re.sub(r"[^/\w.\- ]", "_", str(name))
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in cleaned.split("/") if p]
    return "/".join(parts)[:_MAX_KEY] or "_"


def _columns(rows: List[Dict[str, Any]]) -> List[str]:
    columns: List[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return columns


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
