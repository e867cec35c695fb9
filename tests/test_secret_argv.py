"""A secret given on the command line as a gin macro's value (``--bind "CREDS = '...'"``, used as ``api_token =
%CREDS``) has no secret-looking name where it stands, so the command line W&B records kept it in clear while
every other place redacted it (a review found it). The config's secrets now reach the command line's redaction."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECRET = "SECRETARGV-d4c3b2a1"

_EXPERIMENT = '''
import gin


@gin.configurable
def macro_train(instrumentation, api_token=None):
    with instrumentation.step(0):
        instrumentation.logger.log_metrics({"x": 1.0}, 0)
    return {"ok": 1}
'''

_CONFIG = """
import macro_exp
run.experiment = @macro_train
macro_train.api_token = %CREDS
Instrumentation.log_dir = 'logs'
Instrumentation.run_name = 'm'
Instrumentation.backends = [@JsonlBackend(), @WandbBackend()]
"""


def test_a_secret_macro_bound_on_the_command_line_never_reaches_the_command_line_wandb_records(tmp_path):
    pytest.importorskip("wandb")
    (tmp_path / "macro_exp.py").write_text(_EXPERIMENT)
    (tmp_path / "m.gin").write_text(textwrap.dedent(_CONFIG))
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "-m", "instrument", "run", "m.gin", "--bind", f"CREDS = '{SECRET}'"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    files = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()]
    wandb_files = [p for p in files if p.suffix == ".wandb"]
    assert wandb_files, files
    assert any(b"CREDS = '<redacted>'" in p.read_bytes() for p in wandb_files)  # the command line, redacted
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
