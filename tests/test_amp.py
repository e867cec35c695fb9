"""Mixed precision: a ``torch.amp.GradScaler`` multiplies the loss by its scale (65536 at first), so gradients read
before it unscales them are the scaled loss's. Given the scaler (``Instrumentation(grad_scaler=...)``), gradient
probes and `GradientStats` log the loss's own gradients, and `NonFinite` tells a loss-scale overflow (GradScaler
skips that optimizer step) from a divergence. References: the same loops without a scaler (gradients of the
unscaled loss), and ``clip_grad_norm_`` after ``unscale_``, read back from real JSONL and TensorBoard files."""

import json
import logging
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch import nn

import instrument
from tests._probe_models import Rule
from tests.conftest import read_scalars


class KeepGradients(instrument.Observer):
    def __init__(self) -> None:
        super().__init__("keep")
        self.gradients: List[torch.Tensor] = []

    def observe(self, context) -> None:
        pass

    def observe_gradients(self, gradients) -> None:
        self.gradients = [g.clone() for g in gradients["hidden"]]


def jsonl(run_dir: Path) -> Dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["metrics"] for line in lines if "metrics" in line}


def session(tmp_path, observers, scaler=None, backends=None) -> instrument.Instrumentation:
    return instrument.Instrumentation(
        observers=observers, log_interval=1, run_name="r", log_dir=str(tmp_path), grad_scaler=scaler,
        backends=[instrument.JsonlBackend(), instrument.TensorBoardBackend()] if backends is None else backends,
    )


def probe_gradients(scaler, update_in_block: bool) -> List[torch.Tensor]:
    """A gradient probe's values over one logging step of 3 iterations, backward from the scaled loss when
    ``scaler`` is given; the scaler's step and update inside the block or not."""
    torch.manual_seed(0)
    rule = Rule(grad=True)
    opt = torch.optim.SGD(rule.parameters(), lr=0.1)
    keep = KeepGradients()
    inst = instrument.Instrumentation(observers=[keep], backends=[], log_interval=1, grad_scaler=scaler)
    inst.watch(rule)
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    with inst.step(0):
        for _ in range(3):
            x = rule(x)
        loss = x.square().mean()
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            if update_in_block:
                scaler.step(opt)
                scaler.update(2.0**20)  # the scale changes in the block: the probe keeps the one backward used
    inst.close()
    return keep.gradients


@pytest.mark.parametrize("update_in_block", [False, True])
def test_gradient_probes_are_the_loss_s_gradients_not_the_scaled_loss_s(update_in_block):
    want = probe_gradients(None, False)
    got = probe_gradients(torch.amp.GradScaler("cpu"), update_in_block)
    assert len(got) == len(want) == 3
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"iteration {i}: probe gradient off by {(g / w).nanmean().item():.6g}x"


def accumulation_loop(tmp_path, step_in_block: bool, scaler_known: bool = True):
    """GradientStats over a GradScaler loop, optimizer step after the block (gradient accumulation) or inside it;
    returns the logged global norms per step and the references (clip_grad_norm_ after unscale_)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)  # the scale grows at every step: 2**16, 2**17, ...
    inst = session(tmp_path, [instrument.GradientStats(module=model, histograms=True)],
                   scaler=scaler if scaler_known else None)
    want = {}
    for step in range(3):
        with inst.step(step):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().square().mean()
            scaler.scale(loss).backward()
            if step_in_block:
                scaler.unscale_(opt)
                want[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
                scaler.step(opt)
                scaler.update()
        if not step_in_block:
            scaler.unscale_(opt)
            want[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
            scaler.step(opt)
            scaler.update()
    inst.close()
    return want, tmp_path / "r"


@pytest.mark.parametrize("step_in_block", [False, True])
def test_gradient_stats_norms_are_unscaled_with_the_optimizer_step_after_or_inside_the_block(tmp_path,
                                                                                              step_in_block):
    want, run = accumulation_loop(tmp_path, step_in_block)
    logged = jsonl(run)
    board = read_scalars(run)["grad_stats/norm/global"]
    for step, norm in want.items():
        assert logged[step]["grad_stats/norm/global"] == pytest.approx(norm, rel=1e-6)
        assert board[step] == pytest.approx(norm, rel=1e-6)
    # the histograms too: their largest bucket edge is near the largest unscaled gradient, not 65536 times it
    from tests.conftest import event_accumulator

    hist = event_accumulator(run).Histograms("grad_stats/grad_hist/2.bias")
    assert all(abs(h.histogram_value.max) < 10 for h in hist)


def test_without_the_scaler_the_norms_stay_what_backward_left(tmp_path):
    """What the session is not told it cannot undo: the scaled norms, as before (documented)."""
    want, run = accumulation_loop(tmp_path, step_in_block=False, scaler_known=False)
    assert jsonl(run)[0]["grad_stats/norm/global"] == pytest.approx(want[0] * 2.0**16, rel=1e-6)


def overflow_then_nan(tmp_path, caplog, raise_on_nonfinite: bool, scaler_known: bool = True):
    """Step 0's scaled loss overflows (GradScaler skips it); step 2's rollout state has a NaN."""
    torch.manual_seed(0)
    rule = nn.Conv2d(4, 4, 1)
    opt = torch.optim.SGD(rule.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    observer = instrument.NonFinite(raise_on_nonfinite=raise_on_nonfinite)
    inst = session(tmp_path, [observer], scaler=scaler if scaler_known else None,
                   backends=[instrument.JsonlBackend()])
    inst.watch(rule)
    raised = {}
    for step in range(4):
        try:
            with inst.step(step):
                opt.zero_grad()
                x = torch.randn(1, 4, 3, 3)
                if step == 2:
                    x[0, 1, 0, 0] = float("nan")
                for _ in range(2):
                    x = rule(x)
                scaler.scale(x.nan_to_num().square().mean() * 1e10).backward()
                scaler.step(opt)
                scaler.update()
        except instrument.NonFiniteError as exc:
            raised[step] = str(exc)
    inst.close()
    return raised, jsonl(tmp_path / "r")


def test_a_loss_scale_overflow_is_said_at_info_and_never_raised_but_a_later_nan_is(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="instrument")
    raised, logged = overflow_then_nan(tmp_path, caplog, raise_on_nonfinite=True)
    assert logged[0]["nonfinite/grad_count"] > 0  # counted as it was
    assert list(raised) == [2] and "rollout iteration 0 in state channel" in raised[2]
    infos = [r.getMessage() for r in caplog.records if "loss-scale overflow" in r.getMessage()]
    assert len(infos) == 1 and "step 0" in infos[0] and all(r.levelno == logging.INFO for r in caplog.records
                                                              if "loss-scale overflow" in r.getMessage())


def test_warn_mode_reports_a_state_nan_after_gradient_trouble_was_reported(tmp_path, caplog):
    """Each kind once per run: the gradients' report at step 0 (no scaler known) does not use up the state's."""
    caplog.set_level(logging.INFO, logger="instrument")
    overflow_then_nan(tmp_path, caplog, raise_on_nonfinite=False, scaler_known=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "non-finite values" in r.getMessage()]
    assert len(warnings) == 2
    assert "step 0" in warnings[0] and "gradient elements" in warnings[0] and "grad_scaler=scaler" in warnings[0]
    assert "step 2" in warnings[1] and "in state channel" in warnings[1] and "gradient" not in warnings[1]


def test_the_scaler_is_checked_and_not_changed_inside_a_step(tmp_path):
    with pytest.raises(instrument.ConfigurationError, match="torch.amp.GradScaler .*got int"):
        instrument.Instrumentation(backends=[], grad_scaler=3)
    inst = instrument.Instrumentation(backends=[], log_interval=1)
    scaler = torch.amp.GradScaler("cpu")
    inst.grad_scaler = scaler
    assert inst.grad_scaler is scaler
    with inst.step(0):
        with pytest.raises(instrument.ConfigurationError, match="inside logging step 0"):
            inst.grad_scaler = None
    inst.close()


def test_gradient_stats_says_once_when_no_covered_parameter_had_a_gradient(tmp_path, caplog):
    """``torch.func.functional_call`` trains a parameter dict that is not the module's own: its parameters never
    get a gradient, which used to log update_ratio 0 and no norm, silently."""
    model = nn.Linear(4, 4)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    inst = session(tmp_path, [instrument.GradientStats(module=model)], backends=[])
    for step in range(2):
        with inst.step(step):
            out = torch.func.functional_call(model, params, (torch.randn(2, 4),))
            out.square().sum().backward()
    inst.close()
    said = [r.getMessage() for r in caplog.records if "had a gradient" in r.getMessage()]
    assert len(said) == 1 and "functional_call" in said[0] and "step 0" in said[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_loss_scale_is_read_and_divided_without_a_host_read(device, tmp_path):
    """The training-thread part of a scaled logging step (the optimizer step after the block) reads nothing on
    the host: the scale is copied and divided on its device. On CUDA under set_sync_debug_mode("error")."""
    from tests.test_cuda_paths import no_host_read

    torch.manual_seed(0)
    rule = Rule(grad=True).to(device)
    opt = torch.optim.SGD(rule.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device)
    keep = KeepGradients()
    inst = session(tmp_path, [keep, instrument.GradientStats(module=rule, per="global")], scaler=scaler,
                   backends=[instrument.JsonlBackend()])
    inst.watch(rule)
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    x0 = torch.randn(2, 4, 6, 6, device=device)
    want = []
    for step in range(2):
        opt.zero_grad()
        with no_host_read(device):
            with inst.step(step):
                x = x0
                with torch.autocast(device, dtype=dtype):
                    for _ in range(2):
                        x = rule(x)
                scaler.scale(x.float().square().mean()).backward()
        scaler.unscale_(opt)
        want.append(torch.nn.utils.clip_grad_norm_(rule.parameters(), 1e9).item())
        scaler.step(opt)
        scaler.update()
    inst.close()
    logged = jsonl(tmp_path / "r")
    assert [logged[s]["grad_stats/norm/global"] for s in range(2)] == pytest.approx(want, rel=1e-5)
    assert all(g.abs().max().item() < 1.0 for g in keep.gradients)  # 65536x too large before


def test_two_optimizers_on_one_scaler_each_parameter_unscaled_or_not_as_it_is(tmp_path):
    """A GAN: D is unscaled and stepped inside the block, G after it. G's gradients are still scaled when the
    block ends, D's are not (and were zeroed after its step, so they read 0 with no division)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    both = nn.ModuleDict({"gen": gen, "disc": disc})
    inst = session(tmp_path, [instrument.GradientStats(module=gen, name="g", per="global"),
                              instrument.GradientStats(module=disc, name="d", per="global"),
                              instrument.GradientStats(module=both, name="both", per="global")],
                   scaler=scaler, backends=[instrument.JsonlBackend()])
    want = {}
    for step in range(3):
        with inst.step(step):
            opt_d.zero_grad()
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fake = gen(torch.randn(8, 4))
                d_loss = disc(fake.detach()).float().square().mean()
            scaler.scale(d_loss).backward()
            scaler.unscale_(opt_d)
            d_norm = torch.nn.utils.clip_grad_norm_(disc.parameters(), 1e9).item()  # clipping changes them too
            scaler.step(opt_d)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                g_loss = (1 - disc(fake)).float().square().mean()
            for p in disc.parameters():
                p.requires_grad_(False)
            scaler.scale(g_loss).backward()
            for p in disc.parameters():
                p.requires_grad_(True)
        scaler.unscale_(opt_g)
        g_norm = torch.nn.utils.clip_grad_norm_(gen.parameters(), 1e9).item()
        scaler.step(opt_g)
        scaler.update()
        want[step] = (g_norm, d_norm, (g_norm**2 + d_norm**2) ** 0.5)
    inst.close()
    logged = jsonl(tmp_path / "r")
    for step, (g_norm, d_norm, both_norm) in want.items():
        got = logged[step]
        assert got["g/norm/global"] == pytest.approx(g_norm, rel=1e-6)
        assert got["d/norm/global"] == pytest.approx(d_norm, rel=1e-6)
        assert got["both/norm/global"] == pytest.approx(both_norm, rel=1e-6)


def test_a_scaler_update_at_the_block_s_start_before_its_backward(tmp_path):
    """The previous iteration's step and update at the top of the block, then this iteration's scaled backward:
    the gradients the block ends with are scaled by the scale after that update."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    inst = session(tmp_path, [instrument.GradientStats(module=model, per="global")], scaler=scaler,
                   backends=[instrument.JsonlBackend()])
    want = {}
    for step in range(4):
        with inst.step(step):
            if step:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
        want[step] = torch.linalg.vector_norm(
            torch.stack([p.grad.double().norm() for p in model.parameters()])).item() / scaler.get_scale()
    inst.close()
    logged = jsonl(tmp_path / "r")
    assert [logged[s]["grad_stats/norm/global"] for s in range(4)] == pytest.approx(list(want.values()), rel=1e-6)


def test_a_loss_that_is_never_finite_is_a_divergence_once_the_scale_falls_below_one(tmp_path, caplog):
    """Skipped at every step, the scale halves each time; below 1 GradScaler cannot be fixing an overflow."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    inst = session(tmp_path, [instrument.NonFinite(module=model, raise_on_nonfinite=True)], scaler=scaler,
                   backends=[instrument.JsonlBackend()])
    raised = []
    for step in range(5):
        try:
            with inst.step(step):
                opt.zero_grad()
                scaler.scale(model(torch.randn(2, 4)).sum() * float("nan")).backward()
                scaler.step(opt)
                scaler.update()
        except instrument.NonFiniteError as exc:
            raised.append((step, str(exc)))
    inst.close()
    logged = jsonl(tmp_path / "r")
    assert [logged[s]["nonfinite/loss_scale"] for s in range(5)] == [2.0, 1.0, 0.5, 0.25, 0.125]
    assert [s for s, _ in raised] == [2, 3, 4] and "loss scale fell to 0.5" in raised[0][1]


def test_an_observer_s_own_loss_scale_attribute_is_left_alone():
    class Mine(instrument.Observer):
        def __init__(self) -> None:
            super().__init__("mine")
            self.loss_scale = 1024.0

        def observe(self, context) -> None:
            pass

    mine = Mine()
    inst = instrument.Instrumentation([mine], backends=[], grad_scaler=torch.amp.GradScaler("cpu"))
    inst.close()
    assert mine.loss_scale == 1024.0


def adam_session(tmp_path, fused: bool, **stats):
    """A small MLP, Adam (fused or not), a GradScaler, and a session with GradientStats over the MLP (JSONL)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    inst = session(tmp_path, [instrument.GradientStats(module=model, **stats)], scaler=scaler,
                   backends=[instrument.JsonlBackend()])
    return model, opt, scaler, inst


def test_a_fused_optimizer_unscales_in_its_own_step_and_its_norms_are_not_divided_again(tmp_path):
    """Fused Adam (and AdamW, SGD) unscale inside their step, never through unscale_: the norms read 65536 times
    too small."""
    model, opt, scaler, inst = adam_session(tmp_path, fused=True, per="global")
    want = {}
    for step in range(2):
        with inst.step(step):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            want[step] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    inst.close()
    logged = jsonl(tmp_path / "r")
    assert [logged[s]["grad_stats/norm/global"] for s in range(2)] == pytest.approx([want[0], want[1]], rel=1e-6)


def test_the_scaler_pickles_and_copies_in_a_logging_step_and_is_left_as_it_was(tmp_path):
    """The wrappers are on the scaler's class during logging steps only: a pickle or copy of the scaler taken
    in one holds none (a copy used to keep wrappers calling the original), and two sessions sharing the scaler
    whose steps end out of order leave the class as it was."""
    import copy
    import pickle

    scaler = torch.amp.GradScaler("cpu")
    plain_scale = torch.amp.GradScaler.__dict__["scale"]
    a = instrument.Instrumentation(backends=[], log_interval=1, grad_scaler=scaler)
    b = instrument.Instrumentation(backends=[], log_interval=1, grad_scaler=scaler)
    in_a, in_b = a.step(0), b.step(0)
    in_a.__enter__()
    in_b.__enter__()
    scaler.scale(torch.ones(()))
    twin = copy.deepcopy(scaler)
    loaded = pickle.loads(pickle.dumps(scaler))
    in_a.__exit__(None, None, None)
    assert torch.amp.GradScaler.__dict__["scale"] is not plain_scale  # b's step still runs
    in_b.__exit__(None, None, None)
    a.close()
    b.close()
    assert torch.amp.GradScaler.__dict__["scale"] is plain_scale
    for other in (twin, loaded):
        assert "scale" not in vars(other) and other.scale(torch.ones(())).item() == 65536.0


def test_non_finite_under_a_scaler_that_has_no_scale_yet(tmp_path):
    """An enabled scaler whose first scale() has not run (a warm-up backward without it): no loss_scale is
    logged, and the step's counts are (the whole log failed)."""
    model = nn.Linear(4, 1)
    inst = session(tmp_path, [instrument.NonFinite(module=model)], scaler=torch.amp.GradScaler("cpu"),
                   backends=[instrument.JsonlBackend()])
    with inst.step(0):
        model(torch.randn(2, 4)).sum().backward()
    inst.close()
    assert inst.failures == {}
    logged = jsonl(tmp_path / "r")[0]
    assert logged["nonfinite/grad_count"] == 0 and "nonfinite/loss_scale" not in logged


@pytest.mark.parametrize("fused", [False, True])
def test_keyword_calls_and_a_fused_step_that_skips_keep_every_norm_the_loss_s(tmp_path, fused):
    """``scaler.unscale_(optimizer=opt)`` / ``scaler.step(optimizer=opt)`` were missed (norms divided twice), and
    a fused optimizer's skipped step (an inf found) leaves the gradients scaled: the finite ones are logged
    divided, per parameter."""
    model, opt, scaler, inst = adam_session(tmp_path, fused=fused)
    want = {}
    for step in range(3):
        with inst.step(step):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
            if step == 1:  # an overflow: GradScaler skips this step
                model[0].bias.grad[0] = float("inf")
            scale = scaler.get_scale()
            want[step] = {name: (p.grad.double() / scale).norm().item() for name, p in model.named_parameters()}
            if not fused:
                scaler.unscale_(optimizer=opt)
            scaler.step(optimizer=opt)
            scaler.update()
    inst.close()
    logged = jsonl(tmp_path / "r")
    for step, norms in want.items():
        for name, norm in norms.items():
            got = float(logged[step][f"grad_stats/norm/{name}"])  # JSONL writes inf as "inf"
            assert got == pytest.approx(norm, rel=1e-6), (step, name)
