"""MLflow's tracking store as `instrument.backends.mlflow.MlflowBackend` meets it: the URIs MLflow serves, a
failure that says the server could not be reached, and the last training step a run already holds (a resumed
run does not write it again: MLflow appends, it cannot replace)."""

import urllib.parse
from typing import Any, List, Optional

from instrument.errors import ConfigurationError

__all__ = ["LAST_STEP_TAG", "check_uri", "is_remote", "is_unreachable", "last_step"]

# Tracking-URI schemes MLflow itself serves (mlflow/tracking/_tracking_service/utils.py); plugins add more
# through the ``mlflow.tracking_store`` entry point group. "" is a local path (a file store).
_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc", "sqlite", "postgresql", "mysql",
            "mssql")
# A run tag: the last step written with media only (images, texts, videos, tables and no scalar), which no
# metric history holds; a resumed run skips it too, instead of writing its media a second time.
LAST_STEP_TAG = "instrument.media_step"


def last_step(client: Any, run_id: str) -> Optional[int]:
    """The highest training step the run holds: of any metric (not ``system/...``), or of a step written with
    media only (`LAST_STEP_TAG`); None when it has none."""
    data = client.get_run(run_id).data
    keys = [k for k in data.metrics if not k.startswith("system/")]
    steps = [m.step for k in keys for m in client.get_metric_history(run_id, k)]
    tagged = data.tags.get(LAST_STEP_TAG)
    if tagged is not None and tagged.isdigit():
        steps.append(int(tagged))
    return max(steps) if steps else None


def check_uri(uri: Optional[str]) -> None:
    """Refuse a tracking URI MLflow would not serve, before the run starts (None: the default store)."""
    if uri is None:
        return
    if not isinstance(uri, str) or not uri:
        raise ConfigurationError(
            f"MlflowBackend.tracking_uri must be a non-empty string or None, got {uri!r}; e.g. "
            "'http://localhost:5000' or 'sqlite:///runs/mlflow.db'."
        )
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    base = scheme.split("+", 1)[0]  # postgresql+psycopg2://, mysql+pymysql://
    if base in _SCHEMES or scheme in _plugin_schemes():
        return
    raise ConfigurationError(
        f"MlflowBackend.tracking_uri has the scheme {scheme!r} ({uri!r}), which MLflow does not serve; "
        f"expected one of {[s for s in _SCHEMES if s]} (or a plain local path, or a scheme registered by an "
        "installed MLflow plugin), e.g. 'http://localhost:5000'."
    )


def is_remote(uri: Optional[str]) -> bool:
    """Whether a store at ``uri`` is reached over the network (a tracking server, a database server, a
    plugin's store), not a local file (None: the run's own SQLite file; a plain path; ``file:``; ``sqlite:``)."""
    return uri is not None and urllib.parse.urlparse(uri).scheme.lower() not in ("", "file", "sqlite")


def _plugin_schemes() -> List[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="mlflow.tracking_store")]


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached, not that it refused the request: MLflow wraps a
    transport failure (refused, timed out, retries used up) as ``API request to <url> failed with ...``."""
    text = str(exc)
    return isinstance(exc, (ConnectionError, TimeoutError)) or ("API request to" in text and "failed with" in text)
