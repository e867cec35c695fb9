"""Logged texts and string hyperparameters with control characters and odd Unicode (a NUL, ANSI escapes, a
carriage return, a newline, a lone surrogate, a bidi override, a very long string), through every backend and
read back with each destination's own reader."""

import io
import json
import re

import pytest

import instrument
from instrument import Column
from tests.conftest import event_accumulator
from tests.wandb_reader import read_run

ODD = {
    "nul": "a\x00b", "ansi": "\x1b[31mred\x1b[0m", "cr": "abc\rXYZ", "nl": "l1\nl2", "osc": "\x1b]0;title\x07",
    "c1": "a\x9bb", "del": "a\x7fb", "bidi": "ab\u202ecd", "surrogate": "caf\udce9", "long": "x" * 100_000,
}
# What may never reach a terminal raw: control characters, bidi overrides, lone surrogates
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def test_the_console_shows_logged_texts_escaped_and_keeps_its_rows_in_place(tmp_path):
    """A text in a ``str`` column, or a sample's field in a panel, reached the terminal raw: an ANSI or OSC escape
    was run by the terminal, a carriage return or a newline rewrote or split the row, a bidi override turned the
    rest of the row around. They are shown escaped now; a panel keeps a text's line breaks. Display only."""
    out = io.StringIO()
    columns = [Column(f"t/{key}", key[:8], 12, "str") for key in ODD]
    console = instrument.ConsoleBackend(columns=columns, stream=out, num_val_samples_to_print=1, width=60)
    logger = instrument.Logger([console, instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        for key, text in ODD.items():
            logger.log_text(f"t/{key}", text, step)
        sample = {"input": "\x1b[2J\x1b[31mred", "output": "line 1\nline 2\r\u202eend\x00", "score": 1.0}
        logger.log_samples("val", [sample], step)
        logger.commit(step)
    logger.close()
    lines = out.getvalue().split("\n")[:-1]
    assert not [line for line in lines if RAW.search(line)]  # nothing raw reaches the terminal
    (header,) = [line for line in lines if line.split()[:2] == ["step", "nul"]]
    rows = [line for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [len(row) for row in rows] == [len(header)] * 2  # every cell its width: no row split or cut short
    assert rows[0].split() == ["1", "a\\x00b", "\\x1b[31mred…", "abc\\rXYZ", "l1\\nl2", "\\x1b]0;titl…", "a\\x9bb",
                               "a\\x7fb", "ab\\u202ecd", "caf\\udce9", "xxxxxxxxxxx…"]
    assert sum("\\x1b[2J\\x1b[31mred" in line for line in lines) == 2  # the panels, one per step
    assert sum("line 1" in line for line in lines) == sum("line 2\\r\\u202eend\\x00" in line for line in lines) == 2
    (first, _) = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert first["texts"]["t/ansi"] == ODD["ansi"] and first["samples"]["val"][0] == sample  # stored as given


def test_odd_texts_and_hyperparameters_reach_every_store_as_given_or_escaped(tmp_path):
    """JSONL, W&B (texts as HTML, hyperparameters in run.config) and TensorBoard keep each value as it is; what
    UTF-8 cannot encode (a lone surrogate) is written escaped where the store needs UTF-8, with nothing else of the
    step lost. MLflow keeps params as they are, cut to 6000 characters."""
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    backends = [instrument.JsonlBackend(), instrument.TensorBoardBackend(), instrument.WandbBackend(project="tests"),
                instrument.MlflowBackend()]
    logger = instrument.Logger(backends, instrument.RunInfo("r", tmp_path))
    logger.log_hyperparams({f"hp/{key}": text for key, text in ODD.items()})
    for step in (1, 2):
        for key, text in ODD.items():
            logger.log_text(f"t/{key}", text, step)
        logger.log_metrics({"loss": float(step)}, step=step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}

    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_bytes().decode().splitlines()]
    (params,) = [r["hyperparameters"] for r in records if "hyperparameters" in r]
    assert params == {f"hp/{key}": text for key, text in ODD.items()}
    assert [r["texts"] for r in records if "step" in r] == [{f"t/{key}": text for key, text in ODD.items()}] * 2

    acc = event_accumulator(tmp_path / "r")
    for key, text in ODD.items():
        written = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"t/{key}/text_summary")]
        assert written == [(1, _escaped(text)), (2, _escaped(text))]

    rows, config = read_run(tmp_path / "r")
    assert [row["loss"] for row in rows] == [1.0, 2.0]
    assert config["hp"] == ODD  # nested under "hp"; JSON keeps even a lone surrogate
    html = (next((tmp_path / "r").rglob("files")) / rows[0]["t/cr"]["path"]).read_bytes().decode()
    assert html.endswith("<pre>abc\rXYZ</pre>")

    client = mlflow.tracking.MlflowClient(tracking_uri=backends[3].tracking_uri)
    stored = client.get_run(backends[3].run_id).data.params
    assert stored == {f"hp/{key}": _escaped(text)[:6000] for key, text in ODD.items()}
    assert [m.value for m in client.get_metric_history(backends[3].run_id, "loss")] == [1.0, 2.0]


def test_hebrew_and_arabic_marks_are_shown_as_written_and_overrides_escaped():
    """U+200F, U+200E and U+061C (marks that right-to-left text uses, which reorder nothing beyond their
    neighbours) stay as written in headers and texts; an override (U+202E) is escaped."""
    header = "\u05d4\u05e4\u05e1\u05d3\u200f"  # four Hebrew letters and a right-to-left mark: 4 cells
    assert Column("train/loss", header, 6, ".4f").header == header
    out = io.StringIO()
    console = instrument.ConsoleBackend(columns=[Column("t/name", "name", 16, "str")], stream=out)
    logger = instrument.Logger([console])
    logger.log_text("t/name", "\u05e9\u05dc\u05d5\u05dd\u200f \u061c!\u202e", 1)
    logger.commit(1)
    logger.close()
    row = next(line for line in out.getvalue().splitlines() if line.strip().startswith("1"))
    assert "\u05e9\u05dc\u05d5\u05dd\u200f \u061c!\\u202e" in row and "\u202e" not in row


def test_log_text_takes_a_str_and_refuses_anything_else_on_the_caller(tmp_path):
    """A review found ``log_text`` writing ``str(value)`` of whatever it got: of a tensor a host sync and a
    summary with ``...``, of an object its repr. A str (a subclass as a plain str) is written; anything else is
    refused where it is logged, saying what came and what to pass, and the step goes on."""
    import numpy as np
    import torch

    class Loud(str):
        def __str__(self) -> str:
            return "not the text"

    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    logger.log_text("t/sub", Loud("the text"), 1)
    logger.log_text("t/np", np.str_("numpy text"), 1)
    refused = {
        "tensor": (torch.arange(3.0), "got a tensor (torch.float32, shape [3], on cpu)"),
        "int": (3, "got int 3"),
        "none": (None, "got NoneType None"),
        "bytes": (b"abc", "got bytes of length 3"),
        "list": (["a"], "got a builtins.list"),
    }
    for key, (value, said) in refused.items():
        with pytest.raises(instrument.InvalidValueError, match="expected a str") as caught:
            logger.log_text(f"t/{key}", value, 1)
        assert said in str(caught.value) and f"log_text('t/{key}')" in str(caught.value)
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.commit(1)
    logger.close()
    (record,) = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert record["texts"] == {"t/sub": "the text", "t/np": "numpy text"} and record["metrics"] == {"loss": 1.0}
