"""Batches as gymnasium and CleanRL hand them out: NumPy arrays (and Python lists) instead of tensors, read back
from a real JSONL file against float64 references."""

import json

import numpy as np
import pytest
import torch

import instrument
from instrument import ConfigurationError
from instrument.rl import CollectionMetrics, RLLogging

P = "collection/main/"


def run(tmp_path, batches, keywords=True):
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1, log_dir=tmp_path)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    for step, (reward, done, mask) in enumerate(batches):
        with inst.step(step), rl.iteration():
            if keywords:
                rl.observe_batch(reward=reward, done=done, mask=mask)
            else:  # a plain nested dict at the default keys
                rl.observe_batch({"next": {"reward": reward, "done": done}, "collector": {"mask": mask}})
    rl.close()
    inst.close()
    rows = [json.loads(line) for line in open(path)]
    return {r["step"]: r["metrics"] for r in rows if "step" in r and "metrics" in r}, inst.failures


def reference(batches):
    """Per step: float64 reward mean/min/max over kept steps, returns of episodes ended, frames so far."""
    out, carry, frames, episodes = [], {}, 0, 0
    for reward, done, mask in batches:
        reward, done, mask = np.asarray(reward, np.float64), np.asarray(done, bool), np.asarray(mask, bool)
        kept = reward[mask]
        returns = []
        for t in range(reward.shape[0]):
            for e in range(reward.shape[1]):
                if mask[t, e]:
                    carry[e] = carry.get(e, 0.0) + reward[t, e]
                    if done[t, e]:
                        returns.append(carry.pop(e))
        frames += int(mask.sum())
        episodes += len(returns)
        out.append((kept.mean(), kept.min(), kept.max(), returns, frames, episodes))
    return out


def batches(dtype, n=3, t=6, envs=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        reward = (rng.standard_normal((t, envs)) * 10).astype(dtype)
        done = rng.random((t, envs)) < 0.3
        mask = rng.random((t, envs)) < 0.8
        mask[0, 0] = True
        out.append((reward, done, mask))
    return out


@pytest.mark.parametrize("keywords", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_batches_are_measured_and_counted(tmp_path, dtype, keywords):
    """NumPy inputs raised AttributeError inside the components (reward.detach(), done.dim()), counted as
    runtime faults: collection logged nothing and counters/frames read 0."""
    data = batches(dtype)
    logged, failures = run(tmp_path, data, keywords)
    assert failures == {}
    for step, (mean, low, high, returns, frames, episodes) in enumerate(reference(data)):
        got = logged[step]
        assert got[P + "reward/mean"] == pytest.approx(mean, rel=1e-12)
        assert got[P + "reward/min"] == low and got[P + "reward/max"] == high
        assert got[P + "episode/count"] == len(returns)
        if returns:
            assert got[P + "episode/return/mean"] == pytest.approx(np.mean(returns), rel=1e-12, abs=1e-12)
            assert got[P + "episode/return/min"] == pytest.approx(min(returns), rel=1e-12, abs=1e-12)
        assert got["counters/frames"] == frames and got["counters/episodes"] == episodes


def test_read_only_arrays_and_python_lists_are_batches(tmp_path):
    reward, done, mask = batches(np.float64, n=1)[0]
    reward.setflags(write=False)  # gymnasium can hand out read-only views; torch warns on them
    (mean, low, high, returns, frames, _), = reference([(reward, done, mask)])
    logged, failures = run(tmp_path, [(reward, done.tolist(), mask.tolist())])
    assert failures == {}
    assert logged[0][P + "reward/mean"] == pytest.approx(mean, rel=1e-12)
    assert logged[0][P + "reward/min"] == low and logged[0]["counters/frames"] == frames


@pytest.mark.parametrize(
    "bad, match",
    [
        ("1.0", r"RL batch reward= is a builtins\.str; expected a torch\.Tensor, a NumPy array"),
        (np.array(["a", "b"]), r"reward= is a numpy\.ndarray of dtype <U1; expected"),
        ([[1.0, 2.0], [3.0]], r"reward= is a builtins\.list that is not an array"),
    ],
)
def test_an_entry_that_is_not_an_array_is_refused_by_name(tmp_path, bad, match):
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path)
    rl = RLLogging(progress=None).attach(inst)
    with pytest.raises(ConfigurationError, match=match):
        rl.observe_batch(reward=bad, done=np.zeros(2, dtype=bool))
    with pytest.raises(ConfigurationError, match=r"the entry at \('next', 'reward'\) is a builtins\.str"):
        rl.observe_batch({"next": {"reward": "x", "done": np.zeros(2, dtype=bool)}})
    rl.close()
    inst.close()


def test_read_only_and_reversed_numpy_losses_are_logged(tmp_path):
    """TrainMetrics converted NumPy losses on its own, without the batch path's copy: a reversed array raised
    (negative strides) and a read-only one warned; both are losses as any other."""
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1, log_dir=tmp_path)
    rl = RLLogging(progress=None).attach(inst)
    frozen = np.array([1.0, 2.0, 4.0])
    frozen.setflags(write=False)
    with inst.step(0), rl.iteration():
        rl.observe_losses({"loss": np.arange(4.0)[::-1], "value": frozen})
    rl.close()
    inst.close()
    metrics = json.loads(path.read_text().splitlines()[0])["metrics"]
    assert metrics["train/main/loss"] == 1.5 and metrics["train/main/value"] == pytest.approx(7 / 3)
    assert inst.failures == {}


def test_float_flags_as_cleanrl_keeps_them_count_like_bools_and_complex_ones_are_refused(tmp_path):
    """CleanRL's next_done is a float32 tensor of 0.0 and 1.0: counted as the bools it stands for. A complex
    done holds no flags and is refused, naming the role and where it came from."""
    done = np.zeros((5, 3), np.float32)
    done[4, :] = 1.0
    logged, failures = run(tmp_path, [(np.ones((5, 3)), done, np.ones((5, 3), np.float32))])
    assert failures == {} and logged[0]["counters/episodes"] == 3 and logged[0]["counters/frames"] == 15
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path / "c")
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None).attach(inst)
    match = r"RL batch done \(given as a keyword\) is a torch\.complex128 tensor; done must hold flags"
    with pytest.raises(ConfigurationError, match=match):
        rl.observe_batch(reward=np.zeros((5, 3)), done=torch.zeros(5, 3, dtype=torch.complex128))
    assert rl.counters.frames == 0 and rl.counters.episodes == 0
    rl.close()
    inst.close()


def test_integer_flags_and_numpy_integer_frames_are_counted(tmp_path):
    done = np.zeros((5, 3), np.int64)
    done[4, :] = 1
    logged, failures = run(tmp_path, [(np.ones((5, 3)), done, np.ones((5, 3), np.uint8))])
    assert failures == {} and logged[0]["counters/episodes"] == 3 and logged[0]["counters/frames"] == 15
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path / "b")
    rl = RLLogging(progress=None).attach(inst)
    with rl.iteration():
        rl.observe_batch(reward=np.ones(3), done=np.zeros(3, bool), frames=np.int64(3))
    assert rl.counters.frames == 3 and type(rl.counters.state_dict()["frames"]) is int
    rl.close()
    inst.close()
