"""Probes placed where no observer can see them, or around something that is not a tensor: said, never silent.
(Found by a review: a readout head's probe lost every value unsaid; a probe around an LSTM's tuple raised a raw
1,800-character schema error from inside torch.)"""

import logging

import pytest
import torch
from torch import nn

import instrument
from instrument.errors import ProbeError
from tests._probe_models import Rule


class Keep(instrument.Observer):
    def __init__(self) -> None:
        super().__init__("keep")
        self.reset()

    def reset(self) -> None:
        self.seen = []

    def observe(self, context) -> None:
        self.seen.append(sorted(context.probes))


class WithHead(nn.Module):
    """A rollout of the probed `Rule`, then a readout head with a probe of its own, called after the rollout."""

    def __init__(self) -> None:
        super().__init__()
        self.rule = Rule()
        self.head = nn.Conv2d(self.rule.fc1.out_channels, 2, 1)
        self.p_logits = instrument.Probe("logits")

    def forward(self, x):
        for _ in range(3):
            x = self.rule(x)
        return self.p_logits(self.head(x))


def test_probe_values_recorded_after_the_last_observer_call_are_said_once_per_probe(caplog):
    torch.manual_seed(0)
    model = WithHead()
    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], log_interval=1)
    inst.watch(model.rule)
    inst.watch(model, state=False)  # the head's probe is this session's too
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(3):
            with inst.step(step):
                model(torch.rand(2, model.rule.fc1.out_channels, 5, 5))
    inst.close()
    assert keep.seen == [["hidden", "update"]] * 3  # only the rule's probes reached an observer
    said = [r.getMessage() for r in caplog.records if "after its last observer call" in r.getMessage()]
    assert len(said) == 1 and "'logits'" in said[0] and "'hidden'" not in said[0], said


class Recurrent(nn.Module):
    def __init__(self, wrong: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.probe = instrument.Probe("lstm_out")
        self.wrong = wrong

    def forward(self, x):
        out = self.lstm(x)
        if self.wrong:
            return self.probe(out)[0]
        return self.probe(out[0])


@pytest.mark.parametrize("wrong", [True, False])
def test_a_probe_around_a_tuple_says_which_probe_and_what_to_do(wrong):
    torch.manual_seed(0)
    model = Recurrent(wrong)
    inst = instrument.Instrumentation(observers=[Keep()], log_interval=2)
    inst.watch(model, state=False)
    x = torch.rand(2, 5, 3)
    with inst.step(1):  # a non-logging step: the probe is off, an identity
        model(x)
    if wrong:
        with pytest.raises(ProbeError, match=r"Probe 'lstm_out' records a Tensor, got tuple"), inst.step(2):
            model(x)
    else:
        with inst.step(2) as s:
            out = model(x)
            s.observer(instrument.StepContext(x, x))
        assert out.shape == (2, 5, 4)
    inst.close()
