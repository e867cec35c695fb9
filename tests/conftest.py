"""Shared fixtures: a tiny update rule, a recording observer, readers for real backend outputs, an `mlflow server`."""

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import gin
import pytest
import torch
from torch import nn

import instrument


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped without a CUDA device (``pytest -m cuda`` runs them on a GPU machine).

    Asked for alone (``pytest -m cuda``, what ``make test-cuda`` runs) on a torch without CUDA, the run stops
    with an error instead: every test would be skipped, and a run of skips reads like a pass."""
    if torch.cuda.is_available():
        return
    if (config.getoption("markexpr", "") or "").strip() == "cuda":
        if torch.version.cuda is None:
            why = (f"this torch is a CPU build (torch {torch.__version__}). On a GPU machine install a CUDA build "
                   f"first: `.venv/bin/pip uninstall -y torch && make TORCH=torch test-cuda` (or remove .venv)")
        else:
            why = (f"this torch (torch {torch.__version__}, CUDA {torch.version.cuda}) sees no CUDA device: check "
                   f"the driver (`nvidia-smi`) and CUDA_VISIBLE_DEVICES (now "
                   f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})")
        pytest.exit(f"the tests marked cuda were asked for, but {why}.", returncode=pytest.ExitCode.USAGE_ERROR)
    skip = pytest.mark.skip(reason="needs a CUDA device: run `pytest -m cuda` on a machine with one")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolate(monkeypatch, tmp_path):
    """Each test runs in its own directory, single-threaded, with W&B offline and a clean gin config."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.set_num_threads(1)
    yield
    gin.clear_config()
    logging.getLogger("instrument").handlers.clear()


class TinyRule(nn.Module):
    """One rollout iteration: x -> x + 0.1 * conv(x)."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.tanh(self.conv(x))


class Recorder(instrument.Observer):
    """Records the lifecycle it goes through, and the contexts it sees."""

    def __init__(self, name: str = "recorder") -> None:
        super().__init__(name)
        self.events: List[str] = []
        self.contexts: List[instrument.StepContext] = []
        self.grad_enabled: List[bool] = []

    def reset(self) -> None:
        self.events.append("reset")

    def observe(self, context: instrument.StepContext) -> None:
        self.events.append(f"observe{context.step_index}")
        self.contexts.append(context)
        self.grad_enabled.append(torch.is_grad_enabled())

    def log(self, logger, step: int) -> None:
        self.events.append(f"log{step}")
        logger.log_metrics({"seen": float(len(self.contexts))}, step=step, prefix=self.name)


@pytest.fixture
def rule() -> TinyRule:
    torch.manual_seed(0)
    return TinyRule()


def iteration_stats_in_tensorboard(log_dir: Path, states: List[torch.Tensor]) -> Dict[str, Dict[int, float]]:
    """One logging step of `IterationStats` over ``states`` (a rollout), written by a real TensorBoardBackend
    to ``log_dir/r`` and read back with TensorBoard's reader."""
    inst = instrument.Instrumentation(
        [instrument.IterationStats()], backends=[instrument.TensorBoardBackend()], log_interval=1,
        log_dir=str(log_dir), run_name="r",
    )
    with inst.step(0) as s:
        for i in range(len(states) - 1):
            s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    return read_scalars(log_dir / "r")


def read_scalars(log_dir: Path) -> Dict[str, Dict[int, float]]:
    """Scalars from real TensorBoard event files, read with TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def event_accumulator(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


class NoHostSync:
    """A TorchFunctionMode that fails on every tensor-to-host read (``.item()``, ``bool(t)``, ``.tolist()``,
    ``.cpu()``, ``.numpy()``...) made on this thread while it is active: on a GPU each would be a host sync,
    so code run under it provably makes none (the mode is thread-local: the logger's writer thread is free).
    Under a mode, `log_metrics` stacks one-element CPU tensors as it stacks device ones, instead of reading
    them at once (`instrument.logger.blocks.tensor_block`), so the check sees the path a GPU run takes."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero"}

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        reads = self.READS

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in reads:
                    raise AssertionError(f"host read {func.__name__} on the training thread")
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def tqdm_bar_active() -> bool:
    """Whether a tqdm bar is alive in this process (a test diagnostic: tqdm has no public API for its live
    bars, so this reads its private registry; the library itself never does)."""
    module = sys.modules.get("tqdm")
    bar_class = getattr(module, "tqdm", None) if module is not None else None
    return bool(getattr(bar_class, "_instances", None)) if bar_class is not None else False


# The start of a child script whose `run_ranks(worker)` runs ``worker(rank)`` on two threads, each a rank of one
# threaded process group (torch's own distributed tests use them; the registry is process-wide, hence a child).
THREADED_RANKS = """
import json, threading
import torch, torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

torch._C._distributed_c10d._set_thread_isolation_mode(True)
_install_threaded_pg()
store, out, barrier = dist.HashStore(), {}, threading.Barrier(2)

def run_ranks(worker):
    def rank_thread(rank):
        dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
        barrier.wait()
        worker(rank)
    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
"""


def run_child(tmp_path: Path, source: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``source`` as a script in a fresh Python (this checkout importable, one OMP thread), output captured."""
    script = tmp_path / "child.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def watched_rollout(inst, rule, seed, n: int, step: int = 0):
    """Watch ``rule`` in ``inst``, run it ``n`` times from ``seed`` in logging step ``step``, close the session;
    the states, ``seed`` first."""
    inst.watch(rule)
    states = [seed]
    with inst.step(step):
        for _ in range(n):
            states.append(rule(states[-1]))
    inst.close()
    return states


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a loopback port, in a process group of its own (SIGSTOP reaches its workers)."""
    root = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'store.db'}",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        yield uri, server
    finally:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(server.pid, sig)
            except ProcessLookupError:
                pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
