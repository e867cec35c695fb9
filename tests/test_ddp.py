"""A model wrapped in DistributedDataParallel, 2 real gloo ranks (processes): instrument's logging steps change
nothing DDP does (parameters bitwise those of an uninstrumented twin on every step, with ``no_sync()``
accumulation), and the logged gradient norm and state statistics are those of the global batch, read back from
rank 0's JSONL against a float64 reference computed from both ranks' data."""

import json

import pytest

from tests.conftest import run_child

CHILD = r'''
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, ITERS = 4, 3


def state(step, rank, k):
    return torch.rand(2, 4, 6, 6, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + k)) - 0.3


class Rule(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, 8, 1), nn.Tanh(), nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return x + 0.1 * self.net(x)


def rule():
    torch.manual_seed(0)
    return Rule()


def rollout(model, x):
    for _ in range(ITERS):
        x = model(x)
    return x


def worker(rank, tmp):
    import instrument
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(os.path.join(tmp, "store"), 2))
    a, b = DDP(rule()), DDP(rule())  # a: instrumented, b: its bare twin
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.05), torch.optim.SGD(b.parameters(), lr=0.05)
    inst = instrument.Instrumentation(
        observers=[instrument.IterationStats(images=False), instrument.GradientStats(per="global")],
        backends=[instrument.JsonlBackend()], log_interval=2, log_dir=tmp, run_name="ddp")
    inst.watch(a.module)
    for step in range(STEPS):
        micro = [state(step, rank, k) for k in range(2)]
        with inst.step(step):
            opt_a.zero_grad()
            with a.no_sync():
                rollout(a, micro[0]).square().mean().backward()
            rollout(a, micro[1]).square().mean().backward()
            opt_a.step()
        opt_b.zero_grad()
        with b.no_sync():
            rollout(b, micro[0]).square().mean().backward()
        rollout(b, micro[1]).square().mean().backward()
        opt_b.step()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), f"rank {rank} step {step}: a parameter differs from the bare twin"
    inst.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp = sys.argv[1]
    mp.spawn(worker, args=(tmp,), nprocs=2, join=True)
    # the reference: the same training in float64 on one process, over both ranks' data (DDP averages gradients)
    model = rule().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    want = {}
    for step in range(STEPS):
        opt.zero_grad()
        finals = []
        for rank in range(2):
            for k in range(2):
                x = rollout(model, state(step, rank, k).double())
                (x.square().mean() / 2).backward()  # the mean over ranks of each rank's summed micro-batches
                finals.append(x.detach())
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        last = torch.cat(finals[1::2])  # each rank's last micro-batch: what the observers saw last
        want[step] = {"norm": norm.item(), "mean_c0": last[:, 0].mean().item()}
        opt.step()
    json.dump(want, open(os.path.join(tmp, "want.json"), "w"))
'''


def test_ddp_training_is_unchanged_and_its_numbers_are_the_global_batch_s(tmp_path):
    done = run_child(tmp_path, CHILD, str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads((tmp_path / "want.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    logged = {line["step"]: line["metrics"] for line in lines if "metrics" in line}
    assert sorted(logged) == [0, 2]
    for step in (0, 2):
        assert logged[step]["grad_stats/norm/global"] == pytest.approx(want[str(step)]["norm"], rel=1e-5)
        assert logged[step]["iteration_stats/mean/c0"] == pytest.approx(want[str(step)]["mean_c0"], rel=1e-5)
        assert logged[step]["iteration_stats/iterations"] == 6  # two micro-batches of 3 iterations
