"""Gradient probes over several backward passes in one logging step: each gradient pairs with its own iteration.

Truncated BPTT (a backward every K iterations, then ``detach``) and gradient accumulation (one backward per
micro-batch) deliver as many gradients as forward calls, in several passes; reversing the whole arrival list
swapped the segments silently. The forward calls are now cut into segments where a forward follows a backward,
and each segment's gradients are reversed on their own. References are eager autograd's own gradients
(``retain_grad``), compared exactly."""

import logging
from typing import List

import pytest
import torch

import instrument
from tests._probe_models import Rule, hidden_gradients

K = 3  # iterations per segment


class Keep(instrument.Observer):
    def __init__(self, probes=("hidden",)) -> None:
        super().__init__("keep")
        self.probes = tuple(probes)
        self.indices: List[int] = []
        self.gradients = None

    def observe(self, context) -> None:
        self.indices.append(context.step_index)

    def observe_gradients(self, gradients) -> None:
        self.gradients = {k: [g.clone() for g in v] for k, v in gradients.items()}


def session(*observers) -> instrument.Instrumentation:
    return instrument.Instrumentation(observers=list(observers), backends=[], log_interval=1)


def seed_state(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(seed))


def new_rule() -> Rule:
    torch.manual_seed(0)
    return Rule(grad=True)


def segment_reference(rule: Rule, x: torch.Tensor) -> List[torch.Tensor]:
    """Eager autograd's gradient of each iteration's hidden activations for one segment of K iterations whose
    loss is ``x.square().mean()``; returns them and leaves the segment's output detached in ``rule._x``."""
    grads = [g.clone() for g in hidden_gradients(rule, x, K)]
    with torch.no_grad():
        for _ in range(K):
            x = rule(x)
    rule._x = x
    return grads


def truncated_bptt(model) -> None:
    """Two segments of K iterations, each with its own backward, the second from the first's detached output."""
    x = seed_state()
    for _ in range(2):
        for _ in range(K):
            x = model(x)
        x.square().mean().backward()
        x = x.detach()


def tbptt_reference(rule: Rule) -> List[torch.Tensor]:
    want, x = [], seed_state()
    for _ in range(2):
        want += segment_reference(rule, x)
        x = rule._x
    return want


def assert_pairs(got: List[torch.Tensor], want: List[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"gradients['hidden'][{i}] is not iteration {i}'s gradient"


def test_truncated_bptt_segments_each_gradient_pairs_with_its_iteration(caplog):
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        truncated_bptt(rule)
    inst.close()
    assert keep.indices == list(range(2 * K))
    assert_pairs(keep.gradients["hidden"], tbptt_reference(rule))
    assert "gradient probe" not in caplog.text


def test_micro_batches_each_with_its_backward_keep_their_order(caplog):
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    seeds = [seed_state(1), seed_state(2), seed_state(3)]
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        for x in seeds:
            for _ in range(K):
                x = rule(x)
            x.square().mean().backward()
    inst.close()
    want: List[torch.Tensor] = []
    for x in seeds:
        want += segment_reference(rule, x)
    assert keep.indices == list(range(3 * K))
    assert_pairs(keep.gradients["hidden"], want)
    assert "gradient probe" not in caplog.text


# Dynamo's own warnings while tracing (as in tests/test_probes_compile.py): torch's, not ours.
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_truncated_bptt_pairs_each_gradient_with_its_iteration():
    torch._dynamo.reset()
    try:
        rule, keep = new_rule(), Keep()
        compiled = torch.compile(rule, backend="aot_eager")
        inst = session(keep)
        inst.watch(compiled)
        with inst.step(0):
            truncated_bptt(compiled)
        inst.close()
    finally:
        torch._dynamo.reset()
    want = tbptt_reference(rule)
    got = keep.gradients["hidden"]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_two_losses_over_the_whole_rollout_are_still_summed():
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    two_passes(inst, rule)
    inst.close()
    hidden, x = [], seed_state()
    for _ in range(K):
        h = torch.relu(rule.fc0(rule.perceive(x)))
        h.retain_grad()
        hidden.append(h)
        x = x + rule.fc1(h)
    (x.square().mean() + x.mean()).backward()
    got = keep.gradients["hidden"]
    assert len(got) == K
    for g, h in zip(got, hidden, strict=True):
        torch.testing.assert_close(g, h.grad, rtol=1e-5, atol=1e-7)


def test_a_gradient_penalty_pass_is_named_in_the_warning(caplog):
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        x = seed_state().requires_grad_()
        y = rule(x)
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.square().mean() + gx.square().mean()).backward()
    inst.close()
    assert "torch.autograd.grad or double-backward pass" in caplog.text
    assert "the gradient of the losses' sum" not in caplog.text


def run_backward_after_block(steps: int) -> None:
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    for step in range(steps):
        with inst.step(step):
            x = seed_state()
            for _ in range(K):
                x = rule(x)
            loss = x.square().mean()
        loss.backward()
        assert keep.gradients is None
    inst.close()


def test_backward_after_the_step_block_is_said_once_naming_the_probe(caplog):
    with caplog.at_level(logging.WARNING, logger="instrument"):
        run_backward_after_block(steps=3)
    said = [r.getMessage() for r in caplog.records if "received no gradient" in r.getMessage()]
    assert len(said) == 1
    assert "'hidden'" in said[0] and "inside the `with inst.step(...)` block" in said[0]


def test_a_step_without_grad_says_nothing_about_missing_gradients(caplog):
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0), torch.no_grad():
        x = seed_state()
        for _ in range(K):
            x = rule(x)
    inst.close()
    assert "received no gradient" not in caplog.text


def two_passes(inst: instrument.Instrumentation, rule: Rule) -> None:
    with inst.step(0):
        x = seed_state()
        for _ in range(K):
            x = rule(x)
        x.square().mean().backward(retain_graph=True)
        x.mean().backward()


@pytest.mark.parametrize("case", ["missing", "passes"])
def test_two_sessions_in_one_process_are_each_warned(caplog, case):
    for run in range(2):
        rule, keep = new_rule(), Keep()
        inst = session(keep)
        inst.watch(rule)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="instrument"):
            if case == "passes":
                two_passes(inst, rule)
                inst.close()
            else:
                inst.close()
                run_backward_after_block(steps=2)
        text = "taken as 2 backward passes" if case == "passes" else "received no gradient"
        assert caplog.text.count(text) == 1, f"session {run} was not warned"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Conv2d(4, 4, 1)
        self.p = instrument.Probe("hidden", grad=True)

    def forward(self, x):
        return torch.tanh(self.p(self.fc(x)))


class Tied(torch.nn.Module):
    """The same block (and probe) twice per iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return x + 0.1 * self.block(self.block(x))


def test_a_gradient_probe_called_twice_per_iteration_is_said(caplog):
    torch.manual_seed(0)
    model, keep = Tied(), Keep()
    inst = session(keep)
    inst.watch(model)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        x = seed_state()
        for _ in range(K):
            x = model(x)
        x.square().mean().backward()
    inst.close()
    assert keep.indices == list(range(K)) and len(keep.gradients["hidden"]) == 2 * K
    assert "more than once per iteration" in caplog.text


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_each_iteration_checkpointed_keeps_its_gradient(caplog, use_reentrant):
    """Reentrant checkpointing runs a nested backward per iteration: pairing by autograd's graph task made each
    one a pass of its own, and the gradients came back last iteration first, unsaid (a review of this change)."""
    from torch.utils.checkpoint import checkpoint

    rule, keep = new_rule(), Keep()

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rule = rule

        def forward(self, x):
            return checkpoint(self.rule, x, use_reentrant=use_reentrant)

    model = Checkpointed()
    inst = session(keep)
    inst.watch(model)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        x = seed_state().requires_grad_(True)
        for _ in range(K):
            x = model(x)
        x.square().mean().backward()
    inst.close()
    rule.zero_grad()
    want = segment_reference(rule, seed_state().requires_grad_(True))
    assert_pairs(keep.gradients["hidden"], want)
    assert "gradient probe" not in caplog.text


def test_a_burn_in_under_no_grad_is_named_in_the_unpaired_warning_and_its_gradients_follow_it(caplog):
    """Two iterations under torch.no_grad, then K differentiated ones: the burn-in's calls count as iterations
    but get no gradient. The warning blamed "a backward over part of a segment, or gradients from outside the
    watched calls" and docs/probes.md did not mention burn-in, the usual cause; gradients[j] is iteration 2 + j's
    (eager autograd's own gradients)."""
    rule, keep = new_rule(), Keep()
    inst = session(keep)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        x = seed_state()
        with torch.no_grad():
            for _ in range(2):
                x = rule(x)
        burned = x.clone()
        for _ in range(K):
            x = rule(x)
        x.square().mean().backward()
    inst.close()
    rule.zero_grad()
    said = [r.getMessage() for r in caplog.records if "cannot be paired" in r.getMessage()]
    assert len(said) == 1 and "torch.no_grad" in said[0] and "burn-in" in said[0]
    assert keep.indices == list(range(2 + K))
    assert_pairs(keep.gradients["hidden"], segment_reference(rule, burned))
