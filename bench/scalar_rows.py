"""Rows ``scalars/x100/<kind>``: the training thread's time per logging step of 100 scalars.

Each call of a row is one logging step: 100 metrics, new values every step, handed over on the calling
thread. Only those calls are timed; the row's ``settle`` (``flush``, untimed) then waits until whatever a
background thread still has to do for that step is done, so a writer thread's work is never charged to the
next row, and a queue never fills across calls. With ``INSTRUMENT_BENCH_CLOCK=cpu`` these rows take the
calling thread's CPU time (`time.thread_time`), never the process's, for the same reason.

Kinds (baseline: ``summarywriter``, the cost of calling TensorBoard yourself):

- ``summarywriter``: ``SummaryWriter.add_scalar`` x100 on the caller's thread (torch's writer serialises
  each event there and hands it to its own writer thread through a queue of 10).
- ``tb+jsonl+console``: ``Logger.log_metrics`` (100 Python floats) + ``commit`` with a real
  `TensorBoardBackend`, `JsonlBackend` and `ConsoleBackend` (printing to ``os.devnull``).
- ``tb+jsonl+console[tensor]``: the same with 100 0-d CPU tensors (they go through the batched transfer).
- ``wandb-offline``: ``wandb.log`` of a dict of 100 floats in offline mode (``WANDB_MODE=offline``), timed
  in the W&B peers' own group with its ``summarywriter`` baseline (`bench.peers.WANDB_GROUP`).
- ``staging``: ``Logger.log_metrics`` + ``commit`` of 100 floats with no backend at all.

Each row's ``prepare`` (untimed, right before each call) makes that step's 100 values, as a training loop
computes what it logs just before logging it; they differ from step to step, so no backend can skip work.
"""

import contextlib
import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from bench.harness import Variant
from instrument import ConsoleBackend, JsonlBackend, Logger, RunInfo, TensorBoardBackend

__all__ = ["SCALAR_KEYS", "SCALAR_WORKLOAD", "scalar_variants", "finish_scalar_rows", "N_SCALARS"]

N_SCALARS = 100
SCALAR_WORKLOAD = "scalars"
BASELINE = "scalars/x100/summarywriter"
SCALAR_KINDS = ("summarywriter", "tb+jsonl+console", "tb+jsonl+console[tensor]", "wandb-offline", "staging")
SCALAR_KEYS = [f"scalars/x100/{kind}" for kind in SCALAR_KINDS]
KEYS = tuple(f"m{i:03d}" for i in range(N_SCALARS))  # the metric names, made once as a loop's literals are

_OPEN: List[Callable[[], object]] = []  # closers, run by finish_scalar_rows after the measurement


class _Steps:
    """Increasing step numbers, and each step's values made fresh right before the step is timed.

    A training loop logs values it has just computed, under keys written in its code (string constants), so
    the timed call finds them in the cache. `prepare` does that work untimed; the 100 values differ from step
    to step (a seeded generator), so no backend can skip work.
    """

    def __init__(self, tensors: bool = False) -> None:
        self.generator = torch.Generator().manual_seed(0)
        self.tensors = tensors
        self.step = 0
        self.values: Dict[str, object] = {}

    def prepare(self) -> None:
        row = torch.randn(N_SCALARS, generator=self.generator, dtype=torch.float64)
        if self.tensors:  # 100 separate 0-d float32 tensors, as a loop's ``loss.detach()`` and the like
            self.values = {key: row[i].float() for i, key in enumerate(KEYS)}
        else:
            self.values = dict(zip(KEYS, row.tolist(), strict=True))
        self.step += 1


def _flush_of(obj) -> Optional[Callable[[], object]]:
    return getattr(obj, "flush", None)


def _summarywriter(tmp: Path) -> Variant:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp / "summarywriter"))
    _OPEN.append(writer.close)
    steps = _Steps()

    def fn() -> None:
        step = steps.step
        for key, value in steps.values.items():
            writer.add_scalar("train/" + key, value, step)

    return Variant(
        key=BASELINE,
        baseline=BASELINE,
        fn=fn,
        settle=writer.flush,
        prepare=steps.prepare,
        thread_clock=True,
        describe="SummaryWriter.add_scalar x100 on the caller's thread (default queue of 10)",
    )


def _logger(key: str, tmp: Path, backends: Sequence, tensors: bool, describe: str) -> Variant:
    name = key.rsplit("/", 1)[1].replace("+", "-").replace("[", "-").rstrip("]")
    logger = Logger(list(backends), RunInfo(name=name, root=tmp))
    _OPEN.append(logger.close)
    steps = _Steps(tensors)
    flush = _flush_of(logger)

    def fn() -> None:
        step = steps.step
        logger.log_metrics(steps.values, step=step, prefix="train")
        logger.commit(step)

    check = None
    jsonl = next((b for b in backends if isinstance(b, JsonlBackend)), None)
    if jsonl is not None:

        def check() -> Optional[str]:
            # Time what the name says: after the warm-up, the last step is in the JSONL file with 100 metrics.
            if flush is not None:
                flush()
            with contextlib.suppress(OSError, ValueError, IndexError):
                last = json.loads(Path(jsonl.path).read_text().splitlines()[-1])
                if last.get("step") == steps.step and len(last.get("metrics", {})) == N_SCALARS:
                    return None
            return (
                f"pending: after warm-up, {jsonl.path} does not end with step {steps.step} and "
                f"{N_SCALARS} metrics (the Logger API differs from bench/scalar_rows.py; update the row)"
            )

    if flush is None:
        describe += "; commit is synchronous (no Logger.flush)"
    return Variant(key=key, baseline=BASELINE, fn=fn, settle=flush, check=check, thread_clock=True,
                   prepare=steps.prepare, describe=describe)


def _wandb_offline(tmp: Path) -> Variant:
    from bench.peers import WANDB_GROUP, wandb_run

    run, problem = wandb_run(str(tmp))
    key = "scalars/x100/wandb-offline"
    if run is None:
        return Variant(key=key, baseline=BASELINE, pending=problem, group=WANDB_GROUP)
    steps = _Steps()

    def fn() -> None:
        run.log({"scalars/" + k: v for k, v in steps.values.items()})

    # wandb has no public flush: its service process writes the offline run; that CPU is not this process's.
    return Variant(key=key, baseline=BASELINE, fn=fn, thread_clock=True, prepare=steps.prepare, group=WANDB_GROUP,
                   describe="wandb.log(dict of 100 floats), offline, on the caller's thread")


def scalar_variants(wanted: Callable[[str], bool], tmp: str) -> List[Variant]:
    """The selected ``scalars/x100/*`` rows plus their baseline."""
    if not any(wanted(key) for key in SCALAR_KEYS):
        return []
    root = Path(tmp) / "scalars"
    root.mkdir(parents=True, exist_ok=True)
    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed by finish_scalar_rows, after the loggers
    _OPEN.append(devnull.close)
    out = [_summarywriter(root)]

    def three() -> List:
        return [TensorBoardBackend(), JsonlBackend(), ConsoleBackend(stream=devnull)]

    for key in SCALAR_KEYS[1:]:
        if not wanted(key):
            continue
        kind = key.rsplit("/", 1)[1]
        if kind == "tb+jsonl+console":
            out.append(_logger(key, root, three(), False,
                               "Logger.log_metrics(100 floats) + commit -> TensorBoard + JSONL + console"))
        elif kind == "tb+jsonl+console[tensor]":
            out.append(_logger(key, root, three(), True,
                               "the same with 100 0-d CPU tensors"))
        elif kind == "wandb-offline":
            out.append(_wandb_offline(root))
        elif kind == "staging":
            out.append(_logger(key, root, [], False, "Logger.log_metrics(100 floats) + commit, no backend"))
    return out


def finish_scalar_rows() -> None:
    """Flush and close every writer and logger these rows opened (after the measurement, untimed)."""
    while _OPEN:
        close = _OPEN.pop()
        with contextlib.suppress(Exception):
            close()
