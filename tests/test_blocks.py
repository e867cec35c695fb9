"""Whole log_metrics calls staged as blocks (instrument.logger.blocks): floats and one-element tensors, same
numbers as the per-key path, and every bad value still refused on the caller."""

import json
import threading

import numpy as np
import pytest
import torch

import instrument
from instrument.errors import ConfigurationError, InvalidValueError
from instrument.logger.blocks import MAX_BLOCKS


class Keep(instrument.Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def _floats(seed: int, steps: int, keys: int):
    rng = np.random.default_rng(seed)
    # a large mean relative to the spread, and values of very different magnitudes
    return [{f"k{i}": float(1e6 + rng.normal() * 10.0 ** (i % 5 - 2)) for i in range(keys)} for _ in range(steps)]


def _per_key(values):
    """The same values through the per-key path: NumPy numbers are never staged as blocks."""
    return [{k: np.float64(v) for k, v in row.items()} for row in values]


def test_interval_means_match_a_float64_reference_read_back_from_jsonl(tmp_path):
    run = instrument.RunInfo("blocks", tmp_path)
    logger = instrument.Logger([instrument.JsonlBackend()], run)
    rows = _floats(0, 30, 12)
    for step, row in enumerate(rows):
        logger.log_metrics(row, step=step, prefix="train/")
        if step % 10 == 9:
            logger.commit(step)
    logger.close()
    written = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    written = [r for r in written if "step" in r]
    assert [r["step"] for r in written] == [9, 19, 29]
    for r, start in zip(written, (0, 10, 20), strict=True):
        assert list(r["metrics"]) == [f"train/k{i}" for i in range(12)]  # first-logged order, prefixed once
        for i in range(12):
            reference = np.mean(np.array([rows[s][f"k{i}"] for s in range(start, start + 10)], dtype=np.float64))
            assert r["metrics"][f"train/k{i}"] == pytest.approx(reference, rel=1e-12, abs=0)


def test_blocks_and_the_per_key_path_give_identical_numbers():
    rows = _floats(1, 7, 5)
    results = []
    for staged in (rows, _per_key(rows)):
        keep = Keep()
        logger = instrument.Logger([keep])
        for step, row in enumerate(staged):
            logger.log_metrics(row, step=step, prefix="p")
            assert bool(logger._blocks) == (staged is rows)  # each arm takes the path it is meant to test
        logger.commit(6)
        logger.close()
        results.append(keep.records[0].scalars)
    assert results[0] == pytest.approx(results[1], rel=1e-15)
    assert list(results[0]) == list(results[1])


def test_the_dict_is_copied_when_logged():
    keep = Keep()
    logger = instrument.Logger([keep])
    metrics = {"loss": 1.0}
    logger.log_metrics(metrics, step=0)
    metrics["loss"] = 99.0  # a loop reusing its dict changes nothing already logged
    metrics["late"] = 5.0
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"loss": 1.0}


def test_other_value_types_take_the_per_key_path_and_mix_with_blocks():
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"a": 1.0, "b": 2.0}, step=0)  # a block
    logger.log_metrics({"a": torch.tensor(3.0), "c": True}, step=0)  # folds the block into the per-key table
    logger.log_metrics({"b": np.float64(4.0), 7: 1.5}, step=1)  # a float subclass and an int key: per key
    logger.log_metrics({"a": 5.0}, step=1)  # plain again, but the per-key table is not empty: per key
    logger.commit(1)
    logger.close()
    assert keep.records[0].scalars == {"a": 3.0, "b": 3.0, "c": 1.0, "7": 1.5}


def test_a_reduce_conflict_with_a_staged_block_is_still_refused_on_the_caller():
    logger = instrument.Logger([Keep()])
    logger.log_metrics({"x": 1.0}, step=0)
    with pytest.raises(ConfigurationError, match="reduce='mean'.*reduce='max'"):
        logger.log_metrics({"x": 2.0}, step=0, reduce="max")
    logger.close()


def test_a_long_interval_stays_bounded_and_exact():
    keep = Keep()
    logger = instrument.Logger([keep])
    n = 3 * MAX_BLOCKS + 5
    for step in range(n):
        logger.log_metrics({"x": float(step), "y": 0.5}, step=step)
        assert len(logger._blocks) <= MAX_BLOCKS
    logger.commit(n - 1)
    logger.close()
    assert keep.records[0].scalars == {"x": pytest.approx((n - 1) / 2, rel=1e-15), "y": 0.5}


def test_a_discarded_step_drops_its_blocks_only_and_names_them():
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"x": 1.0}, step=1)
    mark = logger.mark()
    logger.log_metrics({"x": 100.0, "y": 5.0}, step=2)
    logger.log_metrics({"y": torch.tensor(6.0)}, step=2)  # folds: the discard still tells what came after
    assert sorted(logger.discard_staged(mark)) == ["x", "y"]
    logger.commit(3)
    logger.close()
    assert keep.records[0].scalars == {"x": 1.0}


def test_a_repeated_step_names_keys_held_in_blocks(caplog):
    logger = instrument.Logger([Keep()])
    logger.log_metrics({"first": 1.0}, step=4)
    logger.commit(4)
    with caplog.at_level("WARNING", logger="instrument"):
        logger.log_metrics({"again": 2.0}, step=4)
        logger.commit(4)
    logger.close()
    assert any("committed a second time" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def test_blocks_logged_from_several_threads_are_committed_exactly_once():
    keep = Keep()
    logger = instrument.Logger([keep])
    per_thread = 400

    def work(i: int) -> None:
        for n in range(per_thread):
            logger.log_metrics({f"t{i}/{n}": float(n)}, step=0)
            if n % 7 == 0:
                logger.commit(0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logger.commit(0)
    logger.close()
    seen = [(k, v) for r in keep.records for k, v in r.scalars.items()]
    assert len(seen) == 4 * per_thread
    assert dict(seen) == {f"t{i}/{n}": float(n) for i in range(4) for n in range(per_thread)}


# ---------------------------------------------------------------------------------------------- tensor blocks
def test_a_call_of_one_element_cpu_float_tensors_is_read_at_once():
    """CPU floats and bools are read on the caller (no sync on a CPU): a float block, nothing to transfer."""
    keep = Keep()
    logger = instrument.Logger([keep])
    weight = torch.ones(3, requires_grad=True)
    values = {"a": torch.tensor(0.1), "b": (weight * 2).sum(), "c": torch.tensor(7.25)}
    logger.log_metrics(values, step=0, prefix="t")
    logger.log_metrics({"h": torch.tensor(1.0078125, dtype=torch.bfloat16)}, step=0)
    (head, floats), (_, halves) = logger._blocks
    assert head == "t/" and all(type(v) is float for v in [*floats.values(), *halves.values()])
    logger.log_metrics({"g": torch.tensor(0.1, dtype=torch.float16), "on": torch.tensor(True)}, step=0)  # per key
    values["a"].fill_(99.0)  # the caller reuses its tensors in place: what was logged stays
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"t/a": float(np.float32(0.1)), "t/b": 6.0, "t/c": 7.25, "h": 1.0078125,
                                       "g": float(np.float16(0.1)), "on": 1.0}


def test_a_call_of_one_element_integer_tensors_is_one_stacked_copy():
    keep = Keep()
    logger = instrument.Logger([keep])
    values = {"a": torch.tensor(2**60 + 1), "b": torch.tensor(-3), "c": torch.tensor(7)}
    logger.log_metrics(values, step=0, prefix="t")
    (head, keys, stacked), = logger._blocks
    assert (head, keys, stacked.shape, stacked.dtype) == ("t/", ("a", "b", "c"), (3,), torch.float64)
    values["c"].fill_(99)
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"t/a": float(2**60 + 1), "t/b": -3.0, "t/c": 7.0}


def test_integer_and_bool_tensor_blocks_stay_exact():
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"big": torch.tensor(2**40 + 1), "small": torch.tensor(-3)}, step=0)
    logger.log_metrics({"on": torch.tensor(True), "off": torch.tensor(False)}, step=0)
    assert len(logger._blocks) == 2
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"big": float(2**40 + 1), "small": -3.0, "on": 1.0, "off": 0.0}


def test_mixed_dtypes_or_shapes_take_the_per_key_path():
    keep = Keep()
    logger = instrument.Logger([keep])
    # stacked together these would become float32, which cannot hold 2**40 + 1
    logger.log_metrics({"big": torch.tensor(2**40 + 1), "f": torch.tensor(0.5)}, step=0)
    logger.log_metrics({"scalar": torch.tensor(1.5), "one": torch.tensor([[2.5]])}, step=0)
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"big": float(2**40 + 1), "f": 0.5, "scalar": 1.5, "one": 2.5}


@pytest.mark.parametrize(
    "value, match",
    [
        (torch.zeros(3), "shape \\(3,\\)"),
        (torch.zeros((), device="meta"), "meta tensor"),
        (torch.tensor(1 + 2j), "complex"),
    ],
)
def test_bad_tensors_in_a_call_are_refused_by_the_per_key_path(value, match):
    logger = instrument.Logger([Keep()])
    with pytest.raises(InvalidValueError, match=match):
        logger.log_metrics({"good": torch.tensor(1.0), "bad": value}, step=0)
    with pytest.raises(InvalidValueError, match=match):
        logger.log_metrics({"bad": value, "bad2": value}, step=0)  # one dtype and shape, still refused
    logger.close()


def test_tensor_blocks_over_an_interval_match_a_float64_reference():
    keep = Keep()
    logger = instrument.Logger([keep])
    rng = np.random.default_rng(3)
    rows = rng.normal(1e3, 1e-2, size=(9, 4))
    for step, row in enumerate(rows):
        logger.log_metrics({f"k{i}": torch.tensor(v, dtype=torch.float64) for i, v in enumerate(row)}, step=step)
        logger.log_metrics({"mixed": torch.tensor(float(step), dtype=torch.float32)}, step=step)
        logger.log_metrics({"mixed": float(step)}, step=step)  # the same key from a float block
    logger.commit(8)
    logger.close()
    scalars = keep.records[0].scalars
    for i in range(4):
        assert scalars[f"k{i}"] == pytest.approx(np.mean(rows[:, i]), rel=1e-14)
    assert scalars["mixed"] == pytest.approx(4.0, rel=1e-15)


# ---------------------------------------------------------------------- review findings


@pytest.mark.parametrize("extra", [{"n": 1}, {"n": np.float64(1.0)}, {"n": torch.tensor(1)}])
def test_a_tensor_changed_in_place_after_the_call_changes_nothing_on_the_per_key_path(extra):
    # A call that is not a block (mixed types) takes the per-key path; its staged value must not be the
    # caller's tensor, which the loop may change in place right after (a running sum, an optimizer step).
    keep = Keep()
    logger = instrument.Logger([keep])
    loss, grad = torch.tensor(1.0), torch.tensor([2.0], requires_grad=True) * 1.0
    logger.log_metrics({"loss": loss, "grad": grad, **extra}, step=0)
    loss.add_(10.0)
    with torch.no_grad():
        grad.add_(10.0)
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars["loss"] == 1.0 and keep.records[0].scalars["grad"] == 2.0


def test_a_weight_tensor_changed_in_place_after_the_call_changes_nothing():
    keep = Keep()
    logger = instrument.Logger([keep])
    weight = torch.tensor(2.0)
    logger.log_metrics({"acc": 0.5}, step=0, weights=weight)
    weight.add_(100.0)
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars["acc"] == 0.5


@pytest.mark.parametrize("dtype, values", [
    (torch.float16, [2000.0] * (MAX_BLOCKS + 1)),  # a float16 sum of these overflows to inf
    (torch.float32, [1e8 + i for i in range(MAX_BLOCKS + 1)]),  # a float32 sum of these rounds
])
def test_the_call_past_max_blocks_does_not_change_the_mean_of_the_calls_before(dtype, values):
    # Up to MAX_BLOCKS calls are summed in float64 on the writer; the next call folds them into the per-key
    # table, which must keep that precision, or one more call changes (here: falsifies) the interval mean.
    keep = Keep()
    logger = instrument.Logger([keep])
    for value in values:
        logger.log_metrics({"x": torch.tensor(value, dtype=dtype)}, step=0)
    logger.commit(0)
    logger.close()
    reference = np.mean(np.array([torch.tensor(v, dtype=dtype).item() for v in values], dtype=np.float64))
    assert keep.records[0].scalars["x"] == pytest.approx(reference, rel=1e-12)


@pytest.mark.parametrize("metrics", [[("loss", 1.0)], "loss", ("loss",)])
def test_metrics_that_are_not_a_mapping_are_refused_with_a_clear_error(metrics):
    logger = instrument.Logger([])
    with pytest.raises(InvalidValueError, match="a dict"):
        logger.log_metrics(metrics, step=0)
    logger.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_per_key_path_sums_an_interval_as_precisely_as_blocks(dtype):
    # The same tensors, once as blocks and once beside an int (the per-key path): one interval mean, not
    # float64 on one path and an overflowing (float16: inf) or rounding (float32) device sum on the other.
    values = [60000.0 if dtype == torch.float16 else 1e8 + i for i in range(10)]
    results = []
    for extra in ({}, {"n": 1}):
        keep = Keep()
        logger = instrument.Logger([keep])
        for value in values:
            logger.log_metrics({"x": torch.tensor(value, dtype=dtype), **extra}, step=0)
        assert bool(logger._blocks) == (not extra)
        logger.commit(0)
        logger.close()
        results.append(keep.records[0].scalars["x"])
    reference = np.mean(np.array([torch.tensor(v, dtype=dtype).item() for v in values], dtype=np.float64))
    assert results == [pytest.approx(reference, rel=1e-12)] * 2


@pytest.mark.parametrize("make", [
    lambda: torch.tensor([2.5]).to_sparse(),
    lambda: torch.tensor([[2.5]]).to_sparse_csr(),
    lambda: torch.quantize_per_tensor(torch.tensor([2.5]), 0.5, 0, torch.qint8),
], ids=["sparse_coo", "sparse_csr", "quantized"])
@pytest.mark.parametrize("extra", [{}, {"n": 1}], ids=["block", "per_key"])
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch deprecates quantize_per_tensor
def test_sparse_and_quantized_one_element_tensors_are_logged_as_their_value(make, extra):
    # Was a bare RuntimeError from deep inside torch (reshape / to), naming no key, on both paths.
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"a": make(), "b": make(), **extra}, step=0)
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars["a"] == 2.5 and keep.records[0].scalars["b"] == 2.5


def test_a_call_with_nothing_to_log_keeps_the_blocks_staged():
    # An observer with nothing to report this step logs {}; that must not fold the interval's blocks (every
    # later call of the interval would take the slower per-key path), and it stages nothing.
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_metrics({}, step=1)
    logger.log_metrics({}, step=1, reduce="sum")
    assert len(logger._blocks) == 1 and not logger._totals
    logger.commit()
    logger.close()
    assert [(r.step, r.scalars) for r in keep.records] == [(1, {"a": 1.0})]  # the step still counts


@pytest.mark.parametrize("options", [{}, {"reduce": "sum"}, {"weights": 2.0}], ids=["mean", "sum", "weighted"])
@pytest.mark.parametrize("bad", [torch.zeros(3), 10**400, "text"], ids=["shape", "huge_int", "str"])
def test_a_refused_call_stages_none_of_its_values(options, bad):
    # The caller is told the call was refused; a loop that catches that and logs again without the bad key
    # must not find the good values of the refused call counted too.
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"good": 1.0}, step=0, **options)
    with pytest.raises(InvalidValueError, match="'bad'"):
        logger.log_metrics({"good": torch.tensor(100.0), "n": 1, "bad": bad}, step=0, **options)
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"good": 1.0}


def test_a_call_refused_for_a_reduce_conflict_stages_none_of_its_values():
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"a": 1.0}, step=0)
    with pytest.raises(ConfigurationError, match="'a'"):
        logger.log_metrics({"b": 2.0, "a": 3.0}, step=0, reduce="sum")
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {"a": 1.0}


def test_counters_and_flags_join_a_float_block_as_the_per_key_path_makes_them():
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"iterations": 32, "done": True, "loss": 0.25, "edge": 2**53, "neg": -(2**53)}, step=0)
    (head, block), = logger._blocks
    assert all(type(v) is float for v in block.values())
    logger.log_metrics({"beyond": 2**53 + 1}, step=0)  # not exactly a float64: the per-key path says so
    assert not logger._blocks
    logger.commit(0)
    logger.close()
    assert keep.records[0].scalars == {
        "iterations": 32.0, "done": 1.0, "loss": 0.25, "edge": float(2**53), "neg": -float(2**53),
        "beyond": float(2**53),
    }


def test_a_refused_call_does_not_move_the_step_of_the_next_implicit_commit():
    keep = Keep()
    logger = instrument.Logger([keep])
    logger.log_metrics({"good": 1.0}, step=5)
    with pytest.raises(InvalidValueError, match="'bad'"):
        logger.log_metrics({"bad": "text"}, step=100)
    with pytest.raises(ConfigurationError, match="'good'"):  # refused for its reduce op, after the blocks fold
        logger.log_metrics({"good": 3.0}, step=200, reduce="sum")
    logger.commit()
    logger.log_metrics({"good": 2.0}, step=6)  # the next step of the loop is not refused as going backwards
    logger.close()
    assert [(r.step, r.scalars) for r in keep.records] == [(5, {"good": 1.0}), (6, {"good": 2.0})]


def test_keys_that_compare_equal_keep_their_own_names_across_calls():
    # 1, 1.0 and True are one dict key, so a name cached for one must not be reused for another
    keep = Keep()
    logger = instrument.Logger([keep])
    for key, value in ((1, 1.0), (True, 5.0), (1.0, 7.0)):
        logger.log_metrics({key: value, "z": np.float64(0.0)}, step=1)  # a NumPy value: the per-key path
    logger.commit()
    logger.close()
    assert keep.records[0].scalars == {"1": 1.0, "z": 0.0, "True": 5.0, "1.0": 7.0}



def test_cpu_tensors_read_at_once_give_the_numbers_the_stacked_path_gives():
    """The CPU read path (no torch function mode) and the stacked path (the one device tensors and a mode take)
    write the same numbers, also over an interval, against a float64 reference."""
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    rng = np.random.default_rng(5)
    rows = rng.normal(1e4, 1e-3, size=(7, 5)).astype(np.float32)
    written = []
    for mode in (None, Passthrough()):
        keep = Keep()
        logger = instrument.Logger([keep])
        for step, row in enumerate(rows):
            values = {f"k{i}": torch.tensor(v) for i, v in enumerate(row)}
            if mode is None:
                logger.log_metrics(values, step=step)
                assert len(logger._blocks[-1]) == 2  # read at once: a float block
            else:
                with mode:
                    logger.log_metrics(values, step=step)
                assert len(logger._blocks[-1]) == 3  # stacked
        logger.commit(6)
        logger.close()
        written.append(keep.records[0].scalars)
    assert written[0] == written[1]
    for i in range(5):
        assert written[0][f"k{i}"] == pytest.approx(np.mean(rows[:, i].astype(np.float64)), rel=1e-15)
