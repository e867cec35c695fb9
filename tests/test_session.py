"""The session's promises: nothing attached off logging steps, lifecycle order, isolation of failures."""

import contextlib
import copy
import logging
import sys
import threading

import pytest
import torch

import instrument
from tests.conftest import Recorder


def _hooks(module):
    # _forward_hooks_with_kwargs only flags entries of _forward_hooks; it must empty with them.
    assert set(module._forward_hooks_with_kwargs) <= set(module._forward_hooks)
    return (
        len(module._forward_hooks) + len(module._forward_pre_hooks) + len(module._backward_hooks)
        + len(module._backward_pre_hooks)
    )


def _rollout(rule, n_iter=3):
    x = torch.randn(2, 4, 5, 5)
    for _ in range(n_iter):
        x = rule(x)
    return x


def test_nothing_registered_on_non_logging_steps(rule):
    rec = Recorder()
    inst = instrument.Instrumentation([rec], backends=[], log_interval=3)
    inst.watch(rule)
    seen = []
    for step in range(7):
        with inst.step(step) as s:
            seen.append((s.active, s.observer is None, _hooks(rule)))
            _rollout(rule)
        assert _hooks(rule) == 0
    # on logging steps a pre-hook (the state argument's version) and the hook; nothing on the others
    assert seen == [(True, False, 2), (False, True, 0), (False, True, 0), (True, False, 2),
                    (False, True, 0), (False, True, 0), (True, False, 2)]
    assert len(rec.contexts) == 9  # 3 logging steps x 3 iterations, nothing else
    inst.close()


def test_lifecycle_order_and_step_index(rule):
    rec = Recorder()
    with instrument.Instrumentation([rec], backends=[], log_interval=2) as inst:
        inst.watch(rule)
        for step in range(3):
            with inst.step(step):
                _rollout(rule, n_iter=4)
    assert rec.events == (["reset", "observe0", "observe1", "observe2", "observe3", "log0"]
                          + ["reset", "observe0", "observe1", "observe2", "observe3", "log2"])
    assert rec.grad_enabled == [False] * 8


def test_context_tensors_are_detached_and_dx_is_the_difference(rule):
    rec = Recorder()
    inst = instrument.Instrumentation([rec], backends=[], log_interval=1)
    inst.watch(rule)
    with inst.step(0):
        x0 = torch.randn(2, 4, 5, 5, requires_grad=True)
        x1 = rule(x0)
    ctx = rec.contexts[0]
    assert not ctx.previous_state.requires_grad and not ctx.next_state.requires_grad
    torch.testing.assert_close(ctx.dx, (x1 - x0).detach(), rtol=0, atol=0)
    assert ctx.condition is None and ctx.probes == {}
    inst.close()


def test_hooks_removed_when_the_step_raises(rule):
    inst = instrument.Instrumentation([Recorder()], backends=[], log_interval=1)
    inst.watch(rule)
    with pytest.raises(RuntimeError, match="boom"):
        with inst.step(0):
            _rollout(rule)
            raise RuntimeError("boom")
    assert _hooks(rule) == 0
    with inst.step(1):  # the session is usable again
        _rollout(rule)
    inst.close()


def test_watch_handle_remove_restores_module(rule):
    inst = instrument.Instrumentation([Recorder()], backends=[], log_interval=1)
    before = dict(rule.__dict__)
    handle = inst.watch(rule)
    handle.remove()
    handle.remove()  # idempotent
    with inst.step(0):
        _rollout(rule)
    assert _hooks(rule) == 0 and rule.__dict__.keys() == before.keys()
    inst.close()


def test_explicit_evolver_style(rule):
    rec = Recorder()
    inst = instrument.Instrumentation([rec], backends=[], log_interval=1)
    with inst.step(0) as s:
        x = torch.zeros(3, 2)
        for i in range(5):
            nxt = x + 1
            s.observer(instrument.StepContext(previous_state=x, next_state=nxt, condition=torch.ones(3, 1),
                                              step_index=i))
            x = nxt
    assert [c.step_index for c in rec.contexts] == list(range(5))
    assert torch.equal(rec.contexts[0].condition, torch.ones(3, 1))
    assert isinstance(s.observer, instrument.StepObserver)
    inst.close()


class Broken(instrument.Observer):
    def observe(self, context):
        raise ValueError("observer exploded")


def test_failing_observer_is_reported_once_and_skipped(rule, caplog):
    rec = Recorder()
    backend_records = []

    class Keep(instrument.Backend):
        def write(self, record):
            backend_records.append(record)

    # overhead_budget=None: its report is a WARNING too, given when a tiny step is slow (a loaded machine)
    inst = instrument.Instrumentation([Broken(), rec], backends=[Keep()], log_interval=1, overhead_budget=None)
    inst.watch(rule)
    with caplog.at_level(logging.DEBUG, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                _rollout(rule, n_iter=3)
    inst.close()
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "'broken'" in errors[0].getMessage() and "observe()" in errors[0].getMessage()
    assert "observer exploded" in caplog.text
    assert len(rec.contexts) == 6  # the healthy observer saw every iteration
    assert [r.scalars["recorder/seen"] for r in backend_records] == [3.0, 6.0]
    assert inst.failures == {"broken": 2}


def test_steps_do_not_nest(rule):
    inst = instrument.Instrumentation([Recorder()], backends=[], log_interval=1)
    with inst.step(0):
        with pytest.raises(instrument.ConfigurationError, match="steps do not nest"):
            with inst.step(1):
                pass
    inst.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_log_interval_validated(bad):
    with pytest.raises(instrument.ConfigurationError, match="log_interval must be a non-negative int"):
        instrument.Instrumentation(backends=[], log_interval=bad)


def test_log_interval_zero_never_logs(rule):
    rec = Recorder()
    inst = instrument.Instrumentation([rec], backends=[], log_interval=0)
    inst.watch(rule)
    for step in range(3):
        with inst.step(step) as s:
            assert not s.active
            _rollout(rule)
    assert rec.events == []
    inst.close()


def test_watching_a_module_with_the_wrong_signature_fails_clearly():
    class NoState(torch.nn.Module):
        def forward(self):
            return 3

    inst = instrument.Instrumentation([Recorder()], backends=[], log_interval=1)
    inst.watch(NoState())
    with pytest.raises(instrument.ConfigurationError, match="must take the previous state as its first argument"):
        with inst.step(0):
            inst._watches[0].module()
    with pytest.raises(instrument.ConfigurationError, match="expects a torch.nn.Module"):
        inst.watch(lambda x: x)
    inst.close()


def test_tuple_output_and_condition_argument():
    class Conditioned(torch.nn.Module):
        def forward(self, x, action):
            return x + action, {"aux": 1}

    rec = Recorder()
    inst = instrument.Instrumentation([rec], backends=[], log_interval=1)
    module = Conditioned()
    inst.watch(module)
    with inst.step(0):
        module(torch.zeros(2, 3), torch.ones(2, 3))
    assert torch.equal(rec.contexts[0].next_state, torch.ones(2, 3))
    assert torch.equal(rec.contexts[0].condition, torch.ones(2, 3))
    inst.close()


def test_closed_session_refuses_steps():
    inst = instrument.Instrumentation(backends=[], log_interval=1)
    inst.close()
    inst.close()
    with pytest.raises(instrument.ConfigurationError, match="closed"):
        inst.step(0)


def test_a_step_scope_made_before_close_and_entered_after_it_is_refused(rule):
    """A review found `s = inst.step(5); inst.close(); with s:` attaching the hooks and running the observers'
    reset and observe on the closed session, and writing nothing, without a word."""
    obs = Attaching()
    inst = instrument.Instrumentation([obs], backends=[], log_interval=5)
    inst.watch(rule)
    scope = inst.step(5)
    inst.close()
    obs.calls.clear()
    with pytest.raises(instrument.ConfigurationError, match="this Instrumentation is closed"):
        with scope:
            _rollout(rule, n_iter=1)
    assert obs.calls == [] and not rule._forward_hooks and not rule._forward_pre_hooks


def test_a_component_added_after_close_is_refused():
    """A review found add_component accepted after close(): its log and close never ran, without a word."""

    class Component:
        def log(self, logger, step):
            pass

    inst = instrument.Instrumentation([], backends=[], log_interval=1)
    inst.close()
    with pytest.raises(instrument.ConfigurationError, match="this Instrumentation is closed"):
        inst.add_component(Component())


def test_two_threads_entering_steps_of_one_session_are_never_both_inside_and_are_told_why():
    """A review found the "steps do not nest" check racy: checked, then the logger's mark (a lock, where the GIL
    may switch), then taken. Both threads were inside a step thousands of times per run; one's exit then cleared
    the other's open step, whose inst.log raised "outside a `with inst.step(n):` block", and the refusals said
    "steps do not nest" of steps on two threads."""
    inst = instrument.Instrumentation(backends=[], log_interval=10**9, overhead_budget=None)
    inside, both, errors, lock = [0], [0], [], threading.Lock()

    def worker(offset):
        for i in range(3000):
            try:
                with inst.step(1 + 2 * i + offset):
                    with lock:
                        inside[0] += 1
                        both[0] += inside[0] > 1
                    inst.log({"x": 1.0})
                    with lock:
                        inside[0] -= 1
            except instrument.ConfigurationError as exc:
                errors.append(str(exc))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the race is then met at once
    try:
        threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    inst.close()
    assert both[0] == 0
    assert all("is open on another thread" in message and "its own Instrumentation" in message for message in errors)


def test_a_step_keeps_its_slot_until_it_has_ended_and_an_interrupted_entry_frees_it():
    """A review of the slot lock found the slot freed before the logging step's end (observers' log, commit): a
    step entered on another thread meanwhile got in, and its values went into this step's record (or its mark
    replaced a failed step's, whose values then reached a later commit). And a Ctrl-C in a non-logging step's
    mark, after the slot was taken, left it taken: every later step was refused."""
    seen = []

    class StartsAStepElsewhere(instrument.Observer):
        def log(self, logger, step):  # the step's end is under way: another thread tries a step of its own
            def other():
                try:
                    with inst.step(3):
                        inst.log({"from_the_other_thread": 1.0})
                    seen.append("entered")
                except instrument.ConfigurationError as exc:
                    seen.append(str(exc))

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()

    keep = []

    class Keep(instrument.Backend):
        def write(self, record):
            keep.append(record)

    inst = instrument.Instrumentation([StartsAStepElsewhere("elsewhere")], backends=[Keep()], log_interval=2,
                                      overhead_budget=None)
    with inst.step(2):
        inst.log({"mine": 1.0})
    inst.logger.flush()
    assert len(seen) == 1 and "is open on another thread" in seen[0], seen
    assert [sorted(r.scalars) for r in keep] == [["mine"]] and inst.open_step is None

    mark, calls = inst.logger.mark, []

    def interrupted_mark():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return mark()

    inst.logger.mark = interrupted_mark
    with pytest.raises(KeyboardInterrupt):
        with inst.step(5):
            pass
    assert inst.open_step is None
    with inst.step(7):  # refused before the fix: "steps do not nest"
        pass
    inst.close()


def test_log_interval_zero_a_step_that_raises_discards_what_it_staged(tmp_path):
    """A review found that with log_interval=0 a failed step kept what it handed to inst.logger: it reached the
    next commit (a loss mean of 34 instead of 1, three timer spans instead of two)."""
    keep = []

    class Keep(instrument.Backend):
        def write(self, record):
            keep.append(record)

    inst = instrument.Instrumentation(backends=[Keep()], log_interval=0, log_dir=str(tmp_path), overhead_budget=None)
    timer = inst.logger.timer("t")
    for step in (1, 2, 3):
        with contextlib.suppress(ValueError):
            with inst.step(step):
                with timer:
                    pass
                inst.logger.log_metrics({"loss": 100.0 if step == 2 else 1.0}, step=step)
                if step == 2:
                    raise ValueError("a failed step")
    inst.logger.commit(3)
    inst.close()
    assert [(r.step, r.flat_scalars()["loss"], r.flat_scalars()["timing/t/count"]) for r in keep] == [(3, 1.0, 2.0)]


class Attaching(instrument.Observer):
    """Records the observer's per-step calls: attach(modules) after reset, detach always, log when not failed."""

    def __init__(self):
        super().__init__("attaching")
        self.calls = []

    def reset(self):
        self.calls.append("reset")

    def attach(self, modules):
        self.calls.append(("attach", [type(m).__name__ for m in modules]))

    def observe(self, context):
        self.calls.append("observe")

    def detach(self):
        self.calls.append("detach")

    def log(self, logger, step):
        self.calls.append(("log", step))


def test_observers_attach_to_the_watched_modules_on_logging_steps_and_always_detach(rule):
    obs = Attaching()
    inst = instrument.Instrumentation([obs], backends=[], log_interval=2)
    inst.watch(rule)
    assert inst.watched_modules == [rule]
    for step in range(3):
        with inst.step(step):
            _rollout(rule, n_iter=1)
    name = type(rule).__name__
    assert obs.calls == ["reset", ("attach", [name]), "observe", "detach", ("log", 0),
                         "reset", ("attach", [name]), "observe", "detach", ("log", 2)]  # nothing at step 1
    obs.calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with inst.step(4):
            raise RuntimeError("boom")
    assert obs.calls == ["reset", ("attach", [name]), "detach"]  # detached although the step raised; no log
    inst.close()


@pytest.mark.parametrize("outer, inner", [(0, 1), (1, 0), (1, 3)])
def test_steps_do_not_nest_whichever_of_them_logs(outer, inner):
    """Only a logging inner step was refused; a non-logging one inside a logging one (or the other way round)
    was taken, and its exit closed the outer block's scope."""
    inst = instrument.Instrumentation(backends=[], log_interval=2)
    with inst.step(outer):
        with pytest.raises(instrument.ConfigurationError, match=rf"step\({inner}\) entered while step {outer} is"):
            with inst.step(inner):
                pass
        inst.log({"x": 1.0})  # the outer block is still open
    inst.close()


class _Positional(torch.nn.Module):
    def forward(self, x, condition=None):
        return x + (0 if condition is None else condition)


class _KeywordOnly(torch.nn.Module):
    def forward(self, *, condition=None, x):
        return x + condition


@pytest.mark.parametrize("rule", [_Positional(), _KeywordOnly()], ids=["positional", "keyword-only"])
def test_a_keyword_only_call_takes_the_state_from_forwards_state_parameter(rule):
    """rule(condition=c, x=x) handed `condition` over as the previous state (the first keyword, whatever its
    name); for a keyword-only forward the state is its first keyword other than `condition`."""
    seen = []

    class Keep(instrument.Observer):
        def observe(self, context):
            seen.append((context.previous_state, context.condition))

        def log(self, logger, step):
            pass

    inst = instrument.Instrumentation([Keep()], backends=[], log_interval=1)
    inst.watch(rule)
    x, c = torch.zeros(2, 3), torch.ones(2, 3)
    with inst.step(0):
        rule(condition=c, x=x)
        rule(x=x, condition=c)
    inst.close()
    assert [(p is x, k is c) for p, k in seen] == [(True, True), (True, True)]


@pytest.mark.parametrize("kwargs, match", [
    ({"observers": instrument.IterationStats}, r"observers must be a list .*got <class"),
    ({"observers": instrument.IterationStats()}, r"observers must be a list .*\(IterationStats\)"),
    ({"observers": [instrument.IterationStats, instrument.UpdateNorm()]}, r"got the class IterationStats; call it"),
    ({"backends": instrument.JsonlBackend()}, r"backends must be a list .*\(JsonlBackend\)"),
    ({"backends": [instrument.JsonlBackend]}, r"got the class JsonlBackend; call it: JsonlBackend\(\)"),
    ({"system_monitor": instrument.SystemMonitor}, r"system_monitor must be None or an instance"),
])
def test_a_class_or_a_single_part_where_a_list_of_instances_goes_is_refused_with_the_fix(tmp_path, kwargs, match):
    """A review found raw TypeErrors ('type' object is not iterable) and a class accepted as an observer (it
    failed every step with 'missing self')."""
    with pytest.raises(instrument.ConfigurationError, match=match):
        instrument.Instrumentation(log_dir=str(tmp_path), **{"backends": [], **kwargs})
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_log_interval_zero_writes_nothing_of_inst_log_at_close(tmp_path):
    """A review found close() writing the staged interval mean at the last step although 0 turns logging off."""
    keep = []

    class Keep(instrument.Backend):
        def write(self, record):
            keep.append(record)

    inst = instrument.Instrumentation(backends=[Keep()], log_interval=0, log_dir=str(tmp_path))
    for step in range(5):
        with inst.step(step):
            inst.log({"loss": float(step)})
    inst.close()
    assert keep == []


def test_ctrl_c_in_an_observers_reset_or_attach_ends_the_step_like_any_failed_one():
    """A KeyboardInterrupt (not an Exception: the failure ledger lets it through) in an observer's reset or
    attach escaped before the step's cleanup: ActivationStats' hooks stayed on the module for good, and every
    later logging step raised 'entered while step 0 is still open'. Now the step ends as a failed one."""
    class Interrupted(instrument.Observer):
        def __init__(self, where):
            super().__init__()
            self.where, self.calls = where, 0

        def reset(self):
            if self.where == "reset":
                self.calls += 1
                if self.calls == 1:
                    raise KeyboardInterrupt

        def attach(self, modules):
            if self.where == "attach":
                self.calls += 1
                if self.calls == 1:
                    raise KeyboardInterrupt

    for where in ("reset", "attach"):
        rule = torch.nn.Sequential(torch.nn.Linear(4, 4))
        stats = instrument.ActivationStats()
        inst = instrument.Instrumentation([stats, Interrupted(where)], backends=[], log_interval=1)
        inst.watch(rule)
        with pytest.raises(KeyboardInterrupt), inst.step(0):
            rule(torch.ones(2, 4))
        assert inst.active_step is None
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in rule.modules())
        with inst.step(1):  # a later logging step runs normally
            rule(torch.ones(2, 4))
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in rule.modules())
        inst.close()


def test_two_watched_modules_that_both_deliver_iterations_are_said_once(caplog):
    """Both feed one observer stream (3 + 3 calls read as one rollout of 6 iterations, their states mixed):
    a review found it silent."""
    fast, slow = torch.nn.Identity(), torch.nn.Identity()
    inst = instrument.Instrumentation([instrument.IterationStats(images=False)], backends=[], log_interval=1)
    inst.watch(fast, name="fast")
    inst.watch(slow, name="slow")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                x = y = torch.zeros(2, 3)
                for _ in range(3):
                    x, y = fast(x + 1), slow(y + 0.001)
    inst.close()
    said = [r.getMessage() for r in caplog.records if "all delivered iterations" in r.getMessage()]
    assert len(said) == 1 and "fast (3 calls), slow (3 calls)" in said[0] and "one rollout of 6" in said[0]


def test_a_watched_module_whose_states_the_loop_also_hands_to_s_observer_is_said_once(caplog):
    """quickstart's own-loop snippet watched the rule and passed ``observer=s.observer`` to the demo's rollout,
    which calls it: every iteration was observed twice (`iteration_stats/iterations` read 10 for 5), unsaid."""
    from instrument.demos.nca import NCA, make_seed, rollout

    torch.manual_seed(0)
    model = NCA(channels=8, hidden=16)
    keep = []

    class Keep(instrument.Backend):
        def write(self, record):
            keep.append(record)

    inst = instrument.Instrumentation([instrument.IterationStats(images=False)], backends=[Keep()],
                                      log_interval=1)
    inst.watch(model.update_rule)  # as quickstart's snippet did
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step) as s, torch.no_grad():
                rollout(model, make_seed(1, 8, 8), 5, observer=s.observer)
        second = copy.deepcopy(model.update_rule)
        inst.watch(second)
        with inst.step(2), torch.no_grad():  # two watched modules: its own warning, not silenced by the first
            x = make_seed(1, 8, 8)
            x = second(model.update_rule(x))
        inst.close()
    assert len([r for r in caplog.records if "all delivered iterations" in r.getMessage()]) == 1
    said = [r.getMessage() for r in caplog.records if "observed twice" in r.getMessage()]
    assert len(said) == 1, said
    # step 0 too, where the watch delivers copies of the states (the first logging step copies them)
    assert "in logging step 0, s.observer was handed 5 state(s) that watched module UpdateRule had just" in said[0]
    assert "state=False" in said[0]
    assert keep[0].scalars["iteration_stats/iterations"] == 10  # what it warns about


def test_s_observer_beside_a_watch_for_other_states_is_not_said(caplog):
    """What is not a double observation: one s.observer call for a readout head's state after the watched
    rollout (the session's own advice for probes in a readout), and a second module watched for part of the step
    (a review of the first version of this warning, which counted calls, blamed s.observer for both)."""
    rule, head, other = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Identity()
    inst = instrument.Instrumentation([instrument.UpdateNorm()], backends=[], log_interval=1)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0) as s, torch.no_grad():
            x = torch.zeros(2, 3)
            for _ in range(3):
                x = rule(x)
            s.observer(instrument.StepContext(x, head(x)))  # the readout: another state
        with inst.step(1), torch.no_grad():
            with inst.watch(other):
                x = torch.zeros(2, 3)
                for _ in range(3):
                    x = other(rule(x))
            x = rule(x)
        inst.close()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "observed twice" in m or "delivered iterations" in m], messages


def test_a_module_watched_with_state_false_and_s_observer_are_not_said(caplog):
    from instrument.demos.nca import NCA, make_seed, rollout

    model = NCA(channels=8, hidden=16)
    model.update_rule = torch.nn.Sequential(model.update_rule, instrument.Probe("p"))
    inst = instrument.Instrumentation([instrument.IterationStats(images=False)], backends=[], log_interval=1)
    inst.watch(model.update_rule, state=False)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0) as s, torch.no_grad():
            rollout(model, make_seed(1, 8, 8), 5, observer=s.observer)
        inst.close()
    assert not [r for r in caplog.records if "observed twice" in r.getMessage()]


def test_one_watched_module_and_a_probe_only_watch_are_not_said(caplog):
    rule, other = torch.nn.Identity(), torch.nn.Sequential(instrument.Probe("o"))  # a probe-only watch needs one
    inst = instrument.Instrumentation([instrument.IterationStats(images=False)], backends=[], log_interval=1)
    inst.watch(rule)
    inst.watch(other, state=False)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0):
            x = torch.zeros(2, 3)
            for _ in range(3):
                x = other(rule(x + 1))
    inst.close()
    assert not [r for r in caplog.records if "all delivered iterations" in r.getMessage()]
