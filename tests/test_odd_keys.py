"""Metric keys a destination cannot take as they are, written back and read with each destination's reader."""

import json
import logging
import os

import numpy as np
import pytest

import instrument
from tests.conftest import event_accumulator, read_scalars
from tests.wandb_reader import read_run

NAME = os.fsdecode(b"caf\xe9.txt")  # 'caf\udce9.txt': a lone surrogate, as os.fsdecode leaves a non-UTF-8 name


def _jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_metric_key_with_a_lone_surrogate_costs_no_step(tmp_path, caplog):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.TensorBoardBackend(), instrument.JsonlBackend(),
                                instrument.WandbBackend(project="tests")], instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"loss": 0.5 * step, f"files/{NAME}": float(step)}, step=step)
        logger.log_histogram(f"sizes/{NAME}", np.array([1.0, 2.0]), step=step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}
    escaped = "files/caf\\udce9.txt"
    tb = read_scalars(tmp_path / "r")
    assert tb["loss"] == {1: 0.5, 2: 1.0} and tb[escaped] == {1: 1.0, 2: 2.0}
    assert [e.step for e in event_accumulator(tmp_path / "r").Histograms("sizes/caf\\udce9.txt")] == [1, 2]
    rows, _ = read_run(tmp_path / "r")
    assert [(row["_step"], row["loss"], row[escaped]) for row in rows] == [(1, 0.5, 1.0), (2, 1.0, 2.0)]
    assert all(row["sizes/caf\\udce9.txt"]["_type"] == "histogram" for row in rows)
    lines = _jsonl(tmp_path / "r")  # JSON escapes the surrogate itself: the key reads back exactly
    assert [(line["step"], line["metrics"]["loss"], line["metrics"][f"files/{NAME}"]) for line in lines] == [
        (1, 0.5, 1.0), (2, 1.0, 2.0)]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "UTF-8 cannot" in r.getMessage()]
    assert len(said) == 4  # once per backend and key: TensorBoard and W&B, the scalar and the histogram
    assert any("TensorBoardBackend wrote the scalar 'files/caf\\udce9.txt' as 'files/caf\\\\udce9.txt'" in m
               for m in said)
