"""Validation samples: selection, console panels, TensorBoard text, W&B table, JSONL; hyperparameters."""

import io
import json
import logging
import re
import sys

import numpy as np
import pytest
import torch

import instrument
from instrument import ConsoleBackend, JsonlBackend, Logger, MissingExtraError, RunInfo, TensorBoardBackend
from instrument.backends.base import SampleTable, StepRecord
from instrument.logger.params import REDACTED, flatten_params, redact_config_text, redact_secrets
from instrument.terminal.samples import markdown_table, select_samples
from tests.conftest import event_accumulator
from tests.wandb_reader import read_run

SAMPLES = [
    {"input": f"prompt {i}", "output": f"answer {i}", "score": torch.tensor(s), "length": i}
    for i, s in enumerate([0.5, 0.9, 0.1, 0.7, 0.3, 0.0])
]


def _rows():
    return [{**s, "score": float(s["score"])} for s in SAMPLES]


def test_selection_mixes_best_and_worst():
    chosen = select_samples(_rows(), 4)
    assert [(label, row["input"]) for label, row in chosen] == [
        ("best #1", "prompt 1"),
        ("worst #1", "prompt 5"),
        ("best #2", "prompt 3"),
        ("worst #2", "prompt 2"),
    ]
    assert [label for label, _ in select_samples(_rows(), 3)] == ["best #1", "worst #1", "best #2"]
    assert len(select_samples(_rows(), 100)) == 6  # never repeats a sample
    assert select_samples(_rows(), 0) == []


def test_selection_without_scores_keeps_order():
    rows = [{"input": "a"}, {"input": "b", "score": float("nan")}, {"input": "c", "score": 1.0}]
    assert [(label, r["input"]) for label, r in select_samples(rows, 2)] == [("best #1", "c"), ("#0", "a")]


def test_logger_moves_tensor_fields_in_the_batched_transfer():
    logger = Logger([])
    logger.log_samples("val", SAMPLES, step=3)
    record = logger.commit(3)
    rows = record.samples["val"].rows
    assert rows[1] == {"input": "prompt 1", "output": "answer 1", "score": pytest.approx(0.9), "length": 1}
    assert isinstance(rows[1]["score"], float)


def test_console_prints_best_and_worst_as_panels():
    stream = io.StringIO()
    logger = Logger([ConsoleBackend(stream=stream, num_val_samples_to_print=2, width=80)])
    logger.log_metrics({"val/score": 0.4}, step=7)
    logger.log_samples("val", SAMPLES, step=7)
    logger.commit(7)
    logger.flush()
    out = stream.getvalue()
    assert "\n      7        0.4\n" in out  # the step's table row (step, val/score), then the panels
    assert "val | step 7 | best #1 | score 0.9" in out and "prompt 1" in out and "answer 1" in out
    assert "val | step 7 | worst #1 | score 0" in out and "prompt 5" in out
    assert "prompt 3" not in out  # only two panels
    assert "length" in out  # extra fields are shown too
    assert logger.failures == {}


def test_console_without_rich_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    record = StepRecord(step=0, samples={"val": SampleTable(_rows())})
    with pytest.raises(MissingExtraError, match=r"pip install 'torch-instrument\[rich\]'"):
        ConsoleBackend(stream=io.StringIO()).write(record)


def test_tensorboard_text_and_jsonl_list(tmp_path):
    logger = Logger([TensorBoardBackend(), JsonlBackend()], RunInfo("r", tmp_path))
    logger.log_samples("val/samples", SAMPLES[:2], step=5)
    logger.commit(5)
    logger.close()
    acc = event_accumulator(tmp_path / "r")
    events = acc.Tensors("val/samples/text_summary")
    assert [e.step for e in events] == [5]
    text = events[0].tensor_proto.string_val[0].decode()
    assert text == markdown_table(_rows()[:2])
    assert "| input | output | score | length |" in text
    assert "| prompt 1 | answer 1 | 0.8999999761581421 | 1 |" in text  # float32 0.9, as JSONL holds it
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["step"] == 5
    assert line["samples"]["val/samples"][1] == {
        "input": "prompt 1",
        "output": "answer 1",
        "score": pytest.approx(0.9),
        "length": 1,
    }


def test_wandb_table_and_system_metrics_on_their_own_axis(tmp_path):
    logger = Logger([instrument.WandbBackend()], RunInfo("r", tmp_path))
    logger.log_metrics({"loss": 1.0}, step=100)
    logger.commit(100)
    logger.write_system(StepRecord(step=2, scalars={"system/process_rss_gib": 0.5, "system/seconds": 2.5}))
    logger.log_samples("val", SAMPLES[:3], step=200)
    logger.commit(200)
    logger.close()
    assert logger.failures == {}
    rows, _ = read_run(tmp_path / "r")
    by_step = {row["_step"]: row for row in rows}
    assert sorted(by_step) == [100, 200]  # the system sample did not add a step
    assert by_step[200]["val"]["_type"] == "table-file" and by_step[200]["val"]["nrows"] == 3
    assert by_step[200]["system/process_rss_gib"] == 0.5 and by_step[200]["system/seconds"] == 2.5


@pytest.mark.parametrize(
    "samples, match",
    [
        ({"input": "x"}, r"log_samples\('val'\) takes a list of dicts, got dict"),
        (["x"], r"sample 0 is a str; each sample must be a dict"),
    ],
)
def test_bad_samples(samples, match):
    with pytest.raises(TypeError, match=match):
        Logger([]).log_samples("val", samples, step=0)


# ---------------------------------------------------------------------- hyperparameters
def test_flatten_and_redact():
    flat = redact_secrets(
        flatten_params(
            {
                "model": {"width": 64, "layers": [1, 2]},
                "wandb": {"api_key": "k1", "project": "p"},
                "hf_token": "t",
                "db_password": "p",
                "client_secret": "s",
                "key": "k2",
                "aws_secret_access_key": "a",
                "wandb_api_key": "w",
                "reward_key": "reward",
                "keys_to_log": ["a"],
            }
        )
    )
    assert flat == {
        "model/width": 64,
        "model/layers": "[1, 2]",
        "wandb/api_key": REDACTED,
        "wandb/project": "p",
        "hf_token": REDACTED,
        "db_password": REDACTED,
        "client_secret": REDACTED,
        "key": REDACTED,
        "aws_secret_access_key": REDACTED,
        "wandb_api_key": REDACTED,
        "reward_key": "reward",
        "keys_to_log": "['a']",
    }


def test_redact_config_text():
    text = (
        "Model.width = 64\nWandbBackend.api_key = 'abc'\nscope/Auth.token = \"xyz\"\nEnv.reward_key = 'r'\n"
    )
    assert redact_config_text(text) == (
        f"Model.width = 64\nWandbBackend.api_key = '{REDACTED}'\nscope/Auth.token = '{REDACTED}'\n"
        "Env.reward_key = 'r'\n"
    )


def test_no_backend_sees_a_secret(tmp_path):
    logger = Logger([JsonlBackend()], RunInfo("r", tmp_path))
    logger.log_hyperparams(
        {"train": {"lr": 0.1}, "hub": {"token": "hf_secret"}},
        config_text="Hub.token = 'hf_secret'\nTrain.lr = 0.1",
    )
    logger.close()
    raw = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert "hf_secret" not in raw
    line = json.loads(raw.splitlines()[0])
    assert line["hyperparameters"] == {"train/lr": 0.1, "hub/token": REDACTED}
    assert line["config"] == f"Hub.token = '{REDACTED}'\nTrain.lr = 0.1"


def test_table_cells_keep_integers_exact():
    import numpy as np

    from instrument.terminal.samples import cell

    assert cell(2**60 + 1) == 2**60 + 1 and type(cell(np.int64(7))) is int
    assert cell(10**400) == str(10**400)  # beyond int64: its digits, never a rounded float
    assert cell(float("nan")) == "nan" and cell(True) is True and cell(0.25) == 0.25
    rows = [{"input": "a", "score": 10**400}, {"input": "b", "score": 1.0}]  # no float holds that score
    assert [(label, r["input"]) for label, r in select_samples(rows, 2)] == [("best #1", "b"), ("#0", "a")]


def test_console_prints_a_sample_with_a_lone_surrogate_and_a_huge_int_score(caplog):
    pytest.importorskip("rich")
    # The console's lines also go to its logger: kept out of pytest's report, which pytest-xdist cannot send
    # with a lone surrogate in it (its worker crashed on this test).
    caplog.set_level(logging.WARNING, logger="instrument.console")
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)  # a UTF-8 terminal
    logger = Logger([ConsoleBackend(stream=stream, num_val_samples_to_print=2, width=80, legend=False)])
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_samples("val", [{"input": "caf\udce9", "score": 10**400}], step=0)
    logger.close()
    out = raw.getvalue().decode("utf-8")
    assert "caf\\udce9" in out and "1" + "0" * 20 in out  # the escaped name and the exact score
    assert logger.failures == {}


def test_markdown_table_escapes_column_names_as_it_escapes_cells():
    """A review found a field named 'P(yes|x)' split into two header cells, shifting every column after it."""
    table = markdown_table([{"P(yes|x)": 0.9, "score": 0.5, "answer": "yes"}])
    header, rule, row = table.splitlines()
    assert header == "| P(yes\\|x) | score | answer |" and row == "| 0.9 | 0.5 | yes |"
    split = [cell for cell in re.split(r"(?<!\\)\|", header)[1:-1]]
    assert len(split) == 3 == rule.count("---")


def test_a_field_with_a_carriage_return_or_a_backslash_before_a_pipe_stays_in_its_cell_in_tensorboard():
    """Rendered by TensorBoard's own Markdown (its text plugin): a \\r split the row in two (only \\n became
    <br>), and a field `p\\|q` cancelled the pipe's escape with its own backslash, shifting the columns."""
    import re

    from tensorboard import plugin_util

    rows = [{"input": "a\rb", "output": "x", "score": 1.0}, {"input": "c:\\", "output": "y|z", "score": 2.0},
            {"input": "p\\|q", "output": "w", "score": 3.0}, {"input": "l1\r\nl2", "output": "v", "score": 4.0}]
    html = plugin_util.markdown_to_safe_html(markdown_table(rows))
    body = re.findall(r"<tr>(.*?)</tr>", html, re.S)[1:]
    cells = [[re.sub(r"<[^>]+>", "|", c).strip("|") for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
             for row in body]
    assert [len(row) for row in cells] == [3, 3, 3, 3], cells
    assert [row[1] for row in cells] == ["x", "y|z", "w", "v"]
    assert cells[2][0] == "p\\|q" and cells[1][0] == "c:\\" and cells[0][0] == "a|b"


def test_tensorboard_samples_table_keeps_every_digit_of_a_float(tmp_path):
    """The table a user reads in TensorBoard holds the number JSONL, W&B and MLflow hold, not 4 digits of it."""
    logger = Logger([TensorBoardBackend(), JsonlBackend()], RunInfo("r", tmp_path))
    values = [float(np.float16(0.1)), 60000.0, 1e-300, 123456.789, float("nan")]
    logger.log_samples("val/samples", [{"input": f"p{i}", "score": v} for i, v in enumerate(values)], step=1)
    logger.commit(1)
    logger.close()
    text = event_accumulator(tmp_path / "r").Tensors("val/samples/text_summary")[0].tensor_proto.string_val[0].decode()
    cells = [line.split("|")[2].strip() for line in text.splitlines()[2:]]
    assert cells == ["0.0999755859375", "60000.0", "1e-300", "123456.789", "nan"]
    stored = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])["samples"]["val/samples"]
    assert [float(row["score"]) for row in stored[:4]] == [float(c) for c in cells[:4]]
