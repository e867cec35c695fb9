"""RunHistoryBackend across runs: a reused instance starts each new run empty; a resumed run drops what it writes
again, as JSONL does; to_dataframe keeps ids and integer values exact."""

import json
import os

import numpy as np
import pytest

import instrument
from instrument import Logger, RunHistoryBackend


def _run(history, root, name, steps, resume=False, state=None, checkpoint_at=None, offset=0.0):
    """A real session that logs ``loss``, a timer, a batch of ids and their per-item values at each step."""
    jsonl = instrument.JsonlBackend()
    inst = instrument.Instrumentation(backends=[history, jsonl], log_interval=1, log_dir=str(root), run_name=name,
                                      resume=resume, overhead_budget=None)
    if state is not None:
        inst.load_state_dict(state)
    saved = None
    for step in steps:
        with inst.step(step):
            with inst.logger.timer("fwd"):
                pass
            inst.logger.log_metrics({"loss": offset + step, f"only/{step}": 1.0}, step=step)
            inst.logger.log_histogram("ids", np.array([step, 1000 + step]), step)
            inst.logger.log_histogram("reward", np.array([offset + 0.5, offset + 1.5]), step)
            if step == checkpoint_at:
                saved = inst.state_dict()
    inst.close()
    return saved, jsonl


def test_a_history_still_open_for_one_session_is_refused_to_another(tmp_path):
    """Given to a second session while the first was open, the history was emptied under the first: its step 0 was
    lost, its later steps landed in the second run's series, and its close dropped the second run's samples."""
    history = RunHistoryBackend(batch_keys=["reward"])
    train = instrument.Instrumentation(backends=[history], log_dir=str(tmp_path), run_name="train",
                                       overhead_budget=None)
    train.logger.log_metrics({"train/loss": 1.0}, step=0, commit=True)
    with pytest.raises(instrument.ConfigurationError, match=r"is already open for another session in this process: "
                                                            r"one backend object writes one run at a time.*a "
                                                            r"RunHistoryBackend made anew for it"):
        instrument.Instrumentation(backends=[history], log_dir=str(tmp_path), run_name="eval", overhead_budget=None)
    train.logger.log_metrics({"train/loss": 0.5}, step=1, commit=True)
    train.close()
    assert list(history.metrics["train/loss"]) == [(0, 1.0), (1, 0.5)]
    evaluation = instrument.Instrumentation(backends=[history], log_dir=str(tmp_path), run_name="eval",
                                            overhead_budget=None)  # once closed, it may hold the next run
    evaluation.logger.log_metrics({"eval/return": 5.0}, step=0, commit=True)
    evaluation.close()
    assert {key: list(values) for key, values in history.metrics.items()} == {"eval/return": [(0, 5.0)]}


def test_a_history_given_to_a_second_run_holds_only_that_run(tmp_path):
    """Reused for a second run, the history appended its steps to the first run's series (steps 0,1,2,0,1,2)."""
    history = RunHistoryBackend(sample_key="ids", batch_keys=["reward"])
    _run(history, tmp_path, "first", range(3))
    first = history.metrics  # taken before the instance is reused: it keeps the first run
    _run(history, tmp_path, "second", range(2), offset=100.0)
    assert history.run.name == "second"
    steps, values = history.series("loss")
    assert steps.tolist() == [0, 1] and values.tolist() == [100.0, 101.0]
    assert history.keys() == ["loss", "only/0", "only/1", "timing/fwd/count", "timing/fwd/max", "timing/fwd/mean",
                              "timing/fwd/min"]
    assert [s for s, _, _ in history.timelog["fwd"]] == [0, 1]
    assert [(s, v.tolist()) for s, v in history.batch_log["reward"]] == [(0, [100.5, 101.5]), (1, [100.5, 101.5])]
    assert history.unique_samples == {0, 1, 1000, 1001}
    assert history.to_dataframe()["step"].tolist() == [0, 0, 1, 1]
    assert [s for s, _ in first["loss"]] == [0, 1, 2]


def test_a_run_resumed_in_the_same_process_drops_the_steps_it_writes_again(tmp_path):
    """The history kept the interrupted run's steps after the checkpoint and appended the resumed ones after them
    (steps 0..5, then 3..7), where JSONL cut them: every query now reads as the JSONL file does."""
    history = RunHistoryBackend(sample_key="ids", batch_keys=["reward"])
    state, _ = _run(history, tmp_path, "r", range(6), checkpoint_at=2)  # "crashes" after step 5
    _, jsonl = _run(history, tmp_path, "r", range(3, 8), resume=True, state=state, offset=100.0)
    lines = [json.loads(line) for line in open(jsonl.path) if '"step"' in line]
    assert [line["step"] for line in lines] == list(range(8))
    steps, values = history.series("loss")
    assert steps.tolist() == list(range(8))
    assert values.tolist() == [line["metrics"]["loss"] for line in lines] == [0, 1, 2, 103, 104, 105, 106, 107]
    assert [s for s, _, _ in history.timelog["fwd"]] == list(range(8))
    assert [s for s, _ in history.batch_log["reward"]] == [s for s, _ in history.batch_samples] == list(range(8))
    assert [s for s, _ in history.metrics["only/4"]] == [4]  # written once, by the resumed run
    frame = history.to_dataframe()
    assert frame["step"].tolist() == [s for s in range(8) for _ in range(2)]
    assert frame["reward"].tolist()[4:8] == [0.5, 1.5, 100.5, 101.5]


def test_a_resume_drops_the_samples_first_seen_after_the_checkpoint_and_keys_left_empty(tmp_path):
    """A bare Logger resumes with resume_after alone (its run info says nothing of a resume): the history it
    opened before goes on, cut at the checkpoint; samples only the cut steps held leave unique_samples."""
    history = RunHistoryBackend(sample_key="ids", batch_keys=["reward"])
    run = instrument.RunInfo("bare", tmp_path)
    logger = Logger([history], run)
    for step in range(4):
        logger.log_metrics({"loss": float(step), **({"late": 1.0} if step == 3 else {})}, step=step)
        logger.log_histogram("ids", np.array([7, 10 + step]), step)
        logger.log_histogram("reward", np.array([1.0, 2.0]), step)
        logger.commit(step)
    logger.close()
    assert history.unique_samples == {7, 10, 11, 12, 13}
    logger = Logger([history], instrument.RunInfo("bare", os.path.relpath(tmp_path)))  # the same folder
    logger.resume_after(1)
    logger.log_metrics({"loss": 20.0}, step=2)
    logger.log_histogram("ids", np.array([7, 12]), 2)
    logger.log_histogram("reward", np.array([3.0, 4.0]), 2)
    logger.commit(2)
    logger.close()
    assert history.series("loss")[0].tolist() == [0, 1, 2] and history.last("loss") == 20.0
    assert "late" not in history.keys()  # logged only after the checkpoint: no empty series left behind
    assert history.unique_samples == {7, 10, 11, 12}
    assert [s for s, _ in history.batch_log["reward"]] == [0, 1, 2]


def test_a_new_run_under_the_same_name_with_a_bare_logger_starts_empty(tmp_path):
    """Two bare Loggers with the default run info are two runs unless the second resumes."""
    history = RunHistoryBackend()
    for value in (1.0, 2.0):
        logger = Logger([history])
        logger.log_metrics({"loss": value}, step=0)
        logger.close()
        assert history.series("loss")[1].tolist() == [value]


def test_to_dataframe_keeps_ids_and_integer_values_exact(tmp_path):
    """Ids beyond 2**53 became one float64 id once any batch held a non-integral id, and integer per-item values
    were rounded through float()."""
    pytest.importorskip("pandas")
    big = 2**53
    history = RunHistoryBackend(sample_key="ids", batch_keys=["count", "score"])
    inst = instrument.Instrumentation(backends=[history], log_interval=1, log_dir=str(tmp_path), run_name="ids",
                                      overhead_budget=None)
    with inst.step(0):
        inst.logger.log_histogram("ids", np.array([big, big + 1], dtype=np.int64), 0)
        inst.logger.log_histogram("count", np.array([big + 1, 2**62 + 1], dtype=np.int64), 0)
        inst.logger.log_histogram("score", np.array([3, 4], dtype=np.int64), 0)
    with inst.step(1):
        inst.logger.log_histogram("ids", np.array([0.5]), 1)
        inst.logger.log_histogram("count", np.array([1]), 1)
        inst.logger.log_histogram("score", np.array([0.25]), 1)
    inst.close()
    frame = history.to_dataframe()
    assert frame["sample"].tolist() == [big, big + 1, 0.5] and frame["sample"].dtype == object
    assert frame["step"].dtype == np.int64
    assert frame["count"].tolist() == [big + 1, 2**62 + 1, 1] and frame["count"].dtype == np.int64
    assert frame["score"].tolist() == [3.0, 4.0, 0.25] and frame["score"].dtype == np.float64  # all exact
    assert frame[frame.step == 0]["sample"].nunique() == 2

    history = RunHistoryBackend(sample_key="ids", batch_keys=["count"])
    logger = Logger([history])
    logger.log_histogram("ids", np.array([1, 2]), 0)
    logger.log_histogram("count", np.array([big + 1, -3], dtype=np.int64), 0)
    logger.commit(0)
    logger.log_histogram("ids", np.array([3]), 1)  # no count at this step: NaN
    logger.commit(1)
    history.add_samples(2, [2**64 + 5])  # an id past uint64, named with add_samples
    logger.log_histogram("count", np.array([2**63 + 1], dtype=np.uint64), 2)
    logger.commit(2)
    logger.close()
    frame = history.to_dataframe()
    assert frame["sample"].tolist() == [1, 2, 3, 2**64 + 5] and frame["sample"].dtype == object
    assert frame["count"].dtype == object  # a NaN beside ints that float64 would round
    assert frame["count"].tolist()[:2] == [big + 1, -3] and np.isnan(frame["count"][2])
    assert frame["count"][3] == 2**63 + 1


def test_the_run_history_docs_name_its_containers_as_they_are(tmp_path):
    """docs/rl.md showed ``history.metrics[key]`` as a list ``[(step, value), ...]``: it is a deque, which cannot
    be sliced. Each documented ``history.<container>[...]  # <form>`` line is checked against a real run."""
    import re
    from pathlib import Path

    history = RunHistoryBackend(sample_key="ids", batch_keys=["reward"])
    _run(history, tmp_path, "docs", range(2))
    text = (Path(__file__).resolve().parents[1] / "docs" / "rl.md").read_text()
    section = text[text.index("## Run history"):]
    lines = re.findall(r"^history\.(metrics|timelog|batch_log)\[[^\]]*\]\s+# (\w*)\(?\[", section, re.M)
    assert {name for name, _ in lines} == {"metrics", "timelog", "batch_log"}, lines
    for name, form in lines:
        form = form or "list"  # a bare [...]
        container = next(iter(getattr(history, name).values()))
        assert form == type(container).__name__, f"docs/rl.md shows history.{name}[...] as {form!r}"
