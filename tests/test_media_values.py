"""Media values the logger must convert exactly, refuse at the call, or drop alone (docs/backends.md, issue 13):
quantized, sparse and nested tensors, a tag staged as both an image and a heatmap, integer sample fields."""

import io
import json
import logging

import numpy as np
import pytest
import torch

from instrument import JsonlBackend, Logger, RunInfo
from instrument.backends.base import Backend
from instrument.errors import InvalidValueError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # quantized, sparse CSR and nested: prototypes


class Keep(Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _quantized(values):
    return torch.quantize_per_tensor(torch.tensor(values), 0.25, 0, torch.qint8)


# (kind, make the value, what its JSONL line holds for it)
EXOTIC = {
    "quantized histogram": ("histogram", lambda: _quantized([0.5, -1.0, 2.0]), {"count": 3, "min": -1.0, "max": 2.0}),
    "sparse histogram": ("histogram", lambda: torch.tensor([0.0, 3.0, 0.0, -2.0]).to_sparse(),
                         {"count": 4, "min": -2.0, "max": 3.0}),
    "quantized heatmap": ("heatmap", lambda: _quantized([[0.5, 1.0], [1.5, 2.0]]), None),
    "sparse csr heatmap": ("heatmap", lambda: torch.eye(3).to_sparse_csr(), None),
    "sparse coo field": ("samples", lambda: [{"x": torch.tensor([[1.0, 0.0], [0.0, 2.5]]).to_sparse()}],
                         [{"x": "[[1.0, 0.0], [0.0, 2.5]]"}]),
    "sparse csr field": ("samples", lambda: [{"x": torch.tensor([[0.0, 4.0]]).to_sparse_csr()}],
                         [{"x": "[[0.0, 4.0]]"}]),
    "0-d quantized field": ("samples", lambda: [{"score": torch.quantize_per_tensor(torch.tensor(0.75), 0.25, 0,
                                                                                      torch.qint8)}],
                            [{"score": 0.75}]),
}


@pytest.mark.parametrize("case", list(EXOTIC))
def test_quantized_and_sparse_media_are_written_as_their_values_and_cost_the_step_nothing(tmp_path, case):
    kind, make, want = EXOTIC[case]
    path = tmp_path / "m.jsonl"
    logger = Logger([JsonlBackend(str(path))], RunInfo("x", tmp_path))
    logger.log_metrics({"loss": 0.5}, step=0)
    getattr(logger, f"log_{kind}")("v", make(), 0)
    logger.commit(0)  # raised here on the training thread, losing the step's loss with it
    logger.log_metrics({"loss": 0.25}, step=1)
    logger.commit(1)
    logger.close()
    first, second = _lines(path)
    assert (first["metrics"], second["metrics"]) == ({"loss": 0.5}, {"loss": 0.25})
    field = {"histogram": "histograms", "heatmap": "images", "samples": "samples"}[kind]
    if kind == "histogram":
        assert {k: first[field]["v"][k] for k in want} == want
    elif kind == "heatmap":
        assert len(first[field]["v"]) == 3  # drawn: an RGB image
    else:
        assert first[field]["v"] == want
    assert logger.failures == {}


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("kind", ["histogram", "heatmap", "samples"])
def test_nested_tensors_are_refused_at_the_call_with_what_to_do(kind, layout):
    keep = Keep()
    logger = Logger([keep])
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=layout)
    logger.log_metrics({"loss": 1.0}, step=0)
    value = [{"x": nested}] if kind == "samples" else nested
    with pytest.raises(InvalidValueError, match=r"got a nested tensor .*unbind\(\).*to_padded_tensor") as caught:
        getattr(logger, f"log_{kind}")("v", value, 0)
    assert "log_" + kind + "('v')" in str(caught.value)
    logger.commit(0)
    logger.close()
    assert [r.scalars for r in keep.records] == [{"loss": 1.0}]


def test_bits_dtypes_are_refused_at_the_call():
    logger = Logger([])
    with pytest.raises(InvalidValueError, match=r"log_histogram\('b'\): got a tensor of dtype torch.bits8"):
        logger.log_histogram("b", torch.zeros(4, dtype=torch.uint8).view(torch.bits8), 0)
    assert not logger.has_pending
    logger.close()


@pytest.mark.parametrize("together", [False, True], ids=["alone", "with a float"])
def test_a_bits_scalar_is_refused_naming_the_metric_and_what_was_staged_stays(together):
    """log_metrics raised a bare NotImplementedError ('"copy_" not implemented for 'Bits8'') naming nothing."""
    keep = Keep()
    logger = Logger([keep])
    logger.log_metrics({"before": 1.0}, step=0)
    bits = torch.zeros(1, dtype=torch.uint8).view(torch.bits8)
    with pytest.raises(InvalidValueError, match=r"metric 'a' is a tensor of dtype torch.bits8.*value.float\(\)"):
        logger.log_metrics({"a": bits, "b": 1.5} if together else {"a": bits}, step=0)
    logger.commit(0)
    logger.close()
    assert [r.scalars for r in keep.records] == [{"before": 1.0}]


class Uncopyable(torch.Tensor):
    """A tensor subclass the caller's checks accept and the commit's packing cannot handle."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.stack, torch.cat, torch.Tensor.reshape):
            raise RuntimeError("this subclass cannot be packed")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_the_transfer_cannot_copy_is_dropped_alone_with_one_message(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    logger = Logger([JsonlBackend(str(path))], RunInfo("x", tmp_path))
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for step in range(2):
            logger.log_metrics({"loss": torch.tensor(0.5 + step), "n": 3.0}, step=step)
            logger.log_histogram("bad", torch.arange(4.0).as_subclass(Uncopyable), step)
            logger.log_histogram("good", torch.arange(3.0), step)
            logger.commit(step)
        logger.close()
    records = _lines(path)
    assert [r["metrics"] for r in records] == [{"loss": 0.5, "n": 3.0}, {"loss": 1.5, "n": 3.0}]
    assert all(list(r["histograms"]) == ["good"] and r["histograms"]["good"]["count"] == 3 for r in records)
    messages = [r.getMessage() for r in caplog.records if "dropped histogram 'bad'" in r.getMessage()]
    assert len(messages) == 1 and "this subclass cannot be packed" in messages[0]
    assert logger.failures == {"histogram bad": 2}


class Unstackable(torch.Tensor):
    """A one-element tensor subclass whose stack and cat raise: what the commit's batched copy uses."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.stack, torch.cat):
            raise RuntimeError("this subclass cannot be stacked")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_metric_the_transfer_cannot_copy_is_dropped_alone_and_counted(tmp_path, caplog):
    """As a metric (not a histogram) such a tensor cost the whole step: every scalar and histogram of it was
    lost, `failures` stayed empty, and the step's handle said it was dropped under on_full='drop'. (An int64
    one: a CPU float is read at the call and never reaches the transfer.)"""
    path = tmp_path / "m.jsonl"
    logger = Logger([JsonlBackend(str(path))], RunInfo("x", tmp_path))
    odd = torch.tensor(7, dtype=torch.int64).as_subclass(Unstackable)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        logger.log_metrics({"loss": 0.25, "odd": odd}, step=1)
        logger.log_histogram("h", np.arange(4.0), step=1)
        handle = logger.commit(1)
        logger.log_metrics({"loss": 0.125}, step=2)
        logger.commit(2)
        logger.close()
    records = _lines(path)
    assert [(r["step"], r["metrics"]) for r in records] == [(1, {"loss": 0.25}), (2, {"loss": 0.125})]
    assert list(records[0]["histograms"]) == ["h"] and handle.scalars == {"loss": 0.25}
    assert logger.failures == {"metric odd": 1}
    assert sum("dropped metric 'odd'" in r.getMessage() and "cannot be stacked" in r.getMessage()
               for r in caplog.records) == 1


@pytest.mark.parametrize("first", ["image", "heatmap"])
def test_an_image_and_a_heatmap_under_one_tag_are_refused_at_the_call(first):
    keep = Keep()
    logger = Logger([keep])
    second = "heatmap" if first == "image" else "image"
    logger.log_metrics({"loss": 1.0}, step=0)
    getattr(logger, f"log_{first}")("attn", torch.rand(4, 4), 0)
    with pytest.raises(InvalidValueError, match=rf"log_{second}\('attn'\): an? {first} is already staged under the "
                                                r"tag 'attn'.*Use another tag"):
        getattr(logger, f"log_{second}")("attn", torch.rand(4, 4), 0)
    getattr(logger, f"log_{second}")(f"attn/{second}", torch.rand(4, 4), 0)  # what the message says to do
    logger.commit(0)
    getattr(logger, f"log_{second}")("attn", torch.rand(4, 4), 1)  # a later step may use the tag for the other
    logger.commit(1)
    logger.close()
    assert [sorted(r.images) for r in keep.records] == [["attn", f"attn/{second}"], ["attn"]]
    assert logger.failures == {}


def test_integer_tensor_sample_fields_stay_exact_ints(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = Logger([JsonlBackend(str(path))], RunInfo("x", tmp_path))
    big = 2**53 + 1
    logger.log_samples("val", [{"seed": torch.tensor(big), "count": torch.tensor(3), "flag": torch.tensor(True),
                                "score": torch.tensor(0.5), "py": big, "np": np.int64(big)}], 0)
    logger.commit(0)
    logger.close()
    (written,) = _lines(path)[0]["samples"]["val"]
    assert written == {"seed": big, "count": 3, "flag": True, "score": 0.5, "py": big, "np": big}
    # 9007199254740992.0, 3.0 and 1.0 before: what a JSON reader gets is an int, an int and a bool
    assert [type(written[k]) for k in ("seed", "count", "flag", "score")] == [int, int, bool, float]


def test_every_integer_dtype_and_shape_of_a_sample_field_comes_back_exact(tmp_path):
    keep = Keep()
    path = tmp_path / "m.jsonl"
    logger = Logger([keep, JsonlBackend(str(path))], RunInfo("x", tmp_path))
    big = 2**53 + 1
    fields = {
        "one": torch.tensor([big]),  # a one-element 1-d tensor: its element (the whole table was dropped before)
        "small": torch.tensor(-3, dtype=torch.int8),
        "u32": torch.tensor(4_000_000_000, dtype=torch.uint32),
        "u64": torch.tensor(2**63 + 5, dtype=torch.uint64),  # travels as its bits
        "neg": torch.tensor(-(2**62) - 1),
        "ids": torch.tensor([big, 2]),
        "flags": torch.tensor([True, False]),
        "half": torch.tensor(1.5, dtype=torch.float16),
        "pixels": torch.tensor([255], dtype=torch.uint8),
    }
    logger.log_samples("val", [fields], 0)
    logger.commit(0)
    logger.close()
    (row,) = keep.records[0].samples["val"].rows
    assert row == {"one": big, "small": -3, "u32": 4_000_000_000, "u64": 2**63 + 5, "neg": -(2**62) - 1,
                   "ids": [big, 2], "flags": [True, False], "half": 1.5, "pixels": 255}
    assert type(row["half"]) is float and type(row["pixels"]) is int
    (written,) = _lines(path)[0]["samples"]["val"]
    assert written["one"] == big and written["u64"] == str(2**63 + 5)  # beyond int64: its digits (docs)


def test_tensors_inside_a_list_field_of_a_sample_are_written_as_their_values(tmp_path):
    # They used to reach the backends as tensors: a table cell holding the str "[tensor(1.5000), 2, ...]".
    keep, run = Keep(), RunInfo("r", tmp_path)
    logger = Logger([keep, JsonlBackend()], run)
    field = [torch.tensor(1.5), 2, torch.tensor(2**53 + 1), np.float64(3.0), torch.tensor([0.25, 0.5]), "x"]
    logger.log_samples("val", [{"score": 1.0, "parts": field}], step=0)
    logger.commit()
    field[0].fill_(99.0)  # after the commit: what was committed is written, whatever the caller does next
    logger.close()
    (row,) = keep.records[0].samples["val"].rows
    assert row["parts"] == [1.5, 2, 2**53 + 1, 3.0, [0.25, 0.5], "x"]
    assert [type(v) for v in row["parts"][:4]] == [float, int, int, float]
    (line,) = [r for r in _lines(run.dir / "metrics.jsonl") if "step" in r]  # a table cell: a list as its str
    assert line["samples"]["val"] == [{"score": 1.0, "parts": "[1.5, 2, 9007199254740993, 3.0, [0.25, 0.5], 'x']"}]
    with pytest.raises(InvalidValueError, match="an element of field 'parts' of sample 0"):
        Logger([]).log_samples("val", [{"parts": [torch.zeros((), device="meta")]}], step=0)


def test_tensors_inside_tuple_dict_and_nested_fields_are_written_as_logged(tmp_path):
    """A review found tensors inside a tuple, a dict or a nested list neither copied by the commit nor turned
    into values: the table showed 'tensor(-99.)', the caller's refill after commit()."""
    keep, run = Keep(), RunInfo("r", tmp_path)
    logger = Logger([keep, JsonlBackend()], run)
    buf = torch.tensor([1.0, 2.0])
    scaled = torch.tensor(0.25, requires_grad=True) * 2
    logger.log_samples("val", [{"tuple": (buf[0], buf[1]), "dict": {"p": buf[0], "ids": [torch.tensor(2**53 + 1)]},
                                "nested": [[buf[1]], (np.array([3.0]),)], "grad": (scaled,)}], step=1)
    logger.commit(1)
    buf.fill_(-99.0)  # the caller refills its buffer once commit returned
    logger.close()
    (row,) = keep.records[0].samples["val"].rows
    assert row == {"tuple": (1.0, 2.0), "dict": {"p": 1.0, "ids": [2**53 + 1]}, "nested": [[2.0], (3.0,)],
                   "grad": (0.5,)}
    (line,) = [r for r in _lines(run.dir / "metrics.jsonl") if "step" in r]
    assert line["samples"]["val"] == [{"tuple": "(1.0, 2.0)", "dict": "{'p': 1.0, 'ids': [9007199254740993]}",
                                       "nested": "[[2.0], (3.0,)]", "grad": "(0.5,)"}]
    looped: list = [1.0]
    looped.append(looped)
    with pytest.raises(InvalidValueError, match=r"field 'l' of sample 0: lists, tuples and dicts nest more than 8"):
        Logger([]).log_samples("val", [{"l": looped}], step=0)
    with pytest.raises(InvalidValueError, match="an element of field 'd' of sample 0"):
        Logger([]).log_samples("val", [{"d": {"k": (torch.zeros((), device="meta"),)}}], step=0)


def test_integer_histograms_stay_exact_for_jsonl_and_the_run_history(tmp_path):
    """A review found int64 histograms rounded to float64 on the writer: JSONL's min read 2**53 for 2**53 + 1,
    and RunHistoryBackend, which takes sample ids from a histogram, merged distinct ids."""
    from instrument.backends.history import RunHistoryBackend

    history = RunHistoryBackend(batch_keys=["reward"], sample_key="ids")
    logger = Logger([JsonlBackend(), history], RunInfo("r", tmp_path))
    ids = torch.tensor([2**53 + 1, 2**53 + 3, 2**60 + 1, -(2**62) - 1])
    logger.log_histogram("ids", ids, step=1)
    logger.log_histogram("u", torch.tensor([2**63 + 5], dtype=torch.uint64), step=1)
    logger.log_histogram("flags", torch.tensor([True, False]), step=1)
    logger.log_histogram("reward", torch.tensor([0.1, 0.2, 0.3, 0.4]), step=1)
    logger.commit(1)
    logger.close()
    (line,) = [r for r in _lines(tmp_path / "r" / "metrics.jsonl") if "histograms" in r]
    assert line["histograms"]["ids"] == {"count": 4, "min": -(2**62) - 1, "max": 2**60 + 1}
    assert line["histograms"]["u"] == {"count": 1, "min": 2**63 + 5, "max": 2**63 + 5}
    assert line["histograms"]["flags"] == {"count": 2, "min": 0.0, "max": 1.0}
    assert sorted(history.unique_samples) == sorted(ids.tolist())


def test_what_is_drawn_otherwise_than_meant_is_said_once_per_tag(tmp_path, caplog):
    """A review found 0..255 floats drawn all white, an ambiguous [3, 16, 4] drawn as [H, W, C], and a media tag
    logged twice before a commit keeping the last value, each without a word."""
    keep = Keep()
    logger = Logger([keep], RunInfo("r", tmp_path))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            logger.log_image("bright", torch.full((4, 4), 200.0), step)
            logger.log_image("ambiguous", torch.rand(3, 16, 4), step)
            logger.log_image("fine", torch.rand(3, 16, 16), step)
            logger.log_samples("val", [{"score": 1.0}], step)
            logger.log_samples("val", [{"score": 2.0}], step)
            logger.commit(step)
        logger.close()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "log_image('bright') got floats from 200 to 200" in m]) == 1
    assert len([m for m in said if "log_image('ambiguous') got shape (3, 16, 4)" in m]) == 1
    assert len([m for m in said if "log_samples('val') was called again before the commit" in m]) == 1
    assert not [m for m in said if "'fine'" in m]
    assert list(keep.records[0].samples["val"].rows) == [{"score": 2.0}]  # a tuple: read-only in a record
    assert (keep.records[0].images["bright"] == 255).all()  # clipped, as said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="instrument"):  # another run in the same process: said again
        other = Logger([Keep()], RunInfo("r2", tmp_path))
        other.log_image("bright", torch.full((4, 4), 200.0), 0)
        other.close()
    assert len([r for r in caplog.records if "log_image('bright') got floats" in r.getMessage()]) == 1


def test_review_findings_on_sample_containers_ticks_and_integer_histograms(tmp_path):
    """Namedtuples and dict subclasses keep their type in a sample field, x_ticks may be any iterable of labels
    (a pandas Index, dict keys), and a uint8 histogram reaches the backends as int64 (no wrap-around)."""
    import collections

    Box = collections.namedtuple("Box", "x y")
    keep = Keep()
    logger = Logger([keep, JsonlBackend()], RunInfo("r", tmp_path))
    buf = torch.tensor([1.0, 2.0])
    logger.log_samples("val", [{"box": Box(buf[0], 3), "od": collections.OrderedDict(a=buf[1]),
                                "dd": collections.defaultdict(int, {"k": 1}), "long": list(range(1000))}], step=0)
    logger.log_heatmap("hm", torch.rand(2, 3), step=0, x_ticks={"a": 0, "b": 1, "c": 2}.keys())
    logger.log_histogram("u8", torch.tensor([255, 5], dtype=torch.uint8), step=0)
    logger.commit(0)
    buf.fill_(-1.0)
    logger.close()
    (row,) = keep.records[0].samples["val"].rows
    assert row["box"] == Box(1.0, 3) and type(row["box"]) is Box
    assert row["od"] == {"a": 2.0} and type(row["od"]) is collections.OrderedDict
    assert row["dd"] == {"k": 1} and row["long"] == list(range(1000))
    assert keep.records[0].histograms["u8"].dtype == np.int64 and (keep.records[0].histograms["u8"] * 2).tolist() == [
        510, 10]
    (line,) = [r for r in _lines(tmp_path / "r" / "metrics.jsonl") if "samples" in r]
    assert line["samples"]["val"][0]["box"] == "Box(x=1.0, y=3)"


def test_containers_whose_constructors_read_items_otherwise_are_written_as_logged(tmp_path):
    """A second review found a Counter rebuilt from its pairs as counts of pairs, a tuple subclass built from
    *args nested one level deeper at each rebuild, and tensors in a deque or a dict view never staged (the
    caller's refill was written)."""
    import collections

    class Args(tuple):
        def __new__(cls, *args):
            return super().__new__(cls, args)

    keep = Keep()
    logger = Logger([keep], RunInfo("r", tmp_path))
    buf = torch.tensor([1.0, 2.0])
    logger.log_samples("val", [{"counts": collections.Counter(a=2, b=3), "args": Args(1, 2),
                                "dq": collections.deque([buf[0]]), "vals": {"k": buf[1]}.values()}], step=0)
    with pytest.raises(InvalidValueError, match="a dict key is a tensor"):
        logger.log_samples("bad", [{"d": {buf[0]: 1}}], step=0)
    logger.commit(0)
    buf.fill_(-9.0)
    logger.close()
    (row,) = keep.records[0].samples["val"].rows
    assert row == {"counts": {"a": 2, "b": 3}, "args": (1, 2), "dq": [1.0], "vals": [2.0]}


def test_heatmap_ticks_that_are_not_an_ordered_list_of_labels_are_refused():
    logger = Logger([])
    for ticks in (torch.arange(3), {"a", "b", "c"}, iter("abc"), np.array(["a", "b", "c"]).reshape(1, 3)):
        with pytest.raises(InvalidValueError, match="x_ticks must be None or one label per column"):
            logger.log_heatmap("hm", torch.rand(2, 3), 0, x_ticks=ticks)
    logger.close()


class Unprintable:
    def __str__(self):
        raise RuntimeError("cannot print")

    __repr__ = __str__


@pytest.mark.parametrize("where", ["field", "nested"])
def test_a_sample_field_that_cannot_print_costs_its_table_only(tmp_path, caplog, where):
    """The backends write such a field as str(value): one whose str raised cost JSONL and the console the whole
    step, its metrics included, under a message that named neither the tag nor the field (a review)."""
    from instrument import ConsoleBackend, RunHistoryBackend

    path, history = tmp_path / "m.jsonl", RunHistoryBackend()
    logger = Logger([JsonlBackend(str(path)), ConsoleBackend(stream=io.StringIO()), history],
                    RunInfo("x", tmp_path))
    bad = Unprintable() if where == "field" else {"inner": [1, Unprintable()]}
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for step in range(3):
            logger.log_metrics({"ok": float(step)}, step=step)
            logger.log_samples("val", [{"input": "a", "score": 1.0}], step=step)
            if step == 1:
                logger.log_samples("bad", [{"input": "a", "odd": bad, "score": 0.5}], step=step)
            logger.commit(step)
        logger.close()
    records = _lines(path)
    assert [(r["step"], r["metrics"]) for r in records] == [(s, {"ok": float(s)}) for s in range(3)]
    assert all(list(r["samples"]) == ["val"] for r in records)
    assert history.series("ok")[1].tolist() == [0.0, 1.0, 2.0]
    assert logger.failures == {"samples bad": 1}
    said = [r.getMessage() for r in caplog.records]
    assert sum("dropped samples 'bad' at step 1" in m and "field 'odd' of sample 0 holds a Unprintable" in m
               and "cannot print" in m for m in said) == 1, said


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_as_a_metric_is_refused_naming_its_key(layout):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    logger = Logger([])
    for values in ({"n": nested}, {"a": 1.0, "n": nested}, {"a": torch.ones(()), "n": nested}):
        with pytest.raises(InvalidValueError, match=r"metric 'n' is a nested tensor \(of 2 tensors\)"):
            logger.log_metrics(values, step=0)
    logger.close()
