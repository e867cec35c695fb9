"""ActivationStats against float64 NumPy, read back from real TensorBoard event files; hooks only on logging steps;
a pure side channel; each iteration once under gradient checkpointing."""

import logging
from typing import Dict, List

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import instrument
from instrument.errors import ConfigurationError
from tests.conftest import event_accumulator, read_scalars

N_ITER = 5


class Rule(nn.Module):
    """One NCA-like iteration: 3x3 conv -> ReLU -> 1x1 conv, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.perceive = nn.Conv2d(4, 12, 3, padding=1)
        self.act = nn.ReLU()
        self.update = nn.Conv2d(12, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * self.update(self.act(self.perceive(x)))


def _rule() -> Rule:
    torch.manual_seed(0)
    return Rule()


def _seed() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, 8, 8, generator=g) + 2.0  # an offset: the mean is not small next to the spread


def _reference(rule: Rule, names: List[str]) -> Dict[str, List[np.ndarray]]:
    """Each named submodule's outputs over a plain rollout (no instrument), as float64 arrays."""
    outputs: Dict[str, List[np.ndarray]] = {n: [] for n in names}
    handles = [
        getattr(rule, n).register_forward_hook(lambda m, a, out, n=n: outputs[n].append(out.detach().double().numpy()))
        for n in names
    ]
    x = _seed()
    with torch.no_grad():
        for _ in range(N_ITER):
            x = rule(x)
    for h in handles:
        h.remove()
    return outputs


def _np_stats(out: np.ndarray) -> Dict[str, float]:
    return {"mean": out.mean(), "std": out.std(), "absmax": np.abs(out).max(), "zero_frac": np.mean(out == 0.0)}


def _run(tmp_path, observer, rule, watch=True, steps=(0,), checkpointed=None, backends=None):
    inst = instrument.Instrumentation(
        [observer], backends=backends or [instrument.TensorBoardBackend()], log_interval=1, log_dir=str(tmp_path),
        run_name="r",
    )
    if watch:
        inst.watch(rule)
    for step in steps:
        with inst.step(step) as s:
            x = _seed().requires_grad_(checkpointed is not None)
            for _ in range(N_ITER):
                prev = x
                if checkpointed is None:
                    x = rule(x)
                else:
                    x = checkpoint(rule, x, use_reentrant=checkpointed)
                if not watch:
                    s.observer(instrument.StepContext(prev, x))
            if checkpointed is not None:
                x.square().mean().backward()
    inst.close()
    return inst


def test_default_modules_match_float64_numpy_read_back_from_tensorboard(tmp_path):
    rule = _rule()
    want = _reference(rule, ["perceive", "act", "update"])
    _run(tmp_path, instrument.ActivationStats(), rule, steps=(0, 1))
    scalars = read_scalars(tmp_path / "r")
    # default: leaf modules with parameters of their own (the ReLU has none)
    assert {k.split("/")[1] for k in scalars if k.startswith("activations/")} == {"perceive", "update"}
    for module in ("perceive", "update"):
        expected = _np_stats(want[module][-1])
        for stat, value in expected.items():
            got = scalars[f"activations/{module}/{stat}"]
            assert sorted(got) == [0, 1]
            assert got[1] == pytest.approx(value, rel=1e-5, abs=1e-6), (module, stat)
    acc = event_accumulator(tmp_path / "r")
    assert {f"activations/{s}" for s in ("mean", "std", "absmax", "zero_frac")} <= set(acc.Tags()["images"])


def test_types_and_pattern_choose_modules_and_dead_units_show_in_zero_frac(tmp_path):
    rule = _rule()
    want = _reference(rule, ["act"])
    _run(tmp_path, instrument.ActivationStats(name="acts", types=["ReLU"]), rule)
    scalars = read_scalars(tmp_path / "r")
    assert sorted(k for k in scalars if k.startswith("acts/")) == [
        "acts/act/absmax", "acts/act/mean", "acts/act/std", "acts/act/zero_frac"]
    zero = np.mean(want["act"][-1] == 0.0)
    assert 0.0 < zero < 1.0
    assert scalars["acts/act/zero_frac"][0] == pytest.approx(zero, abs=1e-7)
    observer = instrument.ActivationStats(types=[nn.Conv2d], pattern="^upd")
    assert [n for n, _ in observer.select([rule])] == ["update"]


def test_explicit_module_in_the_explicit_evolver_style(tmp_path):
    rule = _rule()
    want = _reference(rule, ["update"])
    _run(tmp_path, instrument.ActivationStats(module=rule, pattern="update"), rule, watch=False)
    scalars = read_scalars(tmp_path / "r")
    assert scalars["activations/update/std"][0] == pytest.approx(want["update"][-1].std(), rel=1e-5)


def test_hooks_exist_only_during_logging_steps():
    rule = _rule()
    inst = instrument.Instrumentation([instrument.ActivationStats()], backends=[], log_interval=2)
    inst.watch(rule)
    seen = []
    for step in range(4):
        with inst.step(step):
            rule(_seed())
            seen.append((len(rule.perceive._forward_hooks), len(rule.update._forward_hooks)))
        assert not rule.perceive._forward_hooks and not rule.update._forward_hooks
    inst.close()
    assert seen == [(1, 1), (0, 0), (1, 1), (0, 0)]


def test_a_copy_or_checkpoint_taken_in_a_logging_step_leaves_the_hooks_behind(tmp_path):
    """With Dynamo imported (as stepping an Adam optimizer does), the hooks were the function Dynamo skips: a
    deep copy of the model shared them, so the copy's calls were counted into the original's statistics at
    every later logging step, and torch.save(model) raised. The copy now holds inert hooks."""
    import copy
    import io

    import torch._dynamo  # noqa: F401 - the state of every training process that steps an Adam optimizer

    rule = _rule()
    stats = instrument.ActivationStats()
    inst = instrument.Instrumentation([stats], backends=[], log_interval=1)
    inst.watch(rule)
    with inst.step(0):
        rule(_seed())
        twin = copy.deepcopy(rule)
        torch.save(rule, io.BytesIO())
        twin(_seed())
    with inst.step(1):
        rule(_seed())
        twin(_seed())
        twin(_seed())
        calls = list(stats._calls)
    inst.close()
    assert calls == [1, 1], calls  # perceive and update, once each: the twin's calls are not observed
    twin(_seed())  # after the session: the copy still runs, its hooks do nothing
    assert all(getattr(h, "instrument_inert", False) for m in twin.modules() for h in m._forward_hooks.values())


def _train(observers, checkpointed=None):
    rule = _rule()
    opt = torch.optim.SGD(rule.parameters(), lr=0.1)
    inst = instrument.Instrumentation(observers, backends=[], log_interval=1)
    inst.watch(rule)
    grads = []
    for step in range(2):
        with inst.step(step):
            x = _seed().requires_grad_(checkpointed is not None)  # reentrant checkpoint needs an input with grad
            for _ in range(N_ITER):
                x = rule(x) if checkpointed is None else checkpoint(rule, x, use_reentrant=checkpointed)
            opt.zero_grad()
            x.square().mean().backward()
            grads.append([p.grad.clone() for p in rule.parameters()])
            opt.step()
    inst.close()
    return [p.detach().clone() for p in rule.parameters()], grads


@pytest.mark.parametrize("checkpointed", [None, False, True])
def test_pure_side_channel_parameters_and_gradients_bitwise_equal(checkpointed):
    params_off, grads_off = _train([], checkpointed)
    params_on, grads_on = _train([instrument.ActivationStats(types=[nn.Conv2d, nn.ReLU])], checkpointed)
    for a, b in zip(params_off + sum(grads_off, []), params_on + sum(grads_on, []), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_sees_each_iteration_once_with_the_same_values(tmp_path, reentrant):
    plain, ckpt = instrument.ActivationStats(), instrument.ActivationStats()
    _run(tmp_path / "plain", plain, _rule(), checkpointed=None)
    _run(tmp_path / "ckpt", ckpt, _rule(), checkpointed=reentrant)
    assert ckpt._calls == [N_ITER, N_ITER]  # recomputation in backward skipped
    a, b = read_scalars(tmp_path / "plain" / "r"), read_scalars(tmp_path / "ckpt" / "r")
    assert a.keys() == b.keys() and all(a[k][0] == pytest.approx(b[k][0], rel=1e-6, abs=1e-7) for k in a)


def test_a_module_called_less_often_gets_grey_rows_and_its_own_last_value(tmp_path):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, i: int = 0):
            return self.a(x) if i % 2 else self.b(self.a(x))

    torch.manual_seed(0)
    model = Twice()
    observer = instrument.ActivationStats(module=model)
    inst = instrument.Instrumentation([observer], backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r")
    x = torch.randn(5, 3)
    with inst.step(0):
        for i in range(4):  # b runs at iterations 0 and 2 only
            model(x, i)
    inst.close()
    with torch.no_grad():
        want_b, want_a = model.b(model.a(x)).double().numpy(), model.a(x).double().numpy()
    scalars = read_scalars(tmp_path / "r")
    assert scalars["activations/b/mean"][0] == pytest.approx(want_b.mean(), rel=1e-6)
    assert scalars["activations/a/absmax"][0] == pytest.approx(np.abs(want_a).max(), rel=1e-6)
    assert observer._calls == [4, 2]  # heatmap rows 2 and 3 of b are grey (NaN)


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_bad_arguments_and_scripted_modules_are_refused_clearly(caplog):
    with pytest.raises(ConfigurationError, match="TorchScript module"):
        instrument.ActivationStats(module=torch.jit.script(nn.Linear(2, 2)))
    with pytest.raises(ConfigurationError, match="types must be nn.Module subclasses or class names, got \\[3\\]"):
        instrument.ActivationStats(types=[3])
    with pytest.raises(ConfigurationError, match="pattern '\\(' is not a regular expression"):
        instrument.ActivationStats(pattern="(")
    with pytest.raises(ConfigurationError, match="not among its heatmaps"):
        instrument.ActivationStats(color_range={"median": (0, 1)})
    outer = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Linear(2, 2)))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        chosen = instrument.ActivationStats().select([outer])
    assert [n for n, _ in chosen] == ["0"]
    assert "skips TorchScript submodules ['1']" in caplog.text


def test_nothing_to_hook_is_said_once_and_logs_nothing(caplog):
    inst = instrument.Instrumentation([instrument.ActivationStats()], backends=[], log_interval=1)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                pass
    inst.close()
    assert caplog.text.count("found no module to hook") == 1
    assert inst.failures == {}


def test_half_precision_outputs_accumulate_in_float32():
    from instrument.observers.activation_stats import _finish, output_moments

    x = (torch.randn(4, 300) * 3 + 1).relu().half()
    got = _finish(output_moments(x)).double().numpy()
    ref = x.double().numpy()
    np.testing.assert_allclose(got, [ref.mean(), ref.std(), np.abs(ref).max(), np.mean(ref == 0)], rtol=1e-5)


def test_a_failing_hook_never_reaches_training_and_is_reported_once(monkeypatch, caplog):
    import instrument.observers.activation_stats as module

    def broken(output):
        raise ValueError("boom")

    monkeypatch.setattr(module, "output_tensor", broken)  # the first thing each hook call does
    rule = _rule()
    inst = instrument.Instrumentation([instrument.ActivationStats()], backends=[], log_interval=1)
    inst.watch(rule)
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step):
                out = rule(_seed())  # the forward completes
    inst.close()
    assert out.shape == (3, 4, 8, 8)
    assert inst.failures == {"activations": 2}
    assert "a forward hook failed in this logging step (ValueError('boom'))" in caplog.text


def test_several_watched_modules_are_named_apart_and_max_modules_is_said(caplog):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert [n for n, _ in instrument.ActivationStats().select([a, nn.Sequential(b)])] == ["Linear", "Sequential.0"]
    assert [n for n, _ in instrument.ActivationStats().select([a, b])] == ["Linear0", "Linear1"]
    with caplog.at_level(logging.WARNING, logger="instrument"):
        chosen = instrument.ActivationStats(max_modules=1).select([a, b])
    assert [m for _, m in chosen] == [a]
    assert "matched 2 modules and hooks the first max_modules=1" in caplog.text


def test_an_output_modified_in_place_is_dropped_once_then_reduced_as_it_comes(tmp_path, caplog):
    """nn.ReLU(inplace=True) after a conv changes the conv's output after its hook ran: the kept reference no longer
    holds what the conv returned. Step 0 drops the conv's values (reported), step 1 reduces them as they come."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(6, 4, 1))
    x = _seed()
    inst = instrument.Instrumentation(
        [instrument.ActivationStats(module=model)], backends=[instrument.TensorBoardBackend()], log_interval=1,
        log_dir=str(tmp_path), run_name="r",
    )
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(2):
            with inst.step(step), torch.no_grad():
                for _ in range(3):
                    model(x)
    inst.close()
    assert "the outputs of ['0'] were modified in place after their hooks ran" in caplog.text
    scalars = read_scalars(tmp_path / "r")
    assert sorted(scalars["activations/2/mean"]) == [0, 1]
    assert sorted(scalars["activations/0/mean"]) == [1]  # step 0's values of the conv were dropped, not falsified
    with torch.no_grad():
        pre = model[0](x).double().numpy()  # what the conv returned, before the ReLU changed it
    assert scalars["activations/0/mean"][1] == pytest.approx(pre.mean(), rel=1e-5, abs=1e-7)
    assert scalars["activations/0/zero_frac"][1] == 0.0


def test_large_outputs_are_reduced_as_they_come_with_the_same_values():
    from instrument.observers.activation_stats import _finish, batched_moments

    x = torch.randn(3, 2, 64, 32, 32) * 2 + 5  # each output 2**17 elements
    batched = _finish(batched_moments(x)).double().numpy()
    ref = x.double().numpy().reshape(3, -1)
    want = np.stack([ref.mean(1), ref.std(1), np.abs(ref).max(1), (ref == 0).mean(1)], 1)
    np.testing.assert_allclose(batched, want, rtol=1e-5, atol=1e-7)
    observer = instrument.ActivationStats(module=nn.Identity(), types=[nn.Identity])
    observer.attach([])
    with torch.no_grad():
        for out in x:
            observer.module(out)
    observer.detach()
    assert not observer._sums[0]._items  # nothing kept: each large output was reduced in its hook
    np.testing.assert_allclose(_finish(observer._sums[0].results()).double().numpy(), want, rtol=1e-5, atol=1e-7)


def test_zero_frac_counts_exact_zeros_only_a_nan_is_not_one():
    """zero_frac was the mean of sign(x)^2, and torch.sign(NaN) is 0: an all-NaN layer read as dead (1.0)."""
    from instrument.observers.activation_stats import _finish, batched_moments

    out = torch.tensor([[0.0, float("nan"), 2.0, 0.0], [float("nan")] * 4, [0.0, -0.0, float("inf"), 1.0]])
    zero_frac = _finish(batched_moments(out))[:, 3]
    want = (out == 0).double().mean(1)  # NaN == 0 is False
    assert zero_frac.tolist() == pytest.approx(want.tolist())


def test_a_float64_layer_after_a_float32_one_keeps_its_float64_statistics(tmp_path):
    """All modules' results were cast to the first module's dtype: a float64 head whose outputs near 1e150 came
    after a float32 layer was cast to float32 and read inf and NaN. Each module keeps its precision now."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4).double()
            with torch.no_grad():
                self.b.weight.mul_(1e150)  # beyond float32 (3.4e38); NumPy squares it

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).double())

    torch.manual_seed(0)
    model = Mixed()
    outputs: Dict[str, np.ndarray] = {}
    for n in ("a", "b"):
        getattr(model, n).register_forward_hook(
            lambda m, a, out, n=n: outputs.__setitem__(n, out.detach().double().numpy()))
    history = instrument.RunHistoryBackend()
    inst = instrument.Instrumentation([instrument.ActivationStats(images=False)], backends=[history],
                                      log_interval=1, log_dir=str(tmp_path), run_name="r")
    inst.watch(model)
    with inst.step(0), torch.no_grad():
        model(torch.randn(3, 4))
    inst.close()
    for n, rel in (("a", 1e-6), ("b", 1e-12)):
        want = _np_stats(outputs[n])
        assert np.isfinite(want["std"]) and want["std"] > (1e148 if n == "b" else 0.0)
        for stat, value in want.items():
            assert history.metrics[f"activations/{n}/{stat}"][-1][1] == pytest.approx(value, rel=rel, abs=1e-7), stat


class _Structured(nn.Module):
    """Submodules whose outputs are not plain tensors: a tuple led by None, a dict, a nested tuple, and None."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = _Wrap(lambda y: (None, y))
        self.named = _Wrap(lambda y: {"mask": None, "hidden": y * 2.0})
        self.nested = _Wrap(lambda y: ((y - 1.0,), 1))
        self.nothing = _Wrap(lambda y: None)

    def forward(self, x):
        y = self.pair(x)[1]
        y = self.named(y)["hidden"]
        y = self.nested(y)[0][0]
        self.nothing(y)
        return y


class _Wrap(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.make = make

    def forward(self, x):
        return self.make(self.lin(x))


def test_an_output_led_by_a_non_tensor_is_reduced_as_its_first_tensor_and_none_is_said_by_name(tmp_path, caplog):
    """A tuple whose first element was not a tensor (None, y), a dict (a ModelOutput) or a nested tuple was
    skipped, and the warning said no module had run, blaming torch.compile (a review)."""
    torch.manual_seed(0)
    model = _Structured()
    seen: Dict[str, np.ndarray] = {}
    x = torch.randn(3, 4)
    with torch.no_grad():  # the reference: each wrapper's linear output through its own structure, in float64
        y = model.pair.lin(x)
        seen["pair"] = y.double().numpy()
        y = model.named.lin(y) * 2.0
        seen["named"] = y.double().numpy()
        y = model.nested.lin(y) - 1.0
        seen["nested"] = y.double().numpy()
    observer = instrument.ActivationStats(pattern=r"^(pair|named|nested|nothing)$", images=False)
    inst = instrument.Instrumentation([observer], backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r")
    inst.watch(model)
    with caplog.at_level(logging.WARNING, logger="instrument"), inst.step(0):
        with torch.no_grad():
            model(x)
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    for module, out in seen.items():
        for stat, value in _np_stats(out).items():
            assert scalars[f"activations/{module}/{stat}"][0] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert not [k for k in scalars if k.startswith("activations/nothing/")]
    said = [r.getMessage() for r in caplog.records if "holds no real tensor" in r.getMessage()]
    assert len(said) == 1 and "module 'nothing' ran in logging step 0, but its output (None)" in said[0]
    assert "torch.compile" not in caplog.text


def test_multihead_attention_is_hooked_itself_not_its_never_called_out_proj(tmp_path):
    """The default chose the leaf ``attn.out_proj``, which the attention never calls (it reads its weights), so
    the attention had no statistics and nothing said why (a review)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y, _ = self.attn(x, x, x)
            return self.lin(y)

    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = block.attn(x, x, x)[0].double().numpy()
    observer = instrument.ActivationStats(images=False)
    assert [name for name, _ in observer.select([block])] == ["attn", "lin"]
    inst = instrument.Instrumentation([observer], backends=[instrument.TensorBoardBackend()], log_interval=1,
                                      log_dir=str(tmp_path), run_name="r")
    inst.watch(block)
    with inst.step(0), torch.no_grad():
        block(x)
    inst.close()
    scalars = read_scalars(tmp_path / "r")
    for stat, value in _np_stats(want).items():
        assert scalars[f"activations/attn/{stat}"][0] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert instrument.ActivationStats(types=[nn.Linear]).select([block])[0][0] == "lin"  # out_proj: never runs
