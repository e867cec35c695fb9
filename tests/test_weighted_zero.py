"""A weight of 0 counts nothing: the mean of an empty batch (NaN) weighed by its size 0 leaves the other values'
weighted mean as it is, on one process and across real gloo ranks (a review found NaN written instead: 0 * nan).
Read back from JSONL against a float64 reference over the union of the samples."""

import datetime
import json

import numpy as np
import pytest
import torch

from instrument import JsonlBackend, Logger

BATCHES = {0: [[1.0, 2.0, 6.0], [], [4.0]], 1: [[], [], [10.0, 20.0]]}  # per rank, per step of one interval


def _log_batches(logger: Logger, rank: int) -> None:
    for step, values in enumerate(BATCHES[rank]):
        batch = torch.tensor(values, dtype=torch.float32)
        logger.log_metrics({"loss": batch.mean()}, step=step, weights=torch.tensor(batch.numel()))
        logger.log_metrics({"loss_f": batch.mean().item()}, step=step, weights=float(batch.numel()))
        logger.log_metrics({"loss_d": batch.double().mean()}, step=step, weights=float(batch.numel()))


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        logger = Logger([JsonlBackend(path=out)])
        _log_batches(logger, rank)
        logger.commit(2)
        logger.close()
    finally:
        dist.destroy_process_group()


def _written(path):
    with open(path) as f:
        return [json.loads(line)["metrics"] for line in f if '"metrics"' in line]


def test_an_empty_batch_weighed_0_keeps_the_mean_on_one_process(tmp_path):
    logger = Logger([JsonlBackend(path=str(tmp_path / "m.jsonl"))])
    _log_batches(logger, 0)
    logger.commit(2)
    logger.close()
    (metrics,) = _written(tmp_path / "m.jsonl")
    want = float(np.mean(np.array([1.0, 2.0, 6.0, 4.0], dtype=np.float64)))
    assert metrics["loss"] == pytest.approx(want, rel=1e-6)
    assert metrics["loss_f"] == metrics["loss_d"] == want


def test_an_empty_batch_on_one_rank_keeps_the_mean_over_the_union(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "m.jsonl")
    mp.spawn(_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    (metrics,) = _written(out)
    union = np.array([v for rank in BATCHES.values() for batch in rank for v in batch], dtype=np.float64)
    assert metrics["loss"] == pytest.approx(float(union.mean()), rel=1e-6)
    assert metrics["loss_f"] == pytest.approx(float(union.mean()), rel=1e-15)
    assert metrics["loss_d"] == pytest.approx(float(union.mean()), rel=1e-15)


def test_an_interval_of_empty_batches_only_is_still_undefined(tmp_path, caplog):
    """Every weight 0: nothing was weighed, and the mean stays NaN, said once (docs/backends.md)."""
    logger = Logger([JsonlBackend(path=str(tmp_path / "m.jsonl"))])
    for step in range(2):
        logger.log_metrics({"loss_f": float("nan")}, step=step, weights=0.0)
        logger.log_metrics({"loss": torch.tensor(float("nan"))}, step=step, weights=torch.tensor(0))
    logger.commit(1)
    logger.close()
    (metrics,) = _written(tmp_path / "m.jsonl")
    assert metrics["loss"] == metrics["loss_f"] == "nan", metrics  # JSONL spells a NaN "nan"
