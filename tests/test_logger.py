"""The logger: staging, interval means, one batched transfer, step order, backend isolation."""

import json
import logging
import math
import threading
import time

import numpy as np
import pytest
import torch

import instrument
from instrument.logger import handover as logger_module  # where the commit starts its transfer


class Keep(instrument.Backend):
    def __init__(self):
        self.records = []
        self.params = None
        self.closed = False

    def log_hyperparams(self, params, config_text=None):
        self.params = (params, config_text)

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


class Exploding(instrument.Backend):
    def write(self, record):
        raise OSError("disk full")

    def close(self):
        raise OSError("still full")


def test_one_batched_transfer_per_commit(monkeypatch):
    calls = []
    real = logger_module.start_transfer

    def counting(tensors):
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(logger_module, "start_transfer", counting)
    keep = Keep()
    log = instrument.Logger([keep])
    metrics = {f"m{i}": torch.tensor(float(i)) for i in range(50)}
    log.log_metrics(metrics, step=0, prefix="x")  # CPU floats: read at once, nothing to transfer
    log.log_metrics({f"n{i}": torch.tensor(2**53 + i) for i in range(50)}, step=0)  # int64: one stacked block
    log.log_histogram("h", torch.arange(10.0), step=0)
    log.log_heatmap("hm", torch.rand(6, 3), step=0, x_label="channel", y_label="iter")
    log.log_metrics({"python": 2.5}, step=0)
    record = log.commit()
    # one call: the 50 int64 scalars (one stacked block), their flags of values beyond 2**53, the histogram and
    # the heatmap
    assert calls == [4]
    assert record.scalars["x/m49"] == 49.0 and record.scalars["python"] == 2.5
    assert record.scalars["n49"] == float(2**53 + 49)
    assert record.images["hm"].dtype == np.uint8 and record.images["hm"].shape[2] == 3
    np.testing.assert_array_equal(record.histograms["h"], np.arange(10.0))


def test_the_transfer_packs_a_dtype_in_a_fixed_number_of_tensor_ops():
    """On a launch-bound GPU step every tensor op is a kernel launch: packing a dozen float32 statistics
    (0-d, 1-d, non-contiguous 2-d) for the copy must not cost an op per tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from instrument.logger.transfer import start_transfer

    class Count(TorchDispatchMode):
        ops = 0  # ops that write memory (on a GPU, a kernel each); views are metadata only

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += "view" not in func.__name__ and "alias" not in func.__name__
            return func(*args, **(kwargs or {}))

    table = torch.rand(32, 4, 16)
    values = [table[:, s] for s in range(4)] + [torch.rand(6) for _ in range(4)] + [torch.tensor(0.5)] * 4
    reference = [v.double().numpy().copy() for v in values]
    with Count():
        batch = start_transfer(values)
    # one stack (the 0-d ones), one cat (float32 travels as float32: no conversion on the device), and a flat
    # copy of each of the four non-contiguous columns: not a conversion per tensor as well (12 more)
    assert Count.ops <= 2 + 4, Count.ops
    table.fill_(7.0)  # the caller's tensors change after the commit: what was handed over does not
    for got, want in zip(batch.arrays(), reference, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float32_and_half_precision_travel_as_float32_and_come_back_exact_in_float64(dtype):
    """A float64 copy on the device doubled what staging a histogram of a large tensor cost the training thread
    (a review: a 52M-parameter model's gradient and weight histograms, 9x the model in memory, 1.6 s). Values of
    these dtypes travel as float32, which holds them exactly, and are widened on the host, on the writer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from instrument.logger.transfer import start_transfer

    widened = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.float64:  # a conversion to float64
                widened.append(str(args[0].dtype))
            return out

    torch.manual_seed(0)
    values = [(torch.randn(1000) * 1e4).to(dtype), torch.randn(3, 5).to(dtype).t(), torch.tensor(1e-7).to(dtype),
              torch.tensor(2.0**-20, dtype=torch.float64)]
    reference = [v.double().numpy().copy() for v in values]
    with Watch():
        batch = start_transfer(values)
    assert widened == [], widened  # only the float64 value was float64 already: nothing widened on the device
    for got, want in zip(batch.arrays(), reference, strict=True):
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)


def test_batched_transfer_keeps_every_dtype_exact_and_in_place():
    """0-d tensors are stacked per dtype for the copy: mixed dtypes, shapes and a huge integer must each come
    back as their own float64 value (a float32 stack would round 2**40 + 1), next to arrays and pixels."""
    keep = Keep()
    log = instrument.Logger([keep])
    values = {
        "f32": torch.tensor(0.1, dtype=torch.float32),
        "f16": torch.tensor(1.5, dtype=torch.float16),
        "bf16": torch.tensor(3.0, dtype=torch.bfloat16),
        "big": torch.tensor(2**40 + 1, dtype=torch.int64),
        "flag": torch.tensor(True),
        "one": torch.tensor([7.25], dtype=torch.float64),
        "grad": (torch.ones(3, requires_grad=True) * 2).sum(),
        "f32b": torch.tensor(-2.5, dtype=torch.float32),
    }
    reference = {k: float(torch.as_tensor(v).detach().double().reshape(())) for k, v in values.items()}
    log.log_metrics(values, step=0)
    log.log_histogram("h", torch.arange(5, dtype=torch.int32), step=0)
    log.log_image("img", torch.full((2, 2, 3), 200, dtype=torch.uint8), step=0)
    # staged values never hold the caller's autograd graph (a CPU float tensor is read at once, as a float)
    assert not getattr(log._totals["grad"], "requires_grad", False)
    record = log.commit()
    assert record.scalars == reference
    assert record.scalars["big"] == 2**40 + 1
    np.testing.assert_array_equal(record.histograms["h"], np.arange(5.0))
    assert record.images["img"].dtype == np.uint8 and (record.images["img"] == 200).all()


def test_values_logged_between_commits_are_averaged_on_the_device():
    keep = Keep()
    log = instrument.Logger([keep])
    for step in range(4):
        log.log_metrics({"loss": torch.tensor(float(step)), "lr": 0.1}, step=step, prefix="train")
    log.commit(3)
    assert log.flush()  # backends are written on the logger's writer thread
    assert keep.records[0].step == 3
    assert keep.records[0].scalars == {"train/loss": 1.5, "train/lr": pytest.approx(0.1)}
    assert log.commit() is None  # nothing staged


def test_step_regression_raises_by_default():
    log = instrument.Logger([Keep()])
    log.log_metrics({"a": 1.0}, step=10)
    log.commit()
    with pytest.raises(instrument.StepOrderError, match="step 5 is lower than step 10"):
        log.log_metrics({"a": 1.0}, step=5)
    log.log_metrics({"a": 2.0}, step=10)  # the same step again is fine
    log.commit()


def test_step_regression_can_warn_and_drop(caplog):
    keep = Keep()
    log = instrument.Logger([keep], on_step_regression="warn")
    log.log_metrics({"a": 1.0}, step=10)
    log.commit()
    with caplog.at_level(logging.WARNING, logger="instrument"):
        log.log_metrics({"a": 7.0}, step=3)
    assert "step 3 is lower than step 10" in caplog.text and "are dropped" in caplog.text
    assert "pass on_step_regression='warn'" not in caplog.text  # it is set already (a review found that advice)
    log.log_metrics({"b": 1.0}, step=11)
    log.commit()
    log.flush()
    assert [r.scalars for r in keep.records] == [{"a": 1.0}, {"b": 1.0}]
    with pytest.raises(instrument.ConfigurationError, match="on_step_regression must be one of"):
        instrument.Logger([], on_step_regression="ignore")


@pytest.mark.parametrize(
    "value, error, pattern",
    [
        (torch.ones(3), ValueError, r"metric 'bad' is a tensor of shape \(3,\)"),
        ("high", TypeError, "metric 'bad' has type str"),
        (np.ones(2), ValueError, "metric 'bad' is an array of shape"),
    ],
)
def test_bad_metric_values_are_explained(value, error, pattern):
    log = instrument.Logger([])
    with pytest.raises(error, match=pattern):
        log.log_metrics({"bad": value}, step=0)


_PATHS = {  # one call per staging path: a float block, a tensor block, the per-key table
    "floats": lambda: {"a": 1.0},
    "tensors": lambda: {"a": torch.tensor(1.0)},
    "per-key": lambda: {"a": np.float32(1.0)},
}


@pytest.mark.parametrize("path", sorted(_PATHS))
@pytest.mark.parametrize(
    "step, pattern",
    [(True, "step must be an int, got bool"), (2.0, "got float"), ("3", "got str"),
     (-1, r"step must be between 0 and 2\*\*63 - 1 .*got -1"), (2**63, r"2\*\*63 - 1 .*got 9223372036854775808")],
)
def test_a_bad_step_is_refused_on_every_path_and_stages_nothing(path, step, pattern):
    keep = Keep()
    log = instrument.Logger([keep])
    with pytest.raises(instrument.InvalidValueError, match=pattern):
        log.log_metrics(_PATHS[path](), step=step)
    assert not log.has_pending
    log.log_metrics({"b": 2.0}, step=4)
    with pytest.raises(instrument.InvalidValueError, match=pattern):
        log.commit(step)
    assert log.has_pending  # a step the commit refuses takes nothing off the staged table
    log.close()
    assert [(r.step, dict(r.scalars)) for r in keep.records] == [(4, {"b": 2.0})]  # close()'s commit


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_step_checks_on_every_path(path, caplog):
    keep = Keep()
    log = instrument.Logger([keep], on_step_regression="warn")
    log.log_metrics(_PATHS[path](), step=np.int64(5))  # any integral type is a step
    assert log.commit().step == 5
    with caplog.at_level(logging.WARNING, logger="instrument"):
        assert log.log_metrics(_PATHS[path](), step=4) is None  # lower than a committed step: dropped
        log.log_metrics(_PATHS[path](), step=7)
        assert log.commit(6).step == 6  # the commit names its step; a staged later step may be committed earlier
        log.log_metrics(_PATHS[path](), step=8)
        assert log.commit(3) is None  # lower than a committed step: dropped, and its values with it
    assert "step 4 is lower than step 5" in caplog.text and "step 3 is lower than step 6" in caplog.text
    assert not log.has_pending
    log.close()
    assert [(type(r.step), r.step, r.scalars) for r in keep.records] == [(int, 5, {"a": 1.0}), (int, 6, {"a": 1.0})]
    strict = instrument.Logger([])
    strict.log_metrics(_PATHS[path](), step=5)
    strict.commit()
    with pytest.raises(instrument.StepOrderError, match="step 4 is lower than step 5"):
        strict.log_metrics(_PATHS[path](), step=4)
    strict.log_metrics(_PATHS[path](), step=5)
    with pytest.raises(instrument.StepOrderError, match="step 2 is lower than step 5"):
        strict.commit(2)
    assert not strict.has_pending
    strict.close()


@pytest.mark.parametrize("policy", ["raise", "warn"])
@pytest.mark.parametrize("end", ["commit", "close"])
def test_values_staged_before_an_own_step_record_are_not_lost(policy, end, caplog):
    keep = Keep()
    log = instrument.Logger([keep], on_step_regression=policy)
    log.log_metrics({"loss": 1.0}, step=0)
    log.log_metrics({"eval": 2.0}, step=1, commit=True)  # a record of its own at step 1
    with caplog.at_level(logging.WARNING, logger="instrument"):
        if end == "commit":
            assert log.commit().step == 1  # an implicit commit never goes behind a committed step
        log.close()
    assert [(r.step, r.scalars) for r in keep.records] == [(1, {"eval": 2.0}), (1, {"loss": 1.0})]
    assert "lower than" not in caplog.text and "final commit failed" not in caplog.text
    explicit = instrument.Logger([Keep()], on_step_regression=policy)
    explicit.log_metrics({"loss": 1.0}, step=0)
    explicit.log_metrics({"eval": 2.0}, step=1, commit=True)
    if policy == "raise":  # a step the caller names is still checked
        with pytest.raises(instrument.StepOrderError, match="step 0 is lower than step 1"):
            explicit.commit(0)
    else:
        assert explicit.commit(0) is None
    explicit.close()


def test_bad_step_type():
    with pytest.raises(TypeError, match="step must be an int, got float"):
        instrument.Logger([]).log_metrics({"a": 1}, step=1.0)


def test_failing_backend_does_not_cost_the_others(caplog):
    keep = Keep()
    log = instrument.Logger([Exploding(), keep])
    with caplog.at_level(logging.DEBUG, logger="instrument"):
        for step in range(3):
            log.log_metrics({"a": torch.tensor(1.0)}, step=step)
            log.commit()
        log.close()
    assert len(keep.records) == 3 and keep.closed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "backend 'Exploding' failed in write()" in warnings[0].getMessage()
    assert log.failures == {"Exploding": 4}


def test_backend_type_checked():
    with pytest.raises(instrument.ConfigurationError, match="got dict"):
        instrument.Logger([{}])


def test_hyperparams_flattened_and_secrets_redacted():
    keep = Keep()
    log = instrument.Logger([keep])
    log.log_hyperparams({"optim": {"lr": 1e-3, "betas": (0.9, 0.99)}, "wandb": {"api_key": "abc", "project": "p"},
                         "reward_key": "reward", "hf_token": "xyz"}, "a.b = 1")
    log.flush()
    params, text = keep.params
    assert params == {"optim/lr": 1e-3, "optim/betas": "(0.9, 0.99)", "wandb/api_key": "<redacted>",
                      "wandb/project": "p", "reward_key": "reward", "hf_token": "<redacted>"}
    assert text == "a.b = 1"


def test_timer_reports_interval_statistics():
    keep = Keep()
    log = instrument.Logger([keep])
    timer = log.timer("rollout")
    assert log.timer("rollout") is timer
    for _ in range(3):
        with timer:
            sum(range(1000))

    @log.timer("decorated")
    def work():
        return 7

    assert work() == 7
    record = log.commit(0)
    rollout = record.timings["rollout"]
    assert rollout["count"] == 3.0 and 0 < rollout["min"] <= rollout["mean"] <= rollout["max"]
    assert record.timings["decorated"]["count"] == 1.0
    assert record.flat_scalars()["timing/rollout/count"] == 3.0  # what scalar-only backends write
    assert not log.has_pending  # timers were drained by the commit


def test_a_timer_never_committed_keeps_bounded_memory_and_counts_every_span():
    """Every span was kept as a float until the next commit: with log_interval=0 (no commit until close), or a
    Logger used without commits, a timer grew by one float a span for the whole run. Spans are now folded into
    count, sum, min and max every FOLD_AT spans."""
    from instrument.logger.timer import FOLD_AT

    keep = Keep()
    log = instrument.Logger([keep])
    timer = log.timer("stage")
    n = 3 * FOLD_AT + 5
    began = time.perf_counter()
    for _ in range(n):
        with timer:
            sum(range(10))
        assert len(timer._seconds) < FOLD_AT
    spent = time.perf_counter() - began
    stats = log.commit(0).timings["stage"]
    assert stats["count"] == n and 0 < stats["min"] <= stats["mean"] <= stats["max"] and stats["mean"] * n < spent
    log.close()


def test_a_failed_steps_spans_are_discarded_exactly_also_when_they_were_folded():
    from instrument.logger.timer import FOLD_AT

    log = instrument.Logger([Keep()])
    timer = log.timer("stage")
    for _ in range(10):
        with timer:
            pass
    mark = log.mark()  # a step starts...
    for _ in range(FOLD_AT + 7):  # ...measures enough to be folded, and fails
        with timer:
            pass
    assert log.discard_staged(mark) == ["timer stage"]
    for _ in range(3):
        with timer:
            pass
    assert log.commit(0).timings["stage"]["count"] == 13  # the 10 before the step and the 3 after it
    other = log.timer("other")
    mark = log.mark()  # a timer not measured since its last take: what it holds later is all newer
    for _ in range(FOLD_AT + 1):
        with other:
            pass
    assert log.discard_staged(mark) == ["timer other"] and other.count == 0
    log.close()


def test_a_timers_count_never_misses_the_spans_being_folded(monkeypatch):
    """A fold moved the spans out of the list before it set the folded count: a commit reading `count` meanwhile
    saw 0 and skipped the timer (its spans went to the next record, or at close were never written)."""
    from instrument.logger import timer as timer_module

    timer = timer_module.Timer("work", cuda=False)
    for _ in range(timer_module.FOLD_AT - 1):
        with timer:
            pass
    folding, release = threading.Event(), threading.Event()
    combined = timer_module._combined

    def held_up(folded, seconds):  # the fold, caught between its two steps
        folding.set()
        release.wait(10)
        return combined(folded, seconds)

    monkeypatch.setattr(timer_module, "_combined", held_up)

    def one_more_span():
        with timer:  # the FOLD_AT-th span: it folds
            pass

    spanning = threading.Thread(target=one_more_span)
    spanning.start()
    assert folding.wait(10)
    seen = []
    reader = threading.Thread(target=lambda: seen.append(timer.count))
    reader.start()
    reader.join(0.2)  # a commit's read, while the fold is held up
    release.set()
    spanning.join(10)
    reader.join(10)
    assert seen == [timer_module.FOLD_AT]


def test_a_span_whose_events_cannot_be_read_is_left_for_the_commit_and_never_raises_in_a_span():
    """A CUDA span begun on one device and ended on another has no elapsed time (torch raises RuntimeError): the
    commit reports it (docs/backends.md). Folding on the training thread read it inside the next span's exit and
    would raise there, in the user's loop. It needs two GPUs, so a pair that runs and cannot be read stands in."""
    from instrument.logger.timer import FOLD_AT, Timer

    class RunOnTwoDevices:
        def query(self):
            return True

        def elapsed_time(self, end):
            raise RuntimeError("events recorded on different devices")

    timer = Timer("t", cuda=False)
    pair = (RunOnTwoDevices(), RunOnTwoDevices())
    timer._events.append(pair)
    for _ in range(2 * FOLD_AT):  # two folds of CPU spans walk the events
        with timer:
            pass
    assert timer._events == [pair] and timer.count == 2 * FOLD_AT + 1


def test_timing_statistics_of_folded_and_single_spans_together():
    from instrument.logger.timer import timing_stats

    # (count, sum, min, max) folded earlier, and two spans kept one by one
    assert timing_stats(((2, 3.0, 1.0, 2.0), [0.5, 4.0], [])) == {"mean": 7.5 / 4, "min": 0.5, "max": 4.0,
                                                                    "count": 4.0}
    assert timing_stats((None, [0.25], [])) == {"mean": 0.25, "min": 0.25, "max": 0.25, "count": 1.0}
    assert timing_stats((None, [], [])) is None


def test_images_in_every_layout():
    log = instrument.Logger([])
    log.log_image("chw", torch.rand(3, 8, 9), step=0)
    log.log_image("hwc", np.zeros((8, 9, 4), dtype=np.uint8), step=0)
    log.log_image("hw", torch.rand(8, 9), step=0)
    record = log.commit()
    assert {k: v.shape for k, v in record.images.items()} == {"chw": (8, 9, 3), "hwc": (8, 9, 4), "hw": (8, 9, 3)}
    with pytest.raises(ValueError, match=r"log_image\('bad'\): expected an image of shape"):
        log.log_image("bad", torch.rand(2, 3, 8, 9), step=1)  # checked on the caller, from its shape alone


def test_integer_pixels_other_than_uint8_are_refused_and_bool_pixels_are_drawn():
    """0..255 in an int64 tensor would be read as floats, clipped to 1 and drawn almost all white: refused on
    the caller, from the dtype alone, with the conversion to use. A bool mask is black and white."""
    log = instrument.Logger([])
    for value in (torch.full((8, 9), 200, dtype=torch.int64), np.full((8, 9, 3), 200, dtype=np.int32)):
        with pytest.raises(ValueError, match=r"log_image\('px'\): got pixels of dtype .*int.*\.to\(torch\.uint8\)"):
            log.log_image("px", value, step=0)
    with pytest.raises(ValueError, match=r"log_video\('clip'\): got pixels of dtype torch.int16"):
        log.log_video("clip", torch.zeros(2, 4, 4, 3, dtype=torch.int16), step=0)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1, 2] = True
    log.log_image("mask", mask, step=0)
    record = log.commit()
    image = record.images["mask"]
    assert image.shape == (4, 5, 3) and image[1, 2].tolist() == [255, 255, 255] and image.sum() == 3 * 255


def test_nan_values_pass_through():
    log = instrument.Logger([])
    log.log_metrics({"nan": torch.tensor(float("nan")), "inf": float("inf")}, step=0)
    record = log.commit()
    assert math.isnan(record.scalars["nan"]) and record.scalars["inf"] == math.inf


@pytest.mark.parametrize("where", ["bare", "session"])
def test_timings_go_with_the_next_record_that_has_a_step(where, tmp_path, caplog):
    """Timer measurements carry no step. They go with the next record (an interval's timings with its logging
    step); ``commit(step)`` writes them alone at that step; those taken after the last logging step are not
    written at close, which would be a second record at a step already written (W&B keeps only the first)."""
    if where == "bare":
        keep = Keep()
        log = instrument.Logger([keep])
        log.log_metrics({"a": 1.0}, step=3)
        log.commit()
        for _ in range(4):
            with log.timer("fwd"):
                pass
        assert log.commit() is None  # no step to put them at: they stay staged
        with log.timer("fwd"):
            pass
        log.commit(4)  # a step given: written there, all five
        with log.timer("fwd"):
            pass
        with caplog.at_level(logging.WARNING, logger="instrument"):
            log.close()
        assert [(r.step, r.timings["fwd"]["count"]) for r in keep.records if "fwd" in r.timings] == [(4, 5)]
        assert [r.step for r in keep.records] == [3, 4] and "a second time" not in caplog.text
        return
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_dir=str(tmp_path), run_name="t",
                                      log_interval=10, overhead_budget=None)
    for step in range(26):  # logging steps 0, 10, 20; steps 21..25 are measured after the last one
        with inst.step(step):
            with inst.logger.timer("fwd"):
                pass
    inst.close()
    import json
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    counts = [(x["step"], x["metrics"]["timing/fwd/count"]) for x in lines if "timing/fwd/count" in x["metrics"]]
    assert counts == [(0, 1.0), (10, 10.0), (20, 10.0)]  # every interval with its logging step, once


@pytest.mark.parametrize("commit_own", [False, True], ids=["interval", "commit_true"])
def test_a_zero_weight_costs_at_most_its_own_key(commit_own, caplog):
    # e.g. a masked-token accuracy weighted by the number of masked tokens, which is 0 in this batch
    keep = Keep()
    log = instrument.Logger([keep])
    log.log_metrics({"loss": 2.0}, step=0)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        log.log_metrics({"acc": 1.0}, step=0, weights=0.0, commit=commit_own)
        if not commit_own:
            log.log_metrics({"acc": 1.0}, step=0, weights=0.0)
            log.commit(0)
    assert caplog.text.count("'acc': its weights sum to 0") == 1  # said once, naming the key
    log.log_metrics({"tok": torch.tensor(0.5), "n": 3.0}, step=0, weights={"tok": torch.tensor(0.0)},
                    commit=commit_own)  # a weight on the device: 0 / 0 there, no host sync to look at it
    log.log_metrics({"half": 1.0}, step=0, weights=0.0)
    log.log_metrics({"half": 3.0}, step=0, weights=2.0)  # a 0 among other weights is an ordinary weight
    log.commit(0)
    log.close()
    merged = {}
    for record in keep.records:
        merged.update(record.scalars)
    assert merged["loss"] == 2.0 and merged["n"] == 3.0 and merged["half"] == 3.0
    # a weighted mean of total weight 0 is undefined: NaN, that key alone
    assert math.isnan(merged["acc"]) and math.isnan(merged["tok"])


def test_a_step_start_and_a_commit_visit_only_the_timers_measured_since_the_last_commit():
    """Every timer name ever used stayed in the walk of every step's start (`mark`) and every commit: a timer per
    checkpoint (`timer(f"checkpoint_{i}")`) made each step, non-logging ones too, cost 1.8 ms at 2,000 names
    against 30 us with one (a review). Measurements from another thread during commits are each committed once."""
    keep = Keep()
    log = instrument.Logger([keep])
    for i in range(500):
        with log.timer(f"checkpoint_{i}"):
            pass
    log.mark()  # a step's start visits no timer at all (each notes the mark at its next span, `Timer.rewind`)
    assert len(log._timed) == 500
    log.commit(0)
    log.mark()
    assert log._timed == {} and not log.has_pending  # 500 idle timers: nothing to visit
    with log.timer("checkpoint_7"):
        pass
    assert list(log._timed) == ["checkpoint_7"]
    record = log.commit(1)
    assert list(record.timings) == ["checkpoint_7"] and record.timings["checkpoint_7"]["count"] == 1.0

    spans, stop = [], threading.Event()

    def measure():
        timer = log.timer("worker")
        while not stop.is_set():
            with timer:
                pass
            spans.append(1)

    thread = threading.Thread(target=measure)
    thread.start()
    committed = []
    try:
        for step in range(2, 200):
            record = log.commit(step)
            if record is not None:
                committed.append(record.timings.get("worker", {}).get("count", 0.0))
    finally:
        stop.set()
        thread.join()
    last = log.commit(200)
    committed.append(0.0 if last is None else last.timings["worker"]["count"])
    log.close()
    assert sum(committed) == len(spans)


def test_per_prefix_key_names_stay_bounded_and_a_bad_step_is_refused_with_nothing_staged():
    """A prefix per episode (`prefix=f"eval/episode_{i}"`) kept one cached name table per prefix forever: +92 MB
    after 200,000 (a review). And commit(-1), commit(5.5), commit("7") returned None silently when nothing was
    staged, though the same calls raise when something is: backends.md says such steps are refused."""
    keep = Keep()
    log = instrument.Logger([keep])
    for i in range(1000):
        log.log_metrics({"return": np.float64(i), "length": 5}, step=i, prefix=f"eval/episode_{i}")
        log.commit(i)
    assert len(log._names) <= 256
    log.flush()
    assert keep.records[-1].scalars == {"eval/episode_999/return": 999.0, "eval/episode_999/length": 5.0}
    assert keep.records[3].scalars == {"eval/episode_3/return": 3.0, "eval/episode_3/length": 5.0}
    for bad in (-1, 2**63, 5.5, "7", float("nan"), True):
        with pytest.raises(instrument.InvalidValueError, match="step must be"):
            log.commit(bad)
    assert log.commit(np.int64(1000)) is None  # an integral type, nothing staged: nothing to do
    log.close()


def test_a_commit_refused_for_its_step_keeps_what_is_staged_for_the_next_commit():
    """commit(True) or commit(9.0) raised after taking the staged values off the table: the retry with a good
    step committed nothing, and the interval's values were gone (a review)."""
    keep = Keep()
    log = instrument.Logger([keep])
    log.log_metrics({"a": 1.0}, step=5)
    log.log_image("pic", np.zeros((2, 2)), step=5)
    for bad in (True, 9.0, 10.5, -1, 2**63, "5"):
        with pytest.raises(instrument.InvalidValueError, match="step must be.*Nothing was committed"):
            log.commit(bad)
    assert log.commit(5) is not None
    log.close()
    assert [(r.step, dict(r.scalars), list(r.images)) for r in keep.records] == [(5, {"a": 1.0}, ["pic"])]


def test_a_timer_used_reentrantly_measures_every_span_and_never_raises():
    keep = Keep()
    log = instrument.Logger([keep])
    timer = log.timer("solve")

    @timer
    def solve(n):
        return 0 if n == 0 else solve(n - 1) + 1

    assert solve(2) == 2  # three nested spans of one timer
    log.log_metrics({"a": 1.0}, step=0)
    log.commit(0)
    with log.timer("x"), log.timer("x"):  # nested blocks of one name
        pass
    with pytest.raises(KeyError), log.timer("x"):  # a span left by an exception is measured too
        {}["missing"]
    # two threads inside one timer at once, interleaved: A enters, B enters, A exits, B exits
    order = [threading.Event() for _ in range(3)]
    errors = []

    def span(wait_before_enter, set_after_enter, wait_before_exit, set_after_exit):
        try:
            if wait_before_enter:
                wait_before_enter.wait(10.0)
            with log.timer("shared"):
                set_after_enter.set()
                if wait_before_exit:
                    wait_before_exit.wait(10.0)
            if set_after_exit:
                set_after_exit.set()
        except Exception as exc:  # pragma: no cover - the failure this test is about
            errors.append(exc)

    a = threading.Thread(target=span, args=(None, order[0], order[1], order[2]))
    b = threading.Thread(target=span, args=(order[0], order[1], order[2], None))
    a.start(), b.start()
    a.join(10.0), b.join(10.0)
    log.commit(1)
    log.close()
    assert not errors
    assert keep.records[0].timings["solve"]["count"] == 3
    assert keep.records[0].timings["solve"]["min"] >= 0.0
    x, shared = keep.records[1].timings["x"], keep.records[1].timings["shared"]
    assert x["count"] == 3 and x["min"] >= 0.0
    assert shared["count"] == 2 and shared["min"] >= 0.0


def test_an_ordinary_timed_loop_is_not_told_it_committed_a_step_twice_at_close(tmp_path, caplog):
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("t", tmp_path))
    timer = logger.timer("train")
    for step in range(25):  # timed every step, logged every 10: steps 21..24 follow the last logging step
        with timer:
            pass
        if step % 10 == 0:
            logger.log_metrics({"loss": 1.0}, step=step)
            logger.commit(step)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.close()
    lines = (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 10, 20]  # one record per logging step
    assert not any("a second time" in r.getMessage() for r in caplog.records)


def test_an_implicit_commit_with_timer_measurements_alone_waits_for_a_step(tmp_path):
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("t", tmp_path))
    timer = logger.timer("train")
    for step in range(1, 21):  # timed every iteration, metrics every 10, commit() every iteration
        with timer:
            pass
        if step % 10 == 0:
            logger.log_metrics({"loss": 1.0}, step=step)
        logger.commit()
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20]  # no step 0 (never logged), one record per step
    assert [line["metrics"]["timing/train/count"] for line in lines] == [10.0, 10.0]  # the whole interval


def test_a_timer_without_cuda_initialised_times_wall_clock_and_cuda_false_keeps_it_there():
    """Timers took CUDA events whenever a GPU existed, so a CPU-only run on a GPU machine created a CUDA context
    at its first span, and host-side stages were timed on the GPU's queue (a review of the CUDA paths). Now a
    timer decides at each span; `logger.timer(name, cuda=False)` stays on wall time."""
    import time

    log = instrument.Logger([Keep()])
    for cuda in (None, False):
        timer = log.timer(f"t{cuda}", cuda=cuda)
        with timer:
            time.sleep(0.002)
        assert timer.cuda is cuda and isinstance(timer._seconds[0], float) and timer._seconds[0] >= 0.002
    record = log.commit(0)
    assert record.timings["tFalse"]["count"] == 1.0 and record.timings["tNone"]["min"] >= 0.002
    assert log.timer("tNone", cuda=False).cuda is False  # set on the existing timer
    with pytest.raises(instrument.ConfigurationError, match="reduce='max'"):  # checked with cuda= given too
        log.timer("tNone", reduce="mean", cuda=True)
    assert log.timer("tNone").cuda is False
    log.close()
