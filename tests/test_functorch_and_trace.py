"""Probes and watched modules under torch.func transforms and torch.jit.trace, in logging steps.

Found by a review of unusual module structures: a probe inside ``torch.func.vmap`` (an ensemble run as
``vmap(functional_call)``) or a gradient probe under ``torch.func.grad`` crashed every logging step; a watched
rule called under ``grad``/``jacrev``/``vmap`` handed functorch-wrapped tensors to observers, which then failed
at log time with PyTorch-internal messages; ``torch.jit.trace`` of a watched rule inside a logging step raised
``TracingCheckError`` and counted the trace's runs as iterations; watching a traced module with probes advised
freezing; and the "not called" warning said nothing of calls that bypass ``nn.Module.__call__``. Every number
here is read back from real TensorBoard event files written by the session, or compared with eager autograd.
"""

import copy
import logging
import warnings
from typing import Dict, List

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap

import instrument
from instrument.errors import ProbeError
from tests._probe_models import BareRule, KeepProbes, Loop, Rule, hidden_gradients, reference
from tests.conftest import Recorder, read_scalars

N_ITER = 3
# torch.jit.trace and torch.jit.script are deprecated in favour of torch.export: tested here on purpose.
JIT_DEPRECATED = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")


def seed_state(seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.rand(batch, 4, 6, 6, generator=torch.Generator().manual_seed(seed))


def session(tmp_path, observers, name: str = "r", log_interval: int = 1) -> instrument.Instrumentation:
    return instrument.Instrumentation(
        observers=list(observers), backends=[instrument.TensorBoardBackend()], log_interval=log_interval,
        log_dir=str(tmp_path), run_name=name,
    )


def said(caplog, text: str) -> List[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def plain(tensor: torch.Tensor) -> bool:
    return not torch._C._functorch.is_functorch_wrapped_tensor(tensor)


# ------------------------------------------------------------------------------------------------ torch.func.vmap
def test_probes_in_a_vmapped_ensemble_record_the_batch_member_first_on_every_logging_step(tmp_path):
    """An ensemble of rules run as vmap(functional_call), watched with state=False, its states handed to
    s.observer: the probes record [members, ...], each member's values exactly those of its own rollout."""
    torch.manual_seed(0)
    members = [Rule() for _ in range(3)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0])
    keep = KeepProbes()
    inst = session(tmp_path, [keep, instrument.IterationStats()], log_interval=2)
    inst.watch(base, state=False)

    def member_step(p, b, x):
        return functional_call(base, (p, b), (x,))

    seen: Dict[int, list] = {}
    for step in range(3):  # steps 0 and 2 log, step 1 does not
        with inst.step(step) as s:
            x = seed_state(step).expand(3, -1, -1, -1, -1)
            for _ in range(N_ITER):
                nxt = vmap(member_step)(params, buffers, x)
                if s.observer is not None:
                    s.observer(instrument.StepContext(previous_state=x, next_state=nxt))
                x = nxt
            if s.active:
                seen[step] = list(keep.seen)
    inst.close()
    assert inst.failures == {}
    for step in (0, 2):
        want = [reference(m, seed_state(step), N_ITER) for m in members]  # per member, per iteration
        assert len(seen[step]) == N_ITER
        for i, got in enumerate(seen[step]):
            for name in ("hidden", "update"):
                assert plain(got[name]) and got[name].shape == (3, *want[0][i][name].shape)
                torch.testing.assert_close(got[name], torch.stack([w[i][name] for w in want]))
    scalars = read_scalars(tmp_path / "r")
    assert scalars["iteration_stats/iterations"] == {0: N_ITER, 2: N_ITER}


def test_a_watched_rule_called_inside_vmap_is_counted_not_delivered_and_said_once(tmp_path, caplog):
    """vmap(rule) over the batch: the hook sees one sample's BatchedTensors. Such calls are counted (a later
    eager call keeps its step_index), not delivered, said once per session; no observer fails."""
    torch.manual_seed(0)
    rule = BareRule()
    rec = Recorder()
    inst = session(tmp_path, [rec, instrument.IterationStats(), instrument.UpdateNorm(), instrument.NonFinite()])
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                x = seed_state(step)
                for _ in range(2):
                    x = vmap(rule)(x.unsqueeze(1)).squeeze(1)  # each sample as a batch of one
                last = rule(x)
    inst.close()
    assert inst.failures == {}
    warned = said(caplog, "inside torch.func.vmap")
    assert len(warned) == 1, warned
    assert "BareRule" in warned[0] and "[1, 4, 6, 6]" in warned[0] and "state=False" in warned[0]
    assert [c.step_index for c in rec.contexts] == [2, 2]  # the eager call of each step, after two vmapped ones
    assert torch.equal(rec.contexts[-1].next_state, last) and torch.equal(rec.contexts[-1].previous_state, x)
    assert read_scalars(tmp_path / "r")["iteration_stats/iterations"] == {0: 1, 1: 1}


@JIT_DEPRECATED
def test_a_watched_scripted_rule_called_by_a_scripted_loop_inside_vmap_does_not_crash(tmp_path, caplog):
    """The compiled-in call boundary's operator has a vmap rule too: such calls are counted and said."""
    torch.manual_seed(0)
    loop = torch.jit.script(Loop(instrument.script(BareRule())))
    rec = Recorder()
    inst = session(tmp_path, [rec, instrument.IterationStats()])
    inst.watch(loop.rule)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0):
            vmap(lambda x: loop(x, N_ITER))(seed_state().unsqueeze(1))
            loop(seed_state(), N_ITER)
    inst.close()
    assert inst.failures == {}
    assert len(said(caplog, "inside torch.func.vmap")) == 1
    assert [c.step_index for c in rec.contexts] == [3, 4, 5]
    assert read_scalars(tmp_path / "r")["iteration_stats/iterations"] == {0: N_ITER}


# ------------------------------------------------------------------------------ torch.func.grad / jacrev, hooks
OBSERVERS = (instrument.IterationStats, instrument.UpdateNorm, instrument.NonFinite)


def eager_reference(tmp_path, rule: nn.Module, x: torch.Tensor) -> Dict[str, Dict[int, float]]:
    inst = session(tmp_path, [cls() for cls in OBSERVERS], name="eager")
    inst.watch(rule)
    with inst.step(0), torch.no_grad():
        for _ in range(N_ITER):
            x = rule(x)
    inst.close()
    return read_scalars(tmp_path / "eager")


@pytest.mark.parametrize("transform", ["grad", "jacrev"])
def test_a_watched_rule_under_func_grad_or_jacrev_logs_what_eager_mode_logs(tmp_path, transform):
    """The states arrive as grad-tracking wrappers: observers get the plain tensors under them, and every
    built-in state observer logs the eager rollout's numbers (before: UpdateNorm and NonFinite failed)."""
    torch.manual_seed(0)
    rule = BareRule()
    params = {k: v.detach().clone() for k, v in rule.named_parameters()}
    x0 = seed_state()
    rec = Recorder()
    inst = session(tmp_path, [rec, *(cls() for cls in OBSERVERS)])
    inst.watch(rule)

    def rollout(p):
        x = x0
        for _ in range(N_ITER):
            x = functional_call(rule, p, (x,))
        return x

    with inst.step(0):
        if transform == "grad":
            grad(lambda p: rollout(p).square().mean())(params)
        else:
            jacrev(lambda p: rollout(p).sum(dim=(1, 2, 3)))(params)
    inst.close()
    assert inst.failures == {}
    assert all(plain(c.previous_state) and plain(c.next_state) for c in rec.contexts)
    got = read_scalars(tmp_path / "r")
    want = eager_reference(tmp_path, rule, x0)
    assert set(want) <= set(got) and {"update_norm/l2/mean", "nonfinite/count"} <= set(want)
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-6, abs=1e-7), key


def test_update_norm_takes_states_handed_over_inside_func_grad(tmp_path):
    """s.observer called inside torch.func.grad keeps the transform's wrappers, which have no storage once it
    returns: UpdateNorm's check for a chained rollout asked them for a data pointer and failed every step."""
    torch.manual_seed(0)
    rule = BareRule()
    params = {k: v.detach().clone() for k, v in rule.named_parameters()}
    x0 = seed_state()
    inst = session(tmp_path, [instrument.UpdateNorm()])

    with inst.step(0) as s:
        def loss(p):
            x = x0
            for _ in range(N_ITER):
                nxt = functional_call(rule, p, (x,))
                s.observer(instrument.StepContext(previous_state=x, next_state=nxt))
                x = nxt
            return x.square().mean()

        grad(loss)(params)
    inst.close()
    assert inst.failures == {}
    want = eager_reference(tmp_path, rule, x0)
    got = read_scalars(tmp_path / "r")
    for key in ("update_norm/l2/mean", "update_norm/l2/first", "update_norm/l2/last", "update_norm/l2/max"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


# --------------------------------------------------------------------------------------- gradient probes, torch.func
class KeepGradients(instrument.Observer):
    """Keeps each logging step's gradients of probe 'hidden', in step order."""

    def __init__(self) -> None:
        super().__init__("keep_gradients")
        self.gradients: List[List[torch.Tensor]] = []

    def observe(self, context) -> None:
        pass

    def observe_gradients(self, gradients) -> None:
        self.gradients.append([g.clone() for g in gradients["hidden"]])


def test_a_gradient_probe_under_func_grad_records_eager_autograds_gradients(tmp_path):
    torch.manual_seed(0)
    rule = Rule(grad=True)
    params = {k: v.detach().clone() for k, v in rule.named_parameters()}
    keep = KeepGradients()
    inst = session(tmp_path, [keep, instrument.IterationStats()], log_interval=2)
    inst.watch(rule)

    def loss(p, x):
        for _ in range(N_ITER):
            x = functional_call(rule, p, (x,))
        return x.square().mean()

    for step in range(3):
        with inst.step(step):
            grad(loss)(params, seed_state(step))
    inst.close()
    assert inst.failures == {}
    assert len(keep.gradients) == 2  # steps 0 and 2
    for step, got in zip((0, 2), keep.gradients, strict=True):
        want = hidden_gradients(rule, seed_state(step), N_ITER)
        assert len(got) == N_ITER and all(plain(g) for g in got)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert read_scalars(tmp_path / "r")["iteration_stats/iterations"] == {0: N_ITER, 2: N_ITER}


def test_a_gradient_probe_under_vmap_of_grad_records_the_batched_gradients(tmp_path, caplog):
    torch.manual_seed(0)
    rule = Rule(grad=True)
    params = {k: v.detach().clone() for k, v in rule.named_parameters()}
    keep = KeepGradients()
    inst = session(tmp_path, [keep])
    inst.watch(rule)
    xs = torch.stack([seed_state(i) for i in range(4)])

    def loss(p, x):
        for _ in range(N_ITER):
            x = functional_call(rule, p, (x,))
        return x.square().mean()

    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0):
            vmap(grad(loss), in_dims=(None, 0))(params, xs)
    inst.close()
    assert inst.failures == {}
    assert len(said(caplog, "inside torch.func.vmap")) == 1  # the watched calls themselves are vmapped
    got = keep.gradients[0]
    assert len(got) == N_ITER and all(g.shape == (4, 2, 8, 6, 6) for g in got)
    for sample in range(4):
        for g, w in zip(got, hidden_gradients(rule, xs[sample], N_ITER), strict=True):
            torch.testing.assert_close(g[sample], w)


# ------------------------------------------------------------------------------------------------ torch.jit.trace
@JIT_DEPRECATED
@pytest.mark.parametrize("depth", [0, 5])
def test_tracing_a_watched_rule_with_probes_inside_a_logging_step(tmp_path, depth):
    """No TracingCheckError and no TracerWarning; the trace holds no record op (it would record on every later
    call); neither the trace nor its check run counts as an iteration or delivers probe values, also when the
    traced module holds the watched rule five modules deep (the check run was looked for 16 frames up only)."""
    torch.manual_seed(0)
    rule = Rule()
    model = rule
    for _ in range(depth):
        model = nn.Sequential(model)
    keep = KeepProbes()
    inst = session(tmp_path, [keep, instrument.IterationStats()])
    inst.watch(rule)
    x = seed_state()
    with inst.step(0):
        with warnings.catch_warnings():
            warnings.simplefilter("error", torch.jit.TracerWarning)
            for _ in range(N_ITER):
                x = rule(x)
            traced = torch.jit.trace(model, seed_state(7))
        seen = list(keep.seen)
    with inst.step(1):
        traced(seed_state())  # a traced module is no watched one: nothing observed, nothing recorded
        seen_later = list(keep.seen)
    inst.close()
    assert "instrument::" not in str(traced.inlined_graph)
    assert len(seen) == N_ITER and seen_later == []
    want = reference(rule, seed_state(), N_ITER)
    for got, w in zip(seen, want, strict=True):
        assert torch.equal(got["hidden"], w["hidden"])
    assert read_scalars(tmp_path / "r")["iteration_stats/iterations"] == {0: N_ITER}
    torch.testing.assert_close(traced(seed_state(3)), rule(seed_state(3)))


@JIT_DEPRECATED
def test_watching_a_traced_module_with_probes_says_trace_and_what_to_do_instead(tmp_path):
    torch.manual_seed(0)
    traced = torch.jit.trace(Rule(), seed_state())
    inst = session(tmp_path, [instrument.IterationStats()])
    with pytest.raises(ProbeError, match=r"torch\.jit\.trace, which keeps no probe.*instrument\.script\(model\)"):
        inst.watch(traced)
    inst.close()


# ---------------------------------------------------------------------------------------- calls that bypass hooks
class OwnCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = BareRule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # runs no hook
        return self.forward(x)


@pytest.mark.parametrize("how", ["custom __call__", ".forward()"])
def test_the_not_called_warning_names_calls_that_bypass_module_call(tmp_path, caplog, how):
    torch.manual_seed(0)
    rule = OwnCall() if how == "custom __call__" else BareRule()
    inst = session(tmp_path, [instrument.IterationStats()])
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0):
            x = seed_state()
            for _ in range(N_ITER):
                x = rule(x) if how == "custom __call__" else rule.forward(x)
    inst.close()
    warned = said(caplog, "was not called in this logging step")
    assert len(warned) == 1 and "bypass nn.Module.__call__" in warned[0]
    assert ("OwnCall defines its own __call__" in warned[0]) == (how == "custom __call__")


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_activation_stats_under_vmap_or_grad_logs_the_whole_batch_as_an_untransformed_run(tmp_path, transform):
    """ActivationStats' own hooks got one vmapped sample (or a grad wrapper) and failed at log time, losing every
    activation statistic of the step. Under vmap they now keep the whole batch behind the sample; the moments
    over all elements are those of the same batch run without vmap."""
    torch.manual_seed(0)
    rule = BareRule()
    x0 = seed_state(batch=3)
    params = {k: v.detach().clone() for k, v in rule.named_parameters()}
    inst = session(tmp_path, [instrument.ActivationStats(module=rule, images=False)])
    with inst.step(0):
        x = x0
        for _ in range(N_ITER):
            if transform == "vmap":
                x = vmap(rule)(x.unsqueeze(1)).squeeze(1)
            else:
                x = functional_call(rule, params, (x,))
        if transform == "grad":
            grad(lambda p: functional_call(rule, p, (x0,)).square().mean())(params)
    inst.close()
    assert inst.failures == {}
    got = read_scalars(tmp_path / "r")
    reference_inst = session(tmp_path, [instrument.ActivationStats(module=rule, images=False)], name="eager")
    with reference_inst.step(0), torch.no_grad():
        x = x0
        for _ in range(N_ITER):
            x = rule(x)
        if transform == "grad":
            rule(x0)
    reference_inst.close()
    want = read_scalars(tmp_path / "eager")
    assert want and set(got) == set(want)
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-6, abs=1e-7), key


@JIT_DEPRECATED  # torch's forward-mode decompositions script themselves on first use
def test_a_gradient_probe_under_forward_mode_transforms_on_a_logging_step():
    """jvp, jacfwd, hessian and forward_ad through a gradient probe raised "You must implement the jvp function" at the
    first logging step of a run that had trained fine until then. The forward is a copy: tangents pass as they
    are, and the results equal those without instrument."""
    from torch.func import hessian, jacfwd, jvp

    torch.manual_seed(0)
    rule = Rule(grad=True)
    inst = instrument.Instrumentation([], backends=[], log_interval=1)
    inst.watch(rule, state=False)
    x = seed_state()
    small = torch.randn(3, generator=torch.Generator().manual_seed(2))

    def scalar(v):  # a function of 3 numbers through the rule, for the hessian
        return rule(x * v.sum()).square().mean()

    def dual():  # forward mode without torch.func
        import torch.autograd.forward_ad as fwad

        with fwad.dual_level():
            return fwad.unpack_dual(rule(fwad.make_dual(x, torch.ones_like(x)))).tangent

    def results():
        return (jvp(rule, (x,), (torch.ones_like(x),))[1], jacfwd(lambda v: rule(x * v).mean())(small[:1]),
                hessian(scalar)(small), dual())

    with inst.step(1):
        got = results()
    inst.close()
    want = results()
    assert inst.failures == {}
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_probes_under_a_chunked_vmap_deliver_the_whole_batch_and_chunked_gradients_are_said(tmp_path, caplog):
    """vmap(..., chunk_size=2) over 5 members runs the rule once per chunk: the probe delivered the last chunk
    only ([1, ...]), the others lost unsaid. The chunks of one call are joined; gradient probes, which arrive one
    per chunk, are said once."""
    torch.manual_seed(0)
    rule = Rule(grad=True)
    keep = KeepProbes()
    inst = session(tmp_path, [keep])
    inst.watch(rule, state=False)
    xs = torch.stack([seed_state(i) for i in range(5)])
    with inst.step(0) as s:
        out = vmap(rule, chunk_size=2)(xs)
        s.observer(instrument.StepContext(previous_state=xs, next_state=out))
        params = dict(rule.named_parameters())
        vmap(grad(lambda p, x: functional_call(rule, p, (x,)).square().mean()), in_dims=(None, 0),
             chunk_size=2)(params, xs)
    inst.close()
    want = reference(rule, xs.flatten(0, 1), 1)[0]
    assert keep.seen[0]["hidden"].shape[0] == 5
    assert torch.equal(keep.seen[0]["hidden"].flatten(0, 1), want["hidden"])
    assert torch.equal(keep.seen[0]["update"].flatten(0, 1), want["update"])
    assert len(said(caplog, "chunk_size=k")) == 1


def test_a_rollout_of_several_iterations_inside_a_chunked_vmap_delivers_its_last_iteration_of_every_member(tmp_path):
    """Three probed iterations per chunk: only the first record of each chunk was joined, so the observer got
    the last chunk's last iteration, [1, ...], mixed with other iterations on the way. It now gets what the
    call without chunks gives: the last iteration of all 5 members."""
    torch.manual_seed(0)
    rule = Rule()
    xs = torch.stack([seed_state(i) for i in range(5)])

    def three(x):
        for _ in range(N_ITER):
            x = rule(x)
        return x

    seen = {}
    for chunk_size in (None, 2):
        keep = KeepProbes()
        inst = session(tmp_path, [keep], name=f"c{chunk_size}")
        inst.watch(rule, state=False)
        with inst.step(0) as s:
            out = vmap(three, chunk_size=chunk_size)(xs)
            s.observer(instrument.StepContext(previous_state=xs, next_state=out))
        inst.close()
        seen[chunk_size] = keep.seen[0]
    assert seen[2]["hidden"].shape[0] == 5
    for name in ("hidden", "update"):
        assert torch.equal(seen[2][name], seen[None][name])


def test_a_vmapped_call_in_another_session_leaves_this_sessions_probe_values(tmp_path):
    """A watched module called inside vmap drops the probe values its call recorded. It dropped them from the
    process-wide active recorder, which may be another session's (a probe-free session in another thread, or as
    here nested in one): that session's observers lost the probe value of the iteration (a review)."""
    from torch import nn

    other = nn.Linear(8, 8)

    class Rule(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.probe = nn.Linear(8, 8), instrument.Probe("h")

        def forward(self, x):
            h = self.probe(self.lin(x))
            vmap(other)(torch.randn(3, 4, 8))  # session B's watched module, under vmap, before this call ends
            return x + torch.tanh(h)

    class Probed(instrument.Observer):
        def reset(self):
            self.missing = 0

        def observe(self, context):
            self.missing += "h" not in context.probes

    probed = Probed()
    a = instrument.Instrumentation(observers=[probed], backends=[], log_interval=1, overhead_budget=None)
    b = instrument.Instrumentation(observers=[], backends=[], log_interval=1, overhead_budget=None)
    rule = Rule()
    a.watch(rule)
    b.watch(other)
    with a.step(0), b.step(0), torch.no_grad():
        x = torch.randn(4, 8)
        for _ in range(3):
            x = rule(x)
        assert probed.missing == 0
    a.close()
    b.close()
