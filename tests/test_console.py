"""ConsoleBackend: declared and inferred tables, summary, and rows that stay intact under a tqdm bar."""

import io
import logging
import re

import pytest
import torch
from tqdm import tqdm

import instrument
from instrument import Column, ConsoleBackend, RunInfo, StepRecord
from instrument.errors import ConfigurationError
from instrument.terminal.output import write_line
from tests.conftest import tqdm_bar_active

COLUMNS = [
    Column("train/loss", "loss↓", 8, ".4f", "training loss"),
    {
        "key": "eval/solved",
        "header": "solved↑",
        "width": 7,
        "fmt": "frac",
        "denominator": "eval/episodes",
        "description": "episodes solved / run",
    },
    {"key": "env/{}/alive", "header": "alive_{}", "width": 8, "fmt": ".1%", "each": ["a", "b"]},
]


def _records():
    return [
        StepRecord(
            0,
            {
                "train/loss": 0.5,
                "eval/solved": 3.0,
                "eval/episodes": 8.0,
                "env/a/alive": 0.25,
            },
            timings={"rollout": {"mean": 0.01}},  # a timer's statistics travel as timings (`Logger.timer`)
        ),
        StepRecord(10, {"train/loss": 0.25}, timings={"rollout": {"mean": 0.03}}),
        StepRecord(20, {"eval/solved": 8.0, "eval/episodes": 8.0, "env/b/alive": 1.0}),
        StepRecord(30, texts={"notes": "a commit with nothing for the table prints no row"}),
    ]


def test_declared_columns_golden_output_with_legend_headers_and_summary():
    out = io.StringIO()
    backend = ConsoleBackend(columns=COLUMNS, header_every=2, stream=out)
    backend.open(RunInfo("golden"))
    for record in _records():
        backend.write(record)
    backend.close()
    assert out.getvalue().splitlines() == [
        "columns:",
        "  step     step                         training step",
        "  loss↓    train/loss                   training loss",
        "  solved↑  eval/solved / eval/episodes  episodes solved / run",
        "  alive_a  env/a/alive",
        "  alive_b  env/b/alive",
        "  (↑ higher is better, ↓ lower is better)",
        "  (nan: no value this step; ?: a value of the wrong type (see the log))",
        "  (numbers too wide for a column are shown as 1.2e5)",
        "   step     loss↓  solved↑   alive_a   alive_b",
        "      0    0.5000      3/8     25.0%       nan",
        "     10    0.2500      nan       nan       nan",
        "   step     loss↓  solved↑   alive_a   alive_b",
        "     20       nan      8/8       nan    100.0%",
        "summary of metrics kept out of the table (timing/):",
        "metric                     last        mean         min         max  steps",
        "timing/rollout/mean        0.03        0.02        0.01        0.03      2",
    ]


@pytest.mark.parametrize("run_log", [False, True])
def test_no_columns_builds_the_table_from_the_first_step_and_says_so_once(run_log, caplog):
    """It names where the metrics it leaves out are: the run log (DEBUG lines) only when one records them."""
    if run_log:
        caplog.set_level(logging.DEBUG, logger="instrument.console")
    out = io.StringIO()
    backend = ConsoleBackend(max_keys=3, stream=out)
    backend.open(RunInfo("auto"))
    assert out.getvalue() == ""  # nothing to show before the first step
    first = {
        "train/loss": 0.5,
        "iteration_stats/mean/c0": 0.1,
        "update_norm/l2/mean": 1.0,
        "counters/frames": 256.0,
    }
    timings = {"rollout": {"mean": 0.01}}  # kept out of the table: a summary prefix
    backend.write(StepRecord(0, first, timings=timings))
    backend.write(
        StepRecord(10, {**first, "train/loss": 0.25, "update_norm/l2/mean": 12345.5, "new/metric": 1.0},
                   timings=timings)
    )
    lines = out.getvalue().splitlines()
    where = "are in the run log" if run_log else (
        "are left out here; Instrumentation.run_log = True keeps every scalar in the run log")
    assert lines[0] == (
        f"console: no columns declared; showing 3 metrics from step 0 (1 more {where}). "
        "Bind ConsoleBackend.columns to choose them."
    )
    assert sum("no columns declared" in line for line in lines) == 1
    assert lines[-3:] == [
        "   step       loss    mean/c0    l2/mean",
        "      0        0.5        0.1          1",
        "     10       0.25        0.1  1.235e+04",
    ]


def test_a_first_step_with_only_timings_does_not_fix_an_empty_inferred_table():
    """A timed warm-up committed before any metric built a table of no columns: no row showed all run."""
    out = io.StringIO()
    backend = ConsoleBackend(legend=False, stream=out)
    backend.open(RunInfo("warm"))
    backend.write(StepRecord(0, timings={"warmup": {"mean": 0.01}}))
    assert out.getvalue() == ""
    for step in (1, 2):
        metrics = {"train/loss": 1.0 / step, "train/acc": 0.5}
        backend.write(StepRecord(step, metrics, timings={"warmup": {"mean": 0.01}}))
    backend.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("console: no columns declared; showing 2 metrics from step 1")
    assert lines[1:4] == [
        "   step       loss        acc",
        "      1          1        0.5",
        "      2        0.5        0.5",
    ]
    assert any(line.startswith("timing/warmup/mean") for line in lines)  # still summarised at the end


def test_keys_choose_and_order_the_inferred_table():
    out = io.StringIO()
    backend = ConsoleBackend(keys=["update_norm", "train/loss"], legend=False, stream=out)
    backend.write(
        StepRecord(0, {"train/loss": 0.5, "x": 1.0, "update_norm/l2/mean": 2.0, "update_norm/alive": 0.5})
    )
    assert out.getvalue().splitlines()[1:] == [
        "   step    l2/mean      alive       loss",
        "      0          2        0.5        0.5",
    ]


def test_bad_column_fails_at_construction_before_training():
    with pytest.raises(ConfigurationError, match=r"Column 'train/loss': fmt 'banana' is not a number format"):
        ConsoleBackend(columns=[("train/loss", "loss", 8, "banana")])


def test_wrong_type_for_a_column_is_reported_once_and_training_goes_on(caplog):
    out = io.StringIO()
    backend = ConsoleBackend(columns=[Column("eval/mode", "mode", 6, "d")], legend=False, stream=out)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        backend.write(StepRecord(0, texts={"eval/mode": "greedy"}))
        backend.write(StepRecord(1, texts={"eval/mode": "greedy"}))
    assert out.getvalue().splitlines()[1:] == ["      0       ?", "      1       ?"]
    assert [r.getMessage()[:48] for r in caplog.records] == [
        "instrument: column 'mode' (key 'eval/mode', form"
    ]


def test_console_in_a_real_session_shows_rows_and_the_timing_summary():
    out = io.StringIO()
    inst = instrument.Instrumentation(
        backends=[
            ConsoleBackend(columns=[Column("train/loss", "loss↓", 9, ".4f", "training loss")], stream=out)
        ],
        log_interval=2,
        run_name="session",
    )
    for step in range(5):
        with inst.step(step):
            with inst.logger.timer("work"):
                loss = torch.tensor(1.0 / (step + 1))
            inst.logger.log_metrics({"loss": loss}, step=step, prefix="train")
    inst.close()
    lines = out.getvalue().splitlines()
    # Steps 0, 2, 4 commit; the loss logged on the other steps is averaged into the next commit.
    assert lines[lines.index("   step      loss↓") + 1 :][:3] == [
        "      0     1.0000",
        "      2     0.4167",
        "      4     0.2250",
    ]
    summary = lines[lines.index("summary of metrics kept out of the table (timing/):") + 2 :]
    assert [line.split()[0] for line in summary] == [
        "timing/work/count",
        "timing/work/max",
        "timing/work/mean",
        "timing/work/min",
    ]
    assert summary[0].split()[1:] == ["2", "1.667", "1", "2", "3"]  # counts 1, 2, 2 over three commits


# ------------------------------------------------------------------------------------------------ tqdm
def _segments(text: str):
    return set(re.split(r"[\r\n]", text))


def test_rows_stay_intact_while_a_tqdm_bar_is_active():
    out = io.StringIO()
    backend = ConsoleBackend(columns=COLUMNS, legend=False, stream=out)
    table_rows = []
    with tqdm(total=40, file=out, mininterval=0, ascii=True, desc="train") as bar:
        assert tqdm_bar_active()
        for step in range(0, 40, 10):
            bar.update(10)
            backend.write(StepRecord(step, {"train/loss": 1.0 / (step + 1), "env/a/alive": 0.5}))
            table_rows.append(
                backend.table.row({"step": step, "train/loss": 1.0 / (step + 1), "env/a/alive": 0.5})
            )
    assert not tqdm_bar_active()
    segments = _segments(out.getvalue())
    assert backend.table.header() in segments
    for row in table_rows:
        assert row in segments, f"row {row!r} was broken by the bar"
    # The same rows written with a plain write land inside the bar's line: what write_line prevents.
    raw = io.StringIO()
    with tqdm(total=2, file=raw, mininterval=0, ascii=True) as bar:
        bar.update(1)
        raw.write(table_rows[0] + "\n")
    assert table_rows[0] not in _segments(raw.getvalue())


def test_write_line_without_tqdm_bar_is_a_plain_line():
    out = io.StringIO()
    write_line("step 1", out)
    assert out.getvalue() == "step 1\n"


# ------------------------------------------------------------------------------------------------ gin
def test_columns_and_run_log_bound_in_gin(tmp_path):
    import gin

    from instrument import config

    (tmp_path / "table.gin").write_text(
        "EVAL_MODES = ('det', 'sto')\n"
        "loss/Column.key = 'train/loss'\n"
        "loss/Column.header = 'loss↓'\n"
        "loss/Column.fmt = '.3f'\n"
        "ConsoleBackend.columns = [\n"
        "    @loss/Column(),\n"
        "    ('train/lr', 'lr', 8, '.1e', 'learning rate'),\n"
        "    {'key': 'eval/{}/return', 'header': '{}↑', 'width': 6, 'fmt': '.1f', 'each': %EVAL_MODES},\n"
        "    {'key': 'train/kl', 'when': False},\n"
        "]\n"
        "ConsoleBackend.legend = False\n"
        "Instrumentation.backends = [@ConsoleBackend()]\n"
        "Instrumentation.log_interval = 1\n"
        "Instrumentation.run_log = @setup_run_logging\n"
        "setup_run_logging.level = 'WARNING'\n",
        encoding="utf-8",
    )
    config.parse([str(tmp_path / "table.gin")])
    inst = instrument.Instrumentation(run_name="gin", log_dir=str(tmp_path))
    console = inst.logger.backends[0]
    out = io.StringIO()
    console.stream = out
    with inst.step(0):
        inst.logger.log_metrics({"loss": 0.5, "lr": 3e-4}, step=0, prefix="train")
        inst.logger.log_metrics({"return": 12.0}, step=0, prefix="eval/sto")
    assert inst.run_log.terminal.level == logging.WARNING
    inst.close()
    assert out.getvalue().splitlines() == [
        "   step     loss↓        lr    det↑    sto↑",
        "      0     0.500   3.0e-04     nan    12.0",
    ]
    log_file = inst.run_log.path
    assert log_file.parent == tmp_path / "gin" and "0.500   3.0e-04" in log_file.read_text(encoding="utf-8")
    assert gin.query_parameter("setup_run_logging.level") == "WARNING"


def test_system_lines_and_sample_panels_take_the_same_route_as_rows():
    out = io.StringIO()
    backend = ConsoleBackend(legend=False, stream=out, show_system=True, num_val_samples_to_print=1, width=60)
    backend.write_system(StepRecord(12, {"system/cpu_percent": 50.0, "system/seconds": 12.0}))
    samples = instrument.backends.base.SampleTable([{"input": "a", "output": "b", "score": 1.0}])
    with tqdm(total=2, file=out, mininterval=0, ascii=True) as bar:
        bar.update(1)
        backend.write(StepRecord(3, {"val/score": 1.0}, samples={"val": samples}))
    segments = _segments(out.getvalue())
    assert "system     12s | system/cpu_percent 50" in segments
    assert "      3          1" in segments
    panel = [s for s in segments if s.startswith("╭─ val | step 3 | best #1")]
    assert len(panel) == 1 and len(panel[0]) == 60


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"header_every": -1}, "header_every must be an int >= 0 (0: the header once), got -1"),
        ({"header_every": 2.5}, "header_every must be an int >= 0"),
        ({"stream": "stderr"}, "stream must be None (sys.stdout when a line is written) or a text stream"),
        ({"keys": "train/loss"}, "keys must be a list of metric keys or prefixes, got the string 'train/loss'"),
        ({"summary": "timing/"}, "summary must be a list of metric keys or prefixes, got the string 'timing/'"),
        ({"keys": ["train/", 3]}, "keys must be a list of non-empty metric keys"),
        ({"columns": "train/loss"}, "columns must be a list of columns, got 'train/loss'"),
        ({"num_val_samples_to_print": -1}, "num_val_samples_to_print must be an int >= 0"),
        ({"legend": "yes"}, "legend must be True or False"),
    ],
)
def test_every_argument_is_checked_when_the_backend_is_built_with_inferred_columns(kwargs, said):
    # Inferred columns (columns=None) build the table at the first write, on the logger's writer thread: a bad
    # argument found there left the run without a table. It is refused here, before training.
    with pytest.raises(ConfigurationError, match=re.escape(said)):
        ConsoleBackend(**kwargs)


def test_a_bad_console_argument_bound_in_gin_stops_the_run_before_training(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    (tmp_path / "inferred.gin").write_text("include 'nca.gin'\nConsoleBackend.columns = None\n"
                                           "ConsoleBackend.header_every = -1\ntrain_nca.steps = 2\n")
    out = subprocess.run([sys.executable, "-m", "instrument", "run", "inferred.gin"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stderr
    assert "header_every must be an int >= 0" in out.stderr and "inferred.gin, line 3" in out.stderr
    assert not list(tmp_path.rglob("*.jsonl"))  # nothing trained


def test_the_summary_mean_of_finite_values_near_float64s_limit_is_finite_and_exact():
    from fractions import Fraction

    out = io.StringIO()
    backend = ConsoleBackend(legend=False, stream=out, summary=["s/"])
    values = [1e308, 1e308, -5e307, 1e308, 3.0]  # their running sum leaves float64's range and comes back
    for step, value in enumerate(values):
        backend.write(StepRecord(step, {"loss": 0.0, "s/v": value}))
    backend.close()
    row = [line.split() for line in out.getvalue().splitlines() if line.startswith("s/v")]
    expected = float(sum(Fraction(v) for v in values) / len(values))  # the float64 of the exact mean
    assert row == [["s/v", "3", f"{expected:.5g}", "-5e+307", "1e+308", "5"]]


def test_sample_panels_keep_their_text_on_a_terminal_that_reports_no_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "0")  # a pipe or a CI runner can say so; the panels were drawn empty
    out = io.StringIO()
    backend = ConsoleBackend(legend=False, stream=out, num_val_samples_to_print=1)
    samples = instrument.backends.base.SampleTable([{"input": "the prompt", "score": 1.0}])
    backend.write(StepRecord(3, {"val/score": 1.0}, samples={"val": samples}))
    panel = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert any("input" in line and "the" in line for line in panel), out.getvalue()
    assert min(map(len, panel)) >= 20
