"""RunHistoryBackend: metrics, timelog, per-item batch values, unique samples, DataFrame, plots, caps."""

import logging
import math
import sys
import threading
import time

import numpy as np
import pytest
import torch

import instrument
from instrument import ConfigurationError, Logger, RunHistoryBackend, StepRecord


def test_metrics_and_timelog_per_step():
    history = RunHistoryBackend()
    logger = Logger([history])
    for step in range(3):
        logger.log_metrics({"loss": torch.tensor(float(step) / 2)}, step=step, prefix="train")
        with logger.timer("rollout"):
            pass
        with logger.timer("rollout"):
            pass
        logger.commit(step)
    logger.flush()  # backends are written on the logger's writer thread
    steps, values = history.series("train/loss")
    assert steps.tolist() == [0, 1, 2] and values.tolist() == [0.0, 0.5, 1.0]
    assert history.last("train/loss") == 1.0
    assert [(s, c) for s, _, c in history.timelog["rollout"]] == [(0, 2), (1, 2), (2, 2)]
    assert all(m >= 0 for _, m, _ in history.timelog["rollout"])
    with pytest.raises(KeyError, match="no metric 'nope'.*known keys"):
        history.series("nope")


def test_batch_log_samples_and_dataframe():
    history = RunHistoryBackend(sample_key="batch/ids")
    history.add_log("batch/reward")
    logger = Logger([history])
    logger.log_histogram("batch/ids", torch.tensor([3, 7, 3]), step=0)
    logger.log_histogram("batch/reward", torch.tensor([1.0, 2.0, 3.0]), step=0)
    logger.commit(0)
    history.add_samples(1, ["seed-a", ("env", 2)])  # any hashable items, named before the commit
    logger.log_histogram("batch/reward", torch.tensor([5.0, 6.0]), step=1)
    logger.log_histogram("batch/other", torch.tensor([9.0]), step=1)  # not registered: not kept per item
    logger.commit(1)
    logger.flush()
    assert [(s, v.tolist()) for s, v in history.batch_log["batch/reward"]] == [
        (0, [1.0, 2.0, 3.0]),
        (1, [5.0, 6.0]),
    ]
    assert "batch/other" not in history.batch_log
    assert history.unique_samples == {3, 7, "seed-a", ("env", 2)}
    frame = history.to_dataframe()
    assert list(frame.columns) == ["sample", "step", "batch/reward"]
    assert frame.to_dict("records") == [
        {"sample": 3, "step": 0, "batch/reward": 1.0},
        {"sample": 7, "step": 0, "batch/reward": 2.0},
        {"sample": 3, "step": 0, "batch/reward": 3.0},
        {"sample": "seed-a", "step": 1, "batch/reward": 5.0},
        {"sample": ("env", 2), "step": 1, "batch/reward": 6.0},
    ]
    assert frame.groupby("sample", sort=False)["batch/reward"].mean()[3] == 2.0


def test_caps_bound_memory_and_are_said_once(caplog):
    history = RunHistoryBackend(max_steps=5, max_samples=4, sample_key="ids", batch_keys=["value"])
    logger = Logger([history])
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(50):
            logger.log_metrics({"a": step, "b": -step}, step=step)
            logger.log_histogram("ids", torch.arange(step, step + 3), step=step)
            logger.log_histogram("value", torch.ones(3), step=step)
            logger.commit(step)
        logger.flush()  # the caps are met (and said) on the writer thread
    assert [s for s, _ in history.metrics["a"]] == [45, 46, 47, 48, 49]
    assert len(history.batch_log["value"]) == 5 and len(history.batch_samples) == 5
    assert history.unique_samples == {0, 1, 2, 3}
    messages = [r.getMessage() for r in caplog.records]
    assert sum("max_steps=5" in m for m in messages) == 1
    assert sum("max_samples=4" in m for m in messages) == 1
    # the DataFrame holds only the kept samples of the kept steps
    assert history.to_dataframe().empty


def test_plots_return_figures():
    from matplotlib.figure import Figure

    history = RunHistoryBackend()
    logger = Logger([history])
    for step in range(4):
        logger.log_metrics({"x": step, "y": math.sin(step)}, step=step)
        with logger.timer("collect"):
            pass
        logger.commit(step)
    assert logger.flush(timeout=60)  # the writer thread hands records to the history; wait for it
    fig = history.plot_metrics(["x", "y"], title="run")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert np.allclose(fig.axes[1].lines[0].get_ydata(), [math.sin(s) for s in range(4)])
    timing = history.plot_timelog()
    assert [line.get_label() for line in timing.axes[0].lines] == ["collect"]
    with pytest.raises(ConfigurationError, match="at least one metric key"):
        history.plot_metrics([])


def test_bad_arguments():
    with pytest.raises(ConfigurationError, match="max_samples must be None or a positive int"):
        RunHistoryBackend(max_samples=0)
    with pytest.raises(TypeError, match="unhashable"):
        RunHistoryBackend().add_samples(0, [[1, 2]])


def test_it_is_a_gin_configurable_backend(tmp_path):
    import gin

    gin.parse_config(["backend_set.extra = [@RunHistoryBackend()]", "RunHistoryBackend.max_steps = 3"])
    from instrument.config import backend_set

    (history,) = backend_set()
    assert isinstance(history, instrument.RunHistoryBackend) and history.max_steps == 3


def test_review_findings_on_the_history_and_the_backends_around_it(tmp_path, caplog):
    """A step committed twice paired its first samples with the second record's values; int steps past int64
    broke series(); one backend instance listed twice wrote every record twice; a reused JsonlBackend wrote the
    second run into the first run's file; a console with a summary that leaves out timings never printed."""
    pytest.importorskip("pandas")
    history = RunHistoryBackend(batch_keys=["reward"], sample_key="ids")
    logger = Logger([history], instrument.RunInfo("h", tmp_path), on_step_regression="warn")
    for ids, rewards in (([1, 2], [10.0, 20.0]), ([3, 4], [30.0, 40.0])):
        logger.log_histogram("ids", torch.tensor(ids), step=20)
        logger.log_histogram("reward", torch.tensor(rewards), step=20)
        logger.commit(20)
    with pytest.raises(instrument.InvalidValueError, match="between 0 and 2"):
        logger.log_metrics({"x": 1.0}, step=2**64)  # TensorBoard, W&B and MLflow could not store it
    logger.log_metrics({"x": 1.0}, step=2**63 - 1)
    logger.close()
    frame = history.to_dataframe()
    assert dict(zip(frame["sample"], frame["reward"], strict=True)) == {1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}
    steps, values = history.series("x")
    assert steps.tolist() == [2**63 - 1] and values.tolist() == [1.0]

    with pytest.raises(ConfigurationError, match="lists one backend instance twice"):
        Logger([history, history])

    jsonl = instrument.JsonlBackend()
    for name in ("a", "b"):
        reused = Logger([jsonl], instrument.RunInfo(name, tmp_path))
        reused.log_metrics({"run": 1.0}, step=0)
        reused.close()
    assert (tmp_path / "a" / "metrics.jsonl").read_text().count('"step"') == 1
    assert (tmp_path / "b" / "metrics.jsonl").read_text().count('"step"') == 1

    import io

    stream = io.StringIO()
    console = instrument.ConsoleBackend(summary=(), stream=stream)
    shown = Logger([console], instrument.RunInfo("c", tmp_path))
    with shown.timer("fwd"):
        pass
    shown.log_metrics({"loss": 0.5}, step=0)
    shown.commit(0)
    shown.close()
    assert shown.failures == {} and "0.5" in stream.getvalue()


def test_the_history_can_be_queried_while_the_run_commits():
    """A review found `series`, `keys` and `last` raising "deque mutated during iteration" when asked while
    the writer thread appended (a notebook or a training loop reading ``history.last("loss")``), and
    `to_dataframe` likewise; `add_samples` from the training thread raced the writer's loop over them."""
    history = RunHistoryBackend(sample_key="ids", max_steps=500)
    history.add_log("reward")
    logger = Logger([history], flush_secs=0.01)
    steps = 2000
    errors: list = []

    def train():
        try:
            for step in range(steps):
                history.add_samples(step, [step, step + 1])
                logger.log_metrics({"loss": float(step), "twice": 2.0 * step, f"k{step % 300}": 1.0}, step=step)
                logger.log_histogram("reward", np.array([step, step + 0.5]), step=step)
                logger.commit(step)
        except Exception as exc:  # reported by the main thread's assert
            errors.append(exc)

    trainer = threading.Thread(target=train)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave often, so an unguarded read meets an append at once
    trainer.start()
    reads = 0
    while trainer.is_alive() or reads == 0:  # bounded: the trainer commits `steps` steps and stops
        try:
            if "loss" in history.metrics:
                got, values = history.series("loss")
                assert values.tolist() == got.astype(float).tolist()  # whole pairs
                assert np.all(np.diff(got) == 1) and len(got) <= 500  # recent steps, in order, none missing
                assert history.last("loss") >= values[-1]
                assert "loss" in history.keys()
            frame = history.to_dataframe()
            assert (frame["reward"] - frame["step"]).isin([0.0, 0.5]).all()  # each value with its own sample
            reads += 1
        except Exception as exc:  # a query that failed: reported below
            errors.append(exc)
            break
    trainer.join()
    sys.setswitchinterval(switch)
    logger.close()
    assert errors == [], errors[:1]
    got, _ = history.series("loss")
    assert got.tolist() == list(range(steps - 500, steps))


@pytest.mark.parametrize("max_steps", [None, 3])
def test_system_monitor_samples_are_kept_on_their_own_axis_as_jsonl_writes_them(tmp_path, max_steps):
    import json

    pytest.importorskip("psutil")
    history = RunHistoryBackend(max_steps=max_steps)
    monitor = instrument.SystemMonitor(collection_interval=0.02, flush_interval=0.02, max_buffered=2, gpu=False)
    inst = instrument.Instrumentation(backends=[history, instrument.JsonlBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r", system_monitor=monitor,
                                      overhead_budget=None)
    for step in range(3):
        with inst.step(step):
            inst.logger.log_metrics({"loss": float(step)}, step=step)
    time.sleep(0.2)  # about ten samples, flushed two at a time (max_buffered) and every 0.02 s
    inst.close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    system = [line for line in lines if "system_step" in line]
    assert len(system) >= 4
    assert history.keys() == ["loss"]  # the training metrics are not mixed with the system axis
    assert "system/process_rss_gib" in history.system_keys()
    for key in ("system/seconds", "system/process_rss_gib", "system/host_cpu_percent"):
        # each key its own series: the CPU keys are in the samples measured over at least 0.1 s only
        have = [line for line in system if key in line["metrics"]]
        kept = have[-max_steps:] if max_steps else have
        seconds, values = history.system_series(key)
        assert seconds.tolist() == [line["metrics"]["system/seconds"] for line in kept]
        assert values.tolist() == [line["metrics"][key] for line in kept]
    with pytest.raises(KeyError, match="no system metric 'system/nope'.*known system keys"):
        history.system_series("system/nope")


def test_values_that_are_not_one_per_sample_are_never_paired_by_position(caplog):
    history = RunHistoryBackend(sample_key="b/ids", batch_keys=["b/r", "b/ok"])
    logger = Logger([history])
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_histogram("b/ids", torch.tensor([1, 2, 3]), step=0)
        logger.log_histogram("b/r", torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5]), step=0)  # 5 values, 3 ids
        logger.log_histogram("b/ok", torch.tensor([7.0, 8.0, 9.0]), step=0)
        logger.commit(0)
        history.add_samples(1, ["a", "b", "c", "d"])
        logger.log_histogram("b/r", torch.tensor([0.25, 0.75]), step=1)  # 2 values, 4 samples
        logger.commit(1)
        logger.flush()
        written = [r.getMessage() for r in caplog.records]
        caplog.clear()
        frame = history.to_dataframe()
    assert written == ["instrument: RunHistoryBackend: batch log 'b/r' at step 0 has 5 value(s) for 3 sample(s) "
                       "(named by 'b/ids'): they cannot be paired with the samples (log one value per sample, in "
                       "the order of the ids); kept in batch_log as logged, left unpaired (NaN) by to_dataframe, "
                       "which says so each time."]
    assert [(s, v.tolist()) for s, v in history.batch_log["b/r"]] == [(0, [0.5, 1.5, 2.5, 3.5, 4.5]), (1, [0.25, 0.75])]
    records = frame.to_dict("records")
    assert [(r["sample"], r["step"], r["b/ok"]) for r in records[:3]] == [(1, 0, 7.0), (2, 0, 8.0), (3, 0, 9.0)]
    assert [r["sample"] for r in records[3:]] == ["a", "b", "c", "d"]
    assert all(math.isnan(r["b/r"]) for r in records)  # no sample is given another's value
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("instrument: RunHistoryBackend.to_dataframe: 2 batch(es) left unpaired (NaN): batch log "
                           "'b/r' at step 0 has 5 value(s) for 3 sample(s): ")
    assert "batch log 'b/r' at step 1 has 2 value(s) for 4 sample(s)" in said


def test_add_samples_reads_tensors_and_arrays_of_ids_as_values_and_refuses_a_step_that_is_not_an_int():
    history = RunHistoryBackend(batch_keys=["b/r"])
    logger = Logger([history])
    batches = [torch.tensor([0, 1, 2]), np.array([0, 1, 2]), [torch.tensor(0), np.int64(1), 2]]
    for step, ids in enumerate(batches):  # the same three samples every batch (e.g. pool indices)
        history.add_samples(np.int64(step) if step == 1 else step, ids)
        logger.log_histogram("b/r", torch.tensor([0.5, 1.5, 2.5]) + step, step=step)
        logger.commit(step)
    logger.flush()
    assert history.unique_samples == {0, 1, 2}
    assert all(type(item) is int for _, items in history.batch_samples for item in items)
    frame = history.to_dataframe()
    assert frame["sample"].tolist() == [0, 1, 2] * 3 and frame["b/r"].tolist() == [0.5, 1.5, 2.5, 1.5, 2.5, 3.5,
                                                                                   2.5, 3.5, 4.5]
    for step in (1.7, "x", True, -1, torch.tensor(3)):
        with pytest.raises(ConfigurationError, match=r"add_samples: step must be a non-negative int, the step the "
                                                     r"batch is committed at, got .* Pass the int step"):
            history.add_samples(step, [1, 2])
    with pytest.raises(ConfigurationError, match=r"one id per item of the batch, got a 0-d tensor or array \(3\)"):
        history.add_samples(5, torch.tensor(3))
    with pytest.raises(ConfigurationError, match=r"takes the batch's items, one per item .* got str 'abc'"):
        history.add_samples(5, "abc")
    assert 5 not in history._pending_samples


@pytest.mark.parametrize("keys", ["batch/reward", b"batch/reward"])
def test_batch_keys_given_as_one_string_is_refused_saying_how_to_fix_it(keys):
    """A lone string was taken apart into its characters: ten one-letter tags, and the reward never kept."""
    with pytest.raises(ConfigurationError) as caught:
        RunHistoryBackend(sample_key="batch/ids", batch_keys=keys)
    message = str(caught.value)
    assert f"got the {type(keys).__name__} {keys!r}" in message
    assert "list of histogram tags" in message and f"batch_keys=[{keys!r}]" in message
    assert list(RunHistoryBackend(batch_keys=["batch/reward"]).batch_log) == ["batch/reward"]


def test_a_system_record_without_seconds_is_placed_by_its_step_in_milliseconds():
    history = RunHistoryBackend()
    history.write_system(StepRecord(step=2500, scalars={"system/cpu": 7.0}))  # Logger.write_system: step in ms
    history.write_system(StepRecord(step=4000, scalars={"system/cpu": 8.0, "system/seconds": 3.75}))
    seconds, values = history.system_series("system/cpu")
    assert seconds.tolist() == [2.5, 3.75] and values.tolist() == [7.0, 8.0]


def test_a_step_whose_write_raises_part_way_keeps_nothing_of_that_step():
    """Its scalars and timings were kept before a sample id failed its conversion: the history then held part
    of a step that every other backend's failure report called not written."""
    history = RunHistoryBackend(sample_key="ids", batch_keys=["r"])  # written directly, as the writer thread does
    history.write(StepRecord(step=0, scalars={"loss": 1.0}, histograms={"ids": [1.0, 2.0], "r": [0.5, 0.25]},
                             timings={"iteration": {"mean": 0.1, "count": 2}}))
    with pytest.raises(ValueError):
        history.write(StepRecord(step=1, scalars={"loss": 2.0}, histograms={"ids": ["one", 2.0], "r": [1.0, 1.0]},
                                 timings={"iteration": {"mean": 0.2, "count": 2}}))
    history.write(StepRecord(step=2, scalars={"loss": 3.0}, histograms={"ids": [1.0, 3.0], "r": [2.0, 2.0]}))
    assert list(history.metrics["loss"]) == [(0, 1.0), (2, 3.0)]
    assert [step for step, *_ in history.timelog["iteration"]] == [0]
    assert [step for step, _ in history.batch_log["r"]] == [0, 2]
    assert [step for step, _ in history.batch_samples] == [0, 2] and history.unique_samples == {1, 2, 3}
