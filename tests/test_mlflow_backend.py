"""MlflowBackend against a real local MLflow store, read back with MLflow's own client."""

import re

import numpy as np
import pytest
import torch

import instrument
from instrument import Logger, MlflowBackend, RunInfo
from instrument.backends.base import StepRecord

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


def _run_through(backend, tmp_path):
    logger = Logger([backend], RunInfo("demo-run", tmp_path))
    logger.log_hyperparams(
        {"model": {"width": 64, "depth": 2}, "wandb_api_key": "abc", "train.lr": 0.01},
        config_text="Model.width = 64\nWandbBackend.api_key = 'abc123'\n",
    )
    for step in (0, 10):
        logger.log_metrics(
            {"loss": torch.tensor(1.0 / (step + 1)), "acc[top1]": 0.5 + step / 100}, step=step, prefix="train"
        )
    logger.log_image("state/rgb", np.full((4, 5, 3), 0.5), step=10)
    logger.log_text("note", "hello", step=10)
    logger.log_samples("val", [{"input": "a", "output": "b", "score": torch.tensor(0.25)}], step=10)
    logger.commit(10)
    logger.write_system(StepRecord(step=3, scalars={"system/cpu_percent": 12.5, "system/seconds": 3.2}))
    logger.close()
    assert logger.failures == {}
    return backend


def _artifacts(client, run_id, path=None):
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def _check(client, run_id):
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "demo-run"
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(10, pytest.approx((1.0 + 1 / 11) / 2))]
    assert client.get_metric_history(run_id, "train/acc_top1_")[0].value == pytest.approx((0.5 + 0.6) / 2)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "system/cpu_percent")] == [(3, 12.5)]
    params = run.data.params
    assert params["model/width"] == "64" and params["model/depth"] == "2" and params["train.lr"] == "0.01"
    assert params["wandb_api_key"] == "<redacted>"
    artifacts = _artifacts(client, run_id)
    # log_image(key=, step=): MLflow names the files "<key with / as ~>+step+<step>+timestamp+...".
    images = sorted(a for a in artifacts if a.startswith("images/") and a.endswith(".png"))
    assert len(images) == 1 and images[0].startswith("images/state~rgb+step+10+"), images
    assert {a for a in artifacts if not a.startswith("images/")} == {
        "text/note/step_00000010.txt",
        "samples/val/step_00000010.json",
        "config/operative_config.gin",
    }
    local = client.download_artifacts(run_id, "config/operative_config.gin")
    text = open(local).read()
    assert "Model.width = 64" in text and "abc123" not in text and "<redacted>" in text
    table = mlflow.artifacts.load_dict(client.download_artifacts(run_id, "samples/val/step_00000010.json"))
    assert table == {"columns": ["input", "output", "score"], "data": [["a", "b", 0.25]]}
    image = client.download_artifacts(run_id, images[0])
    from PIL import Image

    assert np.asarray(Image.open(image)).shape == (4, 5, 3)


def test_default_is_one_sqlite_store_per_log_dir(tmp_path):
    backend = _run_through(MlflowBackend(), tmp_path)
    assert backend.tracking_uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    _check(client, backend.run_id)
    experiment = client.get_experiment_by_name("instrument")
    assert experiment.artifact_location.startswith((tmp_path / "mlartifacts").resolve().as_uri())


def test_bound_tracking_uri_experiment_and_run_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    uri = (tmp_path / "mlruns").resolve().as_uri()
    backend = MlflowBackend(tracking_uri=uri, experiment_name="nca", run_name="demo-run", tags={"team": "x"})
    _run_through(backend, tmp_path)
    client = MlflowClient(tracking_uri=uri)
    assert (
        client.get_run(backend.run_id).info.experiment_id
        == client.get_experiment_by_name("nca").experiment_id
    )
    assert client.get_run(backend.run_id).data.tags["team"] == "x"
    _check(client, backend.run_id)


@pytest.mark.parametrize("status, expected", [("killed", "KILLED"), ("failed", "FAILED")])
def test_on_exit_ends_the_run_killed_or_failed(tmp_path, status, expected):
    backend = MlflowBackend()
    backend.open(RunInfo("ended", tmp_path))
    backend.write(StepRecord(step=0, scalars={"loss": 1.0}))
    backend.flush()
    backend.on_exit(status)
    backend.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    run = client.get_run(backend.run_id)
    assert run.info.status == expected and run.info.end_time is not None
    assert [m.value for m in client.get_metric_history(backend.run_id, "loss")] == [1.0]


def test_on_exit_rejects_an_unknown_status(tmp_path):
    with pytest.raises(instrument.ConfigurationError, match=r"got status 'crashed'; expected one of \('killed'"):
        MlflowBackend().on_exit("crashed")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tracking_uri": "htp://localhost:5000"}, r"scheme 'htp' .*expected one of \['file', 'http'"),
        ({"tracking_uri": "localhost:5000"}, r"scheme 'localhost'"),
        ({"tracking_uri": ""}, r"tracking_uri must be a non-empty string or None, got ''"),
        ({"timeout": -1}, r"timeout must be an int >= 1 .*got -1"),
        ({"timeout": 0}, r"timeout must be an int >= 1 .*got 0"),
        ({"timeout": 2.5}, r"timeout must be an int >= 1 \(MLflow reads it as whole seconds\), got 2.5"),
        ({"max_retries": 11}, r"max_retries must be an int from 0 to 10 .*got 11"),
        ({"max_retries": -1}, r"max_retries must be an int from 0 to 10 .*got -1"),
        ({"backoff_factor": True}, r"backoff_factor must be an int from 0 to 120 .*got True"),
        ({"retry_after": -1}, r"retry_after must be a number of seconds >= 0, got -1"),
    ],
)
def test_bad_options_are_rejected_at_construction(kwargs, match):
    with pytest.raises(instrument.ConfigurationError, match=match):
        MlflowBackend(**kwargs)


@pytest.mark.parametrize("uri", ["http://h:5000", "https://h", "sqlite:///x.db", "postgresql+psycopg2://u@h/db",
                                 "file:/tmp/mlruns", "/tmp/mlruns", "databricks", "databricks-uc"])
def test_uris_mlflow_serves_are_accepted(uri):
    assert MlflowBackend(tracking_uri=uri).tracking_uri == uri


def test_a_long_key_cut_at_a_slash_costs_mlflow_nothing_else(tmp_path):
    long_key = "a" * 249 + "/b"  # e.g. a deeply nested prefix: the 250th character is the '/'
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("long", tmp_path))
    logger.log_metrics({"loss": 0.5, long_key: 1.0}, step=0)
    logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    assert [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "loss")] == [(0, 0.5)]
    assert logger.failures == {}
    (name,) = set(client.get_run(backend.run_id).data.metrics) - {"loss"}
    assert name == "a" * 249 and [m.value for m in client.get_metric_history(backend.run_id, name)] == [1.0]


def test_a_text_with_a_lone_surrogate_and_a_huge_int_sample_cost_mlflow_nothing(tmp_path):
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("odd", tmp_path))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_text("checkpoint", "saved to /data/caf\udce9.pt", step=0)  # a non-UTF-8 file name, fsdecoded
    logger.log_samples("val", [{"input": "x", "seed": 10**400, "score": 1.0}], step=0)
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    text = client.download_artifacts(backend.run_id, "text/checkpoint/step_00000000.txt")
    assert open(text, encoding="utf-8").read() == "saved to /data/caf\\udce9.pt"  # escaped, not lost
    table = mlflow.artifacts.load_dict(client.download_artifacts(backend.run_id, "samples/val/step_00000000.json"))
    assert table["data"] == [["x", str(10**400), 1.0]]


def test_a_hyperparameter_with_a_lone_surrogate_costs_mlflow_nothing(tmp_path):
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("param", tmp_path))
    logger.log_hyperparams({"data": "/data/caf\udce9", "lr": 0.1}, config_text="Data.path = '/data/caf\udce9'")
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.close()
    assert logger.failures == {}
    params = MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id).data.params
    assert params == {"data": "/data/caf\\udce9", "lr": "0.1"}


def test_a_changed_hyperparameter_costs_mlflow_no_other_param(tmp_path, caplog):
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("params", tmp_path))
    logger.log_hyperparams({"lr": 0.1, "acc[top1]": 1})
    # MLflow refuses to change a param, and one refused param used to fail the whole batch (epochs lost)
    logger.log_hyperparams({"lr": 0.2, "epochs": 10, "acc_top1_": 2})  # acc_top1_: the MLflow name of acc[top1]
    logger.log_hyperparams({"lr": 0.3})
    logger.close()
    assert logger.failures == {}
    run = MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id)
    assert run.data.params == {"lr": "0.1", "epochs": "10", "acc_top1_": "1", "acc_top1__2": "2"}
    assert run.data.tags["instrument.param/lr"] == "0.3"  # the latest value, where a value may change
    said = [r.getMessage() for r in caplog.records if "cannot change the param 'lr'" in r.getMessage()]
    assert len(said) == 1 and "'0.1'" in said[0] and "'0.2'" in said[0]


def test_a_resumed_mlflow_run_takes_its_params_again_without_a_failure(tmp_path):
    first = MlflowBackend()
    logger = Logger([first], RunInfo("resumed", tmp_path))
    logger.log_hyperparams({"lr": 0.1, "seed": 1})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    again = MlflowBackend()
    logger = Logger([again], RunInfo("resumed", tmp_path, resume={"MlflowBackend": first.run_id}))
    logger.log_hyperparams({"lr": 0.1, "seed": 2, "epochs": 3})  # the same lr, a new seed, a new param
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.close()
    assert logger.failures == {} and again.run_id == first.run_id
    run = MlflowClient(tracking_uri=again.tracking_uri).get_run(again.run_id)
    assert run.data.params == {"lr": "0.1", "seed": "1", "epochs": "3"}
    assert run.data.tags["instrument.param/seed"] == "2"


def test_a_store_that_cannot_open_at_start_is_tried_again_and_gets_the_later_steps_params_and_resume(tmp_path, caplog):
    """The store's folder is a file at start (MLflow cannot create its database there): under
    on_backend_error='warn' the backend stays in the run, each record tries again, and once the path is freed
    the run opens with the kept hyperparameters and every later step, read back with MlflowClient; JSONL has
    every step all along, and resume=True continues the same MLflow run from the id saved at close."""
    import json
    import logging

    store = tmp_path / "store"
    store.write_text("not a folder yet")
    uri = f"sqlite:///{store}/mlflow.db"

    def backend():
        return MlflowBackend(tracking_uri=uri, artifact_location=(tmp_path / "art").as_uri(), retry_after=0)

    logs = tmp_path / "logs"
    with caplog.at_level(logging.WARNING, logger="instrument"):
        inst = instrument.Instrumentation(
            backends=[backend(), instrument.JsonlBackend()], run_name="r", log_dir=str(logs),
            on_backend_error="warn",
        )
        inst.logger.log_hyperparams({"lr": 0.25})
        for step in range(6):
            if step == 2:
                assert inst.flush() is False  # MLflow did not get the steps so far, and flush says so
                store.unlink()
            inst.logger.log_metrics({"x": float(step)}, step=step)
            inst.logger.commit(step)
        inst.close()
    assert inst.failures["MlflowBackend"] == 4  # the open, the hyperparameters, steps 0 and 1
    assert "stays in the run and tries to open again" in caplog.text
    assert caplog.text.count("opened its run") == 1
    lines = [json.loads(line) for line in (logs / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "x" in line.get("metrics", {})] == list(range(6))
    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((logs / "r" / "run.json").read_text())["backends"]["MlflowBackend"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.25"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "x")] == [(s, float(s)) for s in range(2, 6)]

    inst = instrument.Instrumentation(backends=[backend()], run_name="r", log_dir=str(logs), resume=True)
    inst.logger.log_metrics({"x": 6.0}, step=6)
    inst.logger.commit(6)
    inst.close()
    assert inst.failures == {}
    assert [m.step for m in client.get_metric_history(run_id, "x")] == [2, 3, 4, 5, 6]


class _Reopening(instrument.Backend):
    reopens = True

    def __init__(self, error):
        self.error, self.records = error, []

    def open(self, run):
        raise self.error

    def write(self, record):
        self.records.append(record)


def test_a_reopening_backend_whose_open_is_instruments_own_error_is_still_left_out(tmp_path, caplog):
    from instrument.errors import MissingExtraError

    bad = _Reopening(MissingExtraError("somesdk", "x", "_Reopening"))
    inst = instrument.Instrumentation(backends=[bad], log_dir=str(tmp_path), run_name="r", on_backend_error="warn")
    inst.logger.log_metrics({"x": 1.0}, step=0)
    inst.logger.commit(0)
    inst.close()
    assert bad not in inst.logger.backends and bad.records == []
    assert "left out of this run" in caplog.text


def test_a_failed_open_is_tried_again_at_most_once_per_retry_after(tmp_path, monkeypatch):
    """Whatever made the open fail (here resume=True with a run id the store does not hold, which never goes
    away), later records try again at most once per retry_after, not once each."""
    import json
    import time

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logs = tmp_path / "logs"
    inst = instrument.Instrumentation(backends=[MlflowBackend(tracking_uri=uri)], run_name="r", log_dir=str(logs))
    inst.close()
    (logs / "r" / "run.json").write_text(json.dumps({"backends": {"MlflowBackend": "0" * 32}}))
    tries = []
    create_run = MlflowBackend._create_run
    monkeypatch.setattr(MlflowBackend, "_create_run", lambda self, run: tries.append(1) or create_run(self, run))
    backend = MlflowBackend(tracking_uri=uri, retry_after=1.0)
    inst = instrument.Instrumentation(backends=[backend, instrument.JsonlBackend()], run_name="r",
                                      log_dir=str(logs), resume=True, on_backend_error="warn")
    for step in range(20):
        inst.logger.log_metrics({"x": float(step)}, step=step)
        inst.logger.commit(step)
    inst.flush()
    assert len(tries) == 1  # the open; the 20 records within retry_after did not try again
    time.sleep(1.1)
    inst.logger.log_metrics({"x": 20.0}, step=20)
    inst.logger.commit(20)
    inst.close()
    assert len(tries) == 2 and inst.failures["MlflowBackend"] == 22  # the open and every record missed


def test_a_failed_open_is_tried_again_under_a_steady_stream_of_records(tmp_path):
    """Records keep coming faster than retry_after: each one within the wait fails at once without pushing the
    wait out, so the run opens at the first record after retry_after once the store is back (before, the
    backend stayed unopened for the whole run)."""
    import time

    store = tmp_path / "store"
    store.write_text("not a folder yet")
    uri = f"sqlite:///{store}/mlflow.db"
    backend = MlflowBackend(tracking_uri=uri, artifact_location=(tmp_path / "art").as_uri(), retry_after=0.3)
    inst = instrument.Instrumentation(backends=[backend, instrument.JsonlBackend()], run_name="r",
                                      log_dir=str(tmp_path / "logs"), on_backend_error="warn")
    store.unlink()  # the store is back at once; the first try after retry_after opens the run
    step, deadline = 0, time.monotonic() + 1.5
    while time.monotonic() < deadline:
        inst.logger.log_metrics({"x": float(step)}, step=step)
        inst.logger.commit(step)
        inst.flush()
        step += 1
        time.sleep(0.05)
    inst.close()
    assert backend.run_id is not None
    history = MlflowClient(tracking_uri=uri).get_metric_history(backend.run_id, "x")
    assert len(history) >= step - 12 and history[-1].step == step - 1  # every record from about 0.3 s on


def test_a_media_value_mlflow_cannot_store_costs_that_value_and_is_counted(tmp_path):
    """A review found one image MLflow refused costing it every media value of the step after it. Here the
    store cannot write one text (its artifact path is taken by a folder): that text is counted in `failures`,
    and the image, the other text and the samples table of the same step are written."""
    from pathlib import Path
    from urllib.parse import urlparse

    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("media", tmp_path))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.commit(0)
    assert logger.flush()
    artifacts = Path(urlparse(MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id)
                              .info.artifact_uri).path)
    (artifacts / "text" / "a_bad" / "step_00000001.txt").mkdir(parents=True)  # a folder where the file goes
    logger.log_image("img", np.full((4, 5, 3), 0.5), step=1)
    logger.log_text("a_bad", "lost", step=1)
    logger.log_text("b_good", "kept", step=1)
    logger.log_samples("val", [{"input": "x", "score": 1.0}], step=1)
    logger.log_metrics({"loss": 0.25}, step=1)
    logger.close()
    assert logger.failures == {"MlflowBackend": 1}
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    found = _artifacts(client, backend.run_id)
    assert "text/b_good/step_00000001.txt" in found and "samples/val/step_00000001.json" in found
    assert any(path.startswith("images/img") for path in found)
    assert [m.value for m in client.get_metric_history(backend.run_id, "loss")] == [0.5, 0.25]


def test_media_tags_that_sanitise_alike_keep_apart(tmp_path):
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("names", tmp_path))
    logger.log_text("notes[a]", "first", step=1)
    logger.log_text("notes_a_", "second", step=1)
    logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    first = client.download_artifacts(backend.run_id, "text/notes_a_/step_00000001.txt")
    second = client.download_artifacts(backend.run_id, "text/notes_a__2/step_00000001.txt")
    assert open(first).read() == "first" and open(second).read() == "second"


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_what_infinity_and_negative_zero_read_back_as_in_each_mlflow_store(tmp_path, monkeypatch, store):
    """Pins docs/backends.md: instrument sends inf, -inf, NaN and -0.0 as they are; MLflow's own SQL store
    (SqlAlchemyStore.sanitize_metric_value) stores +-inf as the largest float64, and SQLite reads -0.0 back
    as 0.0; a file store keeps them."""
    import math
    import sys

    if store == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        backend = MlflowBackend(tracking_uri=(tmp_path / "mlruns").as_uri())
    else:
        backend = MlflowBackend()  # the default: sqlite:///<log_dir>/mlflow.db
    logger = Logger([backend], RunInfo("special", tmp_path))
    logger.log_metrics({"inf": float("inf"), "ninf": float("-inf"), "nan": float("nan"), "negzero": -0.0,
                        "big": 1e308}, step=1)
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    got = {key: [m.value for m in client.get_metric_history(backend.run_id, key)]
           for key in ("inf", "ninf", "nan", "negzero", "big")}
    assert math.isnan(got.pop("nan")[0]) and got["big"] == [1e308]
    if store == "sqlite":
        assert got["inf"] == [sys.float_info.max] == [1.7976931348623157e308] and got["ninf"] == [-sys.float_info.max]
        assert got["negzero"] == [0.0] and math.copysign(1.0, got["negzero"][0]) == 1.0
    else:
        assert got["inf"] == [math.inf] and got["ninf"] == [-math.inf]
        assert math.copysign(1.0, got["negzero"][0]) == -1.0


def test_a_resumed_run_does_not_write_again_a_step_it_holds_as_media_only(tmp_path):
    """A resumed run skipped the steps it held as metrics only: a step of images and texts without a scalar
    was written again (a second image, its text file replaced by the resumed run's)."""
    first = MlflowBackend()
    logger = Logger([first], RunInfo("media", tmp_path))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.commit(0)
    for step in (5, 10):  # media only
        logger.log_image("img", torch.full((4, 4), 0.5), step=step)
        logger.log_text("note", f"first run, step {step}", step=step)
        logger.commit(step)
    logger.close()
    again = MlflowBackend()
    logger = Logger([again], RunInfo("media", tmp_path, resume={"MlflowBackend": first.run_id}))
    for step in (5, 10, 15):  # the resumed run runs 5 and 10 again
        logger.log_image("img", torch.full((4, 4), 0.25), step=step)
        logger.log_text("note", f"resumed run, step {step}", step=step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=again.tracking_uri)
    for step in (5, 10):
        text = client.download_artifacts(again.run_id, f"text/note/step_{step:08d}.txt", str(tmp_path / f"t{step}"))
        assert open(text).read() == f"first run, step {step}"
    images = [a for a in _artifacts(client, again.run_id) if a.startswith("images/img") and a.endswith(".png")]
    # MLflow names an image images/<key><sep>step<sep><step><sep>timestamp...: one per step, 5 and 10 not twice
    assert sorted(int(re.search(r"step\W(\d+)\W", a).group(1)) for a in images) == [5, 10, 15], images


@pytest.mark.parametrize("key", ["...", "..hidden/x", "..a"])
def test_a_key_whose_name_starts_with_two_dots_costs_mlflow_no_other_value(tmp_path, key):
    """MLflow refuses a name whose path starts with ``..`` (not only a part that is ``..``), and one refused name
    failed the whole ``log_batch``: every metric of every step, and every param of the call, was lost."""
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("dots", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"loss": 0.5 * step, key: 1.0}, step=step)
        logger.commit(step)
    logger.log_hyperparams({"lr": 0.001, key: 3})
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    run = client.get_run(backend.run_id)
    name = "__" + key[2:]
    assert [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "loss")] == [(1, 0.5), (2, 1.0)]
    assert [m.value for m in client.get_metric_history(backend.run_id, name)] == [1.0, 1.0]
    assert run.data.params == {"lr": "0.001", name: "3"}


def test_a_resumed_run_logs_each_key_to_the_series_it_had_where_two_keys_sanitise_alike(tmp_path):
    """``acc[top1]`` took the MLflow name ``acc_top1_`` and the later key ``acc_top1_`` the name ``acc_top1__2``.
    A resumed run (a new backend, as in a new process) named its keys afresh: the key it saw first took the plain
    name, so each series went on with the other key's values (media folders alike). Each renamed key is now written
    down in a run tag."""
    first = MlflowBackend()
    logger = Logger([first], RunInfo("resumed", tmp_path))
    logger.log_hyperparams({"w[0]": 1, "w_0_": 2})
    for step in (1, 2):
        logger.log_metrics({"acc[top1]": 0.9}, step=step)  # every step
        logger.log_text("notes[a]", f"a{step}", step=step)
        if step == 2:
            logger.log_metrics({"acc_top1_": 0.1}, step=step)  # evaluation steps only
            logger.log_text("notes_a_", f"b{step}", step=step)
        logger.commit(step)
    logger.close()
    again = MlflowBackend()
    logger = Logger([again], RunInfo("resumed", tmp_path, resume={"MlflowBackend": first.run_id}))
    logger.log_hyperparams({"w_0_": 2, "w[0]": 1})  # the same params, in another order: nothing changed
    for step in (3, 4):
        if step == 3:
            logger.log_metrics({"acc_top1_": 0.1}, step=step)  # evaluation comes first this time
            logger.log_text("notes_a_", f"b{step}", step=step)
        logger.log_metrics({"acc[top1]": 0.9}, step=step)
        logger.log_text("notes[a]", f"a{step}", step=step)
        logger.commit(step)
    logger.log_metrics({"fresh[x]": 2.0, "loss": 1.0}, step=5)  # a key renamed only after the resume
    logger.commit(5)
    logger.close()
    assert logger.failures == {} and again.run_id == first.run_id
    client = MlflowClient(tracking_uri=again.tracking_uri)

    def series(name):
        return {m.step: m.value for m in client.get_metric_history(again.run_id, name)}

    assert series("acc_top1_") == {1: 0.9, 2: 0.9, 3: 0.9, 4: 0.9}
    assert series("acc_top1__2") == {2: 0.1, 3: 0.1}
    assert series("fresh_x_") == {5: 2.0} and series("loss") == {5: 1.0}
    run = client.get_run(again.run_id)
    assert run.data.params == {"w_0_": "1", "w_0__2": "2"}
    assert not any(tag.startswith("instrument.param/") for tag in run.data.tags)  # no param read as changed
    texts = {path: open(client.download_artifacts(again.run_id, path)).read()
             for path in _artifacts(client, again.run_id, "text")}
    assert texts == {"text/notes_a_/step_00000001.txt": "a1", "text/notes_a_/step_00000002.txt": "a2",
                     "text/notes_a_/step_00000003.txt": "a3", "text/notes_a_/step_00000004.txt": "a4",
                     "text/notes_a__2/step_00000002.txt": "b2", "text/notes_a__2/step_00000003.txt": "b3"}
    third = MlflowBackend()  # and once more: the names restored are kept, the plain ones too
    logger = Logger([third], RunInfo("resumed", tmp_path, resume={"MlflowBackend": first.run_id}))
    logger.log_metrics({"fresh_x_": 3.0, "acc_top1_": 0.2, "fresh[x]": 4.0, "loss": 0.5}, step=6)
    logger.close()
    assert logger.failures == {}
    assert series("fresh_x_") == {5: 2.0, 6: 4.0} and series("fresh_x__2") == {6: 3.0}
    assert series("acc_top1__2") == {2: 0.1, 3: 0.1, 6: 0.2} and series("loss") == {5: 1.0, 6: 0.5}


def test_a_run_made_before_names_were_tagged_keeps_its_renamed_keys_series_on_resume(tmp_path):
    """A run written before the name tags holds ``acc_1`` for the key ``acc@1`` with no tag saying so. Taking
    every untagged name for its own key's (as in a run that tags its names) split that series at the resume
    into ``acc_1`` and ``acc_1_2`` (a review): such a run's names go to the first key that maps to them, as
    before."""
    first = MlflowBackend()
    logger = Logger([first], RunInfo("old", tmp_path))
    logger.log_metrics({"acc@1": 0.5}, step=1)
    logger.close()
    client = MlflowClient(tracking_uri=first.tracking_uri)
    for tag in list(client.get_run(first.run_id).data.tags):  # as a run written before the tags looks
        if tag.startswith("instrument."):
            client.delete_tag(first.run_id, tag)
    again = MlflowBackend()
    logger = Logger([again], RunInfo("old", tmp_path, resume={"MlflowBackend": first.run_id}))
    logger.log_metrics({"acc@1": 0.75}, step=2)
    logger.close()
    assert logger.failures == {}
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "acc_1")] == [(1, 0.5), (2, 0.75)]
    assert "acc_1_2" not in client.get_run(first.run_id).data.metrics


def test_a_resumed_run_keeps_media_and_param_names_held_under_the_keys_own_name(tmp_path):
    """Media and params named as their keys were not written down: after a resume, a key that sanitises to such a
    name took it (``notes[a]`` wrote into ``notes_a_``'s folder; ``w[0]``'s value read as a change of ``w_0_``)."""
    first = MlflowBackend()
    logger = Logger([first], RunInfo("held", tmp_path))
    logger.log_hyperparams({"w_0_": 2})
    logger.log_text("notes_a_", "b1", step=1)
    logger.close()
    again = MlflowBackend()
    logger = Logger([again], RunInfo("held", tmp_path, resume={"MlflowBackend": first.run_id}))
    logger.log_hyperparams({"w[0]": 1, "w_0_": 2})
    logger.log_text("notes[a]", "a2", step=2)
    logger.log_text("notes_a_", "b2", step=2)
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=again.tracking_uri)
    run = client.get_run(again.run_id)
    assert run.data.params == {"w_0_": "2", "w_0__2": "1"}
    assert not any(tag.startswith("instrument.param/") for tag in run.data.tags)
    texts = {path: open(client.download_artifacts(again.run_id, path)).read()
             for path in _artifacts(client, again.run_id, "text")}
    assert texts == {"text/notes_a_/step_00000001.txt": "b1", "text/notes_a_/step_00000002.txt": "b2",
                     "text/notes_a__2/step_00000002.txt": "a2"}


def test_a_resume_that_fails_while_opening_opens_whole_at_the_next_try(tmp_path, monkeypatch):
    """The run id was set before the resume read what the run holds: one failed read left the backend open with
    no names restored (two keys swapped series) and no last step (steps written twice)."""
    first = MlflowBackend()
    logger = Logger([first], RunInfo("half", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"acc[top1]": 0.9}, step=step)
        if step == 2:
            logger.log_metrics({"acc_top1_": 0.1}, step=step)
        logger.commit(step)
    logger.close()
    fail = [True]
    history = MlflowClient.get_metric_history

    def flaky(self, *args, **kwargs):
        if fail and fail.pop():
            raise ConnectionError("the store went away for a moment")
        return history(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "get_metric_history", flaky)
    again = MlflowBackend(retry_after=0)
    logger = Logger([again], RunInfo("half", tmp_path, resume={"MlflowBackend": first.run_id}),
                    on_backend_error="warn")
    for step in (2, 3):  # step 2 is the resumed run's again
        logger.log_metrics({"acc_top1_": 0.1, "acc[top1]": 0.9}, step=step)
        logger.commit(step)
    logger.close()
    client = MlflowClient(tracking_uri=again.tracking_uri)
    series = {name: [(m.step, m.value) for m in client.get_metric_history(first.run_id, name)]
              for name in ("acc_top1_", "acc_top1__2")}
    assert series == {"acc_top1_": [(1, 0.9), (2, 0.9), (3, 0.9)], "acc_top1__2": [(2, 0.1), (3, 0.1)]}


def test_a_name_tag_that_cannot_be_written_costs_no_value_and_is_sent_once(tmp_path, monkeypatch):
    """The name tags went out before the step's media, so a failed tag batch cost the step's text (a review);
    and a hyperparameter's tag was sent again at every log_hyperparams call."""
    batches = []
    log_batch = MlflowClient.log_batch

    def recording(self, run_id, metrics=(), params=(), tags=(), *args, **kwargs):
        named = [tag.key for tag in tags if tag.key.startswith("instrument.key.")]
        batches.append(len(named))
        if named and len(batches) == 2:  # the first batch of name tags
            raise ConnectionError("503")
        return log_batch(self, run_id, metrics, params, tags, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", recording)
    backend = MlflowBackend()
    logger = Logger([backend], RunInfo("tags", tmp_path), on_backend_error="warn")
    logger.log_metrics({"acc@1": 0.5}, step=1)
    logger.log_text("note", "kept", step=1)
    logger.commit(1)
    logger.log_metrics({"acc@1": 0.6}, step=2)
    logger.commit(2)
    for _ in range(3):
        logger.log_hyperparams({"w[0]": 1})
    logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    assert open(client.download_artifacts(backend.run_id, "text/note/step_00000001.txt")).read() == "kept"
    assert [m.value for m in client.get_metric_history(backend.run_id, "acc_1")] == [0.5, 0.6]
    tags = client.get_run(backend.run_id).data.tags
    assert sum(tag.startswith("instrument.key.") for tag in tags) == 3  # acc@1, note, w[0]: each written
    assert sum(1 for n in batches if n) == 3  # the failed batch, its retry with step 2, and w[0]'s tag once


def test_a_name_tag_that_cannot_be_written_costs_the_hyperparameters_call_nothing(tmp_path, monkeypatch):
    """The name tags went out before the operative config text, which a hyperparameters call sends once: a failed
    tag batch lost it (a review)."""
    log_batch = MlflowClient.log_batch
    failed = []

    def refusing(self, run_id, metrics=(), params=(), tags=(), *args, **kwargs):
        if any(tag.key.startswith("instrument.key.") for tag in tags) and not failed:
            failed.append(True)
            raise ConnectionError("503")
        return log_batch(self, run_id, metrics, params, tags, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", refusing)
    backend = MlflowBackend(retry_after=0)  # the next record tries the store again at once
    logger = Logger([backend], RunInfo("config", tmp_path), on_backend_error="warn")
    logger.log_hyperparams({"w[0]": 1}, config_text="Model.depth = 3\n")
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.commit(1)
    logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    assert failed and open(client.download_artifacts(backend.run_id, "config/operative_config.gin")).read() == \
        "Model.depth = 3\n"
    run = client.get_run(backend.run_id)
    assert run.data.params == {"w_0_": "1"} and any(tag.startswith("instrument.key.") for tag in run.data.tags)
    assert [m.value for m in client.get_metric_history(backend.run_id, "loss")] == [0.5]  # sent with this record


_POOL_OF_MLFLOW_RUNS = """
import multiprocessing, sys
import mlflow  # imported before the fork: every worker reaches the store's first use at about the same time
import instrument

def task(k):
    with instrument.Instrumentation(log_interval=1, run_name=f"t{k}", log_dir=sys.argv[1], overhead_budget=None,
                                    backends=[instrument.MlflowBackend()]) as inst:
        for step in range(3):
            with inst.step(step):
                inst.logger.log_metrics({"loss": float(step)}, step=step)
    return k

if __name__ == "__main__":
    with multiprocessing.get_context("fork").Pool(4) as pool:
        print(pool.map(task, range(4)))
"""


def test_pool_workers_sharing_a_log_dir_create_the_default_store_one_at_a_time(tmp_path):
    """A sweep's Pool workers with one log_dir share `sqlite:///<log_dir>/mlflow.db`; created and migrated by
    several processes at once, most workers' MLflow failed to open (MLflow's "Online migration expected to match
    one row", "duplicate column name"). Each run is now there, finished, with every step."""
    from tests.conftest import run_child

    out = run_child(tmp_path, _POOL_OF_MLFLOW_RUNS, str(tmp_path / "runs"), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("instrument").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["t0", "t1", "t2", "t3"]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2]



@pytest.mark.parametrize("where", ["one", "two"])
def test_one_instance_given_to_a_new_run_after_a_resume_writes_every_step_of_it_into_its_own_store(tmp_path, where):
    """One MlflowBackend resumed run "a" (which held steps 0..4), closed, then opened a new run "b": it kept a's
    last step, so b held only the steps above it (0..4 skipped, without a word), without the param a already
    held, and ended KILLED as a did; given another log_dir, b went into a's store all the same (the default URI
    resolved for a stuck)."""
    first = MlflowBackend()
    first.open(RunInfo("a", tmp_path / "one"))
    first.log_hyperparams({"lr": 0.1})
    for step in range(5):
        first.write(StepRecord(step=step, scalars={"v": float(step)}))
    first.close()
    reused = MlflowBackend()
    reused.open(RunInfo("a", tmp_path / "one", resume={"MlflowBackend": first.run_id}))
    reused.write(StepRecord(step=4, scalars={"v": -1.0}))  # held: not written again
    reused.write(StepRecord(step=5, scalars={"v": 5.0}))
    reused.on_exit("killed")
    reused.close()
    reused.open(RunInfo("b", tmp_path / where))  # a new run through the same instance
    reused.log_hyperparams({"lr": 0.1, "seed": 1})
    for step in range(8):
        reused.write(StepRecord(step=step, scalars={"v": 100.0 + step}))
    reused.close()
    client = MlflowClient(tracking_uri=reused.tracking_uri)
    assert [(m.step, m.value) for m in client.get_metric_history(reused.run_id, "v")] == [
        (step, 100.0 + step) for step in range(8)]
    run = client.get_run(reused.run_id)
    assert run.data.params == {"lr": "0.1", "seed": "1"}
    assert run.info.run_name == "b" and run.info.status == "FINISHED"
    assert reused.tracking_uri == f"sqlite:///{(tmp_path / where / 'mlflow.db').resolve()}"
    old = MlflowClient(tracking_uri=first.tracking_uri)
    names = [run.info.run_name for run in old.search_runs([old.get_experiment_by_name("instrument").experiment_id])]
    assert sorted(names) == (["a", "b"] if where == "one" else ["a"])
    assert old.get_run(first.run_id).info.status == "KILLED"
    assert [(m.step, m.value) for m in old.get_metric_history(first.run_id, "v")] == [
        (step, float(step)) for step in range(6)]


def test_keys_too_long_for_a_name_tag_go_on_under_their_names_after_a_resume(tmp_path, monkeypatch):
    """Two keys of 6,001 characters sharing their first 6,000 are cut to one 250-character name: the later is
    numbered. Their name tags could not hold them (a tag's value takes about 5,000 characters), so a resumed run
    found no tag, took each held name for its own key's and numbered both keys anew: each series split in three
    names. The tag now holds such a key's SHA-256."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path}/mlruns"
    first_key, second_key = "p" * 6000 + "A", "p" * 6000 + "B"
    first = MlflowBackend(tracking_uri=uri)
    logger = Logger([first], RunInfo("long", tmp_path))
    for step, key in ((0, first_key), (1, second_key)):
        logger.log_metrics({key: float(step)}, step=step)
        logger.commit(step)
    logger.close()
    for order in ((2, second_key), (3, first_key)), ((4, first_key), (5, second_key)):
        again = MlflowBackend(tracking_uri=uri)
        logger = Logger([again], RunInfo("long", tmp_path, resume={"MlflowBackend": first.run_id}))
        for step, key in order:
            logger.log_metrics({key: float(step)}, step=step)
            logger.commit(step)
        logger.close()
        assert logger.failures == {} and again.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    cut = "p" * 250
    assert {name: [m.step for m in client.get_metric_history(first.run_id, name)]
            for name in client.get_run(first.run_id).data.metrics} == {cut: [0, 3, 4], cut[:242] + "_2": [1, 2, 5]}


def test_a_file_store_keeps_a_key_and_a_key_under_it_apart_across_a_resume(tmp_path, monkeypatch, caplog):
    """A file store keeps each metric and param as a file named by its key: ``a`` beside ``a/b`` needs ``a`` as a
    file and as a folder. MLflow then failed the step's whole ``log_batch`` part way, at every step: ``a/b`` and
    every metric after it in the batch (``zz``) were lost, and so were the params after ``opt`` with the config.
    The later key is numbered where it meets the other, as keys that sanitise alike are, also after a resume."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path}/mlruns"
    first = MlflowBackend(tracking_uri=uri)
    logger = Logger([first], RunInfo("nested", tmp_path))
    logger.log_hyperparams({"opt": 1, "opt/lr": 0.5, "z": 3}, config_text="Model.width = 4\n")
    for step in (0, 1):
        logger.log_metrics({"a": 1.0 + step, "a/b": 2.0 + step, "zz": 3.0 + step, "c/d": 4.0 + step}, step=step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}
    again = MlflowBackend(tracking_uri=uri)  # resumed: each key keeps its name, whichever comes first now
    logger = Logger([again], RunInfo("nested", tmp_path, resume={"MlflowBackend": first.run_id}))
    logger.log_metrics({"c": 5.0, "a/b": 6.0, "a": 7.0}, step=2)
    logger.commit(2)
    logger.close()
    assert logger.failures == {} and again.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(first.run_id)
    assert {name: [(m.step, m.value) for m in client.get_metric_history(first.run_id, name)]
            for name in run.data.metrics} == {
        "a": [(0, 1.0), (1, 2.0), (2, 7.0)], "a_2/b": [(0, 2.0), (1, 3.0), (2, 6.0)], "zz": [(0, 3.0), (1, 4.0)],
        "c/d": [(0, 4.0), (1, 5.0)], "c_2": [(2, 5.0)]}
    assert run.data.params == {"opt": "1", "opt_2/lr": "0.5", "z": "3"}
    assert "config/operative_config.gin" in _artifacts(client, first.run_id)
    assert "which a file store cannot keep beside 'a' (each name is a file)" in caplog.text
