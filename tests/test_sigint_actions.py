"""Ctrl-C whatever SIGINT's action was before the first Logger: Python's own handler (raises KeyboardInterrupt,
tests/test_pipeline.py), the default action (the process ends at once: ``SIG_DFL``, set by a launcher or by a
program that wants Ctrl-C to end it without a traceback), or a handler of the user's that ends the process. A
review found the last two left the MLflow run RUNNING and W&B without its exit: the default action killed the
process after a flush without closing a logger, and a handler's ``sys.exit`` ended the run as finished. Real
child processes, real signals; every committed step is read back from JSONL."""

import signal

import pytest

from tests.conftest import run_child
from tests.test_pipeline import steps_of

CHILD = """
import os, signal, sys, time
{action}
from instrument.backends.base import Backend, RunInfo
from instrument.backends.jsonl import JsonlBackend
from instrument.logger.logger import Logger

class Status(Backend):
    def write(self, record):
        pass

    def on_exit(self, status):
        print("on_exit", status, flush=True)

logger = Logger([JsonlBackend(), Status()], RunInfo("child", sys.argv[1]))  # not closed by the script
for step in range(5):
    logger.log_metrics({{"a": float(step)}}, step=step)
    logger.commit(step)
os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would
time.sleep(60)  # never reached: the signal ends the process
print("still running", flush=True)
"""

ACTIONS = {
    "default action": ("signal.signal(signal.SIGINT, signal.SIG_DFL)", -signal.SIGINT),
    "a handler that exits": ("signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(3))", 3),
}


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_ctrl_c_closes_every_logger_killed_whatever_sigint_did_before(tmp_path, action):
    line, returncode = ACTIONS[action]
    done = run_child(tmp_path, CHILD.format(action=line), str(tmp_path), timeout=120)
    assert done.returncode == returncode, done.stderr
    assert done.stdout.splitlines() == ["on_exit killed"], done.stdout + done.stderr
    assert steps_of(tmp_path / "child" / "metrics.jsonl") == [0, 1, 2, 3, 4]


THREADED = """
import signal, sys, threading
from instrument.backends.base import RunInfo
from instrument.backends.jsonl import JsonlBackend
from instrument.logger.logger import Logger

default = signal.getsignal(signal.SIGTERM)
made = []
for name in ("first", "second"):
    worker = threading.Thread(target=lambda n=name: made.append(Logger([JsonlBackend()], RunInfo(n, sys.argv[1]))),
                              name=f"worker-{name}")
    worker.start()
    worker.join()
print("after threads:", signal.getsignal(signal.SIGTERM) is default, flush=True)
made.append(Logger([JsonlBackend()], RunInfo("main", sys.argv[1])))
print("after main:", signal.getsignal(signal.SIGTERM) is default, flush=True)
for logger in made:
    logger.close()
"""


def test_a_logger_made_off_the_main_thread_says_once_that_no_signal_handler_guards_it(tmp_path):
    """Python installs signal handlers on the main thread only. A Logger made on a worker thread (and none yet on
    the main one) was left without SIGTERM handling in silence: a SIGTERM then lost what it had queued. It now says
    so once, naming the thread; the first Logger made on the main thread still installs the handlers."""
    done = run_child(tmp_path, THREADED, str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["after threads: True", "after main: False"], done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if "no SIGTERM/SIGINT handler" in line]
    assert len(said) == 1, done.stderr
    assert "'worker-first'" in said[0] and "Make the first Logger (or Instrumentation) on the main thread" in said[0]
