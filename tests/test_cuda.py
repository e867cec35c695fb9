"""CUDA: a logging step makes no host sync inside the rollout, and the commit's copy is non-blocking.

Every test here is marked ``cuda`` and skipped without a CUDA device (see ``tests/conftest.py``); on a GPU
machine ``pytest -m cuda`` runs them alone. ``torch.cuda.set_sync_debug_mode("error")`` makes the synchronising
CUDA calls it knows (``.item()``, a blocking device->host copy, a stream synchronize) raise, so a test that passes
under it shows that none of those happened. It does not see every sync: an event's ``synchronize`` (the writer
thread's wait, which is meant to block), a copy from pageable host memory, or a pinned allocation go unnoticed,
and torch calls the mode a prototype that "does not yet detect all synchronizing operations".
"""

import contextlib
import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import instrument
from instrument.logger.transfer import start_transfer
from tests.conftest import read_scalars

pytestmark = pytest.mark.cuda

ITERATIONS = 4


class Grow(nn.Module):
    """One deterministic NCA-like iteration (channels first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.02 * torch.sin(3.0 * x)


@contextlib.contextmanager
def no_host_sync():
    """The synchronising CUDA calls the debug mode knows raise inside (the mode is process-wide; the writer
    thread's event wait is not one it knows, and is meant to block)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # "a prototype feature and does not yet detect all synchronizing operations"
        warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _state() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.rand((2, 5, 16, 16), generator=g) * 0.2 - 0.1
    x[:, 3] += (torch.rand((2, 16, 16), generator=g) < 0.2) * 0.6  # some alive cells (alpha > 0.1)
    return x


def _reference(x0: torch.Tensor):
    """float64 NumPy over the same iterations: mean per-sample L2 norm of each update, and the last state's
    per-channel mean and population std."""
    x = x0.double().numpy()
    norms = []
    for _ in range(ITERATIONS):
        nxt = x + 0.02 * np.sin(3.0 * x)
        norms.append(np.sqrt(((nxt - x).reshape(x.shape[0], -1) ** 2).sum(1)).mean())
        x = nxt
    per_channel = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1)
    return np.mean(norms), per_channel.mean(1), per_channel.std(1), x


def test_a_logging_step_on_cuda_makes_no_host_sync_and_logs_the_float64_reference(tmp_path):
    x0 = _state()
    start = x0.cuda()  # outside the check: a copy from pageable host memory is a synchronising call
    inst = instrument.Instrumentation(
        observers=[instrument.IterationStats(images=False), instrument.UpdateNorm()],
        backends=[instrument.TensorBoardBackend(), instrument.JsonlBackend()], log_interval=2, run_name="r",
        log_dir=str(tmp_path),
    )
    rule = Grow().cuda()
    inst.watch(rule)
    for step in range(4):  # logging steps 0 and 2, a non-logging step after each
        with no_host_sync():
            with inst.step(step):
                x = start
                for _ in range(ITERATIONS):
                    x = rule(x)
                inst.logger.log_metrics({"energy": (x.double() ** 2).mean()}, step=step, prefix="train")
    inst.close()
    norm, means, stds, last = _reference(x0)
    scalars = read_scalars(tmp_path / "r")
    assert set(scalars["update_norm/l2/mean"]) == {0, 2}
    for step in (0, 2):
        assert scalars["update_norm/l2/mean"][step] == pytest.approx(norm, rel=1e-5)
        assert scalars["train/energy"][step] == pytest.approx((last**2).mean(), rel=1e-6)
        for c in range(5):
            assert scalars[f"iteration_stats/mean/c{c}"][step] == pytest.approx(means[c], rel=1e-5, abs=1e-7)
            assert scalars[f"iteration_stats/std/c{c}"][step] == pytest.approx(stds[c], rel=1e-5)


def test_the_commit_copies_into_pinned_memory_behind_one_event():
    values = [torch.arange(6.0, device="cuda").view(2, 3), torch.tensor(2.5, device="cuda"),
              torch.tensor(7, device="cuda"), torch.full((4,), 9, dtype=torch.uint8, device="cuda")]
    with no_host_sync():
        batch = start_transfer(values)  # what commit does on the training thread
    buffers = [buffer for buffer, _ in batch._parts]
    assert buffers and all(buffer.device.type == "cpu" and buffer.is_pinned() for buffer in buffers)
    assert len(batch._events) == 1  # one device: one event, recorded after its copies
    arrays = batch.arrays()  # what the writer thread does: waits on the event, then reads
    np.testing.assert_array_equal(arrays[0], np.arange(6.0).reshape(2, 3))
    assert arrays[1].shape == () and arrays[1] == 2.5 and arrays[2] == 7.0
    assert arrays[3].dtype == np.uint8 and arrays[3].tolist() == [9, 9, 9, 9]


def test_a_cuda_commit_makes_no_host_sync_and_the_writer_reads_the_values(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = instrument.Logger([instrument.JsonlBackend(str(path))], instrument.RunInfo("cuda", tmp_path))
    x = torch.arange(100.0, device="cuda")
    with no_host_sync():
        logger.log_metrics({"mean": x.mean(), "max": x.max()}, step=0)
        logger.log_heatmap("hm", x.view(10, 10), 0)
        handle = logger.commit(0)  # non-blocking copy into pinned memory; the writer waits on the event
    assert handle.scalars == {"mean": 49.5, "max": 99.0}
    logger.close()
    first = json.loads(path.read_text().splitlines()[0])
    assert first["metrics"] == {"mean": 49.5, "max": 99.0} and first["images"]["hm"][2] == 3


def test_timers_on_two_streams_are_read_on_the_writer_without_a_sync_on_the_caller(tmp_path):
    logger = instrument.Logger([], instrument.RunInfo("timers", tmp_path))
    a = torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    with no_host_sync():
        with torch.cuda.stream(side):  # a long span on a side stream, recorded first
            with logger.timer("side"):
                for _ in range(20):
                    a = a @ a / 1024
        with logger.timer("main"):  # a short one on the default stream, recorded last
            b = torch.ones(8, device="cuda") * 2
        logger.log_metrics({"b": b.sum()}, step=0)
        handle = logger.commit(0)
    record = handle.result(timeout=60)  # the writer waits for every span's end, whatever its stream
    assert record is not None and record.scalars == {"b": 16.0}
    assert record.timings["side"]["count"] == 1 and record.timings["side"]["mean"] > 0
    assert record.timings["main"]["count"] == 1 and record.timings["main"]["mean"] >= 0
    side.synchronize()
    logger.close()


def test_a_cuda_timer_folds_the_spans_that_have_run_without_a_sync_and_counts_every_span(tmp_path):
    """Two CUDA events a span were kept until the next commit; pairs whose events have run are now folded into
    count, sum, min and max (a query each, never a wait), so a timer never committed stays bounded."""
    from instrument.logger.timer import FOLD_AT

    logger = instrument.Logger([], instrument.RunInfo("fold", tmp_path))
    timer = logger.timer("tiny", cuda=True)
    x = torch.ones(64, device="cuda")
    n, held = 3 * FOLD_AT, []
    with no_host_sync():
        for _ in range(n):
            with timer:
                x = x * 1.0
            held.append(len(timer._events))
        handle = logger.commit(0)
    record = handle.result(timeout=60)
    assert max(held) < n  # folded on the way (tiny kernels run long before a thousand more are launched)
    stats = record.timings["tiny"]
    assert stats["count"] == n and 0 <= stats["min"] <= stats["mean"] <= stats["max"]
    logger.close()


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("scripted", [False, True])
def test_embedded_probes_on_cuda_record_without_a_sync(scripted):
    from tests._probe_models import KeepProbes, Rule, reference

    torch.manual_seed(0)
    rule = Rule().cuda()
    module = torch.jit.script(rule) if scripted else rule
    keep = KeepProbes()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(module, state=False)
    x0 = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1)).cuda()
    with no_host_sync():
        with inst.step(0) as s:
            x = x0
            for _ in range(3):
                nxt = module(x)
                s.observer(instrument.StepContext(x, nxt))
                x = nxt
    inst.close()
    expected = reference(rule, x0, 3)
    assert len(keep.seen) == 3
    for got, want in zip(keep.seen, expected, strict=True):
        for name in ("hidden", "update"):
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_integer_values_of_every_width_travel_exact_from_cuda_without_a_sync(tmp_path, caplog):
    """Integer metrics and sample fields on CUDA: int64 and uint64 beyond 2**53 are flagged on the device and
    named once by the writer, uint64 travels as its bits, and no value is read on the training thread."""
    big, unsigned = 2**60 + 1, 2**63 + 5
    cpu = {"seed": torch.tensor(big), "u": torch.tensor(unsigned, dtype=torch.uint64),
           "i32": torch.tensor(2**31 - 1, dtype=torch.int32), "small": torch.tensor(7)}
    fields = {"small": torch.tensor(-3, dtype=torch.int8), "u16": torch.tensor(65535, dtype=torch.uint16),
              "u32": torch.tensor(4_000_000_000, dtype=torch.uint32), "u64": torch.tensor(unsigned, dtype=torch.uint64),
              "ids": torch.tensor([big, 2]), "flags": torch.tensor([True, False]),
              "pixels": torch.tensor([255], dtype=torch.uint8)}
    metrics = {k: v.cuda() for k, v in cpu.items()}
    row = {k: v.cuda() for k, v in fields.items()}
    torch.cuda.synchronize()
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    with caplog.at_level("WARNING", logger="instrument"):
        with no_host_sync():
            logger.log_metrics(metrics, step=0)
            logger.log_samples("val", [row], 0)
            logger.commit(0)
        logger.close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    (first,) = [line for line in lines if "metrics" in line]
    assert first["metrics"] == {"seed": float(big), "u": float(unsigned), "i32": float(2**31 - 1), "small": 7.0}
    (written,) = first["samples"]["val"]
    assert written == {"small": -3, "u16": 65535, "u32": 4_000_000_000, "u64": str(unsigned),
                       "ids": f"[{big}, 2]", "flags": "[True, False]", "pixels": 255}  # lists: a table cell's str
    said = sorted(r.getMessage().split("'")[1] for r in caplog.records if "beyond 2**53" in r.getMessage())
    assert said == ["seed", "u"]


class Wide(nn.Module):
    """An NCA-like iteration whose hidden layer's output is larger than the CPU's batching limit (2**17)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Conv2d(5, 96, 1)
        self.out = nn.Conv2d(96, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * self.out(torch.relu(self.hidden(x)))


def test_large_activations_are_batched_on_cuda_without_a_sync_and_match_float64(tmp_path):
    """On a GPU every output size is kept for one batched reduction (reducing each as it comes cost ~30 kernel
    launches per call); the values are those of a float64 NumPy reduction of each output."""
    x0 = torch.rand((4, 5, 24, 24), generator=torch.Generator().manual_seed(1))
    start = x0.cuda()
    stats = instrument.ActivationStats(images=False)
    inst = instrument.Instrumentation(observers=[stats], backends=[instrument.JsonlBackend()], log_interval=1,
                                      run_name="act", log_dir=str(tmp_path))
    rule = Wide().cuda()
    inst.watch(rule)
    outputs = []
    keep = rule.hidden.register_forward_hook(lambda m, a, out: outputs.append(out.detach().double().cpu().numpy()))
    with torch.no_grad():  # the reference: every output of the hidden layer, in float64
        x = start
        for _ in range(ITERATIONS):
            x = rule(x)
    keep.remove()
    with no_host_sync():
        with inst.step(0):
            x = start
            for _ in range(ITERATIONS):
                x = rule(x)
            assert rule.hidden._forward_hooks  # the step's hook is on
            assert len(stats._sums[0]._items) == ITERATIONS  # kept by reference: nothing reduced yet
    inst.close()
    assert outputs[0].size > 2**17
    last = outputs[-1]
    record = json.loads((tmp_path / "act" / "metrics.jsonl").read_text().splitlines()[-1])["metrics"]
    assert record["activations/hidden/mean"] == pytest.approx(last.mean(), rel=1e-5)
    assert record["activations/hidden/std"] == pytest.approx(last.std(), rel=1e-5)
    assert record["activations/hidden/absmax"] == pytest.approx(np.abs(last).max(), rel=1e-6)
    assert record["activations/hidden/zero_frac"] == pytest.approx(np.mean(last == 0.0), abs=1e-7)
