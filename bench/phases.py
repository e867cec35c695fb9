"""`make bench-phases`: where the NCA's logging step spends the training thread's time, phase by phase.

A ratio says how much a logging step costs; this says where. It drives the bench's NCA (eager, watched with
hooks, IterationStats + UpdateNorm, ``overhead_budget=None``) through bare steps and logging steps with a sink
and with a real TensorBoard backend, interleaved, and reports for each the median CPU time of the training
thread (``time.thread_time``) in each phase of the step:

* ``begin``: entering ``inst.step`` (hooks attached, observers reset);
* ``forward``: the rollout's iterations (on a logging step, the hooks and the observers' ``observe``);
* ``backward+opt``: ``loss.backward()`` and the optimizer step;
* ``log_metrics``: one ``inst.logger.log_metrics`` of the loss;
* ``end``: leaving ``inst.step`` (the observers' ``log``, their batched reductions, and the commit).

``wall`` is the whole step's wall time, with no sync: on a GPU the thread's CPU time is what a logging step
adds to a host-bound step, and ``wall`` minus ``total`` is what the thread spends waiting (for the GPU, or for
autograd's device thread), time that work moved off the training thread could use. The device is
``INSTRUMENT_BENCH_DEVICE`` (default ``cpu``); ``--hostbound`` takes `bench.hostbound`'s tiny NCA instead.

Usage: ``python -m bench.phases [--reps N] [--hostbound]``; writes bench/results/phases.{json,md}.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

import instrument
from bench import workloads
from bench.report import setup_line

__all__ = ["PHASES", "main", "measure"]

PHASES = ("begin", "forward", "backward+opt", "log_metrics", "end", "total", "wall")
KINDS = ("bare", "log", "log-tb")
RESULTS = Path(__file__).parent / "results"


def measure(reps: int, warmup: int, tmp: str) -> Dict[str, Dict[str, List[float]]]:
    """Per kind, per phase: the seconds of each timed step (``reps`` rounds of one step of each kind)."""
    from instrument.demos.nca import run_iterations

    rule, seed, target = workloads._nca_parts()
    n_iter = workloads.NCA_SIZE["n_iter"]
    opt = torch.optim.Adam(rule.parameters(), lr=1e-4)
    sessions = {}
    sync = torch.cuda.synchronize if workloads.device().type == "cuda" else (lambda: None)
    clock = time.thread_time
    times: Dict[str, Dict[str, List[float]]] = {kind: {phase: [] for phase in PHASES} for kind in KINDS}
    step = 1
    try:  # from the first session made: one that fails to open or watch closes those before it
        for kind in KINDS[1:]:
            backend = instrument.TensorBoardBackend() if kind == "log-tb" else workloads.SinkBackend()
            sessions[kind] = workloads.opened(instrument.Instrumentation(
                observers=workloads.make_observers(workloads.OBSERVERS, "nca"), backends=[backend], log_interval=1,
                run_name=None, log_dir=tmp, overhead_budget=None,
            ))
            sessions[kind].watch(rule)
        for rep in range(warmup + reps):
            for kind in KINDS:
                step += 1
                inst = sessions.get(kind)
                wall, t0 = time.perf_counter(), clock()
                scope = inst.step(step) if inst is not None else None
                if scope is not None:
                    scope.__enter__()
                t1 = clock()
                x = run_iterations(rule, seed, n_iter)
                t2 = clock()
                loss = F.mse_loss(x[:, :4], target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                t3 = clock()
                if inst is not None:
                    inst.logger.log_metrics({"loss": loss.detach()}, step=step, prefix="train")
                t4 = clock()
                if scope is not None:
                    scope.__exit__(None, None, None)
                t5, wall = clock(), time.perf_counter() - wall
                sync()  # untimed: the next step starts with an idle device and an empty writer queue
                if inst is not None:
                    inst.logger.flush()
                if rep >= warmup:
                    spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0, wall)
                    for phase, seconds in zip(PHASES, spans, strict=True):
                        times[kind][phase].append(seconds)
    finally:
        workloads.close_sessions()
    return times


def markdown(medians: Dict[str, Dict[str, float]], reps: int) -> str:
    lines = [
        "# instrument: the NCA's logging step by phase (training thread's CPU time, median ms)",
        "",
        f"{setup_line(reps).replace(' repetitions per group', ' rounds of one step of each kind')} NCA "
        f"{workloads.NCA_SIZE}, IterationStats + UpdateNorm, hooks, "
        "`overhead_budget=None`. `wall`: the whole step's wall time, no sync.",
        "",
        "| kind | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for kind, row in medians.items():
        lines.append(f"| `{kind}` | " + " | ".join(f"{row[phase]:.3f}" for phase in PHASES) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="timed rounds, one step of each kind (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default 10)")
    parser.add_argument("--hostbound", action="store_true", help="bench.hostbound's tiny NCA")
    args = parser.parse_args(argv)
    saved = dict(workloads.NCA_SIZE)
    if args.hostbound:
        from bench.hostbound import SIZES

        workloads.NCA_SIZE.update(SIZES["nca"])
    try:
        with tempfile.TemporaryDirectory(prefix="instrument-phases-") as tmp:
            times = measure(args.reps, args.warmup, tmp)
        medians = {kind: {phase: statistics.median(v) * 1e3 for phase, v in row.items()}
                   for kind, row in times.items()}
        text = markdown(medians, args.reps)
    finally:
        workloads.NCA_SIZE.update(saved)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "phases.json").write_text(json.dumps({"reps": args.reps, "ms": medians}, indent=1))
    (RESULTS / "phases.md").write_text(text)
    print(text, end="")
    print(f"written: {RESULTS / 'phases.json'} and {RESULTS / 'phases.md'}")
    return medians


if __name__ == "__main__":
    main()
