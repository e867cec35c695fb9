"""Ctrl-C (KeyboardInterrupt) landing at the edges of a logging step, in a process that goes on (a notebook).

A signal is delivered between any two bytecodes, so each test raises KeyboardInterrupt once at one such spot (a
review found each with real timer interrupts) and then trains on: the session stays usable, no hook is left
on the user's module, and every completed step's values are written, read back from the JSONL file."""

import json
import logging

import pytest
import torch
from torch import nn

import instrument
import instrument.logger.steps as staging
from instrument import IterationStats, JsonlBackend
from instrument.core.overhead import OverheadMeter


class Rule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + 0.1 * self.lin(x)


def interrupt_once(owner, name, monkeypatch):
    """``owner.name`` raises KeyboardInterrupt at its next call, then is itself again."""
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(owner, name, original)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


def written(tmp_path):
    with open(tmp_path / "r" / "metrics.jsonl") as f:
        return [(row["step"], row["metrics"].get("loss")) for row in map(json.loads, f) if "step" in row]


def train(inst, model, steps, arm=None, at=None):
    """Each step logs loss = its step number; ``arm()`` runs at the start of step ``at``. Returns the steps a
    KeyboardInterrupt ended."""
    interrupted = []
    for k in steps:
        try:
            with inst.step(k):
                if k == at and arm is not None:
                    arm()
                model(torch.randn(2, 4))
                inst.log({"loss": float(k)})
        except KeyboardInterrupt:
            interrupted.append(k)
    return interrupted


def session(tmp_path, log_interval, **options):
    return instrument.Instrumentation(observers=[IterationStats(images=False)], backends=[JsonlBackend()],
                                      log_interval=log_interval, log_dir=str(tmp_path), run_name="r", **options)


def test_an_interrupt_between_the_two_hooks_of_an_attach_leaves_no_hook(tmp_path, monkeypatch):
    """The pre-hook stayed on the module for good, after close too, holding every input it was ever called with."""
    model = Rule()
    inst = session(tmp_path, log_interval=2)
    inst.watch(model)
    interrupt_once(model, "register_forward_hook", monkeypatch)  # right after the pre-hook was registered
    assert train(inst, model, [0]) == [0]
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert train(inst, model, range(1, 5)) == []
    inst.close()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert written(tmp_path) == [(2, 1.5), (4, 3.5)]


@pytest.mark.parametrize("where", ["begun", "ending"])
def test_an_interrupt_at_a_step_s_start_or_end_leaves_the_session_usable(tmp_path, monkeypatch, where):
    """The step stayed open: every later step raised 'steps do not nest', the hooks ran in every non-logging
    step, and close() wrote later steps' values under the interrupted one."""
    model = Rule()
    calls = []
    inst = session(tmp_path, log_interval=2, overhead_budget=0.5)
    inst.watch(model)
    inst.add_component(type("Count", (), {"log": lambda self, logger, step: calls.append(step)})())
    interrupt_once(OverheadMeter, where, monkeypatch)  # at step 0's start, or its end
    assert train(inst, model, range(10)) == [0]
    assert not model._forward_pre_hooks and not model._forward_hooks
    inst.close()
    assert inst._current is None and inst.failures == {}
    # step 0 failed (its loss is dropped); 2, 4, 6, 8 are means over their intervals, 9 is close()'s commit
    assert written(tmp_path) == [(2, 1.5), (4, 3.5), (6, 5.5), (8, 7.5), (9, 9.0)]
    assert calls == [2, 4, 6, 8]


@pytest.mark.parametrize("where", ["handover", "submit"])
def test_an_interrupted_commit_keeps_the_interval_s_earlier_values_and_the_step_free(tmp_path, monkeypatch, caplog,
                                                                                    where):
    """Ctrl-C while the commit hands the step over (the transfer starting, or waiting for room in the queue)
    lost the values of the interval's completed steps silently, and a re-run of the step was then warned about
    as 'committed a second time' although nothing of it was written."""
    model = Rule()
    inst = session(tmp_path, log_interval=3)
    inst.watch(model)

    def arm():
        if where == "handover":
            interrupt_once(staging, "handover", monkeypatch)
        else:
            interrupt_once(inst.logger._writer, "submit", monkeypatch)

    with caplog.at_level(logging.WARNING, logger="instrument"):
        assert train(inst, model, range(7), arm=arm, at=3) == [3]
        assert train(inst, model, range(7, 10)) == []
    inst.close()
    # steps 1 and 2 go into step 6's mean with 4, 5 and 6; step 3's own value is lost with it, and said
    assert written(tmp_path) == [(0, 0.0), (6, 3.6), (9, 8.0)]
    said = [r.getMessage() for r in caplog.records]
    assert any("the commit of step 3 was interrupted (KeyboardInterrupt)" in m and "not written" in m
               for m in said), said
    assert not any("committed a second time" in m for m in said)


def test_a_step_whose_commit_was_interrupted_can_be_run_again(tmp_path, monkeypatch, caplog):
    model = Rule()
    inst = session(tmp_path, log_interval=1)
    inst.watch(model)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        assert train(inst, model, range(4), arm=lambda: interrupt_once(staging, "handover", monkeypatch), at=3) == [3]
        assert train(inst, model, range(3, 6)) == []  # the cell run again from step 3
    inst.close()
    assert written(tmp_path) == [(k, float(k)) for k in range(6)]
    assert not any("committed a second time" in r.getMessage() for r in caplog.records)


def test_values_given_back_by_an_interrupted_commit_are_written_by_close(tmp_path, monkeypatch):
    """The given-back values lost their step, so close()'s commit, which writes at the pending step, wrote none."""
    model = Rule()
    inst = session(tmp_path, log_interval=2)
    inst.watch(model)
    assert train(inst, model, range(3), arm=lambda: interrupt_once(staging, "handover", monkeypatch), at=2) == [2]
    inst.close()
    assert written(tmp_path) == [(0, 0.0), (1, 1.0)]  # step 1's value, at its step; step 2's own is lost, said
