"""Session misuse a review found mishandled: close() inside an open logging block, a backwards step refused only
after its body and observers ran (and blamed on an observer), a probe-only watch of a model without probes,
calls after close, a checkpoint step given as a NumPy int, and a logging step entered again under the "warn"
policy. Read back from JSONL."""

import json
import logging

import numpy as np
import pytest
import torch

import instrument
from instrument.errors import ConfigurationError, StepOrderError


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if '"step"' in x]


def _session(tmp_path, **kwargs):
    return instrument.Instrumentation(observers=[instrument.IterationStats(images=False)],
                                      backends=[instrument.JsonlBackend()], log_dir=str(tmp_path), run_name="r",
                                      **kwargs)


def _rollout(s, n=3):
    x = torch.zeros(2, 3, 4, 4)
    for i in range(n):
        y = x + 1
        if s.observer is not None:
            s.observer(instrument.StepContext(x, y, step_index=i))
        x = y


def test_close_inside_a_logging_block_ends_that_step_whole(tmp_path):
    inst = _session(tmp_path, log_interval=2)
    for step in range(10):
        with inst.step(step) as s:
            _rollout(s)
            inst.log({"loss": float(step)})
            if step == 4:
                inst.close()  # an early stop
                break
    assert inst.failures == {}
    rows = _rows(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert rows[-1]["metrics"]["loss"] == 3.5  # steps 3 and 4
    assert rows[-1]["metrics"]["iteration_stats/iterations"] == 3  # the observers ran for it


def test_a_backwards_step_is_refused_before_its_body_runs(tmp_path):
    inst = _session(tmp_path, log_interval=1)
    ran = []
    with inst.step(10) as s:
        _rollout(s)
    with pytest.raises(StepOrderError, match="step 8 is lower than step 10"):
        with inst.step(8) as s:
            ran.append(8)
    assert ran == [] and inst.failures == {}
    with inst.step(11) as s:
        _rollout(s)
    inst.close()
    assert [r["step"] for r in _rows(tmp_path / "r" / "metrics.jsonl")] == [10, 11]


def test_watch_and_load_state_dict_are_checked(tmp_path):
    inst = _session(tmp_path)
    with pytest.raises(ConfigurationError, match=r"state=False\) would observe nothing"):
        inst.watch(torch.nn.Linear(2, 2), state=False)
    with pytest.raises(ConfigurationError, match=r"watch\(state=...\) takes True, False or None, got 'yes'"):
        inst.watch(torch.nn.Linear(2, 2), state="yes")
    with inst.step(0):
        pass
    inst.load_state_dict({"version": 1, "run_name": "r", "last_step": np.int64(5), "config_logged": True})
    inst.close()
    with pytest.raises(ConfigurationError, match="closed, so load_state_dict"):
        inst.load_state_dict({"version": 1, "run_name": "r", "last_step": 5, "config_logged": True})


def test_a_logging_step_entered_again_under_the_warn_policy_is_written_again_with_a_warning(tmp_path, caplog):
    inst = _session(tmp_path, log_interval=1, on_step_regression="warn")
    scope = inst.step(3)
    with scope:
        inst.log({"loss": 1.0})
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with scope:
            inst.log({"loss": 2.0})
    inst.close()
    assert [(r["step"], r["metrics"]["loss"]) for r in _rows(tmp_path / "r" / "metrics.jsonl")] == [(3, 1.0), (3, 2.0)]
    assert any("second time" in r.getMessage() for r in caplog.records)


def test_close_from_another_thread_while_a_logging_block_runs_leaves_the_block_to_end_quietly(tmp_path):
    """Another thread's close (a watchdog, a notebook's stop) must not run this block's observers under it: the
    block's hooks go off, its exit commits nothing and counts no failure."""
    import threading

    inst = _session(tmp_path, log_interval=1)
    with inst.step(0) as s:
        _rollout(s)
    with inst.step(1) as s:
        _rollout(s, n=2)
        closer = threading.Thread(target=inst.close)
        closer.start()
        closer.join()
        _rollout(s, n=1)  # hooks and observers are off now: nothing observed, nothing raised
    assert inst.failures == {}
    assert [r["step"] for r in _rows(tmp_path / "r" / "metrics.jsonl")] == [0]
