"""``Instrumentation.close()`` called from another thread (a watchdog, a signal forwarded to a worker) while the
training thread is inside a logging step: in the block's body, the block's exit undoes every hook the step
attached and commits nothing; while the block ends (observers' log, commit), the step is not written and the
block does not raise."""

import threading

import torch
from torch import nn

import instrument
from tests.test_checkpointing import Sink


class Rule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.Tanh()

    def forward(self, x):
        return x + self.act(self.lin(x))


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_a_close_during_the_blocks_body_leaves_no_observer_hook_on_the_model():
    """close() took the watch's hooks off but not ActivationStats' own: they ran (and buffered outputs) at every
    later call of the model, for the rest of the process (a review)."""
    rule = Rule()
    inst = instrument.Instrumentation(observers=[instrument.ActivationStats(images=False)], backends=[Sink()],
                                      log_interval=1, overhead_budget=None)
    inst.watch(rule)
    with inst.step(0):
        rule(torch.randn(2, 4))
        assert _hooks(rule) > 0
        closer = threading.Thread(target=inst.close)
        closer.start()
        closer.join()
    assert _hooks(rule) == 0
    assert not inst.logger.backends[0].records  # the block's exit committed nothing


def test_a_close_while_the_block_ends_does_not_raise_in_the_training_thread(caplog):
    """close() from another thread while the training thread ran the observers' log closed the logger under it:
    the block raised ConfigurationError into the training loop, blaming the user (a review). The step is not
    written (close() does not wait for it: the ending block may wait for the writer or a lock the closing thread
    holds), and that is said once; the loop goes on to find the session closed."""
    import logging

    in_log, closed = threading.Event(), threading.Event()

    class Slow(instrument.Observer):
        def observe(self, context):
            pass

        def log(self, logger, step):
            in_log.set()
            closed.wait(10)  # the other thread's close() comes now
            logger.log_metrics({"seen": 1.0}, step=step, prefix="slow")

    sink = Sink()
    inst = instrument.Instrumentation(observers=[Slow(name="slow")], backends=[sink], log_interval=1,
                                      overhead_budget=None)
    closer = threading.Thread(target=lambda: (in_log.wait(), inst.close(), closed.set()))
    closer.start()
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0) as s:
        s.observer(instrument.StepContext(torch.zeros(2), torch.ones(2)))
    closer.join()
    assert any("closed while logging step 0 was ending" in r.getMessage()
               for r in caplog.records)
    assert not any("slow/seen" in r.scalars for r in sink.records)


def test_two_closes_at_once_close_observers_and_components_once():
    """The training thread's close() inside a logging block (an early stop) ends the step first; another thread's
    close() (a watchdog) that came meanwhile found the session not yet marked closed and closed it too: when the
    first went on, every observer's and component's close() ran a second time (a review)."""
    in_log, closed = threading.Event(), threading.Event()
    closes = []

    class Slow(instrument.Observer):
        def observe(self, context):
            pass

        def log(self, logger, step):
            in_log.set()
            closed.wait(10)  # the other thread's close() runs whole now

        def close(self):
            closes.append("observer")

    class Component:
        def log(self, logger, step):
            pass

        def close(self):
            closes.append("component")

    inst = instrument.Instrumentation(observers=[Slow(name="slow")], backends=[Sink()], log_interval=1,
                                      overhead_budget=None)
    inst.add_component(Component())
    closer = threading.Thread(target=lambda: (in_log.wait(10), inst.close(), closed.set()))
    closer.start()
    with inst.step(0) as s:
        s.observer(instrument.StepContext(torch.zeros(2), torch.ones(2)))
        inst.close()
    closer.join()
    assert sorted(closes) == ["component", "observer"]
    inst.close()  # idempotent
    assert sorted(closes) == ["component", "observer"]


def test_a_close_from_a_signal_handler_while_close_claims_the_session_does_not_deadlock(monkeypatch):
    """A SIGTERM handler's close() that landed while the main thread's close() held the claim's lock waited for
    that lock forever, in the thread that held it (a review). Delivered inside the claim here, deterministically."""
    import signal

    inst = instrument.Instrumentation([], backends=[Sink()], log_interval=1)
    calls = []
    real = dict.setdefault

    class Claims(dict):
        def setdefault(self, key, value):
            if key == "_close_claim" and not calls:
                calls.append(key)
                signal.raise_signal(signal.SIGUSR1)  # its handler runs at the next bytecode
            return real(self, key, value)

    inst.__dict__ = Claims(inst.__dict__)
    previous = signal.signal(signal.SIGUSR1, lambda *_: inst.close())
    try:
        inst.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert calls == ["_close_claim"] and inst._closed
