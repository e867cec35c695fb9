"""Embedded probes under torch.compile: values, graph counts, graph breaks, the on/off guard trap.

Cold compiles take 10+ s on this machine, so there are two tests on a tiny rule, compiled with the
``aot_eager`` backend: Dynamo (guards, graph breaks, recompiles) and AOT autograd (the fake kernel, the
autograd formula) behave as with inductor, without inductor's code generation time.
"""

import logging
import re

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._dynamo.utils import counters

import instrument
from tests._probe_models import BareRule, KeepProbes, ReuseRule, Rule, hidden_gradients, reference

# Dynamo itself reads .grad of the non-leaf state it is given each iteration (torch's warning, not ours).
pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
    # Dynamo makes a context object for a traced autograd function (the gradient probe's) by instantiating
    # torch.autograd.Function, which torch itself deprecates (torch's warning, not ours; hidden by default).
    pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated"),
]

N_ITER = 3
STEPS = 6  # log_interval=2: on, off, on, off, on, off


class HostSide(instrument.Observer):
    """Does what must never happen inside compiled code: host syncs on every observed iteration."""

    probes = ("hidden", "update")

    def reset(self) -> None:
        self.seen, self.sums, self.gradients = [], [], None

    def observe(self, context) -> None:
        self.sums.append(float(context.probes["hidden"].sum()))  # host sync, on purpose
        self.seen.append({k: v.clone() for k, v in context.probes.items()})

    def observe_gradients(self, gradients) -> None:
        self.gradients = {k: list(v) for k, v in gradients.items()}


def seed_state() -> torch.Tensor:
    # requires_grad like every later state of the rollout, so Dynamo sees one kind of input (else it compiles
    # a second variant for the first iteration, probes or not).
    return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()


def cache_entries(function) -> int:
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__))


@pytest.fixture()
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def run_steps(inst, call, x0, explicit=False, backward=False):
    logged = []
    for step in range(STEPS):
        with inst.step(step) as s:
            x = x0
            for _ in range(N_ITER):
                nxt = call(x)
                if explicit and s.observer is not None:
                    s.observer(instrument.StepContext(x, nxt))
                x = nxt
            if backward:
                x.square().mean().backward()
        logged.append(s.active)
    return logged


def test_watch_then_compile_two_graphs_no_breaks_and_off_steps_skip_on_guards(fresh_dynamo):
    torch.manual_seed(0)
    rule, observer = Rule(), HostSide()
    inst = instrument.Instrumentation(observers=[observer], backends=[], log_interval=2)
    inst.watch(rule)                                        # hook style, on the eager module
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(rule, backend=backend)
    x0 = seed_state()
    assert run_steps(inst, compiled, x0) == [True, False] * 3
    inst.close()

    assert sum(counters["graph_break"].values()) == 0
    assert backend.frame_count == 2                         # one graph with probes on, one with them off
    on_graph, off_graph = (g.code for g in backend.graphs)  # step 0 logs, so "on" compiled first
    assert "instrument.record" in on_graph and "instrument" not in off_graph
    # Compiled code may reuse an intermediate's memory after its last use, unseen by version counters: the
    # probe passes copy=True there (recorded values are copies), and the eager True/False test was folded away.
    assert "'hidden', True)" in on_graph and "'update', True)" in on_graph and "is_compiling" not in on_graph
    # The trap fix: "off" calls run the original forward code, whose cache holds only the "off" variant.
    assert cache_entries(Rule.forward) == 1
    # Every iteration of the last logging step was recorded, equal to eager; the observer's host syncs ran.
    want = reference(rule, x0, N_ITER)
    assert len(observer.seen) == N_ITER and len(observer.sums) == N_ITER
    for got, ref in zip(observer.seen, want, strict=True):
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


def test_compile_then_watch_wrapper_explicit_observer_and_gradient_probe(fresh_dynamo):
    torch.manual_seed(0)
    rule, observer = Rule(grad=True), HostSide()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(rule, backend=backend)
    x0 = seed_state()
    compiled(x0)                                            # compiled before anything is watched
    inst = instrument.Instrumentation(observers=[observer], backends=[], log_interval=2)
    inst.watch(compiled, state=False)                       # probes found through _orig_mod
    run_steps(inst, compiled, x0, explicit=True, backward=True)
    inst.close()

    assert sum(counters["graph_break"].values()) == 0
    assert backend.frame_count == 2
    want = reference(rule, x0, N_ITER)
    for got, ref in zip(observer.seen, want, strict=True):
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    # Gradient probe through the compiled backward: equal to eager autograd's gradient of each hidden value.
    assert len(observer.gradients["hidden"]) == N_ITER
    for got, want_grad in zip(observer.gradients["hidden"], hidden_gradients(rule, x0, N_ITER), strict=True):
        torch.testing.assert_close(got, want_grad)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_inductor_reusing_a_probed_buffer_or_the_caller_changing_the_output_never_changes_values(
    fresh_dynamo, monkeypatch
):
    """The one test with Inductor itself (a cold compile): it reuses the memory of the probed intermediate ``a``
    for a later buffer of the same size, and the caller zeroes the returned value (``out``) in place after the
    compiled call. Neither touches version counters; observers must still get what each probe saw."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from instrument.probes import record

    monkeypatch.setattr(record, "_shared", ({}, set()))
    torch.manual_seed(0)
    rule, observer = ReuseRule(), KeepProbes(("a", "out"))
    inst = instrument.Instrumentation(observers=[observer], backends=[], log_interval=1)
    inst.watch(rule, state=False)
    compiled = torch.compile(rule)
    x = torch.randn(2, 4, 8, 8)
    copies = []
    codes = []
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        for step in range(3):
            with inst.step(step) as s:
                for _ in range(2):
                    if codes:
                        out = compiled(x)
                    else:  # the first call compiles the graph with the probes on: keep its generated code
                        out, codes = run_and_get_code(compiled, x)
                    saw = out.detach().clone()
                    out.detach().mul_(0)                    # the caller reuses the output's memory in place
                    s.observer(instrument.StepContext(x, out))
                    torch.testing.assert_close(saw, rule.reference(x)[1].detach())
                copies.append(record.active_recorder().copies)
            with torch.no_grad():
                a, want = rule.reference(x)
            assert len(observer.seen) == 2
            # Inductor's sin/cos differ from eager's in the last bits; a reused buffer would differ entirely.
            for seen in observer.seen:
                torch.testing.assert_close(seen["a"], a)
                torch.testing.assert_close(seen["out"], want)
    inst.close()
    # Under torch.compile every recorded value is copied at recording (two probes, two calls a step).
    assert copies == [4, 4, 4]
    assert sum(counters["graph_break"].values()) == 0
    # That copy is the only one: the operator takes Inductor's buffers in whatever layout they have
    # (flexible_layout), so no kernel converts a probed value to the eager layout first (Inductor names such
    # a copy after the operator it feeds).
    code = "\n".join(codes)
    assert code.count("torch.ops.instrument.record.default(") == 2
    assert re.findall(r"def (\w*record\w*)|(cpp_fused\w*record\w*)", code) == []


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_inductor_gradient_probe_adds_one_fused_copy_forward_and_one_recording_backward(fresh_dynamo):
    """A gradient probe under Inductor (a cold compile): the forward's copy is traced (fused by Inductor), the
    backward records the gradient through an opaque operator that takes it in whatever layout Inductor made
    (channels-last after the CPU convolutions); the recorded values and gradients equal eager autograd's."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    rule, observer = Rule(grad=True), HostSide()
    inst = instrument.Instrumentation(observers=[observer], backends=[], log_interval=1)
    inst.watch(rule, state=False)
    compiled = torch.compile(rule)
    x0 = seed_state()

    with inductor_config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(run_steps, inst, compiled, x0, explicit=True, backward=True)
    inst.close()

    code, forward = "\n".join(codes), codes[0]
    # The gradient is recorded by an opaque operator in the backward, taken in Inductor's layout: no kernel
    # converts it first (Inductor names such a kernel after the operator it feeds: cpp_fused_..._record_grad_..).
    assert code.count("torch.ops.instrument.record_grad.default(") == 1
    assert re.findall(r"cpp_fused\w*record\w*", code) == []
    # The forward's copy is a traced clone, not an opaque operator returning one: with an opaque operator
    # Inductor saved ReLU's mask for the backward as a bool tensor, a kernel 24x slower than the ReLU on AVX2.
    assert "instrument.watch_grad" not in code and "torch.bool" not in forward
    want = reference(rule, x0, N_ITER)
    for got, ref in zip(observer.seen, want, strict=True):
        for name in ref:
            torch.testing.assert_close(got[name], ref[name])
    assert len(observer.gradients["hidden"]) == N_ITER
    for got, want_grad in zip(observer.gradients["hidden"], hidden_gradients(rule, x0, N_ITER), strict=True):
        torch.testing.assert_close(got, want_grad)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning")
@pytest.mark.parametrize("fullgraph", [False, True])
def test_watching_a_scripted_model_leaves_an_unrelated_compiled_module_compiled(fullgraph):
    """The scripted model is observed through a global forward hook during logging steps; Dynamo traced it inside
    every other compiled module and gave up on it (fullgraph: step 0 raised; otherwise that module ran uncompiled
    for the whole run)."""
    torch._dynamo.reset()
    runs = {"graphs": 0, "calls": 0}

    def backend(gm, example_inputs):
        runs["graphs"] += 1

        def run(*args):
            runs["calls"] += 1
            return gm.forward(*args)

        return run

    scripted = instrument.script(Rule())
    other = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), fullgraph=fullgraph,
                          backend=backend)
    inst = instrument.Instrumentation([KeepProbes()], backends=[], log_interval=2)
    inst.watch(scripted)
    x, state = torch.randn(2, 4), torch.randn(2, 4, 6, 6)
    for step in range(8):
        with inst.step(step):
            other(x)
            scripted(state)
    inst.close()
    assert runs["calls"] == 8 and runs["graphs"] <= 2


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning")
@pytest.mark.parametrize("call_boundary", [False, True])
def test_a_watched_scripted_model_called_inside_a_compiled_function_is_observed(call_boundary):
    """The global hook's early return inside compiled code keeps a ScriptModule's own call: Dynamo runs a
    ScriptModule as it is, so its calls are the watched module's (scripted plainly, or with a call boundary)."""
    torch._dynamo.reset()
    scripted = instrument.script(BareRule(), call_boundary=call_boundary)
    compiled = torch.compile(lambda x: scripted(x) * 2, backend="eager")
    seen = []

    class Count(instrument.Observer):
        def observe(self, context):
            seen.append(context.step_index)

        def log(self, logger, step):
            pass

    inst = instrument.Instrumentation([Count()], backends=[], log_interval=1)
    inst.watch(scripted)
    x = torch.randn(2, 4, 6, 6)
    for step in range(3):
        with inst.step(step):
            compiled(x)
    inst.close()
    assert seen == [0, 0, 0]


class _Counted(instrument.Observer):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def observe(self, context):
        self.seen.append(context.step_index)

    def log(self, logger, step):
        pass


def test_a_compiled_caller_first_compiled_on_a_non_logging_step_calls_the_hook_and_is_said_once(fresh_dynamo, caplog):
    """A compiled caller first compiled on a non-logging step had no hook call in its graph (Dynamo does not
    guard on hooks), so every later logging step observed nothing. The watched module now runs a copy of its
    forward code on logging steps (`hook_switch`), a variant Dynamo compiles with the hook; the split that hook
    makes in the caller's graph is said once, with the fix."""
    torch.manual_seed(0)
    outer = torch.nn.Sequential(BareRule(), BareRule())
    counted = _Counted()
    inst = instrument.Instrumentation([counted], backends=[], log_interval=2)
    inst.watch(outer[0])
    compiled = torch.compile(outer, backend="eager")
    x = torch.randn(2, 4, 6, 6)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(1, 6):  # compiled first on step 1, which does not log
            with inst.step(step):
                compiled(x)
    inst.close()
    assert len(counted.seen) == 2  # one call of outer[0] in each of logging steps 2 and 4
    assert not [r for r in caplog.records if "was not called in this logging step" in r.getMessage()]
    said = [r.getMessage() for r in caplog.records if "inside a torch.compile'd caller" in r.getMessage()]
    assert len(said) == 1 and "Compile the watched module itself" in said[0], said


def test_a_compile_wrapper_and_the_module_it_wraps_are_watched_once(fresh_dynamo):
    """Both were accepted and each iteration was delivered twice (step indices 0, 0, 1, 1, ...)."""
    rule = BareRule()
    compiled = torch.compile(rule, backend="eager")
    for first, second in ((rule, compiled), (compiled, rule)):
        inst = instrument.Instrumentation([_Counted()], backends=[], log_interval=1)
        inst.watch(first)
        with pytest.raises(instrument.ConfigurationError, match="already watched .* torch.compile wrapper"):
            inst.watch(second)
        inst.close()


def test_a_step_that_raised_before_the_rollout_is_not_reported_as_a_module_never_called(caplog):
    """The once-per-run warning fired for an aborted step, and a real case later went unsaid."""
    counted = _Counted()
    inst = instrument.Instrumentation([counted], backends=[], log_interval=1)
    rule = BareRule()
    inst.watch(rule)
    x = torch.randn(2, 4, 6, 6)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with pytest.raises(RuntimeError, match="before the rollout"), inst.step(0):
            raise RuntimeError("before the rollout")
        with inst.step(1):
            rule(x)
        assert not [r for r in caplog.records if "was not called" in r.getMessage()]
        with inst.step(2):
            pass  # this step ran to its end without calling the module
    inst.close()
    assert len([r for r in caplog.records if "was not called" in r.getMessage()]) == 1
