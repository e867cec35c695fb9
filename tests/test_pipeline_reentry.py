"""Code that runs on the logger's writer thread and calls back into the logger (a backend, a logging handler),
a backend that calls sys.exit, Ctrl-C while a commit waits for room, and an exit while the queue is full.

Each scenario runs in a child process: before these fixes most of them hung, and a hang there is a timeout
(a failed test) instead of a hung test run."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import run_child
from tests.test_pipeline import WAIT, steps_of

PRELUDE = textwrap.dedent(
    """
    import logging, os, signal, sys, threading, time
    import torch
    from instrument.backends.base import Backend, RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.backends.tensorboard import TensorBoardBackend
    from instrument.logger import shutdown
    from instrument.logger.logger import Logger
    root = sys.argv[1]
    """
)


def _run(tmp_path, body: str, timeout: float = WAIT) -> subprocess.CompletedProcess:
    try:
        return run_child(tmp_path, PRELUDE + textwrap.dedent(body), str(tmp_path), timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the child hung (killed after {timeout} s): {exc.stdout!r} {exc.stderr!r}") from exc


def test_a_logging_handler_that_commits_on_the_writer_thread_does_not_deadlock_close(tmp_path):
    """A handler turning instrument's warnings into a metric (commit=True): TensorBoard warned on the writer
    thread during close(), which held the commit lock while waiting for that thread, and the handler waited for
    the lock: close() never returned."""
    done = _run(tmp_path, """
        logger = Logger([TensorBoardBackend(), JsonlBackend()], RunInfo("r", root))
        seen = []

        class Count(logging.Handler):
            def emit(self, record):
                if record.levelno >= logging.WARNING and record.threadName.startswith("instrument-writer"):
                    try:
                        logger.log_metrics({"warnings": 1.0}, step=1, commit=True)
                    except Exception as exc:
                        seen.append(type(exc).__name__)

        logging.getLogger("instrument").addHandler(Count())
        logger.log_metrics({"x": 1.0}, step=1)
        logger.log_histogram("h", torch.tensor([float("nan"), 1.0]), step=1)  # TensorBoard warns on the writer
        logger.close()
        print("closed", seen, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert "closed ['ConfigurationError']" in done.stdout  # the closed logger refused the handler's value
    assert steps_of(tmp_path / "r" / "metrics.jsonl") == [1]


@pytest.mark.parametrize("call", ["commit", "commit_own", "close"])
def test_a_backend_calling_back_while_a_commit_waits_for_room_does_not_deadlock(tmp_path, call):
    """A backend that commits (or closes) from write() while the training thread's commit held the commit lock
    and waited for room in the full queue: each waited for the other. Now the writer thread's call gives up on
    the lock after a bounded wait and says so; its values go with the next commit."""
    done = _run(tmp_path, f"""
        call = {call!r}

        class Calls(Backend):
            def write(self, record):
                if record.step == 1:
                    # until the training thread's commit of step 3 holds the commit lock and waits for room
                    while not [h for h, _ in list(logger._writer._waiting.values()) if h.step == 3]:
                        time.sleep(0.005)
                    if call == "commit":
                        logger.log_metrics({{"from_backend": 5.0}}, step=3)
                        logger.commit()
                    elif call == "commit_own":
                        logger.log_metrics({{"from_backend": 5.0}}, step=3, commit=True)
                    else:
                        logger.close()

        logger = Logger([Calls(), JsonlBackend()], RunInfo("r", root), queue_size=1)
        for step in range(1, 6):
            try:
                logger.log_metrics({{"x": float(step)}}, step=step)
                logger.commit(step)
            except Exception as exc:
                print("commit", step, type(exc).__name__, flush=True)
        logger.close()
        print("done", logger.failures, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert "done {}" in done.stdout, done.stdout + done.stderr
    rows = [r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) if "step" in r]
    if call == "close":  # closed from the writer: the waiting step 3 is written, later commits refused
        assert [r["step"] for r in rows] == [1, 2, 3] and "commit 4 ConfigurationError" in done.stdout
        assert "the logger closes without a last commit" in done.stderr
    else:  # every step written once, in order; the backend's value with the next commit
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
        assert rows[3]["metrics"] == {"x": 4.0, "from_backend": 5.0}
    assert "on the logger's own writer thread" in done.stderr


def test_a_backend_that_calls_sys_exit_costs_that_backend_alone(tmp_path):
    """SystemExit passed the ledger (which caught Exception only), so the writer's last-resort handler skipped
    the backends after it for that step, and the failure was neither counted nor reflected by flush()."""
    done = _run(tmp_path, """
        class Exits(Backend):
            def write(self, record):
                if record.step == 2:
                    sys.exit("the SDK gave up")

        logger = Logger([Exits(), JsonlBackend()], RunInfo("r", root))
        for step in (1, 2, 3):
            logger.log_metrics({"x": float(step)}, step=step)
            logger.commit(step)
        print("flush", logger.flush(), flush=True)
        logger.close()
        print("failures", logger.failures, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert "flush False" in done.stdout and "failures {'Exits': 1}" in done.stdout
    assert steps_of(tmp_path / "r" / "metrics.jsonl") == [1, 2, 3]



@pytest.mark.parametrize("raised", ["asyncio.CancelledError()", "KeyboardInterrupt()", "GeneratorExit()"])
@pytest.mark.parametrize("method", ["write", "flush", "log_hyperparams"])
def test_a_backend_raising_any_base_exception_costs_that_backend_alone(tmp_path, raised, method):
    """Only Exception and SystemExit were caught: a CancelledError an SDK's event loop let out (or a
    KeyboardInterrupt or GeneratorExit raised on the writer thread) skipped every backend after it, for every
    step, uncounted, and flush() said True."""
    done = _run(tmp_path, f"""
        import asyncio

        class Raises(Backend):
            def {method}(self, *args):
                raise {raised}

        logger = Logger([Raises(), JsonlBackend()], RunInfo("r", root))
        logger.log_hyperparams({{"lr": 0.1}})
        for step in (1, 2, 3):
            logger.log_metrics({{"x": float(step)}}, step=step)
            logger.commit(step)
        print("flush", logger.flush(), flush=True)
        logger.close()
        print("failures", {{k: v > 0 for k, v in logger.failures.items()}}, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert "flush False" in done.stdout and "failures {'Raises': True}" in done.stdout, done.stdout + done.stderr
    assert steps_of(tmp_path / "r" / "metrics.jsonl") == [1, 2, 3]
    if method == "log_hyperparams":
        assert any("hyperparameters" in line for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())


def test_a_backend_whose_open_calls_sys_exit_fails_the_start_like_any_other_open_failure(tmp_path):
    """SystemExit from open() passed the open's handler: the run started with a dead backend still listed,
    nothing counted. It is an open failure now: the start raises, naming the backend."""
    done = _run(tmp_path, """
        from instrument.errors import ConfigurationError

        class Exits(Backend):
            def open(self, run):
                sys.exit(1)

        try:
            Logger([Exits(), JsonlBackend()], RunInfo("r", root))
        except ConfigurationError as exc:
            print("refused:", exc, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert "refused: could not open Exits: SystemExit" in done.stdout, done.stdout + done.stderr

@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_while_a_commit_waits_for_room_never_writes_that_step_out_of_order(tmp_path):
    """The interrupted step stayed in the writer's waiting list, and close() queued it after every later step
    (JSONL 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 6). Now it is not handed over: every written step is in order."""
    done = _run(tmp_path, """
        class Slow(Backend):
            def write(self, record):
                time.sleep(0.2)

        logger = Logger([Slow(), JsonlBackend()], RunInfo("r", root), queue_size=1)

        def interrupt():
            while not logger._writer._waiting:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGINT)

        interrupted = None
        for step in range(1, 10):
            logger.log_metrics({"x": float(step)}, step=step)
            if step == 4:
                threading.Thread(target=interrupt, daemon=True).start()
            try:
                logger.commit(step)
            except KeyboardInterrupt:
                interrupted = step
        logger.close()
        print("interrupted", interrupted, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    interrupted = int(done.stdout.split("interrupted ")[1].split()[0])
    steps = steps_of(tmp_path / "r" / "metrics.jsonl")
    assert steps == sorted(steps) and interrupted not in steps
    assert steps == [s for s in range(1, 10) if s != interrupted]


def test_exit_with_a_full_queue_and_a_staged_value_keeps_its_time_bound(tmp_path):
    """A backend hung in write, exactly queue_size records waiting and one value staged when the script ends:
    the exit's close made a last commit that waited for room forever, past shutdown.TIMEOUT."""
    done = _run(tmp_path, """
        shutdown.TIMEOUT = 3.0
        entered = threading.Event()

        class Hung(Backend):
            def write(self, record):
                entered.set()
                threading.Event().wait()

        logger = Logger([JsonlBackend(), Hung()], RunInfo("r", root), queue_size=2)
        logger.log_metrics({"x": 1.0}, step=1)
        logger.commit(1)
        entered.wait()
        for step in (2, 3):
            logger.log_metrics({"x": float(step)}, step=step)
            logger.commit(step)
        logger.log_metrics({"x": 4.0}, step=4)
        print("exiting", flush=True)
    """)
    assert "exiting" in done.stdout, done.stderr  # and it exited: a hang is a timeout (`_run`)
    assert steps_of(tmp_path / "r" / "metrics.jsonl") == [1]  # the writer hangs in step 1's second backend


def test_a_second_close_from_another_thread_returns_after_the_first_one_finished(tmp_path):
    """close() no longer holds the commit lock while it waits for the writer (a callback from the writer thread
    could deadlock on it), and a second close() found the writer's close queued and waited only for a 5 s
    thread join: it returned with steps still unwritten and the backends open."""
    import threading
    import time

    from instrument.backends.base import Backend, RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger

    class Slow(Backend):
        closed = False

        def write(self, record):
            time.sleep(0.8)

        def close(self):
            Slow.closed = True

    logger = Logger([Slow(), JsonlBackend()], RunInfo("r", tmp_path), queue_size=16)
    for step in range(8):
        logger.log_metrics({"x": float(step)}, step=step)
        logger.commit(step)
    first = threading.Thread(target=logger.close)
    first.start()
    while not logger._writer._closing:
        time.sleep(0.005)
    logger.close()  # the second close, while the first waits for the writer
    assert Slow.closed and steps_of(tmp_path / "r" / "metrics.jsonl") == list(range(8))
    first.join(WAIT)
