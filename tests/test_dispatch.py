"""The dispatcher hands observers the recorded probe values without touching the caller's StepContext."""

import pytest
import torch

import instrument
from tests._probe_models import Model

N_ITER = 3


class KeepProbes(instrument.Observer):
    """Keeps the probe names and the context object each call received."""

    probes = ("hidden", "update", "seed")

    def __init__(self) -> None:
        super().__init__("keep_probes")
        self.names, self.contexts = [], []

    def reset(self) -> None:
        self.names, self.contexts = [], []

    def observe(self, context) -> None:
        self.names.append(sorted(context.probes))
        self.contexts.append(context)


class TaggedContext(instrument.StepContext):
    """A user's subclass with an attribute of its own (copied along, not through the slots)."""

    def __init__(self, *args, tag: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


@pytest.mark.parametrize("context_type", [instrument.StepContext, TaggedContext])
def test_callers_context_keeps_its_own_probes_while_observers_get_the_recorded_ones(context_type):
    torch.manual_seed(0)
    model, keep = Model(), KeepProbes()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(model, state=False)
    own = torch.full((2,), 7.0)
    x0 = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    mine = []
    with inst.step(0) as s:
        x = model.encoder_probe(x0)
        for i in range(N_ITER):
            nxt = model.rule(x)
            context = context_type(x, nxt, step_index=i, probes={"mine": own})
            if context_type is TaggedContext:
                context.tag = f"iteration {i}"
            s.observer(context)
            mine.append(context)
            x = nxt
    inst.close()
    # The caller's objects are exactly as they built them: no recorded probe was written into them.
    for context in mine:
        assert list(context.probes) == ["mine"]
        assert context.probes["mine"] is not None and torch.equal(context.probes["mine"], own)
    # The observers saw the recorded values next to the caller's own, in objects of their own.
    assert keep.names[0] == ["hidden", "mine", "seed", "update"]
    assert keep.names[1:] == [["hidden", "mine", "update"]] * (N_ITER - 1)
    assert all(seen is not given for seen, given in zip(keep.contexts, mine, strict=True))
    assert [c.step_index for c in keep.contexts] == list(range(N_ITER))
    assert torch.equal(keep.contexts[-1].next_state, mine[-1].next_state)
    assert all(type(seen) is context_type for seen in keep.contexts)
    if context_type is TaggedContext:
        assert [c.tag for c in keep.contexts] == [f"iteration {i}" for i in range(N_ITER)]


def test_without_recorded_probes_the_callers_context_is_passed_through():
    keep = KeepProbes()
    keep.probes = ()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    state = torch.zeros(1, 2, 3, 3)
    context = instrument.StepContext(state, state + 1)
    with inst.step(0) as s:
        s.observer(context)
    inst.close()
    assert keep.contexts == [context] and context.probes == {}
