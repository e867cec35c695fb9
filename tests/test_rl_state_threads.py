"""`rl.state_dict()` beside other threads: the counters it saves and the session's step always agree
(``iterations == last_step + 1`` with ``log_interval=1``), so a run resumed from it logs every step once, with no
gap. Real sessions, JSONL read back; the interleavings are forced with a backend that holds its flushes."""

import json
import threading

import numpy as np

import instrument
from instrument.rl import CollectionMetrics, RLLogging

REWARD, DONE = np.ones((4, 2)), np.zeros((4, 2), bool)


class _Turns(instrument.Backend):
    """Once armed, each flush (what a checkpoint waits for) says so and waits for its turn."""

    name = "turns"

    def __init__(self) -> None:
        self.armed = False
        self.entered, self.go = threading.Semaphore(0), threading.Semaphore(0)

    def write(self, record) -> None:
        pass

    def flush(self) -> None:
        if self.armed:
            self.entered.release()
            self.go.acquire(timeout=60)


def _session(path, backends=(), resume=False):
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path / "m.jsonl")), *backends],
                                      log_interval=1, log_dir=str(path), run_name="r", resume=resume,
                                      flush_secs=3600.0, overhead_budget=None, system_monitor=None)
    return inst, RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)


def _steps(path):
    lines = map(json.loads, (path / "m.jsonl").read_text().splitlines())
    return [line["step"] for line in lines if "metrics" in line]


def _resume_and_finish(path, state, until):
    inst, rl = _session(path, resume=True)
    rl.load_state_dict(state)
    for k in range(rl.step, until):
        with inst.step(k), rl.iteration():
            rl.observe_batch(reward=REWARD, done=DONE)
    rl.close()
    inst.close()
    return _steps(path)


def test_a_step_opened_while_the_checkpoint_reads_the_session_again_is_counted(tmp_path):
    """The review's race (116 of 511 states disagreed): a step committed during the checkpoint's wait made it read
    the counters and the session again, but the training thread's next ``inst.step(k)`` block opened (the session
    counts it committed) between the two reads, so the state saved iterations 3 with last step 3, and the resumed
    run logged step 3 twice. Forced here: the counters are read, then block 3 opens, then the session is read."""
    turns = _Turns()
    inst, rl = _session(tmp_path, [turns])
    for k in range(2):
        with inst.step(k), rl.iteration():
            rl.observe_batch(reward=REWARD, done=DONE)
    turns.armed = True
    saved = {}
    saver = threading.Thread(target=lambda: saved.update(state=rl.state_dict()))
    saver.start()
    assert turns.entered.acquire(timeout=60)  # counters read (2 iterations); the session's flush waits
    with inst.step(2), rl.iteration():  # committed meanwhile: the checkpoint reads both again
        rl.observe_batch(reward=REWARD, done=DONE)
    turns.go.release()
    assert turns.entered.acquire(timeout=60)  # counters read again (3 iterations); the session's flush waits
    with inst.step(3):  # opens between the two reads
        turns.go.release()
        saver.join(60)
        turns.armed = False  # the block's exit flushes again: the checkpoint counted its step as committed
        with rl.iteration():
            rl.observe_batch(reward=REWARD, done=DONE)
    state = saved["state"]
    rl.close()
    inst.close()
    assert state["session"]["last_step"] == 3
    assert state["counters"]["iterations"] == 4
    assert _resume_and_finish(tmp_path, state, 6) == [0, 1, 2, 3, 4, 5]


def test_a_collector_batch_between_iterations_does_not_count_an_iteration(tmp_path):
    """The review's case (100 of 100 saves had iterations = last_step + 2): a collector thread's batch between two
    iterations counted the next iteration as done, so the resumed run skipped a step. Now it counts the batch's
    frames, not an iteration."""
    inst, rl = _session(tmp_path)
    states = []
    for _ in range(3):
        with rl.iteration():
            rl.observe_batch(reward=REWARD, done=DONE)
        collector = threading.Thread(target=rl.observe_batch, kwargs={"reward": REWARD, "done": DONE})
        collector.start()
        collector.join(60)
        states.append(rl.state_dict())
    rl.close()
    inst.close()
    assert [(s["counters"]["iterations"], s["session"]["last_step"]) for s in states] == [(1, 0), (2, 1), (3, 2)]
    assert states[-1]["counters"]["frames"] == 6 * 8  # the collector's batches are counted
    assert _resume_and_finish(tmp_path, states[1], 4) == [0, 1, 2, 3]


def test_states_saved_beside_a_training_and_a_collector_thread_always_agree(tmp_path):
    """A stress test, no timing asserted: a checkpoint thread saves in a loop while the training thread opens and
    commits its ``inst.step(k)`` blocks and a collector thread feeds batches. Every state agrees."""
    inst, rl = _session(tmp_path)
    stop, states, errors = threading.Event(), [], []

    def loop(work):
        try:
            while not stop.is_set():
                work()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(lambda: rl.observe_batch(reward=REWARD, done=DONE),)),
               threading.Thread(target=loop, args=(lambda: states.append(rl.state_dict()),))]
    for thread in threads:
        thread.start()
    try:
        for k in range(200):
            with inst.step(k), rl.iteration():
                rl.observe_losses({"loss": 1.0})
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    rl.close()
    inst.close()
    assert not errors and states
    pairs = [(s["counters"]["iterations"], s["session"]["last_step"]) for s in states]
    assert [p for p in pairs if p[0] != (-1 if p[1] is None else p[1]) + 1] == []
