"""A logging step's forward hooks under torch.compile: the graphs non-logging steps run, and that hooks fire.

Dynamo does not guard on module hooks, so the code it compiles during a logging step (split at each hook, which
it never traces) would otherwise be reused on every non-logging step, and code compiled on a non-logging step
would never call the hooks. `instrument.probes.compiled.hook_switch` runs logging steps through copies of the
forward code instead. Graph calls are counted by a backend wrapper (``eager``: Dynamo's guards and graph breaks
without code generation); nothing is timed.
"""

import json
import logging

import pytest
import torch
import torch._dynamo
from torch import nn

import instrument

LOG_INTERVAL = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Outer(nn.Module):
    """A rollout whose rule is called inside the compiled caller."""

    def __init__(self) -> None:
        super().__init__()
        self.rule = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = self.rule(x)
        return x


class Counting:
    """A torch.compile backend that counts compiled graphs and their calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.fixture()
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(tmp_path, model, compiled, observer, watched, first: int, counting: Counting):
    inst = instrument.Instrumentation(observers=[observer], backends=[instrument.JsonlBackend()],
                                      log_interval=LOG_INTERVAL, log_dir=str(tmp_path), run_name="r",
                                      overhead_budget=None)
    inst.watch(watched)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    calls = {}
    try:
        for step in range(first, first + 6):
            before = counting.calls
            with inst.step(step), torch.no_grad():
                compiled(x)
            calls[step] = counting.calls - before
    finally:
        inst.close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return calls, {line["step"]: line["metrics"] for line in lines}


@pytest.mark.parametrize("first", [0, 1], ids=["compiled-on-a-logging-step", "compiled-on-a-non-logging-step"])
def test_activation_stats_hooks_leave_non_logging_steps_one_graph_and_fire_on_logging_steps(tmp_path, fresh_dynamo,
                                                                                            first):
    # Before: compiled on a logging step, every later non-logging step ran 6 graphs (split at the hooks);
    # compiled on a non-logging step, no logging step ever called the hooks (no activation keys).
    torch.manual_seed(0)
    model, counting = Net(), Counting()
    compiled = torch.compile(model, backend=counting)
    calls, metrics = run(tmp_path, model, compiled, instrument.ActivationStats(), compiled, first, counting)
    quiet = [step for step in calls if step % LOG_INTERVAL][1:]  # after the first non-logging step compiled
    assert all(calls[step] == 1 for step in quiet), calls
    eager = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            eager[i] = block.lin(x).double()
            x = block(x)
    logged = [step for step in calls if step % LOG_INTERVAL == 0]
    assert logged and set(logged) <= set(metrics)
    for step in logged:
        for i, out in eager.items():
            assert metrics[step][f"activations/blocks.{i}.lin/mean"] == pytest.approx(out.mean().item(), rel=1e-5)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the switch restores the modules


def test_a_watched_module_inside_a_compiled_caller_is_said_and_its_logging_steps_are_observed(tmp_path, caplog,
                                                                                              fresh_dynamo):
    # Compiled on a non-logging step: before, the caller never called the hooks (no iterations at all).
    torch.manual_seed(0)
    model, counting = Outer(), Counting()
    compiled = torch.compile(model, backend=counting)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        calls, metrics = run(tmp_path, model, compiled, instrument.IterationStats(images=False), model.rule, 1,
                             counting)
    assert [metrics[step]["iteration_stats/iterations"] for step in (2, 4, 6)] == [4.0, 4.0, 4.0]
    said = [r.getMessage() for r in caplog.records if "inside a torch.compile'd caller" in r.getMessage()]
    assert len(said) == 1 and "Compile the watched module itself" in said[0], said
    assert "forward" not in model.rule.__dict__


@pytest.mark.parametrize("which", ["wrapper", "inner"])
def test_a_watched_module_compiled_itself_is_not_said_and_runs_one_graph_per_call(tmp_path, caplog, fresh_dynamo,
                                                                                 which):
    torch.manual_seed(0)
    model, counting = Outer(), Counting()
    model.rule = torch.compile(model.rule, backend=counting)
    watched = model.rule if which == "wrapper" else model.rule._orig_mod
    with caplog.at_level(logging.WARNING, logger="instrument"):
        calls, metrics = run(tmp_path, model, model, instrument.IterationStats(images=False), watched, 0, counting)
    assert all(n == 4 for n in calls.values()), calls  # one graph per call of the rule: no split, no hook inside
    assert [metrics[step]["iteration_stats/iterations"] for step in (0, 2, 4)] == [4.0, 4.0, 4.0]
    assert not [r for r in caplog.records if "compiled" in r.getMessage()], caplog.records


def test_a_module_saved_in_a_logging_step_loads_and_a_forward_set_in_the_step_is_kept(tmp_path, fresh_dynamo):
    # Before: the ModuleList on the way to the hooked layers got a copy named _forward_unimplemented, so
    # torch.load of a model saved inside the step raised AttributeError; and the step's end popped every
    # instance forward it had switched, also one the user (an accelerate or peft wrapper) set meanwhile.
    import io

    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="eager")
    inst = instrument.Instrumentation(observers=[instrument.ActivationStats()], backends=[], log_interval=1,
                                      overhead_budget=None)
    inst.watch(compiled)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    buffer = io.BytesIO()

    def own_forward(self, x):
        return x

    try:
        with inst.step(0), torch.no_grad():
            compiled(x)
            torch.save(model, buffer)
            model.blocks[1].forward = own_forward.__get__(model.blocks[1])
    finally:
        inst.close()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
    assert model.blocks[1].__dict__["forward"].__func__ is own_forward
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == ["blocks.1"]
