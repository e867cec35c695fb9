"""NonFinite: NaN/Inf injected at a known iteration and channel is found there, counted right against a float64
NumPy reference read back from real TensorBoard files, reported once per run with where it was seen, raised
at the commit on request; a pure side channel, also under gradient checkpointing."""

import logging
from typing import List

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import instrument
from instrument import Instrumentation, NonFinite, NonFiniteError, StepContext
from instrument.errors import ConfigurationError, InstrumentError
from tests._probe_models import Rule as ProbedRule
from tests.conftest import read_scalars
from tests.test_checkpointing import Sink, fresh_rule, train_step

N_ITER = 8


def rollout(bad_iteration: int = 3, bad_channel: int = 2) -> List[Tensor]:
    """States [2, 5, 4, 4]: finite until ``bad_iteration``'s output, where channel ``bad_channel`` gets a NaN in
    one cell; two iterations later channel 4 gets an Inf, and the NaN spreads in its channel."""
    torch.manual_seed(0)
    x = torch.rand(2, 5, 4, 4)
    states = [x]
    for i in range(N_ITER):
        x = torch.tanh(x + 0.1 * torch.randn_like(x))
        if i >= bad_iteration:
            x[0, bad_channel, 1, 1 + (i - bad_iteration) % 3] = float("nan")
        if i == bad_iteration + 2:
            x[1, 4, 0, 0] = float("inf")
        states.append(x)
    return states


def reference(states: List[Tensor]):
    """float64 NumPy: non-finite counts of states and dx, first iteration, first channel there."""
    s = [t.double().numpy() for t in states]
    bad_state = [~np.isfinite(s[i + 1]) for i in range(len(s) - 1)]
    bad_dx = [~np.isfinite(s[i + 1] - s[i]) for i in range(len(s) - 1)]
    first = next((i for i, b in enumerate(bad_state) if b.any()), -1)
    channel = int(np.flatnonzero(bad_state[first].any(axis=(0, 2, 3)))[0]) if first >= 0 else -1
    return sum(int(b.sum()) for b in bad_state), sum(int(b.sum()) for b in bad_dx), first, channel


def run_steps(inst, states, steps=(0,)):
    for step in steps:
        with inst.step(step) as s:
            if s.observer is not None:
                for i in range(len(states) - 1):
                    s.observer(StepContext(states[i], states[i + 1], step_index=i))


def test_first_iteration_channel_and_counts_in_tensorboard(tmp_path, caplog):
    states = rollout(bad_iteration=3, bad_channel=2)
    inst = Instrumentation([NonFinite()], backends=[instrument.TensorBoardBackend()], log_interval=1,
                           log_dir=str(tmp_path), run_name="r")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        run_steps(inst, states, steps=(0, 1, 2))
        inst.close()
    assert not inst.failures
    scalars = read_scalars(tmp_path / "r")
    n_state, n_dx, first, channel = reference(states)
    assert (first, channel) == (3, 2) and n_state > 1 and n_dx > 1
    for step in (0, 1, 2):
        assert scalars["nonfinite/first_iteration"][step] == 3.0
        assert scalars["nonfinite/count"][step] == float(n_state + n_dx)
        assert scalars["nonfinite/count/state"][step] == float(n_state)
        assert scalars["nonfinite/count/dx"][step] == float(n_dx)
        assert scalars["nonfinite/first_iteration/state"][step] == 3.0
        assert scalars["nonfinite/first_channel/state"][step] == 2.0
        assert scalars["nonfinite/channels/state"][step] == 1.0
    messages = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(messages) == 1, messages  # once per run, although all three steps were non-finite
    assert "step 0" in messages[0] and "iteration 3" in messages[0]
    assert "state channel 2" in messages[0] and "dx channel 2" in messages[0]


def test_all_finite_logs_minus_one_and_says_nothing(tmp_path, caplog):
    torch.manual_seed(1)
    states = [torch.rand(2, 3, 4, 4) for _ in range(5)]
    inst = Instrumentation([NonFinite()], backends=[instrument.TensorBoardBackend()], log_interval=1,
                           log_dir=str(tmp_path), run_name="ok")
    with caplog.at_level(logging.WARNING, logger="instrument"):
        run_steps(inst, states)
        inst.close()
    scalars = read_scalars(tmp_path / "ok")
    assert scalars["nonfinite/first_iteration"][0] == -1.0
    assert scalars["nonfinite/count"][0] == 0.0
    assert scalars["nonfinite/first_channel/state"][0] == -1.0
    assert not [r for r in caplog.records if "non-finite" in r.getMessage()]


def test_raise_mode_raises_at_the_commit_after_writing_the_step(tmp_path):
    states = rollout(bad_iteration=5, bad_channel=1)
    inst = Instrumentation([NonFinite(raise_on_nonfinite=True)], backends=[instrument.TensorBoardBackend()],
                           log_interval=1, log_dir=str(tmp_path), run_name="raise")
    run_steps(inst, rollout(bad_iteration=N_ITER), steps=(0,))  # finite (bad_iteration past the end): no raise
    with pytest.raises(NonFiniteError, match=r"step 1: first at rollout iteration 5 in state channel 1") as info:
        run_steps(inst, states, steps=(1,))
    assert isinstance(info.value, InstrumentError) and isinstance(info.value, FloatingPointError)
    inst.close()
    scalars = read_scalars(tmp_path / "raise")
    assert scalars["nonfinite/first_iteration"] == {0: -1.0, 1: 5.0}


def test_channels_last_layout_and_a_channel_dim():
    torch.manual_seed(2)
    states = [torch.rand(6, 5) for _ in range(4)]
    states[2] = states[2].clone()
    states[2][3, 4] = float("-inf")  # iteration 1's output, feature 4
    sink = Sink()
    inst = Instrumentation([NonFinite(channel_dim=-1, dx=False, name="nf")], backends=[sink], log_interval=1)
    run_steps(inst, states)
    inst.close()
    scalars = sink.records[0].scalars
    assert scalars["nf/first_iteration"] == 1.0 and scalars["nf/first_channel/state"] == 4.0
    assert scalars["nf/count"] == 1.0 and "nf/count/dx" not in scalars


def test_probe_values_and_gradients_are_checked_and_named(caplog):
    """Watched-module style: the rule's embedded probe ``hidden`` goes non-finite first (its input is poisoned
    through a weight), the gradient of that weight too; the message names both."""
    torch.manual_seed(0)
    rule = ProbedRule()
    with torch.no_grad():
        rule.fc0.bias[1] = float("nan")
    sink = Sink()
    inst = Instrumentation([NonFinite()], backends=[sink], log_interval=1)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        with inst.step(0):
            x = torch.rand(1, 4, 5, 5)
            for _ in range(3):
                x = rule(x)
            x.sum().backward()
        inst.close()
    scalars = sink.records[0].scalars
    assert scalars["nonfinite/first_iteration/probe.hidden"] == 0.0
    assert scalars["nonfinite/first_channel/probe.hidden"] == 1.0
    # iteration 0: channel 1 of the hidden layer (25 cells); the state is NaN from then on, so iterations 1
    # and 2 have every hidden cell non-finite (8 channels x 25 cells each)
    assert scalars["nonfinite/count/probe.hidden"] == 25.0 + 2 * 8 * 25.0
    for name, p in rule.named_parameters():
        want = int((~np.isfinite(p.grad.double().numpy())).sum())
        assert scalars[f"nonfinite/grad_count/{name}"] == float(want), name
    assert scalars["nonfinite/grad_count"] > 0
    (message,) = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert "probe.hidden channel 1" in message and "fc0.weight" in message and "iteration 0" in message


@pytest.mark.parametrize("mode", ["none", "reentrant", "nonreentrant", "chunked"])
@pytest.mark.parametrize("style", ["hook", "evolver"])
def test_each_iteration_once_under_checkpointing_and_bitwise_equal_gradients(mode, style):
    _, grads_off = train_step(fresh_rule(), mode)
    rule = fresh_rule()
    sink = Sink()
    inst = Instrumentation([NonFinite(module=rule)], backends=[sink], log_interval=1)
    if style == "hook":
        inst.watch(rule)
    with inst.step(0) as s:
        # a finite run: nothing counted, under every checkpointing mode and in both styles
        _, grads_on = train_step(rule, mode, observer=s.observer if style == "evolver" else None)
    inst.close()
    assert not inst.failures
    for name in grads_off:
        assert torch.equal(grads_off[name], grads_on[name]), name
    scalars = sink.records[0].scalars
    assert scalars["nonfinite/count"] == 0.0 and scalars["nonfinite/first_iteration"] == -1.0
    assert scalars["nonfinite/grad_count"] == 0.0


def test_counted_once_per_iteration_under_checkpointing():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    sink = Sink()
    inst = Instrumentation([NonFinite(channel_dim=-1)], backends=[sink], log_interval=1)
    inst.watch(layer)
    with inst.step(0):
        x = torch.ones(3, 4, requires_grad=True)
        for _ in range(5):
            x = checkpoint(lambda t: layer(t) * torch.tensor([1.0, 1.0, float("nan"), 1.0]), x, use_reentrant=False)
        x.nan_to_num().sum().backward()  # recomputation runs the layer again: it must not be counted again
    inst.close()
    scalars = sink.records[0].scalars
    # the layer's output feeds a NaN into channel 2 from iteration 1 on: iteration 0's output is finite
    assert scalars["nonfinite/first_iteration/state"] == 1.0
    assert scalars["nonfinite/count/state"] == 4 * 3 * 4.0  # iterations 1..4, every element: counted once each


def test_bad_arguments():
    with pytest.raises(ConfigurationError, match="channel_dim must be an int"):
        NonFinite(channel_dim="1")
    with pytest.raises(ConfigurationError, match="torch.nn.Module, got list"):
        NonFinite(module=[])
    with pytest.raises(ConfigurationError, match="not a valid regex"):
        NonFinite(include="[")


def test_no_host_read_before_the_logger_transfer(tmp_path):
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger
    from tests.conftest import NoHostSync

    states = rollout()
    layer = nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    observer = NonFinite(module=layer)
    logger = Logger([JsonlBackend(path=str(tmp_path / "m.jsonl"))], RunInfo("sync", tmp_path))
    observer.reset()
    with NoHostSync(), torch.no_grad():
        observer.attach([])
        for i in range(len(states) - 1):
            observer.observe(StepContext(states[i], states[i + 1], step_index=i, probes={"p": states[i + 1]}))
        observer.detach()
        observer.log(logger, 0)
    record = logger.commit(0).result()
    logger.close()
    assert record.scalars["nonfinite/first_iteration"] == 3.0
    assert record.scalars["nonfinite/count/probe.p"] == record.scalars["nonfinite/count/state"] > 0
    assert record.scalars["nonfinite/grad_count"] == 0.0


def test_a_failing_committed_hook_is_reported_and_training_goes_on(caplog):
    class Broken(instrument.Observer):
        def observe(self, context):
            pass

        def committed(self, record):
            raise ValueError("broken hook")

    closed = []

    class Closing(instrument.Observer):
        def observe(self, context):
            pass

        def close(self):
            closed.append(True)

    inst = Instrumentation([Broken("broken"), Closing("closing"), NonFinite()], backends=[Sink()], log_interval=1)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        run_steps(inst, rollout(bad_iteration=N_ITER), steps=(0, 1))
        inst.close()
    assert inst.failures == {"broken": 2}  # counted at each logging step (tried again), reported once
    assert closed == [True]
    reports = [r for r in caplog.records if "'broken'" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(reports) == 1 and "committed" in reports[0].getMessage()


def test_a_state_buffer_reused_in_place_is_dropped_once_then_checked_as_it_comes(tmp_path, caplog):
    """An environment that writes each observation into the same tensor: the first logging step's state counts
    are dropped with one warning and nonfinite/incomplete = 1, dx (and the totals over it) are still logged and
    reported, and every later step finds the NaN at its iteration, counted against float64 NumPy read back
    from TensorBoard."""
    steps, n_iter, bad = 3, 6, 4
    inst = Instrumentation([NonFinite()], backends=[instrument.TensorBoardBackend()], log_interval=1,
                           log_dir=str(tmp_path), run_name="r")
    generator = torch.Generator().manual_seed(1)
    obs = torch.zeros(8, 3)  # the one buffer, overwritten every iteration
    wanted = []
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(steps):
            want_state, want_dx = 0, 0
            obs.zero_()  # a reset environment: the NaN of the last step does not carry into this one's dx
            with inst.step(step) as s:
                for i in range(n_iter):
                    previous = obs.clone()
                    obs.copy_(torch.randn(8, 3, generator=generator))
                    if i >= bad:
                        obs[i % 8, 1] = float("nan")
                    want_state += int((~np.isfinite(obs.double().numpy())).sum())
                    dx = obs - previous
                    want_dx += int((~np.isfinite(dx.double().numpy())).sum())
                    s.observer(StepContext(previous, obs, dx=dx, step_index=i))
            wanted.append((want_state, want_dx))
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    assert scalars["nonfinite/incomplete"] == {0: 1.0, 1: 0.0, 2: 0.0}
    assert 0 not in scalars["nonfinite/count/state"]
    assert scalars["nonfinite/count/dx"][0] == float(wanted[0][1]) > 0
    assert scalars["nonfinite/count"][0] == float(wanted[0][1])  # the sources that were checked
    for step in (1, 2):
        want_state, want_dx = wanted[step]
        assert scalars["nonfinite/count/state"][step] == float(want_state) == 2.0
        assert scalars["nonfinite/first_iteration/state"][step] == float(bad)
        assert scalars["nonfinite/first_channel/state"][step] == 1.0
        assert scalars["nonfinite/first_iteration"][step] == float(bad)
        assert scalars["nonfinite/count"][step] == float(want_state + want_dx)
    assert inst.failures == {}
    assert caplog.text.count("modified in place") == 1
    assert "the state tensors were modified in place" in caplog.text and "step 0" in caplog.text
    reports = [r.getMessage() for r in caplog.records if "non-finite values at step" in r.getMessage()]
    assert len(reports) == 1 and "step 0 (incomplete" in reports[0] and "dx channel 1" in reports[0], reports


def test_a_dropped_source_still_raises_for_a_nan_in_another_source():
    """raise_on_nonfinite=True: a step whose state buffer was reused in place still raises for the NaN its
    dx shows, and the observer's commit hook is not skipped."""
    inst = Instrumentation([NonFinite(raise_on_nonfinite=True)], backends=[], log_interval=1)
    obs = torch.zeros(4, 2)
    with pytest.raises(NonFiniteError, match=r"step 0 \(incomplete.*dx channel 0"):
        with inst.step(0) as s:
            for i in range(3):
                previous = obs.clone()
                obs.copy_(torch.full((4, 2), float(i)))
                if i == 2:
                    obs[0, 0] = float("nan")
                s.observer(StepContext(previous, obs, dx=obs - previous, step_index=i))
    inst.close()


def _dropped_on_one_rank(rank, store, out, raise_on_nonfinite):
    """Rank 0 reuses its probe buffer in place (a dropped source); the NaN is in rank 1's state."""
    import datetime
    import json
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    class Keep(instrument.Backend):
        def write(self, record):
            result.setdefault("records", []).append(record.scalars)

    result = {"steps": []}
    inst = Instrumentation([NonFinite(raise_on_nonfinite=raise_on_nonfinite)], backends=[Keep()], log_interval=1)
    probe = torch.zeros(4)
    try:
        for step in range(2):
            with inst.step(step) as s:
                x = torch.zeros(2, 3)
                for i in range(4):
                    following = torch.ones(2, 3)
                    if step == 0 and rank == 1 and i == 2:
                        following[0, 1] = float("nan")
                    value = probe if rank == 0 else probe.clone()
                    probe.fill_(float(i))
                    s.observer(StepContext(x, following, probes={"obs": value}, step_index=i))
                    x = following
            result["steps"].append(step)
    except NonFiniteError as exc:
        result["raised"] = str(exc)
    inst.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("raise_on_nonfinite", [False, True])
def test_a_source_dropped_on_one_rank_marks_the_step_and_every_rank_decides_alike(tmp_path, raise_on_nonfinite):
    """2 gloo ranks: the totals are summed over the sources every rank checked, the step is marked incomplete
    on every rank, and in raise mode every rank raises at the same commit (before, rank 0 skipped its commit
    hook and waited alone in the next step's collective until the timeout)."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_dropped_on_one_rank, args=(str(tmp_path / "store"), str(tmp_path), raise_on_nonfinite), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if raise_on_nonfinite:
        for result in results:
            assert result["steps"] == [] and "step 0 (incomplete" in result["raised"]
        return
    assert results[0]["steps"] == results[1]["steps"] == [0, 1]
    for result in results[:1]:  # only rank 0 writes
        first, second = result["records"]
        assert first["nonfinite/incomplete"] == 1.0 and second["nonfinite/incomplete"] == 0.0
        assert first["nonfinite/count/state"] == 1.0 and first["nonfinite/count"] == 1.0 + first["nonfinite/count/dx"]
        assert first["nonfinite/first_iteration"] == 2.0
        assert second["nonfinite/count"] == 0.0  # rank 0's probe is checked as it comes from then on


@pytest.mark.parametrize("given", ["never", "always", "odd iterations"])
@pytest.mark.parametrize("chained", [True, False])
def test_dx_counts_match_float32_whether_dx_is_given_or_taken_batched_from_the_pairs(given, chained, tmp_path):
    """dx taken by the observer, given by the caller, or both in one step, from chained states or copies: every
    way counts what the rollout's own float32 ``next - previous`` holds, also an overflow of finite states
    (3e38 - -3e38 is inf in float32)."""
    states = rollout(bad_iteration=5, bad_channel=1)
    states[2] = states[2].clone()
    states[2][0, 3, 2, 2] = 3e38
    states[3] = states[3].clone()
    states[3][0, 3, 2, 2] = -3e38  # both finite; their difference is not
    dx32 = [(b - a).numpy() for a, b in zip(states[:-1], states[1:], strict=True)]
    want_dx = sum(int((~np.isfinite(d)).sum()) for d in dx32)
    want_state = sum(int((~np.isfinite(s.numpy())).sum()) for s in states[1:])
    first_dx = next(i for i, d in enumerate(dx32) if not np.isfinite(d).all())
    assert first_dx == 2 and want_dx > 0
    history = instrument.RunHistoryBackend()
    inst = Instrumentation([NonFinite(gradients=False)], backends=[history], log_interval=1)
    with inst.step(0) as s:
        for i in range(N_ITER):
            previous = states[i] if chained else states[i].clone()  # a copy: not the tensor the last call returned
            dx = states[i + 1] - states[i] if given == "always" or (given == "odd iterations" and i % 2) else None
            s.observer(StepContext(previous, states[i + 1], dx=dx, step_index=i))
    inst.close()
    got = {key: values[0][1] for key, values in history.metrics.items()}
    assert got["nonfinite/count/dx"] == want_dx and got["nonfinite/count/state"] == want_state
    assert got["nonfinite/first_iteration/dx"] == first_dx
    assert got["nonfinite/first_channel/dx"] == 3 and got["nonfinite/incomplete"] == 0.0
    assert got["nonfinite/count"] == want_dx + want_state


def test_a_state_with_no_elements_is_finite_and_costs_no_failure():
    """A state of zero channels failed the whole log (argmax over nothing): every other count of the step was lost."""
    history = instrument.RunHistoryBackend()
    inst = Instrumentation([NonFinite(gradients=False)], backends=[history], log_interval=1)
    empty, full = torch.zeros(2, 0, 3, 3), torch.tensor([[1.0, float("nan")]])
    with inst.step(0) as s:
        for i in range(3):
            s.observer(StepContext(empty, empty + 1, step_index=i, probes={"head": full}))
    inst.close()
    got = {key: values[0][1] for key, values in history.metrics.items()}
    assert inst.failures == {}
    assert got["nonfinite/count/state"] == 0 and got["nonfinite/first_channel/state"] == -1
    assert got["nonfinite/count/probe.head"] == 3 and got["nonfinite/first_iteration"] == 0


def _logged(scenario) -> dict:
    history = instrument.RunHistoryBackend()
    inst = Instrumentation([NonFinite(gradients=False)], backends=[history], log_interval=1)
    with inst.step(0) as s:
        scenario(s.observer)
    inst.close()
    assert inst.failures == {}
    return {key: values[0][1] for key, values in history.metrics.items()}


@pytest.mark.parametrize("reused", ["next", "previous"])
def test_a_reused_state_buffer_costs_only_the_state_and_dx_is_still_counted(reused):
    """dx is taken as each iteration is observed: a rollout that writes its observations into one buffer loses
    the state's counts of the step (caught, said once) but not dx's (a review found dx dropped with the state
    when it was taken from kept (previous, next) pairs at log time)."""
    def scenario(observe):
        obs = torch.zeros(8, 3)
        for i in range(4):
            if reused == "next":
                previous = obs.clone()
                obs.copy_(torch.full((8, 3), float(i)))
                if i == 2:
                    obs[0, 1] = float("nan")
                observe(StepContext(previous, obs, step_index=i))
            else:
                nxt = torch.full((8, 3), float(i))
                if i == 2:
                    nxt[0, 1] = float("nan")
                observe(StepContext(obs, nxt, step_index=i))
                obs.copy_(nxt)

    got = _logged(scenario)
    assert got["nonfinite/count/dx"] == 2  # the NaN enters dx at iteration 2, and leaves it at 3
    assert got["nonfinite/first_iteration/dx"] == 2 and got["nonfinite/first_channel/dx"] == 1
    assert got["nonfinite/incomplete"] == (1.0 if reused == "next" else 0.0)
    assert ("nonfinite/count/state" in got) == (reused == "previous")


def test_dx_of_a_first_state_of_another_dtype_or_shape_is_each_iterations_own_difference():
    """A float64 seed before float32 states (the overflow of two finite float32 states is inf in float32, not in
    float64), a [1, 4] seed broadcast against [3, 4] states, and integer states with an integer dx given in
    some iterations: dx counts what each iteration's own ``next - previous`` holds."""
    def mixed(observe):
        x, states = torch.zeros(3, 4, dtype=torch.float64), [torch.zeros(3, 4) for _ in range(4)]
        states[1][0, 0], states[2][0, 0] = 3e38, -3e38
        for i, nxt in enumerate(states):
            observe(StepContext(x, nxt, step_index=i))
            x = nxt

    def broadcast(observe):
        x = torch.zeros(1, 4)
        for i in range(3):
            nxt = torch.ones(3, 4)
            nxt[0, 0] = float("nan")
            observe(StepContext(x, nxt, step_index=i))
            x = nxt

    ints = [torch.full((2, 3), i, dtype=torch.int64) for i in range(5)]

    def integers(observe):
        for i in range(4):
            dx = ints[i + 1] - ints[i] if i % 2 else None
            observe(StepContext(ints[i], ints[i + 1], dx=dx, step_index=i))

    got = _logged(mixed)
    assert got["nonfinite/count/dx"] == 1 and got["nonfinite/first_iteration/dx"] == 2
    got = _logged(broadcast)
    assert got["nonfinite/count/dx"] == 3 * 1 and got["nonfinite/count/state"] == 3
    got = _logged(integers)
    assert got["nonfinite/count/dx"] == 0 and got["nonfinite/first_iteration"] == -1


@pytest.mark.parametrize("first_recorded", [0, 5])
def test_a_probe_recorded_in_some_iterations_is_placed_at_the_rollout_s_iteration(tmp_path, caplog, first_recorded):
    """A probe recorded from iteration 5 on (after a warm-up, in a branch) that is NaN at iteration 6 was placed
    at its own second recording, 1, and named the first non-finite source before a state NaN at iteration 3
    (found by a review). Read back from TensorBoard."""
    torch.manual_seed(4)
    x = torch.rand(2, 3, 4, 4)
    states = [x]
    for i in range(8):
        x = x * 0.9
        if i == 7:
            x = x.clone()
            x[1, 2, 0, 0] = float("nan")  # the state's first non-finite value: iteration 7
        states.append(x)
    inst = Instrumentation([NonFinite(dx=False)], backends=[instrument.TensorBoardBackend()], log_interval=1,
                           log_dir=str(tmp_path), run_name="r")
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0) as s:
        for i in range(8):
            probes = {}
            if i >= first_recorded:
                probes["hidden"] = torch.full((2, 3), float("nan")) if i == 6 else torch.zeros(2, 3)
            s.observer(StepContext(states[i], states[i + 1], step_index=i, probes=probes))
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    assert scalars["nonfinite/first_iteration/probe.hidden"] == {0: 6.0}
    assert scalars["nonfinite/first_iteration/state"] == {0: 7.0}
    assert scalars["nonfinite/first_iteration"] == {0: 6.0}
    assert scalars["nonfinite/first_channel/probe.hidden"] == {0: 0.0}
    assert scalars["nonfinite/count"] == {0: 7.0}
    said = [r.getMessage() for r in caplog.records if "non-finite values at step 0" in r.getMessage()]
    assert len(said) == 1 and "first at rollout iteration 6 in probe.hidden" in said[0], said


def test_a_probe_whose_channel_count_changes_within_a_step_is_counted_with_the_state(tmp_path):
    """A per-token probe, [2, 6] then [2, 3]: its per-channel tables could not be concatenated, so the step lost
    every NonFinite metric, the state's own NaN at iteration 2 among them (a review). Now the narrower iterations
    count no non-finite value in the channels they lack. Read back from TensorBoard, against NumPy."""
    g = torch.Generator().manual_seed(5)
    states = [torch.rand(4, 3, generator=g) for _ in range(5)]
    states[3][1, 0] = float("nan")  # iteration 2's output
    probes = [torch.rand(2, 6 if i < 2 else 3, generator=g) for i in range(4)]
    probes[3][0, 2] = float("inf")  # iteration 3, channel 2 of the narrower probe
    probes[1][1, 5] = float("nan")  # iteration 1, channel 5: only the wider probe has it
    inst = Instrumentation([NonFinite(dx=False, channel_dim=-1)], backends=[instrument.TensorBoardBackend()],
                           log_interval=1, log_dir=str(tmp_path), run_name="r")
    with inst.step(0) as s:
        for i in range(4):
            s.observer(StepContext(states[i], states[i + 1], step_index=i, probes={"p": probes[i]}))
    inst.close()
    assert inst.failures == {}
    scalars = read_scalars(tmp_path / "r")
    bad = [int((~np.isfinite(p.numpy())).sum()) for p in probes]
    assert scalars["nonfinite/count/probe.p"] == {0: float(sum(bad))} == {0: 2.0}
    assert scalars["nonfinite/first_iteration/probe.p"] == {0: 1.0}
    assert scalars["nonfinite/first_channel/probe.p"] == {0: 5.0}
    assert scalars["nonfinite/count/state"] == {0: 1.0} and scalars["nonfinite/first_iteration/state"] == {0: 2.0}
    assert scalars["nonfinite/first_iteration"] == {0: 1.0} and scalars["nonfinite/count"] == {0: 3.0}


@pytest.mark.parametrize("channel_dim", [0, 4, -5])
def test_a_channel_dim_naming_no_channel_dimension_is_refused(channel_dim, caplog):
    """channel_dim=0 read the batch row as the channel, and one out of range read the whole state as one channel,
    unsaid (a review); IterationStats refused both, as docs/observers.md says."""
    sink = Sink()
    inst = Instrumentation([NonFinite(channel_dim=channel_dim, name="nf")], backends=[sink], log_interval=1)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        run_steps(inst, [torch.rand(4, 3, 5, 5) for _ in range(3)])
    inst.close()
    assert inst.failures == {"nf": 1}
    said = [r.exc_info[1] for r in caplog.records if r.exc_info and "'nf' failed in observe()" in r.getMessage()]
    assert len(said) == 1 and isinstance(said[0], ConfigurationError)
    assert f"channel_dim={channel_dim}" in str(said[0]) and "[4, 3, 5, 5]" in str(said[0])
    assert not any("nf/first_channel/state" in r.scalars for r in sink.records)


def test_a_nan_loss_over_many_parameters_names_eight_of_them_and_counts_the_rest(caplog):
    """A NaN loss makes every gradient NaN: the report listed every parameter (77 KB in one log line at 3,000
    tensors, and as much in a NonFiniteError). It names the first 8 in the model's order and counts the rest;
    every parameter keeps its own grad_count key."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(10)])  # 20 parameter tensors
    sink = Sink()
    inst = Instrumentation([NonFinite(module=model)], backends=[sink], log_interval=1)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        (model(torch.ones(2, 3)).sum() * float("nan")).backward()
    inst.close()
    (message,) = [r.getMessage() for r in caplog.records if "non-finite gradient" in r.getMessage()]
    names = [name for name, _ in model.named_parameters()]
    assert all(f"{name} (" in message for name in names[:8]) and not any(f"{name} (" in message for name in names[8:])
    assert "and 12 more parameters (see nonfinite/grad_count/*)" in message
    scalars = sink.records[0].scalars
    assert all(scalars[f"nonfinite/grad_count/{name}"] == float(p.numel()) for name, p in model.named_parameters())
    assert scalars["nonfinite/grad_count"] == float(sum(p.numel() for p in model.parameters()))
