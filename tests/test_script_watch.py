"""Scripted, loaded and frozen models watched with no loop code: one `StepContext` per forward call, every value
equal to what the same watched eager model delivers.

`instrument.script` compiles a call boundary into the module (a typed forward hook calling
``instrument::call_end`` while switched on); ``torch.jit.script``-ed, frozen and old saved modules are observed
from Python. Saved modules are loaded in a fresh process.
"""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Tuple

import pytest
import torch

import instrument
from instrument.probes import record
from instrument.probes import script as scripting
from tests._probe_models import BareRule, CondRule, Loop, Rule, StateInPlaceRule, reference
from tests.conftest import read_scalars

pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")

N_ITER = 4


class Keep(instrument.Observer):
    """Keeps (cloned) everything each context carries."""

    def __init__(self, probes=("hidden", "update")) -> None:
        super().__init__("keep")
        self.probes = tuple(probes)
        self.reset()

    def reset(self) -> None:
        self.contexts = []

    def observe(self, context) -> None:
        self.contexts.append({
            "index": context.step_index,
            "probes": {k: v.clone() for k, v in context.probes.items()},
            "previous": context.previous_state.clone(),
            "next": context.next_state.clone(),
            "condition": None if context.condition is None else context.condition.clone(),
        })


def new_rule() -> Rule:
    torch.manual_seed(0)
    return Rule().eval()


def seed_state() -> torch.Tensor:
    return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))


def watched_run(module, x0, steps=(0,), log_interval=1, keep=None, **kw):
    """Watch ``module`` and call it in a plain loop: no ``s.observer`` anywhere."""
    keep = keep or Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=log_interval)
    inst.watch(module, **kw)
    for step in steps:
        with inst.step(step):
            x = x0
            for _ in range(N_ITER):
                x = module(x)
    inst.close()
    return keep.contexts


def assert_same(got, want) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g["index"] == w["index"]
        assert set(g["probes"]) == set(w["probes"])
        for name in w["probes"]:
            assert torch.equal(g["probes"][name], w["probes"][name]), name
        for key in ("previous", "next"):
            assert torch.equal(g[key], w[key]), key
        assert (g["condition"] is None) == (w["condition"] is None)
        if w["condition"] is not None:
            assert torch.equal(g["condition"], w["condition"])


SCRIPTERS = {
    "torch.jit.script": torch.jit.script,
    "instrument.script": instrument.script,
    "instrument.freeze(keep_probes=True)": lambda rule: instrument.freeze(torch.jit.script(rule), keep_probes=True),
}


@pytest.mark.parametrize("how", list(SCRIPTERS))
def test_scripted_rule_watched_with_no_loop_code_delivers_what_eager_does(how):
    rule, x0 = new_rule(), seed_state()
    eager = watched_run(rule, x0)
    assert [c["index"] for c in eager] == list(range(N_ITER))
    for got, want in zip(eager, reference(rule, x0, N_ITER), strict=True):
        assert all(torch.equal(got["probes"][n], want[n]) for n in want)
    scripted = SCRIPTERS[how](rule)
    assert scripting.has_call_boundary(scripted) == (how == "instrument.script")
    assert_same(watched_run(scripted, x0), eager)


def test_instrument_script_leaves_the_eager_module_as_it_was():
    rule = new_rule()
    keys = list(rule.state_dict())
    scripted = instrument.script(rule)
    assert list(rule.state_dict()) == keys and list(scripted.state_dict()) == keys
    assert "instrument_call" not in rule._modules and not rule._forward_hooks
    assert not scripted.instrument_call.enabled
    assert torch.equal(scripted(seed_state()), rule(seed_state()))


def test_call_boundary_fires_when_torchscript_code_calls_the_watched_rule(caplog):
    rule, x0 = new_rule(), seed_state()
    eager = watched_run(rule, x0)
    loop = torch.jit.script(Loop(instrument.script(rule)))  # the whole rollout is TorchScript

    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(loop.rule)
    with inst.step(0):
        loop(x0, N_ITER)
    inst.close()
    assert_same(keep.contexts, eager)

    # A torch.jit.script-ed rule has no boundary: called from TorchScript, its probes record but no call is
    # seen, and the session says so (the loop must then call s.observer, with state=False).
    plain_loop = torch.jit.script(Loop(torch.jit.script(new_rule())))
    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(plain_loop.rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        plain_loop(x0, N_ITER)
    inst.close()
    assert keep.contexts == []
    assert "no observer call delivered them" in caplog.text


def test_conditioned_rule_returning_a_tuple_gets_its_condition_and_first_output():
    torch.manual_seed(0)
    rule = CondRule()
    scripted = instrument.script(rule)
    assert scripting.has_call_boundary(scripted)
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    cond = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))

    def run(module, by_keyword):
        keep = Keep(("h",))
        inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
        inst.watch(module)
        with inst.step(0):
            x = x0
            for _ in range(N_ITER):
                x, _ = module(x, condition=cond) if by_keyword else module(x, cond)
        inst.close()
        return keep.contexts

    eager = run(rule, False)
    assert eager[0]["condition"] is not None
    for module in (rule, scripted, torch.jit.script(rule)):
        for by_keyword in (False, True):
            assert_same(run(module, by_keyword), eager)


def test_non_logging_steps_install_nothing_and_deliver_nothing():
    rule, x0 = new_rule(), seed_state()
    for module in (instrument.script(rule), torch.jit.script(rule)):
        keep = Keep()
        inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=2)
        inst.watch(module)
        for step in (1, 2, 3):
            with inst.step(step) as s:
                x = x0
                for _ in range(N_ITER):
                    x = module(x)
                if not s.active:
                    assert record.active_recorder() is None
                    assert not torch.nn.modules.module._global_forward_hooks
                    assert not record._call_ends
                    assert not module.p_hidden.enabled and not module.p_update.enabled
                    if scripting.has_call_boundary(module):
                        assert not module.instrument_call.enabled
            assert len(keep.contexts) == (0 if step == 1 else N_ITER)  # step 3 added nothing to step 2's
            assert record.active_recorder() is None and not record._call_ends
            assert not torch.nn.modules.module._global_forward_hooks
        inst.close()


class HiddenMean(instrument.Observer):
    probes = ("hidden",)

    def reset(self) -> None:
        self.means = []

    def observe(self, context) -> None:
        self.means.append(context.probes["hidden"].mean())

    def log(self, logger, step: int) -> None:
        logger.log_metrics({f"{self.name}/hidden_mean": torch.stack(self.means).mean()}, step=step)


def test_what_tensorboard_holds_is_the_same_for_eager_and_scripted_rules(tmp_path):
    rule, x0 = new_rule(), seed_state()
    runs = {}
    for how, module in (("eager", rule), ("script", torch.jit.script(rule)), ("instrument", instrument.script(rule))):
        inst = instrument.Instrumentation(
            observers=[instrument.IterationStats(images=False), HiddenMean()],
            backends=[instrument.TensorBoardBackend()], log_interval=2, run_name=how, log_dir=str(tmp_path),
        )
        inst.watch(module)
        for step in range(5):
            with inst.step(step):
                x = x0
                for _ in range(N_ITER):
                    x = module(x)
        inst.close()
        # instrument/overhead/* are wall-clock measurements of this run, not values of the rule
        runs[how] = {k: v for k, v in read_scalars(tmp_path / how).items() if not k.startswith("instrument/")}
    assert "hidden_mean/hidden_mean" in runs["eager"]
    assert runs["eager"]["iteration_stats/iterations"] == {0: N_ITER, 2: N_ITER, 4: N_ITER}
    assert runs["script"] == runs["eager"]
    assert runs["instrument"] == runs["eager"]


SUBPROCESS = """
import sys, warnings, torch
warnings.simplefilter("ignore", DeprecationWarning)
import instrument                                   # registers torch.ops.instrument.*
from instrument.probes.script import has_call_boundary
torch.set_num_threads(int(sys.argv[3]))             # same kernels, same bits as the parent process
x0 = torch.load(sys.argv[1])
out = {}
for name in ("plain", "boundary", "loop"):
    loaded = torch.jit.load(f"{sys.argv[2]}/{name}.pt")
    watched = loaded.rule if name == "loop" else loaded  # loop: a rollout whose loop is TorchScript
    class Keep(instrument.Observer):
        probes = ("hidden", "update")
        def reset(self): self.contexts = []
        def observe(self, c):
            self.contexts.append({"index": c.step_index, "probes": {k: v.clone() for k, v in c.probes.items()},
                                  "previous": c.previous_state.clone(), "next": c.next_state.clone(),
                                  "condition": None})
    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(watched)                             # no loop code below: the watch delivers
    with inst.step(0):
        if name == "loop":
            loaded(x0, {n})
        else:
            x = x0
            for _ in range({n}):
                x = loaded(x)
    inst.close()
    out[name] = (has_call_boundary(watched), keep.contexts)
torch.save(out, f"{sys.argv[2]}/out.pt")
"""


def test_loaded_rules_in_a_fresh_process_deliver_what_eager_does(tmp_path):
    rule, x0 = new_rule(), seed_state()
    eager = watched_run(rule, x0)
    torch.jit.save(torch.jit.script(rule), str(tmp_path / "plain.pt"))  # as saved before call boundaries
    torch.jit.save(instrument.script(rule), str(tmp_path / "boundary.pt"))
    torch.jit.save(torch.jit.script(Loop(instrument.script(rule))), str(tmp_path / "loop.pt"))
    torch.save(x0, tmp_path / "x0.pt")
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent(SUBPROCESS).replace("{n}", str(N_ITER)))
    repo = Path(instrument.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    args = [sys.executable, str(script), str(tmp_path / "x0.pt"), str(tmp_path), str(torch.get_num_threads())]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    out = torch.load(tmp_path / "out.pt")
    assert [out[name][0] for name in ("plain", "boundary", "loop")] == [False, True, True]
    for name in ("plain", "boundary", "loop"):
        assert_same(out[name][1], eager)


def _users_own_hook(module: BareRule, input: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    return None


def test_the_python_hook_never_breaks_another_script_modules_compiled_hooks(monkeypatch):
    """TorchScript keys a module's compiled hooks 0, 1, ... in its Python hook table, and torch calls such a
    hook with keyword arguments when a global hook with the same id takes them: the session's global hook must
    never get a small id, even in a process that has registered no hook yet."""
    from torch.utils.hooks import RemovableHandle

    bare = BareRule()
    handle = bare.register_forward_hook(_users_own_hook)
    users = torch.jit.script(bare)  # a ScriptModule with a compiled hook of its own, mirrored under key 0
    handle.remove()
    assert 0 in users._forward_hooks
    monkeypatch.setattr(RemovableHandle, "next_id", 0)  # as in a fresh process
    rule, x0 = new_rule(), seed_state()
    scripted = torch.jit.script(rule)
    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(scripted)
    with inst.step(0):
        x = scripted(x0)
        users(x)  # would be called with (module, args, kwargs, output) and fail if ids collided
    inst.close()
    assert len(keep.contexts) == 1
    assert not torch.nn.modules.module._global_forward_hooks_with_kwargs  # nothing left behind


def test_a_logging_step_that_raises_leaves_nothing_switched_on():
    scripted = instrument.script(new_rule())
    inst = instrument.Instrumentation(observers=[Keep()], backends=[], log_interval=1)
    inst.watch(scripted)
    with pytest.raises(RuntimeError, match="boom"), inst.step(0):
        scripted(seed_state())
        assert scripted.instrument_call.enabled and torch.nn.modules.module._global_forward_hooks
        raise RuntimeError("boom")
    assert not scripted.instrument_call.enabled and not scripted.p_hidden.enabled
    assert not torch.nn.modules.module._global_forward_hooks and not record._call_ends
    assert record.active_recorder() is None
    inst.close()


TEACHER = """
import sys, warnings
warnings.filterwarnings("ignore", category=DeprecationWarning)
import torch
import instrument
from tests._probe_models import Rule
path, phase = sys.argv[1], sys.argv[2]

class Count(instrument.Observer):
    def reset(self):
        self.calls = 0
    def observe(self, context):
        self.calls += 1
    def log(self, logger, step):
        pass

torch.manual_seed(0)
count = Count()
inst = instrument.Instrumentation([count], backends=[], log_interval=1)
if phase == "save":  # a checkpoint written during a logging step
    rule = instrument.script(Rule())
    inst.watch(rule)
    with torch.no_grad(), inst.step(0):
        rule(torch.randn(2, 4, 6, 6))
        torch.jit.save(rule, path)
else:  # that checkpoint loaded as an unwatched teacher beside a watched student
    teacher, student = torch.jit.load(path), instrument.script(Rule())
    inst.watch(student)
    with torch.no_grad(), inst.step(0):
        x = torch.randn(2, 4, 6, 6)
        for _ in range(3):
            teacher(x)
            x = student(x)
    print("observed", count.calls, flush=True)
inst.close()
"""


def test_a_scripted_checkpoint_saved_in_a_logging_step_is_never_observed_as_another_processes_watch(tmp_path):
    """A boundary saved switched on keeps its token; tokens counted from 1 in every process, so the loaded
    teacher's token was the student's watch's and its calls were observed as the student's (6 for 3)."""
    from tests.conftest import run_child

    path = str(tmp_path / "teacher.pt")
    saved = run_child(tmp_path, TEACHER, path, "save", timeout=240)
    assert saved.returncode == 0, saved.stderr[-2000:]
    loaded = run_child(tmp_path, TEACHER, path, "load", timeout=240)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "observed 3" in loaded.stdout, loaded.stdout + loaded.stderr[-2000:]



def test_a_copy_of_the_watched_scripted_rule_made_and_run_in_the_same_logging_step_is_not_observed():
    """A deepcopy (a target network) or a torch.jit.save / load of the scripted loop, made during a logging step,
    kept the boundary's live token switched on: in the same process its calls were observed as iterations 3..8
    of the watched three-iteration rollout. A boundary now also carries a key tensor of its own storage."""
    import copy
    import io

    loop = torch.jit.script(Loop(instrument.script(new_rule())))
    keep = Keep(probes=())
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(loop.rule)
    x = seed_state()
    with torch.no_grad(), inst.step(0):
        out = loop(x, 3)
        target = copy.deepcopy(loop)
        buffer = io.BytesIO()
        torch.jit.save(loop, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
        assert torch.equal(target(x, 3), out) and torch.equal(loaded(x, 3), out)  # they run, and compute the same
        loop(x, 1)  # the watched module itself still delivers, after the copies ran
    inst.close()
    assert [c["index"] for c in keep.contexts] == [0, 1, 2, 3]


def _in_place_rule() -> StateInPlaceRule:
    torch.manual_seed(0)
    return StateInPlaceRule().eval()


@pytest.mark.parametrize("how", ["torch.jit.script", "instrument.script"])
def test_a_scripted_rule_changing_its_state_in_place_called_from_python_delivers_what_eager_does(how, caplog):
    """The state before each call was unknown to a watched ScriptModule (no hook before its calls): previous_state
    held the next state and dx read 0, without a word. Python calls now copy it as eager ones do."""
    x0 = seed_state()
    with torch.no_grad():
        eager = watched_run(_in_place_rule(), x0.clone(), steps=(0, 1))
        scripted = watched_run(SCRIPTERS[how](_in_place_rule()), x0.clone(), steps=(0, 1))
    assert [c["index"] for c in eager] == list(range(N_ITER))  # the second logging step's (reset keeps one)
    assert not torch.equal(eager[0]["previous"], eager[0]["next"])
    assert_same(scripted, eager)


def _loop_steps(loop, caplog):
    """Two logging steps of the scripted ``loop`` with its rule watched: the step indices delivered in each."""
    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(loop.rule)
    delivered = []
    with caplog.at_level(logging.WARNING, logger="instrument"), torch.no_grad():
        for step in (0, 1):
            with inst.step(step):
                loop(seed_state(), N_ITER)
            delivered.append([c["index"] for c in keep.contexts])
    inst.close()
    return delivered


def test_a_scripted_rule_changing_its_state_in_place_called_from_torchscript_is_said_and_not_delivered(caplog):
    """From TorchScript code no copy can be taken before the call: a call that returned its own argument, changed
    since the last call returned it, is counted (later indices kept) and not delivered, with one warning,
    instead of a context whose dx reads 0. The first call of a step cannot be told."""
    loop = torch.jit.script(Loop(instrument.script(_in_place_rule())))
    delivered = _loop_steps(loop, caplog)
    said = [r.getMessage() for r in caplog.records if "changed its state argument in place" in r.getMessage()]
    assert len(said) == 1 and "watched ScriptModule StateInPlaceRule" in said[0] and "return x + dx" in said[0]
    assert delivered == [[0], [0]]  # each step's first call, before a change could be seen; then none


def test_a_scripted_in_place_rule_given_its_state_as_a_keyword_is_said_and_not_delivered(caplog):
    """A ScriptModule's hook before the call gets no keyword arguments (torch's global pre-hook), so no copy is
    taken: such calls delivered dx 0 silently; now they are told as from TorchScript code."""
    rule = torch.jit.script(_in_place_rule())
    keep = Keep()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"), torch.no_grad(), inst.step(0):
        x = seed_state()
        for _ in range(N_ITER):
            x = rule(x=x)
    inst.close()
    assert [c["index"] for c in keep.contexts] == [0]
    assert "with the state as a keyword argument" in caplog.text


def test_a_scripted_loop_changing_the_state_between_calls_is_not_taken_for_an_in_place_rule(caplog):
    """The loop clamps in place between calls of a rule that returns a new tensor: every call is delivered
    (a version check alone took the loop's change for the rule's and dropped every later call)."""
    rule = instrument.script(new_rule())
    loop = torch.jit.script(Loop(rule, clamp=True))
    delivered = _loop_steps(loop, caplog)
    assert delivered == [list(range(N_ITER))] * 2
    assert "in place" not in caplog.text


class _InterruptsAt(instrument.Observer):
    """Raises Ctrl-C's KeyboardInterrupt at one iteration, as a SIGINT landing in observer code would."""

    def __init__(self, at: int) -> None:
        super().__init__("interrupts")
        self.at, self.indices = at, []

    def reset(self) -> None:
        self.indices = []

    def observe(self, context) -> None:
        self.indices.append(context.step_index)
        if context.step_index == self.at and not getattr(self, "done", False):
            self.done = True
            raise KeyboardInterrupt


def test_ctrl_c_in_an_observer_called_from_torchscript_code_reaches_the_loop_as_keyboard_interrupt(tmp_path):
    """The observers run inside the call boundary's operator, and TorchScript turned the KeyboardInterrupt into
    a RuntimeError: a loop's `except KeyboardInterrupt` (save and exit) never ran. Now it is raised when the step's
    block exits, the step is discarded as any interrupted step, and the next step observes every iteration."""
    loop = torch.jit.script(Loop(instrument.script(new_rule())))
    observer = _InterruptsAt(1)
    inst = instrument.Instrumentation(observers=[observer], backends=[instrument.JsonlBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r", overhead_budget=None)
    inst.watch(loop.rule)
    with pytest.raises(KeyboardInterrupt), torch.no_grad(), inst.step(0):
        inst.log({"loss": 1.0})
        loop(seed_state(), 3)
    assert observer.indices == [0, 1]  # nothing delivered after the interrupt
    with torch.no_grad(), inst.step(1):
        inst.log({"loss": 2.0})
        loop(seed_state(), 3)
    inst.close()
    assert observer.indices == [0, 1, 2]
    import json

    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["metrics"]) for line in lines if "metrics" in line] == [(1, {"loss": 2.0})]
