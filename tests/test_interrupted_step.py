"""A logging step cut short after its body (Ctrl-C while observers log or detach) is a failed step: it leaves no
staged value behind, no hook, no probe switched on and no recorder installed, in this session or the next.

Ctrl-C is a real SIGINT delivered to this process while an observer's ``detach`` waits, or a
``KeyboardInterrupt`` raised where it lands (an observer's ``log``); read back from the JSONL file.
"""

import json
import os
import signal
import threading

import pytest
import torch
from torch import nn

import instrument
from instrument.probes import record


class Rule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.probe = instrument.Probe("hidden")

    def forward(self, x):
        return x + self.probe(self.conv(x))


class InterruptOnce(instrument.Observer):
    """Raises KeyboardInterrupt in ``log`` (or ``detach``) at its first logging step, as Ctrl-C landing there."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.armed = where, True

    def observe(self, context):
        pass

    def _interrupt(self, where: str) -> None:
        if self.where == where and self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def log(self, logger, step):
        self._interrupt("log")

    def detach(self):
        self._interrupt("detach")


class WaitsInDetach(instrument.Observer):
    """Its ``detach`` waits until a real SIGINT has been delivered to the process."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.armed = True

    def observe(self, context):
        pass

    def log(self, logger, step):
        pass

    def detach(self):
        if self.armed:
            self.armed = False
            self.entered.set()
            threading.Event().wait(60.0)  # the SIGINT's KeyboardInterrupt ends the wait


def _steps(path):
    return {line["step"]: line for line in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("where", ["log", "detach"])
def test_a_step_interrupted_after_its_body_leaves_nothing_staged_for_the_next_step(tmp_path, where):
    rule, x = Rule(), torch.randn(2, 4, 3, 3)
    inst = instrument.Instrumentation(observers=[instrument.UpdateNorm(), InterruptOnce(where)],
                                      backends=[instrument.JsonlBackend()], log_interval=10,
                                      log_dir=str(tmp_path), overhead_budget=None)
    inst.watch(rule)
    with pytest.raises(KeyboardInterrupt):
        with inst.step(0):
            rule(rule(x))
            inst.log({"loss": 111.0, "only_in_step_0": 1.0})
    for step in range(1, 11):
        with inst.step(step):
            if step == 10:
                rule(rule(rule(x)))  # three iterations at the logging step
            inst.log({"loss": 222.0})
    inst.close()
    steps = _steps(inst.run.dir / "metrics.jsonl")
    assert sorted(steps) == [10]
    metrics = steps[10]["metrics"]
    assert metrics["loss"] == 222.0 and "only_in_step_0" not in metrics  # step 0's values were 111 and 1.0
    assert steps[10]["histograms"]["update_norm/l2"]["count"] == 3  # this step's iterations only


def test_ctrl_c_while_an_observer_detaches_still_switches_probes_and_hooks_off(tmp_path):
    rule, x = Rule(), torch.randn(2, 4, 3, 3)
    hooks_before = (dict(rule._forward_hooks), dict(rule._forward_pre_hooks))
    waits = WaitsInDetach()
    inst = instrument.Instrumentation(observers=[instrument.IterationStats(), waits], backends=[],
                                      log_interval=1, log_dir=str(tmp_path))
    inst.watch(rule)
    threading.Thread(target=lambda: waits.entered.wait(60.0) and os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        with inst:
            with inst.step(0):
                rule(rule(x))
    assert not rule.probe.enabled and "forward" not in rule.__dict__
    assert (dict(rule._forward_hooks), dict(rule._forward_pre_hooks)) == hooks_before
    assert record.active_recorder() is None

    # the next session on the same model (a notebook cell run again) logs its probes
    seen = []
    again = instrument.Instrumentation(observers=[lambda c: seen.append(sorted(c.probes))], backends=[],
                                       log_interval=1, log_dir=str(tmp_path / "again"))
    again.watch(rule)
    with again.step(0):
        rule(rule(x))
    again.close()
    assert seen == [["hidden"], ["hidden"]]


def test_a_session_dropped_without_close_is_said_when_the_next_one_starts(tmp_path, caplog):
    import gc
    import logging

    def session(name):
        return instrument.Instrumentation(observers=[], backends=[instrument.JsonlBackend()], log_dir=str(tmp_path),
                                          run_name=name)

    first = session("first")
    kept = first.logger  # its writer thread holds it, as it holds a dropped session's logger
    del first
    gc.collect()
    with caplog.at_level(logging.WARNING, logger="instrument"):
        second = session("second")
        second.close()
        session("third").close()  # the first was said once; the second was closed
    said = [r.getMessage() for r in caplog.records if "dropped without close()" in r.getMessage()]
    assert len(said) == 1 and "1 earlier Instrumentation session(s)" in said[0], said
    assert str(tmp_path / "first") in said[0]
    kept.close()


def test_resuming_the_run_of_a_dropped_session_says_it_cannot_be_closed_and_what_to_do(tmp_path):
    """The refusal told a notebook user to close a session whose object was gone (a review): nothing can close it."""
    import gc

    from instrument.errors import ConfigurationError

    def session(**kw):
        return instrument.Instrumentation(observers=[], backends=[instrument.JsonlBackend()], log_dir=str(tmp_path),
                                          run_name="nb", **kw)

    first = session()
    kept = first.logger
    del first
    gc.collect()
    for attempt in range(2):  # before and after the next session said the drop
        with pytest.raises(ConfigurationError) as refused:
            session(resume=True)
        message = str(refused.value)
        assert "dropped without close()" in message and "nothing can close it now" in message, message
        assert "Choose another run_name, or restart the process" in message
        assert "Close it (inst.close()" not in message
        if not attempt:
            instrument.Instrumentation(observers=[], backends=[], log_dir=str(tmp_path), run_name="other").close()
    kept.close()  # its steps written, as at exit
