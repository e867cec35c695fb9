"""Metric keys a destination cannot take as they are, written back and read with each destination's reader."""

import json
import logging
import os

import numpy as np
import pytest

import instrument
from tests.conftest import event_accumulator, read_scalars
from tests.wandb_reader import read_run

NAME = os.fsdecode(b"caf\xe9.txt")  # 'caf\udce9.txt': a lone surrogate, as os.fsdecode leaves a non-UTF-8 name


def _jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_metric_key_with_a_lone_surrogate_costs_no_step(tmp_path, caplog):
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.TensorBoardBackend(), instrument.JsonlBackend(),
                                instrument.WandbBackend(project="tests")], instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"loss": 0.5 * step, f"files/{NAME}": float(step)}, step=step)
        logger.log_histogram(f"sizes/{NAME}", np.array([1.0, 2.0]), step=step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}
    escaped = "files/caf\\udce9.txt"
    tb = read_scalars(tmp_path / "r")
    assert tb["loss"] == {1: 0.5, 2: 1.0} and tb[escaped] == {1: 1.0, 2: 2.0}
    assert [e.step for e in event_accumulator(tmp_path / "r").Histograms("sizes/caf\\udce9.txt")] == [1, 2]
    rows, _ = read_run(tmp_path / "r")
    assert [(row["_step"], row["loss"], row[escaped]) for row in rows] == [(1, 0.5, 1.0), (2, 1.0, 2.0)]
    assert all(row["sizes/caf\\udce9.txt"]["_type"] == "histogram" for row in rows)
    lines = _jsonl(tmp_path / "r")  # JSON escapes the surrogate itself: the key reads back exactly
    assert [(line["step"], line["metrics"]["loss"], line["metrics"][f"files/{NAME}"]) for line in lines] == [
        (1, 0.5, 1.0), (2, 1.0, 2.0)]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "UTF-8 cannot" in r.getMessage()]
    assert len(said) == 4  # once per backend and key: TensorBoard and W&B, the scalar and the histogram
    assert any("TensorBoardBackend wrote the scalar 'files/caf\\udce9.txt' as 'files/caf\\\\udce9.txt'" in m
               for m in said)


def test_a_metric_under_a_timers_key_is_kept_apart_from_the_timer(tmp_path, caplog):
    """A review found ``log_metrics({"timing/fwd/mean": ...})`` beside ``logger.timer("fwd")`` silently
    replaced by the timer's statistic in every scalar-only backend."""
    logger = instrument.Logger([instrument.TensorBoardBackend(), instrument.JsonlBackend()],
                               instrument.RunInfo("t", tmp_path))
    for step in (1, 2, 3):
        if step != 2:  # a timer that runs on some steps only: the user's series stays whole (a review found
            with logger.timer("fwd"):  # it renamed on the colliding steps only, the timer's mixed into it)
                pass
        logger.log_metrics({"timing/fwd/mean": 123.0, "timing/fwd/count": 7.0, "timing/data": 0.5}, step=step)
        logger.commit(step)
    logger.close()
    for line in _jsonl(tmp_path / "t"):
        metrics = line["metrics"]
        assert metrics["user/timing/fwd/mean"] == 123.0 and metrics["user/timing/fwd/count"] == 7.0
        if line["step"] != 2:
            assert metrics["timing/fwd/count"] == 1.0 and metrics["timing/fwd/mean"] < 1.0  # the timer's own
        else:
            assert "timing/fwd/mean" not in metrics
        assert metrics["timing/data"] == 0.5  # no timer's key: as logged
    tb = read_scalars(tmp_path / "t")
    assert tb["user/timing/fwd/mean"] == {1: 123.0, 2: 123.0, 3: 123.0}
    assert tb["timing/fwd/count"] == {1: 1.0, 3: 1.0}
    said = [r.getMessage() for r in caplog.records if "timing/<name>/<stat>" in r.getMessage()]
    assert len(said) == 2 and "'timing/fwd/mean'" in said[0] and "'user/timing/fwd/mean'" in said[0]


def test_a_metric_under_timing_is_reduced_as_a_metric_under_a_process_group(tmp_path):
    """Under a process group the timers' statistics were reduced under ``timing/...`` names and every key
    starting with ``timing/`` was then taken for one: a user's ``timing/data`` was written as
    ``timing//data``, and a ``timing/fwd/mean`` beside the timer was reduced with it into one value."""
    pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
    from tests.conftest import THREADED_RANKS

    source = THREADED_RANKS + """
import instrument

def worker(rank):
    logger = instrument.Logger([])
    with logger.timer("fwd"):
        pass
    logger.log_metrics({"timing/data": float(rank + 1), "timing/fwd/mean": 100.0 + rank}, step=0)
    handle = logger.commit(0)
    out[rank] = None if handle is None else handle.flat_scalars()
    logger.close()

run_ranks(worker)
print(json.dumps(out))
"""
    from tests.conftest import run_child

    done = run_child(tmp_path, source)
    assert done.returncode == 0, done.stderr[-2000:]
    scalars = json.loads(done.stdout.strip().splitlines()[-1])["0"]
    assert scalars["timing/data"] == 1.5 and "timing//data" not in scalars  # the mean over ranks, as logged
    assert scalars["user/timing/fwd/mean"] == 100.5 and scalars["timing/fwd/mean"] < 1.0
    assert scalars["timing/fwd/count"] == 1.0


def test_tensorboard_keeps_one_kind_of_value_per_tag(tmp_path, caplog):
    """A scalar and a histogram (or an image) under one tag: TensorBoard listed no histogram, and reading the
    run's scalars raised ("can only convert an array of size 1"), losing every other scalar too. The kind a
    tag first takes now keeps it; the other goes under <key>/<kind> (W&B does the same)."""
    import torch

    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("k", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"reward": float(step), "loss": 0.5}, step=step)
        logger.log_histogram("reward", torch.arange(5.0), step=step)
        logger.log_image("picture", torch.zeros(4, 4), step=step)
        logger.commit(step)
    logger.log_metrics({"picture": 3.0}, step=3)  # a scalar under a tag an image holds
    logger.commit(3)
    logger.close()
    tb = read_scalars(tmp_path / "k")
    assert tb["reward"] == {1: 1.0, 2: 2.0} and tb["loss"] == {1: 0.5, 2: 0.5} and tb["picture/scalar"] == {3: 3.0}
    acc = event_accumulator(tmp_path / "k")
    assert [e.step for e in acc.Histograms("reward/histogram")] == [1, 2]
    assert np.isclose(acc.Histograms("reward/histogram")[0].histogram_value.sum, 10.0)
    assert [e.step for e in acc.Images("picture")] == [1, 2]
    said = [r.getMessage() for r in caplog.records if "TensorBoard shows one kind per tag" in r.getMessage()]
    assert len(said) == 2


def _tb_session(tmp_path, resume, state, steps):
    """One process's part of run ``k``: ``steps`` of (step, scalars, histograms, images); returns its state."""
    import torch

    inst = instrument.Instrumentation(backends=[instrument.TensorBoardBackend()], run_name="k",
                                      log_dir=str(tmp_path), resume=resume, log_interval=1)
    if resume:
        inst.load_state_dict(state)
    for step, scalars, histograms, images in steps:
        with inst.step(step):
            inst.log(scalars)
            for key in histograms:
                inst.logger.log_histogram(key, torch.arange(5.0), step=step)
            for key in images:
                inst.logger.log_image(key, torch.zeros(4, 4), step=step)
    saved = inst.state_dict()
    inst.close()
    return saved


def test_tensorboard_keeps_each_tags_kind_across_a_resume(tmp_path, caplog):
    """The kind each tag held lived in memory: a resumed run's first histogram of ``reward`` took the scalar's tag
    (its scalars unreadable) and the scalar ``picture``, moved to ``picture/scalar`` beside the images, went back
    under ``picture`` (its series split). They are now kept with the run (`TAGS_FILE`) and read back."""
    from instrument.backends.tb_tags import TAGS_FILE

    state = _tb_session(tmp_path, False, None, [(0, {"reward": 0.0}, [], ["picture"]),
                                                (1, {"reward": 1.0, "picture": 1.0}, [], ["picture"])])
    assert (tmp_path / "k" / TAGS_FILE).is_file()
    _tb_session(tmp_path, True, state, [(2, {"picture": 2.0}, ["reward"], []), (3, {"reward": 3.0}, [], ["picture"])])
    tb = read_scalars(tmp_path / "k")
    assert tb["reward"] == {0: 0.0, 1: 1.0, 3: 3.0} and tb["picture/scalar"] == {1: 1.0, 2: 2.0}
    assert "picture" not in tb
    acc = event_accumulator(tmp_path / "k")
    assert [e.step for e in acc.Histograms("reward/histogram")] == [2]
    assert [e.step for e in acc.Images("picture")] == [0, 1, 3]


_FIELDS = '"media": {}, "renamed": {}, "moved": [], "moved_scalars": []'


@pytest.mark.parametrize("damage, error", [
    ('{"scalars": [1], ' + _FIELDS + "}", "TypeError"),
    ('{"scalars": "reward", ' + _FIELDS + "}", "TypeError"),  # a review found it taken as its characters
    ('{"scalars": [], "media": ["ab"], "renamed": {}, "moved": [], "moved_scalars": []}', "TypeError"),
    ('{"scalars": [], "media": {}, "renamed": {"image": ["ab"]}, "moved": [], "moved_scalars": []}', "TypeError"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),  # the resumed run failed to start
    ('{"scalars": ["h\\ud800"], ' + _FIELDS + "}", "UnicodeEncodeError"),  # a tag `state` never writes
])
def test_a_damaged_tags_file_is_ignored_with_one_warning_and_written_again(tmp_path, caplog, damage, error):
    from instrument.backends.tb_tags import TAGS_FILE

    state = _tb_session(tmp_path, False, None, [(0, {"reward": 0.0}, [], [])])
    path = tmp_path / "k" / TAGS_FILE
    path.write_text(damage)
    _tb_session(tmp_path, True, state, [(1, {"loss": 1.0}, ["reward"], [])])
    said = [r.getMessage() for r in caplog.records if "could not read back which kind" in r.getMessage()]
    assert len(said) == 1 and error in said[0]
    assert "loss" in json.loads(path.read_text())["scalars"]  # what this process decided is saved whole again
    assert "reward" in json.loads(path.read_text())["media"]  # the resumed run's histogram took the tag afresh


def test_a_tags_file_that_cannot_be_read_or_written_costs_no_step_and_is_named(tmp_path, caplog):
    """A folder where the tags file should be: the run resumes and writes every step; the warning names the file
    and the real cause (it said a JSON error), and no ``.part`` file is left behind."""
    from instrument.backends.tb_tags import TAGS_FILE

    state = _tb_session(tmp_path, False, None, [(0, {"reward": 0.0}, [], [])])
    path = tmp_path / "k" / TAGS_FILE
    path.unlink()
    path.mkdir()
    _tb_session(tmp_path, True, state, [(1, {"reward": 1.0, "loss": 1.0}, [], [])])
    said = [r.getMessage() for r in caplog.records if TAGS_FILE in r.getMessage()]
    assert len(said) == 2 and "could not read" in said[0] and "IsADirectoryError" in said[0]
    assert "could not write" in said[1]
    assert read_scalars(tmp_path / "k")["reward"] == {0: 0.0, 1: 1.0}
    assert not list((tmp_path / "k").glob("*.part"))


def test_tag_kinds_come_back_whole_from_their_state():
    from instrument.backends.tb_tags import TagKinds

    kinds = TagKinds()
    kinds.scalars({"a": 1.0, "b": 2.0})
    assert kinds.media("image", "a", {}) == "a/image" and kinds.media("image", "c", {}) == "c"
    assert kinds.text("table", "val", {}) == "val" and kinds.text("text", "val", {}) == "val/text"
    assert kinds.scalars({"c": 3.0}) == {"c/scalar": 3.0}
    back = TagKinds()
    back.restore(kinds.state())
    assert back.state() == kinds.state()
    assert back.media("histogram", "b", {}) == "b/histogram" and back.scalars({"c": 1.0}) == {"c/scalar": 1.0}
    assert back.text("text", "val", {}) == "val/text" and back.media("image", "a", {}) == "a/image"


def test_keys_that_escape_alike_keep_their_names_across_a_resume(tmp_path):
    """``a\\udcff`` (a lone surrogate) is written escaped as the text ``a\\\\udcff``; a key that already is that text
    is numbered (``a\\\\udcff__2``). Those choices lived in memory: a run resumed in a new process numbered afresh,
    so the key seen first after the resume took the plain name, and the two keys swapped series in TensorBoard
    and W&B. They are now kept with the run and read back (JSONL writes both keys exactly)."""
    pytest.importorskip("wandb")
    from tests.wandb_reader import read_history

    surrogate, literal = os.fsdecode(b"a\xff"), "a\\udcff"

    def session(resume, steps):
        inst = instrument.Instrumentation(
            backends=[instrument.TensorBoardBackend(), instrument.JsonlBackend(),
                      instrument.WandbBackend(project="tests")],
            run_name="r", log_dir=str(tmp_path), resume=resume, log_interval=1)
        if resume:
            inst.load_state_dict(state)
        for step, key in steps:
            with inst.step(step):
                inst.log({key: float(step)})
        saved = inst.state_dict()
        inst.close()
        return saved

    state = session(False, [(0, surrogate), (1, literal)])  # the surrogate's key first: it takes the plain name
    state = session(True, [(2, literal), (3, surrogate)])  # the literal key first this time
    session(True, [(4, surrogate), (5, literal)])
    tb = read_scalars(tmp_path / "r")
    assert tb[literal] == {0: 0.0, 3: 3.0, 4: 4.0} and tb[literal + "__2"] == {1: 1.0, 2: 2.0, 5: 5.0}
    files = sorted((tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = [row for path in files for row in read_history(path, timeout=60.0)]
    assert len(files) == 3 and all(not key.startswith("_instrument") for row in rows for key in row)
    assert {key: [row["_step"] for row in rows if key in row] for key in (literal, literal + "__2")} == {
        literal: [0, 3, 4], literal + "__2": [1, 2, 5]}
    series = {}
    for line in _jsonl(tmp_path / "r"):
        for key in (surrogate, literal):
            if key in line["metrics"]:
                series.setdefault(key, []).append(line["step"])
    assert series == {surrogate: [0, 3, 4], literal: [1, 2, 5]}


def test_a_damaged_key_state_is_ignored_whole_with_one_warning_and_later_keys_are_saved(caplog):
    # A names list holding a non-str was taken: the next key with a backslash then raised TypeError at every
    # save (sorted() of mixed types), and a damaged later kind left the kinds before it half restored.
    from instrument.backends.drops import Drops

    drops = Drops("TensorBoardBackend")
    damaged = json.dumps({"scalar": {"renamed": {"a\\udcff": "a\\\\udcff"}, "names": ["x\\y"]},
                          "image": {"renamed": {}, "names": [1, "a\\b"]}})
    with caplog.at_level(logging.WARNING, logger="instrument"):
        drops.restore_keys(damaged)
    assert [r for r in caplog.records if "could not read back" in r.getMessage()]
    assert drops.renamed.get("scalar", {}) == {} and not drops.names.get("scalar")
    drops.mark("image", ["k\\1"])
    assert json.loads(drops.key_state())["image"]["names"] == ["k\\1"]
