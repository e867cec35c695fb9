"""Embedded probes in eager mode and TorchScript (scripted, frozen, saved and loaded in a fresh process).

torch.compile is tested in test_probes_compile.py (compiles are slow on this machine).
"""

import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import instrument
from instrument.probes import record
from tests._probe_models import BareRule, InPlaceRule, Model, Rule, TwoSameNames, hidden_gradients, reference
from tests.conftest import TinyRule

pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")

N_ITER = 3


class Keep(instrument.Observer):
    """Keeps every context's probes (cloned) and the gradients it is given."""

    def __init__(self, probes=("hidden", "update")) -> None:
        super().__init__("keep")
        self.probes = tuple(probes)
        self.reset()

    def reset(self) -> None:
        self.seen, self.indices, self.gradients = [], [], None

    def observe(self, context) -> None:
        self.seen.append({k: v.clone() for k, v in context.probes.items()})
        self.indices.append(context.step_index)

    def observe_gradients(self, gradients) -> None:
        self.gradients = {k: list(v) for k, v in gradients.items()}


def session(*observers, **kw) -> instrument.Instrumentation:
    return instrument.Instrumentation(observers=list(observers), backends=kw.pop("backends", []), **kw)


def seed_state() -> torch.Tensor:
    return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))


def new_rule(**kw) -> Rule:
    torch.manual_seed(0)
    return Rule(**kw)


def assert_untouched(rule: torch.nn.Module) -> None:
    for module in rule.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert "forward" not in module.__dict__
        if isinstance(module, instrument.Probe):
            assert module.enabled is False
    assert record.active_recorder() is None


def assert_matches(seen, expected) -> None:
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected, strict=True):
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ eager
def test_eager_watched_rule_gives_each_iteration_its_probe_values_on_logging_steps_only():
    rule, keep = new_rule(), Keep()
    inst = session(keep, log_interval=2)
    inst.watch(rule)
    x0 = seed_state()
    for step in range(3):
        with inst.step(step) as s:
            x = x0
            for _ in range(N_ITER):
                x = rule(x)
            if not s.active:
                assert_untouched(rule)
        assert_untouched(rule)
        if step == 0:
            assert keep.indices == list(range(N_ITER))
            assert_matches(keep.seen, reference(rule, x0, N_ITER))
            assert all(not v.requires_grad for d in keep.seen for v in d.values())
            first = keep.seen
    assert len(first) == N_ITER  # step 1 did not log; step 2 logged again with reset()
    assert_matches(keep.seen, reference(rule, x0, N_ITER))
    inst.close()


def test_off_probe_is_identity_and_on_probe_returns_its_input():
    probe = instrument.Probe("p")
    x = torch.randn(3, requires_grad=True)
    assert probe(x) is x
    probe.enabled = True
    assert probe(x) is x  # nothing copied on the data path
    grad_probe = instrument.Probe("g", grad=True)
    grad_probe.enabled = True
    y = grad_probe(x)
    assert y is not x and torch.equal(y, x)  # a custom op's output may not alias its input
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3))  # identity gradient


class InPlaceAfterProbe(torch.nn.Module):
    """Changes the probed value in place after the probe, on every call or only from ``from_call`` on."""

    def __init__(self, from_call: int = 0) -> None:
        super().__init__()
        self.p_h = instrument.Probe("h")
        self.p_out = instrument.Probe("out")
        self.from_call, self.calls = from_call, 0
        self.seen = []  # the tensors the probes were given, as the model holds them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.p_h(torch.sin(3.0 * x))  # both signs, every call
        self.seen.append((h.clone(), h))
        if self.calls >= self.from_call:
            h.relu_()  # the common pattern: an in-place activation right after the probe
        self.calls += 1
        return self.p_out(h + 1.0)


class KeepRefs(instrument.Observer):
    probes = ("h", "out")

    def reset(self) -> None:
        self.values = []

    def observe(self, context) -> None:
        self.values.append(dict(context.probes))


def _in_place_run(model, steps=2, n=4):
    keep = KeepRefs("keep")
    inst = session(keep, log_interval=1)
    inst.watch(model)
    recorders = []
    x0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    runs = []
    for step in range(steps):
        model.seen.clear()
        with inst.step(step):
            x = x0
            for _ in range(n):
                x = model(x)
            recorders.append(inst._recorder)
        runs.append((list(model.seen), list(keep.values)))
    inst.close()
    return runs, recorders


@pytest.fixture()
def fresh_copied():
    """Which probes are copied at recording is learned per session, and for recorders without one per process:
    isolate each test from the latter."""
    saved = set(record._shared[1])
    record._shared[1].clear()
    yield
    record._shared[1].clear()
    record._shared[1].update(saved)


def test_probe_value_changed_in_place_after_the_probe_delivers_the_value_it_saw(fresh_copied):
    runs, _ = _in_place_run(InPlaceAfterProbe())
    for seen, delivered in runs:
        assert len(delivered) == len(seen) == 4
        for (before, held), values in zip(seen, delivered, strict=True):
            assert bool((before < 0).any())  # relu_ really changed it...
            assert torch.equal(values["h"], before)  # ...and the probe still delivers the value it saw
            assert values["h"].data_ptr() != held.data_ptr()


def test_unmodified_probe_value_is_delivered_without_a_copy(fresh_copied):
    runs, recorders = _in_place_run(InPlaceAfterProbe(from_call=10**6))  # never changed in place
    for seen, delivered in runs:
        for (before, held), values in zip(seen, delivered, strict=True):
            assert values["h"] is not None and torch.equal(values["h"], before)
            assert values["h"].data_ptr() == held.data_ptr()  # the model's own tensor: no copy
    # 2 probes x 4 calls per step: one copy per probe per step (its first value, kept until delivery shows
    # it was not needed), none for the other calls.
    assert [(r.recorded, r.delivered, r.copies) for r in recorders] == [(8, 8, 2), (8, 8, 2)]


def test_probe_changed_only_on_a_later_call_drops_that_value_and_copies_from_then_on(fresh_copied, caplog):
    runs, _ = _in_place_run(InPlaceAfterProbe(from_call=2), steps=2, n=4)
    (seen, delivered), (seen2, delivered2) = runs
    # Step 0: calls 0-1 unchanged (delivered by reference); call 2 changed after a by-reference record:
    # its value is dropped, never delivered wrong; call 3 is copied at recording.
    assert [("h" in v) for v in delivered] == [True, True, False, True]
    for (before, _), values in zip(seen, delivered, strict=True):
        if "h" in values:
            assert torch.equal(values["h"], before)
    assert "modified in place after the probe" in caplog.text
    # Step 1: every call is copied at recording, every value is the one the probe saw.
    for (before, _), values in zip(seen2, delivered2, strict=True):
        assert torch.equal(values["h"], before)


def test_a_probe_copied_in_one_session_is_not_copied_for_another_sessions_model_of_that_name(fresh_copied):
    """Which probes are copied at recording was learned per probe name for the whole process: once one model changed
    its "h" in place, a later session's unrelated model paid a copy of every value of its own "h" and "out"."""
    _, changing = _in_place_run(InPlaceAfterProbe(), steps=2)
    assert [r.copies for r in changing] == [5, 5]  # "h" copied at each of its 4 calls, "out" once (its first)
    _, fresh = _in_place_run(InPlaceAfterProbe(from_call=10**6), steps=2)
    assert [(r.recorded, r.delivered, r.copies) for r in fresh] == [(8, 8, 2), (8, 8, 2)]  # as in a fresh process


def test_whole_rollout_model_watched_for_probes_only_with_explicit_observer_calls():
    torch.manual_seed(0)
    model, keep = Model(), Keep(("hidden", "update", "seed"))
    inst = session(keep, log_interval=1)
    handle = inst.watch(model, state=False)
    assert handle.watch is None and sorted(inst.probe_names) == ["hidden", "seed", "update"]
    x0 = seed_state()
    with inst.step(0) as s:
        x = model.encoder_probe(x0)
        for _ in range(N_ITER):
            nxt = model.rule(x)
            s.observer(instrument.StepContext(x, nxt))
            x = nxt
    expected = reference(model.rule, x0, N_ITER)
    expected[0]["seed"] = x0  # recorded before the first observer call, so delivered with it
    assert_matches(keep.seen, expected)
    assert_untouched(model)
    inst.close()


def _hidden_mean_run(observer, tmp_path):
    """One logging step of the probed rule with ``observer`` and a JSONL backend: the last line's metrics, the
    session's failures, and the float64 reference of the mean of the iterations' hidden means."""
    rule, path = new_rule(), tmp_path / "m.jsonl"
    inst = session(observer, backends=[instrument.JsonlBackend(path=str(path))], log_interval=1)
    inst.watch(rule)
    x0 = seed_state()
    with inst.step(0):
        x = x0
        for _ in range(N_ITER):
            x = rule(x)
    inst.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    want = torch.stack([r["hidden"].mean() for r in reference(rule, x0, N_ITER)]).mean()
    return rows[-1]["metrics"], inst.failures, float(want)


def test_probe_values_reach_a_backend(tmp_path):
    class HiddenMean(instrument.Observer):
        probes = ("hidden",)

        def reset(self):
            self.means = []

        def observe(self, context):
            self.means.append(context.probes["hidden"].mean())

        def log(self, logger, step):
            logger.log_metrics({f"{self.name}/hidden_mean": torch.stack(self.means).mean()}, step=step)

    metrics, _, want = _hidden_mean_run(HiddenMean(), tmp_path)
    assert metrics["hidden_mean/hidden_mean"] == pytest.approx(want, rel=1e-6)


def test_the_observer_of_docs_probes_md_runs_as_written(tmp_path):
    """docs/probes.md's HiddenStats, taken from the page with its imports: it used to raise on every logging
    step (no torch import, and a tensor of every iteration's mean where log_metrics takes a scalar)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "probes.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    imports = [line for line in block.splitlines() if line.startswith(("import ", "from "))]
    observer = block[block.index("class HiddenStats"):block.index("\ninst = ")]
    namespace: dict = {}
    exec("\n".join(imports) + "\n" + observer, namespace)  # noqa: S102 - the documented code, as a user pastes it
    metrics, failures, want = _hidden_mean_run(namespace["HiddenStats"](), tmp_path)
    assert failures == {}, failures
    assert metrics["hidden_stats/hidden_mean"] == pytest.approx(want, rel=1e-6)


def test_undelivered_probe_values_are_reported(caplog):
    torch.manual_seed(0)
    model = Model()
    inst = session(Keep(()), log_interval=1)
    inst.watch(model, state=False)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        model(seed_state(), 2)
    assert "no observer call delivered them" in caplog.text
    inst.close()


# ------------------------------------------------------------------------------------------- gradients
def test_gradient_probe_delivers_each_iterations_gradient_before_log():
    rule, keep = new_rule(grad=True), Keep()
    inst = session(keep, log_interval=1)
    inst.watch(rule)
    x0 = seed_state()
    with inst.step(0):
        x = x0
        for _ in range(N_ITER):
            x = rule(x)
        x.square().mean().backward()
    grads_on = [p.grad.clone() for p in rule.parameters()]
    inst.close()
    # Reference: the same rollout without instrumentation, keeping the hidden activations' gradients.
    hidden, x = [], x0
    for _ in range(N_ITER):
        h = torch.relu(rule.fc0(rule.perceive(x)))
        h.retain_grad()
        hidden.append(h)
        x = x + rule.fc1(h)
    rule.zero_grad()
    x.square().mean().backward()
    assert list(keep.gradients) == ["hidden"]
    assert len(keep.gradients["hidden"]) == N_ITER
    for got, h in zip(keep.gradients["hidden"], hidden, strict=True):
        torch.testing.assert_close(got, h.grad, rtol=0, atol=0)
    # Pure side channel: parameter gradients are bitwise those of the uninstrumented step.
    for on, p in zip(grads_on, rule.parameters(), strict=True):
        assert torch.equal(on, p.grad)


def test_two_backward_passes_deliver_one_gradient_per_iteration_the_gradient_of_the_losses_sum(caplog):
    """Two losses each with its own backward (retain_graph=True): each pass recorded every gradient probe, so
    2n gradients came for n iterations and gradients[i] was no iteration's. Now passes are summed per
    iteration, as one backward of the sum gives; a count that pairs with nothing is said once."""
    rule, keep = new_rule(grad=True), Keep()
    inst = session(keep, log_interval=1)
    inst.watch(rule)
    x0 = seed_state()
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        x = x0
        for _ in range(N_ITER):
            x = rule(x)
        x.square().mean().backward(retain_graph=True)
        x.mean().backward()
    want = hidden_gradients(rule, x0, N_ITER, lambda x: x.square().mean() + x.mean())
    assert len(keep.gradients["hidden"]) == N_ITER
    for got, grad in zip(keep.gradients["hidden"], want, strict=True):
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-7)
    assert "taken as 2 backward passes over the whole rollout" in caplog.text  # a count cannot tell more
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(1):  # backward over the last 2 only
        x = x0
        for i in range(N_ITER):
            x = rule(x.detach() if i == N_ITER - 2 else x)
        x.mean().backward()
    inst.close()
    assert len(keep.gradients["hidden"]) == 2
    assert "cannot be paired with iterations" in caplog.text


class InPlaceAfterGradProbe(torch.nn.Module):
    """``h = probe(h); h.mul_(2)``: a model may change a gradient probe's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.p = instrument.Probe("h", grad=True)

    def forward(self, x):
        h = self.p(torch.tanh(self.lin(x)))
        h.mul_(2)
        return x + h


def test_gradient_probe_output_may_be_changed_in_place():
    """The gradient probe returns a copy, not a view made inside an autograd function (which autograd forbids
    changing in place), so a model that worked without instrument still works on a logging step."""
    torch.manual_seed(0)
    model, keep = InPlaceAfterGradProbe(), Keep(("h",))
    inst = session(keep, log_interval=1)
    inst.watch(model)
    x = torch.randn(2, 3, requires_grad=True)
    with inst.step(0):
        model(x).sum().backward()
    inst.close()
    h = torch.tanh(model.lin(x))
    h.retain_grad()
    (x + h * 2).sum().backward()
    torch.testing.assert_close(keep.seen[0]["h"], h.detach())       # the value the probe saw, before mul_
    torch.testing.assert_close(keep.gradients["h"][0], h.grad)       # d loss / d h = 2


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputation_records_nothing_twice(use_reentrant):
    rule, keep = new_rule(grad=True), Keep()
    inst = session(keep, log_interval=1)
    inst.watch(rule)
    x0 = seed_state().requires_grad_()
    with inst.step(0):
        x = x0
        for _ in range(N_ITER):
            x = torch.utils.checkpoint.checkpoint(rule, x, use_reentrant=use_reentrant)
        x.square().mean().backward()
    inst.close()
    assert keep.indices == list(range(N_ITER))
    assert_matches(keep.seen, reference(rule, x0, N_ITER))
    assert len(keep.gradients["hidden"]) == N_ITER


# ------------------------------------------------------------------------------------------ TorchScript
def scripted_rollout(inst, module, x0):
    with inst.step(0) as s:
        x = x0
        for _ in range(N_ITER):
            nxt = module(x)
            s.observer(instrument.StepContext(x, nxt))
            x = nxt
    return x


def test_scripted_model_records_the_same_values_as_eager():
    rule = new_rule()
    scripted = torch.jit.script(rule)
    keep = Keep()
    inst = session(keep, log_interval=1)
    handle = inst.watch(scripted, state=False)  # the loop delivers (watched with no loop code: test_script_watch)
    assert handle.watch is None
    x0 = seed_state()
    scripted_rollout(inst, scripted, x0)
    assert_matches(keep.seen, reference(rule, x0, N_ITER))
    assert not scripted.p_hidden.enabled and not scripted.p_update.enabled
    inst.close()


def test_scripted_probes_copy_once_per_step_unless_the_value_is_changed_in_place(fresh_copied):
    rule = new_rule()
    scripted = torch.jit.script(rule)
    inst = session(Keep(), log_interval=1)
    inst.watch(scripted, state=False)
    with inst.step(0) as s:
        x = seed_state()
        for _ in range(N_ITER):
            nxt = scripted(x)
            s.observer(instrument.StepContext(x, nxt))
            x = nxt
        recorder = inst._recorder
    assert (recorder.recorded, recorder.delivered, recorder.copies) == (2 * N_ITER, 2 * N_ITER, 2)
    inst.close()

    changed = torch.jit.script(InPlaceRule())  # relu_ on the probed value after the probe
    keep = Keep(("h",))
    inst = session(keep, log_interval=1)
    inst.watch(changed, state=False)
    inputs = []
    with inst.step(0) as s:
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(4))
        for _ in range(N_ITER):
            inputs.append(x)
            nxt = changed(x)
            s.observer(instrument.StepContext(x, nxt))
            x = nxt
    inst.close()
    for x, seen in zip(inputs, keep.seen, strict=True):
        assert bool((torch.sin(3.0 * x) < 0).any())
        assert torch.equal(seen["h"], torch.sin(3.0 * x))  # the value before relu_


def test_probe_values_under_inference_mode_are_copied(fresh_copied):
    model = InPlaceAfterProbe(from_call=10**6)
    keep = KeepRefs("keep")
    inst = session(keep, log_interval=1)
    inst.watch(model)
    with torch.inference_mode(), inst.step(0):
        x = torch.randn(2, 3)
        for _ in range(3):
            x = model(x)
        recorder = inst._recorder
    inst.close()
    assert recorder.copies == recorder.recorded == 6  # no version counter to rely on
    for (before, _), values in zip(model.seen, keep.values, strict=True):
        assert torch.equal(values["h"], before)


def test_freeze_without_probes_has_the_ops_of_the_probe_free_model():
    rule = new_rule().eval()
    bare = BareRule().eval()
    bare.load_state_dict(rule.state_dict())
    frozen = instrument.freeze(torch.jit.script(rule))
    frozen_bare = torch.jit.freeze(torch.jit.script(bare))

    def kinds(module):
        return sorted(node.kind() for node in module.graph.nodes())

    assert kinds(frozen) == kinds(frozen_bare)
    assert "instrument::" not in str(frozen.graph)
    x = seed_state()
    assert torch.equal(frozen(x), frozen_bare(x))
    # instrument.script compiles a call boundary (a forward hook) in; freezing removes it with the probes,
    # by instrument.freeze and by plain torch.jit.freeze alike.
    with_boundary = instrument.script(rule)
    assert "instrument::call_end" in str(with_boundary._c._get_forward_hooks()[0].graph)
    for frozen in (instrument.freeze(with_boundary), torch.jit.freeze(with_boundary)):
        assert kinds(frozen) == kinds(frozen_bare)
        assert "instrument::" not in str(frozen.graph) and not frozen._c._get_forward_hooks()
        assert torch.equal(frozen(x), frozen_bare(x))


def test_freeze_keeping_probes_stays_toggleable():
    rule = new_rule().eval()
    scripted = torch.jit.script(rule)
    frozen = instrument.freeze(scripted, keep_probes=True)
    keep = Keep()
    inst = session(keep, log_interval=1)
    inst.watch(frozen, state=False)
    x0 = seed_state()
    scripted_rollout(inst, frozen, x0)
    assert_matches(keep.seen, reference(rule, x0, N_ITER))
    inst.close()


SUBPROCESS = """
import sys, warnings, torch
warnings.simplefilter("ignore", DeprecationWarning)
import instrument                                   # registers torch.ops.instrument.probe
torch.set_num_threads(int(sys.argv[4]))             # same kernels, same bits as the parent process
loaded = torch.jit.load(sys.argv[1])
class Keep(instrument.Observer):
    probes = ("hidden", "update")
    def reset(self): self.seen = []
    def observe(self, context): self.seen.append({k: v.clone() for k, v in context.probes.items()})
keep = Keep()
inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
inst.watch(loaded, state=False)
x = torch.load(sys.argv[2])
with inst.step(0) as s:
    for _ in range({n}):
        nxt = loaded(x)
        s.observer(instrument.StepContext(x, nxt))
        x = nxt
inst.close()
torch.save(keep.seen, sys.argv[3])
"""


def test_save_and_load_in_a_fresh_process_keeps_probes_working(tmp_path):
    rule = new_rule()
    torch.jit.save(torch.jit.script(rule), str(tmp_path / "rule.pt"))
    x0 = seed_state()
    torch.save(x0, tmp_path / "x0.pt")
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent(SUBPROCESS).replace("{n}", str(N_ITER)))
    repo = Path(instrument.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    files = [str(tmp_path / name) for name in ("rule.pt", "x0.pt", "o.pt")]
    args = [sys.executable, str(script), *files, str(torch.get_num_threads())]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_matches(torch.load(tmp_path / "o.pt"), reference(rule, x0, N_ITER))


# ------------------------------------------------------------------------------------------------ export
def test_export_with_probes_off_has_no_probe_op():
    rule = new_rule()
    x = seed_state()
    exported = torch.export.export(rule, (x,))
    assert "instrument" not in str(exported.graph)
    assert torch.equal(exported.module()(x), rule(x))


# ------------------------------------------------------------------------------------------------ errors
def test_duplicate_probe_names_in_one_model_are_refused():
    inst = session()
    with pytest.raises(instrument.ProbeError,
                       match=r"two probes named 'h' in watched model TwoSameNames: at 'a.1' and 'b'"):
        inst.watch(TwoSameNames())
    inst.close()


def test_same_probe_name_in_two_watched_models_is_refused():
    inst = session()
    inst.watch(new_rule())
    with pytest.raises(instrument.ProbeError,
                       match=r"probe 'hidden' of Rule .* same name as a probe of already watched"):
        inst.watch(new_rule())
    inst.close()


def test_observer_asking_for_a_missing_probe_fails_at_the_first_logging_step():
    inst = session(Keep(("hidden", "hiden")), log_interval=1)
    inst.watch(new_rule())
    with pytest.raises(instrument.ProbeError,
                       match=r"observer 'keep' asks for probe\(s\) \['hiden'\], but no watched model has a "
                       r"probe of that name \(probes found: \['hidden', 'update'\]\)"):
        with inst.step(0):
            pass
    inst.close()


def test_gradient_probe_is_refused_by_scripting():
    with pytest.raises(instrument.ProbeError,
                       match=r"gradient probe 'hidden' cannot be scripted: TorchScript drops backward hooks"):
        torch.jit.script(new_rule(grad=True))


def test_gradient_probe_switched_on_in_a_scripted_module_is_refused_by_watch():
    scripted = torch.jit.script(new_rule())
    scripted.p_update.grad = True
    with pytest.raises(instrument.ProbeError, match=r"gradient probe 'update' cannot be scripted"):
        session().watch(scripted)


def test_future_annotations_breaking_scripting_is_explained(tmp_path, monkeypatch):
    (tmp_path / "future_rule.py").write_text(textwrap.dedent("""
        from __future__ import annotations
        from typing import List
        from torch import Tensor, nn
        import instrument

        class FutureRule(nn.Module):
            history: List[Tensor]
            def __init__(self):
                super().__init__()
                self.probe = instrument.Probe("h")
                self.history = []
            def forward(self, x: Tensor) -> Tensor:
                return self.probe(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from future_rule import FutureRule

    with pytest.raises(instrument.ProbeError,
                       match=r"module\(s\) \['future_rule'\] start with 'from __future__ import annotations'"
                       r".*Unknown type annotation"):
        instrument.script(FutureRule())
    assert isinstance(instrument.script(new_rule()), torch.jit.ScriptModule)  # no warning, no error


def test_bad_probe_names_and_frozen_probes_without_names_are_refused():
    with pytest.raises(instrument.ProbeError, match=r"Probe name must be a non-empty string"):
        instrument.Probe("")
    rule = new_rule().eval()
    frozen = torch.jit.freeze(torch.jit.script(rule), preserved_attrs=["p_hidden.enabled"])
    with pytest.raises(instrument.ProbeError,
                       match=r"has lost its name.*instrument.freeze\(scripted, keep_probes=True\)"):
        session().watch(frozen)


COPY_IN_A_LOGGING_STEP = textwrap.dedent(
    """
    import copy, io, sys
    import torch
    if sys.argv[1] == "dynamo":  # what stepping a torch.optim.Adam does in every training run
        import torch._dynamo
    import instrument
    from tests._probe_models import Rule

    seen = []

    class Keep(instrument.Observer):
        def observe(self, context):
            seen.append(float(context.probes["hidden"].sum()))

        def log(self, logger, step):
            pass

    assert ("torch._dynamo" in sys.modules) == (sys.argv[1] == "dynamo")
    rule = Rule()
    inst = instrument.Instrumentation([Keep()], backends=[], log_interval=2)
    inst.watch(rule)
    x = torch.randn(2, 4, 6, 6)
    with inst.step(2):
        rule(x)
        twin = copy.deepcopy(rule)        # a checkpoint taken during a logging step
        torch.save(rule, io.BytesIO())
        twin(x * 1000)                    # the copy is not watched: nothing of it reaches the observers
    assert len(seen) == 1, seen
    for step in (3, 4):
        with inst.step(step):
            rule(x)
            twin(x * 1000)
    assert len(seen) == 2 and abs(seen[1] - seen[0]) < 1e-3 * max(1.0, abs(seen[0])), seen
    assert all(not p.enabled for p in twin.modules() if isinstance(p, instrument.Probe))
    instrument.script(twin)  # the copy's inert hook is dropped: TorchScript could not compile it
    assert not twin._forward_hooks
    inst.close()
    print("ok")
    """
)


@pytest.mark.parametrize("dynamo", ["eager-only", "dynamo"])
def test_a_copy_or_checkpoint_of_a_watched_model_taken_in_a_logging_step_is_inert(tmp_path, dynamo):
    """copy.deepcopy and torch.save of the model inside a logging step raised (the session's hook refers to
    locks), and a copy kept its probes on, recording into the next logging steps under the same names. Once
    torch._dynamo was imported (any process that steps an Adam optimizer) the copy still shared the session's
    hook, observed forever, and torch.save raised. In a process of its own, so that whether Dynamo is imported
    is up to the test."""
    script = tmp_path / "copy_in_step.py"
    script.write_text(COPY_IN_A_LOGGING_STEP)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), dynamo], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_copy_taken_in_a_logging_step_loses_the_switched_forward_once_a_session_watches_it():
    """A copy (deepcopy, torch.save) of a model with probes kept the session's instance-level forward for good,
    and a session watching the copy took it for the user's own and left it: the copy was never restored."""
    import copy
    import io

    rule = Rule()
    inst = instrument.Instrumentation([], backends=[], log_interval=1)
    inst.watch(rule, state=False)
    x = torch.randn(2, 4, 6, 6)
    with inst.step(0):
        rule(x)
        twin = copy.deepcopy(rule)
        buffer = io.BytesIO()
        torch.save(rule, buffer)
    inst.close()
    assert "forward" not in rule.__dict__
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert "forward" in other.__dict__  # what the copy carried along: the class's code, bound to the copy
        torch.testing.assert_close(other(x), rule(x), rtol=0, atol=0)
        later = instrument.Instrumentation([], backends=[], log_interval=1)
        later.watch(other, state=False)
        with later.step(0):
            assert other.__dict__["forward"].__func__.__code__.co_name.endswith("_instrument_probes_on")
            other(x)
        later.close()
        assert "forward" not in other.__dict__  # restored: as if it had never been copied during a step
        torch.testing.assert_close(other(x), rule(x), rtol=0, atol=0)


def test_scripting_during_a_logging_step_leaves_the_models_probes_and_starts_the_copy_off():
    """torch.jit.script puts what Probe.__prepare_scriptable__ returns into the eager model: returning a copy
    there replaced the watched model's probes, which the session then never saw again."""
    names = []

    class KeepNames(instrument.Observer):
        def observe(self, context):
            names.append(sorted(context.probes))

        def log(self, logger, step):
            pass

    rule = Rule()
    inst = instrument.Instrumentation([KeepNames()], backends=[], log_interval=1)
    inst.watch(rule, state=False)
    x = torch.randn(2, 4, 6, 6)
    originals = [rule.p_hidden, rule.p_update]
    with inst.step(0) as s:
        scripted = instrument.script(rule)
        rule(x)
        s.observer(instrument.StepContext(x, x))
    with inst.step(1) as s:
        rule(x)
        s.observer(instrument.StepContext(x, x))
    inst.close()
    assert [rule.p_hidden, rule.p_update] == originals
    assert names == [["hidden", "update"], ["hidden", "update"]]
    assert [bool(p.enabled) for _, p in instrument.probes.script.scripted_probes(scripted)] == [False, False]


def test_a_rule_that_changes_its_state_argument_in_place_is_observed_with_a_copy_of_it(tmp_path, caplog):
    """`x.add_(dx); return x`: the hook after the call read the argument as previous_state, which already held
    the next state, so UpdateNorm logged 0 from the second logging step on, silently. Then the first such call was
    not observed. Now copies are taken throughout the first logging step that calls a watched module, so every
    call, the first included, is observed with the state from before it; said once. Float64 NumPy reference."""
    import json

    import numpy as np

    class InPlace(torch.nn.Module):
        def forward(self, x):
            return x.add_(torch.sin(x) + 0.5)

    inst = instrument.Instrumentation([instrument.UpdateNorm()], backends=[instrument.JsonlBackend()],
                                      log_interval=1, run_name="r", log_dir=str(tmp_path))
    rule = InPlace()
    inst.watch(rule)
    norms = []
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(3):
            x = torch.linspace(-1, 1, 2 * 4 * 9).reshape(2, 4, 3, 3)
            with inst.step(step), torch.no_grad():
                for _ in range(3):
                    before = x.double().numpy().copy()
                    x = rule(x)
                    dx = x.double().numpy() - before
                    norms.append(np.sqrt((dx.reshape(2, -1) ** 2).sum(1)).mean())
    inst.close()
    said = [r for r in caplog.records if "changed its state argument in place" in r.getMessage()]
    assert len(said) == 1
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["metrics"].get("update_norm/l2/mean") for r in records if "metrics" in r}
    assert "This call is observed with a copy" in said[0].getMessage()
    # next_state is a copy too (the next call changes the returned tensor again), so the observers' buffers
    # keep batching and no step is dropped as "modified in place after it was observed"
    assert not [r for r in caplog.records if "after it was observed" in r.getMessage()]
    for step in (0, 1, 2):  # every iteration observed with the state from before the call, the first included
        assert logged[step] == pytest.approx(np.mean(norms[3 * step:3 * step + 3]), rel=1e-6)


class _CountClones(TorchDispatchMode):
    """Counts the ``aten.clone`` calls made while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.clone.default
        return func(*args, **(kwargs or {}))


def test_a_rule_that_changes_its_argument_and_returns_a_new_tensor_keeps_its_first_logging_step(tmp_path, caplog):
    """`x.clamp_(-1, 1); return x + dx`: the state a call returned was delivered by reference, and the next call
    clamped it in place, so every observer's kept reference of the first logging step changed after it was
    observed: IterationStats, UpdateNorm and StateHistogram lost that step (ERROR tracebacks), NonFinite marked it
    incomplete, and they reduced per iteration from then on. Now the returned state is delivered as a copy, as it
    was for a rule returning its argument. Float64 NumPy reference."""
    import json

    import numpy as np

    class ClampThenStep(torch.nn.Module):
        def forward(self, x):
            x.clamp_(-1.0, 1.0)
            return x + 0.25 * torch.tanh(3.0 * x + 0.5)

    observers = [instrument.IterationStats(images=False), instrument.UpdateNorm(), instrument.StateHistogram(),
                 instrument.NonFinite()]
    # overhead_budget=None: its report (a WARNING when a tiny step spends over 10 % in instrument, as on a loaded
    # machine) is not what is checked here, and the check below would read it as a fault.
    inst = instrument.Instrumentation(observers, backends=[instrument.JsonlBackend()], log_interval=1, run_name="r",
                                      log_dir=str(tmp_path), overhead_budget=None)
    rule = ClampThenStep()
    inst.watch(rule)
    clones = []
    reference = {}
    with caplog.at_level(logging.INFO, logger="instrument"):
        for step in range(3):
            x = torch.linspace(-3, 3, 2 * 4 * 9).reshape(2, 4, 3, 3)
            norms = []
            with inst.step(step), torch.no_grad():
                with _CountClones() as counted:
                    for _ in range(4):
                        before = x.double().numpy()
                        x = rule(x)
                        dx = x.double().numpy() - before
                        norms.append(np.sqrt((dx.reshape(2, -1) ** 2).sum(1)).mean())
                clones.append(counted.count)
            last = x.double().numpy()
            reference[step] = (np.mean(norms), last[:, 0].mean())
    inst.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["metrics"] for r in records if "metrics" in r}
    for step in range(3):
        assert logged[step]["update_norm/l2/mean"] == pytest.approx(reference[step][0], rel=1e-6)
        assert logged[step]["iteration_stats/mean/c0"] == pytest.approx(reference[step][1], rel=1e-6, abs=1e-7)
        assert logged[step]["nonfinite/incomplete"] == 0
    # once the rule is known to change its argument: its argument before each call, the state it returned after
    assert clones[1:] == [8, 8]


def test_a_rule_that_starts_changing_its_argument_mid_step_keeps_the_first_logging_step(tmp_path, caplog):
    """In the first logging step the inputs were copied but the outputs were delivered by reference until a call
    changed its argument: a rule that starts `x.clamp_()` at its third call changed the state the second call had
    delivered, and IterationStats, UpdateNorm and NonFinite lost the step (a review of the fix above). Under
    inference_mode, where observers keep no reference, a new tensor is not copied (16 clones, not 32)."""
    import json

    import numpy as np

    class LateClamp(torch.nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls >= 3:
                x.clamp_(-1.0, 1.0)
            return x + 0.25 * torch.tanh(3.0 * x + 0.5)

    observers = [instrument.IterationStats(images=False), instrument.UpdateNorm(), instrument.NonFinite()]
    # overhead_budget=None: its report (a WARNING when a tiny step spends over 10 % in instrument, as on a loaded
    # machine) is not what is checked here, and the check below would read it as a fault.
    inst = instrument.Instrumentation(observers, backends=[instrument.JsonlBackend()], log_interval=1, run_name="r",
                                      log_dir=str(tmp_path), overhead_budget=None)
    rule = LateClamp()
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0), torch.no_grad():
        x = torch.linspace(-3, 3, 2 * 4 * 9).reshape(2, 4, 3, 3)
        norms = []
        for _ in range(5):
            before = x.double().numpy()
            x = rule(x)
            norms.append(np.sqrt(((x.double().numpy() - before).reshape(2, -1) ** 2).sum(1)).mean())
    inst.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = next(r["metrics"] for r in records if r.get("step") == 0 and "metrics" in r)
    assert logged["update_norm/l2/mean"] == pytest.approx(np.mean(norms), rel=1e-6)
    assert logged["iteration_stats/mean/c0"] == pytest.approx(x[:, 0].double().mean().item(), rel=1e-5, abs=1e-6)
    assert logged["nonfinite/incomplete"] == 0

    class IdentityOnce(torch.nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return x if self.calls == 1 else x + 0.1 * torch.tanh(x)  # returns its argument once

    rule = IdentityOnce()
    inst = instrument.Instrumentation([instrument.IterationStats(images=False), instrument.UpdateNorm()],
                                      backends=[], log_interval=1)
    inst.watch(rule)
    clones = []
    for step in range(3):
        with inst.step(step), torch.inference_mode():
            x = torch.randn(2, 4, 3, 3)
            with _CountClones() as counted:
                for _ in range(8):
                    x = rule(x)
            clones.append(counted.count)
    inst.close()
    assert clones[1:] == [8, 8]  # the argument before each call only


class _Deltas(instrument.Observer):
    """Keeps |dx| (sum of absolute differences) of every observed iteration."""

    def reset(self):
        self.seen = []

    def observe(self, context):
        self.seen.append(float((context.next_state - context.previous_state).abs().sum()))

    def log(self, logger, step):
        pass


def _watched(rule, observer):
    inst = instrument.Instrumentation([observer], backends=[], log_interval=1)
    inst.watch(rule)
    return inst


def test_a_state_that_is_a_view_of_a_buffer_the_rule_writes_into_is_not_taken_for_an_in_place_change(caplog):
    """Ping-pong buffers: the state is buf[0] and the rule writes buf[1]; views share one version counter, so a
    version check alone flagged the call, dropped it and copied every later state."""

    class PingPong(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.buf = torch.zeros(2, 2, 3)

        def forward(self, x):
            return torch.add(x, 1.0, out=self.buf[1])

    rule, deltas = PingPong(), _Deltas()
    inst = _watched(rule, deltas)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        for _ in range(4):
            rule.buf[0].copy_(rule(rule.buf[0]))
        seen = list(deltas.seen)
    inst.close()
    assert seen == [6.0] * 4 and not [r for r in caplog.records if "in place" in r.getMessage()]


def test_a_rule_that_changes_its_argument_in_place_and_returns_a_new_tensor_is_observed_with_its_input(caplog):
    """`x.clamp_(-.5, .5); return x + ...`: the version check ran only for rules returning their own argument,
    so every iteration's previous_state was the clamped tensor, silently. Now the first call's copy catches it
    (said at INFO) and every call is observed with the state from before it."""

    class Clamp(torch.nn.Module):
        def forward(self, x):
            x.clamp_(-0.5, 0.5)
            return x + 0.25

    rule, deltas = Clamp(), _Deltas()
    inst = _watched(rule, deltas)
    expected = []
    with caplog.at_level(logging.INFO, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                x = torch.linspace(-2, 2, 12).reshape(2, 6)
                for _ in range(3):
                    before = x.double().clone()
                    x = rule(x)
                    expected.append(float((x.double() - before).abs().sum()))
                seen = list(deltas.seen)
            assert seen == pytest.approx(expected[3 * step:], rel=1e-6)
    inst.close()
    said = [r for r in caplog.records if "changed during its forward" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


class _Pairs(instrument.Observer):
    """Keeps each context's (step_index, previous, next), cloned."""

    def reset(self):
        self.seen = []

    def observe(self, context):
        self.seen.append((context.step_index, context.previous_state.clone(), context.next_state.clone()))

    def log(self, logger, step):
        pass


@pytest.mark.parametrize("mode", ["grad", "inference"])
@pytest.mark.parametrize("kind", ["returns itself", "clamps, returns anew"])
def test_a_rule_that_changes_its_argument_on_some_calls_only_is_observed_right_on_every_call(kind, mode):
    """In place on every third call only: the first call's copy said nothing about it, so a later call was
    dropped and the rest of the step renumbered (or, returning a new tensor, observed with the changed state;
    under inference_mode on every step, silently). Copies are now taken throughout the first logging step (and
    always under inference_mode, where no version counter tells), so every call is observed right."""

    class Sometimes(torch.nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls % 3 == 0:
                if kind == "returns itself":
                    return x.add_(1.0)
                x.clamp_(max=1.5)
            return x + 1.0

    rule, pairs = Sometimes(), _Pairs()
    inst = _watched(rule, pairs)
    for step in range(3):
        truth = []
        with inst.step(step), (torch.inference_mode() if mode == "inference" else contextlib.nullcontext()):
            x = torch.zeros(2, 3)
            for _ in range(5):
                before = x.clone()
                x = rule(x)
                truth.append((before, x.clone()))
            seen = list(pairs.seen)
        assert [i for i, _, _ in seen] == list(range(5))
        for (_, previous, following), (before, after) in zip(seen, truth, strict=True):
            assert torch.equal(previous, before) and torch.equal(following, after)
    inst.close()


def test_an_in_place_rule_whose_state_is_changed_through_data_between_calls_is_observed_right():
    """The copy of one call's output served as the next call's copy when the same tensor came back with the
    same version; a write through .data between calls moves no version, so previous_state was stale."""

    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x.add_(1.0)

    rule, pairs = AddOne(), _Pairs()
    inst = _watched(rule, pairs)
    for step in range(2):
        truth = []
        with inst.step(step):
            x = torch.ones(2, 3)
            for _ in range(4):
                before = x.clone()
                x = rule(x)
                truth.append((before, x.clone()))
                x.data.mul_(2.0)
            seen = list(pairs.seen)
        for (_, previous, _), (before, _) in zip(seen, truth, strict=True):
            assert torch.equal(previous, before)
    inst.close()


def test_a_call_that_cannot_be_observed_keeps_the_later_calls_step_index(caplog):
    """A rule that starts changing its argument in place after the first logging step: that call has no copy
    and is not observed (said once), and the calls after it keep their indices (they were renumbered)."""

    class Late(torch.nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 8:  # the second logging step's third call
                x.clamp_(max=0.5)
            return x + 1.0

    rule, pairs = Late(), _Pairs()
    inst = _watched(rule, pairs)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                x = torch.zeros(2, 3)
                for _ in range(5):
                    x = rule(x)
                seen = [i for i, _, _ in pairs.seen]
    inst.close()
    assert seen == [0, 1, 3, 4]
    assert "This call is not observed" in caplog.text


def test_a_list_state_whose_element_is_replaced_is_observed_with_the_element_before_the_call():
    class Replace(torch.nn.Module):
        def forward(self, state):
            state[0] = state[0] + 1.0
            return state

    rule, deltas = Replace(), _Deltas()
    inst = _watched(rule, deltas)
    with inst.step(0):
        state = [torch.zeros(2, 3)]
        for _ in range(3):
            state = rule(state)
        seen = list(deltas.seen)
    inst.close()
    assert seen == [6.0] * 3


def test_in_place_rules_on_two_threads_and_under_inference_mode_pair_each_call_with_its_own_state():
    """One record per call in progress: two threads' calls no longer swapped their states (|dx| 245 and 0
    where every call adds 1). Under inference_mode (no version counter) the first call was observed with dx 0;
    now every call is observed with a copy taken before it."""
    import threading

    class InPlace(torch.nn.Module):
        barrier = None  # two threads' calls overlap: both pre-hooks run before either forward goes on

        def forward(self, x):
            if self.barrier is not None:
                self.barrier.wait(timeout=30)
            return x.add_(1.0)

    rule, deltas = InPlace(), _Deltas()
    rule.barrier = threading.Barrier(2)
    inst = _watched(rule, deltas)
    for step in range(2):
        with inst.step(step):
            def run(start):
                x = torch.full((2, 3), start)
                for _ in range(5):
                    x = rule(x)

            threads = [threading.Thread(target=run, args=(float(s),)) for s in (0, 100)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seen = list(deltas.seen)
        assert all(d == 6.0 for d in seen) and len(seen) == 10, seen
    inst.close()

    rule, deltas = InPlace(), _Deltas()
    inst = _watched(rule, deltas)
    with inst.step(0), torch.inference_mode():
        x = torch.zeros(2, 3)
        for _ in range(3):
            x = rule(x)
        seen = list(deltas.seen)
    inst.close()
    assert seen == [6.0, 6.0, 6.0]


def test_a_refused_logging_step_of_a_second_session_leaves_the_first_sessions_probes_on():
    """Two sessions watch one model; the second's logging step inside the first's is refused (one recorder at a
    time), and its clean-up switched the shared probes off: the first session's later iterations lost them."""
    rule = new_rule()
    first, second = Keep(), Keep()
    outer, inner = session(first, log_interval=1), session(second, log_interval=1)
    outer.watch(rule)
    inner.watch(rule)
    x0 = seed_state()
    with outer.step(0), torch.no_grad():
        x = rule(x0)
        with pytest.raises(instrument.ProbeError, match="another Instrumentation is inside a logging step"):
            with inner.step(0):
                pass
        for _ in range(N_ITER - 1):
            x = rule(x)
    outer.close()
    inner.close()
    assert_matches(first.seen, reference(rule, x0, N_ITER))
    assert_untouched(rule)


class _EagerAround(torch.nn.Module):
    """An eager per-iteration module whose work is a ScriptModule submodule with probes."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("how", ["instrument.script", "torch.jit.script"])
def test_probes_of_a_scripted_submodule_of_an_eager_model_are_found_and_delivered(how):
    """watch(outer) looked for `Probe` instances only: a ScriptModule child's probes are not, so none was found
    (an observer asking for one was told to add it; otherwise its values were silently missing)."""
    rule = new_rule().eval()
    inner = instrument.script(rule) if how == "instrument.script" else torch.jit.script(rule)
    outer = _EagerAround(inner)
    keep = Keep()
    inst = session(keep, log_interval=1)
    inst.watch(outer)
    assert sorted(inst.probe_names) == ["hidden", "update"]
    x = seed_state()
    with torch.no_grad(), inst.step(0):
        for _ in range(3):
            x = outer(x)
    inst.close()
    want = reference(new_rule().eval(), seed_state(), 3)
    assert keep.indices == [0, 1, 2]
    for got, ref in zip(keep.seen, want, strict=True):
        for name in ("hidden", "update"):
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)
    assert not any(probe.enabled for _, probe in instrument.probes.script.scripted_probes(inner))  # off again


@pytest.mark.parametrize("dynamo", ["plain", "dynamo"])
def test_a_copy_taken_in_a_logging_step_drops_its_inert_hooks_at_its_first_call(dynamo):
    """A copy made during a logging step (a DQN target network) kept two inert hooks for good, so every later
    call of it took torch's hooked call path (about 4 us a call on CPU): on non-logging steps too."""
    import copy

    if dynamo == "dynamo":  # the hooks are Dynamo-skipping then; copies must still drop theirs
        importlib.import_module("torch._dynamo")
    rule = TinyRule()
    inst = instrument.Instrumentation([], backends=[], log_interval=1)
    inst.watch(rule)
    x = torch.randn(2, 4, 6, 6)
    with inst.step(0):
        rule(x)
        twin = copy.deepcopy(rule)
    inst.close()
    tables = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    assert twin._forward_hooks and twin._forward_pre_hooks  # the inert stand-ins, until the copy runs
    torch.testing.assert_close(twin(x), rule(x), rtol=0, atol=0)
    assert not any(getattr(twin, table) for table in tables)
    assert not any(getattr(rule, table) for table in tables)


def test_a_gradient_probe_on_a_strided_view_leaves_training_bitwise_as_it_is():
    """WatchGradient's copy of a non-dense view (``h[:, ::2]``) came out contiguous, so a reduction after the probe
    added in another order and a logging step's numbers differed in their last bits from the same step without the
    probe (a review). The copy now keeps the view's strides."""
    from instrument.probes.copies import same_layout_copy

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(16, 64), torch.nn.Linear(32, 1)
            self.probe = instrument.Probe("half", grad=True)

        def forward(self, x):
            h = self.probe(torch.tanh(self.l1(x))[:, ::2])
            return self.l2(h).squeeze(-1) + h.sum(1) * 1e-3

    def train(instrumented):
        torch.manual_seed(0)
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        inst = instrument.Instrumentation(observers=[], backends=[], log_interval=1) if instrumented else None
        if inst is not None:
            inst.watch(net, state=False)
        for step in range(3):
            x = torch.randn(256, 16)
            with inst.step(step) if inst is not None else contextlib.nullcontext():
                loss = net(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        if inst is not None:
            inst.close()
        return [p.detach().clone() for p in net.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True), strict=True))
    view = torch.randn(8, 6)[:, ::2]
    assert same_layout_copy(view).stride() == view.stride() and torch.equal(same_layout_copy(view), view)
    broadcast = torch.randn(1, 3).expand(4, 3)
    assert torch.equal(same_layout_copy(broadcast), broadcast)
    token = torch.randn(4, 50, 8)[:, 0]  # one token of many: a contiguous copy, not the span of the whole tensor
    assert torch.equal(same_layout_copy(token), token)
    assert same_layout_copy(token).untyped_storage().nbytes() == token.numel() * token.element_size()
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass keeps its type (and both parts)

    pair = TwoTensor(torch.randn(4, 6), torch.randn(4, 6))[:, ::2]
    copied = same_layout_copy(pair)
    assert type(copied) is TwoTensor and torch.equal(copied.a, pair.a) and torch.equal(copied.b, pair.b)
