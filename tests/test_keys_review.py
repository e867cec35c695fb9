"""Keys a review found hidden, replaced or garbled: TensorBoard texts and samples tables under one tag (or under
the backend's own text tags), W&B's ``operative_config``, an escaped key meeting another key, the wording of a
step committed twice, control characters in names shown as text. Read back with each destination's own reader."""

import io
import logging
import re

import pytest

import instrument
from instrument.backends.base import StepRecord
from tests.conftest import event_accumulator, read_scalars
from tests.wandb_reader import read_run


def _texts(acc):
    """TensorBoard's text tags -> [(step, text)], read with its own EventAccumulator."""
    return {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}


def test_tensorboard_keeps_a_text_and_a_samples_table_of_one_key_apart(tmp_path, caplog):
    """Both were written as the tag ``val/text_summary``: the event file held two texts per step, and TensorBoard's
    UI showed only the table. The table now moves to ``val/table`` (as W&B moves it), with one warning."""
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        logger.log_metrics({"note/text_summary": float(step)}, step=step)  # a scalar under a text's tag, first
        logger.log_text("note", f"note {step}", step)
        logger.log_text("val", f"summary {step}", step)
        logger.log_samples("val", [{"input": "q", "output": "a", "score": float(step)}], step)
        logger.commit(step)
    logger.close()
    acc = event_accumulator(tmp_path / "r")
    texts = _texts(acc)
    assert texts["val/text_summary"] == [(1, "summary 1"), (2, "summary 2")]  # one text per step and tag
    assert [step for step, _ in texts["val/table/text_summary"]] == [1, 2]
    assert all(text.startswith("| input | output | score |") for _, text in texts["val/table/text_summary"])
    assert texts["note/text/text_summary"] == [(1, "note 1"), (2, "note 2")]  # the scalar took the tag first
    assert {e.step: e.value for e in acc.Scalars("note/text_summary")} == {1: 1.0, 2: 2.0}
    assert "note/text_summary" not in texts  # no tag holds two kinds
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "TensorBoardBackend writes"
            in r.getMessage()]
    assert len(said) == 2  # once per moved key
    assert any("samples table 'val' under the tag 'val/table/text_summary'" in m for m in said)


def test_a_users_text_never_hides_the_tensorboard_backends_own_texts(tmp_path, caplog):
    """A user's ``log_text("hyperparameters", ..., 0)`` shared tag and step with the hyperparameter table, and
    TensorBoard's UI showed only the user's text; ``config/operative`` alike. The user's text moves."""
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("r", tmp_path))
    logger.log_hyperparams({"lr": 0.001}, config_text="train.lr = 0.001")
    logger.log_text("hyperparameters", "my notes", 0)
    logger.log_samples("config/operative", [{"input": "q", "score": 1.0}], 0)
    logger.commit(0)
    logger.log_text("hyperparameters", "more notes", 3)  # a later step would mix two series in the tag
    logger.commit(3)
    logger.close()
    texts = _texts(event_accumulator(tmp_path / "r"))
    ((step, table),) = texts["hyperparameters/text_summary"]
    assert step == 0 and table.startswith("| where | parameter | value |") and "| lr | 0.001 |" in table
    assert texts["config/operative/text_summary"] == [(0, "    train.lr = 0.001")]
    assert texts["hyperparameters/text/text_summary"] == [(0, "my notes"), (3, "more notes")]
    assert [step for step, _ in texts["config/operative/table/text_summary"]] == [0]
    said = [r.getMessage() for r in caplog.records if "TensorBoardBackend writes" in r.getMessage()]
    assert len(said) == 2 and any("its hyperparameter table" in m for m in said)


def test_wandb_keeps_a_hyperparameter_named_operative_config_beside_the_config_text(tmp_path, caplog):
    """W&B's ``run.config["operative_config"]`` holds the gin config text, which silently replaced a hyperparameter
    of that name (JSONL, MLflow and TensorBoard kept it). The hyperparameter now goes to ``operative_config__2``."""
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_hyperparams({"operative_config": "mine", "operative_config__2": 2, "lr": 0.1},
                           config_text="Model.depth = 3\n")
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.commit(1)
    logger.close()
    _, config = read_run(tmp_path / "w")
    assert config["operative_config"] == "Model.depth = 3\n"
    assert (config["operative_config__3"], config["operative_config__2"], config["lr"]) == ("mine", 2, 0.1)
    said = [r.getMessage() for r in caplog.records if "operative gin config text" in r.getMessage()]
    assert len(said) == 1 and "'operative_config' as 'operative_config__3'" in said[0]


def test_wandb_keeps_hyperparameters_starting_with_an_underscore_under_user(tmp_path, caplog):
    """W&B keeps the top-level config keys starting with "_" for itself: a hyperparameter named ``_wandb`` replaced
    W&B's own metadata there, and the UI hides the others. They go under ``user/``, as such metrics do."""
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.WandbBackend(project="tests")], instrument.RunInfo("w", tmp_path))
    logger.log_hyperparams({"_wandb": 5, "_lr": 0.1, "user/_lr": 0.2, "lr": 0.3, "/_x": 6, "._y": 7})
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.commit(1)
    logger.close()
    _, config = read_run(tmp_path / "w")
    assert config["user"]["_wandb"] == 5 and config["user"]["_lr"] == 0.1 and config["lr"] == 0.3
    assert config["user"]["user"]["_lr"] == 0.2  # a key already under user/ moves one level further: never merged
    assert "_lr" not in config and config.get("_wandb") != 5
    # empty parts go when the names nest: "/_x" and "._y" were top-level "_x" and "_y" (a review)
    assert config["user"]["_x"] == 6 and config["user"]["_y"] == 7 and "_x" not in config and "_y" not in config
    said = [r.getMessage() for r in caplog.records if "keys starting with '_'" in r.getMessage()]
    assert len(said) == 1 and "'_wandb'" in said[0]


RAW, PRINTED = "files/caf\udce9", "files/caf\\udce9"  # os.fsdecode(b"caf\xe9") and that name as repr prints it


def test_an_escaped_key_never_takes_the_name_of_another_key(tmp_path, caplog):
    """TensorBoard and W&B write a key with a lone surrogate escaped; a second key that already was that text
    (in the same step) lost its value to it, unsaid. The escaped name is now numbered, the same at every step;
    a key logged later under a name an escaped key took is numbered in turn. JSONL keeps every key as it is."""
    pytest.importorskip("wandb")
    logger = instrument.Logger([instrument.TensorBoardBackend(), instrument.WandbBackend(project="tests")],
                               instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        logger.log_metrics({RAW: 1.0 * step, PRINTED: 2.0 * step, "loss": 0.5}, step=step)
        logger.commit(step)
    logger.log_metrics({"b/\udce9": 3.0, "loss": 0.5}, step=3)  # escaped first, to a name no key had
    logger.commit(3)
    logger.log_metrics({"b/\\udce9": 4.0, "loss": 0.5}, step=4)  # then a key under that very name
    logger.commit(4)
    logger.close()
    assert logger.failures == {}
    expected = {PRINTED + "__2": {1: 1.0, 2: 2.0}, PRINTED: {1: 2.0, 2: 4.0}, "b/\\udce9": {3: 3.0},
                "b/\\udce9__2": {4: 4.0}, "loss": {s: 0.5 for s in (1, 2, 3, 4)}}
    assert read_scalars(tmp_path / "r") == expected
    series: dict = {}
    for row in read_run(tmp_path / "r")[0]:
        for key, value in row.items():
            if not key.startswith("_"):
                series.setdefault(key, {})[row["_step"]] = value
    assert series == expected
    said = [r.getMessage() for r in caplog.records if "wrote the scalar" in r.getMessage()]
    assert len(said) == 6  # once per backend and key: the two escaped keys and the later literal one
    assert any(f"TensorBoardBackend wrote the scalar {RAW!r} as {PRINTED + '__2'!r}" in m and
               f"{PRINTED!r} is already the name of another key" in m for m in said)


def test_the_warning_of_a_step_committed_twice_says_what_tensorboard_shows(tmp_path, caplog):
    """The warning said TensorBoard keeps both records: its event file does, but TensorBoard's UI (its data
    server) shows the last value written for a tag and step."""
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("r", tmp_path))
    logger.log_metrics({"eval/acc": 0.25}, step=20, commit=True)
    logger.log_metrics({"eval/acc": 0.75}, step=20)
    logger.commit(20)
    logger.close()
    events = event_accumulator(tmp_path / "r").Scalars("eval/acc")
    assert [(e.step, e.value) for e in events] == [(20, 0.25), (20, 0.75)]  # the event file holds both
    (said,) = [r.getMessage() for r in caplog.records if "committed a second time" in r.getMessage()]
    assert "TensorBoard's event file holds both but its UI shows only the last one written for a step" in said
    assert "TensorBoard, MLflow and JSONL keep" not in said and "W&B keeps only the first" in said



def test_the_warning_of_a_step_committed_twice_names_each_key_once_and_the_users_first(tmp_path, caplog):
    """The warning listed a key once per call that staged it (``['...', 'x', 'x']``) and filled its sample of
    five with the session's own ``instrument/overhead/*`` keys, sorted before the user's."""
    import ast
    import json

    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=2, log_dir=str(tmp_path),
                                      run_name="rep")
    for step in range(3):
        with inst.step(step):
            inst.logger.log_metrics({"x": 1.0, "y": 2.0}, step=step)
            if step == 2:
                inst.logger.log_metrics({"ev": 1.0}, step=step, commit=True)  # the block then commits step 2 again
    inst.close()
    lines = [json.loads(line) for line in (tmp_path / "rep" / "metrics.jsonl").read_text().splitlines()]
    again = [sorted(line["metrics"]) for line in lines if line.get("step") == 2][1]
    assert {"x", "y", "instrument/overhead/fraction"} <= set(again)  # the record whose keys the warning names
    (said,) = [r.getMessage() for r in caplog.records if "committed a second time" in r.getMessage()]
    named = re.search(r"\(keys (\[.*?\])( and (\d+) more)?\)", said)
    keys = ast.literal_eval(named.group(1))
    assert keys[:2] == ["x", "y"]  # the user's keys first, each once
    assert len(keys) == len(set(keys)) == min(5, len(again))
    assert int(named.group(3) or 0) == len(again) - len(keys)

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
ODD = ["k\nl", "m\x1bn", "a\rb", "z\x00", "t\tu"]


def test_the_console_shows_control_characters_in_names_escaped(tmp_path):
    """A metric key with a newline split the console table's header and legend; an escape, a carriage return or
    NUL was written raw to the terminal. Names are now shown escaped; the keys themselves do not change."""
    out = io.StringIO()
    console = instrument.ConsoleBackend(stream=out, max_keys=10, show_system=True, num_val_samples_to_print=1,
                                        width=60)
    history = instrument.RunHistoryBackend()
    logger = instrument.Logger([console, history], instrument.RunInfo("r", tmp_path))
    for step in (1, 2):
        logger.log_metrics({**{key: float(step) for key in ODD}, "timing/x\ny": 0.5}, step=step)
        logger.log_samples("val\x1b[2J", [{"in\nput": "a", "score": 1.0}], step)
        logger.commit(step)
    logger.write_system(StepRecord(1, {"system/gpu\r0": 1.0, "system/seconds": 1.0}))
    logger.close()
    lines = out.getvalue().split("\n")[:-1]
    assert not [line for line in lines if CONTROL.search(line)]  # nothing raw reaches the terminal
    (header,) = [line for line in lines if line.split()[:2] == ["step", "k\\nl"]]
    assert header.split() == ["step", "k\\nl", "m\\x1bn", "a\\rb", "z\\x00", "t\\tu"]
    rows = [line for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [len(row) for row in rows] == [len(header)] * 2 and rows[1].split() == ["2"] + ["2"] * len(ODD)
    assert all(any(line.split()[:2] == [shown, shown] for line in lines)  # the legend: header, key
               for shown in ("k\\nl", "m\\x1bn", "a\\rb", "z\\x00", "t\\tu"))
    assert any(line.startswith("timing/x\\ny ") for line in lines)  # the summary at close
    assert any("system/gpu\\r0 1" in line for line in lines)
    assert any("val\\x1b[2J | step 1" in line for line in lines) and any("in\\nput" in line for line in lines)
    assert set(ODD) <= set(history.keys())  # stored as given


def test_the_tensorboard_hyperparameter_table_escapes_names_as_it_escapes_values(tmp_path):
    """A name's ``|`` made a cell of its own and a newline broke the table; the HParams plugin keeps the names."""
    logger = instrument.Logger([instrument.TensorBoardBackend()], instrument.RunInfo("r", tmp_path))
    logger.log_hyperparams({"loss|weight": 0.5, "note\nx": 1, "lr": 0.001, "opt/a\r\nb|c": "v|w\nz"})
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.commit(1)
    logger.close()
    acc = event_accumulator(tmp_path / "r")
    table = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    rows = table.split("\n")
    assert len(rows) == 2 + 4 and all(len(re.findall(r"(?<!\\)\|", row)) == 4 for row in rows)  # 3 cells each
    assert {"|  | loss\\|weight | 0.5 |", "|  | note x | 1 |", "| opt | a b\\|c | v\\|w z |"} <= set(rows)
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    content = acc.PluginTagToContent("hparams")[metadata.SESSION_START_INFO_TAG]
    names = set(plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams)
    assert names == {"loss|weight", "note\nx", "lr", "opt/a\r\nb|c"}
