"""RLLogging's step and the session's open `inst.step(k)` block agree at every iteration, logging or not.

A review found two ways they drifted apart with nothing said but a repeat warning: a 1-based loop with
``log_interval > 1`` (the refusal checked logging blocks only, so step 0 was committed inside ``inst.step(1)`` and
every later logging step twice: W&B keeps only the first), and an iteration that raised inside its block (the
session used step k up, RLLogging did not, so it lagged by one for the rest of the run). Read back from JSONL."""

import json

import pytest
import torch

import instrument
from instrument.errors import ConfigurationError
from instrument.rl import CollectionMetrics, RLLogging


class SkipBatch(Exception):
    pass


def _session(tmp_path, log_interval):
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=log_interval,
                                      log_dir=str(tmp_path), run_name="r", overhead_budget=None)
    rl = RLLogging(progress=None, collection=CollectionMetrics(time_dim=0)).attach(inst)
    return inst, rl


def _batch(k):
    return {"reward": torch.full((4, 2), float(k)), "done": torch.zeros(4, 2, dtype=torch.bool)}


def _written(tmp_path):
    with open(tmp_path / "r" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [(row["step"], row["metrics"].get("counters/frames"), row["metrics"].get("counters/iterations"))
            for row in rows if "metrics" in row]


@pytest.mark.parametrize("log_interval", [1, 2, 10])
def test_a_1_based_loop_is_refused_at_its_first_iteration_whatever_the_interval(tmp_path, log_interval):
    inst, rl = _session(tmp_path, log_interval)
    with pytest.raises(ConfigurationError, match=r"inside `with inst\.step\(1\)`.*looks 1-based"):
        for it in range(1, 6):
            with inst.step(it), rl.iteration():
                rl.observe_batch(**_batch(it))
    rl.close()
    inst.close()
    steps = [step for step, _, _ in _written(tmp_path)]
    assert len(steps) == len(set(steps)), steps  # no step written twice


@pytest.mark.parametrize("log_interval", [1, 2])
def test_an_iteration_that_raised_in_its_block_uses_its_step_up(tmp_path, log_interval):
    inst, rl = _session(tmp_path, log_interval)
    for k in range(6):
        try:
            with inst.step(k), rl.iteration():
                rl.observe_batch(**_batch(k))
                if k == 2:
                    raise SkipBatch  # e.g. a NaN loss: the loop skips this update and goes on
        except SkipBatch:
            pass
    rl.close()
    inst.close()
    written = _written(tmp_path)
    steps = [step for step, _, _ in written]
    assert len(steps) == len(set(steps)) and 2 not in steps, written  # the failed step commits nothing
    logged = [k for k in range(6) if k % log_interval == 0 and k != 2]
    assert steps[:len(logged)] == logged
    # every step's counters are its own: frames of every batch up to it (8 a batch), iterations k + 1
    assert all(frames == 8.0 * (step + 1) and iterations == step + 1 for step, frames, iterations in written)


@pytest.mark.parametrize("log_interval", [1, 2])
def test_an_iteration_retried_at_its_own_step_is_not_refused(tmp_path, log_interval):
    """A loop that retries a failed iteration at the same step (after an OOM): the step is not used up."""
    inst, rl = _session(tmp_path, log_interval)
    failed = False
    for k in range(4):
        while True:
            try:
                with inst.step(k), rl.iteration():
                    rl.observe_batch(**_batch(k))
                    if k == 1 and not failed:
                        failed = True
                        raise SkipBatch
                break
            except SkipBatch:
                continue
    rl.close()
    inst.close()
    written = _written(tmp_path)
    assert [step for step, _, _ in written] == [k for k in range(4) if k % log_interval == 0 or k == 3]
    # the failed try's batch went with the retry: frames count it (8 a batch), iterations do not
    assert [(step, iterations) for step, _, iterations in written] == [(step, step + 1.0) for step, _, _ in written]
    assert written[-1][1] == 8.0 * 5


def test_rl_close_at_the_top_of_a_later_non_logging_block_writes_the_tail(tmp_path):
    """An early stop seen at the start of step 5 (log_interval 10): the iterations 1-4 are written at step 4."""
    inst, rl = _session(tmp_path, 10)
    for k in range(100):
        with inst.step(k):
            if k == 5:
                rl.close()
                break
            with rl.iteration():
                rl.observe_batch(**_batch(k))
    inst.close()
    assert [(step, iterations) for step, _, iterations in _written(tmp_path)] == [(0, 1.0), (4, 5.0)]


@pytest.mark.parametrize("log_interval", [1, 2])
def test_iterations_that_raise_in_a_row_each_use_their_step_up(tmp_path, log_interval):
    """Two failures in a row (steps 2 and 3): the second was taken for iteration 2 again, so the next iteration,
    inside `inst.step(4)`, was refused as a 1-based loop and the run stopped."""
    inst, rl = _session(tmp_path, log_interval)
    steps_seen = []
    for k in range(7):
        try:
            with inst.step(k), rl.iteration():
                steps_seen.append(rl.step)
                rl.observe_batch(**_batch(k))
                if k in (2, 3, 4):
                    raise SkipBatch
        except SkipBatch:
            pass
    rl.close()
    inst.close()
    assert steps_seen == list(range(7))  # rl.step is the open block's in every iteration, failed ones too
    written = _written(tmp_path)
    assert [step for step, _, _ in written] == [k for k in range(7) if k % log_interval == 0 and k not in (2, 3, 4)]
    assert all(frames == 8.0 * (step + 1) and iterations == step + 1 for step, frames, iterations in written)


def test_a_frame_counted_iteration_in_a_block_is_told_to_drop_the_block(tmp_path):
    """The refusal's fix was `inst.step(rl.step)`, the very call that was refused: before the batch, rl.step is
    the frame count before it."""
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=1, log_dir=str(tmp_path),
                                      run_name="r", overhead_budget=None)
    rl = RLLogging(progress=None, collection=CollectionMetrics(time_dim=0), step_unit="frames").attach(inst)
    with pytest.raises(ConfigurationError) as refused:
        with inst.step(rl.step), rl.iteration():
            rl.observe_batch(**_batch(0))
    rl.close()
    inst.close()
    assert "drop the `with inst.step(...)` block" in str(refused.value)
    assert "or open it with `inst.step(rl.step)`" not in str(refused.value)
