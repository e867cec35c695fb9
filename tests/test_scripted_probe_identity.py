"""A probe inside a ScriptModule watched twice by one session (a model, and the scripted rule inside it) is one
probe, as it is for an eager model: ``watch`` refused it as "the same name as a probe of already watched" model,
since each watch sees a scripted probe through a wrapper of its own, and unwatching one of the two mid-step
turned the probe off for the other."""

import pytest
import torch
from torch import nn

import instrument


class Keep(instrument.Observer):
    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def reset(self) -> None:
        pass

    def observe(self, context) -> None:
        self.seen.append((context.step_index, {name: value.clone() for name, value in context.probes.items()}))

    def log(self, logger, step) -> None:
        pass


class Rule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p = instrument.Probe("h")

    def forward(self, x):
        return x + self.p(self.lin(x)).tanh()


class Model(nn.Module):
    def __init__(self, rule: nn.Module) -> None:
        super().__init__()
        self.rule = rule

    def forward(self, x):
        for _ in range(3):
            x = self.rule(x)
        return x


@pytest.mark.parametrize("how", ["eager", "scripted_rule", "scripted_model"])
def test_a_scripted_probe_watched_through_a_model_and_its_rule_is_one_probe(how):
    torch.manual_seed(0)
    model = Model(Rule() if how == "eager" else instrument.script(Rule()))
    if how == "scripted_model":
        model = instrument.script(model)
    keep = Keep()
    inst = instrument.Instrumentation([keep], backends=[], log_interval=1)
    whole = inst.watch(model, state=False)  # refused for the scripted ones: "the same name as a probe of ..."
    inst.watch(model.rule)
    x = torch.randn(2, 4)
    with torch.no_grad(), inst.step(0):
        y = model.rule(x)
        whole.remove()  # the rule's watch still holds the probe on for the rest of the step
        model.rule(y)
    inst.close()
    assert [index for index, _ in keep.seen] == [0, 1]
    assert all(set(probes) == {"h"} for _, probes in keep.seen)
    with torch.no_grad():
        torch.testing.assert_close(keep.seen[1][1]["h"], model.rule.lin(y), rtol=0, atol=0)
    assert not model.rule.p.enabled
