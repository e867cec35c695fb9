"""MLflow's tracking store as `instrument.backends.mlflow.MlflowBackend` meets it: the URIs MLflow serves, a
failure that says the server could not be reached, the HTTP settings of its calls, and the last training step
a run already holds (a resumed run does not write it again: MLflow appends, it cannot replace)."""

import contextlib
import os
import re
import threading
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional

from instrument.errors import ConfigurationError

__all__ = ["LAST_STEP_TAG", "check_uri", "http_settings", "is_file_store", "is_remote", "is_unreachable", "last_step"]

# Tracking-URI schemes MLflow itself serves (mlflow/tracking/_tracking_service/utils.py); plugins add more
# through the ``mlflow.tracking_store`` entry point group. "" is a local path (a file store).
_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc", "sqlite", "postgresql", "mysql",
            "mssql")
# A run tag: the last step written with media only (images, texts, videos, tables and no scalar), which no
# metric history holds; a resumed run skips it too, instead of writing its media a second time.
LAST_STEP_TAG = "instrument.media_step"
_GATEWAY = (502, 503, 504)  # a proxy's answers that the server behind it could not be reached


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


def is_file_store(uri: Optional[str]) -> bool:
    """Whether ``uri`` is a file store (a plain path, ``file:``), which keeps each metric, param and tag as a file
    named by its key: there ``a`` and ``a/b`` cannot both be held (`mlflow_names.unique_name`)."""
    return uri is not None and urllib.parse.urlparse(uri).scheme.lower() in ("", "file")


def _plugin_schemes() -> List[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="mlflow.tracking_store")]


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached, not that it refused the request: MLflow wraps a
    transport failure (refused, timed out, retries used up) as ``API request to <url> failed with ...``. It words
    an answer that is not JSON the same way (``... failed with error code 413 != 200``, a proxy's error page):
    that is a refusal, unless a gateway says the server behind it did not answer (502, 503, 504)."""
    text = str(exc)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if "API request to" not in text or "failed with" not in text:
        return False
    code = re.search(r"failed with error code (\d+)", text)
    return code is None or int(code.group(1)) in _GATEWAY


# MLflow reads its HTTP settings (timeout, retries, backoff) from the environment at every request
# (rest_utils.http_request), so `http_settings` sets them around each call to a tracking server. They are one
# process-wide set, and no call waits for another's: each remote backend has a thread of its own, and one waiting
# on a silent server must not hold another backend's calls (waiting whenever the settings differed held a live
# backend for a dead one's whole timeout, also between backends of the same options: a retry of a failed open uses
# retries=0). A call made while others are in flight runs with the settings of the first of them, all bounded;
# the environment is put back once the last call in flight returns.
_ENV = threading.Lock()
_in_flight: Dict[str, Any] = {"calls": 0, "saved": {}}


@contextlib.contextmanager
def http_settings(settings: Dict[str, str]) -> Iterator[None]:
    """Set MLflow's HTTP environment variables to ``settings`` for one call, unless calls are in flight
    (module comment above)."""
    with _ENV:
        if not _in_flight["calls"]:
            _in_flight["saved"] = {k: os.environ.get(k) for k in settings}
            os.environ.update(settings)
        _in_flight["calls"] += 1
    try:
        yield
    finally:
        with _ENV:
            _in_flight["calls"] -= 1
            if not _in_flight["calls"]:
                _put_back(_in_flight["saved"])
                _in_flight["saved"] = {}


def _put_back(saved: Dict[str, Optional[str]]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _after_fork_in_child() -> None:
    """A child forked while a writer thread was in an MLflow call inherits the lock, maybe held by a thread it does
    not have (its own MlflowBackend's open then waited forever), and that call's settings: a new lock, no call in
    flight, and the environment as it was before the calls."""
    global _ENV
    _ENV = threading.Lock()
    if _in_flight["calls"]:
        _put_back(_in_flight["saved"])
    _in_flight.update(calls=0, saved={})


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
