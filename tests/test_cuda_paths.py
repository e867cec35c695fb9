"""The paths a GPU run takes beyond the core logging step, each on the CPU and on CUDA.

RL statistics, media, gradient observers, gradient checkpointing, compiled probes, a second logging thread
and the system monitor's GPU readings: every value is read back from the files a user opens (JSONL, TensorBoard
event files) against a float64 NumPy reference, and the training-thread part of each step runs under a check
that fails on any host read. On CUDA that check is ``torch.cuda.set_sync_debug_mode("error")`` (every
synchronising call raises, the writer thread's included); on the CPU it is `tests.conftest.NoHostSync`, so the
tests' own logic is exercised by ``make test`` on every machine. The CUDA cases are marked ``cuda``: skipped
without a GPU, run alone by ``pytest -m cuda``.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.checkpoint import checkpoint

import instrument
from instrument.rl import CollectionMetrics, RLLogging
from tests.conftest import NoHostSync, event_accumulator, read_scalars
from tests.test_cuda import no_host_sync

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@contextlib.contextmanager
def no_host_read(device: str):
    """Any host read of a tensor inside raises: a synchronising CUDA call on a GPU, a read on the CPU."""
    with NoHostSync() if device == "cpu" else no_host_sync():
        yield


def jsonl_metrics(path):
    return {line["step"]: line["metrics"] for line in map(json.loads, path.read_text().splitlines())
            if "step" in line}


@pytest.mark.parametrize("device", DEVICES)
def test_rl_episode_statistics_from_device_batches_match_a_step_by_step_float64_loop(device, tmp_path):
    """Episodes that end inside a batch and ones carried across iterations, from rewards and dones on the
    device, against a loop over time in float64; no iteration reads a value on the host."""
    g = torch.Generator().manual_seed(3)
    t_len, envs, iterations = 8, 16, 4
    # [envs, time]: time last, as TorchRL collectors lay batches out (RLLogging's default time_dim)
    rewards = [torch.randn(envs, t_len, generator=g, dtype=torch.float64) * 3 + 1 for _ in range(iterations)]
    dones = [torch.rand(envs, t_len, generator=g) < 0.2 for _ in range(iterations)]
    on_device = [(r.float().to(device), d.to(device)) for r, d in zip(rewards, dones, strict=True)]
    losses = [torch.tensor(0.5 * i, device=device) for i in range(iterations)]
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=1, run_name="rl",
                                      log_dir=str(tmp_path))
    rl = RLLogging(progress=None).attach(inst)
    with no_host_read(device):
        for (reward, done), loss in zip(on_device, losses, strict=True):
            with rl.iteration():
                rl.observe_batch(reward=reward, done=done)
                rl.observe_losses({"loss": loss})
    rl.close()
    inst.close()
    assert inst.failures == {}
    got = jsonl_metrics(tmp_path / "rl" / "metrics.jsonl")
    total, length = np.zeros(envs), np.zeros(envs, dtype=int)
    for step in range(iterations):
        reward = rewards[step].float().double().numpy()  # the float32 values the device held
        ended = []
        for t in range(t_len):
            total += reward[:, t]
            length += 1
            for e in np.flatnonzero(dones[step][:, t].numpy()):
                ended.append((total[e], length[e]))
                total[e], length[e] = 0.0, 0
        m = got[step]
        prefix = "collection/main/"
        assert m[prefix + "reward/mean"] == pytest.approx(reward.mean(), rel=1e-6)
        assert m[prefix + "reward/min"] == reward.min() and m[prefix + "reward/max"] == reward.max()
        assert m[prefix + "episode/count"] == len(ended)
        returns = np.array([r for r, _ in ended])
        lengths = np.array([n for _, n in ended])
        assert m[prefix + "episode/return/mean"] == pytest.approx(returns.mean(), rel=1e-6)
        assert m[prefix + "episode/return/min"] == pytest.approx(returns.min(), rel=1e-6)
        assert m[prefix + "episode/return/max"] == pytest.approx(returns.max(), rel=1e-6)
        assert m[prefix + "episode/length/mean"] == pytest.approx(lengths.mean())
        assert m["train/main/loss"] == 0.5 * step
        assert m["counters/frames"] == (step + 1) * t_len * envs


@pytest.mark.parametrize("device", DEVICES)
def test_images_histograms_and_videos_of_device_tensors_are_drawn_from_their_values(device, tmp_path):
    g = torch.Generator().manual_seed(5)
    image = torch.rand(3, 6, 10, generator=g, dtype=torch.float64).float()
    values = torch.randn(10_000, generator=g) * 2.0 + 0.5
    frames = (torch.rand(4, 6, 8, 3, generator=g) < 0.5).to(torch.uint8) * 255  # two levels: a GIF keeps them
    image_d, values_d, frames_d = image.to(device), values.to(device), frames.to(device)
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("media", tmp_path))
    with no_host_read(device):
        logger.log_image("img", image_d, 0)
        logger.log_histogram("hist", values_d, 0)
        logger.log_video("vid", frames_d, 0, fps=4)
        logger.commit(0)
    logger.close()
    assert logger.failures == {}
    acc = event_accumulator(tmp_path / "media")
    drawn = np.asarray(Image.open(io.BytesIO(acc.Images("img")[-1].encoded_image_string)).convert("RGB"))
    want = (np.clip(image.double().numpy(), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8).transpose(1, 2, 0)
    np.testing.assert_array_equal(drawn, want)
    (hist,) = acc.Histograms("hist")
    ref = values.double().numpy()
    assert hist.histogram_value.num == ref.size
    assert hist.histogram_value.min == pytest.approx(ref.min(), rel=1e-6)
    assert hist.histogram_value.max == pytest.approx(ref.max(), rel=1e-6)
    assert hist.histogram_value.sum == pytest.approx(ref.sum(), rel=1e-5)
    assert sum(hist.histogram_value.bucket) == ref.size
    gif = Image.open(io.BytesIO(acc.Images("vid")[-1].encoded_image_string))
    decoded = []
    for i in range(gif.n_frames):
        gif.seek(i)
        decoded.append(np.asarray(gif.convert("RGB")))
    np.testing.assert_array_equal(np.stack(decoded), frames.numpy())


class Rule(nn.Module):
    """One NCA-like iteration with a stochastic fire mask drawn on the state's device."""

    def __init__(self, channels: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.perceive = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.mlp = nn.Sequential(nn.Conv2d(2 * channels, hidden, 1), nn.ReLU(), nn.Conv2d(hidden, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fire = (torch.rand(x.shape[0], 1, *x.shape[2:], device=x.device) <= 0.5).to(x.dtype)
        return x + 0.1 * self.mlp(self.perceive(x)) * fire


def _gradient_step(device: str, inst, checkpointed: bool, x0: torch.Tensor):
    """One training step of 4 iterations; returns float64 host copies of weights before/after, the gradients
    and every state, all cloned on the device inside the step and read on the host after it."""
    torch.manual_seed(7)
    rule = Rule().to(device)
    inst.watch(rule)
    opt = torch.optim.SGD(rule.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in rule.named_parameters()}
    with no_host_read(device):
        with inst.step(0):
            x, states = x0, [x0]
            for _ in range(4):
                x = checkpoint(rule, x, use_reentrant=False) if checkpointed else rule(x)
                states.append(x.detach().clone())
            F.mse_loss(x, torch.full_like(x, 0.25)).backward()
            grads = {n: p.grad.detach().clone() for n, p in rule.named_parameters()}
            opt.step()
    after = {n: p.detach().clone() for n, p in rule.named_parameters()}
    inst.close()

    def host(d):
        return {n: v.double().cpu().numpy() for n, v in d.items()}

    return host(before), host(after), host(grads), [s.double().cpu().numpy() for s in states]


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_gradient_update_and_state_observers_match_float64_with_and_without_checkpointing(device, checkpointed,
                                                                                          tmp_path):
    """GradientStats, UpdateNorm and IterationStats on one training step, read back from TensorBoard; under
    gradient checkpointing each iteration is observed once (the recompute is not observed again)."""
    x0 = torch.rand(2, 4, 12, 12, generator=torch.Generator().manual_seed(2)).to(device)
    observers = [instrument.GradientStats(), instrument.UpdateNorm(), instrument.IterationStats(images=False)]
    inst = instrument.Instrumentation(observers, backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      run_name="g", log_dir=str(tmp_path))
    before, after, grads, states = _gradient_step(device, inst, checkpointed, x0)
    assert inst.failures == {}
    got = read_scalars(tmp_path / "g")
    grad_norms = {n: np.linalg.norm(g.ravel()) for n, g in grads.items()}
    assert got["grad_stats/norm/global"][0] == pytest.approx(np.sqrt(sum(v**2 for v in grad_norms.values())),
                                                              rel=1e-5)
    for n in grads:
        assert got[f"grad_stats/norm/{n}"][0] == pytest.approx(grad_norms[n], rel=1e-5)
        assert got[f"grad_stats/weight_norm/{n}"][0] == pytest.approx(np.linalg.norm(after[n]), rel=1e-5)
        ratio = np.linalg.norm(after[n] - before[n]) / np.linalg.norm(before[n])
        assert got[f"grad_stats/update_ratio/{n}"][0] == pytest.approx(ratio, rel=1e-4)
    norms = [np.sqrt(((b - a).reshape(2, -1) ** 2).sum(1)).mean() for a, b in zip(states[:-1], states[1:], strict=True)]
    assert got["update_norm/l2/mean"][0] == pytest.approx(np.mean(norms), rel=1e-5)
    last = states[-1].transpose(1, 0, 2, 3).reshape(4, -1)
    for c in range(4):
        assert got[f"iteration_stats/mean/c{c}"][0] == pytest.approx(last[c].mean(), rel=1e-5)
        assert got[f"iteration_stats/std/c{c}"][0] == pytest.approx(last[c].std(), rel=1e-5)
    assert got["iteration_stats/iterations"][0] == 4  # each iteration once, also under checkpointing


@pytest.mark.filterwarnings("ignore::UserWarning")  # inductor's hints (e.g. TF32 on a GPU)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_embedded_probes_record_the_values_of_the_layers(device):
    from tests._probe_models import KeepProbes, reference
    from tests._probe_models import Rule as ProbedRule

    torch._dynamo.reset()
    torch.manual_seed(0)
    rule = ProbedRule().to(device)
    compiled = torch.compile(rule)
    keep = KeepProbes()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=2)
    inst.watch(compiled, state=False)
    x0 = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1)).to(device)

    def rollout(step):
        with inst.step(step) as s:
            x = x0
            for _ in range(3):
                nxt = compiled(x)
                if s.observer is not None:
                    s.observer(instrument.StepContext(x, nxt))
                x = nxt

    for step in range(2):  # compiled for a logging step and a non-logging one, outside the check
        rollout(step)
    with no_host_read(device):
        rollout(2)
    inst.close()
    torch._dynamo.reset()
    expected = reference(rule, x0, 3)
    assert len(keep.seen) == 3
    for got, want in zip(keep.seen, expected, strict=True):
        for name in ("hidden", "update"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_values_logged_from_a_second_thread_are_each_committed_once(device, tmp_path):
    """An evaluation thread logs device values while the training thread stages and commits its own."""
    path = tmp_path / "m.jsonl"
    logger = instrument.Logger([instrument.JsonlBackend(str(path))], instrument.RunInfo("t", tmp_path))
    side_values = torch.arange(300, dtype=torch.float32, device=device) * 0.25
    main_values = torch.arange(300, dtype=torch.float32, device=device) * -1.0
    if device == "cuda":
        torch.cuda.synchronize()  # the values exist before the side thread reads them

    current = [0]
    lock = threading.Lock()  # steps are taken in order: the eval thread logs at the training step of the moment

    def side() -> None:
        for n in range(300):
            with lock:
                logger.log_metrics({f"eval/{n}": side_values[n]}, step=current[0])

    thread = threading.Thread(target=side)
    thread.start()
    for n in range(300):
        with lock:
            current[0] = n
            logger.log_metrics({f"train/{n}": main_values[n]}, step=n)
        logger.commit()  # at the staged step, while the eval thread may be staging
    thread.join()
    logger.commit(300)
    logger.close()
    assert logger.failures == {}
    seen = {}
    for metrics in jsonl_metrics(path).values():
        for key, value in metrics.items():
            assert key not in seen, f"{key} committed twice"
            seen[key] = value
    assert seen == {**{f"eval/{n}": n * 0.25 for n in range(300)}, **{f"train/{n}": -float(n) for n in range(300)}}


@pytest.mark.cuda
def test_the_system_monitor_reads_the_gpu_through_torch_and_nvml(tmp_path):
    pytest.importorskip("pynvml", reason="NVML readings need nvidia-ml-py")
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB allocated by torch
    path = tmp_path / "m.jsonl"
    logger = instrument.Logger([instrument.JsonlBackend(str(path))], instrument.RunInfo("sys", tmp_path))
    monitor = instrument.SystemMonitor(collection_interval=0.05, flush_interval=0.05, gpu=True)
    monitor.start(logger)
    samples = []
    for _ in range(400):
        whole = path.read_text().rpartition("\n")[0] if path.exists() else ""  # complete lines only
        samples = [line for line in map(json.loads, whole.splitlines())
                   if any(k.startswith("system/gpu0/") for k in line.get("metrics", {}))]
        if samples:
            break
        threading.Event().wait(0.05)
    monitor.stop()
    logger.close()
    assert samples, "no GPU sample was written within 20 s"
    metrics = samples[0]["metrics"]
    allocated = metrics["system/gpu0/torch_allocated_gib"]
    assert 64 / 1024 <= allocated <= torch.cuda.max_memory_allocated() / 2**30 + 1e-9
    assert metrics["system/gpu0/torch_reserved_gib"] >= allocated
    assert 0.0 <= metrics["system/gpu0/utilization_percent"] <= 100.0
    assert 0.0 < metrics["system/gpu0/memory_used_percent"] <= 100.0
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert metrics["system/gpu0/memory_used_gib"] == pytest.approx(
        metrics["system/gpu0/memory_used_percent"] / 100.0 * total, rel=0.05)
    del held


@pytest.mark.parametrize("device", DEVICES)
def test_the_demos_train_on_the_device_and_log_the_numbers_they_return(device, tmp_path):
    from instrument.demos.cartpole import train_cartpole
    from instrument.demos.nca import train_nca

    inst = instrument.Instrumentation([instrument.IterationStats(images=False), instrument.UpdateNorm()],
                                      backends=[instrument.JsonlBackend()], log_interval=1, run_name="nca",
                                      log_dir=str(tmp_path))
    nca = train_nca(inst, steps=3, batch_size=2, size=12, n_iter_min=4, n_iter_max=6, device=device)
    inst.close()
    assert next(nca["model"].parameters()).device.type == device and inst.failures == {}
    logged = jsonl_metrics(tmp_path / "nca" / "metrics.jsonl")
    assert [logged[s]["train/loss"] for s in range(3)] == pytest.approx(nca["losses"], rel=1e-6)
    assert all(4 <= logged[s]["iteration_stats/iterations"] <= 6 for s in range(3))
    inst = instrument.Instrumentation([instrument.IterationStats(channel_dim=-1, images=False)],
                                      backends=[instrument.JsonlBackend()], log_interval=1, run_name="rl",
                                      log_dir=str(tmp_path))
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None)  # the demo's batches are [time, envs]
    cart = train_cartpole(inst, steps=3, num_envs=16, max_steps=20, rl_logging=rl, device=device)
    inst.close()
    assert next(cart["policy"].parameters()).device.type == device and inst.failures == {}
    logged = jsonl_metrics(tmp_path / "rl" / "metrics.jsonl")
    assert [logged[s]["train/episode_length"] for s in range(3)] == pytest.approx(cart["mean_lengths"], rel=1e-6)
    assert logged[2]["counters/frames"] > 0


TINY_NCA = ["--bind", "train_nca.steps = 3", "--bind", "train_nca.batch_size = 2", "--bind", "train_nca.size = 16"]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["nca", "nca_diagnostics", "nca_checkpointed", "rl_cartpole"])
def test_every_shipped_demo_config_runs_on_cuda_from_the_command_line(name, tmp_path):
    """What a user on a GPU machine runs: ``instrument run <config> --bind '<demo>.device = "cuda"'``."""
    demo = "train_cartpole" if name.startswith("rl") else "train_nca"
    binds = ["--bind", "train_cartpole.steps = 4", "--bind", "train_cartpole.num_envs = 32"] if demo != "train_nca" \
        else TINY_NCA
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "WANDB_MODE": "offline"}
    out = subprocess.run(
        [sys.executable, "-m", "instrument", "run", name, *binds, "--bind", "Instrumentation.log_interval = 2",
         "--bind", f"{demo}.device = 'cuda'", "--bind", "Instrumentation.run_name = 'gpu'"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert " failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    scalars = read_scalars(tmp_path / "runs" / "gpu")
    assert {0, 2} <= set(scalars["train/loss"])  # the logging steps (RL adds its last step at close)
    assert {0, 2} <= set(scalars["iteration_stats/iterations"])
    assert all(np.isfinite(v) for v in scalars["train/loss"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA answers")
def test_asking_for_the_cuda_tests_without_cuda_is_an_error_not_a_run_of_skips(tmp_path):
    """`make test-cuda` (``pytest -m cuda``) with a CPU build of torch skipped every test and exited 0."""
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                          str(repo / "tests" / "test_cuda.py")], cwd=repo, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout[-2000:]
    said = "the tests marked cuda were asked for, but this torch is a CPU build" if torch.version.cuda is None else \
        "sees no CUDA device: check the driver"
    assert said in out.stdout, out.stdout[-2000:]


@pytest.mark.cuda
def test_timers_of_a_cpu_only_run_on_a_gpu_machine_create_no_cuda_context_and_follow_the_run_to_the_gpu():
    """A timer chose CUDA events whenever a GPU existed: a CPU-only run's first span created a CUDA context. In a
    fresh process: wall time while CUDA is not initialised, events once the run has put something on the GPU
    (a timer made before that follows it), wall time again for `cuda=False`; every timing is committed."""
    script = (
        "import torch, instrument\n"
        "log = instrument.Logger([instrument.RunHistoryBackend()])\n"
        "early, host = log.timer('early'), log.timer('host', cuda=False)\n"
        "with early:\n    pass\n"
        "assert isinstance(early._seconds[0], float) and not torch.cuda.is_initialized()\n"
        "log.commit(0)\n"
        "x = torch.ones(256, 256, device='cuda')\n"
        "with early:\n    y = x @ x\n"
        "with host:\n    y = x @ x\n"
        "assert len(early._events) == 1 and isinstance(host._seconds[0], float)\n"
        "record = log.commit(1)\n"
        "assert record.timings['early']['count'] == 1.0 and record.timings['host']['count'] == 1.0\n"
        "log.close()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_moves_host_values_exactly_and_leaves_a_cpu_tensor_itself(device):
    """`instrument.core.devices.to_device`: the host-made index lists, masks and scalar vectors reach a GPU
    through pinned memory without a wait; every dtype used arrives exact, and on the CPU nothing is copied."""
    from instrument.core.devices import to_device

    values = [torch.tensor([True, False, True]), torch.tensor([0, 2**53 + 1, -7], dtype=torch.int64),
              torch.tensor([0.1, -2.5e300, 3.0], dtype=torch.float64), torch.tensor(1.5), torch.arange(6)[::2]]
    for host in values:
        moved = to_device(host, torch.device(device))
        assert moved.device.type == device and moved.dtype == host.dtype
        assert torch.equal(moved.cpu(), host)
        if device == "cpu":
            assert moved is host


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reader", ["evaluation", "frames"])
def test_a_frame_schedule_without_a_collector_mask_reads_nothing_back_and_counts_episodes_exactly(
        device, reader, tmp_path):
    """An `Evaluation`'s schedule and ``step_unit="frames"`` read ``Counters.frames`` every iteration. Without a
    collector mask the frames are known from shapes, but that read also brought the episode count (on the device
    since the batches have `done`) back to the host: a host sync every iteration (a review counted 100 in 100
    iterations). It is left on the device now, and read with the commit's transfer, exact."""
    from instrument.rl import CollectionMetrics, Evaluation

    g = torch.Generator().manual_seed(5)
    t_len, envs, iterations, interval = 8, 4, 12, 5
    dones = [torch.rand(t_len, envs, generator=g) < 0.25 for _ in range(iterations)]
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=interval, run_name="rl",
                                      log_dir=str(tmp_path))
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None,
                   evaluation=Evaluation(every_frames=10**9) if reader == "evaluation" else None,
                   step_unit="frames" if reader == "frames" else "iterations").attach(inst)
    reward = torch.ones(t_len, envs, device=device)
    on_device = [done.to(device) for done in dones]  # before the check: a copy from pageable memory synchronises
    with no_host_read(device):
        for done in on_device:
            with rl.iteration():
                rl.observe_batch(reward=reward, done=done)
            assert rl.counters.frames_known
    rl.close()
    inst.close()
    assert inst.failures == {}
    got = jsonl_metrics(tmp_path / "rl" / "metrics.jsonl")
    ended = np.cumsum([int(done.sum()) for done in dones])
    logged = [0, 5, 10, iterations - 1]  # the session's cadence, and the record close writes after the last one
    steps = logged if reader == "evaluation" else [(k + 1) * t_len * envs for k in logged]
    assert sorted(got) == steps
    for k, step in zip(logged, steps, strict=True):
        assert got[step]["counters/episodes"] == ended[k] and got[step]["counters/frames"] == (k + 1) * t_len * envs
