"""Ranks whose commits fall out of step are told, on every rank, instead of having their steps mixed.

Real gloo process groups on the CPU (``torch.multiprocessing.spawn``). Each rank logs ``x = 100 * rank + step``;
rank 0's JSONL is read back. Before, a rank that skipped a commit (a commit in an ``if``, uneven data shards)
paired every later commit with another rank's next one: rank 0 wrote step 1 as the mean of rank 1's steps 1 and
2 (51.25), and so on, with no error until the very last commit (a review)."""

import datetime
import json
import logging
from pathlib import Path

import pytest
import torch

from instrument import Instrumentation, JsonlBackend, Logger
from instrument.errors import InstrumentError


def _init(rank: int, tmp: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    return dist


def _outcome(tmp: str, rank: int, **result) -> None:
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def _skipping_rank(rank: int, tmp: str) -> None:
    dist = _init(rank, tmp)
    logger = Logger([JsonlBackend(path=f"{tmp}/m.jsonl")])
    raised = []
    for step in range(4):
        logger.log_metrics({"x": float(100 * rank + step)}, step=step)
        if rank == 1 and step == 1:
            continue  # the skipped commit
        try:
            logger.commit(step)
        except InstrumentError as exc:
            raised.append([step, str(exc)])
            break
    logger.close()
    _outcome(tmp, rank, raised=raised)
    dist.destroy_process_group()


def _uneven_rank(rank: int, tmp: str) -> None:
    dist = _init(rank, tmp)
    inst = Instrumentation(observers=[], backends=[JsonlBackend(path=f"{tmp}/m.jsonl")], log_interval=2)
    raised = []
    try:
        for step in range(10 if rank == 0 else 8):  # rank 1's shard is two steps shorter
            with inst.step(step):
                inst.log({"x": float(100 * rank + step)})
    except InstrumentError as exc:
        raised.append([step, str(exc)])
    # rank 1 closes at once; rank 0's own close then has no partner left (its error is logged, not raised)
    inst.close(timeout=20)
    _outcome(tmp, rank, raised=raised)
    dist.destroy_process_group()


def _own_steps_rank(rank: int, tmp: str) -> None:
    """Each rank commits at its own frame count (RLLogging's step_unit='frames'): not checked."""
    dist = _init(rank, tmp)
    inst = Instrumentation(observers=[], backends=[JsonlBackend(path=f"{tmp}/m.jsonl")], log_interval=1)
    for frames in (10, 20):
        inst.logger.log_metrics({"x": float(100 * rank + frames)}, step=frames + rank)
        inst.commit_step(frames + rank)
    inst.close()
    _outcome(tmp, rank, raised=[])
    dist.destroy_process_group()


def _beyond_float_rank(rank: int, tmp: str) -> None:
    """Steps beyond 2**53 (nanoseconds, say): rank 1 is one step ahead of rank 0, which float64 cannot tell."""
    dist = _init(rank, tmp)
    logger = Logger([JsonlBackend(path=f"{tmp}/m.jsonl")])
    raised, said = [], []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("instrument").addHandler(catch)
    base = 2**53
    for step in (base - 2, base + rank):
        logger.log_metrics({"x": float(100 * rank + step - base)}, step=step)
        try:
            logger.commit(step)
        except InstrumentError as exc:
            raised.append([step - base, str(exc)])
            break
    logger.close()
    _outcome(tmp, rank, raised=raised, said=said)
    dist.destroy_process_group()


def _run(worker, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(str(tmp_path),), nprocs=2, join=True)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    with open(tmp_path / "m.jsonl") as f:
        written = [(row["step"], row["metrics"].get("x")) for row in map(json.loads, f) if "metrics" in row]
    return outcomes, written


def test_a_rank_that_skips_a_commit_is_told_on_every_rank_and_nothing_mixed_is_written(tmp_path):
    outcomes, written = _run(_skipping_rank, tmp_path)
    # rank 0 commits step 1 while rank 1 commits step 2: both raise there, saying so
    assert [o["raised"][0][0] for o in outcomes] == [1, 2], outcomes
    for outcome in outcomes:
        assert "commits are out of step" in outcome["raised"][0][1] and "(1 to 2)" in outcome["raised"][0][1]
    assert written == [(0, 50.0)]  # step 0 is the mean over both ranks; no mixed step follows


def test_a_rank_with_fewer_steps_is_told_when_it_closes_while_another_commits(tmp_path):
    outcomes, written = _run(_uneven_rank, tmp_path)
    assert outcomes[0]["raised"] and outcomes[0]["raised"][0][0] == 8, outcomes
    assert "closing its logger" in outcomes[0]["raised"][0][1]
    # logging steps 0, 2, 4, 6: the interval means over both ranks (steps 1..k of each), never a mixed step 8
    assert written[:4] == [(0, 50.0), (2, 51.5), (4, 53.5), (6, 55.5)], written
    assert all(step != 8 for step, _ in written)


def test_ranks_that_count_their_own_steps_commit_through_commit_step_unchecked(tmp_path):
    outcomes, written = _run(_own_steps_rank, tmp_path)
    assert outcomes == [{"raised": []}, {"raised": []}]
    assert written == [(10, pytest.approx(60.0)), (20, pytest.approx(70.0))]  # rank 0's steps, both ranks' means


def _bare_frames_rank(rank: int, tmp: str) -> None:
    """RLLogging on a bare Logger, step_unit='frames': rank 0 collects 2 environments, rank 1 three."""
    from instrument.rl import CollectionMetrics, RLLogging

    dist = _init(rank, tmp)
    logger = Logger([JsonlBackend(path=f"{tmp}/m.jsonl")])
    rl = RLLogging(progress=None, collection=CollectionMetrics(time_dim=0), step_unit="frames").attach(logger)
    envs = 2 + rank
    raised = []
    try:
        for _ in range(3):
            with rl.iteration():
                rl.observe_batch(reward=torch.ones(2, envs), done=torch.zeros(2, envs, dtype=torch.bool))
        rl.close()
    except InstrumentError as exc:
        raised.append([0, str(exc)])
    logger.close()
    _outcome(tmp, rank, raised=raised)
    dist.destroy_process_group()


def test_rl_logging_on_a_bare_logger_with_frame_steps_is_not_checked(tmp_path):
    """Each rank's frame count is its step: RLLogging commits them unpaired (a review of this change found both
    ranks refused)."""
    outcomes, written = _run(_bare_frames_rank, tmp_path)
    assert outcomes == [{"raised": []}, {"raised": []}]
    assert [step for step, _ in written] == [4, 8, 12]  # rank 0's frames (2 steps x 2 environments a batch)


def test_ranks_at_steps_beyond_2_to_the_53_one_apart_are_told_not_mixed(tmp_path):
    """float64 rounds 2**53 + 1 to 2**53: the step check compared the rounded steps alone, so rank 0 wrote step
    2**53 as the mean of its own value and rank 1's at step 2**53 + 1 (a review)."""
    outcomes, written = _run(_beyond_float_rank, tmp_path)
    assert [o["raised"][0][0] for o in outcomes] == [0, 1], outcomes
    for rank, outcome in enumerate(outcomes):
        assert f"({2**53} to {2**53 + 1})" in outcome["raised"][0][1], outcome
        # the error reaches the caller: the commit failed (it was not interrupted by Ctrl-C)
        assert f"the commit of step {2**53 + rank} failed (InstrumentError)" in "\n".join(outcome["said"]), outcome
    assert written == [(2**53 - 2, 48.0)]  # the paired step: the mean over both ranks; nothing mixed after it
