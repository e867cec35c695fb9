"""``Instrumentation(channel_dim=...)`` reaches every observer that reads channels.

"Say the layout once for the session" held for IterationStats and UpdateNorm only: StateHistogram, NonFinite and
RolloutVideo defaulted to ``channel_dim=1``, so with a channels-last state and the session's ``channel_dim=-1``
they read grid rows as channels (eight histograms of 64 values for four channels of 128, a NaN in channel 2
reported in "channel 5", a video of rows) without any error. Read back from TensorBoard's event files.
"""

import numpy as np
import pytest
import torch
from torch import nn

import instrument
from tests.conftest import event_accumulator, watched_rollout
from tests.test_rollout_video import composite_reference, gif_frames


class Twice(nn.Module):
    """Two iterations on a channels-last [B, H, W, C] state: the first leaves a NaN in channel 2 at grid row 5,
    the second replaces it (the last state, which StateHistogram reads, is finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            y = x + 0.25
            y[:, 5, 2, 2] = float("nan")
            return y
        return torch.nan_to_num(x, nan=0.5) + 0.25


def test_state_histogram_and_nonfinite_take_the_sessions_channel_dim(tmp_path):
    g = torch.Generator().manual_seed(0)
    seed = torch.rand(2, 8, 8, 4, generator=g)  # [B, H, W, C]: 4 channels on an 8 x 8 grid
    seed[..., 2] += 10.0
    rule = Twice()
    inst = instrument.Instrumentation(
        [instrument.StateHistogram(), instrument.NonFinite(gradients=False)],
        backends=[instrument.TensorBoardBackend()], log_interval=1, log_dir=str(tmp_path), run_name="r",
        channel_dim=-1, overhead_budget=None,
    )
    inst.watch(rule)
    with inst.step(0):
        last = rule(rule(seed))
    inst.close()
    acc = event_accumulator(tmp_path / "r")
    tags = sorted(t for t in acc.Tags()["histograms"] if t.startswith("state_hist/"))
    assert tags == ["state_hist/c0", "state_hist/c1", "state_hist/c2", "state_hist/c3"]
    reference = last.double().numpy()
    for c, tag in enumerate(tags):
        (event,) = acc.Histograms(tag)
        values = reference[..., c].ravel()
        assert event.histogram_value.num == values.size == 128
        assert event.histogram_value.min == pytest.approx(values.min(), rel=1e-6)
        assert event.histogram_value.max == pytest.approx(values.max(), rel=1e-6)
        assert event.histogram_value.sum == pytest.approx(values.sum(), rel=1e-6)
    scalars = {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"] if tag.startswith("nonfinite/")}
    # The NaN: channel 2 of both samples after iteration 0; in dx at iterations 0 (NaN - x) and 1 (x - NaN).
    assert scalars["nonfinite/first_channel/state"] == 2 and scalars["nonfinite/channels/state"] == 1
    assert scalars["nonfinite/count/state"] == 2 and scalars["nonfinite/first_iteration/state"] == 0
    assert scalars["nonfinite/first_channel/dx"] == 2 and scalars["nonfinite/count/dx"] == 4


class Roll(nn.Module):
    def forward(self, x):  # [B, H, W, C]: roll the grid one cell along W
        return x.roll(1, dims=2)


def test_rollout_video_takes_the_sessions_channel_dim(tmp_path):
    g = torch.Generator().manual_seed(3)
    seed = torch.randint(0, 5, (2, 4, 7, 5), generator=g).float() / 4.0  # [B, H, W, C]: few colours, GIF-exact
    inst = instrument.Instrumentation(
        [instrument.RolloutVideo(upscale=1)], backends=[instrument.TensorBoardBackend()], log_interval=1,
        log_dir=str(tmp_path), run_name="r", channel_dim=-1, overhead_budget=None,
    )
    states = watched_rollout(inst, Roll(), seed, 3)
    (event,) = event_accumulator(tmp_path / "r").Images("rollout/video")
    frames, _ = gif_frames(event.encoded_image_string)
    want = [composite_reference(s[0].permute(2, 0, 1).numpy()) for s in states]  # sample 0, channels first
    assert len(frames) == len(want) == 4
    for got, ref in zip(frames, want, strict=True):
        np.testing.assert_array_equal(got, ref)


def test_an_observers_own_channel_dim_still_wins_and_a_batch_channel_dim_is_refused(tmp_path, caplog):
    seed = torch.rand(2, 3, 4, 4)  # [B, C, H, W]
    observers = [instrument.StateHistogram(channel_dim=1), instrument.NonFinite(channel_dim=1, gradients=False)]
    inst = instrument.Instrumentation(observers, backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r", channel_dim=-1, overhead_budget=None)
    with inst.step(0) as s:
        s.observer(instrument.StepContext(seed, seed + 1))
    inst.close()
    acc = event_accumulator(tmp_path / "r")
    assert sorted(acc.Tags()["histograms"]) == ["state_hist/c0", "state_hist/c1", "state_hist/c2"]
    with pytest.raises(instrument.ConfigurationError, match="StateHistogram.*channel_dim"):
        instrument.StateHistogram(channel_dim=1.5)
    with pytest.raises(instrument.ConfigurationError, match="must not be 0"):
        instrument.RolloutVideo(channel_dim=0)
