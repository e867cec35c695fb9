"""Rows for embedded probes (`instrument.Probe`) in scripted and compiled NCA rules.

Uses the API of docs/probes.md: ``instrument.Probe(name)`` as an identity module inside the model,
``inst.watch(model, state=False)`` so the loop delivers iterations, values in ``context.probes[name]``. Each
row carries a self-check that runs once after warm-up: if observers did not receive one probe value per
iteration, the row is reported as pending with the reason instead of timing something that is not what its
name says.
"""

import copy
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import instrument
from bench.workloads import NCA_SIZE, SinkBackend, _nca_parts, evolve, opened
from instrument import Instrumentation, IterationStats, Observer, UpdateNorm

__all__ = ["probe_variant"]


class ProbeCounter(Observer):
    """Counts, per logging step, the iterations whose context carried the ``hidden`` probe."""

    def __init__(self) -> None:
        super().__init__("probe_counter")
        self.count = 0
        self.last = 0

    def reset(self) -> None:
        self.count = 0

    def observe(self, context) -> None:
        if "hidden" in context.probes:
            self.count += 1

    def log(self, logger, step: int) -> None:
        self.last = self.count


def _probed_rule_class():
    from instrument.demos.nca import UpdateRule

    class ProbedUpdateRule(UpdateRule):
        """The demo's rule with a probe on the hidden activations of the per-cell MLP."""

        def __init__(self, channels: int, hidden: int) -> None:
            super().__init__(channels=channels, hidden=hidden)
            self.p_hidden = instrument.Probe("hidden")

        def forward(self, x: Tensor) -> Tensor:
            pre_alive = self.alive_mask(x)
            perception = F.conv2d(x, self.kernel, padding=1, groups=self.channels)
            h = self.p_hidden(torch.relu(self.conv1(perception)))
            dx = self.conv2(h) * self.step_size
            fire = torch.rand(x.shape[0], 1, x.shape[2], x.shape[3], dtype=x.dtype, device=x.device)
            x = x + dx * (fire <= self.fire_rate).to(x.dtype)
            post_alive = self.alive_mask(x)
            return x * (pre_alive & post_alive).to(x.dtype)

    return ProbedUpdateRule


def probe_variant(workload: str, mode: str, kind: str, tmp: str, **parts):
    """(fn, check, describe, settle) for ``<workload>/<mode>/probe-off|probe-log``."""
    if workload != "nca":
        raise ValueError(f"probe rows exist for the NCA only, got {workload!r}")
    s = NCA_SIZE
    base_rule, seed, target = _nca_parts()
    rule = _probed_rule_class()(s["channels"], s["hidden"])
    rule.load_state_dict(copy.deepcopy(base_rule.state_dict()), strict=False)
    rule.to(seed.device)
    counter = ProbeCounter()
    logging = kind == "probe-log"
    observers: List[Observer] = [IterationStats(), UpdateNorm(), counter] if logging else [IterationStats()]
    inst = opened(Instrumentation(
        observers=observers,
        backends=[SinkBackend()],
        log_interval=1 if logging else 10**12,
        run_name=None,  # a unique default: several rows log to the same tmp folder
        log_dir=tmp,
    ))
    # state=False: the probes are switched on for logging steps, and the loop below delivers each iteration
    # (explicit evolver), as in the script/compile rows without probes.
    if mode == "script":
        model = torch.jit.script(rule)
        inst.watch(model, state=False)
    else:
        inst.watch(rule, state=False)
        model = torch.compile(rule)
    opt = torch.optim.Adam(rule.parameters(), lr=1e-4)
    state = {"step": 1}

    def fn() -> None:
        state["step"] += 1
        with inst.step(state["step"]) as scope:
            x = evolve(model, seed, s["n_iter"], scope.observer)
            loss = F.mse_loss(x[:, :4], target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            inst.logger.log_metrics({"loss": loss.detach()}, step=state["step"], prefix="train")

    def check() -> Optional[str]:
        if logging and counter.last != s["n_iter"]:
            return (
                f"pending: probe row delivered {counter.last} probe values for {s['n_iter']} iterations "
                f"(instrument.Probe API differs from bench/probe_rows.py; update the row)"
            )
        return None

    # The same untimed settle as every other instrumented row (bench/workloads.py): the writer's work for this
    # step is done before the next row is timed, never charged to it.
    settle = getattr(inst.logger, "flush", None)
    return fn, check, f"embedded Probe('hidden'), {'logging' if logging else 'non-logging'} step", settle
