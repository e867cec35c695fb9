"""What instrument keeps alive: nothing of a logging step once it is written, nothing of a model once the session
closed. Told by weak references to the tensors' storages (the logger and observers may keep views of them)."""

import gc
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import instrument
from tests.test_checkpointing import Sink


def _released(ref: StorageWeakRef, within: float = 10.0) -> bool:
    """Whether the storage is freed, waiting up to ``within`` seconds for the writer thread to finish the step."""
    deadline = time.monotonic() + within
    while True:
        gc.collect()
        if ref.expired():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def test_the_writer_lets_a_written_steps_tensors_go_before_the_next_commit():
    """The writer thread's loop kept its last item bound while it waited for the next one, so a logging step's
    staged tensors (device memory on a GPU) and their host copy stayed alive through the whole interval, and for
    good behind a session dropped without close()."""
    inst = instrument.Instrumentation(observers=[], backends=[Sink()], log_interval=100, overhead_budget=None)
    with inst.step(0):
        values = torch.randn(10_000)
        inst.logger.log_histogram("values", values, 0)
        ref = StorageWeakRef(values.untyped_storage())
        del values
    assert _released(ref)  # no later commit, flush or close: the interval's other steps hold nothing
    inst.close()


def test_state_histogram_lets_the_states_it_kept_go_when_the_step_is_logged():
    """StateHistogram kept its iterations' states (a whole state each) until the next logging step's reset, and
    after close(): more peak memory in every non-logging step of the interval."""
    observer = instrument.StateHistogram(iterations=(0, -1))
    inst = instrument.Instrumentation(observers=[observer], backends=[Sink()], log_interval=1,
                                      overhead_budget=None)
    refs = []
    for step in (0, 1):  # the second: a step whose states are kept by reference, not copied
        with inst.step(step) as s:
            previous = torch.zeros(2, 3, 4, 4)
            for _ in range(3):
                state = previous + 1.0
                s.observer(instrument.StepContext(previous, state))
                refs.append(StorageWeakRef(state.untyped_storage()))
                previous = state
            del previous, state
    inst.flush()
    assert all(_released(ref) for ref in refs)
    inst.close()


@pytest.mark.parametrize("make", [lambda: instrument.GradientStats(), lambda: instrument.NonFinite()])
def test_an_observer_kept_after_close_holds_no_parameter_of_the_model(make):
    """A notebook defines an observer once and hands it to each new session: GradientStats and NonFinite kept the
    last session's parameters (and GradientStats its modules) after close(), so ``del model`` freed nothing."""
    observer = make()
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with instrument.Instrumentation(observers=[observer], backends=[Sink()], log_interval=1,
                                    overhead_budget=None) as inst:
        inst.watch(model)
        with inst.step(0):
            model(torch.randn(2, 64)).square().mean().backward()
            optimizer.step()
    refs = [StorageWeakRef(model.weight.untyped_storage()), StorageWeakRef(model.weight.grad.untyped_storage())]
    del model, optimizer, inst  # the closed session itself keeps its watched modules; the observer stays
    assert all(_released(ref, within=0.0) for ref in refs)


@pytest.mark.parametrize("make", [lambda: instrument.IterationStats(images=False), lambda: instrument.UpdateNorm(),
                                  lambda: instrument.ActivationStats(images=False), lambda: instrument.StateHistogram(),
                                  lambda: instrument.NonFinite(gradients=False)])
def test_what_a_step_that_raised_kept_goes_when_the_session_closes(make):
    """A logging step whose body raised never reaches the observers' log: what they kept of it (references, or
    copies of slices) stayed alive after close() for as long as the observer object did (a notebook re-uses it)."""
    observer = make()
    inst = instrument.Instrumentation(observers=[observer], backends=[Sink()], log_interval=1, overhead_budget=None)
    layer = torch.nn.Linear(8, 8)
    inst.watch(layer)  # ActivationStats hooks its output
    refs = []
    with pytest.raises(ValueError), inst.step(0) as s, torch.no_grad():
        x = torch.randn(4, 8)
        for t in range(3):
            y = layer(x)
            s.observer(instrument.StepContext(x, y, step_index=t))
            refs.append(StorageWeakRef(y.untyped_storage()))
            x = y
        raise ValueError("the training step failed")
    inst.close()
    del x, y, layer, inst, s
    assert all(_released(ref, within=0.0) for ref in refs)


def test_rollout_video_lets_its_frames_go_once_logged():
    """RolloutVideo kept its frames (copies of the rendered channels) through the interval and after close()."""
    video = instrument.RolloutVideo()
    inst = instrument.Instrumentation(observers=[video], backends=[Sink()], log_interval=100, overhead_budget=None)
    with inst.step(0) as s, torch.no_grad():
        x = torch.rand(2, 4, 8, 8)
        for t in range(5):
            s.observer(instrument.StepContext(x, x * 0.9, step_index=t))
            x = x * 0.9
    assert video._frames == []
    inst.close()


def test_a_nonfinite_observer_handed_to_a_new_session_reports_that_runs_first_nan(caplog):
    """Its once-per-run report outlived close(), so the next run's first NaN was counted but never said."""
    import logging

    observer = instrument.NonFinite(gradients=False)
    for run in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="instrument"), instrument.Instrumentation(
                observers=[observer], backends=[Sink()], log_interval=1, overhead_budget=None) as inst:
            with inst.step(0) as s:
                s.observer(instrument.StepContext(torch.zeros(2, 3), torch.tensor([[0.0, float("nan"), 1.0]] * 2)))
        said = [r for r in caplog.records if "non-finite values at step 0" in r.getMessage()]
        assert len(said) == 1, (run, [r.getMessage() for r in caplog.records])
