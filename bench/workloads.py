"""The matrix `make bench` times: one training step of the NCA and of the RL demo, in every variant.

Rows (``workload/mode/kind``):

- modes: ``eager``; ``script`` (the update rule / policy is ``torch.jit.script``-ed); ``compile`` (it is
  ``torch.compile``-d); ``ckpt`` (NCA only: eager, every ``checkpoint_every`` iterations one
  ``torch.utils.checkpoint`` segment, non-reentrant).
- kinds: ``bare`` (no instrument at all: the baseline of its mode); ``off`` (instrumented, non-logging step);
  ``log-tb`` (the headline logging row: a logging step with IterationStats + UpdateNorm and a real
  TensorBoard backend writing event files); ``log`` (the same with a sink backend, so the figure is the
  pipeline's own cost: observers, one batched host transfer, handing the record over); ``log[]`` (a
  logging step with no observer: the base from which each observer's own cost is taken);
  ``log[IterationStats]``, ``log[UpdateNorm]``, ``log[GradientStats]``, ``log[GradientStats.global]``
  (``per="global"``: only the global gradient norm, one fused pass), ``log[NonFinite]``, ``log[RolloutVideo]``,
  ``log[ActivationStats]``, ``log[StateHistogram]`` (one observer each: the own-cost rows, ``log[X] - log[]``;
  RolloutVideo on the NCA only: RL observations have no grid to render); ``naive`` (the common hand-written
  pattern: the same statistics with ``.tolist()``/``.item()`` every iteration); ``wandb-watch``
  (``wandb.watch(model, log="all", log_freq=1)``, offline, with ``wandb.log`` of the loss each step; timed
  in the ``wandb`` group, see `WANDB_GROUP`);
  ``probe-off``/``probe-log`` (embedded `instrument.Probe` in a scripted or compiled model; pending until
  the Probe module exists).
- ``scalars/x100/*``: the training thread's time per logging step of 100 scalars handed to
  TensorBoard + JSONL + console, vs ``SummaryWriter.add_scalar`` x100 and offline ``wandb.log``
  (bench/scalar_rows.py).

Instrumented rows settle after every timed call: ``logger.flush()`` (when the Logger has one) runs untimed,
so what a background writer thread still does for that step is never charged to the next row timed.

How instrumented rows observe: the eager and checkpointed NCA watch the update rule with forward hooks
(``inst.watch``); scripted and compiled models cannot carry hooks added at run time, so those rows (and all RL
rows, as the RL demo does) use the explicit-evolver style: the Python loop calls ``s.observer`` itself.

Device: the CPU, or the device ``INSTRUMENT_BENCH_DEVICE`` names (e.g. ``cuda``): models, states and the RL
environment live there, and on CUDA every timed call ends with ``torch.cuda.synchronize()`` (in every row,
bare included), so a step's time is the time until its device work is done, not until its kernels are queued.
The ``scalars/x100`` rows stay on the host (they time the calling thread).

Every variant of a workload does the same work every call: NCA state sizes are fixed, and RL rollouts run a
fixed number of environment steps (no early stop), so timings do not depend on how far training got.
"""

import copy
import os
import tempfile
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import instrument
from bench.harness import Variant
from bench.peers import WANDB_GROUP, wandb_variant
from bench.scalar_rows import SCALAR_KEYS, scalar_variants
from instrument import GradientStats, Instrumentation, IterationStats, NonFinite, RolloutVideo, StepContext, UpdateNorm
from instrument.backends.base import Backend

__all__ = ["NCA_SIZE", "RL_SIZE", "build_variants", "all_keys", "OBSERVERS", "OWN_COST", "HEADLINE", "device",
           "close_sessions", "opened"]

NCA_SIZE = {"batch": 4, "channels": 16, "size": 24, "hidden": 128, "n_iter": 32, "checkpoint_every": 8}
RL_SIZE = {"envs": 256, "hidden": 64, "steps": 200}
OBSERVERS = ("IterationStats", "UpdateNorm")  # the headline rows' observers
# One own-cost row each (``log[X]`` minus ``log[]``); GradientStats.global is GradientStats(per="global").
OWN_COST = OBSERVERS + (
    "GradientStats", "GradientStats.global", "NonFinite", "RolloutVideo", "ActivationStats", "StateHistogram"
)
NOT_APPLICABLE = {("rl", "RolloutVideo"): "not applicable: RL observations have no grid to render"}
PROBE_PENDING = "pending: needs instrument.Probe (issue 3)"
RL_PROBE_PENDING = "not in this matrix: RL probe costs are in bench/probe_overhead.py (make bench-probes)"

MODES = {"nca": ("eager", "script", "compile", "ckpt"), "rl": ("eager", "script", "compile")}
KINDS = {
    "eager": (
        "bare",
        "off",
        "log-tb",
        "log",
        "log[]",
        "log[IterationStats]",
        "log[UpdateNorm]",
        "log[GradientStats]",
        "log[GradientStats.global]",
        "log[NonFinite]",
        "log[RolloutVideo]",
        "log[ActivationStats]",
        "log[StateHistogram]",
        "naive",
        "wandb-watch",
    ),
    "script": ("bare", "off", "log-tb", "log", "probe-off", "probe-log"),
    "compile": ("bare", "off", "log-tb", "log", "probe-off", "probe-log"),
    "ckpt": ("bare", "off", "log"),
}


def device() -> torch.device:
    """Where the workloads run: ``INSTRUMENT_BENCH_DEVICE`` (default ``cpu``)."""
    name = os.environ.get("INSTRUMENT_BENCH_DEVICE", "") or "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"INSTRUMENT_BENCH_DEVICE must name a torch device such as 'cpu' or 'cuda', got {name!r}"
        ) from None
    if dev.type not in ("cpu", "cuda"):  # e.g. meta (no values) or mps: the rows are written for these two
        raise ValueError(f"INSTRUMENT_BENCH_DEVICE must be 'cpu' or a CUDA device ('cuda', 'cuda:1'), got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"INSTRUMENT_BENCH_DEVICE={name}, but torch.cuda.is_available() is False on this machine")
    return dev


# The headline logging row of each workload and mode: a logging step as a user runs it (real TensorBoard).
HEADLINE = "log-tb"


def all_keys() -> List[str]:
    """Every row of the matrix, in table order, then the ``scalars/x100`` rows."""
    return [f"{w}/{m}/{k}" for w, modes in MODES.items() for m in modes for k in KINDS[m]] + SCALAR_KEYS


class SinkBackend(Backend):
    """Receives every committed record and drops it: the pipeline's cost without a backend's I/O."""

    name = "sink"

    def open(self, run) -> None:
        pass

    def write(self, record) -> None:
        self.last = record

    def close(self) -> None:
        pass


def make_observers(
    names: Sequence[str], workload: str, model: Optional[nn.Module] = None
) -> List[instrument.Observer]:
    """``model``: whose parameters GradientStats and NonFinite cover and whose layers ActivationStats hooks."""
    channel_dim = 1 if workload == "nca" else -1
    made = {
        "IterationStats": lambda: IterationStats(channel_dim=channel_dim),
        "UpdateNorm": UpdateNorm,
        "RolloutVideo": RolloutVideo,
        "GradientStats": lambda: GradientStats(module=model),
        "GradientStats.global": lambda: GradientStats(module=model, per="global"),
        "NonFinite": lambda: NonFinite(channel_dim=channel_dim, module=model),
        "ActivationStats": lambda: instrument.ActivationStats(module=model),
        "StateHistogram": lambda: instrument.StateHistogram(channel_dim=channel_dim),
    }
    return [made[n]() for n in names]


_OPEN: List[Instrumentation] = []  # sessions the rows opened, closed by `close_sessions` when their group is done


def opened(inst: Instrumentation) -> Instrumentation:
    """Keep ``inst`` for `close_sessions`: a session dropped without close() keeps its writer thread and files,
    and the next session made warns about it."""
    _OPEN.append(inst)
    return inst


def close_sessions() -> None:
    """Close every session the rows opened (after the group that timed them: closing is never timed)."""
    while _OPEN:
        _OPEN.pop().close()


class Session:
    """One Instrumentation driven like a training loop: each call is the next step (logging or not)."""

    def __init__(
        self, observers: Sequence[str], workload: str, logging: bool, backend: str, tmp: str,
        model: Optional[nn.Module] = None,
    ) -> None:
        backends: List[Backend]
        if backend == "tensorboard":
            backends = [instrument.TensorBoardBackend()]
        else:
            backends = [SinkBackend()]
        self.inst = opened(Instrumentation(
            observers=make_observers(observers, workload, model),
            backends=backends,
            log_interval=1 if logging else 10**12,
            run_name=None,  # a unique default: several variants log to the same tmp folder
            log_dir=tmp,
        ))
        self.step = 1  # step 0 would be a logging step for any interval

    def next_step(self) -> int:
        self.step += 1
        return self.step


# ------------------------------------------------------------------------------------------------- NCA
def _nca_parts():
    from instrument.demos.nca import UpdateRule, make_seed, make_target

    s = NCA_SIZE
    torch.manual_seed(0)
    rule = UpdateRule(channels=s["channels"], hidden=s["hidden"])
    # Train-like parameters (the demo's last layer starts at zero, which would make dx trivially zero).
    with torch.no_grad():
        for p in rule.parameters():
            p.normal_(0.0, 0.05)
    seed = make_seed(s["batch"], s["channels"], s["size"])
    q = s["size"] // 4
    seed[:, :, q:-q, q:-q] = torch.rand(s["batch"], s["channels"], s["size"] - 2 * q, s["size"] - 2 * q)
    target = make_target(s["size"]).unsqueeze(0).expand(s["batch"], -1, -1, -1)
    dev = device()
    return rule.to(dev), seed.to(dev), target.to(dev)


def _nca_model(rule: nn.Module) -> nn.Module:
    """The demo's NCA module around a copy of ``rule``: what a wandb user would watch (one call per step)."""
    from instrument.demos.nca import NCA

    s = NCA_SIZE
    model = NCA(channels=s["channels"], hidden=s["hidden"]).to(device())
    model.update_rule = copy.deepcopy(rule)
    return model


def evolve(rule: Callable[[Tensor], Tensor], x: Tensor, n_iter: int, observer) -> Tensor:
    """The explicit-evolver loop: the rollout hands each iteration to ``observer`` (None: no logging step)."""
    for i in range(n_iter):
        prev = x
        x = rule(x)
        if observer is not None:
            observer(StepContext(previous_state=prev, next_state=x, step_index=i))
    return x


def naive_stats(prev: Tensor, x: Tensor, sink: List[object], dims=(0, 2, 3)) -> None:
    """What most trainers write: every statistic turned into Python numbers right away."""
    with torch.no_grad():
        sink.append(x.mean(dim=dims).tolist())
        sink.append(x.std(dim=dims).tolist())
        sink.append(x.amin(dim=dims).tolist())
        sink.append(x.amax(dim=dims).tolist())
        sink.append((x - prev).reshape(x.shape[0], -1).norm(dim=1).mean().item())
        if x.dim() == 4:
            sink.append((x[:, 3] > 0.1).float().mean().item())


def _is_instrumented(kind: str) -> bool:
    return kind in ("off", "log", "log-tb") or kind.startswith("log[")


def _instrumented(
    kind: str, workload: str, train, tmp: str, hooks_on: Optional[nn.Module] = None,
    model: Optional[nn.Module] = None,
):
    """The training step inside ``inst.step``: hooks on ``hooks_on``, or ``s.observer`` handed to ``train``.

    Returns the step function, its description for the table, and its untimed settle (the logger's flush).
    """
    names = OBSERVERS if kind in ("off", "log", "log-tb") else tuple(filter(None, [kind[4:-1]]))
    session = Session(
        names, workload, kind != "off", "tensorboard" if kind == "log-tb" else "sink", tmp, model=model
    )
    if hooks_on is not None:
        session.inst.watch(hooks_on)

    def fn():
        inst = session.inst
        step = session.next_step()
        with inst.step(step) as scope:
            loss = train(None if hooks_on is not None else scope.observer)
            inst.logger.log_metrics({"loss": loss}, step=step, prefix="train")

    style = "hooks" if hooks_on is not None else "explicit evolver"
    when = ", non-logging step" if kind == "off" else f", logging step: {', '.join(names) or 'no observer'}"
    describe = style + when
    if kind == HEADLINE:
        describe = f"headline logging step: {', '.join(names)}, real TensorBoardBackend ({style})"
    return fn, describe, _flush(session.inst.logger)


def _flush(logger) -> Optional[Callable[[], object]]:
    """The logger's ``flush`` (a background writer's drain), or None where the Logger has none."""
    return getattr(logger, "flush", None)


def nca_variants(modes: Sequence[str], wanted: Callable[[str], bool], tmp: str) -> List[Variant]:
    from instrument.demos.nca import run_iterations

    s = NCA_SIZE
    n_iter, k = s["n_iter"], s["checkpoint_every"]
    base_rule, seed, target = _nca_parts()
    out: List[Variant] = []

    def trainer(rule: nn.Module, forward: Callable[[Optional[Callable]], Tensor]):
        opt = torch.optim.Adam(rule.parameters(), lr=1e-4)

        def train(observer=None) -> Tensor:
            x = forward(observer)
            loss = F.mse_loss(x[:, :4], target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()

        return train

    for mode in modes:
        keys = [f"nca/{mode}/{kind}" for kind in KINDS[mode]]
        if not any(wanted(key) for key in keys):
            continue
        baseline = f"nca/{mode}/bare"
        rule = copy.deepcopy(base_rule)
        hooks_on: Optional[nn.Module] = None
        if mode in ("eager", "ckpt"):
            runner: Callable[[Tensor], Tensor] = rule
            hooks_on = rule
            every = k if mode == "ckpt" else 0

            def forward(observer, runner=runner, every=every):
                return run_iterations(runner, seed, n_iter, checkpoint_every=every)
        else:
            runner = torch.jit.script(rule) if mode == "script" else torch.compile(rule)

            def forward(observer, runner=runner):
                return evolve(runner, seed, n_iter, observer)

        train = trainer(rule, forward)
        for kind, key in zip(KINDS[mode], keys, strict=True):
            if not wanted(key) and key != baseline:
                continue
            v = Variant(key=key, baseline=baseline)
            if kind == "bare":
                v.fn, v.describe = train, "no instrument"
            elif _is_instrumented(kind):
                v.fn, v.describe, v.settle = _instrumented(kind, "nca", train, tmp, hooks_on, model=rule)
            elif kind == "naive":
                sink: List[object] = []

                def naive_forward(observer, runner=runner, sink=sink):
                    sink.clear()
                    x = seed
                    for _ in range(n_iter):
                        prev, x = x, runner(x)
                        naive_stats(prev, x, sink)
                    return x

                v.fn, v.describe = (
                    trainer(rule, naive_forward),
                    "per-iteration .tolist()/.item() of the same stats",
                )
            elif kind == "wandb-watch":
                v.fn, v.pending, v.describe = wandb_variant(
                    _nca_model(base_rule), "nca", tmp, lambda m: trainer(m, lambda observer: m(seed, n_iter))
                )
                v.group = WANDB_GROUP
            elif kind.startswith("probe-"):
                v.pending = PROBE_PENDING if not hasattr(instrument, "Probe") else None
                if v.pending is None:
                    v.fn, v.check, v.describe, v.settle = _probe_variant(
                        "nca", mode, kind, tmp, target=target, seed=seed
                    )
            out.append(v)
    return out


# -------------------------------------------------------------------------------------------------- RL
def rl_variants(modes: Sequence[str], wanted: Callable[[str], bool], tmp: str) -> List[Variant]:
    from instrument.demos.cartpole import CartPole, Policy, discounted_returns

    s = RL_SIZE
    torch.manual_seed(0)
    dev = device()
    base_policy = Policy(hidden=s["hidden"]).to(dev)
    out: List[Variant] = []

    def trainer(policy: nn.Module, act: Callable[[Tensor], Tensor], naive: bool = False):
        env = CartPole(num_envs=s["envs"], device=dev, generator=torch.Generator(dev).manual_seed(0))
        actions_rng = torch.Generator(dev)
        opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
        sink: List[object] = []

        def train(observer=None) -> Tensor:
            env.generator.manual_seed(0)
            actions_rng.manual_seed(1)
            sink.clear()
            obs = env.reset()
            alive = torch.ones(s["envs"], dtype=torch.bool, device=dev)
            log_probs, rewards = [], []
            for t in range(s["steps"]):
                logp_all = F.log_softmax(act(obs), dim=-1)
                action = torch.multinomial(logp_all.detach().exp(), 1, generator=actions_rng).squeeze(1)
                next_obs, reward, done = env.step(action)
                if observer is not None:
                    observer(
                        StepContext(
                            previous_state=obs,
                            next_state=next_obs,
                            condition=action,  # as the README hands it over: the action tensor as is
                            step_index=t,
                        )
                    )
                if naive:
                    naive_stats(obs, next_obs, sink, dims=(0,))
                log_probs.append(logp_all.gather(1, action.unsqueeze(1)).squeeze(1))
                rewards.append(reward * alive.to(reward.dtype))
                alive = alive & ~done
                obs = next_obs
            returns = discounted_returns(torch.stack(rewards))
            advantage = returns - returns.mean(dim=1, keepdim=True)
            loss = -(torch.stack(log_probs) * advantage.detach()).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()

        return train

    for mode in modes:
        keys = [f"rl/{mode}/{kind}" for kind in KINDS[mode]]
        if not any(wanted(key) for key in keys):
            continue
        baseline = f"rl/{mode}/bare"
        policy = copy.deepcopy(base_policy)
        act = (
            policy
            if mode == "eager"
            else torch.jit.script(policy)
            if mode == "script"
            else torch.compile(policy)
        )
        train = trainer(policy, act)
        for kind, key in zip(KINDS[mode], keys, strict=True):
            if not wanted(key) and key != baseline:
                continue
            v = Variant(key=key, baseline=baseline)
            if kind == "bare":
                v.fn, v.describe = train, "no instrument"
            elif ("rl", kind[4:-1]) in NOT_APPLICABLE:
                v.pending = NOT_APPLICABLE[("rl", kind[4:-1])]
            elif _is_instrumented(kind):
                v.fn, v.describe, v.settle = _instrumented(kind, "rl", train, tmp, model=policy)
            elif kind == "naive":
                v.fn = trainer(policy, act, naive=True)
                v.describe = "per-iteration .tolist()/.item() of the same stats"
            elif kind == "wandb-watch":
                v.fn, v.pending, v.describe = wandb_variant(
                    copy.deepcopy(base_policy), "rl", tmp, lambda p: trainer(p, p)
                )
                v.group = WANDB_GROUP
            elif kind.startswith("probe-"):
                v.pending = PROBE_PENDING if not hasattr(instrument, "Probe") else RL_PROBE_PENDING
            out.append(v)
    return out


def _probe_variant(workload: str, mode: str, kind: str, tmp: str, **parts):
    """Rows for issue 3's embedded probes. Built against the API issue 3 describes; if the Probe module that
    lands behaves differently, the self-check reports the row as pending instead of timing something else."""
    from bench.probe_rows import probe_variant

    return probe_variant(workload, mode, kind, tmp, **parts)


# ------------------------------------------------------------------------------------------------- all
def build_variants(selected: Optional[Sequence[str]] = None, tmp: Optional[str] = None) -> List[Variant]:
    """Variants for ``selected`` keys (all when None), plus the baselines they need."""
    chosen = set(selected) if selected is not None else set(all_keys())
    tmp = tmp or tempfile.mkdtemp(prefix="instrument-bench-")

    def wanted(key: str) -> bool:
        return key in chosen

    variants = nca_variants(MODES["nca"], wanted, tmp) + rl_variants(MODES["rl"], wanted, tmp)
    if device().type == "cuda":
        for v in variants:
            if v.fn is not None:
                v.fn = _synchronized(v.fn)
    variants += scalar_variants(wanted, tmp)
    order = {key: i for i, key in enumerate(all_keys())}
    return sorted(variants, key=lambda v: order[v.key])


def _synchronized(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` then a wait for the device: a CUDA step is timed until its work is done (every row alike)."""

    dev = device()

    def step() -> None:
        fn()
        torch.cuda.synchronize(dev)  # host sync: the bench's clock, not the library's (the rows' own device)

    return step
