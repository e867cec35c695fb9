"""Adopting instrument in place: `inst.log` inside a step, and writing into a SummaryWriter or W&B run the user
already has, which instrument flushes but leaves open. Read back with TensorBoard's and W&B's own readers."""

import pytest
import torch

import instrument
from tests.conftest import read_scalars
from tests.wandb_reader import read_run


def test_log_inside_a_step_logs_at_that_step(tmp_path):
    inst = instrument.Instrumentation([], backends=[instrument.TensorBoardBackend()], log_interval=2,
                                      log_dir=str(tmp_path), run_name="r", overhead_budget=None)
    for step in range(4):
        with inst.step(step):
            inst.log({"loss": torch.tensor(float(step))}, prefix="train")
            inst.log({"batch": 8.0 * (step + 1)}, reduce="sum")
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    # Steps 0 and 2 log; step 1's value is staged and committed with step 2 as the interval's mean; close
    # commits what step 3 staged, at step 3.
    assert scalars["train/loss"] == {0: 0.0, 2: 1.5, 3: 3.0}
    assert scalars["batch"] == {0: 8.0, 2: pytest.approx((16.0 + 24.0) / 2), 3: 32.0}


def test_log_outside_a_step_says_what_to_do(tmp_path):
    inst = instrument.Instrumentation([], backends=[], log_dir=str(tmp_path))
    with pytest.raises(instrument.ConfigurationError, match=r"outside a `with inst.step\(n\):` block.*log_metrics"):
        inst.log({"loss": 1.0})
    with inst.step(0):
        pass
    with pytest.raises(instrument.ConfigurationError, match="outside"):
        inst.log({"loss": 1.0})  # the block has ended
    inst.close()


def test_log_passes_options_to_log_metrics(tmp_path):
    inst = instrument.Instrumentation([], backends=[], log_dir=str(tmp_path))
    with inst.step(0):
        with pytest.raises(instrument.ConfigurationError, match="unknown reduce op 'median'"):
            inst.log({"x": 1.0}, reduce="median")
    inst.close()


def test_external_summary_writer_is_written_and_left_open(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    writer.add_scalar("before", 1.0, 0)
    backend = instrument.TensorBoardBackend(writer=writer)
    inst = instrument.Instrumentation([], backends=[backend], log_interval=1, log_dir=str(tmp_path / "runs"),
                                      hyperparams={"lr": 0.1})
    for step in range(3):
        with inst.step(step):
            inst.log({"loss": 1.0 / (step + 1)})
    inst.close()
    assert inst.failures == {}
    writer.add_scalar("after", 2.0, 5)  # still open: the user's writer is theirs to close
    writer.flush()
    scalars = read_scalars(tmp_path / "mine")
    assert scalars["loss"] == {0: 1.0, 1: 0.5, 2: pytest.approx(1 / 3)}
    assert scalars["before"] == {0: 1.0} and scalars["after"] == {5: 2.0}
    assert not (tmp_path / "runs" / inst.run.name).exists() or not list((tmp_path / "runs").rglob("events.*"))
    writer.close()


def test_writer_and_log_dir_together_are_refused():
    from torch.utils.tensorboard import SummaryWriter

    with pytest.raises(instrument.ConfigurationError, match="both log_dir"):
        instrument.TensorBoardBackend(log_dir="x", writer=SummaryWriter)
    with pytest.raises(instrument.ConfigurationError, match="takes a torch.utils.tensorboard.SummaryWriter"):
        instrument.TensorBoardBackend(writer="runs/x")


def test_external_wandb_run_is_written_and_left_running(tmp_path):
    wandb = pytest.importorskip("wandb")
    run = wandb.init(project="adopt", dir=str(tmp_path), mode="offline", reinit="create_new",
                     settings=wandb.Settings(console="off", silent=True))
    run.log({"mine": 1.0}, step=0)
    inst = instrument.Instrumentation([], backends=[instrument.WandbBackend(run=run)], log_interval=1,
                                      log_dir=str(tmp_path / "runs"), hyperparams={"optim": {"lr": 0.1}})
    for step in range(1, 3):
        with inst.step(step):
            inst.log({"loss": float(step)})
    inst.close()
    assert inst.failures == {}
    run.log({"mine": 2.0}, step=5)  # still running: finishing it is the user's call
    run.config.update({"after": True})
    run.finish()
    rows, config = read_run(tmp_path)
    by_step = {row["_step"]: row for row in rows}
    assert by_step[0]["mine"] == 1.0 and by_step[5]["mine"] == 2.0
    assert by_step[1]["loss"] == 1.0 and by_step[2]["loss"] == 2.0
    assert config["optim"] == {"lr": 0.1} and config["after"] is True


def test_wandb_run_must_be_a_run():
    with pytest.raises(instrument.ConfigurationError, match="takes a started W&B run"):
        instrument.WandbBackend(run="my-run")
