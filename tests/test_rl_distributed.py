"""RL keys over a real 2-rank gloo group (torch.multiprocessing spawn, FileStore rendezvous), read back from
rank 0's JSONL against float64 references over both ranks' data. Every key used to be averaged over ranks:
frames and episode counts halved, min/max averaged, and a rank without an episode made the episode mean NaN."""

import datetime
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

P = "collection/main/"
STEPS = 3


def data(rank, step):
    """Rank ``rank``'s batch at ``step``: rewards and dones [T=3, envs=2], and its losses (a different number of
    updates per rank). Step 0: only rank 0 ends episodes; step 1: no rank does; step 2: both do."""
    reward = np.arange(6, dtype=np.float64).reshape(3, 2) * (rank + 1) + 0.25 * step - rank
    done = np.zeros((3, 2), dtype=bool)
    if step == 0 and rank == 0:
        done[1, 0] = done[2, 1] = True
    if step == 2:
        done[2, rank] = True
        done[0, 1 - rank] = True
    losses = [0.5 * rank + 0.1 * step + 0.01 * i for i in range(1 + 2 * rank)]
    return reward, done, losses



def _join(dist, rank, store_path):
    """This process as rank ``rank`` of a 2-rank gloo group (one thread, a FileStore rendezvous)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))

def _worker(rank, store_path, out_dir):
    import torch.distributed as dist

    import instrument
    from instrument.rl import CollectionMetrics, RLLogging, TrainMetrics

    _join(dist, rank, store_path)
    try:
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(Path(out_dir) / "m.jsonl"))],
                                          log_interval=1, log_dir=out_dir, run_name="rl-ddp",
                                          overhead_budget=None)
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), training=TrainMetrics(reduce_stats=True),
                       progress=None).attach(inst)
        for step in range(STEPS):
            reward, done, losses = data(rank, step)
            with inst.step(step), rl.iteration():
                rl.observe_batch(reward=torch.from_numpy(reward), done=torch.from_numpy(done))
                for loss in losses:
                    rl.observe_losses({"loss": torch.tensor(loss, dtype=torch.float64)})
        rl.close()
        inst.close()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("rl_dist")
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=2, join=True)
    rows = [json.loads(line) for line in open(tmp / "m.jsonl")]
    out = {}
    for row in rows:
        if "step" in row and "metrics" in row:
            out.setdefault(row["step"], {}).update(
                {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in row["metrics"].items()}
            )
    return out


def reference():
    """Per step, over both ranks in float64: the union of their rewards, episodes and losses."""
    carry = {r: {} for r in (0, 1)}
    frames = episodes = 0
    out = []
    for step in range(STEPS):
        rewards, returns, lengths, losses = [], [], [], []
        for rank in (0, 1):
            reward, done, rank_losses = data(rank, step)
            losses += rank_losses
            rewards += list(reward.ravel())
            for t in range(reward.shape[0]):
                for e in range(reward.shape[1]):
                    total, n = carry[rank].get(e, (0.0, 0))
                    total, n = total + reward[t, e], n + 1
                    if done[t, e]:
                        returns.append(total)
                        lengths.append(n)
                        total, n = 0.0, 0
                    carry[rank][e] = (total, n)
            frames += reward.size
        episodes += len(returns)
        out.append(dict(rewards=rewards, returns=returns, lengths=lengths, losses=losses, frames=frames,
                        episodes=episodes, iterations=step + 1))
    return out


def test_rl_keys_combine_over_ranks_as_the_statistics_they_are(logged):
    for step, want in enumerate(reference()):
        got = logged[step]
        assert got["counters/frames"] == want["frames"] and got["counters/episodes"] == want["episodes"]
        assert got["counters/iterations"] == want["iterations"]
        assert got[P + "reward/mean"] == pytest.approx(np.mean(want["rewards"]), rel=1e-12)
        assert got[P + "reward/min"] == min(want["rewards"]) and got[P + "reward/max"] == max(want["rewards"])
        assert got["train/main/loss"] == pytest.approx(np.mean(want["losses"]), rel=1e-12)
        assert got["train/main/loss/min"] == min(want["losses"])
        assert got["train/main/loss/max"] == max(want["losses"])
        assert got[P + "episode/count"] == len(want["returns"])
        if want["returns"]:  # step 0: only rank 0 had episodes, rank 1's count of 0 does not make them NaN
            assert got[P + "episode/return/mean"] == pytest.approx(np.mean(want["returns"]), rel=1e-12)
            assert got[P + "episode/return/min"] == min(want["returns"])
            assert got[P + "episode/return/max"] == max(want["returns"])
            assert got[P + "episode/length/mean"] == pytest.approx(np.mean(want["lengths"]), rel=1e-12)
        else:  # no rank ended an episode: NaN, as on one process (they were the reduction's identities, +-inf)
            assert math.isnan(got[P + "episode/return/mean"]) and math.isnan(got[P + "episode/length/mean"])
            assert math.isnan(got[P + "episode/return/min"]) and math.isnan(got[P + "episode/return/max"])
        assert not [key for key in got if key.startswith("\0")]  # the presence counts are not written


def _frames_worker(rank, store_path, out_dir, masked_at):
    import torch.distributed as dist

    import instrument
    from instrument.rl import CollectionMetrics, RLLogging

    _join(dist, rank, store_path)
    try:
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(Path(out_dir) / "m.jsonl"))],
                                          log_interval=1, log_dir=out_dir, run_name="frames", overhead_budget=None)
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None, step_unit="frames").attach(inst)
        for it in range(3):
            with rl.iteration():
                done = torch.zeros(2, 2, dtype=torch.bool)
                done[1] = True
                mask = torch.full((2, 2), not (rank == 1 and it == masked_at))
                rl.observe_batch(reward=torch.full((2, 2), float(it + 10 * rank)), done=done, mask=mask)
        rl.close()
        inst.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("masked_at", [1, 2])
def test_frame_steps_under_a_process_group_commit_together_on_every_rank(tmp_path, masked_at):
    """A rank whose batch kept no frame deferred its commit on its own (or skipped its tail at close) while
    the other rank committed: the collectives paired different iterations (frames 12 where 20 were kept) and
    close failed with a closed connection."""
    import torch.multiprocessing as mp

    mp.spawn(_frames_worker, args=(str(tmp_path / "store"), str(tmp_path), masked_at), nprocs=2, join=True)
    rows = [json.loads(line)["metrics"] for line in open(tmp_path / "m.jsonl") if "metrics" in json.loads(line)]
    assert [r["counters/iterations"] for r in rows] == [1, 2, 3]  # one record per iteration, ranks paired
    kept = [4 + (0 if masked_at == it else 4) for it in range(3)]  # rank 0 keeps 4 frames, rank 1 4 or 0
    assert [r["counters/frames"] for r in rows] == list(np.cumsum(kept))


def _uneven_worker(rank, store_path, out_dir):
    import torch.distributed as dist

    import instrument
    from instrument.rl import CollectionMetrics, Evaluation, RLLogging
    from instrument.rl.evaluation import Episode

    _join(dist, rank, store_path)
    try:
        # An evaluation falls due at another iteration on each rank: rank 1 keeps half the frames of rank 0.
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(Path(out_dir) / "eval.jsonl"))],
                                          log_interval=5, log_dir=out_dir, run_name="eval", overhead_budget=None)
        runner = lambda deterministic, max_steps, render: Episode(return_=1.0 + rank, length=3)  # noqa: E731
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), evaluation=Evaluation(every_frames=40),
                       progress=None).attach(inst, eval_runner=runner)
        for it in range(11):
            with inst.step(it), rl.iteration():
                mask = torch.ones(4, 4, dtype=torch.bool)
                if rank == 1:
                    mask[:, :2] = False
                rl.observe_batch(reward=torch.ones(4, 4), done=torch.zeros(4, 4, dtype=torch.bool), mask=mask)
        rl.close()
        inst.close()
        # A step that raises on rank 1 only (a loop that skips a bad batch) still commits there.
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(Path(out_dir) / "fail.jsonl"))],
                                          log_interval=2, log_dir=out_dir, run_name="fail", overhead_budget=None)
        for step in range(6):
            try:
                with inst.step(step):
                    inst.log({"x": float(step + 10 * rank)})
                    if rank == 1 and step == 2:
                        raise ValueError("bad batch")
            except ValueError:
                pass
        inst.close()
    finally:
        dist.destroy_process_group()


def test_a_due_evaluation_and_a_failed_step_on_one_rank_keep_the_ranks_commits_paired(tmp_path):
    """Two ways one rank committed where the other did not, so every later collective paired different steps
    (frames going backwards, values mixed from different steps) and close failed with a closed connection:
    an evaluation that fell due on one rank first (its frames differ), and a step whose body raised on one rank.
    Now a due evaluation waits for the next logging step under a process group, and a failed step commits what
    was staged before it."""
    import torch.multiprocessing as mp

    mp.spawn(_uneven_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    rows = {r["step"]: r["metrics"] for r in map(json.loads, open(tmp_path / "eval.jsonl")) if "metrics" in r}
    assert sorted(rows)[:3] == [0, 5, 10]
    for step in (0, 5, 10):  # both ranks' frames of iterations 0..step: 16 and 8 per iteration
        assert rows[step]["counters/iterations"] == step + 1
        assert rows[step]["counters/frames"] == 24 * (step + 1)
    assert rows[5]["eval/deterministic/return"] == 1.5  # both ranks evaluated at step 5: mean of 1 and 2
    rows = {r["step"]: r["metrics"] for r in map(json.loads, open(tmp_path / "fail.jsonl")) if "metrics" in r}
    # the mean over the interval on each rank, then over ranks; rank 1's step-2 value is discarded
    assert {step: rows[step]["x"] for step in (0, 2, 4)} == {0: 5.0, 2: (1.5 + 11.0) / 2, 4: (3.5 + 13.5) / 2}


def _close_worker(rank, store_path, out_dir):
    import torch.distributed as dist

    import instrument
    from instrument.rl import CollectionMetrics, RLLogging

    _join(dist, rank, store_path)
    try:
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(Path(out_dir) / "m.jsonl"))],
                                          log_interval=1, log_dir=out_dir, run_name="r", overhead_budget=None)
        rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
        for step in range(3):
            with inst.step(step), rl.iteration():
                rl.observe_batch(reward=torch.ones(2, 2), done=torch.zeros(2, 2, dtype=torch.bool))
        inst.logger.log_image("final", np.zeros((4, 4, 3), np.uint8), step=2)  # staged on rank 0 alone
        rl.close()  # committed where something was pending: on rank 0 alone, and the collectives unpaired
        inst.close()
        dist.barrier()  # the program's own collective after the run
    finally:
        dist.destroy_process_group()


def test_closing_rl_logging_makes_the_same_commit_on_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_close_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [row["step"] for row in rows if row.get("metrics")] == [0, 1, 2]
    assert [row["step"] for row in rows if "images" in row] == [2]  # the final image, written at close
