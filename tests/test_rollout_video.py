"""RolloutVideo, read back from the files a user opens (TensorBoard events, W&B media, MLflow artifacts) and
compared with an independent float64 NumPy render of the same states."""

import io
import logging
from typing import List

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence
from torch import nn
from torch.utils.checkpoint import checkpoint

import instrument
from instrument import Logger, RolloutVideo, RunInfo, StepContext
from instrument.backends.base import StepRecord
from instrument.backends.video import VideoWriteError
from instrument.core.colormap import VIRIDIS_LUT
from tests.conftest import event_accumulator

N_ITER = 5


# ------------------------------------------------------------------------------------------------ references
def composite_reference(state: np.ndarray, channels=(0, 1, 2, 3), premultiplied=True) -> np.ndarray:
    """[C, H, W] -> [H, W, 3] uint8: RGBA over white, in float64 (the growing-NCA papers' to_rgb)."""
    x = state[list(channels)].astype(np.float64)
    a = np.clip(x[3], 0.0, 1.0)
    rgb = x[:3] if premultiplied else np.clip(x[:3], 0.0, 1.0) * a
    out = np.clip(1.0 - a + rgb, 0.0, 1.0)
    finite = np.isfinite(out).all(axis=0) & np.isfinite(x).all(axis=0)
    img = np.floor(np.moveaxis(np.where(finite, out, 0.0), 0, -1) * 255.0 + 0.5).astype(np.uint8)
    img[~finite] = 128
    return img


def colormap_reference(states: List[np.ndarray], channel: int) -> List[np.ndarray]:
    """One channel through viridis over the finite min..max of the whole video, in float64."""
    values = np.stack([s[channel] for s in states]).astype(np.float64)
    finite = values[np.isfinite(values)]
    lo, hi = finite.min(), finite.max()
    index = np.clip(np.round((np.where(np.isfinite(values), values, lo) - lo) / (hi - lo) * 255.0), 0, 255)
    index = index.astype(np.int64)
    frames = VIRIDIS_LUT[index]
    frames[~np.isfinite(values)] = 128
    return list(frames)


def upscaled(frame: np.ndarray, k: int) -> np.ndarray:
    return np.repeat(np.repeat(frame, k, axis=0), k, axis=1)


def gif_frames(data: bytes):
    image = Image.open(io.BytesIO(data))
    assert image.format == "GIF"
    frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(image)]
    image.seek(0)
    return frames, image.info.get("duration")


# ------------------------------------------------------------------------------------------------ a rollout
class Shift(nn.Module):
    """One iteration: roll the grid one cell right and scale by a learnable 1.0 (a parameter to check gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x.roll(1, dims=-1) * self.scale


def seed_state() -> torch.Tensor:
    """[2, 5, 4, 7]: values on a coarse grid (few distinct colours, so a GIF holds them exactly); every frame
    of the roll differs from the one before it."""
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 5, (2, 5, 4, 7), generator=g).float() / 4.0


def run_steps(backends, steps=(0, 1), checkpointed=False, style="hook", observer=None, log_dir=None):
    """Train Shift over ``steps`` with RolloutVideo watching; returns the rolled states per step and the grads."""
    torch.manual_seed(0)
    rule = Shift()
    observer = observer or RolloutVideo(fps=5, upscale=2)
    inst = instrument.Instrumentation(
        observers=[observer], backends=backends, log_interval=1, log_dir=str(log_dir or "runs"), run_name="r"
    )
    if style == "hook":
        inst.watch(rule)
    opt = torch.optim.SGD(rule.parameters(), lr=0.0)
    rollouts, grads = [], []
    for step in steps:
        x = seed_state() + step / 4.0
        states = [x]
        with inst.step(step) as s:
            for i in range(N_ITER):
                prev = x
                x = checkpoint(rule, x, use_reentrant=False) if checkpointed else rule(x)
                if style == "evolver":
                    s.observer(StepContext(prev, x, step_index=i))
                states.append(x.detach())
            loss = x.square().mean()
            opt.zero_grad()
            loss.backward()
            grads.append(rule.scale.grad.clone())
            opt.step()
        rollouts.append([t[0].numpy() for t in states])
    inst.close()
    assert inst.logger.failures == {}
    return rollouts, grads


# ------------------------------------------------------------------------------------------------ TensorBoard
def test_tensorboard_video_matches_float64_composite_over_white(tmp_path):
    tb = tmp_path / "tb"
    rollouts, _ = run_steps([instrument.TensorBoardBackend(log_dir=str(tb))], log_dir=tmp_path)
    acc = event_accumulator(tb)
    events = acc.Images("rollout/video")
    assert [e.step for e in events] == [0, 1]
    for event, states in zip(events, rollouts, strict=True):
        frames, duration = gif_frames(event.encoded_image_string)
        assert duration == 200  # fps=5
        expected = [upscaled(composite_reference(s), 2) for s in states]
        assert len(frames) == len(expected) == N_ITER + 1
        assert (event.width, event.height) == (7 * 2, 4 * 2)
        for got, want in zip(frames, expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_filmstrip_format_writes_every_frame_side_by_side(tmp_path):
    tb = tmp_path / "tb"
    rollouts, _ = run_steps([instrument.TensorBoardBackend(log_dir=str(tb), video_format="filmstrip")], steps=(0,),
                            log_dir=tmp_path)
    (event,) = event_accumulator(tb).Images("rollout/video")
    sheet = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    h, w, gap = 8, 14, 2
    assert sheet.shape == (h, (N_ITER + 1) * (w + gap) - gap, 3)  # six frames: one row
    for t, state in enumerate(rollouts[0]):
        left = t * (w + gap)
        np.testing.assert_array_equal(sheet[:, left: left + w], upscaled(composite_reference(state), 2))
        if t:
            assert (sheet[:, left - gap: left] == 255).all()  # white gaps between frames


def test_video_format_is_validated():
    with pytest.raises(instrument.ConfigurationError, match=r"video_format must be one of .*got 'mp4'"):
        instrument.TensorBoardBackend(video_format="mp4")


# ------------------------------------------------------------------------------------------------ W&B, MLflow
def test_wandb_offline_run_has_the_gif_with_every_frame(tmp_path):
    pytest.importorskip("wandb")
    from tests.wandb_reader import read_run

    rollouts, _ = run_steps([instrument.WandbBackend(project="tests", dir=str(tmp_path / "wb"))], log_dir=tmp_path)
    rows, _ = read_run(tmp_path / "wb")
    videos = {row["_step"]: row["rollout/video"] for row in rows if "rollout/video" in row}
    assert sorted(videos) == [0, 1]
    for step, states in zip((0, 1), rollouts, strict=True):
        meta = videos[step]
        assert meta["_type"] == "video-file" and meta["path"].startswith("media/videos/")
        (path,) = list((tmp_path / "wb").rglob(meta["path"]))
        frames, _ = gif_frames(path.read_bytes())
        assert len(frames) == N_ITER + 1
        np.testing.assert_array_equal(frames[-1], upscaled(composite_reference(states[-1]), 2))


def test_mlflow_artifact_per_step_read_back(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    backend = instrument.MlflowBackend(tracking_uri=uri, artifact_location=(tmp_path / "art").as_uri())
    rollouts, _ = run_steps([backend], log_dir=tmp_path)
    client = MlflowClient(tracking_uri=uri)
    listed = sorted(a.path for a in client.list_artifacts(backend.run_id, "videos/rollout/video"))
    assert listed == ["videos/rollout/video/step_00000000.gif", "videos/rollout/video/step_00000001.gif"]
    for path, states in zip(listed, rollouts, strict=True):
        with open(client.download_artifacts(backend.run_id, path), "rb") as f:
            frames, duration = gif_frames(f.read())
        assert duration == 200
        expected = [upscaled(composite_reference(s), 2) for s in states]
        assert len(frames) == len(expected)
        for got, want in zip(frames, expected, strict=True):
            np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------------ rendering
class Keep(instrument.Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def observed(observer: RolloutVideo, states: List[torch.Tensor], numbered: bool = True) -> StepRecord:
    """``numbered=False``: an explicit evolver that leaves ``step_index`` at its default 0."""
    keep = Keep()
    logger = Logger([keep])
    observer.reset()
    with torch.no_grad():
        for i in range(len(states) - 1):
            observer.observe(StepContext(states[i], states[i + 1], step_index=i if numbered else 0))
    observer.log(logger, step=0)
    logger.commit()
    logger.close()
    return keep.records[0]


def test_composite_of_arbitrary_values_matches_float64_exactly_up_to_rounding():
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(3, 6, 5, 4, generator=g) * 0.7 + 0.4 for _ in range(4)]
    states[2][1, 1, 2, 3] = float("nan")
    for premultiplied in (True, False):
        record = observed(RolloutVideo(sample=1, upscale=1, premultiplied=premultiplied), states)
        frames, fps = record.videos["rollout/video"]
        assert fps == 10 and frames.dtype == np.uint8 and frames.shape == (4, 5, 4, 3)
        for got, state in zip(frames, states, strict=True):
            want = composite_reference(state[1].numpy(), premultiplied=premultiplied)
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # float32 vs float64 at .5 boundaries
        assert (frames[2, 2, 3] == 128).all()  # the NaN pixel is grey


def test_one_channel_through_viridis_over_the_whole_videos_range_channels_last():
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(2, 5, 6, 3, generator=g) * (i + 1) for i in range(4)]  # [B, H, W, C]
    states[1][0, 0, 0, 2] = float("inf")
    record = observed(RolloutVideo(channels=(2,), channel_dim=-1, upscale=1), states)
    frames, _ = record.videos["rollout/video"]
    want = colormap_reference([s[0].permute(2, 0, 1).numpy() for s in states], channel=2)
    assert frames.shape == (4, 5, 6, 3)
    for got, ref in zip(frames, want, strict=True):
        assert np.abs(got.astype(int) - ref.astype(int)).max() <= 3  # one LUT step at a rounding boundary
    assert (frames[1, 0, 0] == 128).all()


def test_fixed_value_range_clips_to_the_ends_of_the_colour_map():
    states = [torch.full((1, 1, 2, 2), v) for v in (-5.0, 0.0, 0.5, 1.0, 9.0)]
    frames, _ = observed(RolloutVideo(channels=(0,), value_range=(0.0, 1.0), upscale=1), states).videos[
        "rollout/video"]
    assert [tuple(f[0, 0]) for f in frames] == [tuple(VIRIDIS_LUT[i]) for i in (0, 0, 128, 255, 255)]


def test_a_channel_spanning_more_than_float32s_range_maps_to_the_ends_of_the_colour_map():
    """hi - lo overflowed to inf, (v - lo) / span was NaN for the largest value, and its index INT64_MIN: an
    IndexError on the CPU, a device-side assert that ended the process on CUDA (a diverging run)."""
    state = torch.tensor([-3e38, 3e38, 0.0, 1.0]).reshape(1, 1, 2, 2)
    frames, _ = observed(RolloutVideo(channels=(0,), upscale=1), [state] * 3).videos["rollout/video"]
    want = colormap_reference([state[0].numpy()] * 3, channel=0)  # float64: no overflow there
    assert len(frames) == 3
    for got, ref in zip(frames, want, strict=True):
        assert (got[0, 0] == VIRIDIS_LUT[0]).all() and (got[0, 1] == VIRIDIS_LUT[255]).all()
        assert np.abs(got.astype(int) - ref.astype(int)).max() <= 3
    wide = RolloutVideo(channels=(0,), upscale=1, value_range=(-3e38, 3e38))
    frames, _ = observed(wide, [state, state]).videos["rollout/video"]
    assert (frames[0][0, 0] == VIRIDIS_LUT[0]).all() and (frames[0][0, 1] == VIRIDIS_LUT[255]).all()


def test_every_max_frames_and_upscale(caplog):
    states = [torch.full((1, 3, 2, 3), i / 10.0) for i in range(10)]  # state i is i/10 everywhere
    record = observed(RolloutVideo(channels=(0, 1, 2), every=3, upscale=3), states)
    frames, _ = record.videos["rollout/video"]
    assert frames.shape == (4, 6, 9, 3)  # states 0, 3, 6, 9
    assert [int(f[0, 0, 0]) for f in frames] == [int(np.floor(i / 10 * 255 + 0.5)) for i in (0, 3, 6, 9)]
    assert not [r for r in caplog.records if "max_frames" in r.getMessage()]
    capped = RolloutVideo(channels=(0, 1, 2), every=2, max_frames=3, upscale=1)
    with caplog.at_level(logging.INFO, logger="instrument"):
        record = observed(capped, states)
        observed(capped, states)
    frames, _ = record.videos["rollout/video"]
    assert [int(f[0, 0, 0]) for f in frames] == [int(np.floor(i / 10 * 255 + 0.5)) for i in (0, 2, 4)]
    # the video stops part-way through the rollout: said once (it read as the rollout's end)
    said = [r.getMessage() for r in caplog.records if "max_frames=3" in r.getMessage()]
    assert len(said) == 1 and "every (now 2)" in said[0]


@pytest.mark.parametrize("every", [1, 2, 3])
def test_every_counts_the_iterations_of_an_evolver_that_leaves_step_index_at_0(every):
    """Such an evolver's video was its seed alone for every > 1: each call read as iteration 0."""
    states = [torch.full((1, 3, 2, 2), i / 10.0) for i in range(9)]  # 8 iterations; state i is i/10
    for numbered in (True, False):
        frames, _ = observed(RolloutVideo(channels=(0, 1, 2), every=every, upscale=1), states,
                             numbered=numbered).videos["rollout/video"]
        assert [int(f[0, 0, 0]) for f in frames] == [int(np.floor(i / 10 * 255 + 0.5)) for i in range(0, 9, every)]


def test_the_first_observed_iteration_gives_the_seed_frame_whatever_its_index():
    """A rollout observed from iteration 3 with every=2 had no seed frame: frame 0 was the state after it."""
    states = [torch.full((1, 3, 2, 2), i / 10.0) for i in range(8)]
    observer = RolloutVideo(channels=(0, 1, 2), every=2, upscale=1)
    keep = Keep()
    logger = Logger([keep])
    observer.reset()
    for i in range(3, 7):  # iterations 3..6 of a rollout: states 3 -> 7
        observer.observe(StepContext(states[i], states[i + 1], step_index=i))
    observer.log(logger, step=0)
    logger.commit()
    logger.close()
    frames, _ = keep.records[0].videos["rollout/video"]
    assert [int(f[0, 0, 0]) for f in frames] == [int(np.floor(i / 10 * 255 + 0.5)) for i in (3, 4, 6)]


def test_negative_channels_count_from_the_last_one():
    """They passed the check and then failed every observe call (index_select refuses negative indices)."""
    g = torch.Generator().manual_seed(4)
    states = [torch.rand(2, 5, 3, 4, generator=g) for _ in range(3)]
    for channels in [(-1,), (-5, -4, -3, -2), (0, 1, -3)]:
        got, _ = observed(RolloutVideo(channels=channels, upscale=1), states).videos["rollout/video"]
        want, _ = observed(RolloutVideo(channels=tuple(c % 5 for c in channels), upscale=1),
                           states).videos["rollout/video"]
        assert got.shape[0] == 3 and np.array_equal(got, want)
    with pytest.raises(instrument.InvalidValueError, match=r"channels \[-6\] do not exist in a state with 5"):
        observed(RolloutVideo(channels=(-6,), upscale=1), states)


def test_reset_forgets_the_previous_logging_step():
    observer = RolloutVideo(upscale=1)
    states = [torch.rand(1, 4, 2, 2) for _ in range(3)]
    observed(observer, states)
    assert observed(observer, states[:2]).videos["rollout/video"][0].shape[0] == 2


# ------------------------------------------------------------------------------------------------ guarantees
@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("style", ["hook", "evolver"])
def test_each_iteration_once_and_gradients_bitwise_equal(tmp_path, checkpointed, style):
    keep = Keep()
    rollouts, grads = run_steps([keep], steps=(0,), checkpointed=checkpointed, style=style, log_dir=tmp_path)
    frames, _ = keep.records[0].videos["rollout/video"]
    want = [upscaled(composite_reference(s), 2) for s in rollouts[0]]
    assert len(frames) == N_ITER + 1
    np.testing.assert_array_equal(frames, np.stack(want))
    torch.manual_seed(0)
    rule = Shift()
    x = seed_state()
    for _ in range(N_ITER):
        x = checkpoint(rule, x, use_reentrant=False) if checkpointed else rule(x)
    x.square().mean().backward()
    assert torch.equal(rule.scale.grad, grads[0])


def test_nothing_on_non_logging_steps(tmp_path):
    keep = Keep()
    observer = RolloutVideo()
    inst = instrument.Instrumentation(observers=[observer], backends=[keep], log_interval=10, log_dir=str(tmp_path))
    rule = Shift()
    inst.watch(rule)
    with inst.step(3):
        rule(seed_state())
    assert observer._frames == []
    inst.close()
    assert not any(r.videos for r in keep.records)


def test_a_video_that_cannot_be_written_costs_that_video_only(tmp_path, caplog):
    tb = tmp_path / "tb"
    backend = instrument.TensorBoardBackend(log_dir=str(tb))
    backend.open(RunInfo("r", tmp_path))
    good = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    good[1] = 255
    record = StepRecord(
        step=0, scalars={"loss": 1.5}, texts={"note": "kept"},
        videos={"bad": (np.zeros((2, 4, 4, 3), dtype=np.float32), 5), "good": (good, 5)},
    )
    with pytest.raises(VideoWriteError, match=r"1 video\(s\) of step 0 .*'bad'.*the rest of the step was written"):
        backend.write(record)
    backend.close()
    acc = event_accumulator(tb)
    assert [e.value for e in acc.Scalars("loss")] == [1.5]
    assert acc.Tags()["images"] == ["good"]
    assert len(gif_frames(acc.Images("good")[0].encoded_image_string)[0]) == 2


def test_bad_input_is_refused_with_what_was_received():
    err = instrument.ConfigurationError
    with pytest.raises(err, match=r"channels must be 1, 3 or 4 channel indices .*got \(0, 1\)"):
        RolloutVideo(channels=(0, 1))
    with pytest.raises(err, match=r"fps must be an int from 1 to 50 .*got 0"):
        RolloutVideo(fps=0)
    with pytest.raises(err, match=r"channel_dim must not be 0"):
        RolloutVideo(channel_dim=0)
    with pytest.raises(err, match=r"value_range applies to a single colour-mapped channel"):
        RolloutVideo(value_range=(0, 1))
    with pytest.raises(err, match=r"value_range must be None or \(low, high\)"):
        RolloutVideo(channels=(0,), value_range=(1, 1))
    for infinite in ((0.0, float("inf")), (float("-inf"), 1.0), (0.0, 1e308 * 10)):  # every frame one colour
        with pytest.raises(err, match=r"value_range must be None or \(low, high\) finite numbers with low < high"):
            RolloutVideo(channels=(0,), value_range=infinite)
    for text_or_mapping in ("01", b"01", bytearray(b"01"), {0: 1, 1: 2}):  # not read as (0, 1), (48, 49), keys
        with pytest.raises(err, match=r"value_range must be None or \(low, high\).*not a pair of bounds"):
            RolloutVideo(channels=(0,), value_range=text_or_mapping)
    assert RolloutVideo(channels=(0,), value_range=[0, 2]).value_range == (0.0, 2.0)
    with pytest.raises(err, match=r"every must be an int >= 1"):
        RolloutVideo(every=0)
    observer = RolloutVideo(sample=4)
    with pytest.raises(instrument.InvalidValueError, match=r"sample=4 but the state's batch dimension has 2"):
        observer.observe(StepContext(torch.zeros(2, 4, 3, 3), torch.zeros(2, 4, 3, 3)))
    with pytest.raises(instrument.InvalidValueError, match=r"channels \[3\] do not exist in a state with 3"):
        RolloutVideo().observe(StepContext(torch.zeros(2, 3, 3, 3), torch.zeros(2, 3, 3, 3)))
    with pytest.raises(instrument.InvalidValueError, match=r"got shape \(2, 4\)"):
        RolloutVideo().observe(StepContext(torch.zeros(2, 4), torch.zeros(2, 4)))


def test_an_observe_error_is_reported_once_and_training_goes_on(tmp_path, caplog):
    keep = Keep()
    inst = instrument.Instrumentation(observers=[RolloutVideo(sample=9)], backends=[keep], log_interval=1,
                                      log_dir=str(tmp_path))
    rule = Shift()
    inst.watch(rule)
    with caplog.at_level(logging.ERROR, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                rule(seed_state())
    inst.close()
    assert inst.failures.get("rollout", 0) >= 1
    assert sum("sample=9" in r.getMessage() or "sample=9" in str(r.exc_info) for r in caplog.records) == 1


def test_the_nca_config_binds_it():
    import gin

    try:
        instrument.parse_config(["nca"])
        observers = gin.query_parameter("Instrumentation.observers")
        assert "RolloutVideo" in [ref.configurable.name for ref in observers]
    finally:
        gin.clear_config()


def test_a_uint8_device_tensor_keeps_its_pixel_values(tmp_path):
    """The logger's transfer carries float64; uint8 frames and images must come out as the same bytes."""
    frames = torch.zeros(2, 3, 4, 3, dtype=torch.uint8)
    frames[0, 0, 0] = torch.tensor([10, 128, 250], dtype=torch.uint8)
    keep = Keep()
    logger = Logger([keep])
    logger.log_video("v", frames, step=0, fps=4)
    logger.log_image("i", frames[0], step=0)
    logger.commit()
    logger.close()
    record = keep.records[0]
    np.testing.assert_array_equal(record.videos["v"][0], frames.numpy())
    np.testing.assert_array_equal(record.images["i"], frames[0].numpy())


def test_a_seed_broadcast_against_the_batch_is_the_first_frame_of_any_sample():
    """A [1, C, H, W] seed before [3, C, H, W] states (as UpdateNorm supports): with sample=2 the first frame was
    sliced from the seed's batch of 1 and raised, losing the video of every logging step."""
    g = torch.Generator().manual_seed(2)
    seed = torch.rand(1, 4, 5, 6, generator=g)
    states = [seed] + [seed + 0.1 * k * torch.rand(3, 4, 5, 6, generator=g) for k in range(1, 4)]
    frames, _ = observed(RolloutVideo(sample=2, upscale=1), states).videos["rollout/video"]
    want = [composite_reference(states[0][0].numpy())] + [composite_reference(s[2].numpy()) for s in states[1:]]
    assert frames.shape == (4, 5, 6, 3)
    for got, ref in zip(frames, want, strict=True):
        assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1  # float32 vs float64 at .5 boundaries
    with pytest.raises(instrument.errors.InvalidValueError, match="sample=2"):  # a later state of batch 1 still is
        observed(RolloutVideo(sample=2, upscale=1), [seed, seed + 0.1])


@pytest.mark.parametrize("channels", [(0, 1, 2), (0, 1, 2, 3)])
def test_uint8_rgb_states_are_read_as_0_to_255_in_tensorboard(tmp_path, channels):
    """A uint8 frame of an image-observation rollout was drawn saturated: 200 red read back as 255, 60 green as
    255 (found by a review). uint8 pixels are 0..255, as log_image and log_video read them."""
    g = torch.Generator().manual_seed(5)
    states = [torch.randint(0, 256, (2, 4, 3, 5), generator=g, dtype=torch.uint8) for _ in range(4)]
    inst = instrument.Instrumentation(observers=[RolloutVideo(channels=channels, upscale=1)],
                                      backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r")
    with inst.step(0) as s:
        for i in range(len(states) - 1):
            s.observer(StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    assert inst.failures == {}
    (event,) = event_accumulator(tmp_path / "r").Images("rollout/video")
    frames, _ = gif_frames(event.encoded_image_string)
    assert len(frames) == len(states)
    for got, state in zip(frames, states, strict=True):
        if len(channels) == 3:  # the pixels themselves
            np.testing.assert_array_equal(got, state[0, :3].permute(1, 2, 0).numpy())
        else:  # over white, from alpha = a / 255
            want = composite_reference(state[0].double().numpy() / 255.0)
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # float32 vs float64 at .5 boundaries


def test_a_complex_state_is_refused_with_what_to_render_instead(caplog):
    states = [torch.randn(2, 4, 3, 3, dtype=torch.complex64) for _ in range(3)]
    inst = instrument.Instrumentation(observers=[RolloutVideo()], backends=[Keep()], log_interval=1)
    with caplog.at_level(logging.ERROR, logger="instrument"), inst.step(0) as s:
        s.observer(StepContext(states[0], states[1]))
    inst.close()
    assert inst.failures == {"rollout": 1}
    (error,) = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert "complex state (torch.complex64)" in str(error) and "x.abs()" in str(error)
