"""Right numbers at the right step: layouts, values at their own step, whole-rollout modules, failed steps,
edge values. Every number is checked against a float64 NumPy reference read back from the files a user opens."""

import json
import logging
import time

import numpy as np
import pytest
import torch
from torch import nn

import instrument
from instrument import IterationStats, UpdateNorm
from tests.conftest import read_scalars

ITERATIONS = 3


class Grow(nn.Module):
    """One iteration of a channels-first or channels-last 'NCA': a fixed, deterministic update."""

    def __init__(self, channel_dim: int) -> None:
        super().__init__()
        self.channel_dim = channel_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.02 * torch.sin(3.0 * x)


def _states(channels_last: bool, shape=(2, 5, 8, 8), seed: int = 0) -> torch.Tensor:
    """A [B, C, H, W] state with ~15% alive cells (alpha, channel 3, > 0.1), laid out as asked."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * 0.2 - 0.1
    alive = torch.rand((shape[0], shape[2], shape[3]), generator=g) < 0.17
    x[:, 3] = torch.where(alive, 0.5 + 0.5 * torch.rand(alive.shape, generator=g), x[:, 3] * 0.5)
    return x.permute(0, 2, 3, 1).contiguous() if channels_last else x


def _reference(x0: torch.Tensor, channels_last: bool):
    """float64 NumPy: per-iteration L2 norms (batch mean), alive fractions, last-iteration channel means/stds."""
    rule = Grow(0)
    x = x0.clone()
    norms, alive = [], []
    for _ in range(ITERATIONS):
        nxt = rule(x)
        dx = (nxt - x).double().numpy()
        norms.append(np.mean(np.sqrt((dx.reshape(dx.shape[0], -1) ** 2).sum(1))))
        state = nxt.double().numpy()
        nchw = state.transpose(0, 3, 1, 2) if channels_last else state
        alive.append(np.mean(nchw[:, 3] > 0.1))
        x = nxt
    nchw = x.double().numpy()
    nchw = nchw.transpose(0, 3, 1, 2) if channels_last else nchw
    per_channel = nchw.transpose(1, 0, 2, 3).reshape(nchw.shape[1], -1)
    return np.array(norms), np.array(alive), per_channel.mean(1), per_channel.std(1)  # population std


def _run(tmp_path, x0, observers, name, **session):
    rule = Grow(0)
    inst = instrument.Instrumentation(
        observers=observers, backends=[instrument.TensorBoardBackend()], log_interval=1, run_name=name,
        log_dir=str(tmp_path), **session,
    )
    inst.watch(rule)
    with inst.step(0):
        x = x0
        for _ in range(ITERATIONS):
            x = rule(x)
    inst.close()
    return read_scalars(tmp_path / name)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("how", ["session", "observer", "inferred"])
def test_both_layouts_match_a_float64_reference(tmp_path, channels_last, how):
    x0 = _states(channels_last)
    dim = -1 if channels_last else 1
    own = {"channel_dim": dim} if how == "observer" else {}
    session = {"channel_dim": dim} if how == "session" else {}
    stats = IterationStats(images=False, **own) if how != "inferred" else IterationStats(images=False, channel_dim=dim)
    scalars = _run(tmp_path, x0, [UpdateNorm(**own), stats], "r", **session)
    norms, alive, means, stds = _reference(x0, channels_last)
    assert 0.1 < alive[-1] < 0.3  # the case of the report: a real alive fraction, not 0.0
    assert scalars["update_norm/alive/last"][0] == pytest.approx(alive[-1], rel=1e-6)
    assert scalars["update_norm/alive/mean"][0] == pytest.approx(alive.mean(), rel=1e-6)
    assert scalars["update_norm/l2/mean"][0] == pytest.approx(norms.mean(), rel=1e-5)
    assert scalars["update_norm/l2/first"][0] == pytest.approx(norms[0], rel=1e-5)
    assert scalars["iteration_stats/iterations"][0] == ITERATIONS
    for c in range(5):
        assert scalars[f"iteration_stats/mean/c{c}"][0] == pytest.approx(means[c], rel=1e-5, abs=1e-7)
        assert scalars[f"iteration_stats/std/c{c}"][0] == pytest.approx(stds[c], rel=1e-5)


def test_observer_channel_dim_wins_over_the_session(tmp_path):
    x0 = _states(channels_last=False)
    norm = UpdateNorm(channel_dim=1)
    scalars = _run(tmp_path, x0, [norm], "r", channel_dim=-1)
    _, alive, _, _ = _reference(x0, channels_last=False)
    assert scalars["update_norm/alive/last"][0] == pytest.approx(alive[-1], rel=1e-6)
    assert norm.session_channel_dim == -1


def test_an_ambiguous_shape_warns_once_and_logs_no_alive_fraction(tmp_path, caplog):
    x0 = _states(channels_last=False, shape=(2, 8, 8, 8))
    stats = IterationStats(images=False)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        inst = instrument.Instrumentation(
            observers=[UpdateNorm(), stats], backends=[instrument.TensorBoardBackend()], log_interval=1,
            run_name="r", log_dir=str(tmp_path),
        )
        rule = Grow(0)
        inst.watch(rule)
        for step in range(2):
            with inst.step(step):
                rule(rule(x0))
        inst.close()
    warnings = [r for r in caplog.records if "ambiguous" in r.getMessage()]
    assert len(warnings) == 1 and "[2, 8, 8, 8]" in warnings[0].getMessage()
    assert "channel_dim=-1" in warnings[0].getMessage()
    scalars = read_scalars(tmp_path / "r")
    assert "update_norm/alive/last" not in scalars and set(scalars["update_norm/l2/mean"]) == {0, 1}


def test_a_channels_last_state_under_the_default_is_said(caplog):
    stats = IterationStats(images=False)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for _ in range(2):
            stats.reset()
            stats.observe(instrument.StepContext(torch.zeros(2, 8, 8, 5), torch.ones(2, 8, 8, 5)))
    assert len([r for r in caplog.records if "looks channels-last" in r.getMessage()]) == 1


def test_a_bad_channel_dim_is_refused():
    with pytest.raises(instrument.ConfigurationError, match="channel_dim must be an int"):
        instrument.Instrumentation(backends=[], channel_dim="last")
    norm = UpdateNorm(channel_dim=0)
    with pytest.raises(instrument.ConfigurationError, match="channel_dim=0"):
        norm.observe(instrument.StepContext(torch.zeros(2, 5, 4, 4), torch.ones(2, 5, 4, 4)))


# ---------------------------------------------------------------------------------------------------- commit=True
def test_commit_true_writes_at_its_own_step_and_leaves_the_interval_alone(tmp_path):
    inst = instrument.Instrumentation(
        backends=[instrument.TensorBoardBackend(), instrument.JsonlBackend()], log_interval=10, run_name="r",
        log_dir=str(tmp_path),
    )
    losses = {}
    for step in range(21):
        with inst.step(step):
            losses[step] = 1.0 / (step + 1)
            inst.logger.log_metrics({"loss": losses[step]}, step=step, prefix="train")
            if step == 15:
                record = inst.logger.log_metrics({"return": 7.5}, step=15, prefix="eval", commit=True)
                assert record.step == 15
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    assert scalars["eval/return"] == {15: 7.5}
    assert scalars["train/loss"][20] == pytest.approx(np.mean([losses[s] for s in range(11, 21)]), rel=1e-6)
    assert scalars["train/loss"][10] == pytest.approx(np.mean([losses[s] for s in range(1, 11)]), rel=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["metrics"]) for row in rows if "eval/return" in row["metrics"]] == [
        (15, {"eval/return": 7.5})
    ]


def test_commit_true_in_wandb_offline_is_a_row_at_its_step(tmp_path):
    pytest.importorskip("wandb")
    from tests.wandb_reader import read_run

    logger = instrument.Logger([instrument.WandbBackend(dir=str(tmp_path / "wb"))], instrument.RunInfo("w", tmp_path))
    for step in range(11, 21):
        logger.log_metrics({"loss": float(step)}, step=step)
        if step == 15:
            logger.log_metrics({"eval/return": 3.0}, step=15, commit=True)
    logger.commit(20)
    logger.close()
    rows, _ = read_run(tmp_path / "wb")
    by_step = {row["_step"]: row for row in rows if "_step" in row}
    assert by_step[15]["eval/return"] == 3.0 and "loss" not in by_step[15]
    assert by_step[20]["loss"] == pytest.approx(15.5) and "eval/return" not in by_step[20]


def test_a_step_committed_twice_is_written_twice_and_said_once(caplog):
    backend = _Keep()
    logger = instrument.Logger([backend])
    with caplog.at_level(logging.WARNING, logger="instrument"):
        logger.log_metrics({"a": 1.0}, step=20, commit=True)
        logger.log_metrics({"b": 2.0}, step=20)
        logger.commit(20)
        logger.log_metrics({"c": 3.0}, step=20, commit=True)
    logger.close()
    assert [(r.step, r.scalars) for r in backend.records] == [(20, {"a": 1.0}), (20, {"b": 2.0}), (20, {"c": 3.0})]
    said = [r.getMessage() for r in caplog.records if "committed a second time" in r.getMessage()]
    assert len(said) == 1 and "['b']" in said[0] and "W&B keeps only the first" in said[0]


class _Keep(instrument.Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


# ---------------------------------------------------------------------------------------------------- failed steps
def test_values_of_a_failed_step_are_discarded_never_carried(tmp_path, caplog):
    inst = instrument.Instrumentation(backends=[instrument.TensorBoardBackend()], log_interval=10, run_name="r",
                                      log_dir=str(tmp_path))
    log = inst.logger
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(21):
            try:
                with inst.step(step):
                    log.log_metrics({"loss": float(step)}, step=step)
                    with log.timer("body"):
                        pass
                    if step in (10, 13):  # a logging step and a non-logging step raise after staging
                        log.log_metrics({"only_failed": 1.0}, step=step)
                        log.log_image("img", np.zeros((2, 2)), step=step)
                        raise RuntimeError("bad batch")
            except RuntimeError:
                pass
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    assert 10 not in scalars["loss"] and "only_failed" not in scalars
    # step 20 holds the mean over 1..9 (never committed: 10 failed) and 11..20 without 13
    expected = np.mean([s for s in range(1, 21) if s not in (10, 13)])
    assert scalars["loss"] == {0: 0.0, 20: pytest.approx(expected)}
    assert scalars["timing/body/count"][20] == 18  # 1..20 without the two failed steps
    said = [r.getMessage() for r in caplog.records if "are discarded" in r.getMessage()]
    assert len(said) == 1 and "step 10 raised" in said[0] and "only_failed" in said[0]


def test_discard_staged_keeps_what_was_staged_before_the_mark():
    backend = _Keep()
    logger = instrument.Logger([backend])
    logger.log_metrics({"x": 1.0}, step=1)
    mark = logger.mark()
    logger.log_metrics({"x": 100.0, "y": 5.0}, step=2)
    assert sorted(logger.discard_staged(mark)) == ["x", "y"]
    assert logger.discard_staged(mark) == []  # once
    stale = logger.mark()
    logger.mark()
    logger.log_metrics({"z": 1.0}, step=2)
    assert logger.discard_staged(stale) == []  # a later mark replaced it
    logger.commit(3)
    logger.close()
    assert backend.records[0].scalars == {"x": 1.0, "z": 1.0}


@pytest.mark.parametrize("failed", ["floats", "per-key", "empty", "image"])
def test_a_discarded_step_gives_its_step_number_back(failed):
    """A commit without a step (``close``, RL's final commit) writes what survived at the last surviving
    step, never at the number of a step that failed."""
    backend = _Keep()
    logger = instrument.Logger([backend])
    logger.log_metrics({"loss": 1.0}, step=3)
    mark = logger.mark()
    if failed == "image":
        logger.log_image("frame", torch.zeros(3, 4, 4), step=5)
    else:
        logger.log_metrics({"floats": {"loss": 9.0}, "per-key": {"loss": np.float32(9.0)}, "empty": {}}[failed],
                           step=5)
    logger.discard_staged(mark)
    logger.close()
    assert [(r.step, r.scalars, sorted(r.images)) for r in backend.records] == [(3, {"loss": 1.0}, [])]


# ---------------------------------------------------------------------------------------------------- whole rollouts
class Rollout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rule = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = x + 0.01 * torch.tanh(self.rule(x))
        return x


def test_a_module_that_runs_the_whole_rollout_is_said_once(tmp_path, caplog):
    model = Rollout()
    inst = instrument.Instrumentation(observers=[IterationStats(images=False)], backends=[], log_interval=1)
    inst.watch(model)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(3):
            with inst.step(step), torch.no_grad():
                model(torch.zeros(1, 4, 6, 6))
    inst.close()
    said = [r.getMessage() for r in caplog.records if "whole rollout" in r.getMessage()]
    assert len(said) == 1
    assert "its submodule 'rule' (Conv2d) in a loop" in said[0] and "inst.watch(model.rule)" in said[0]
    assert not model.rule._forward_hooks and not model._forward_hooks  # nothing left registered



class RolloutOwnReceiver(nn.Module):
    """`Rollout` whose forward names its receiver ``m`` instead of ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.rule = nn.Conv2d(4, 4, 3, padding=1)

    def forward(m, x: torch.Tensor) -> torch.Tensor:  # noqa: N805 - the receiver's name is the point
        for _ in range(20):
            x = x + 0.01 * torch.tanh(m.rule(x))
        return x


@pytest.mark.parametrize("first", ["raises", "not_called"])
def test_a_first_logging_step_that_raised_or_never_called_the_module_does_not_use_up_the_check(caplog, first):
    """The check ran after the first logging step whatever it did, so a first step that raised before the
    model ran (or never called it) meant the whole-rollout warning never came; a receiver not named ``self``
    was not read as a loop over the submodule."""
    model = RolloutOwnReceiver()
    inst = instrument.Instrumentation(observers=[IterationStats(images=False)], backends=[], log_interval=1,
                                      overhead_budget=None)
    inst.watch(model)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        if first == "raises":
            with pytest.raises(RuntimeError), inst.step(0):
                raise RuntimeError("the data loader failed")
        else:
            with inst.step(0):
                pass
        for step in (1, 2):
            with inst.step(step), torch.no_grad():
                model(torch.zeros(1, 4, 6, 6))
    inst.close()
    said = [r.getMessage() for r in caplog.records if "whole rollout" in r.getMessage()]
    assert len(said) == 1 and "its submodule 'rule' (Conv2d) in a loop" in said[0]

def test_a_single_call_without_a_loop_is_said_at_info_level(caplog):
    rule = nn.Conv2d(4, 4, 3, padding=1)
    inst = instrument.Instrumentation(observers=[IterationStats(images=False)], backends=[], log_interval=1)
    inst.watch(rule)
    with caplog.at_level(logging.INFO, logger="instrument"), torch.no_grad():
        for step in range(2):
            with inst.step(step):
                rule(torch.zeros(1, 4, 6, 6))
    inst.close()
    said = [r for r in caplog.records if "called once" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_a_per_iteration_module_is_not_flagged(caplog):
    model = Rollout()
    inst = instrument.Instrumentation(observers=[IterationStats(images=False)], backends=[], log_interval=1)
    inst.watch(model.rule)
    with caplog.at_level(logging.INFO, logger="instrument"), torch.no_grad():
        with inst.step(0):
            model(torch.zeros(1, 4, 6, 6))
    inst.close()
    assert not [r for r in caplog.records if "called once" in r.getMessage()]


# ---------------------------------------------------------------------------------------------------- edge values
def test_edge_values_read_back(tmp_path, caplog):
    logger = instrument.Logger([instrument.JsonlBackend(), instrument.TensorBoardBackend()],
                               instrument.RunInfo("r", tmp_path))
    big = 2**53 + 1
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            logger.log_metrics(
                {"big": big, "flag": np.bool_(True), "off": False, "count": torch.tensor(2**24 + 1),
                 "np_int": np.int64(7), "nan": float("nan")},
                step=step, commit=True,
            )
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    scalars = next(row for row in rows if row.get("step") == 0)
    flat = scalars["metrics"]
    assert flat["big"] == float(big) and flat["flag"] == 1.0 and flat["off"] == 0.0 and flat["np_int"] == 7.0
    assert flat["nan"] == "nan"  # NaN passes through (JSONL writes it as a string)
    assert flat["count"] == 2**24 + 1  # integer tensors go through float64, not float32
    said = [r.getMessage() for r in caplog.records if "beyond 2**53" in r.getMessage()]
    assert len(said) == 1 and "'big'" in said[0] and str(big) in said[0]


def test_integer_tensors_beyond_2_53_are_written_as_the_nearest_float64_and_said_once_per_key(tmp_path, caplog):
    """The value of an int64 tensor is never read on the caller: each staged value is compared with 2**53 on
    its device, and the writer thread names each key that held such a value once, whichever path staged it (a
    dict of int64 tensors, a mixed dict, ``reduce=``, ``commit=True``, uint64), also when the interval's mean
    is below 2**53. A key later logged as a float, values of a failed step and exact integers are not named."""
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    seed, key, own, unsigned = 2**60 + 1, -(2**55) - 3, 2**53 + 1, 2**63 + 5
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in (0, 3):
            logger.log_metrics({"seed": torch.tensor(seed), "small": torch.tensor(7)}, step=step)  # one block
            logger.log_metrics({"hash": torch.tensor(key), "x": 1.5, "i32": torch.tensor(2**31 - 1, dtype=torch.int32),
                                "f": torch.tensor(1e17, dtype=torch.float64)}, step=step, prefix="mixed")
            logger.log_metrics({"u": torch.tensor(unsigned, dtype=torch.uint64)}, step=step)
            logger.log_metrics({"mean": torch.tensor(2**53 + 2)}, step=step)  # with the next: a mean below 2**53
            logger.log_metrics({"mean": torch.tensor(0)}, step=step)
            logger.log_metrics({"total": torch.tensor(2**54)}, step=step, reduce="sum")
            logger.commit(step)
            logger.log_metrics({"own": torch.tensor(own)}, step=step + 1, commit=True)
        logger.log_metrics({"later": torch.tensor(3)}, step=5)  # an int64 key, exact
        logger.log_metrics({"later": 2.0**60}, step=5)  # the same key, later in the interval, as a float
        mark = logger.mark()
        logger.log_metrics({"failed": torch.tensor(2**60)}, step=5)
        assert logger.discard_staged(mark) == ["failed"]  # a failed step's values never reach a commit
        logger.commit(5)
    logger.close()
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    rows = {row["step"]: row["metrics"] for row in map(json.loads, lines) if "metrics" in row}
    assert rows[0] == rows[3] == {
        "seed": float(seed), "small": 7.0, "mixed/hash": float(key), "mixed/x": 1.5,
        "mixed/i32": float(2**31 - 1), "mixed/f": 1e17, "u": float(unsigned), "mean": float(2**52 + 1),
        "total": float(2**54),
    }
    assert rows[1] == rows[4] == {"own": float(own)}
    assert rows[5] == {"later": (3.0 + 2.0**60) / 2}
    said = [r.getMessage() for r in caplog.records if "at or beyond 2**53" in r.getMessage()]
    named = sorted(message.split("'")[1] for message in said)
    assert named == ["mean", "mixed/hash", "own", "seed", "total", "u"], said  # once each
    assert f"written as {float(seed)!r}" in next(m for m in said if "'seed'" in m)



def test_integer_flags_stay_one_per_key_and_never_hold_the_writer_on_the_staging_lock(tmp_path, caplog):
    """Each call of an int64 value flags it on its device; an interval keeps one flag per key (OR-ed), not one
    per call, so a loop logging a counter every micro-batch hands over one. The writer warns without the
    staging lock: a signal handler's close holds that lock while it waits for the writer (`_shutdown`)."""
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("r", tmp_path))
    for i in range(1000):
        logger.log_metrics({"tokens": torch.tensor(i), "loss": torch.tensor(0.5)}, step=0)  # mixed: per key
        logger.log_metrics({"seen": torch.tensor(2**60 if i == 500 else i)}, step=0)
    assert len(logger._wide) == 2 and logger._wide[("tokens",)].shape == (1,)  # one flag per key, 2,000 calls
    with caplog.at_level(logging.WARNING, logger="instrument"), logger._lock:  # as a signal handler may
        logger.commit(0)
        logger.log_metrics({"after": 1.0}, step=1)
        logger.commit(1)
        started = time.monotonic()
        logger._shutdown(None, 10.0, commit=False)
        assert time.monotonic() - started < 5.0
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    rows = {row["step"]: row["metrics"] for row in map(json.loads, lines) if "metrics" in row}
    assert rows[1] == {"after": 1.0} and rows[0]["tokens"] == 499.5
    said = [r.getMessage() for r in caplog.records if "at or beyond 2**53" in r.getMessage()]
    assert len(said) == 1 and "'seen'" in said[0]


def test_on_mps_integers_are_flagged_from_2_24():
    """MPS converts integer tensors to float32 (it has no float64), exact only up to 2**24: there int32 and
    uint32 can be rounded too, and the limit is 2**24 (the same ops, run on a CPU)."""
    from instrument.logger.values import note_beyond, wide_int

    assert wide_int(torch.int32, torch.float32) and wide_int(torch.int64, torch.float32)
    assert not wide_int(torch.int32, torch.float64) and not wide_int(torch.int16, torch.float32)
    assert wide_int(torch.uint64, torch.float64) and not wide_int(torch.bool, torch.float32)
    wide = {}
    values = torch.tensor([2**24 - 1, 2**24 + 1, -(2**24) - 1, 7], dtype=torch.int32)
    note_beyond(wide, ("a", "b", "c", "d"), values.to(torch.float32))
    assert wide[("a", "b", "c", "d")].tolist() == [False, True, True, False]
    note_beyond(wide, ("a", "b", "c", "d"), torch.zeros(4))  # OR-ed with a later call's flags
    assert wide[("a", "b", "c", "d")].tolist() == [False, True, True, False]


@pytest.mark.parametrize(
    "value, pattern",
    [
        (10**400, r"metric 'k' is an integer of 401 digits"),
        (1 + 2j, r"metric 'k' is complex \(\(1\+2j\)\)"),
        (np.complex64(1j), r"metric 'k' is complex"),
        (torch.tensor(1j), r"metric 'k' is complex \(a complex tensor"),
        (np.array([1 + 1j]), r"metric 'k' is complex"),
    ],
)
def test_values_no_float_can_hold_are_refused(value, pattern):
    logger = instrument.Logger([])
    with pytest.raises(instrument.InvalidValueError, match=pattern):
        logger.log_metrics({"k": value}, step=0)
    with pytest.raises(ValueError, match=pattern):
        logger.log_metrics({"k": value}, step=0, commit=True)


def test_negative_steps_and_empty_keys_are_refused():
    logger = instrument.Logger([])
    with pytest.raises(instrument.InvalidValueError, match=r"step must be between 0 and 2\*\*63 - 1 .*got -1"):
        logger.log_metrics({"a": 1.0}, step=-1)
    with pytest.raises(ValueError, match="step must be between 0"):
        logger.commit(-1) if logger.log_metrics({"a": 1.0}, step=0) is None else None
    with pytest.raises(instrument.InvalidValueError, match="empty metric key"):
        logger.log_metrics({"": 1.0}, step=0, prefix="x")
    with pytest.raises(instrument.InvalidValueError, match="empty tag"):
        logger.log_image("", np.zeros((2, 2)), step=0)
    inst = instrument.Instrumentation(backends=[])
    with pytest.raises(instrument.InvalidValueError, match=r"inst.step\(-1\): the step must be between 0"):
        inst.step(-1)
    with pytest.raises(instrument.InvalidValueError, match=r"inst.step\(9223372036854775808\): the step must be"):
        inst.step(2**63)  # TensorBoard, W&B and MLflow would refuse it at every write
    assert inst.step(2**63 - 1) is not None
    with pytest.raises(TypeError, match="inst.step takes an int step, got float"):
        inst.step(1.0)
    inst.close()


def test_keys_mlflow_would_merge_stay_apart(tmp_path, caplog):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    backend = instrument.MlflowBackend()
    logger = instrument.Logger([backend], instrument.RunInfo("m", tmp_path))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in (0, 1):
            logger.log_metrics({"acc[top1]": 0.5 + step, "acc_top1_": 0.25 + step}, step=step, commit=True)
        logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    first = [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "acc_top1_")]
    second = [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "acc_top1__2")]
    assert first == [(0, 0.5), (1, 1.5)] and second == [(0, 0.25), (1, 1.25)]
    said = [r.getMessage() for r in caplog.records if "sanitises to" in r.getMessage()]
    assert len(said) == 1 and "'acc_top1_'" in said[0] and "'acc[top1]'" in said[0]


# ---------------------------------------------------------------------------------------------------- loop numbering
def test_a_one_based_loop_is_told_how_to_fix_it():
    from instrument.rl import RLLogging

    keeper = _Keep()
    inst = instrument.Instrumentation(backends=[keeper], log_interval=1)
    rl = RLLogging(progress=None).attach(inst)
    with pytest.raises(instrument.ConfigurationError, match=r"loop looks 1-based.*range\(n\).*inst.step\(rl.step\)"):
        with inst.step(1), rl.iteration():
            inst.logger.log_metrics({"user": 1.0}, step=1)
    for _ in range(1, 3):  # the suggested fix: the loop variable stays 1-based, the step is RLLogging's
        with inst.step(rl.step), rl.iteration():
            inst.logger.log_metrics({"user": 2.0}, step=rl.step)
    rl.close()
    inst.close()
    assert [r.step for r in keeper.records] == [1, 2]
    assert all(r.scalars["user"] == 2.0 for r in keeper.records)  # the failed step's 1.0 was discarded


def test_a_bool_tensor_on_the_per_key_path_keeps_the_interval_mean_in_float64(tmp_path):
    logger = instrument.Logger([instrument.JsonlBackend()], instrument.RunInfo("b", tmp_path))
    # a bool tensor beside a float: not one dtype, so the per-key path stages it
    logger.log_metrics({"done": torch.tensor(True), "loss": 0.5}, step=0)
    logger.log_metrics({"done": 1e-9}, step=0)
    logger.log_metrics({"done": 0.1}, step=0)
    logger.commit(0)
    # the same at its own step (commit=True), with a weight, and as a block of bool tensors folded later
    logger.log_metrics({"own": torch.tensor(True), "x": 0.5}, step=1, commit=True)
    logger.log_metrics({"w": torch.tensor(True)}, step=2, weights=3.0)
    logger.log_metrics({"w": 1e-9}, step=2, weights=1.0)
    logger.log_metrics({"w": 0.1}, step=2, weights=1.0)
    logger.log_metrics({"b": torch.tensor(True), "c": torch.tensor(False)}, step=2)
    logger.log_metrics({"b": np.float64(1e-9)}, step=2)  # a NumPy number: the per-key path folds the block
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    flat = next(row for row in rows if row.get("step") == 0)["metrics"]
    reference = float(np.mean(np.array([1.0, 1e-9, 0.1], dtype=np.float64)))
    assert flat["done"] == pytest.approx(reference, rel=1e-15, abs=0)
    own = next(row for row in rows if row.get("step") == 1)["metrics"]
    assert own["own"] == 1.0
    later = next(row for row in rows if row.get("step") == 2)["metrics"]
    weighted = float(np.sum(np.array([3.0, 1e-9, 0.1], dtype=np.float64)) / 5.0)
    assert later["w"] == pytest.approx(weighted, rel=1e-15, abs=0)
    assert later["b"] == pytest.approx((1.0 + 1e-9) / 2.0, rel=1e-15, abs=0) and later["c"] == 0.0
