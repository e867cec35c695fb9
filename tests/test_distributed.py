"""Cross-rank reduction with real 2-process gloo groups (torch.multiprocessing spawn, FileStore rendezvous).

Starting processes is slow on a shared machine, so one spawn runs every scenario and writes what each rank saw
to a JSON file; the tests below each check one aspect of those results against single-process references
computed over the union of the data.
"""

import datetime
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from instrument import JsonlBackend, Logger
from instrument.errors import ConfigurationError, InvalidValueError

# Rank r's data: two batches per logging interval.
BATCHES = {0: [[0.5, 1.5], [-2.0]], 1: [[3.0, -1.0, 0.25], [2.0, 4.5]]}
ACC = {0: [0.5, 0.7], 1: [0.9, 0.9]}


def _install_counter(counts):
    """Count the collectives instrument's reduction issues by wrapping its own collective functions."""
    import instrument.logger.reduce as reduce_mod

    for name in ("_all_gather", "_all_reduce", "_all_gather_object"):
        original = getattr(reduce_mod, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(reduce_mod, name, counted)


def _log_interval(logger, rank, step0, step1):
    """Log one interval's metrics: two batches at step0 and step1, per-rank totals at step1."""
    for step, batch in zip((step0, step1), BATCHES[rank], strict=True):
        t = torch.tensor(batch)
        logger.log_metrics({"loss": t.mean()}, step=step, prefix="train", weights=float(len(batch)))
    for step, acc in zip((step0, step1), ACC[rank], strict=True):
        logger.log_metrics({"acc": acc}, step=step, prefix="train")
    x = torch.tensor([v for b in BATCHES[rank] for v in b], dtype=torch.float64)
    logger.log_metrics(
        {"total": x.sum(), "lo": x.min(), "hi": float(x.max()), "norm": torch.linalg.vector_norm(x)},
        step=step1,
        reduce={"total": "sum", "lo": "min", "hi": "max", "norm": "l2"},
    )


def _commit_counted(logger, counts, step):
    counts.clear()
    record = logger.commit(step)
    return (record.flat_scalars() if record is not None else None), sum(counts.values())


def _worker(rank, store_path, out_dir):
    import torch.distributed as dist

    from instrument import Instrumentation
    from instrument.logger.ranks import check_same_config
    from instrument.logger.reduce import CrossRankReducer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, 2),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    out: dict = {"rank": rank}
    counts: dict = {}
    _install_counter(counts)
    try:
        # One all_gather per steady commit, whatever the number of metrics.
        logger = Logger([JsonlBackend(path=str(Path(out_dir) / f"rank{rank}" / "m.jsonl"))])
        out["opened"] = len(logger.backends)
        _log_interval(logger, rank, 0, 1)
        with logger.timer("work"):
            time.sleep(0.05 if rank == 1 else 0.0)
        out["first"], out["first_count"] = _commit_counted(logger, counts, 1)
        _log_interval(logger, rank, 2, 3)
        out["steady"], out["steady_count"] = _commit_counted(logger, counts, 3)
        _log_interval(logger, rank, 4, 5)
        if rank == 1:
            logger.log_metrics({"only_r1": 7.0}, step=5, reduce="sum")
        out["new_key"], out["new_key_count"] = _commit_counted(logger, counts, 5)
        _log_interval(logger, rank, 6, 7)
        if rank == 1:
            logger.log_metrics({"only_r1": 7.0}, step=7, reduce="sum")
        out["known_key"], out["known_key_count"] = _commit_counted(logger, counts, 7)
        _log_interval(logger, rank, 8, 9)
        out["absent_key"], out["absent_key_count"] = _commit_counted(logger, counts, 9)
        # A rank with nothing staged still takes part.
        if rank == 0:
            logger.log_metrics({"solo": 2.0}, step=10)
        out["one_sided"], _ = _commit_counted(logger, counts, 10)
        # Whole calls staged as blocks (floats, one-element tensors) are reduced like any other value.
        for step in (11, 12):
            logger.log_metrics({"tb": torch.tensor(float(10 * rank + step)), "n": torch.tensor(rank + step)},
                               step=step, prefix="blk")
            logger.log_metrics({"fb": float(rank * step)}, step=step, prefix="blk")
        out["blocks"], _ = _commit_counted(logger, counts, 12)
        logger.close()

        # The bandwidth-optimal form: one SUM and one MAX all_reduce.
        logger = Logger([], reducer=CrossRankReducer(strategy="allreduce"))
        _log_interval(logger, rank, 0, 1)
        out["ar_first"], out["ar_first_count"] = _commit_counted(logger, counts, 1)
        _log_interval(logger, rank, 2, 3)
        out["ar_steady"], out["ar_steady_count"] = _commit_counted(logger, counts, 3)
        out["ar_kinds"] = dict(counts)
        if rank == 1:  # a key new to the layout, on one rank: both take part in its exchange
            logger.log_metrics({"only_r1": 7.0}, step=3, reduce="sum")
        new_key, out["ar_new_key_count"] = _commit_counted(logger, counts, 3)
        out["ar_new_key"] = new_key["only_r1"]
        # A NaN on one rank is the min or max over ranks: gloo's MAX all_reduce alone would drop it.
        for op in ("min", "max"):
            values = {"nan_on_0": (math.nan, 1.0), "nan_on_1": (1.0, math.nan), "finite": (-2.0, 3.0)}
            logger.log_metrics({k: torch.tensor(v[rank], dtype=torch.float64) for k, v in values.items()},
                               step=4, prefix=op, reduce=op)
        out["ar_nan"] = {k: repr(v) for k, v in logger.commit(4).scalars.items()}
        logger.close()

        # Conflicting ops for one key fail on every rank (no hang).
        logger = Logger([])
        logger.log_metrics({"c": 1.0}, step=0, reduce="mean" if rank == 0 else "max")
        try:
            logger.commit(0)
        except ConfigurationError as exc:
            out["conflict_error"] = str(exc)

        # An image and a heatmap under one tag are refused on every rank alike: were rank 0 alone to raise,
        # the other ranks would wait for it in the next commit's collective.
        logger = Logger([])
        logger.log_image("t", torch.rand(8, 8), step=0)
        try:
            logger.log_heatmap("t", torch.rand(3, 3), step=0)
        except InvalidValueError as exc:
            out["shared_tag_error"] = str(exc)
        logger.commit(0)
        logger.close()

        # Operative config hash check.
        check_same_config("same text")
        try:
            check_same_config(f"rank {rank} text")
        except ConfigurationError as exc:
            out["config_error"] = str(exc)

        # Observers under data parallelism: each rank observes its own batch (its float64 reference kept).
        out["observed"] = _observe_own_batch(rank, out_dir)

        # A whole session: only rank 0 opens backends and creates files.
        inst = Instrumentation(
            backends=[JsonlBackend()], log_interval=2, log_dir=str(Path(out_dir) / f"runs{rank}")
        )
        for step in range(4):
            with inst.step(step):
                inst.logger.log_metrics({"x": float(rank + step)}, step=step)
        inst.close()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"result{rank}.json").write_text(json.dumps(out))


class _Rule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return x + 0.5 * torch.tanh(self.conv(x))


def _observe_own_batch(rank, out_dir):
    """One logging step of IterationStats, UpdateNorm and ActivationStats on this rank's own batch; returns
    the float64 statistics of its last iteration, per channel."""
    from instrument import ActivationStats, Instrumentation, IterationStats, UpdateNorm

    rule = _Rule()
    inst = Instrumentation([IterationStats(), UpdateNorm(), ActivationStats()], log_interval=1,
                           backends=[JsonlBackend(str(Path(out_dir) / "observers.jsonl"))],
                           log_dir=str(Path(out_dir) / f"obs{rank}"), overhead_budget=None)
    inst.watch(rule)
    x = torch.linspace(-1, 1, 2 * 3 * 4 * 4).reshape(2, 3, 4, 4) * (1 + 5 * rank) + 3 * rank
    norms = []
    with inst.step(0), torch.no_grad():
        for _ in range(2):
            conv = rule.conv(x).double().numpy()
            nxt = rule(x)
            norms.append(float(np.mean(np.linalg.norm((nxt - x).double().numpy().reshape(2, -1), axis=1))))
            x = nxt
    inst.close()
    last = x.double().numpy().transpose(1, 0, 2, 3).reshape(3, -1)
    return {"min": last.min(1).tolist(), "max": last.max(1).tolist(), "mean": last.mean(1).tolist(),
            "std": last.std(1).tolist(), "l2": norms, "absmax": float(np.abs(conv).max())}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=2, join=True)
    results = [json.loads((tmp / f"result{r}.json").read_text()) for r in range(2)]
    return results, tmp


# ---------------------------------------------------------------------- single-process references
def _union():
    return np.array([v for r in (0, 1) for b in BATCHES[r] for v in b], dtype=np.float64)


def _expected():
    x = _union()
    return {
        "train/loss": x.mean(),
        "train/acc": np.mean([np.mean(ACC[0]), np.mean(ACC[1])]),
        "total": x.sum(),
        "lo": x.min(),
        "hi": x.max(),
        "norm": np.sqrt((x**2).sum()),
    }


def _assert_close(got, want):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_reduced_values_equal_single_process_over_union(ranks):
    results, _ = ranks
    for r in results:
        _assert_close(r["first"], _expected())
        _assert_close(r["steady"], _expected())
        assert r["first"] == results[0]["first"]  # every rank gets the same values


def test_weighted_mean_matches_a_single_process_logger_over_the_union():
    logger = Logger([])
    batches = [b for r in (0, 1) for b in BATCHES[r]]
    for b in batches:
        logger.log_metrics({"loss": torch.tensor(b).mean()}, step=0, prefix="train", weights=len(b))
    record = logger.commit(0)
    assert record.scalars["train/loss"] == pytest.approx(_union().mean(), rel=1e-6)


def test_whole_calls_staged_as_blocks_are_reduced_across_ranks(ranks):
    results, _ = ranks
    # mean over ranks of each rank's interval mean (steps 11 and 12), against a float64 reference
    expected = {
        "blk/tb": np.mean([np.mean([10.0 * r + s for s in (11, 12)]) for r in range(2)]),
        "blk/n": np.mean([np.mean([float(r + s) for s in (11, 12)]) for r in range(2)]),
        "blk/fb": np.mean([np.mean([float(r * s) for s in (11, 12)]) for r in range(2)]),
    }
    for result in results:
        assert result["blocks"] == pytest.approx(expected, rel=1e-12)


def test_one_collective_per_steady_commit(ranks):
    results, _ = ranks
    for r in results:
        assert r["steady_count"] == 1
        assert r["known_key_count"] == 1
        assert r["absent_key_count"] == 1
        # First commit and a new key: agree on the layout (header, key exchange, data).
        assert r["first_count"] == 3
        assert r["new_key_count"] == 3


def test_allreduce_strategy_uses_one_collective_per_reduction_kind(ranks):
    results, _ = ranks
    for r in results:
        assert r["ar_steady_count"] == 2
        assert r["ar_first_count"] == 4  # MAX header, key exchange, SUM + MAX
        assert r["ar_new_key_count"] == 5  # SUM + MAX (a misfit), key exchange, SUM + MAX (docs/distributed.md)
        assert r["ar_new_key"] == 7.0
        assert r["ar_kinds"] == {"_all_reduce": 2}
        _assert_close(r["ar_first"], _expected())
        _assert_close(r["ar_steady"], _expected())


def test_a_nan_on_one_rank_survives_the_allreduce_min_and_max(ranks):
    results, _ = ranks
    for r in results:
        assert r["ar_nan"] == {
            "min/nan_on_0": "nan", "min/nan_on_1": "nan", "min/finite": "-2.0",
            "max/nan_on_0": "nan", "max/nan_on_1": "nan", "max/finite": "3.0",
        }


def test_keys_logged_on_some_ranks_only(ranks):
    results, _ = ranks
    for r in results:
        assert r["new_key"]["only_r1"] == 7.0
        assert r["known_key"]["only_r1"] == 7.0
        assert "only_r1" not in r["absent_key"]
        assert r["one_sided"] == {"solo": 2.0}


def test_timers_reduce_with_max_across_ranks(ranks):
    results, _ = ranks
    for r in results:
        assert r["first"]["timing/work/max"] >= 0.05
        assert r["first"]["timing/work/mean"] >= 0.05  # the slow rank's mean, not the average of ranks
        assert r["first"]["timing/work/count"] == 1.0
        assert "timing/work/max" not in r["steady"]


def test_conflicting_ops_fail_on_every_rank(ranks):
    results, _ = ranks
    for r in results:
        assert "different reduce ops across ranks" in r["conflict_error"]
        assert "'c'" in r["conflict_error"] and "max on ranks [1]" in r["conflict_error"]


def test_an_image_and_a_heatmap_under_one_tag_are_refused_on_every_rank(ranks):
    results, _ = ranks
    assert all("is already staged under the tag 't'" in r.get("shared_tag_error", "") for r in results), results


def test_different_operative_configs_fail_on_every_rank(ranks):
    results, _ = ranks
    for r in results:
        assert "operative configuration differs across ranks" in r["config_error"]
        assert "ranks [0]" in r["config_error"] and "ranks [1]" in r["config_error"]


def test_only_rank_zero_opens_backends_and_writes(ranks):
    results, tmp = ranks
    assert results[0]["opened"] == 1 and results[1]["opened"] == 0
    assert (tmp / "rank0" / "m.jsonl").is_file()
    assert not (tmp / "rank1").exists()
    assert not (tmp / "runs1").exists()
    runs = list((tmp / "runs0").iterdir())
    assert len(runs) == 1
    lines = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "step" in line]
    # x = rank + step: mean over the interval on each rank, then over ranks; close() commits step 3.
    assert [(s["step"], s["metrics"]["x"]) for s in steps] == [(0, 0.5), (2, 2.0), (3, 3.5)]
    jsonl = [json.loads(line) for line in (tmp / "rank0" / "m.jsonl").read_text().splitlines()]
    assert [line["step"] for line in jsonl] == [1, 3, 5, 7, 9, 10, 12]


# ---------------------------------------------------------------------- no process group
def test_without_process_group_nothing_is_reduced(monkeypatch):
    import instrument.logger.reduce as reduce_mod

    def forbidden(*args, **kwargs):
        raise AssertionError("no collective may run without a process group")

    monkeypatch.setattr(reduce_mod, "_all_gather", forbidden)
    monkeypatch.setattr(reduce_mod, "_all_reduce", forbidden)
    logger = Logger([])
    logger.log_metrics({"a": torch.tensor(2.0), "b": 3.0}, step=0, reduce={"a": "max", "b": "l2"})
    assert logger.commit(0).scalars == {"a": 2.0, "b": 3.0}
    assert logger.commit(1) is None  # nothing staged, no process group: nothing to do


def test_rank_from_torchrun_environment_keeps_other_ranks_from_opening(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    backend = JsonlBackend(path=str(tmp_path / "m.jsonl"))
    logger = Logger([backend])
    assert not logger.is_writer and logger.backends == []
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_image("img", np.zeros((2, 2)), step=0)  # media are rank 0's: not even staged here
    assert logger.commit(0).scalars == {"a": 1.0}
    logger.close()
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reduce": "median"}, r"unknown reduce op 'median' for metric 'a'; expected one of"),
        ({"reduce": {"z": "sum"}}, r"reduce= names \['z'\], which are not among the logged metrics"),
        ({"reduce": "max", "weights": 2.0}, r"no metric is reduced with 'mean' \(ops: \['max'\]\)"),
        ({"reduce": {"a": "sum"}, "weights": {"a": 2.0}}, r"metric 'a' has a weight but reduce op 'sum'"),
        ({"weights": -1.0}, r"weight of 'a' must be a finite number >= 0"),
        ({"weights": {"b": 1.0}}, r"weights= names \['b'\]"),
        ({"weights": torch.ones(3)}, r"weight of 'a' must be one number"),
    ],
)
def test_bad_reduce_arguments_are_rejected(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        Logger([]).log_metrics({"a": 1.0}, step=0, **kwargs)


def test_one_metric_keeps_one_op_within_an_interval():
    logger = Logger([])
    logger.log_metrics({"a": 1.0}, step=0, reduce="sum")
    with pytest.raises(
        ConfigurationError, match=r"metric 'a' was logged with reduce='sum' and now with reduce='max'"
    ):
        logger.log_metrics({"a": 1.0}, step=0, reduce="max")
    with pytest.raises(ConfigurationError, match=r"always with or always without a weight"):
        logger.log_metrics({"b": 1.0}, step=0, weights=2.0)
        logger.log_metrics({"b": 1.0}, step=0)


def test_weighted_mean_over_time_on_one_process():
    logger = Logger([])
    logger.log_metrics({"a": torch.tensor(1.0)}, step=0, weights=torch.tensor(3.0))
    logger.log_metrics({"a": 5.0}, step=1, weights=1)
    assert logger.commit(1).scalars["a"] == pytest.approx((3 * 1 + 5) / 4)


def test_l2_on_one_process_is_the_absolute_value_as_over_one_rank():
    logger = Logger([])
    logger.log_metrics({"norm": -3.0, "t": torch.tensor(-4.0)}, step=0, reduce="l2")
    assert logger.commit(0).scalars == {"norm": 3.0, "t": 4.0}


def test_timer_reduce_op_is_fixed_per_timer():
    logger = Logger([])
    assert logger.timer("t").reduce == "max"
    assert logger.timer("u", reduce="mean").reduce == "mean"
    with pytest.raises(
        ConfigurationError, match=r"timer 't' already exists with reduce='max', asked for 'sum'"
    ):
        logger.timer("t", reduce="sum")


def test_the_commits_group_check_follows_init_and_destroy_of_a_process_group(tmp_path, monkeypatch):
    """`ranks.initialized` reads torch's default group directly (every commit asks it): it must say what
    ``dist.is_initialized`` says before, during and after a real gloo group, and the logger's commits with it;
    also when torch replaces its registry of groups (it is looked up at every call)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from instrument.logger.ranks import _WORLD_TYPE, initialized

    assert _WORLD_TYPE is not None, "torch's layout changed: initialized() fell back to dist.is_initialized"
    assert initialized() is dist.is_initialized() is False
    logger = Logger([])
    monkeypatch.setattr(distributed_c10d, "_world", distributed_c10d._World())  # a new registry, after import
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert initialized() is dist.is_initialized() is True
        logger.log_metrics({"a": 1.0}, step=0)
        assert logger.commit(0).scalars == {"a": 1.0}  # one rank: nothing to reduce, written as logged
    finally:
        dist.destroy_process_group()
    assert initialized() is dist.is_initialized() is False
    logger.log_metrics({"a": 2.0}, step=1)
    assert logger.commit(1).scalars == {"a": 2.0}
    logger.close()


def test_a_threaded_process_group_is_seen_and_reduced(tmp_path):
    """torch's threaded process groups (its own distributed tests) install a registry of another type: the
    commit asks `dist.is_initialized` then, and two ranks' sums are reduced (run in a child: the threaded
    registry is process-wide). An integer beyond 2**53 on rank 1 alone is said by rank 0, which writes it."""
    pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
    from tests.conftest import THREADED_RANKS

    source = THREADED_RANKS + """
import logging
import instrument
from instrument.logger.ranks import initialized

said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("instrument").addHandler(Keep())

def worker(rank):
    logger = instrument.Logger([])
    logger.log_metrics({"x": float(rank + 1)}, step=0, reduce="sum")
    # only rank 1 holds an integer beyond 2**53; rank 0 writes the reduced value and must say so
    logger.log_metrics({"seed": torch.tensor(2**60 + 1 if rank else 5)}, step=0, reduce="max")
    handle = logger.commit(0)
    out[rank] = [initialized(), None if handle is None else handle.scalars]
    logger.close()

run_ranks(worker)
print(json.dumps({"out": out, "said": said}))
"""
    from tests.conftest import run_child

    done = run_child(tmp_path, source)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    out = result["out"]
    assert out["0"] == [True, {"x": 3.0, "seed": float(2**60 + 1)}] and out["1"][0] is True
    rounded = [m for m in result["said"] if "at or beyond 2**53" in m]
    # once by each rank's logger: rank 1 for its own value, rank 0 for the reduced one it writes
    assert len(rounded) == 2 and all("'seed'" in m for m in rounded), result["said"]


def _late_rank0_worker(rank, store_path, out_dir):
    import torch.distributed as dist

    import instrument

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        if rank == 0:
            time.sleep(1.0)  # rank 1 reaches Instrumentation() first, as ordinary skew between ranks does
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_dir=out_dir, run_name="late",
                                          run_log=True)
        inst.close()
        Path(out_dir, f"started{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def test_another_ranks_run_log_never_makes_rank_0_refuse_its_own_run(tmp_path):
    """A review found rank 0 refusing run 'late' as 'already exists': rank 1 had written its run log into the
    folder before rank 0 checked it. Rank 0 now checks and claims the folder before any rank goes on."""
    import torch.multiprocessing as mp

    mp.spawn(_late_rank0_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "started0").exists() and (tmp_path / "started1").exists()
    assert not (tmp_path / "late" / ".instrument-starting").exists()


def test_observers_combine_each_statistic_over_ranks_as_what_it_is(ranks):
    """Under data parallelism each rank observes its own batch; every key was averaged over ranks, so the
    logged min and max of a channel were the mean of the ranks' minima and maxima (-6.3 for a -10.9 minimum).
    Now min is the minimum over ranks and max the maximum; means and stds are means over ranks."""
    results, tmp = ranks
    seen = [r["observed"] for r in results]
    rows = [json.loads(line) for line in (tmp / "observers.jsonl").read_text().splitlines()]
    got = next(r["metrics"] for r in rows if "metrics" in r)
    for c in range(3):
        assert got[f"iteration_stats/min/c{c}"] == pytest.approx(min(s["min"][c] for s in seen), rel=1e-6)
        assert got[f"iteration_stats/max/c{c}"] == pytest.approx(max(s["max"][c] for s in seen), rel=1e-6)
        assert got[f"iteration_stats/mean/c{c}"] == pytest.approx(np.mean([s["mean"][c] for s in seen]), rel=1e-6)
        assert got[f"iteration_stats/std/c{c}"] == pytest.approx(np.mean([s["std"][c] for s in seen]), rel=1e-5)
    assert got["update_norm/l2/max"] == pytest.approx(max(max(s["l2"]) for s in seen), rel=1e-6)
    assert got["update_norm/l2/mean"] == pytest.approx(np.mean([np.mean(s["l2"]) for s in seen]), rel=1e-6)
    assert got["activations/conv/absmax"] == pytest.approx(max(s["absmax"] for s in seen), rel=1e-6)
