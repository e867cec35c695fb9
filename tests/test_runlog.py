"""Run logs: terse terminal lines, a verbose timestamped file per run, the user's logging left alone."""

import contextlib
import functools
import io
import logging
import os
import re

import pytest
from tqdm import tqdm

import instrument
from instrument import Backend, Column, ConsoleBackend, setup_run_logging
from instrument.errors import ConfigurationError

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"


def _state(name: str):
    logger = logging.getLogger(name)
    return list(logger.handlers), logger.level, logger.propagate


def test_terminal_is_terse_and_the_file_keeps_everything(tmp_path):
    term = io.StringIO()
    with setup_run_logging(tmp_path / "runs" / "r1", "r1", stream=term) as run_log:
        log = logging.getLogger("instrument")
        log.debug("detail %d", 1)
        log.info("hello")
        log.warning("careful")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("it failed")
    assert run_log.path.parent == tmp_path / "runs" / "r1"
    assert re.fullmatch(r"\d{8}-\d{6}-r1\.log", run_log.path.name)
    assert term.getvalue().splitlines() == [
        "I hello",
        "W careful",
        "E it failed [ValueError: boom; traceback in the run log]",
    ]
    text = run_log.path.read_text(encoding="utf-8")
    assert re.search(rf"^{STAMP} DEBUG    instrument: detail 1$", text, re.M)
    assert re.search(rf"^{STAMP} WARNING  instrument: careful$", text, re.M)
    assert re.search(rf"^{STAMP} DEBUG    instrument: run log .*r1\.log started", text, re.M)  # name once
    assert "Traceback (most recent call last)" in text and "ValueError: boom" in text


def test_the_users_logging_configuration_is_left_alone(tmp_path):
    root = logging.getLogger()
    user_out = io.StringIO()
    user_handler = logging.StreamHandler(user_out)
    root.addHandler(user_handler)
    try:
        root_before, inst_before = _state(""), _state("instrument")
        run_log = setup_run_logging(tmp_path, "mine", stream=io.StringIO())
        assert _state("") == root_before  # no basicConfig, no handler added to or removed from root
        logging.getLogger("instrument").warning("printed once, by the run log")
        logging.getLogger("myapp").warning("the user's own message")
        run_log.close()
        run_log.close()  # idempotent
        assert _state("instrument") == inst_before and _state("") == root_before
        logging.getLogger("instrument").warning("after close, propagation is back")
    finally:
        root.removeHandler(user_handler)
    assert user_out.getvalue().splitlines() == ["the user's own message", "after close, propagation is back"]


def test_chosen_user_loggers_go_to_both_places_and_are_restored(tmp_path):
    term = io.StringIO()
    before = _state("myapp.train")
    run_log = setup_run_logging(tmp_path, "mine", loggers=["myapp.train"], stream=term)
    logging.getLogger("myapp.train").info("epoch 1 done")
    run_log.close()
    assert term.getvalue() == "I epoch 1 done\n"
    assert "INFO     myapp.train: epoch 1 done" in run_log.path.read_text(encoding="utf-8")
    assert _state("myapp.train") == before
    with pytest.raises(ConfigurationError, match=r"'instrument.console' is covered already"):
        setup_run_logging(tmp_path, "mine", loggers=["instrument.console"])


def test_a_second_run_log_takes_the_messages_until_it_is_closed_then_the_first_takes_them_again(tmp_path):
    """Setting up a second run log (a second session with run_log=True) closed the first: that session's log
    stopped without a word, and after the second was closed its messages reached no file at all."""
    log = logging.getLogger("instrument")
    before = len(log.handlers), log.level, log.propagate
    first = setup_run_logging(tmp_path / "a", "a", stream=io.StringIO())
    count = len(log.handlers)
    log.warning("instrument: <one>")
    second = setup_run_logging(tmp_path / "b", "b", stream=io.StringIO())
    assert not first.closed and not second.closed
    assert len(log.handlers) == count  # never piled up
    log.warning("instrument: <two>")
    second.close()
    assert len(log.handlers) == count and not log.propagate
    log.warning("instrument: <three>")
    first.close()
    assert (len(log.handlers), log.level, log.propagate) == before
    log.warning("instrument: after both")  # reaches neither file
    a, b = (r.path.read_text(encoding="utf-8") for r in (first, second))
    assert "<one>" in a and "<three>" in a and "<two>" not in a and "after both" not in a
    assert "<two>" in b and "<one>" not in b and "<three>" not in b
    assert f"run log {second.path} was started while this one is open" in a  # each file says when and where
    assert f"run log {second.path} was closed; this run log takes instrument's messages again" in a
    assert f"while the run log {first.path} stays open" in b


def test_a_refused_second_run_log_leaves_the_first_taking_the_messages(tmp_path):
    """A second run log refused for its ``loggers`` had already taken the first's handlers off (and left its own
    attached): the first run log got nothing more, its file saying it would take the messages again."""
    log = logging.getLogger("instrument")
    first = setup_run_logging(tmp_path / "a", "a", stream=io.StringIO())
    handlers = list(log.handlers)
    with pytest.raises(ConfigurationError, match="covered already"):
        setup_run_logging(tmp_path / "b", "b", stream=io.StringIO(), loggers=["instrument.rl"])
    assert log.handlers == handlers and not (tmp_path / "b").exists()
    log.warning("instrument: <after the refusal>")
    first.close()
    assert "<after the refusal>" in first.path.read_text(encoding="utf-8")


def test_loggers_given_as_an_iterator_are_all_attached(tmp_path):
    run_log = setup_run_logging(tmp_path, "it", stream=io.StringIO(), loggers=(n for n in ["myapp.gen"]))
    logging.getLogger("myapp.gen").warning("from a generator's logger")
    run_log.close()
    assert "from a generator's logger" in run_log.path.read_text(encoding="utf-8")


def test_closing_the_earlier_run_log_first_leaves_the_later_one_taking_the_messages(tmp_path):
    log = logging.getLogger("instrument")
    before = len(log.handlers), log.level, log.propagate
    first = setup_run_logging(tmp_path / "a", "a", stream=io.StringIO())
    second = setup_run_logging(tmp_path / "b", "b", stream=io.StringIO())
    first.close()
    log.warning("instrument: still the second's")
    second.close()
    assert (len(log.handlers), log.level, log.propagate) == before
    assert "still the second's" in second.path.read_text(encoding="utf-8")
    assert "still the second's" not in first.path.read_text(encoding="utf-8")


def test_bad_arguments_say_what_was_expected(tmp_path):
    with pytest.raises(ConfigurationError, match=r"level must be a logging level such as 'INFO'.*got 'LOUD'"):
        setup_run_logging(tmp_path, "x", level="LOUD")
    with pytest.raises(ConfigurationError, match=r"needs a non-empty run_name string, got ''"):
        setup_run_logging(tmp_path, "")


def test_terminal_lines_do_not_break_a_tqdm_bar(tmp_path):
    out = io.StringIO()
    with setup_run_logging(tmp_path, "bar", stream=out):
        with tqdm(total=3, file=out, mininterval=0, ascii=True) as bar:
            for i in range(3):
                bar.update(1)
                logging.getLogger("instrument").warning("slow step %d", i)
    segments = set(re.split(r"[\r\n]", out.getvalue()))
    assert {"W slow step 0", "W slow step 1", "W slow step 2"} <= segments


class Broken(Backend):
    def write(self, record):
        raise RuntimeError("boom")


def test_session_run_log_has_table_rows_and_every_scalar(tmp_path):
    table, term = io.StringIO(), io.StringIO()
    inst_before = _state("instrument")
    inst = instrument.Instrumentation(
        backends=[
            ConsoleBackend(columns=[Column("train/loss", "loss↓", 9, ".4f", "training loss")], stream=table),
            Broken(),
        ],
        log_interval=1,
        log_dir=str(tmp_path),
        run_name="demo",
        run_log=functools.partial(setup_run_logging, stream=term),
    )
    for step in range(2):
        with inst.step(step):
            inst.logger.log_metrics({"loss": 0.5 / (step + 1), "lr": 1e-3}, step=step, prefix="train")
    inst.close()
    logs = list((tmp_path / "demo").glob("*-demo.log"))
    assert logs == [inst.run_log.path]
    text = logs[0].read_text(encoding="utf-8")
    # Every table line is in the file, after a timestamp, in the same order as on the terminal.
    file_rows = re.findall(rf"^{STAMP} INFO     instrument\.console: (.*)$", text, re.M)
    assert file_rows == table.getvalue().splitlines()
    assert "      1     0.2500" in file_rows
    # What the table leaves out (train/lr, and step 0's instrument/overhead/... measurement) is kept at DEBUG.
    assert re.search(
        rf"^{STAMP} DEBUG    instrument\.console: step 1 scalars: train/loss=0.25, train/lr=0.001"
        rf"(, instrument/overhead/\w+=[0-9.e-]+)*$",
        text,
        re.M,
    )
    assert term.getvalue().splitlines()[0] == (
        "E instrument: backend 'Broken' failed in write(); it gets the next record again; training and the "
        "other backends go on [RuntimeError: boom; traceback in the run log]"
    )
    assert "RuntimeError: boom" in text and "Traceback" in text
    assert _state("instrument") == inst_before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_run_log_on_a_full_disk_is_said_once_and_never_ends_the_run(tmp_path, capsys):
    """The run log's file is moved to /dev/full mid-run (every write fails with ENOSPC): one line says so, no
    traceback per record, the console table and the steps go on, and close() returns (its final flush of
    the file fails too) and restores the logging configuration."""
    table, term = io.StringIO(), io.StringIO()
    before = _state("instrument")
    inst = instrument.Instrumentation(
        backends=[ConsoleBackend(stream=table)], log_interval=1, log_dir=str(tmp_path), run_name="full",
        run_log=functools.partial(setup_run_logging, stream=term),
    )
    inst.run_log.file.stream = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 - closed by the run log
    for step in range(20):
        with inst.step(step):
            inst.logger.log_metrics({"loss": float(step)}, step=step)
    inst.close()
    said = capsys.readouterr().err
    assert said.count("cannot be written") == 1 and "No space left on device" in said
    assert "--- Logging error ---" not in said
    assert len(table.getvalue().splitlines()) > 20  # every row reached the console (plus its header)
    assert inst.failures == {} and _state("instrument") == before


@pytest.mark.parametrize("closed_before_start", [False, True])
def test_console_rows_reach_the_run_log_after_the_terminal_pipe_closes(tmp_path, closed_before_start):
    """`python train.py | head -1`: the reader of the console's pipe goes away, during the run or before it
    began (the legend at open then fails: that no longer stops the start). The failure is reported once, nothing
    more is written to the pipe, and every row is still in the run log."""
    read_end, write_end = os.pipe()
    pipe = os.fdopen(write_end, "w", buffering=1)
    if closed_before_start:
        os.close(read_end)
    inst = instrument.Instrumentation(
        backends=[ConsoleBackend(columns=[Column("loss", "loss", 9, ".4f", "loss")], stream=pipe)],
        log_interval=1, log_dir=str(tmp_path), run_name="piped",
        run_log=functools.partial(setup_run_logging, stream=io.StringIO()),
    )
    inst.flush()  # the legend went through, or failed
    if not closed_before_start:
        os.close(read_end)  # the reader is gone: writes raise BrokenPipeError (Python ignores SIGPIPE)
    for step in range(30):
        with inst.step(step):
            inst.logger.log_metrics({"loss": step / 4}, step=step)
    inst.close()
    text = inst.run_log.path.read_text(encoding="utf-8")
    rows = re.findall(rf"^{STAMP} INFO     instrument\.console: +(\d+) +([0-9.]+)$", text, re.M)
    assert [(int(s), float(v)) for s, v in rows] == [(s, s / 4) for s in range(30)]
    assert inst.failures == {"ConsoleBackend": 1}
    with contextlib.suppress(OSError):
        pipe.close()


def test_the_run_log_of_a_default_named_run_has_the_time_once_and_an_unwritable_folder_is_a_clear_error(tmp_path):
    """A review found `20261126-000553-20261126-000553-dc975b.log` (the guard predated the random suffix), and a
    raw NotADirectoryError from a log_dir that is a file."""
    inst = instrument.Instrumentation(backends=[], log_dir=str(tmp_path / "runs"), run_log=True)
    try:
        assert inst.run_log.path.name == f"{inst.run.name}.log"
    finally:
        inst.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(instrument.ConfigurationError, match=r"the run log cannot be written in .*run_log=False"):
        instrument.Instrumentation(backends=[], log_dir=str(tmp_path / "file"), run_log=True, run_name="r")
    with pytest.raises(instrument.ConfigurationError, match=r"run_name is 300 characters long"):
        instrument.Instrumentation(backends=[], log_dir=str(tmp_path / "runs"), run_name="a" * 300)
    inst = instrument.Instrumentation(backends=[], log_dir=str(tmp_path / "runs"), run_name="b" * 250, run_log=True)
    inst.close()  # a name a folder holds, and its run log's file name too (the stem is cut)
    assert len(inst.run_log.path.name) <= 255 and inst.run_log.path.parent.name == "b" * 250
