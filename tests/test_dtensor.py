"""DTensors (FSDP2's ``fully_shard``) on real 2-process gloo groups (spawn, FileStore rendezvous).

A DTensor's ``item()`` and host copy act on the rank's local tensor: for a Shard or Partial placement a shard or a
partial value. Such values are refused at the call (not averaged over ranks as if they were the global value);
replicated ones hold the global value and are logged as it. One spawn runs every scenario and writes what each
rank saw to a JSON file.
"""

import datetime
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from instrument import Instrumentation, JsonlBackend, Logger
from instrument.errors import InvalidValueError


def _fsdp2_model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _worker(rank, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from instrument import GradientStats, NonFinite

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(out_dir) / "store"), 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    out: dict = {}
    records: list = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("instrument").addHandler(handler)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sharded = distribute_tensor(torch.arange(1.0, 9.0), mesh, [Shard(0)])  # global norm sqrt(204)
        logger = Logger([])
        for key, value in {"norm": torch.linalg.vector_norm(sharded), "sum": sharded.sum()}.items():
            try:
                logger.log_metrics({key: value}, step=0)
            except InvalidValueError as exc:
                out[f"refused_{key}"] = str(exc)
        # the fix the message names: the local part, combined over ranks
        logger.log_metrics({"norm": torch.linalg.vector_norm(sharded).to_local()}, step=0, reduce="l2")
        replicated = distribute_tensor(torch.tensor(3.5), mesh, [Replicate()])
        logger.log_metrics({"rep": replicated}, step=0)
        logger.log_metrics({"rep_sum": replicated}, step=0, reduce="sum")
        logger.log_metrics({"rep_int": distribute_tensor(torch.tensor(3), mesh, [Replicate()])}, step=0)
        out["scalars"] = logger.commit(0).flat_scalars()
        try:
            logger.log_histogram("h", sharded, step=1)
        except InvalidValueError as exc:
            out["refused_hist"] = str(exc)
        logger.log_histogram("rep_h", distribute_tensor(torch.arange(4.0), mesh, [Replicate()]), step=1)
        record = logger.commit(1)
        out["histograms"] = sorted(record.histograms) if record is not None else None
        logger.close()

        # FSDP2: GradientStats with histograms, NonFinite with one NaN on rank 0's shard of a gradient.
        model = _fsdp2_model()
        inst = Instrumentation([GradientStats(histograms=True), NonFinite()], backends=[JsonlBackend()],
                               log_interval=1, log_dir=out_dir, run_name="fsdp2", overhead_budget=None)
        inst.watch(model)
        with inst.step(0):
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
            if rank == 0:
                model[0].weight.grad.to_local()[0, 0] = math.nan
        inst.close()
        # Classic FullyShardedDataParallel: flat parameters, one shard per rank, whose norms are not the model's.
        from torch.distributed.fsdp import FullyShardedDataParallel

        torch.manual_seed(0)
        classic = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 6)),
                                           device_id=torch.device("cpu"))
        inst = Instrumentation([GradientStats()], backends=[JsonlBackend()], log_interval=1, log_dir=out_dir,
                               run_name="classic", overhead_budget=None)
        inst.watch(classic)
        for step in range(2):
            with inst.step(step):
                classic(torch.randn(4, 6)).square().mean().backward()
                inst.logger.log_metrics({"x": 1.0}, step=step)
        inst.close()
        # use_orig_params=True, watching the module inside the wrapper: names carry no sign of FSDP (before: its
        # shard norms were logged, wrong and unsaid)
        torch.manual_seed(0)
        inner = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 6)),
                                         device_id=torch.device("cpu"), use_orig_params=True)
        inst = Instrumentation([GradientStats()], backends=[JsonlBackend()], log_interval=1, log_dir=out_dir,
                               run_name="classic_inner", overhead_budget=None)
        inst.watch(inner.module)
        with inst.step(0):
            inner(torch.randn(4, 6)).square().mean().backward()
            inst.logger.log_metrics({"x": 1.0}, step=0)
        inst.close()
        _mixed_and_ddp(rank, out_dir, out)
        out["warnings"] = records
    finally:
        logging.getLogger("instrument").removeHandler(handler)
        dist.destroy_process_group()
    Path(out_dir, f"result{rank}.json").write_text(json.dumps(out))


def _mixed_and_ddp(rank, out_dir, out):
    """FSDP2 on one submodule only (its parameters DTensors, the others plain), and a DDP model whose averaged
    gradients hold a NaN on both ranks; each rank keeps its own float64 reference."""
    from torch.distributed.fsdp import fully_shard

    from instrument import GradientStats, NonFinite

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))
    fully_shard(model[0])
    inst = Instrumentation([GradientStats(), NonFinite()], backends=[JsonlBackend()], log_interval=1,
                           log_dir=out_dir, run_name="mixed", overhead_budget=None)
    inst.watch(model)
    for step in range(2):
        with inst.step(step):
            model.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
            grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double()
                     for name, p in model.named_parameters()}
            out["mixed_norms"] = {name: torch.linalg.vector_norm(g).item() for name, g in grads.items()}
            out["mixed_global"] = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])).item()
            if rank == 0 and step == 1:
                model[2].weight.grad[0, :3] = math.nan  # a plain parameter's gradient, on one rank
                model[0].weight.grad.to_local()[0, 0] = math.inf  # and a DTensor's shard
    inst.close()
    out["mixed_failures"] = inst.failures

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    inst = Instrumentation([NonFinite()], backends=[JsonlBackend()], log_interval=1, log_dir=out_dir,
                           run_name="ddp_nan", overhead_budget=None)
    inst.watch(plain)
    with inst.step(0):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        if rank == 0:
            x[0, 0] = math.nan  # after DDP's average every rank's gradient holds the NaNs
        ddp(x).square().mean().backward()
        out["ddp_counts"] = {name: int((~p.grad.isfinite()).sum()) for name, p in plain.named_parameters()}
    inst.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dtensor")
    mp.spawn(_worker, args=(str(tmp),), nprocs=2, join=True)
    return [json.loads((tmp / f"result{r}.json").read_text()) for r in range(2)], tmp


def test_a_sharded_or_partial_dtensor_metric_is_refused_on_every_rank_naming_the_fix(ranks):
    results, _ = ranks
    for out in results:
        for key in ("norm", "sum"):
            message = out[f"refused_{key}"]
            assert f"metric {key!r}" in message and "Partial" in message and "Replicate()" in message
            assert "full_tensor()" in message and "to_local()" in message


def test_replicated_dtensors_are_logged_as_their_global_value(ranks):
    results, _ = ranks
    scalars = results[0]["scalars"]
    assert scalars["norm"] == pytest.approx(math.sqrt(204.0), rel=1e-6)
    assert scalars["rep"] == 3.5
    assert scalars["rep_sum"] == 7.0
    assert scalars["rep_int"] == 3.0


def test_a_sharded_dtensor_histogram_is_refused_on_every_rank_and_a_replicated_one_written(ranks):
    results, _ = ranks
    for out in results:
        assert "log_histogram('h')" in out["refused_hist"] and "Shard(dim=0)" in out["refused_hist"]
    assert results[0]["histograms"] == ["rep_h"]


def test_fsdp2_gradient_histograms_are_left_out_with_one_warning_and_nonfinite_counts_exact(ranks):
    results, tmp = ranks
    for out in results:
        said = [m for m in out["warnings"] if "histograms are not logged" in m]
        assert len(said) == 1 and "Shard(dim=0)" in said[0]
    metrics = {}
    for record in _records(tmp / "fsdp2" / "metrics.jsonl"):
        metrics.update(record.get("metrics", {}))
    assert metrics["grad_stats/norm/2.weight"] > 0  # norm/0.weight and norm/global are NaN
    assert not any("hist" in key for key in metrics)
    assert metrics["nonfinite/grad_count"] == 1.0
    assert metrics["nonfinite/grad_count/0.weight"] == 1.0
    assert metrics["nonfinite/grad_count/2.weight"] == 0.0


def test_classic_fsdp_shard_norms_are_not_logged_and_the_fix_is_said_once(ranks):
    results, tmp = ranks
    for out in results:
        said = [m for m in out["warnings"] if "classic FullyShardedDataParallel" in m]
        assert len(said) == 2 and all("fully_shard" in m for m in said), said  # once per run (each its own)
    for run in ("classic", "classic_inner"):
        keys = {key for record in _records(tmp / run / "metrics.jsonl") for key in record.get("metrics", {})}
        assert "x" in keys and not any(key.startswith("grad_stats/") for key in keys), (run, keys)


def test_a_parameter_named_like_fsdp_s_is_not_taken_for_one(tmp_path):
    # Detection by name left out every parameter of a model with a module named 'proj_flat_params' once
    # torch.distributed.fsdp was imported (as any FSDP2 user's script does): no GradientStats key at all.
    import torch.distributed.fsdp  # noqa: F401

    from instrument import GradientStats

    model = torch.nn.Sequential()
    model.add_module("proj_flat_params", torch.nn.Linear(4, 4))
    model.add_module("out", torch.nn.Linear(4, 1))
    inst = Instrumentation([GradientStats()], backends=[JsonlBackend()], log_interval=1, log_dir=str(tmp_path),
                           run_name="r", overhead_budget=None)
    inst.watch(model)
    with inst.step(0):
        model(torch.randn(2, 4)).sum().backward()
    inst.close()
    keys = set(_records(tmp_path / "r" / "metrics.jsonl")[0]["metrics"])
    assert {"grad_stats/norm/proj_flat_params.weight", "grad_stats/norm/out.weight"} <= keys


def _metrics(path, step=None):
    metrics = {}
    for record in _records(path):
        if step is None or record.get("step") == step:
            metrics.update(record.get("metrics", {}))
    return metrics


def test_fsdp2_on_a_submodule_only_logs_norms_and_counts_of_every_parameter(ranks):
    """Plain parameters beside DTensor ones made GradientStats and NonFinite fail at every logging step (torch's
    fused kernels refuse the mix). Each kind is now computed apart: the DTensor's norm is the whole parameter's,
    a plain one's this rank's (averaged over ranks, as any norm), checked against a float64 reference."""
    results, tmp = ranks
    assert all(out["mixed_failures"] == {} for out in results)
    metrics = _metrics(tmp / "mixed" / "metrics.jsonl", step=0)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        want = sum(out["mixed_norms"][name] for out in results) / 2
        assert metrics[f"grad_stats/norm/{name}"] == pytest.approx(want, rel=1e-6), name
    assert metrics["grad_stats/norm/global"] == pytest.approx(sum(out["mixed_global"] for out in results) / 2,
                                                              rel=1e-6)
    assert metrics["grad_stats/weight_norm/2.bias"] > 0 and metrics["nonfinite/grad_count"] == 0.0
    metrics = _metrics(tmp / "mixed" / "metrics.jsonl", step=1)
    assert metrics["nonfinite/grad_count/2.weight"] == 3.0 and metrics["nonfinite/grad_count/0.weight"] == 1.0
    assert metrics["nonfinite/grad_count"] == 4.0


def test_ddp_gradient_counts_are_not_counted_once_per_rank(ranks):
    """DDP averages the gradients, so every rank holds the same NaNs: the sum over ranks logged 120 non-finite
    elements for a 60-element weight (a review of this stop found it). Gradient counts take the largest rank's."""
    results, tmp = ranks
    counts = results[0]["ddp_counts"]
    assert counts == results[1]["ddp_counts"] and counts["0.weight"] == 60
    metrics = _metrics(tmp / "ddp_nan" / "metrics.jsonl")
    assert {key.rpartition("/")[2]: value for key, value in metrics.items()
            if key.startswith("nonfinite/grad_count/")} == counts
    assert metrics["nonfinite/grad_count"] == sum(counts.values())
