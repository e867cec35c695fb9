"""MlflowBackend against a real local MLflow store, read back with MLflow's own client."""

import numpy as np
import pytest
import torch

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
    assert _artifacts(client, run_id) == {
        "images/state/rgb/step_00000010.png",
        "text/note/step_00000010.txt",
        "samples/val/step_00000010.json",
        "config/operative_config.gin",
    }
    local = client.download_artifacts(run_id, "config/operative_config.gin")
    text = open(local).read()
    assert "Model.width = 64" in text and "abc123" not in text and "<redacted>" in text
    table = mlflow.artifacts.load_dict(client.download_artifacts(run_id, "samples/val/step_00000010.json"))
    assert table == {"columns": ["input", "output", "score"], "data": [["a", "b", 0.25]]}
    image = client.download_artifacts(run_id, "images/state/rgb/step_00000010.png")
    from PIL import Image

    assert np.asarray(Image.open(image)).shape == (4, 5, 3)


def test_default_is_a_sqlite_store_under_the_run_dir(tmp_path):
    backend = _run_through(MlflowBackend(), tmp_path)
    assert backend.tracking_uri == f"sqlite:///{(tmp_path / 'demo-run' / 'mlflow.db').resolve()}"
    assert (tmp_path / "demo-run" / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    _check(client, backend.run_id)
    experiment = client.get_experiment_by_name("instrument")
    assert experiment.artifact_location.startswith((tmp_path / "demo-run" / "mlartifacts").resolve().as_uri())


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
