"""Hyperparameters users can compare: TensorBoard's HParams plugin data (read back with TensorBoard's own loader
and its HParams backend), W&B's nested config (offline run read back), MLflow flat params and stepped images."""

import numpy as np
import pytest

import instrument
from instrument.backends.hparams import hyperparameter_table, order_params, unflatten_params
from tests.conftest import event_accumulator
from tests.wandb_reader import read_run

HYPERPARAMS = {"optim": {"lr": 0.003, "betas": (0.9, 0.99)}, "seed": 7, "hub_token": "secret!", "tags": None}


def _run(tmp_path, name, backends, lr=0.003, steps=2):
    instrument.parse_config([], ["Instrumentation.log_interval = 1", "Instrumentation.observers = [@IterationStats()]",
                                 "IterationStats.channel_scalars = False", "IterationStats.images = False"])
    params = {**HYPERPARAMS, "optim": {**HYPERPARAMS["optim"], "lr": lr}}
    inst = instrument.Instrumentation(backends=backends, log_dir=str(tmp_path), run_name=name,
                                      hyperparams=params, overhead_budget=None)
    for step in range(steps):
        with inst.step(step):
            inst.log({"loss": lr * (step + 1)}, prefix="train")
    inst.close()
    assert inst.failures == {}
    return inst


def _session_start(run_dir):
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    content = event_accumulator(run_dir).PluginTagToContent("hparams")
    assert set(content) == {metadata.SESSION_START_INFO_TAG}  # no experiment summary (see hparams_summary)
    data = plugin_data_pb2.HParamsPluginData.FromString(content[metadata.SESSION_START_INFO_TAG])
    hparams = {}
    for name, value in data.session_start_info.hparams.items():
        hparams[name] = getattr(value, value.WhichOneof("kind"))
    return data.session_start_info, hparams


def test_tensorboard_hparams_plugin_data_read_back(tmp_path):
    _run(tmp_path, "a", [instrument.TensorBoardBackend()])
    info, hparams = _session_start(tmp_path / "a")
    assert info.group_name == "a"
    assert hparams["optim/lr"] == pytest.approx(0.003) and hparams["seed"] == 7.0
    assert hparams["optim/betas"] == "(0.9, 0.99)" and hparams["tags"] == "None"
    assert hparams["hub_token"] == "<redacted>"
    # The operative gin bindings are hparams too.
    assert hparams["Instrumentation.log_interval"] == 1.0
    assert hparams["IterationStats.channel_scalars"] is False


def test_tensorboard_hparams_keep_every_digit_of_a_wide_int(tmp_path):
    """A seed or a hash beyond 2**53 was stored as a rounded double (the other backends keep its digits)."""
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("w", tmp_path))
    logger.log_hyperparams({"seed": 2**64 + 1, "small": 2**53, "neg": -(2**62) - 1, "lr": 0.5})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    _, hparams = _session_start(tmp_path / "w")
    assert hparams == {"seed": str(2**64 + 1), "small": float(2**53), "neg": str(-(2**62) - 1), "lr": 0.5}


def test_tensorboard_hparams_tab_compares_runs_with_their_metrics(tmp_path):
    """TensorBoard's own HParams backend (what its tab asks) sees both runs, their hparams and metrics."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment

    _run(tmp_path, "a", [instrument.TensorBoardBackend()], lr=0.003)
    _run(tmp_path, "b", [instrument.TensorBoardBackend()], lr=0.01)
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(tmp_path))
    backend = backend_context.Context(base_plugin.TBContext(logdir=str(tmp_path), multiplexer=mux,
                                                             data_provider=provider))
    request = context.RequestContext()
    experiment = get_experiment.Handler(request, backend, "", api_pb2.GetExperimentRequest()).run()
    names = {h.name for h in experiment.hparam_infos}
    assert {"optim/lr", "seed", "Instrumentation.log_interval"} <= names
    metrics = {m.name.tag for m in experiment.metric_infos}
    assert "train/loss" in metrics
    lr = next(h for h in experiment.hparam_infos if h.name == "optim/lr")
    assert lr.differs and (lr.domain_interval.min_value, lr.domain_interval.max_value) == (0.003, 0.01)


def test_hyperparameter_table_puts_training_settings_first_and_never_splits_a_name():
    params = {"WandbBackend.project": "p", "Model.depth": 3, "optim/lr": 0.1, "seed": 1, "log_dir": "runs",
              "train/total_steps": 100, "Instrumentation.log_interval": 10, "note": "a|b"}
    order = order_params(list(params))
    assert order[:3] == ["optim/lr", "seed", "train/total_steps"]
    assert order.index("Model.depth") < order.index("WandbBackend.project")
    assert set(order[-3:]) == {"WandbBackend.project", "log_dir", "Instrumentation.log_interval"}
    rows = hyperparameter_table(params).splitlines()
    assert rows[0] == "| where | parameter | value |"
    assert rows[2] == "| optim | lr | 0.1 |" and "| Model | depth | 3 |" in rows
    assert "|  | note | a\\|b |" in rows  # a pipe in a value does not open a column


def test_unflatten_nests_and_loses_nothing():
    flat = {"optim/lr": 1, "Model.depth": 3, "train/Adam.lr": 2, "a": 1, "a/b": 2, "x/y": 3, "x": 4}
    nested = unflatten_params(flat)
    assert nested["optim"] == {"lr": 1} and nested["Model"] == {"depth": 3}
    assert nested["train"] == {"Adam": {"lr": 2}}
    assert nested["a"] == 1 and nested["a/b"] == 2  # a leaf already there: the other is kept whole
    assert nested["x"] == {"y": 3} and nested["x/"] == 4  # a subtree already there


def test_wandb_config_is_nested(tmp_path):
    pytest.importorskip("wandb")
    _run(tmp_path, "w", [instrument.WandbBackend(dir=str(tmp_path / "wandb"))])
    _, config = read_run(tmp_path / "wandb")
    assert config["optim"] == {"lr": 0.003, "betas": "(0.9, 0.99)"}
    assert config["seed"] == 7 and config["hub_token"] == "<redacted>"
    assert config["Instrumentation"]["log_interval"] == 1
    assert config["IterationStats"]["channel_scalars"] is False
    assert "Instrumentation.log_interval = 1" in config["operative_config"]


def test_mlflow_params_flat_and_images_have_steps(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    backend = instrument.MlflowBackend()
    logger = instrument.Logger([backend], instrument.RunInfo("m", tmp_path))
    logger.log_hyperparams({"optim": {"lr": 0.1}, "Model.depth": 3})
    for step in (0, 5):
        logger.log_image("state/rgb", np.full((4, 5, 3), step / 10), step=step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    params = client.get_run(backend.run_id).data.params
    assert params == {"optim/lr": "0.1", "Model.depth": "3"}
    pngs = [a.path for a in client.list_artifacts(backend.run_id, "images") if a.path.endswith(".png")]
    steps = sorted(int(p.split("+step+")[1].split("+")[0]) for p in pngs)
    assert steps == [0, 5] and all(p.startswith("images/state~rgb+step+") for p in pngs)


def test_hyperparameters_that_collide_or_are_numpy_or_tensors_keep_their_values(tmp_path, caplog):
    """A review found two keys flattening to one name losing a value silently, a tensor hyperparameter logged
    as its 4-digit repr, a NumPy int as the string 'np.int64(...)', and unflatten_params overwriting 'a/'."""
    import json
    import logging

    import torch

    from instrument.logger.params import flatten_params

    with caplog.at_level(logging.WARNING, logger="instrument"):
        flat = flatten_params({"optim/lr": 0.1, "optim": {"lr": 0.001}, 1: "int-key", "1": "str-key",
                               "clip": torch.tensor(0.123456789, dtype=torch.float64), "seed": np.int64(1234567890123),
                               "betas": (0.9, torch.tensor(0.99951, dtype=torch.float64))})
    assert flat == {"optim/lr": 0.1, "optim/lr__2": 0.001, "1": "int-key", "1__2": "str-key", "clip": 0.123456789,
                    "seed": 1234567890123, "betas": "(0.9, 0.99951)"}
    assert len([r for r in caplog.records if "flatten to the name" in r.getMessage()]) == 2
    assert unflatten_params({"a/b": 1, "a/": 2, "a": 3}) in ({"a": {"b": 1}, "a/": 2, "a//": 3},
                                                               {"a": {"b": 1}, "a/": 3, "a//": 2})
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    logger.log_hyperparams({"eps": float("nan"), "seed": np.int64(7)})
    logger.close()
    first = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["hyperparameters"] == {"eps": "nan", "seed": 7}


def test_a_nan_hyperparameter_reaches_the_wandb_config_as_nan_not_null(tmp_path):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_hyperparams({"eps": float("nan"), "optim/eps": float("inf")})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    _, config = read_run(tmp_path / "w")
    assert config["eps"] == "nan" and config["optim"]["eps"] == float("inf")


@pytest.mark.parametrize("commits", ["own", "logger", "none"])
def test_hyperparameters_reach_every_backend_when_the_run_commits_only_through_the_logger(tmp_path, commits):
    """An evaluation script that commits only through ``inst.logger`` (never ``inst.step``) wrote no
    hyperparameters and no operative config to any backend: they were logged at the first ``inst.step``."""
    import json

    instrument.parse_config([], ["Instrumentation.overhead_budget = None"])
    jsonl = instrument.JsonlBackend()
    inst = instrument.Instrumentation(backends=[jsonl, instrument.TensorBoardBackend()], log_dir=str(tmp_path),
                                      run_name="eval", hyperparams={"lr": 0.1, "ckpt": "a.pt"})
    for step in (0, 100) if commits != "none" else ():
        if commits == "own":
            inst.logger.log_metrics({"eval/return": 1.0 + step}, step=step, commit=True)
        else:
            inst.logger.log_metrics({"eval/return": 1.0 + step}, step=step)
            inst.logger.commit(step)
    inst.close()
    lines = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    params = lines[-1]["hyperparameters"]  # once, at close (after the records), with the gin parameters
    assert params["lr"] == 0.1 and params["ckpt"] == "a.pt" and params["Instrumentation.overhead_budget"] is None
    assert sum("hyperparameters" in line for line in lines) == 1
    assert "Instrumentation.overhead_budget = None" in lines[-1]["config"]
    assert [line.get("step") for line in lines[:-1]] == ([0, 100] if commits != "none" else [])
    _, hparams = _session_start(tmp_path / "eval")
    assert hparams["lr"] == 0.1 and hparams["ckpt"] == "a.pt"


def test_a_commit_before_the_first_step_leaves_the_config_to_that_step(tmp_path):
    """Logged at the first commit, a training script's commit before its first step (dataset statistics) would
    have logged an operative config without the bindings used after it, and never again."""
    import json

    import gin

    @gin.configurable("LaterModel")
    def later_model(width=1):
        return width

    instrument.parse_config([], ["LaterModel.width = 7"])
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_dir=str(tmp_path), run_name="r",
                                      hyperparams={"lr": 0.1}, overhead_budget=None)
    inst.logger.log_metrics({"data/size": 10.0}, step=0, commit=True)
    later_model()  # configured after that commit, before the first step
    with inst.step(1):
        pass
    inst.close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    said = [line for line in lines if "hyperparameters" in line]
    assert len(said) == 1 and "LaterModel.width = 7" in said[0]["config"]


def test_tensorboard_escapes_a_hyperparameter_name_with_a_lone_surrogate(tmp_path, caplog):
    """A name from os.fsdecode of a non-UTF-8 file name made protobuf refuse the whole call: the HParams session
    info and config/operative were lost and the backend counted as failed. Now it is escaped, one warning."""
    import logging
    import os

    name = "weights/" + os.fsdecode(b"caf\xe9")  # 'weights/caf\udce9'
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("s", tmp_path),
                               on_backend_error="warn")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_hyperparams({name: 0.5, "weights/caf\\udce9": 0.25, "lr": 0.1}, "train.lr = 0.1\n")
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.commit()
        logger.close()
    assert logger.failures == {}
    _, hparams = _session_start(tmp_path / "s")
    # The escaped name does not take the name a key already had: it is numbered.
    assert hparams == {"weights/caf\\udce9": 0.25, "weights/caf\\udce9__2": 0.5, "lr": 0.1}
    acc = event_accumulator(tmp_path / "s")
    config = acc.Tensors("config/operative/text_summary")[0].tensor_proto.string_val[0].decode()
    assert config == "    train.lr = 0.1"
    table = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| weights | caf\\\\udce9__2 | 0.5 |" in table  # markdown source: the backslash escaped
    warned = [r.getMessage() for r in caplog.records if "udce9" in r.getMessage()]
    assert len(warned) == 1 and "hyperparameter" in warned[0], warned


def test_tensorboard_writes_the_operative_config_when_the_hparams_summary_fails(tmp_path, monkeypatch, caplog):
    """The config text was written after the HParams summary in the same call, so a summary that failed lost it;
    the report said the backend 'gets the next record again', though log_hyperparams is never called again."""
    import logging

    from instrument.backends import tensorboard

    def broken(params, trial):
        raise ValueError("no summary")

    monkeypatch.setattr(tensorboard, "hparams_summary", broken)
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("c", tmp_path),
                               on_backend_error="warn")
    with caplog.at_level(logging.ERROR, logger="instrument"):
        logger.log_hyperparams({"lr": 0.1}, "train.lr = 0.1\n")
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.commit()
        logger.close()
    assert logger.failures == {"TensorBoardBackend": 1}
    (said,) = [r.getMessage() for r in caplog.records if "failed in log_hyperparams()" in r.getMessage()]
    assert "next record" not in said and "not sent to it again" in said, said
    acc = event_accumulator(tmp_path / "c")
    assert acc.Tensors("config/operative/text_summary")[0].tensor_proto.string_val[0].decode() == "    train.lr = 0.1"
    assert [e.step for e in acc.Scalars("loss")] == [0]


def test_numpy_items_tuples_and_empty_groups_reach_every_backend_as_written(tmp_path):
    """A list of np.float64 (np.str_) was logged as '[np.float64(0.9), ...]' (they are floats and strs, so they
    were kept as they were and str(list) showed their repr); a tuple was shown as a list; an empty dict value
    (model_kwargs = {}) vanished from every backend."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    import json

    import torch
    from mlflow.tracking import MlflowClient

    params = {"betas": tuple(np.linspace(0.9, 0.999, 2)), "names": ["a", np.str_("b")], "one": np.str_("x"),
              "t": [torch.tensor(0.5, dtype=torch.float64), np.float32(0.25)], "model_kwargs": {},
              "api_key": np.str_("hunter2"), "url": "https://u:hunter2@host"}
    expected = {"betas": "(0.9, 0.999)", "names": "['a', 'b']", "one": "x", "t": "[0.5, 0.25]", "model_kwargs": "{}",
                "api_key": "<redacted>", "url": "https://u:<redacted>@host"}
    mlflow = instrument.MlflowBackend(tracking_uri=f"sqlite:///{tmp_path}/ml.db", experiment_name="e")
    backends = [instrument.JsonlBackend(), instrument.TensorBoardBackend(), mlflow,
                instrument.WandbBackend(dir=str(tmp_path / "wandb"))]
    logger = instrument.Logger(backends, instrument.RunInfo("n", tmp_path))
    logger.log_hyperparams(params)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.close()
    assert logger.failures == {}
    first = json.loads((tmp_path / "n" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["hyperparameters"] == expected
    _, hparams = _session_start(tmp_path / "n")
    assert hparams == expected
    assert MlflowClient(mlflow.tracking_uri).get_run(mlflow.run_id).data.params == expected
    _, config = read_run(tmp_path / "wandb")
    assert {k: v for k, v in config.items() if k in expected} == expected


def test_the_tensorboard_table_keeps_a_backslash_before_a_pipe_in_its_cell(tmp_path):
    """A value holding '\\|' (a grep alternation 'cat\\|dog') was cut at the pipe, the rest in a fourth cell, and a
    cell ending in '\\' escaped the row's next pipe: the backslash was not escaped before the pipe was."""
    import re

    from tensorboard import plugin_util

    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("b", tmp_path))
    logger.log_hyperparams({"data/filter": "cat\\|dog", "C:\\dir\\/lr": 0.1, "seed": 3})
    logger.close()
    md = event_accumulator(tmp_path / "b").Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0]
    html = plugin_util.markdown_to_safe_html(md.decode())  # what TensorBoard's Text tab shows
    rows = [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S) for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)]
    assert sorted(rows[1:]) == [["", "seed", "3"], ["C:\\dir\\", "lr", "0.1"], ["data", "filter", "cat\\|dog"]]


def test_a_container_under_a_secret_key_of_a_reference_valued_dict_keeps_other_parameters():
    """Its every word of 4+ characters went into the secrets found, and the words were blanked in unrelated
    parameters ('main', 'each month', 'rotate'); a container of numbers blanked the same list elsewhere."""
    from instrument.logger.params import redact_argv, redact_hyperparams

    text = ("Foo.settings = {'credentials': {'path': 'keys/main.json', 'note': 'rotate each month'}, "
            "'model': @Model()}\nTrainer.name = 'main'\nTrainer.schedule = 'each month'\nModel.block = 'rotate'\n"
            "Bar.env = {'secret_sauce': [1, 2], 'm': @M()}\nBar.sizes = [1, 2]\n")
    params = {"Foo.settings": {"credentials": {"path": "keys/main.json", "note": "rotate each month"},
                               "model": "@Model()"},
              "Trainer.name": "main", "Trainer.schedule": "each month", "Model.block": "rotate",
              "Bar.env": {"secret_sauce": [1, 2], "m": "@M()"}, "Bar.sizes": [1, 2]}
    flat, logged = redact_hyperparams(params, text)
    assert (flat["Trainer.name"], flat["Trainer.schedule"], flat["Model.block"]) == ("main", "each month", "rotate")
    assert flat["Foo.settings/credentials"] == "<redacted>"
    assert logged.splitlines() == [
        "Foo.settings = {'credentials': '<redacted>', 'model': @Model()}", "Trainer.name = 'main'",
        "Trainer.schedule = 'each month'", "Model.block = 'rotate'", "Bar.env = {'secret_sauce': '<redacted>', "
        "'m': @M()}", "Bar.sizes = [1, 2]"]
    argv = redact_argv(["--bind", text.splitlines()[0], "--bind", "Trainer.name = 'main'", "--bind",
                        text.splitlines()[4], "--bind", "Bar.sizes = [1, 2]"])
    assert argv[3] == "Trainer.name = 'main'" and argv[7] == "Bar.sizes = [1, 2]"
    assert "keys/main.json" not in " ".join(argv) and "rotate" not in argv[1]
