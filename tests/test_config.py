"""gin at the edge: stable names, errors before training, operative config logged, the CLI."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gin
import pytest

import instrument
from instrument import config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "binding",
    ["Instrumentation.log_interval = 3", "IterationStats.channel_dim = 1", "UpdateNorm.alive_channel = 3",
     "TensorBoardBackend.log_dir = None", "WandbBackend.mode = 'offline'", "ConsoleBackend.max_keys = 3",
     "JsonlBackend.path = None", "backend_set.extra = []", "train_nca.steps = 1", "train_cartpole.steps = 1"],
)
def test_every_component_is_configurable_under_its_stable_name(binding):
    config.parse([], [binding])  # raises "No configurable matching ..." for an unknown name
    name, value = binding.split(" = ")
    assert repr(gin.query_parameter(name)) == value or gin.query_parameter(name) == eval(value)


def test_observers_and_backends_bound_in_gin_file(tmp_path):
    gin_file = tmp_path / "exp.gin"
    gin_file.write_text(
        "include 'backends/jsonl.gin'\n"
        "Instrumentation.observers = [@IterationStats(), @UpdateNorm()]\n"
        "Instrumentation.backends = @backend_set()\n"
        "Instrumentation.log_interval = 5\n"
        "IterationStats.channel_scalars = False\n"
    )
    config.parse([str(gin_file)])
    inst = instrument.Instrumentation(log_dir=str(tmp_path), run_name="g")
    assert [type(o).__name__ for o in inst.observers] == ["IterationStats", "UpdateNorm"]
    assert isinstance(inst.observers[0], instrument.IterationStats)
    assert [b.name for b in inst.logger.backends] == ["JsonlBackend"]
    assert inst.log_interval == 5 and inst.observers[0].channel_scalars is False
    with inst.step(0):
        pass
    inst.close()
    first = json.loads((tmp_path / "g" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["hyperparameters"]["Instrumentation.log_interval"] == 5
    assert "IterationStats.channel_scalars = False" in first["config"]


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("Instrumentation.log_intervall = 5\n",
         r"(?s)doesn't have a parameter named 'log_intervall'.*exp.gin\", line 1"),
        ("\nNoSuchObserver.x = 5\n", r"(?s)No configurable matching 'NoSuchObserver'.*exp.gin\", line 2"),
    ],
)
def test_misspelt_names_fail_before_training_naming_file_and_line(tmp_path, text, pattern):
    gin_file = tmp_path / "exp.gin"
    gin_file.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        config.parse([str(gin_file)])


def test_missing_config_file_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="gin config 'nope.gin' does not exist"):
        config.parse(["nope.gin"])


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "instrument", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


def test_cli_runs_the_nca_demo_and_says_where_the_logs_are(tmp_path):
    out = _cli("run", str(REPO / "instrument" / "configs" / "nca.gin"), "--bind", "train_nca.steps = 3",
               "--bind", "train_nca.batch_size = 2", "--bind", "Instrumentation.log_interval = 2",
               "--bind", "Instrumentation.run_name = 'cli'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "logs: runs/cli" in out.stdout and "tensorboard --logdir runs" in out.stdout
    assert re.search(r"^ +step +loss", out.stdout, re.M) and re.search(r"^ +0 +0\.\d+ ", out.stdout, re.M)
    lines = [json.loads(x) for x in (tmp_path / "runs" / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "step" in x] == [0, 2]
    assert list((tmp_path / "runs" / "cli").glob("events.out.tfevents.*"))


def test_cli_reports_a_misspelt_binding_without_training(tmp_path):
    out = _cli("run", str(REPO / "instrument" / "configs" / "nca.gin"), "--bind", "train_nca.stepz = 3", cwd=tmp_path)
    assert out.returncode == 2
    assert "configuration error" in out.stderr and "stepz" in out.stderr
    assert not (tmp_path / "runs").exists()
