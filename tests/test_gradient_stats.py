"""GradientStats: norms read back from real TensorBoard files against a float64 reference, equal to
``clip_grad_norm_``, a pure side channel (bitwise-equal parameters and gradients on and off), under gradient
checkpointing, in the watched-module and explicit-evolver styles, with its filters and groupings."""

from typing import Dict, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import instrument
from instrument import GradientStats, Instrumentation, StepContext
from instrument.errors import ConfigurationError
from tests.conftest import event_accumulator, read_scalars
from tests.test_checkpointing import Sink, fresh_rule, train_step


class Rule(nn.Module):
    """One NCA-like iteration with a nested submodule, so parameter names have dots at two depths."""

    def __init__(self, channels: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.perceive = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.mlp = nn.Sequential(nn.Conv2d(2 * channels, hidden, 1), nn.ReLU(), nn.Conv2d(hidden, channels, 1))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.scale * self.mlp(self.perceive(x))


def make(seed: int = 0) -> Rule:
    torch.manual_seed(seed)
    return Rule()


def train(rule: Rule, inst, steps: int, n_iter: int = 4, evolver: bool = False, clip: bool = False):
    """Adam on a growth-like loss; returns, per step, float64 host copies of weights before/after and grads."""
    opt = torch.optim.Adam(rule.parameters(), lr=1e-2)
    seen: List[Dict[str, Dict[str, np.ndarray]]] = []
    totals = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.rand(2, 4, 6, 6)
        before = {n: p.detach().double().numpy().copy() for n, p in rule.named_parameters()}
        with (inst.step(step) if inst is not None else _null()) as s:
            opt.zero_grad()
            for i in range(n_iter):
                nxt = rule(x)
                if evolver and s is not None and s.observer is not None:
                    s.observer(StepContext(x, nxt, step_index=i))
                x = nxt
            F.mse_loss(x, torch.full_like(x, 0.25)).backward()
            if clip:  # max_norm=inf: returns the norm and scales by exactly 1.0 (gradients unchanged)
                totals.append(torch.nn.utils.clip_grad_norm_(rule.parameters(), float("inf")))
            grads = {n: p.grad.detach().double().numpy().copy() for n, p in rule.named_parameters()}
            opt.step()
        after = {n: p.detach().double().numpy().copy() for n, p in rule.named_parameters()}
        seen.append({"before": before, "after": after, "grad": grads})
    return seen, totals


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_tensorboard_values_match_a_float64_reference_and_clip_grad_norm(tmp_path):
    rule = make()
    inst = Instrumentation([GradientStats()], backends=[instrument.TensorBoardBackend()], log_interval=2,
                           log_dir=str(tmp_path), run_name="r")
    inst.watch(rule)
    seen, totals = train(rule, inst, steps=5, clip=True)
    inst.close()
    assert not inst.failures
    scalars = read_scalars(tmp_path / "r")
    names = [n for n, _ in rule.named_parameters()]
    assert {"perceive.weight", "mlp.0.bias", "mlp.2.weight", "scale"} <= set(names)
    for step in (0, 2, 4):
        ref = seen[step]
        grad_norms = {n: np.linalg.norm(ref["grad"][n].ravel()) for n in names}
        total = np.sqrt(sum(v**2 for v in grad_norms.values()))
        assert scalars["grad_stats/norm/global"][step] == pytest.approx(total, rel=1e-6)
        # what clip_grad_norm_ returned on the same gradients, bit for bit (TensorBoard stores float32)
        assert scalars["grad_stats/norm/global"][step] == totals[step].item()
        for n in names:
            w0, w1 = ref["before"][n].ravel(), ref["after"][n].ravel()
            assert scalars[f"grad_stats/norm/{n}"][step] == pytest.approx(grad_norms[n], rel=1e-6)
            assert scalars[f"grad_stats/weight_norm/{n}"][step] == pytest.approx(np.linalg.norm(w1), rel=1e-6)
            ratio = np.linalg.norm(w1 - w0) / np.linalg.norm(w0)
            assert scalars[f"grad_stats/update_ratio/{n}"][step] == pytest.approx(ratio, rel=1e-4)
    assert set(scalars["grad_stats/norm/global"]) == {0, 2, 4}  # logging steps only


def test_global_norm_is_bitwise_what_clip_grad_norm_returns_in_memory():
    rule = make(3)
    sink = Sink()
    inst = Instrumentation([GradientStats(per="global")], backends=[sink], log_interval=1)
    inst.watch(rule)
    _, totals = train(rule, inst, steps=2, clip=True)
    inst.close()
    for record, total in zip(sink.records, totals, strict=True):
        assert record.scalars["grad_stats/norm/global"] == float(total)
        assert {k for k in record.scalars if k.startswith("grad_stats")} == {"grad_stats/norm/global"}  # one key


def test_histograms_in_tensorboard(tmp_path):
    rule = make()
    inst = Instrumentation([GradientStats(histograms=True, update_ratio=False)],
                           backends=[instrument.TensorBoardBackend()], log_interval=1, log_dir=str(tmp_path),
                           run_name="h")
    inst.watch(rule)
    seen, _ = train(rule, inst, steps=1)
    inst.close()
    acc = event_accumulator(tmp_path / "h")
    tags = set(acc.Tags()["histograms"])
    for n, p in rule.named_parameters():
        assert f"grad_stats/grad_hist/{n}" in tags and f"grad_stats/weight_hist/{n}" in tags
        (grad_hist,) = acc.Histograms(f"grad_stats/grad_hist/{n}")
        assert grad_hist.histogram_value.num == p.numel()
        g = seen[0]["grad"][n]
        assert grad_hist.histogram_value.min == pytest.approx(g.min(), rel=1e-6, abs=1e-12)
        assert grad_hist.histogram_value.max == pytest.approx(g.max(), rel=1e-6, abs=1e-12)
        (weight_hist,) = acc.Histograms(f"grad_stats/weight_hist/{n}")
        assert weight_hist.histogram_value.sum == pytest.approx(seen[0]["after"][n].sum(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("evolver", [False, True])
def test_pure_side_channel_parameters_and_gradients_bitwise_equal(evolver):
    off = make()
    seen_off, _ = train(off, None, steps=3, evolver=evolver)
    on = make()
    observers = [GradientStats(module=on if evolver else None, histograms=True, per="module"),
                 instrument.NonFinite(module=on if evolver else None)]
    inst = Instrumentation(observers, backends=[Sink()], log_interval=1)
    if not evolver:
        inst.watch(on)
    seen_on, _ = train(on, inst, steps=3, evolver=evolver)
    inst.close()
    assert not inst.failures
    for a, b in zip(seen_off, seen_on, strict=True):
        for part in ("grad", "after"):
            for n in a[part]:
                assert np.array_equal(a[part][n], b[part][n]), (part, n)
    for (n, p_off), (_, p_on) in zip(off.named_parameters(), on.named_parameters(), strict=True):
        assert torch.equal(p_off, p_on) and torch.equal(p_off.grad, p_on.grad), n


def test_explicit_evolver_style_names_the_module():
    rule = make()
    sink = Sink()
    inst = Instrumentation([GradientStats(module=rule)], backends=[sink], log_interval=1)
    seen, _ = train(rule, inst, steps=1, evolver=True)  # nothing watched: module= says which parameters
    inst.close()
    want = np.linalg.norm(seen[0]["grad"]["mlp.2.weight"].ravel())
    assert sink.records[0].scalars["grad_stats/norm/mlp.2.weight"] == pytest.approx(want, rel=1e-6)


def test_nothing_kept_or_registered_on_non_logging_steps():
    rule = make()
    stats = GradientStats()
    inst = Instrumentation([stats], backends=[Sink()], log_interval=3)
    inst.watch(rule)
    opt = torch.optim.SGD(rule.parameters(), lr=0.1)
    for step in range(4):
        with inst.step(step):
            opt.zero_grad()
            rule(torch.rand(1, 4, 5, 5)).sum().backward()
            opt.step()
            if step in (1, 2):  # a non-logging step: no snapshot, no hook
                assert stats._before is None and stats._update is None
            if step == 3:  # a logging step holds its snapshot until detach
                assert stats._before is not None
        assert stats._before is None  # released at the end of every logging step
        assert not any(m._forward_hooks or m._backward_hooks for m in rule.modules())
    inst.close()


def test_snapshot_released_when_the_step_raises():
    rule = make()
    stats = GradientStats()
    inst = Instrumentation([stats], backends=[Sink()], log_interval=1)
    inst.watch(rule)
    with pytest.raises(RuntimeError, match="boom"):
        with inst.step(0):
            raise RuntimeError("boom")
    assert stats._before is None
    inst.close()


def test_per_module_groups_and_filters():
    rule = make()
    sink = Sink()
    inst = Instrumentation(
        [GradientStats(per="module", name="by_module"), GradientStats(include=r"^mlp\.", exclude=r"bias$")],
        backends=[sink], log_interval=1,
    )
    inst.watch(rule)
    seen, _ = train(rule, inst, steps=1)
    inst.close()
    scalars = sink.records[0].scalars
    grads = seen[0]["grad"]
    for module, members in {"perceive": ["perceive.weight", "perceive.bias"],
                            "mlp.0": ["mlp.0.weight", "mlp.0.bias"], "Rule": ["scale"]}.items():
        want = np.sqrt(sum(np.sum(grads[m] ** 2) for m in members))
        assert scalars[f"by_module/norm/{module}"] == pytest.approx(want, rel=1e-6)
        assert f"by_module/update_ratio/{module}" in scalars
    filtered = {k for k in scalars if k.startswith("grad_stats/norm/")}
    assert filtered == {"grad_stats/norm/global", "grad_stats/norm/mlp.0.weight", "grad_stats/norm/mlp.2.weight"}
    want = np.sqrt(np.sum(grads["mlp.0.weight"] ** 2) + np.sum(grads["mlp.2.weight"] ** 2))
    assert scalars["grad_stats/norm/global"] == pytest.approx(want, rel=1e-6)


class _TwoBranch(nn.Module):
    """A global/local two-branch model: a submodule and a root parameter named ``global``."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("global", nn.Linear(4, 4))
        self.local = nn.Linear(4, 4)

    def forward(self, x):
        return getattr(self, "global")(x).sum() + 10 * self.local(x).sum()


@pytest.mark.parametrize("per", ["module", "param"])
def test_a_submodule_or_parameter_named_global_does_not_overwrite_the_global_norm(per):
    """Its key was norm/global: the module's own norm replaced the global one, unsaid (a review)."""
    torch.manual_seed(0)
    net = _TwoBranch()
    if per == "param":  # a root parameter named global instead of the submodule
        net = nn.Module()
        net.register_parameter("global", nn.Parameter(torch.randn(3)))
        net.register_parameter("local", nn.Parameter(torch.randn(3)))
    sink = Sink()
    inst = Instrumentation([GradientStats(module=net, per=per, histograms=per == "param")], backends=[sink],
                           log_interval=1)
    with inst.step(0):
        net.zero_grad()
        loss = net(torch.randn(3, 4)) if per == "module" else (getattr(net, "global") + 10 * net.local).sum()
        loss.backward()
    inst.close()
    scalars = sink.records[0].scalars
    grads = {name: p.grad.double().numpy() for name, p in net.named_parameters()}
    want = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
    assert scalars["grad_stats/norm/global"] == pytest.approx(want, rel=1e-6)
    root = type(net).__name__
    own = np.sqrt(sum(np.sum(g ** 2) for name, g in grads.items() if name.startswith("global")))
    assert scalars[f"grad_stats/norm/{root}.global"] == pytest.approx(own, rel=1e-6)
    assert f"grad_stats/weight_norm/{root}.global" in scalars and "grad_stats/weight_norm/global" not in scalars
    if per == "param":
        assert f"grad_stats/grad_hist/{root}.global" in sink.records[0].histograms


def test_under_gradient_checkpointing_values_and_gradients_unchanged():
    """The checkpointed step gives the norms of the plain step, and gradients bitwise equal to observers off."""
    values = {}
    for mode in ("none", "reentrant", "nonreentrant", "chunked"):
        _, grads_off = train_step(fresh_rule(), mode)
        rule = fresh_rule()
        sink = Sink()
        inst = Instrumentation([GradientStats(), instrument.NonFinite()], backends=[sink], log_interval=1)
        inst.watch(rule)
        with inst.step(0):
            _, grads_on = train_step(rule, mode)
        inst.close()
        assert not inst.failures
        for n in grads_off:
            assert torch.equal(grads_off[n], grads_on[n]), (mode, n)
        values[mode] = sink.records[0].scalars
        assert values[mode]["nonfinite/count"] == 0.0 and values[mode]["nonfinite/first_iteration"] == -1.0
    for mode, scalars in values.items():
        for key, value in values["none"].items():
            if key.startswith("grad_stats/norm/"):
                assert scalars[key] == pytest.approx(value, rel=1e-5), (mode, key)


def test_parameters_without_gradients_are_left_out():
    rule = make()
    sink = Sink()
    inst = Instrumentation([GradientStats()], backends=[sink], log_interval=1)
    inst.watch(rule)
    with inst.step(0):
        rule.mlp(torch.rand(1, 8, 3, 3)).sum().backward()  # perceive and scale get no gradient
    inst.close()
    norms = {k for k in sink.records[0].scalars if k.startswith("grad_stats/norm/")}
    assert norms == {"grad_stats/norm/global"} | {f"grad_stats/norm/mlp.{i}.{w}" for i in (0, 2)
                                                   for w in ("weight", "bias")}
    assert "grad_stats/weight_norm/scale" in sink.records[0].scalars


def test_bad_arguments_say_what_was_received():
    with pytest.raises(ConfigurationError, match="per must be one of"):
        GradientStats(per="layer")
    with pytest.raises(ConfigurationError, match="torch.nn.Module, got str"):
        GradientStats(module="model")
    with pytest.raises(ConfigurationError, match="not a valid regex"):
        GradientStats(include="(")
    with pytest.raises(ConfigurationError, match="got int"):
        GradientStats(exclude=[3])


def test_gin_binds_it(tmp_path):
    import gin

    import instrument.config  # noqa: F401  (registers the configurables)

    gin.clear_config()
    try:
        instrument.parse_config(bindings=["GradientStats.per = 'module'", "GradientStats.histograms = True"])
        stats = gin.get_configurable("instrument.GradientStats")()
        assert stats.per == "module" and stats.histograms
    finally:
        gin.clear_config()


@pytest.mark.parametrize("per", ["param", "module", "global"])
def test_no_host_read_before_the_logger_transfer(per, tmp_path):
    """attach, detach and log read nothing back to the host (on a GPU: no sync); the values still arrive."""
    from instrument.backends.base import RunInfo
    from instrument.backends.jsonl import JsonlBackend
    from instrument.logger.logger import Logger
    from tests.conftest import NoHostSync

    rule = make()
    opt = torch.optim.SGD(rule.parameters(), lr=0.1)
    stats = GradientStats(per=per, histograms=True)
    logger = Logger([JsonlBackend(path=str(tmp_path / "m.jsonl"))], RunInfo("sync", tmp_path))
    stats.reset()
    with NoHostSync():
        stats.attach([rule])
    rule(torch.rand(1, 4, 5, 5)).square().sum().backward()
    opt.step()
    with NoHostSync(), torch.no_grad():
        stats.detach()
        stats.log(logger, 0)
    record = logger.commit(0).result()
    logger.close()
    assert record.scalars["grad_stats/norm/global"] > 0
    with pytest.raises(AssertionError, match="host read item"), NoHostSync():
        torch.ones(1).item()  # the guard itself works


def test_a_sparse_gradient_is_left_out_of_the_norms_and_checked_by_nonfinite_through_its_values(tmp_path, caplog):
    """nn.Embedding(sparse=True): _foreach_norm and isfinite have no sparse kernels, so GradientStats and NonFinite
    failed in log at every step and every other parameter's values of the step were lost."""
    import json
    import logging

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return x + self.lin(x)

    torch.manual_seed(0)
    model = Model()
    path = tmp_path / "m.jsonl"
    inst = Instrumentation([GradientStats(module=model, histograms=True), instrument.NonFinite(module=model)],
                           backends=[instrument.JsonlBackend(str(path))], log_interval=1, log_dir=str(tmp_path))
    inst.watch(model)
    scale = torch.tensor([[1.0, 1.0, 1.0, 1.0], [float("inf"), 1.0, 1.0, 1.0]])
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        y = model(torch.linspace(-1, 1, 12).reshape(3, 4))
        (y.square().sum() + (model.emb(torch.tensor([1, 3])) * scale).sum()).backward()
        want = {name: np.linalg.norm(p.grad.double().numpy()) for name, p in model.lin.named_parameters()}
    inst.close()
    metrics = json.loads(path.read_text().splitlines()[-1])["metrics"]
    assert inst.failures == {}
    assert "grad_stats/norm/emb.weight" not in metrics
    for name, norm in want.items():
        assert metrics[f"grad_stats/norm/lin.{name}"] == pytest.approx(norm, rel=1e-6)
    assert metrics["grad_stats/norm/global"] == pytest.approx(np.sqrt(sum(n * n for n in want.values())), rel=1e-6)
    assert metrics["nonfinite/grad_count/emb.weight"] == 1.0 and metrics["nonfinite/grad_count"] == 1.0
    assert len([r for r in caplog.records if "are sparse" in r.getMessage()]) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weight_norms_and_update_ratios_are_computed_in_float32(dtype, tmp_path):
    """A float16 weight whose norm is above 65504 read inf, and bfloat16 norms kept 3 significant digits
    (95.0 for 94.875): they were computed in the weights' dtype. Gradient norms stay those of clip_grad_norm_.
    Float64 NumPy reference, read back from JSONL."""
    import json

    torch.manual_seed(0)
    model = nn.Linear(100, 100, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.rand(100, 100) * 2000.0 if dtype == torch.float16 else torch.randn(100, 100))
    path = tmp_path / "m.jsonl"
    inst = Instrumentation([GradientStats(module=model)], backends=[instrument.JsonlBackend(str(path))],
                           log_interval=1, log_dir=str(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with inst.step(0):
        before = model.weight.detach().double().numpy().copy()
        model(torch.ones(2, 100, dtype=dtype) * 1e-3).float().sum().backward()
        opt.step()
        after = model.weight.detach().double().numpy().copy()
    inst.close()
    metrics = json.loads(path.read_text().splitlines()[-1])["metrics"]
    assert inst.failures == {}
    assert metrics["grad_stats/weight_norm/weight"] == pytest.approx(np.linalg.norm(after), rel=1e-5)
    assert metrics["grad_stats/update_ratio/weight"] == pytest.approx(
        np.linalg.norm(after - before) / np.linalg.norm(before), rel=1e-5)



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_update_is_subtracted_in_float32(dtype):
    """The update w_after - w_before was taken in the weights' own dtype, so a weight that changes sign lost
    digits: bfloat16 1 + 2**-7 -> -2**-9 read an update ratio of 1.0 for 1.0019 (float64)."""
    bits = 8 if dtype == torch.bfloat16 else 11  # the significand's: the difference needs two more
    model = nn.Linear(2, 1, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1 + 2.0 ** (1 - bits), 0.75]]))
    sink = Sink()
    inst = Instrumentation([GradientStats(module=model)], backends=[sink], log_interval=1)
    with inst.step(0), torch.no_grad():
        before = model.weight.double().clone()
        model.weight.copy_(torch.tensor([[-(2.0 ** (-1 - bits)), 0.75]]))  # what an optimizer step may do
        after = model.weight.double().clone()
    inst.close()
    want = ((after - before).norm() / before.norm()).item()
    assert abs(want - 1.0) > 1e-3  # the case the weights' own dtype rounded
    assert sink.records[0].scalars["grad_stats/update_ratio/weight"] == pytest.approx(want, rel=1e-6)

def test_float32_weights_whose_squares_underflow_read_the_documented_limit(tmp_path):
    """Weights of 1e-30 (float32): the float32 norms square to 0, so weight_norm reads 0.0 and update_ratio NaN
    (0 / 0) where float64 says ~1e-30 and ~1.6. Not fixed (a float64 norm measured 24x slower on CPU): documented
    in docs/observers.md, next to the gradient norms' range, and in the docstring; the same model in float64
    reads its float64 NumPy reference, and the global gradient norm stays clip_grad_norm_'s bit for bit."""
    import json
    from pathlib import Path

    read = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = nn.Linear(5, 7).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1e-30)
        path = tmp_path / f"{dtype}.jsonl"
        inst = Instrumentation([GradientStats(module=model)], backends=[instrument.JsonlBackend(str(path))],
                               log_interval=1, log_dir=str(tmp_path))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with inst.step(0):
            model(torch.randn(4, 5, dtype=dtype)).pow(2).sum().backward()
            clip = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            before = model.weight.detach().double().numpy().copy()
            opt.step()
        after = model.weight.detach().double().numpy()
        inst.close()
        assert inst.failures == {}
        read[dtype] = json.loads(path.read_text().splitlines()[-1])["metrics"]
        assert read[dtype]["grad_stats/norm/global"] == float(clip)
        ratio = np.linalg.norm(after - before) / np.linalg.norm(before)  # ~1.6 for both dtypes
        if dtype == torch.float64:
            assert read[dtype]["grad_stats/weight_norm/weight"] == pytest.approx(np.linalg.norm(after), rel=1e-12)
            assert read[dtype]["grad_stats/update_ratio/weight"] == pytest.approx(ratio, rel=1e-12)
        else:
            assert np.linalg.norm(after) > 1e-30 and np.isfinite(ratio)
            assert read[dtype]["grad_stats/weight_norm/weight"] == 0.0
            assert read[dtype]["grad_stats/update_ratio/weight"] == "nan"  # JSONL writes NaN as a string
    docs = " ".join((Path(__file__).parents[1] / "docs" / "observers.md").read_text().split())
    assert "reads `weight_norm` 0 and `update_ratio` NaN" in docs
    assert "A NaN `update_ratio` therefore says the weight norm before the step read 0" in docs


def test_update_ratios_of_a_model_of_mixed_dtypes_match_float64():
    """Half-precision snapshots are float32 while the others keep their dtype: the subtraction is grouped so that
    each parameter's update is taken against its own copy, whatever the mix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6).bfloat16(), nn.Linear(6, 6).half(),
                          nn.Linear(6, 6).double())
    sink = Sink()
    inst = Instrumentation([GradientStats(module=model)], backends=[sink], log_interval=1)
    with inst.step(0), torch.no_grad():
        before = {name: p.double().clone() for name, p in model.named_parameters()}
        for p in model.parameters():
            p.mul_(-0.5).add_(0.01)
        after = {name: p.double().clone() for name, p in model.named_parameters()}
    inst.close()
    scalars = sink.records[0].scalars
    for name in before:
        want = ((after[name] - before[name]).norm() / before[name].norm()).item()
        assert scalars[f"grad_stats/update_ratio/{name}"] == pytest.approx(want, rel=1e-5), name


@pytest.mark.parametrize("per", ["param", "module", "global"])
def test_gradient_stats_stages_its_call_as_one_block_so_later_calls_keep_the_fast_path(per):
    """``norm/global`` was float32 among float64 keys: the logger's one-block path takes one dtype only, so the call
    went down the per-key path, and so did every later call of the interval (NonFinite's, the user's): 1.3-1.6x the
    logger time of a logging step at 100-1,000 parameter tensors (a review). The values are the same either way."""
    seen: List[bool] = []

    class Peek(instrument.Observer):
        def observe(self, context):
            pass

        def log(self, logger, step):  # runs after GradientStats' log, before the commit
            seen.append(bool(logger._blocks) and not logger._totals)

    rule = make(1)
    sink = Sink()
    inst = Instrumentation([GradientStats(per=per, weight_norm=per != "global"), Peek("peek")], backends=[sink],
                           log_interval=1)
    inst.watch(rule)
    _, totals = train(rule, inst, steps=2, clip=True)
    inst.close()
    assert dict(inst.failures) == {} and seen == [True, True]
    for record, total in zip(sink.records, totals, strict=True):
        assert record.scalars["grad_stats/norm/global"] == float(total)  # bitwise, as clip_grad_norm_ returns it


def test_log_called_by_hand_outside_no_grad_stages_no_value_that_carries_autograd_graph(monkeypatch):
    """A session runs `log` under no_grad; an observer driven by hand (reset, attach, backward, detach, log) must
    not hand the logger parameter norms that require grad (they would keep the model's graph alive), also with
    gradients from a create_graph backward."""
    staged = []
    real = instrument.Logger.log_metrics

    def spy(self, metrics, *args, **kwargs):
        staged.extend(value for value in metrics.values() if isinstance(value, Tensor))
        return real(self, metrics, *args, **kwargs)

    monkeypatch.setattr(instrument.Logger, "log_metrics", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    observer = GradientStats(per="param", weight_norm=True, update_ratio=True)
    logger = instrument.Logger([Sink()])
    observer.reset()
    observer.attach([model])
    grads = torch.autograd.grad(model(torch.randn(8, 4)).square().sum(), list(model.parameters()), create_graph=True)
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    observer.detach()
    observer.log(logger, 0)
    logger.close()
    assert len(staged) >= 9 and not [v for v in staged if v.requires_grad or v.grad_fn is not None]


def test_watched_modules_whose_labels_would_coincide_keep_a_key_each():
    """Two Rule instances and a class named Rule1: the second Rule's label, Rule1, was the class's too, and one
    of their norms replaced the other's (a review)."""
    from instrument.observers.activation_stats import ActivationStats
    from instrument.observers.gradient_stats import select_parameters

    class Rule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    class Rule1(Rule):
        pass

    names = [name for name, _ in select_parameters([Rule(), Rule(), Rule1()])]
    assert len(set(names)) == 6 and names[:4] == ["Rule.lin.weight", "Rule.lin.bias", "Rule1.lin.weight",
                                                  "Rule1.lin.bias"]
    hooked = [name for name, _ in ActivationStats().select([Rule1(), Rule(), Rule()])]
    assert len(set(hooked)) == 3 and hooked[0] == "Rule1.lin"
