"""Keys a backend must rename never merge two series, and never change from one step to the next (a review found
both: a scalar moved to ``<key>/scalar`` over the user's own ``<key>/scalar``, W&B's ``user/_x`` over a literal
``user/_x``, a timer-form key renamed by what else its step held, training ``system/...`` keys mixed with the
system monitor's samples). Also W&B and MLflow media values a review found garbled or lost: a 1-pixel-wide image,
one value W&B cannot save costing the step's other media, MLflow image keys it refuses. Read back with each
backend's own reader."""

import json
import logging
from collections import defaultdict

import numpy as np
import pytest

import instrument
from instrument.backends.base import StepRecord
from tests.conftest import read_scalars
from tests.wandb_reader import read_run


def _commit(logger, metrics, step):
    logger.log_metrics(metrics, step=step)
    logger.commit(step)  # with the step's media values and timings


def _jsonl(path):
    series = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.get("metrics", {}).items():
            if "step" in row:
                series[key].append((row["step"], value))
    return dict(series)


def _tb(path):
    return {tag: sorted(values.items()) for tag, values in read_scalars(path).items()}


def _wandb(path):
    rows, _ = read_run(path)
    series = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if not key.startswith("_") and isinstance(value, (int, float)):
                series[key].append((row["_step"], value))
    return dict(series)


def test_timer_form_keys_are_renamed_the_same_way_at_every_step_in_every_backend(tmp_path):
    logger = instrument.Logger([instrument.JsonlBackend(), instrument.TensorBoardBackend()],
                               instrument.RunInfo("r", tmp_path))
    _commit(logger, {"user/timing/t/mean": 1000.0, "timing/t/mean": 1.0}, 1)
    _commit(logger, {"timing/t/mean": 2.0}, 2)
    _commit(logger, {"user/timing/t/mean": 3000.0}, 3)
    _commit(logger, {"timing/t/mean": 4.0, "user/timing/t/mean": 4000.0}, 4)  # the other order in one step
    with logger.timer("t"):
        pass
    _commit(logger, {"x": 0.0}, 5)
    logger.close()
    expected = {"user/timing/t/mean": [(1, 1.0), (2, 2.0), (4, 4.0)],
                "user/user/timing/t/mean": [(1, 1000.0), (3, 3000.0), (4, 4000.0)]}
    for series in (_jsonl(tmp_path / "r" / "metrics.jsonl"), _tb(tmp_path / "r")):
        assert {k: v for k, v in series.items() if k in expected} == expected  # exact in float32 too
        assert [step for step, _ in series["timing/t/mean"]] == [5]  # the timer's own, apart


def _moved_scalar_run(backend, tmp_path):
    logger = instrument.Logger([backend], instrument.RunInfo("r", tmp_path))
    logger.log_image("pic", np.zeros((4, 4, 3), np.uint8), step=1)
    _commit(logger, {"q": 0.0}, 1)
    _commit(logger, {"pic": 2.0, "pic/scalar": 222.0}, 2)  # both at once
    _commit(logger, {"pic": 3.0}, 3)
    logger.log_image("img", np.zeros((4, 4, 3), np.uint8), step=4)
    _commit(logger, {"img": 4.0}, 5)  # moves to img/scalar
    _commit(logger, {"img/scalar": 555.0, "img": 5.0}, 6)  # the user's own comes later
    logger.close()
    return logger


def _check_apart(series):
    values = {key: [v for _, v in points] for key, points in series.items()}
    pic = [k for k, v in values.items() if v == [2.0, 3.0]]
    img = [k for k, v in values.items() if v == [4.0, 5.0]]
    assert values.get("pic/scalar") == [222.0] and len(pic) == 1 and pic[0] != "pic/scalar", values
    assert len(img) == 1 and [k for k, v in values.items() if v == [555.0]] != img, values
    assert not [k for k, v in values.items() if len(set(v) & {2.0, 222.0, 4.0, 555.0}) > 1], values


def test_tensorboard_never_moves_a_scalar_onto_the_users_own_key(tmp_path):
    _moved_scalar_run(instrument.TensorBoardBackend(), tmp_path)
    _check_apart(_tb(tmp_path / "r"))


def test_wandb_never_moves_a_scalar_onto_the_users_own_key(tmp_path):
    pytest.importorskip("wandb")
    _moved_scalar_run(instrument.WandbBackend(project="tests"), tmp_path)
    _check_apart(_wandb(tmp_path / "r"))


def test_wandb_reserved_and_system_keys_move_to_user_without_meeting_a_literal_user_key(tmp_path, caplog):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("r", tmp_path))
    logger.write_system(StepRecord(step=0, scalars={"system/seconds": 0.5, "system/host_cpu_percent": 50.0}))
    _commit(logger, {"_hidden": 1.0, "system/host_cpu_percent": 900.0}, 0)
    _commit(logger, {"_hidden": 2.0, "user/_hidden": 2222.0, "user/system/host_cpu_percent": 901.0}, 1)
    logger.close()
    series = _wandb(tmp_path / "r")
    assert series["user/_hidden"] == [(0, 1.0), (1, 2.0)]
    assert series["user/user/_hidden"] == [(1, 2222.0)]
    assert series["user/system/host_cpu_percent"] == [(0, 900.0)]
    assert series["user/user/system/host_cpu_percent"] == [(1, 901.0)]
    assert [v for _, v in series["system/host_cpu_percent"]] == [50.0]  # the monitor's sample, not replaced
    assert any("system monitor" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_mlflow_keeps_training_system_keys_apart_from_the_monitors(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    backend = instrument.MlflowBackend()
    logger = instrument.Logger([backend], instrument.RunInfo("r", tmp_path))
    logger.write_system(StepRecord(step=10, scalars={"system/host_cpu_percent": 50.0}))
    for step in range(2):
        _commit(logger, {"system/host_cpu_percent": 900.0 + step}, step)
    logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(backend.run_id, key))
               for key in ("system/host_cpu_percent", "user/system/host_cpu_percent")}
    assert history == {"system/host_cpu_percent": [(10, 50.0)],
                       "user/system/host_cpu_percent": [(0, 900.0), (1, 901.0)]}


def test_wandb_keeps_a_one_pixel_wide_image_and_the_media_beside_one_it_cannot_save(tmp_path, caplog):
    pytest.importorskip("wandb")
    from PIL import Image

    column = (np.arange(27, dtype=np.uint8).reshape(9, 1, 3) * 9)
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("r", tmp_path))
    for step in range(2):
        logger.log_image("column", column, step=step)
        logger.log_histogram("h", np.arange(5.0) + step, step=step)
        logger.log_image("L" * 300, np.zeros((4, 4, 3), np.uint8), step=step)  # a file name too long to save
        _commit(logger, {"loss": float(step)}, step)
    logger.close()
    rows, _ = read_run(tmp_path / "r")
    assert [sorted(k for k in row if not k.startswith("_")) for row in rows] == [["column", "h", "loss"]] * 2
    (files,) = (tmp_path / "r" / "wandb").glob("offline-run-*/files")
    stored = np.asarray(Image.open(files / rows[0]["column"]["path"]).convert("RGB"))
    assert stored.shape == (9, 1, 3) and (stored == column).all()
    assert any("dropped the media value 'LLL" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("tag, shape", [("日本/画像", (4, 5, 3)), ("x" * 300, (4, 5, 3)), ("thin", (1, 300, 3)),
                                        ("edge", (49, 12544, 3))])  # 49 * 256 / 12544 is 0.99999... in floats
def test_mlflow_stores_images_of_any_tag_and_shape(tmp_path, tag, shape):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    backend = instrument.MlflowBackend()
    logger = instrument.Logger([backend], instrument.RunInfo("r", tmp_path))
    logger.log_image(tag, pixels, step=1)
    _commit(logger, {"loss": 1.0}, 1)
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    found = []

    def walk(path=None):
        for item in client.list_artifacts(backend.run_id, path):
            walk(item.path) if item.is_dir else found.append(item.path)

    walk("images")
    (png,) = [p for p in found if p.endswith(".png")]
    stored = np.asarray(Image.open(client.download_artifacts(backend.run_id, png)).convert("RGB"))
    assert (stored == pixels).all()


def test_a_users_timer_form_key_has_one_console_column_whether_or_not_a_timer_ran():
    import io

    stream = io.StringIO()
    logger = instrument.Logger([instrument.ConsoleBackend(keys=["user/"], stream=stream, legend=False)],
                               instrument.RunInfo("c"))
    for step in range(3):
        logger.log_metrics({"user/timing/fwd/mean": float(step)}, step=step)
        if step == 1:
            with logger.timer("fwd"):
                pass
        logger.commit(step)
    logger.close()
    lines = stream.getvalue().splitlines()
    assert lines[1].split() == ["step", "fwd/mean"]  # the shortest distinct suffix of user/user/timing/fwd/mean
    assert [line.split() for line in lines[2:5]] == [["0", "0"], ["1", "1"], ["2", "2"]]


def test_wandb_keeps_a_moved_scalars_key_after_an_offline_resume(tmp_path):
    pytest.importorskip("wandb")
    from pathlib import Path

    from tests.wandb_reader import read_history

    first = instrument.WandbBackend(project="tests")
    first.open(instrument.RunInfo("r", tmp_path))
    first.write(StepRecord(step=0, histograms={"hist": np.arange(3.0)}))
    first.write(StepRecord(step=1, scalars={"hist": 1.0}))
    run_id, first_file = first.run.id, Path(first.run.settings.sync_file)
    first.close()
    read_history(first_file, timeout=60.0)
    again = instrument.WandbBackend(project="tests")
    again.open(instrument.RunInfo("r", tmp_path, resume={"WandbBackend": run_id}))
    again.write(StepRecord(step=2, scalars={"hist": 2.0}))
    again_file = Path(again.run.settings.sync_file)
    again.close()
    rows = read_history(first_file) + read_history(again_file, timeout=60.0)
    assert [(row["_step"], row["hist/scalar"]) for row in rows if "hist/scalar" in row] == [(1, 1.0), (2, 2.0)]
