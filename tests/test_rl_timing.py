"""Which clock times each RL stage: the host stages (collection, evaluation, iteration) in wall time on every
device, optimisation on the logger's default (CUDA events once CUDA is initialised). With the default, a host
stage on a GPU run was timed by CUDA events: the GPU's queue, not the environment steps."""

import json

import pytest
import torch
from torch import nn

import instrument
from instrument.logger.timer import timing_stats
from instrument.rl import CollectionMetrics, Evaluation, GymnasiumRunner, RLLogging
from instrument.rl.timing import stage_timer

HOST = ("collection", "evaluation", "iteration")


def run(tmp_path, device: str = "cpu"):
    """Two iterations with an evaluation due at the first; the session, the set and what JSONL holds."""
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=tmp_path)
    torch.manual_seed(0)
    runner = GymnasiumRunner("CartPole-v1", nn.Linear(4, 2).to(device), seed=0)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None,
                   evaluation=Evaluation(every_frames=1, max_steps=10, at_start=True)).attach(inst, eval_runner=runner)
    for k in range(2):
        with inst.step(k), rl.iteration():
            with rl.timer("collection"):
                reward = torch.ones(4, 2, device=device)
            rl.observe_batch(reward=reward, done=torch.zeros(4, 2, dtype=torch.bool, device=device))
            with rl.timer("optimization"):
                loss = (reward * 2).sum()
            rl.observe_losses({"loss": loss})
    return inst, rl, path


def test_host_stages_are_wall_time_timers_whatever_the_device(tmp_path):
    """The timers the set's stages make (``rl.timer``, the clock's, the evaluation's) are host timers
    (``cuda=False``), not left to decide by whether CUDA is initialised; optimisation keeps the default."""
    inst, rl, path = run(tmp_path)
    logger = rl.logger
    try:
        for stage in HOST:
            assert logger.timer(stage).cuda is False, stage
            assert rl.timer(stage) is logger.timer(stage)
        assert logger.timer("optimization").cuda is None  # GPU work: CUDA events on a GPU
        rl.clock.start("collection")  # as the TorchRL hook times it
        rl.clock.stop("collection")
        assert logger.timer("collection").cuda is False
    finally:
        rl.close()
        inst.close()
    logged = [json.loads(line)["metrics"] for line in path.read_text().splitlines() if "metrics" in line]
    assert [m["timing/evaluation/count"] for m in logged] == [1.0, 1.0]
    assert all(m[f"timing/{stage}/count"] >= 1.0 for m in logged for stage in ("collection", "iteration"))


@pytest.mark.cuda
def test_on_a_gpu_host_stages_measure_wall_time_and_optimisation_records_cuda_events(tmp_path):
    torch.zeros(1, device="cuda")  # CUDA initialised: a timer left at its default records events from here on
    inst, rl, path = run(tmp_path, device="cuda")
    logger = rl.logger
    try:
        with rl.timer("collection"):
            pass
        with rl.timer("optimization"):
            torch.ones(64, 64, device="cuda").matmul(torch.ones(64, 64, device="cuda"))
        rl.clock.start("iteration")
        rl.clock.stop("iteration")
        for stage in ("collection", "iteration"):
            _, seconds, events = logger.timer(stage).take()
            assert len(seconds) == 1 and events == [], stage
        _, seconds, events = logger.timer("optimization").take()
        assert seconds == [] and len(events) == 1
        # an evaluation's episodes, on a logger of its own (nothing staged in the session's)
        evaluation = Evaluation(every_frames=1, max_steps=10, at_start=True,
                                runner=GymnasiumRunner("CartPole-v1", nn.Linear(4, 2).cuda(), seed=0))
        bare = instrument.Logger([])
        assert evaluation.end_iteration(rl.counters)
        evaluation.log(bare, 0)
        _, seconds, events = bare.timer("evaluation").take()
        assert len(seconds) == 1 and events == []
        evaluation.close()
        bare.close()
    finally:
        rl.close()
        inst.close()
    logged = [json.loads(line)["metrics"] for line in path.read_text().splitlines() if "metrics" in line]
    assert all(m[f"timing/{stage}/count"] >= 1.0 for m in logged[:2] for stage in ("collection", "evaluation"))


def test_a_restarted_or_cancelled_stage_leaves_no_open_span(tmp_path, monkeypatch):
    """`StageClock.start` on a running stage and `cancel_all` cancel the timer's open span: they only dropped
    the clock's reference, and the timer's per-thread stack kept every start (a CUDA event on a GPU), one per
    restart and per failed iteration. The span measured after a restart runs from the last start."""
    from instrument.logger import timer as timer_module
    from instrument.rl import StageClock

    now = [0.0]
    monkeypatch.setattr(timer_module, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: now[0])}))
    logger = instrument.Logger([])
    clock = StageClock(logger)
    try:
        for _ in range(1000):
            clock.start("collection")
            now[0] += 100.0  # the abandoned start: not in the span measured below
            clock.start("collection")
        now[0] += 2.0
        clock.stop("collection")
        timer = stage_timer(logger, "collection")
        assert timer._starts() == []
        assert timing_stats(timer.take()) == {"mean": 2.0, "min": 2.0, "max": 2.0, "count": 1.0}
        clock.start("evaluation")
        clock.start("optimization")
        clock.cancel_all()
        assert not clock.running("evaluation") and not clock.running("optimization")
        for stage in ("evaluation", "optimization"):
            assert stage_timer(logger, stage)._starts() == [], stage
            assert stage_timer(logger, stage).count == 0, stage
        with stage_timer(logger, "evaluation"):  # entered by hand around the clock's: only the clock's is cancelled
            clock.start("evaluation")
            clock.cancel_all()
            assert len(stage_timer(logger, "evaluation")._starts()) == 1
            now[0] += 3.0
        assert timing_stats(stage_timer(logger, "evaluation").take())["max"] == 3.0
    finally:
        logger.close()


def test_failed_iterations_leave_no_open_spans(tmp_path):
    """`RLLogging.iteration` cancels the running stages of a failed iteration: their timers' stacks stay empty
    however many iterations fail, and the next iteration's timing counts its own span alone."""
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=tmp_path)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    try:
        for _ in range(200):
            with pytest.raises(RuntimeError), inst.step(rl.step), rl.iteration():
                rl.clock.start("optimization")
                raise RuntimeError("failed iteration")
        for stage in ("iteration", "optimization"):
            assert rl.logger.timer(stage)._starts() == [], stage
        with inst.step(rl.step), rl.iteration():
            rl.clock.start("optimization")
            rl.clock.stop("optimization")
    finally:
        rl.close()
        inst.close()
    logged = [json.loads(line)["metrics"] for line in path.read_text().splitlines() if "metrics" in line]
    assert logged[-1]["timing/iteration/count"] == 1.0 and logged[-1]["timing/optimization/count"] == 1.0
