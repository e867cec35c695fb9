"""Probes, from a review of instrument/probes: torch.jit.trace's check run records nothing, a nested tensor is
refused by name and a sparse one copied, a strided view is copied once, ``freeze_channels`` is checked, and a
model with a probe added after ``watch`` is watched again after its handle is removed. Each failed before."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import instrument
from instrument.errors import ConfigurationError, ProbeError
from instrument.probes.copies import same_layout_copy


class Keep(instrument.Observer):
    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def reset(self) -> None:
        pass

    def observe(self, context) -> None:
        self.seen.append(dict(context.probes))

    def log(self, logger, step) -> None:
        pass


class Rule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p = instrument.Probe("h")

    def forward(self, x):
        return x + self.p(self.lin(x)).tanh()


@pytest.mark.parametrize("state", [True, False])
def test_a_trace_taken_inside_a_logging_step_records_nothing_in_its_check_run(state):
    """torch.jit.trace runs the module again as plain Python to check the trace (``check_trace=True``); that run
    recorded the trace's input into the step, replacing the iteration's probe value (state=False)."""
    torch.manual_seed(0)
    rule, keep = Rule(), Keep()
    inst = instrument.Instrumentation([keep], backends=[], log_interval=1)
    inst.watch(rule, state=state)
    x = torch.zeros(2, 4)
    with inst.step(0) as s:
        y = rule(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the trace's own warnings
            torch.jit.trace(rule, torch.full((2, 4), 100.0))
        if not state:
            s.observer(instrument.StepContext(previous_state=x, next_state=y))
    inst.close()
    assert len(keep.seen) == 1
    torch.testing.assert_close(keep.seen[0]["h"], rule.lin(x).detach(), rtol=0, atol=0)


class Probed(nn.Module):
    def __init__(self, grad: bool) -> None:
        super().__init__()
        self.p = instrument.Probe("v", grad=grad)

    def forward(self, x):
        return self.p(x)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_a_nested_tensor_given_to_a_probe_is_refused_by_name(layout):
    value = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    module = Probed(grad=False)
    inst = instrument.Instrumentation([Keep()], backends=[], log_interval=1)
    inst.watch(module, state=False)
    module(value)  # a non-logging step: the probe is off
    with pytest.raises(ProbeError, match=r"Probe 'v' records one regular tensor, got a nested tensor \(layout "):
        with inst.step(0):
            module(value)
    inst.close()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_a_sparse_value_of_a_gradient_probe_is_copied_as_it_is():
    """A sparse CSR tensor has no strides: reading its layout raised before the copy was made."""
    value = torch.eye(3).to_sparse_csr()
    copy = same_layout_copy(value)
    assert copy.layout == torch.sparse_csr and copy is not value
    torch.testing.assert_close(copy.to_dense(), torch.eye(3))


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_strided_view_is_copied_once_with_its_strides():
    view = torch.randn(4, 64)[:, ::2]
    with Ops() as ops:
        copy = same_layout_copy(view)
    assert copy.stride() == view.stride() and torch.equal(copy, view)
    assert not [name for name in ops.names if "clone" in name], ops.names  # a clone first, thrown away, before


@pytest.mark.parametrize("bad", [3, "01", [1.5], [True], {0, 1}])
def test_freeze_channels_other_than_a_sequence_of_ints_is_refused_at_watch(bad):
    inst = instrument.Instrumentation([Keep()], backends=[], log_interval=1)
    with pytest.raises(ConfigurationError, match=r"watch\(freeze_channels=\.\.\.\) takes channel indices, a sequence "
                                                 r"of ints, got .*pass e\.g\. freeze_channels=\(0, 1, 2\)"):
        inst.watch(Rule(), freeze_channels=bad)
    inst.close()


def test_a_probe_added_after_watch_is_seen_once_the_handle_is_removed_and_the_model_watched_again():
    rule, keep = Rule(), Keep()
    inst = instrument.Instrumentation([keep], backends=[], log_interval=1)
    handle = inst.watch(rule, freeze_channels=[0, 1])
    rule.late = instrument.Probe("late")
    rule.forward = lambda x: x + rule.late(rule.p(rule.lin(x)))
    with pytest.raises(ConfigurationError, match=r"already watched .*remove\(\) its handle, rewatch"):
        inst.watch(rule)
    handle.remove()
    inst.watch(rule)
    with inst.step(0):
        rule(torch.randn(2, 4))
    inst.close()
    assert sorted(keep.seen[0]) == ["h", "late"]


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rule = Rule()

    def forward(self, x):
        return self.rule(x)


def test_removing_one_watch_mid_step_leaves_on_the_probes_another_watch_of_the_session_holds():
    """A model watched for its probes and its rule watched for its calls: removing the rule's watch in a
    logging step switched the probe off for the rest of the step, though the model's watch still held it."""
    outer, keep = Outer(), Keep()
    inst = instrument.Instrumentation([keep], backends=[], log_interval=1)
    inst.watch(outer, state=False)
    handle = inst.watch(outer.rule, state=True)
    with inst.step(0) as s:
        x = outer(torch.randn(2, 4))
        handle.remove()
        assert outer.rule.p.enabled
        y = outer(x)
        s.observer(instrument.StepContext(previous_state=x, next_state=y))
    assert not outer.rule.p.enabled  # off after the step, as always
    inst.close()
    assert [sorted(probes) for probes in keep.seen] == [["h"], ["h"]]


def test_another_session_unwatching_the_model_mid_step_leaves_this_steps_probes_on():
    """Two sessions watch one model (training and evaluation). The second removing its watch while the first's
    logging step was open switched the probe off, and the rest of that step recorded nothing."""
    rule, keep = Rule(), Keep()
    train = instrument.Instrumentation([keep], backends=[], log_interval=1)
    evaluation = instrument.Instrumentation([Keep()], backends=[], log_interval=1)
    train.watch(rule, state=False)
    handle = evaluation.watch(rule, state=False)
    with train.step(0) as s:
        x = torch.randn(2, 4)
        handle.remove()
        assert rule.p.enabled
        y = rule(x)
        s.observer(instrument.StepContext(previous_state=x, next_state=y))
    assert not rule.p.enabled
    with evaluation.step(0):  # unwatched there: nothing turns the probe on
        rule(x)
        assert not rule.p.enabled
    train.close()
    evaluation.close()
    assert [sorted(probes) for probes in keep.seen] == [["h"]]
    torch.testing.assert_close(keep.seen[0]["h"], rule.lin(x).detach(), rtol=0, atol=0)


def test_plain_torch_jit_script_of_a_module_whose_probes_are_on_is_refused_and_instrument_script_is_not():
    """Plain torch.jit.script copies each probe's ``enabled``: a rule scripted during a logging step (an export)
    kept its probe on for good, and its calls replaced the watched model's values in every later step."""
    outer, keep = Outer(), Keep()
    inst = instrument.Instrumentation([keep], backends=[], log_interval=1)
    inst.watch(outer, state=False)
    with inst.step(0) as s:
        x = torch.randn(2, 4)
        y = outer(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation
            with pytest.raises(ProbeError, match=r"torch\.jit\.script of a module holding probe 'h' while it is on "
                                                 r".*or with instrument\.script\(module\)"):
                torch.jit.script(outer.rule)
        exported = instrument.script(outer.rule)
        s.observer(instrument.StepContext(previous_state=x, next_state=y))
    with inst.step(1) as s:
        x = torch.zeros(2, 4)
        y = outer(x)
        exported(torch.full((2, 4), 100.0))  # not watched: records nothing
        s.observer(instrument.StepContext(previous_state=x, next_state=y))
    inst.close()
    torch.testing.assert_close(keep.seen[-1]["h"], outer.rule.lin(x).detach(), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(outer.rule)  # outside a step: its probes are off, and scripting is as before


class Lookahead(instrument.Observer):
    """Evaluates the watched rule one step ahead of each observed state, as a diagnostic might."""

    def __init__(self, rule: nn.Module) -> None:
        super().__init__()
        self.rule, self.ahead = rule, []

    def reset(self) -> None:
        self.ahead = []

    def observe(self, context) -> None:
        self.ahead.append(self.rule(context.next_state))

    def log(self, logger, step) -> None:
        pass


def test_a_watched_module_called_by_an_observer_is_not_an_iteration(caplog):
    """Each such call went through the watch's hook, which delivered it to the observers from inside their own
    fan-out: a 3-iteration rollout reached the other observer as 83 contexts, step_index 80, 79, ..., 0, 81, 82
    (a review). The observer's calls are now its own: not counted, not observed, their probe values dropped."""
    torch.manual_seed(0)
    rule = Rule()
    contexts = []
    keep = Keep()
    lookahead = Lookahead(rule)
    inst = instrument.Instrumentation([lookahead, keep, contexts.append], backends=[], log_interval=1)
    inst.watch(rule)
    x = torch.randn(2, 4)
    states = [x]
    with caplog.at_level("INFO", logger="instrument"), torch.no_grad(), inst.step(0):
        for _ in range(3):
            states.append(rule(states[-1]))
    inst.close()
    assert [c.step_index for c in contexts] == [0, 1, 2]
    with torch.no_grad():
        for i, context in enumerate(contexts):
            torch.testing.assert_close(context.next_state, states[i + 1], rtol=0, atol=0)
            torch.testing.assert_close(keep.seen[i]["h"], rule.lin(states[i]), rtol=0, atol=0)  # not the lookahead's
            torch.testing.assert_close(lookahead.ahead[i], rule(states[i + 1]), rtol=0, atol=0)
    assert len(keep.seen) == 3
    assert caplog.text.count("was called by an observer") == 1


class _Rollout(nn.Module):
    def __init__(self, rule: nn.Module) -> None:
        super().__init__()
        self.rule = rule

    def forward(self, x):
        for _ in range(3):
            x = self.rule(x)
        return x


@pytest.mark.parametrize("how", ["eager", "scripted_rule", "scripted_model"])
def test_a_scripted_probe_watched_through_a_model_and_its_rule_is_one_probe(how):
    """A probe inside a ScriptModule watched twice by one session (a model, and the scripted rule inside it) is one
    probe, as it is for an eager model: ``watch`` refused it as "the same name as a probe of already watched"
    model, since each watch sees a scripted probe through a wrapper of its own, and unwatching one of the two
    mid-step turned the probe off for the other (a review)."""
    torch.manual_seed(0)
    model = _Rollout(Rule() if how == "eager" else instrument.script(Rule()))
    if how == "scripted_model":
        model = instrument.script(model)
    keep, contexts = Keep(), []
    inst = instrument.Instrumentation([keep, contexts.append], backends=[], log_interval=1)
    whole = inst.watch(model, state=False)  # refused for the scripted ones: "the same name as a probe of ..."
    inst.watch(model.rule)
    x = torch.randn(2, 4)
    with torch.no_grad(), inst.step(0):
        y = model.rule(x)
        whole.remove()  # the rule's watch still holds the probe on for the rest of the step
        model.rule(y)
    inst.close()
    assert [c.step_index for c in contexts] == [0, 1]
    assert all(set(probes) == {"h"} for probes in keep.seen)
    with torch.no_grad():
        torch.testing.assert_close(keep.seen[1]["h"], model.rule.lin(y), rtol=0, atol=0)
    assert not model.rule.p.enabled


def test_an_observers_call_of_a_module_two_sessions_watch_is_an_iteration_of_neither():
    """Session A's lookahead called the rule that session B watches too: A dropped the call, but B counted it as an
    iteration, delivered from inside A's fan-out: 3 iterations reached B as 6 contexts (a review)."""
    torch.manual_seed(0)
    rule = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # no probes: their values go to one session at a time
    a_seen, b_seen = [], []
    a = instrument.Instrumentation([Lookahead(rule), a_seen.append], backends=[], log_interval=1)
    b = instrument.Instrumentation([b_seen.append], backends=[], log_interval=1)
    a.watch(rule)
    b.watch(rule)
    states = [torch.randn(2, 4)]
    with torch.no_grad(), a.step(0), b.step(0):
        for _ in range(3):
            states.append(rule(states[-1]))
    a.close()
    b.close()
    assert [c.step_index for c in a_seen] == [c.step_index for c in b_seen] == [0, 1, 2]
    for i, context in enumerate(b_seen):
        torch.testing.assert_close(context.next_state, states[i + 1], rtol=0, atol=0)
