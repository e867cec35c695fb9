"""Every backend, written for real and read back with the destination's own reader."""

import json
import logging
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import instrument
from tests.conftest import Recorder, event_accumulator, read_scalars
from tests.wandb_reader import read_run


def _state_sequence(seed=0, n_iter=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 6, 6, generator=g)
    states = [x]
    for _ in range(n_iter):
        x = torch.tanh(x + 0.3 * torch.randn(x.shape, generator=g))
        states.append(x)
    return states


def _run(backends, log_dir, steps=(0, 1)):
    inst = instrument.Instrumentation([instrument.IterationStats(), instrument.UpdateNorm(), Recorder()],
                                      backends=backends, log_interval=1, log_dir=str(log_dir), run_name="r",
                                      hyperparams={"lr": 0.01, "nested": {"depth": 3}})
    states = _state_sequence()
    for step in steps:
        with inst.step(step) as s:
            for i in range(len(states) - 1):
                s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
            inst.logger.log_metrics({"loss": torch.tensor(0.5 * (step + 1))}, step=step, prefix="train")
    inst.close()
    return states


def test_tensorboard_values_match_a_float64_reference(tmp_path):
    states = _run([instrument.TensorBoardBackend()], tmp_path)
    scalars = read_scalars(tmp_path / "r")
    last = states[-1].double().numpy()
    per_channel = last.transpose(1, 0, 2, 3).reshape(5, -1)
    for c in range(5):
        assert scalars[f"iteration_stats/mean/c{c}"][1] == pytest.approx(per_channel[c].mean(), rel=1e-5, abs=1e-7)
        assert scalars[f"iteration_stats/std/c{c}"][1] == pytest.approx(per_channel[c].std(), rel=1e-5)
        assert scalars[f"iteration_stats/min/c{c}"][1] == pytest.approx(per_channel[c].min(), rel=1e-5)
        assert scalars[f"iteration_stats/max/c{c}"][1] == pytest.approx(per_channel[c].max(), rel=1e-5)
    pairs = zip(states, states[1:], strict=False)
    norms = [np.linalg.norm((b - a).double().numpy().reshape(3, -1), axis=1).mean() for a, b in pairs]
    assert scalars["update_norm/l2/mean"][0] == pytest.approx(np.mean(norms), rel=1e-5)
    assert scalars["update_norm/l2/last"][0] == pytest.approx(norms[-1], rel=1e-5)
    assert scalars["train/loss"] == {0: 0.5, 1: 1.0}
    acc = event_accumulator(tmp_path / "r")
    tags = acc.Tags()
    assert {"iteration_stats/mean", "iteration_stats/std", "iteration_stats/min", "iteration_stats/max"} <= set(
        tags["images"])
    assert [e.step for e in acc.Images("iteration_stats/mean")] == [0, 1]
    assert acc.Images("iteration_stats/mean")[0].width > 100
    assert "update_norm/l2" in tags["histograms"]
    assert acc.Histograms("update_norm/l2")[0].histogram_value.num == 4
    texts = {t for t in tags["tensors"]}
    assert "hyperparameters/text_summary" in texts


def test_tensorboard_writes_a_steps_scalars_as_one_event_at_its_step_and_wall_time(tmp_path):
    """One event per step (one protobuf message, see TensorBoardBackend), read back raw with TensorBoard's own
    loader and proto: every key with its value, the committed step and the record's wall time, not the write's."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("one", tmp_path))
    metrics = {f"m{i:03d}": i / 7 for i in range(100)}
    logger.log_metrics(metrics, step=5, prefix="train")
    record = logger.commit().result(timeout=60)
    logger.close()
    (path,) = (tmp_path / "one").glob("events.out.tfevents.*")
    events = [e for e in map(Event.FromString, RawEventFileLoader(str(path)).Load())
              if e.HasField("summary") and e.summary.value and e.summary.value[0].tag.startswith("train/")]
    assert len(events) == 1 and events[0].step == 5 and events[0].wall_time == record.wall_time
    written = {v.tag: v.simple_value for v in events[0].summary.value}
    assert written == {f"train/{k}": pytest.approx(v, rel=1e-7) for k, v in metrics.items()}


def test_jsonl_one_object_per_committed_step(tmp_path):
    _run([instrument.JsonlBackend()], tmp_path, steps=(0, 1, 2))
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["hyperparameters"] == {"lr": 0.01, "nested/depth": 3}
    steps = [line for line in lines if "step" in line]
    assert [line["step"] for line in steps] == [0, 1, 2]
    assert steps[2]["metrics"]["train/loss"] == 1.5
    assert steps[0]["histograms"]["update_norm/l2"]["count"] == 4
    assert steps[0]["images"]["iteration_stats/mean"][2] == 3


def test_jsonl_keeps_nan_readable(tmp_path):
    log = instrument.Logger([instrument.JsonlBackend(path=str(tmp_path / "m.jsonl"))])
    log.log_metrics({"x": float("nan")}, step=0)
    log.close()
    line = json.loads((tmp_path / "m.jsonl").read_text())
    assert line["metrics"]["x"] == "nan"


def test_console_prints_one_row_per_commit(capsys):
    log = instrument.Logger([instrument.ConsoleBackend(keys=["train/"], max_keys=3, legend=False)])
    for step in range(3):
        log.log_metrics({"loss": torch.tensor(0.25), "acc": 0.5}, step=step, prefix="train")
        log.log_metrics({"hidden": 1.0}, step=step)
        log.commit()
    log.flush()  # rows are printed on the logger's writer thread
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["   step       loss        acc"] + [f"{s:>7}       0.25        0.5" for s in range(3)]


def test_wandb_offline_run_read_back(tmp_path):
    pytest.importorskip("wandb")
    _run([instrument.WandbBackend(project="tests")], tmp_path)
    rows, config = read_run(tmp_path / "r")
    by_step = {row["_step"]: row for row in rows}
    assert sorted(by_step) == [0, 1]
    assert by_step[1]["train/loss"] == 1.0
    assert math.isfinite(by_step[0]["update_norm/l2/mean"])
    image = by_step[0]["iteration_stats/mean"]
    assert image["_type"] == "image-file" and image["width"] > 100
    assert config["lr"] == 0.01 and config["nested"] == {"depth": 3}  # nested: W&B groups it


def test_wandb_mode_is_validated():
    with pytest.raises(instrument.ConfigurationError, match="mode must be one of"):
        instrument.WandbBackend(mode="offine")


def test_missing_wandb_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(instrument.MissingExtraError, match=r"pip install 'torch-instrument\[wandb\]'") as raised:
        instrument.WandbBackend().open(instrument.RunInfo("x"))
    assert raised.value.name == "wandb"  # as ImportError.name: code that skips a missing SDK by name sees it


def test_an_sdk_installed_but_failing_to_import_is_not_called_missing(tmp_path, monkeypatch):
    """An SDK that is installed but whose own import fails (mlflow 2.10 under today's setuptools: no
    pkg_resources) was reported as "not installed, pip install ...", advice that changes nothing; the cause was
    only on __cause__, which the CLI's gin traceback does not show. The message now gives the import's error."""
    from instrument.errors import MissingExtraError, require

    (tmp_path / "brokensdk").mkdir()
    (tmp_path / "brokensdk" / "__init__.py").write_text("import a_dependency_that_is_not_there_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtraError) as raised:
        require("brokensdk", "wandb", "WandbBackend")
    message = str(raised.value)
    assert "installed but failed to import" in message and "a_dependency_that_is_not_there_xyz" in message
    assert "not installed" not in message and "torch-instrument[wandb]" in message
    (tmp_path / "selfish").mkdir()  # installed, and its own import fails naming the package itself
    (tmp_path / "selfish" / "__init__.py").write_text("from selfish import gone\n")
    with pytest.raises(MissingExtraError, match="installed but failed to import: ImportError: cannot import name"):
        require("selfish", "wandb", "WandbBackend")
    with pytest.raises(MissingExtraError, match="which is not installed"):  # truly absent: as before
        require("no_such_sdk_xyz", "wandb", "WandbBackend")
    with pytest.raises(MissingExtraError, match="which is not installed"):  # a submodule of an absent package
        require("no_such_sdk_xyz.sub", "x", "F")


@pytest.mark.parametrize("values", [[math.nan, math.nan], [math.inf, 1.0, -math.inf], [1e308, -1e308]],
                         ids=["all_nan", "only_inf", "huge"])
def test_a_histogram_tensorboard_cannot_bin_costs_that_histogram_only(values, tmp_path, caplog):
    # Diverged gradients are exactly when a user logs a histogram of NaN; the rest of the step must still land.
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("h", tmp_path))
    for step in (0, 1):
        logger.log_metrics({"loss": 1.0}, step=step)
        logger.log_histogram("grads", np.array(values), step=step)
        logger.log_text("note", "diverged", step=step)
        logger.log_image("state", np.zeros((4, 4, 3)), step=step)
        logger.commit(step)
    logger.close()
    with warnings.catch_warnings():  # TensorBoard's own reader overflows interpolating buckets 1e308 wide
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        acc = event_accumulator(tmp_path / "h")
    assert [e.step for e in acc.Tensors("note/text_summary")] == [0, 1]
    assert [e.step for e in acc.Images("state")] == [0, 1]
    assert "TensorBoardBackend" not in logger.failures
    finite = [v for v in values if math.isfinite(v)]
    if finite:  # the finite values are binned, NaN and inf left out
        histos = [e.histogram_value for e in acc.Histograms("grads")]
        assert [(h.num, h.min, h.max) for h in histos] == [(len(finite), min(finite), max(finite))] * 2
        assert sum(histos[0].bucket) == len(finite)
    else:
        assert "grads" not in acc.Tags()["histograms"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "'grads'" in r.getMessage()]
    assert len(said) == (0 if len(finite) == len(values) else 1)  # once per key, not once per step


def test_a_nan_in_a_histogram_costs_wandb_that_histogram_only(tmp_path):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_histogram("grads", np.array([0.1, math.nan, 0.3]), step=0)
    logger.commit(0)
    logger.log_metrics({"loss": 2.0}, step=1)
    logger.close()
    rows, _ = read_run(tmp_path / "w")
    assert {row["_step"]: row["loss"] for row in rows} == {0: 1.0, 1: 2.0}
    (grads,) = [row["grads"] for row in rows if "grads" in row]  # binned from its finite values
    assert grads["_type"] == "histogram" and sum(grads["values"]) == 2


def test_wandb_bins_histograms_whose_range_is_narrow_for_their_magnitude(tmp_path):
    """A review found these dropped with 'Too many bins for data range': a constant float32-min mask, ids near
    1e17, and two adjacent floats. Each has fewer distinct floats in its range than 65 bin edges."""
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    values = {"mask": np.full(10, np.finfo(np.float32).min, dtype=np.float64),
              "ids": torch.tensor([10**17, 10**17 + 8, 10**17 + 16]), "near": np.array([1.0, 1.0 + 2**-52])}
    for tag, v in values.items():
        logger.log_histogram(tag, v, step=0)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    rows, _ = read_run(tmp_path / "w")
    (row,) = [r for r in rows if "loss" in r]
    for tag, v in values.items():
        assert row[tag]["_type"] == "histogram" and sum(row[tag]["values"]) == len(v), tag
        assert row[tag]["bins"][0] <= float(np.min(np.asarray(v, dtype=np.float64)))
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("c", tmp_path))
    logger.log_histogram("zeros", np.zeros(5), step=0)  # a constant: numpy's own +-0.5 range, not one tiny bin
    logger.log_histogram("fmax", np.full(2, np.finfo(np.float64).max), step=0)  # no +-0.5 there, and no inf edge
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    rows, _ = read_run(tmp_path / "c")
    (zeros,) = [r["zeros"] for r in rows if "zeros" in r]
    assert zeros["bins"][0] == -0.5 and zeros["bins"][-1] == 0.5 and sum(zeros["values"]) == 5
    (fmax,) = [r["fmax"] for r in rows if "fmax" in r]
    assert all(math.isfinite(edge) for edge in fmax["bins"]) and sum(fmax["values"]) == 2


def test_a_media_value_wandb_cannot_write_costs_that_value_only(tmp_path, caplog):
    """W&B writes an image into its run's media folder inside run.log; when that fails (here the folder is a
    file, a fault that root meets too), the step's scalars are still logged and only the image is dropped."""
    pytest.importorskip("wandb")
    backend = instrument.WandbBackend(project="tests")
    logger = instrument.Logger([backend], instrument.RunInfo("w", tmp_path))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_image("img", torch.rand(8, 8), step=0)
    logger.commit(0)
    assert logger.flush()
    media = Path(backend.run.dir) / "media"
    shutil.rmtree(media)
    media.write_text("a file where W&B keeps its media folder")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_metrics({"loss": 2.0}, step=1)
        logger.log_image("img", torch.rand(8, 8), step=1)
        logger.commit(1)
        logger.log_metrics({"loss": 3.0}, step=2)
        logger.log_image("img", torch.rand(8, 8), step=2)
        logger.commit(2)
        logger.close()
    rows, _ = read_run(tmp_path / "w")
    assert {row["_step"]: row["loss"] for row in rows} == {0: 1.0, 1: 2.0, 2: 3.0}
    assert [row["_step"] for row in rows if "img" in row] == [0]
    said = [r.getMessage() for r in caplog.records if "'img'" in r.getMessage()]
    assert len(said) == 1 and "NotADirectoryError" in said[0], said  # named once, not once per step


def _strict_json(line):
    """A JSON reader that, like jq or JavaScript's JSON.parse, has no NaN or Infinity."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_jsonl_hyperparameter_line_is_json_with_a_nan_hyperparameter(tmp_path):
    log = instrument.Logger([instrument.JsonlBackend(path=str(tmp_path / "m.jsonl"))])
    log.log_hyperparams({"lr": 0.1, "clip": float("inf"), "warmup": float("nan")})
    log.log_metrics({"x": 1.0}, step=0)
    log.close()
    lines = [_strict_json(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0]["hyperparameters"] == {"lr": 0.1, "clip": "inf", "warmup": "nan"}  # as metrics write them


@pytest.mark.parametrize("seed", [2**60 + 1, 10**400], ids=["beyond_2_53", "beyond_float"])
def test_jsonl_writes_an_integer_sample_field_exactly(seed, tmp_path):
    log = instrument.Logger([instrument.JsonlBackend(path=str(tmp_path / "m.jsonl"))])
    log.log_samples("val", [{"input": "x", "seed": seed, "score": 1.0}], step=0)
    log.log_metrics({"loss": 0.5}, step=0)
    log.close()
    (line,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert line["metrics"] == {"loss": 0.5}
    assert line["samples"]["val"][0]["seed"] in (seed, str(seed))  # exact, as a JSON int or its digits
    assert line["samples"]["val"][0]["score"] == 1.0


def test_wandb_keeps_a_scalar_whose_key_is_also_a_histogram_tag(tmp_path, caplog):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_metrics({"reward": 0.5}, step=0)  # the mean, and its distribution under the same name
    logger.log_histogram("reward", np.array([0.1, 0.9]), step=0)
    logger.close()
    rows, _ = read_run(tmp_path / "w")
    values = [value for row in rows for value in row.values()]
    said = any("reward" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert 0.5 in values or said  # kept under some key, or at least said: JSONL and TensorBoard keep both
    (row,) = rows  # the scalar keeps its key; the histogram moves to <key>/histogram, with one warning
    assert row["reward"] == 0.5 and row["reward/histogram"]["_type"] == "histogram" and said


def test_wandb_keys_that_w_and_b_reserves_are_kept_under_user(tmp_path, caplog):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    for step in range(2):  # W&B would replace _step and _runtime by its own, and take _timestamp as its own
        logger.log_metrics({"_step": 100.0 + step, "_runtime": 5.0, "_timestamp": 7.0, "loss": float(step)},
                           step=step)
        logger.log_histogram("_h", np.array([0.1, 0.9]), step=step)
        logger.commit()
    logger.close()
    rows, _ = read_run(tmp_path / "w")
    assert [row["_step"] for row in rows] == [0, 1]  # W&B's own step column is the training step
    assert [row["user/_step"] for row in rows] == [100.0, 101.0]
    assert all(row["user/_runtime"] == 5.0 and row["user/_timestamp"] == 7.0 for row in rows)
    assert all(row["_timestamp"] > 1e9 and row["user/_h"]["_type"] == "histogram" for row in rows)
    said = [r.getMessage() for r in caplog.records if "W&B keeps the keys that start with '_'" in r.getMessage()]
    assert len(said) == 4  # once per key: _step, _runtime, _timestamp, _h


def test_a_text_tensorboard_cannot_encode_costs_that_text_only(tmp_path):
    logger = instrument.Logger([instrument.TensorBoardBackend(), instrument.JsonlBackend()],
                               instrument.RunInfo("t", tmp_path))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_text("checkpoint", "saved to /data/caf\udce9.pt", step=0)  # a non-UTF-8 file name, fsdecoded
    logger.log_samples("val", [{"input": "x", "output": "y", "score": 1.0}], step=0)
    logger.close()
    acc = event_accumulator(tmp_path / "t")
    assert [e.step for e in acc.Tensors("val/text_summary")] == [0]
    (text,) = acc.Tensors("checkpoint/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "saved to /data/caf\\udce9.pt"  # escaped, not dropped
    assert "TensorBoardBackend" not in logger.failures


def test_a_text_wandb_cannot_encode_costs_that_text_only(tmp_path):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_text("checkpoint", "saved to /data/caf\udce9.pt", step=0)
    logger.close()
    rows, _ = read_run(tmp_path / "w")
    assert [row.get("loss") for row in rows if row["_step"] == 0] == [0.5]
    (html,) = [row["checkpoint"] for row in rows if "checkpoint" in row]  # written, the surrogate escaped
    (files,) = (tmp_path / "w" / "wandb").glob("offline-run-*/files")
    assert "caf\\udce9.pt" in (files / html["path"]).read_text()


def test_a_hyperparameter_with_a_lone_surrogate_costs_tensorboard_nothing(tmp_path):
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("p", tmp_path))
    logger.log_hyperparams({"data": "/data/caf\udce9", "lr": 0.1}, config_text="Data.path = '/data/caf\udce9'")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    assert logger.failures == {}
    acc = event_accumulator(tmp_path / "p")
    (table,) = acc.Tensors("hyperparameters/text_summary")
    assert "/data/caf\\udce9" in table.tensor_proto.string_val[0].decode()
    assert [e.value for e in acc.Scalars("loss")] == [1.0]


def test_wandb_media_key_is_stable_when_the_scalar_of_that_name_comes_later(tmp_path):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_histogram("reward", np.array([0.1, 0.9]), step=0)  # no scalar "reward" yet: kept as "reward"
    logger.commit()
    logger.log_metrics({"reward": 0.5}, step=1)
    logger.log_histogram("reward", np.array([0.2, 0.8]), step=1)  # now moved to "reward/histogram"
    logger.close()
    rows, _ = read_run(tmp_path / "w")
    hist_keys = {k for row in rows for k, v in row.items() if isinstance(v, dict) and v.get("_type") == "histogram"}
    scalar_keys = {k for row in rows for k, v in row.items() if isinstance(v, float) and not k.startswith("_")}
    assert len(hist_keys) == 1  # one key for the histogram over the run
    assert not hist_keys & scalar_keys  # and never a key that holds both a histogram and a number


def test_wandb_writes_a_samples_table_whose_int_column_has_one_value_beyond_int64(tmp_path):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_samples("val", [{"input": "a", "seed": 1, "score": 1.0}, {"input": "b", "seed": 2**64, "score": 0.5}],
                       step=0)
    logger.close()
    (row,) = read_run(tmp_path / "w")[0]
    assert row["loss"] == 0.5
    assert row["val"]["nrows"] == 2  # the table is written, both samples in it


def test_wandb_writes_a_samples_table_with_a_nan_score(tmp_path):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_samples("val", [{"input": "a", "score": 1.0}, {"input": "b", "score": float("nan")}], step=0)
    logger.close()
    (row,) = read_run(tmp_path / "w")[0]
    assert row["loss"] == 0.5
    assert row["val"]["nrows"] == 2


def test_tensorboard_says_once_per_key_when_float32_cannot_hold_a_value(tmp_path, caplog):
    """TensorBoard stores float32: 1e39 reads inf and 1e-46 reads 0 there, while JSONL keeps both. One warning
    per key, none for values float32 holds, for zero, inf or NaN."""
    logger = instrument.Logger([instrument.TensorBoardBackend(), instrument.JsonlBackend()],
                               instrument.RunInfo("r", tmp_path))
    values = {"big": 1e39, "tiny": -1e-46, "fine": 3e38, "small": 1e-44, "zero": 0.0, "inf": math.inf,
              "nan": math.nan, "edge": 3.4028235e38, "half": 2.0**-150,  # float32's max as printed; rounds to 0
              "neg": -1e39}
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in (0, 1):
            logger.log_metrics(values, step=step)
            logger.commit(step)
        logger.close()
    said = [r.getMessage() for r in caplog.records if "stores scalars as float32" in r.getMessage()]
    assert len(said) == 4 and "'big' = 1e+39 reads inf" in "".join(said) and "'tiny'" in "".join(said)
    assert "'neg' = -1e+39 reads -inf" in "".join(said)
    assert "'half'" in "".join(said) and "'edge'" not in "".join(said)
    tb = read_scalars(tmp_path / "r")
    assert tb["big"][0] == math.inf and tb["tiny"][0] == 0.0 and tb["fine"][0] == pytest.approx(3e38, rel=1e-7)
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    metrics = next(line["metrics"] for line in lines if line.get("step") == 0 and "metrics" in line)
    assert metrics["big"] == 1e39 and metrics["tiny"] == -1e-46
