"""A console column or key that matches no metric is said, with the keys it was likely meant to be (a review found
a misspelt key printing a legend and then no row for the whole run, unsaid, and a shipped config's evaluation
column that could never show because the table's columns are fixed at the first step)."""

import io
import logging

import instrument


def _run(console, steps=3, later=None):
    logger = instrument.Logger([console], instrument.RunInfo("c"))
    for step in range(steps):
        logger.log_metrics({"loss": 1.0 / (step + 1), "acc": 0.5}, step=step, prefix="train")
        if later is not None and step == steps - 1:
            logger.log_metrics({later: 2.0}, step=step)
        with logger.timer("iteration"):
            pass
        logger.commit(step)
    logger.close()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "console table" in r.getMessage()]


def test_a_declared_column_that_never_shows_is_said_at_close_with_the_near_keys(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="instrument"):
        _run(instrument.ConsoleBackend(columns=[{"key": "train/lossx"}, {"key": "train/acc"}], stream=stream))
    (said,) = _warnings(caplog)
    assert "'train/lossx' (did you mean 'train/loss'?)" in said and "ConsoleBackend.columns" in said
    assert "train/acc" not in said.split("matched")[0]  # the column that showed is not named


def test_a_key_that_matches_nothing_at_the_first_step_is_said_then(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="instrument"):
        _run(instrument.ConsoleBackend(keys=["train/lossx", "train/", "eval/", "timing/iteration/mean"],
                                       stream=stream, legend=False), later="eval/return")
    (said,) = _warnings(caplog)
    assert "'train/lossx' (did you mean 'train/loss'?)" in said
    assert "'eval/'" in said and "declare ConsoleBackend.columns" in said  # logged only after the first step
    assert "'timing/iteration/mean'" in said and "summary=('timing/',)" in said  # kept for the summary
    assert stream.getvalue().splitlines()[1].split() == ["step", "loss", "acc"]


def test_nothing_is_said_when_every_column_shows(caplog):
    with caplog.at_level(logging.WARNING, logger="instrument"):
        _run(instrument.ConsoleBackend(columns=[{"key": "train/loss"}], keys=None, stream=io.StringIO()))
        _run(instrument.ConsoleBackend(keys=["train/"], stream=io.StringIO()))
    assert _warnings(caplog) == []
