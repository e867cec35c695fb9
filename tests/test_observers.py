"""Built-in observers against float64 NumPy references."""

import json

import numpy as np
import pytest
import torch
from torch import nn

import instrument
from instrument.observers.buffer import IterationBuffer
from instrument.observers.stats import channel_stats, iteration_channel_stats
from tests.conftest import iteration_stats_in_tensorboard, read_scalars, watched_rollout


class Keep(instrument.Backend):
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def _observe(observer, states, condition=None):
    keep = Keep()
    log = instrument.Logger([keep])
    observer.reset()
    with torch.no_grad():
        for i, (a, b) in enumerate(zip(states, states[1:], strict=False)):
            observer(instrument.StepContext(a, b, condition=condition, step_index=i))
    observer.log(log, step=0)
    log.commit()
    log.flush()  # backends are written on the logger's writer thread
    return keep.records[0]


def test_channel_stats_matches_numpy_float64():
    x = torch.randn(4, 7, 9, 11) * 3 + 1
    ref = x.double().numpy().transpose(1, 0, 2, 3).reshape(7, -1)
    got = channel_stats(x).double().numpy()
    np.testing.assert_allclose(got, np.stack([ref.mean(1), ref.std(1), ref.min(1), ref.max(1)]), rtol=1e-5, atol=1e-6)
    flat = torch.randn(64, 4)
    np.testing.assert_allclose(channel_stats(flat, channel_dim=-1)[0].numpy(), flat.double().numpy().mean(0),
                               rtol=1e-5, atol=1e-6)


def test_iteration_stats_heatmaps_cover_every_iteration_and_channel():
    states = [torch.randn(2, 3, 4, 4) for _ in range(6)]
    observer = instrument.IterationStats(max_channels=2)
    record = _observe(observer, states)
    assert record.scalars["iteration_stats/iterations"] == 5.0
    assert {k for k in record.scalars if k.startswith("iteration_stats/mean/")} == {
        "iteration_stats/mean/c0", "iteration_stats/mean/c1"}
    assert set(record.images) == {f"iteration_stats/{s}" for s in ("mean", "std", "min", "max")}
    assert record.scalars["iteration_stats/max/c1"] == pytest.approx(float(states[-1][:, 1].max()))
    # reset forgets the previous step
    observer.reset()
    assert observer._states.results() is None


def test_update_norm_and_alive_fraction():
    a = torch.zeros(2, 4, 3, 3)
    b = a.clone()
    b[0, 3, 0, 0] = 1.0  # one alive cell in sample 0
    b[1, 0] = 2.0  # sample 1 changes 9 cells by 2
    record = _observe(instrument.UpdateNorm(), [a, b])
    assert record.scalars["update_norm/l2/mean"] == pytest.approx((1.0 + 6.0) / 2)
    assert record.scalars["update_norm/alive/last"] == pytest.approx(1 / 18)
    assert record.histograms["update_norm/l2"].shape == (1,)


def test_update_norm_on_flat_rl_states_has_no_alive_metric():
    states = [torch.zeros(8, 4), torch.ones(8, 4)]
    record = _observe(instrument.UpdateNorm(name="obs_delta"), states)
    assert record.scalars["obs_delta/l2/last"] == pytest.approx(2.0)
    assert not any("alive" in k for k in record.scalars)


def test_observer_names_and_protocol():
    assert instrument.IterationStats().name == "iteration_stats"
    assert instrument.UpdateNorm("u").name == "u"

    class MyFancyObserver(instrument.Observer):
        def observe(self, context):
            pass

    assert MyFancyObserver().name == "my_fancy_observer"
    assert isinstance(MyFancyObserver(), instrument.StepObserver)


def test_an_observer_without_observe_reads_parameters_in_log(tmp_path):
    """docs/porting.md's GradHistograms: attach and log only. The base observe used to raise, so the observer
    failed at the first iteration and was skipped for the step, its log included."""

    class GradHistograms(instrument.Observer):
        def __init__(self):
            super().__init__("grad")

        def attach(self, modules):
            self.modules = modules

        def log(self, logger, step):
            for module in self.modules:
                for name, p in module.named_parameters():
                    if p.grad is not None:
                        logger.log_histogram(f"grad/{name}", p.grad, step)
                    logger.log_histogram(f"param/{name}", p.detach(), step)

    keep = []

    class Keep(instrument.Backend):
        def write(self, record):
            keep.append(record)

    inst = instrument.Instrumentation([GradHistograms()], backends=[Keep()], log_interval=1, log_dir=str(tmp_path))
    rule = torch.nn.Linear(3, 3)
    inst.watch(rule)
    with inst.step(0):
        x = torch.ones(2, 3)
        for _ in range(3):
            x = rule(x)
        x.sum().backward()
    inst.close()
    assert inst.failures == {}
    assert sorted(keep[0].histograms) == ["grad/bias", "grad/weight", "param/bias", "param/weight"]
    np.testing.assert_array_equal(keep[0].histograms["param/weight"], rule.weight.detach().double().reshape(-1).numpy())


def test_step_context_validates_and_detaches():
    with pytest.raises(TypeError, match=r"StepContext.next_state must be a torch.Tensor or None, got list"):
        instrument.StepContext(torch.zeros(1), [1.0])
    with pytest.raises(TypeError, match="needs both previous_state and next_state"):
        instrument.StepContext(torch.zeros(1), None)
    ctx = instrument.StepContext(torch.zeros(2), torch.ones(2), dx=torch.full((2,), 5.0), freeze_channels=[0],
                                 probes={"h": torch.ones(1, requires_grad=True)})
    assert torch.equal(ctx.dx, torch.full((2,), 5.0)) and ctx.freeze_channels == (0,)
    assert not ctx.probes["h"].requires_grad
    # A state in autograd is detached (same memory, no graph); one outside it is handed over as it is.
    leaf = torch.randn(3, requires_grad=True)
    state, plain = leaf * 2, torch.zeros(3)
    ctx = instrument.StepContext(state, plain, condition=plain)
    assert not ctx.previous_state.requires_grad and ctx.previous_state.data_ptr() == state.data_ptr()
    assert ctx.next_state is plain and ctx.condition is plain
    assert ctx.previous_state.grad_fn is None and state.grad_fn is not None


def test_small_states_are_batched_and_match_per_iteration_values():
    states = [torch.randn(256, 4) for _ in range(30)]
    batched = _observe(instrument.IterationStats(channel_dim=-1), states)
    one_by_one = instrument.IterationStats(channel_dim=-1)
    one_by_one._states.batched = False
    eager = _observe(one_by_one, states)
    assert batched.scalars.keys() == eager.scalars.keys()
    for key, value in eager.scalars.items():
        assert batched.scalars[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    np.testing.assert_array_equal(batched.images["iteration_stats/mean"], eager.images["iteration_stats/mean"])


def test_memory_cap_drains_early_and_keeps_iteration_order():
    states = [torch.full((4, 2), float(i)) for i in range(10)]
    # Both [4, 2] states are kept (dx is taken at log time): 16 elements per iteration, so it drains every 2.
    observer = instrument.UpdateNorm(max_elements=20)
    record = _observe(observer, states)
    assert record.histograms["update_norm/l2"].shape == (9,)
    assert record.scalars["update_norm/l2/first"] == pytest.approx(np.sqrt(2.0))


def _update_norm_observed(contexts):
    observer = instrument.UpdateNorm()
    observer.reset()
    with torch.no_grad():
        for context in contexts:
            observer.observe(context)
    keep = Keep()
    log = instrument.Logger([keep])
    observer.log(log, step=0)
    log.commit()
    log.flush()
    return keep.records[0]


@pytest.mark.parametrize("shape", [(256, 4), (3, 5, 6, 6)])
def test_update_norm_is_the_same_whether_dx_is_taken_per_iteration_or_batched_at_log_time(shape):
    torch.manual_seed(3)
    states = [(torch.randn(*shape) * 2 + 1e3).float() for _ in range(12)]
    pairs = list(zip(states, states[1:], strict=False))

    def contexts(previous_copy=False, read_dx=False, given=False):
        for i, (a, b) in enumerate(pairs):
            if previous_copy:  # not a chain: each iteration starts from another tensor object and storage
                a = a.clone()
            context = instrument.StepContext(a, b, dx=(b - a) if given else None, step_index=i)
            if read_dx:  # another observer read context.dx first: UpdateNorm uses that one
                assert context.dx is not None
            yield context

    # The detached states a rollout hands over are new tensor objects over the same storage: a chain.
    chain = _update_norm_observed(contexts())
    for other in (_update_norm_observed(contexts(previous_copy=True)),
                  _update_norm_observed(contexts(read_dx=True)),
                  _update_norm_observed(contexts(given=True))):
        assert other.scalars.keys() == chain.scalars.keys()
        for key, value in chain.scalars.items():
            assert float(other.scalars[key]) == float(value), key  # the same elementwise next - previous
        np.testing.assert_array_equal(other.histograms["update_norm/l2"], chain.histograms["update_norm/l2"])
    x = np.stack([s.double().numpy() for s in states])
    norms = np.sqrt(((x[1:] - x[:-1]).reshape(len(pairs), shape[0], -1) ** 2).sum(axis=2)).mean(axis=1)
    np.testing.assert_allclose(chain.histograms["update_norm/l2"], norms, rtol=1e-5)
    assert float(chain.scalars["update_norm/l2/mean"]) == pytest.approx(norms.mean(), rel=1e-5)
    if len(shape) == 4:  # [B, C, S, S] with C != S: the alive fraction of channel 3, read off the next states
        alive = (x[1:, :, 3] > 0.1).reshape(len(pairs), -1).mean(axis=1)
        assert float(chain.scalars["update_norm/alive/mean"]) == pytest.approx(alive.mean(), rel=1e-6)


def test_update_norm_given_dx_then_deferred_dx_in_one_step_keeps_iteration_order():
    states = [torch.full((4, 2), float(i * i)) for i in range(7)]
    contexts = [
        instrument.StepContext(a, b, dx=(b - a) if i % 3 == 0 else None, step_index=i)
        for i, (a, b) in enumerate(zip(states, states[1:], strict=False))
    ]
    record = _update_norm_observed(contexts)
    want = [np.sqrt(2.0) * (2 * i + 1) for i in range(6)]  # each of 4 samples: 2 elements of (i+1)^2 - i^2
    np.testing.assert_allclose(record.histograms["update_norm/l2"], want, rtol=1e-6)


@pytest.mark.parametrize("seed", ["broadcast", "float64"])
def test_update_norm_of_a_seed_of_another_shape_or_dtype_is_each_iterations_own_difference(seed):
    """A [1, 4] seed before [3, 4] states failed the log (its pair stacked with theirs), and a float64 seed before
    float32 states made every iteration's difference float64: the seed's pair is now differenced as it comes."""
    if seed == "broadcast":
        states, first = [torch.full((3, 4), float(i * i)) for i in range(1, 6)], torch.zeros(1, 4)
    else:  # states of +-3e38: each float32 difference overflows to inf, the float64 one would not
        states = [torch.full((3, 4), 3e38 * (-1) ** i) for i in range(5)]
        first = torch.zeros(3, 4, dtype=torch.float64)
    previous = [first, *states[:-1]]
    deferred = _update_norm_observed(
        [instrument.StepContext(a, b, step_index=i) for i, (a, b) in enumerate(zip(previous, states, strict=True))])
    given = _update_norm_observed(
        [instrument.StepContext(a, b, dx=b - a, step_index=i) for i, (a, b) in enumerate(zip(previous, states,
                                                                                                strict=True))])
    np.testing.assert_array_equal(deferred.histograms["update_norm/l2"], given.histograms["update_norm/l2"])
    if seed == "broadcast":
        want = [2.0 * (2 * i + 1) if i else 2.0 for i in range(5)]  # 4 elements of (i+1)^2 - i^2 per sample, 0 -> 1
        np.testing.assert_allclose(deferred.histograms["update_norm/l2"], want, rtol=1e-6)
    else:
        assert np.isinf(deferred.histograms["update_norm/l2"][1:]).all()


def test_in_place_change_after_observe_is_detected_not_logged(caplog):

    keep = Keep()
    inst = instrument.Instrumentation([instrument.IterationStats(channel_dim=-1)], backends=[keep], log_interval=1)
    for step in range(2):
        with inst.step(step) as s:
            x = torch.zeros(8, 3)
            for i in range(4):
                nxt = x + 1
                s.observer(instrument.StepContext(x, nxt, step_index=i))
                if step == 0:
                    nxt.mul_(100.0)  # a rollout that updates its state in place after observing it
                x = nxt
    inst.close()
    assert "modified in place after it was observed" in caplog.text
    assert [r.step for r in keep.records] == [1]  # the corrupted step logged nothing
    assert keep.records[0].scalars["iteration_stats/max/c0"] == 4.0  # the next step reduced as it came


def _numpy_stats(states: np.ndarray, channel_axis: int) -> np.ndarray:
    """[T, *state] float64 -> [T, 4, C] population mean/std/min/max per iteration and channel."""
    t = states.shape[0]
    per_channel = np.moveaxis(states, channel_axis + 1, 1).reshape(t, states.shape[channel_axis + 1], -1)
    return np.stack([per_channel.mean(2), per_channel.std(2), per_channel.min(2), per_channel.max(2)], axis=1)


@pytest.mark.parametrize("shape, channel_dim", [((3, 5, 8, 8), 1), ((1, 5, 8, 8), 1), ((512, 6), -1), ((2, 4, 260), 1)])
def test_stats_kernel_is_exact_for_a_large_mean_with_a_small_spread(shape, channel_dim):
    torch.manual_seed(1)
    states = (1e4 + 1e-2 * torch.randn(7, *shape)).float()
    want = _numpy_stats(states.double().numpy(), channel_dim % len(shape))
    for scratch in (False, True):
        got = iteration_channel_stats(states.clone(), channel_dim, scratch=scratch).double().numpy()
        np.testing.assert_allclose(got[:, 1], want[:, 1], rtol=1e-5)  # std
        np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=1e-7)  # mean: float32 rounding of 1e4 only
        np.testing.assert_array_equal(got[:, 2:], want[:, 2:])  # min and max are exact
    # The check can fail: E[x^2] - E[x]^2 in float32, without the shift, is wrong by orders of magnitude here.
    x = states
    c = channel_dim % len(shape) + 1
    dims = tuple(d for d in range(1, x.dim()) if d != c)
    naive = (x.square().mean(dims) - x.mean(dims).square()).clamp_min(0).sqrt().double().numpy()
    assert np.max(np.abs(naive - want[:, 1]) / want[:, 1]) > 1e-2


def test_stats_kernel_integer_half_and_empty_states():
    ints = torch.randint(-50, 50, (4, 3, 10), dtype=torch.int32)
    want = _numpy_stats(ints.double().numpy(), 1)
    np.testing.assert_allclose(iteration_channel_stats(ints).double().numpy(), want, rtol=1e-6, atol=1e-6)
    half = torch.randn(4, 3, 10).half()
    want = _numpy_stats(half.double().numpy(), 1)
    got = iteration_channel_stats(half)
    assert got.dtype == torch.float32  # accumulated in float32, not in half
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
    empty = iteration_channel_stats(torch.zeros(2, 0, 3, 4))
    assert empty.shape == (2, 4, 3) and bool(empty.isnan().all())


def test_buffer_reduces_large_cpu_states_as_they_come_and_small_ones_batched():
    calls = []

    def reduce(x, scratch):
        calls.append((x.shape[0], scratch))
        return iteration_channel_stats(x, scratch=scratch)

    small = IterationBuffer(reduce, batch_below=100)
    for _ in range(5):
        small.append(torch.randn(2, 3, 4))
    assert small.results().shape == (5, 4, 3) and calls == [(5, True)]  # one batched call on its own stack
    calls.clear()
    large = IterationBuffer(reduce, batch_below=10)
    state = torch.randn(2, 3, 4)
    for _ in range(3):
        large.append(state)
    assert large.results().shape == (3, 4, 3) and calls == [(1, False)] * 3  # views of the caller's state
    # Off the CPU every size is batched: reducing as they come would pay the kernel launches per iteration.
    calls.clear()
    elsewhere = IterationBuffer(lambda x, scratch: calls.append((x.shape[0], scratch)) or x.sum((1, 2, 3)),
                                batch_below=10)
    for _ in range(3):
        elsewhere.append(torch.empty(2, 3, 4, device="meta"))
    assert elsewhere.results().shape == (3,) and calls == [(3, True)]


@pytest.mark.parametrize("shape, channel_dim", [((64, 4), -1), ((2, 3, 4), 1), ((1, 5, 1), 1), ((6, 1), -1)])
@pytest.mark.parametrize("batched", [True, False])
def test_observing_never_changes_the_callers_state(shape, channel_dim, batched):
    states = [torch.randn(shape) + 5 for _ in range(4)]
    before = [s.clone() for s in states]
    observer = instrument.IterationStats(channel_dim=channel_dim)
    observer._states.batched = batched
    record = _observe(observer, states)
    for s, b in zip(states, before, strict=True):
        assert torch.equal(s, b)
    last = states[-1].double().numpy()
    per_channel = np.moveaxis(last, channel_dim % len(shape), 0).reshape(shape[channel_dim], -1)
    assert record.scalars["iteration_stats/std/c0"] == pytest.approx(per_channel[0].std(), rel=1e-5)


def test_large_mean_state_read_back_from_tensorboard_matches_float64(tmp_path):
    """A real run: IterationStats -> Logger -> TensorBoard event file -> EventAccumulator vs float64 NumPy."""
    torch.manual_seed(2)
    channels = 4
    offsets = torch.tensor([1e4, -3e3, 5e2, 0.0]).reshape(1, channels, 1, 1)
    states = [(offsets + 1e-2 * torch.randn(3, channels, 12, 12)).float() for _ in range(9)]
    scalars = iteration_stats_in_tensorboard(tmp_path, states)
    want = _numpy_stats(states[-1].double().numpy()[None], 1)[0]  # [4, C]
    for c in range(channels):
        assert scalars[f"iteration_stats/std/c{c}"][0] == pytest.approx(want[1, c], rel=1e-5)
        assert scalars[f"iteration_stats/mean/c{c}"][0] == pytest.approx(want[0, c], rel=2e-7, abs=1e-6)
        assert scalars[f"iteration_stats/min/c{c}"][0] == pytest.approx(want[2, c], rel=1e-7)
        assert scalars[f"iteration_stats/max/c{c}"][0] == pytest.approx(want[3, c], rel=1e-7)
    assert scalars["iteration_stats/iterations"][0] == 8.0


def test_states_made_under_inference_mode_are_reduced_as_they_come():
    with torch.inference_mode():
        states = [torch.randn(8, 3) + i for i in range(4)]
    keep = Keep()
    inst = instrument.Instrumentation([instrument.IterationStats(channel_dim=-1), instrument.UpdateNorm()],
                                      backends=[keep], log_interval=1)
    with inst.step(0) as s, torch.inference_mode():
        for i in range(3):
            s.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
    inst.close()
    assert not inst.failures
    want = states[-1].double().numpy()
    assert keep.records[0].scalars["iteration_stats/std/c1"] == pytest.approx(want[:, 1].std(), rel=1e-5)
    assert keep.records[0].scalars["iteration_stats/iterations"] == 3.0


# ------------------------------------------------------------------ heatmaps people can compare, channel names
def _pngs(log_dir, tag):
    """The heatmap images of ``tag`` as TensorBoard stored them, decoded: {step: [H, W, 3] uint8}."""
    import io

    from PIL import Image

    from tests.conftest import event_accumulator

    acc = event_accumulator(log_dir)
    return {e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
            for e in acc.Images(tag)}


def _cell(image, rows, cols, r, c):
    from instrument.logger.render import heatmap_geometry

    left, top, cw, ch = heatmap_geometry(rows, cols)
    return tuple(image[top + r * ch + ch // 2, left + c * cw + cw // 2])


def _log_two_heatmaps(tmp_path, color_range):
    steps = {0: np.array([[0.0, 0.5], [1.0, -1.0]]), 1: np.array([[0.0, 0.5], [3.0, -5.0]])}
    logger = instrument.Logger([instrument.TensorBoardBackend(log_dir=str(tmp_path))])
    for step, matrix in steps.items():
        logger.log_heatmap("hm", torch.from_numpy(matrix), step, x_ticks=("a", "b"), color_range=color_range)
        logger.commit(step)
    logger.close()
    return _pngs(tmp_path, "hm")


def test_fixed_color_range_gives_a_value_the_same_colour_at_every_step(tmp_path):
    from instrument.logger.render import _LUT

    fixed = _log_two_heatmaps(tmp_path / "fixed", (-1.0, 1.0))
    for r, c, value in ((0, 0, 0.0), (0, 1, 0.5)):
        assert _cell(fixed[0], 2, 2, r, c) == _cell(fixed[1], 2, 2, r, c)
        assert _cell(fixed[0], 2, 2, r, c) == tuple(_LUT[round((value + 1.0) / 2.0 * 255)])
    assert _cell(fixed[1], 2, 2, 1, 0) == tuple(_LUT[255])  # 3.0 lies above the range: the top colour
    own = _log_two_heatmaps(tmp_path / "own", None)  # each image scaled to its own values: colours drift
    assert _cell(own[0], 2, 2, 0, 0) != _cell(own[1], 2, 2, 0, 0)


def test_running_color_range_is_the_range_seen_so_far(tmp_path):
    from instrument.logger.render import _LUT

    running = _log_two_heatmaps(tmp_path, "running")
    assert _cell(running[0], 2, 2, 0, 0) == tuple(_LUT[round(1.0 / 2.0 * 255)])  # step 0: range (-1, 1)
    assert _cell(running[1], 2, 2, 0, 0) == tuple(_LUT[round(5.0 / 8.0 * 255)])  # step 1: range (-5, 3)


def test_color_bar_has_round_intermediate_ticks():
    from instrument.logger.render import colorbar_ticks

    values = sorted(v for v, _ in colorbar_ticks(-1.0, 1.0, 256))
    assert values == [-1.0, -0.5, 0.0, 0.5, 1.0]
    ticks = colorbar_ticks(0.013, 0.97, 256)
    assert len(ticks) > 3 and all(round(v, 6) == round(v, 1) for v, _ in ticks[2:])
    assert colorbar_ticks(0.0, 1.0, 20) == [(1.0, 0), (0.0, 19)]  # too short for more


def test_bad_color_range_and_x_ticks_are_refused_clearly():
    logger = instrument.Logger([])
    with pytest.raises(instrument.InvalidValueError, match=r"lo < hi, got \(1, 0\)"):
        logger.log_heatmap("hm", torch.zeros(2, 2), 0, color_range=(1, 0))
    with pytest.raises(instrument.InvalidValueError, match="'running' \\(the range seen so far\\)"):
        logger.log_heatmap("hm", torch.zeros(2, 2), 0, color_range="auto")
    with pytest.raises(instrument.InvalidValueError, match="got 1 x_ticks for a matrix of 2 columns"):
        logger.log_heatmap("hm", torch.zeros(2, 2), 0, x_ticks=["a"])
    with pytest.raises(instrument.ConfigurationError, match="not among its heatmaps"):
        instrument.IterationStats(color_range={"median": (0, 1)})
    # two characters or two keys are not a pair of bounds: refused, not read as (0, 1)
    for bad, kind in (("01", "str"), (b"01", "bytes"), ({0.0: "a", 1.0: "b"}, "dict")):
        with pytest.raises(instrument.InvalidValueError, match=rf"got .* \(a {kind}\); give the bounds as numbers"):
            logger.log_heatmap("hm", torch.zeros(2, 2), 0, color_range=bad)
    for bad in ("01", {"mean": "01"}, {"mean": {0: 1, 1: 2}}):
        with pytest.raises(instrument.ConfigurationError, match=r"give the bounds as numbers, e\.g\. \(0\.0, 1\.0\)"):
            instrument.IterationStats(color_range=bad)
    assert instrument.IterationStats(color_range={"mean": (0, 1)}).color_range["mean"] == (0.0, 1.0)  # per stat
    logger.close()


def test_iteration_stats_channel_names_and_fixed_range_read_back_from_tensorboard(tmp_path):
    names = ("x", "v", "theta", "omega")
    g = torch.Generator().manual_seed(3)
    inst = instrument.Instrumentation(
        [instrument.IterationStats(channel_dim=-1, channel_names=names, color_range={"mean": (-4.0, 4.0)})],
        backends=[instrument.TensorBoardBackend()], log_interval=1, log_dir=str(tmp_path), run_name="r",
    )
    last = {}
    for step in (0, 1):
        states = [torch.randn(32, 4, generator=g) * (step + 1) for _ in range(5)]
        for s in states:
            s[:, 0] = 0.25  # channel x: the same mean at every iteration and step
        with inst.step(step) as scope:
            for i in range(4):
                scope.observer(instrument.StepContext(states[i], states[i + 1], step_index=i))
        last[step] = states[-1].double().numpy()
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    for k, n in enumerate(names):
        assert scalars[f"iteration_stats/std/{n}"][1] == pytest.approx(last[1][:, k].std(), rel=1e-5)
    assert not any("/c0" in key for key in scalars)
    images = _pngs(tmp_path / "r", "iteration_stats/mean")
    assert _cell(images[0], 4, 4, 2, 0) == _cell(images[1], 4, 4, 2, 0)  # fixed range: x's colour holds
    assert images[0].shape == images[1].shape


def test_channel_names_of_the_wrong_length_say_so():
    observer = instrument.IterationStats(channel_dim=-1, channel_names=("x", "v"))
    with pytest.raises(instrument.ConfigurationError, match=r"got 2 channel_names \['x', 'v'\] for a state with 4"):
        _observe(observer, [torch.randn(8, 4) for _ in range(3)])
    with pytest.raises(instrument.ConfigurationError, match="must be unique"):
        instrument.IterationStats(channel_names=("x", "x"))
    with pytest.raises(instrument.ConfigurationError, match="list or tuple of strings"):
        instrument.IterationStats(channel_names="xv")


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("form", ["hooks", "scripted evolver"])
def test_the_headline_logging_step_reads_nothing_to_the_host_on_the_training_thread(tmp_path, form):
    """The bench's headline step (IterationStats with heatmaps, UpdateNorm, TensorBoard, JSONL), watched with
    hooks or fed by an explicit evolver around a scripted rule, under `NoHostSync` (``.item()``, ``.tolist()``,
    ``bool()``, ``float()``, ``.cpu()``, ``.numpy()``...; not ``.to("cpu")``, which a CPU run cannot tell from
    any other ``.to``): on a GPU each such read would be a sync. An observer that read a value would be reported
    and skipped, not raised, so the test also checks that nothing failed and that the step's values were
    written."""
    from instrument.demos.nca import UpdateRule
    from tests.conftest import NoHostSync

    torch.manual_seed(0)
    rule = UpdateRule(channels=8, hidden=16)
    with torch.no_grad():
        for p in rule.parameters():
            p.normal_(0.0, 0.05)  # the demo's last layer starts at zero, which would make every update zero
    runner = torch.jit.script(rule) if form == "scripted evolver" else rule
    inst = instrument.Instrumentation(
        observers=[instrument.IterationStats(), instrument.UpdateNorm()],
        backends=[instrument.TensorBoardBackend(), instrument.JsonlBackend()], log_interval=1, run_name="r",
        log_dir=str(tmp_path),
    )
    if form == "hooks":
        inst.watch(rule)
    x0 = torch.rand(2, 8, 12, 12, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        with NoHostSync(), inst.step(step) as s:
            x = x0
            for i in range(4):
                nxt = runner(x)
                if form != "hooks":
                    s.observer(instrument.StepContext(previous_state=x, next_state=nxt, step_index=i))
                x = nxt
            loss = x.square().mean()
            loss.backward()
            inst.logger.log_metrics({"loss": loss.detach()}, step=step, prefix="train")
    assert inst.failures == {}
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    assert scalars["iteration_stats/iterations"] == {0: 4.0, 1: 4.0, 2: 4.0}
    assert set(scalars["update_norm/l2/mean"]) == {0, 1, 2} and set(scalars["train/loss"]) == {0, 1, 2}
    assert len(_pngs(tmp_path / "r", "iteration_stats/mean")) == 3


def _records_in_pieces(make, states, monkeypatch, piece_bytes):
    """The record of ``make()`` observing ``states``, with CPU stacks split into ``piece_bytes`` pieces (None:
    the default, one piece for these small states), and how many pieces its buffers reduced."""
    import instrument.observers.buffer as buffer_module

    reduced = []
    original = IterationBuffer.drain

    def counting_drain(self):
        before = len(self._results)
        original(self)
        reduced.append(len(self._results) - before)

    with monkeypatch.context() as patch:
        if piece_bytes is not None:
            patch.setattr(buffer_module, "PIECE_BYTES", piece_bytes)
        patch.setattr(IterationBuffer, "drain", counting_drain)
        record = _observe(make(), states)
    return record, sum(reduced)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: instrument.IterationStats(), (2, 5, 6, 6)),
        (lambda: instrument.IterationStats(channel_dim=-1), (64, 4)),  # channels last: the transposed copy
        (lambda: instrument.UpdateNorm(), (2, 5, 6, 6)),  # pairs: the chain of states stacked as one
        (lambda: instrument.NonFinite(), (2, 5, 6, 6)),  # two buffers: the states and dx
    ],
)
def test_large_cpu_stacks_are_reduced_in_pieces_with_the_same_values(monkeypatch, make, shape):
    """Every reduction is per iteration, so reducing a stack in cache-sized pieces (`PIECE_BYTES`) must give
    the same numbers, bit for bit, as one batched call: here with pieces of one, two and three iterations."""
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(shape, generator=g) * 3 + 10 for _ in range(8)]
    states[5][0, 1] = float("nan")  # NonFinite has something to count
    whole, buffers = _records_in_pieces(make, states, monkeypatch, None)  # one piece per buffer
    one_state = states[0].numel() * states[0].element_size()
    for rows in (1, 2, 3):
        split, pieces = _records_in_pieces(make, states, monkeypatch, rows * one_state)
        assert pieces > buffers
        assert split.scalars.keys() == whole.scalars.keys()
        for key, value in whole.scalars.items():
            assert split.scalars[key] == value or (np.isnan(value) and np.isnan(split.scalars[key])), key
        for tag, image in whole.images.items():
            np.testing.assert_array_equal(split.images[tag], image)
        for tag, values in whole.histograms.items():
            np.testing.assert_array_equal(split.histograms[tag], values)


def test_activation_stats_reduced_in_pieces_gives_the_same_values(monkeypatch):
    """`ActivationStats` keeps its hooked outputs in the same buffers: reduced in pieces of one, two and three
    calls, its scalars and heatmaps are the same, bit for bit, as from one batched call."""
    import instrument.observers.buffer as buffer_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inputs = [torch.randn(64, 4) * 5 for _ in range(8)]

    def record(piece_bytes):
        with monkeypatch.context() as patch:
            if piece_bytes is not None:
                patch.setattr(buffer_module, "PIECE_BYTES", piece_bytes)
            observer = instrument.ActivationStats(module=model)
            keep = Keep()
            logger = instrument.Logger([keep])
            observer.attach([])
            with torch.no_grad():
                for x in inputs:
                    model(x)
            observer.detach()
            observer.log(logger, step=0)
            logger.commit()
            logger.close()
        return keep.records[0]

    whole = record(None)
    assert whole.scalars and whole.images
    one_call = 64 * 8 * 4  # bytes of the larger output, [64, 8] float32
    for rows in (1, 2, 3):
        split = record(rows * one_call)
        assert split.scalars == whole.scalars
        for tag, image in whole.images.items():
            np.testing.assert_array_equal(split.images[tag], image)


def test_observe_set_on_the_instance_or_a_call_only_observer_is_still_called():
    """A review found both skipped after the base observe became a no-op (the check read the class)."""
    seen = []

    class Fast(instrument.Observer):
        def __init__(self):
            super().__init__("fast")
            self.observe = lambda context: seen.append(("fast", context.step_index))

    class Called(instrument.Observer):
        def __call__(self, context):
            seen.append(("called", context.step_index))

    class LogOnly(instrument.Observer):  # reads no iterations: never called per iteration
        def log(self, logger, step):
            seen.append(("log", step))

    inst = instrument.Instrumentation([Fast(), Called(), LogOnly()], backends=[], log_interval=1)
    with inst.step(0) as s:
        for i in range(2):
            s.observer(instrument.StepContext(torch.zeros(1), torch.ones(1), step_index=i))
    inst.close()
    assert sorted(seen) == [("called", 0), ("called", 1), ("fast", 0), ("fast", 1), ("log", 0)]
    assert inst.failures == {} and [name for _, name, _ in inst._dispatch._build_observing()] == ["fast", "called"]


def test_builtins_without_per_iteration_work_are_left_out_of_the_per_iteration_calls():
    """ActivationStats reads its hooks and GradientStats the gradients: a no-op ``observe`` of their own would be
    called on every iteration of every logging step for nothing."""
    model = nn.Sequential(nn.Linear(3, 3))
    observers = [instrument.ActivationStats(module=model), instrument.GradientStats(module=model),
                 instrument.IterationStats()]
    inst = instrument.Instrumentation(observers, backends=[], log_interval=1)
    try:
        assert [name for _, name, _ in inst._dispatch._build_observing()] == ["iteration_stats"]
    finally:
        inst.close()


def test_std_stays_within_1e5_when_the_shift_sample_lands_on_a_border_unlike_the_rest():
    """On a grid whose side is a multiple of 32 every sample of the shift reference fell in column 0; with that
    column empty (an NCA border) E[d^2] - E[d]^2 cancelled and the std was 2e-5 to 1e-4 off. Float64 NumPy."""
    from instrument.observers.activation_stats import _finish, batched_moments

    g = torch.Generator().manual_seed(0)
    x = 1.0 + 1e-3 * torch.randn(2, 1, 1024, 1024, generator=g, dtype=torch.float64)
    x[..., 0] = 0.0
    state = x.float()
    want = state.double().numpy()
    got = iteration_channel_stats(state.unsqueeze(0), channel_dim=1)[0]  # [4, C]
    assert float(got[1, 0]) == pytest.approx(want.std(), rel=1e-5)
    assert float(got[0, 0]) == pytest.approx(want.mean(), rel=1e-6)
    moments = _finish(batched_moments(state.unsqueeze(0)))[0]  # ActivationStats: mean, std, absmax, zero_frac
    assert float(moments[1]) == pytest.approx(want.std(), rel=1e-5)
    assert float(moments[0]) == pytest.approx(want.mean(), rel=1e-6)


class _Nudge(nn.Module):
    def forward(self, x):
        return x + 0.01 * torch.sin(3 * x + 1)


@pytest.mark.parametrize("seed_shape, offset", [((4, 16, 40, 40), 1e3), ((1, 16, 512, 512), 0.0)])
def test_update_norm_of_many_values_per_sample_is_within_2e6_of_float64(tmp_path, seed_shape, offset):
    """vector_norm sums its squares one after the other on a CPU: 25,600 values per sample near 1e3 read 1.1e-5
    off, 4M values (reduced as they come) 6e-5. The norms are sums of squares now (pairwise). JSONL read back."""
    g = torch.Generator().manual_seed(0)
    x = offset + torch.rand(*seed_shape, generator=g)
    inst = instrument.Instrumentation([instrument.UpdateNorm()], backends=[instrument.JsonlBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r", overhead_budget=None)
    states = watched_rollout(inst, _Nudge(), x, 3)
    (line,) = [json.loads(s) for s in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"step"' in s]
    s64 = [s.double().numpy().reshape(seed_shape[0], -1) for s in states]
    norms = [np.sqrt(((b - a) ** 2).sum(axis=1)).mean() for a, b in zip(s64, s64[1:], strict=False)]
    for key, want in (("first", norms[0]), ("last", norms[-1]), ("mean", np.mean(norms)), ("max", max(norms))):
        assert line["metrics"][f"update_norm/l2/{key}"] == pytest.approx(want, rel=2e-6), key


def test_update_norm_of_a_1d_state_is_the_batch_mean_of_each_samples_change():
    """A [B] state is B samples of one value (dim 0 is the batch, as everywhere): the norm was taken over the
    whole batch at once (one sample of B values)."""
    states = [torch.tensor([0.0, 1.0, -2.0, 4.0]) * (i + 1) for i in range(3)]
    record = _update_norm_observed(instrument.StepContext(a, b, step_index=i)
                                   for i, (a, b) in enumerate(zip(states, states[1:], strict=False)))
    x = np.stack([s.double().numpy() for s in states])
    want = np.abs(x[1:] - x[:-1]).mean(axis=1)
    np.testing.assert_allclose(record.histograms["update_norm/l2"], want, rtol=1e-7)
    assert float(record.scalars["update_norm/l2/first"]) == pytest.approx(want[0], rel=1e-7)
