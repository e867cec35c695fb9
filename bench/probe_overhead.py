"""What embedded probes cost: NCA and CartPole rollouts, eager / TorchScript / torch.compile.

For each mode it times four variants of the same rollout:

* ``bare``: the demo module, no probes anywhere;
* ``off``:  the same module with `instrument.Probe`s embedded, on a non-logging step (target <= 1.01x bare);
* ``on``:   a logging step: probes record every iteration and a session hands the values to an observer;
* ``observed``: the bare module in a logging step with the same observer calls, so ``on / observed`` is what
  the probes themselves add to a logging step.

Every repetition runs each variant once in shuffled order; the report is the median over repetitions of
``variant / bare`` within a mode (never absolute times: the machine is shared). For torch.compile the
"on" variant is compiled (and run) before timing, so ``off`` is measured with an "on" graph in the cache:
the situation in which the on/off guard trap (docs/probes.md) would show.

    python bench/probe_overhead.py                     # eager + TorchScript, ~1-2 minutes
    python bench/probe_overhead.py --compile           # + torch.compile (inductor): minutes of cold compiles
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Tuple

_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "4294967296",
        "MALLOC_TRIM_THRESHOLD_": "4294967296"}
if any(os.environ.get(k) != v for k, v in _ENV.items()):  # stable timings need these before torch loads
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_ENV})

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import instrument  # noqa: E402
from instrument.demos.cartpole import CartPole, Policy  # noqa: E402
from instrument.demos.nca import UpdateRule, make_seed  # noqa: E402

warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)


class ProbedRule(UpdateRule):
    """The demo NCA rule with probes on the hidden activation and the update."""

    def __init__(self) -> None:
        super().__init__()
        self.p_hidden = instrument.Probe("hidden")
        self.p_dx = instrument.Probe("dx")

    def forward(self, x: Tensor) -> Tensor:
        pre_alive = self.alive_mask(x)
        perception = F.conv2d(x, self.kernel, padding=1, groups=self.channels)
        h = self.p_hidden(torch.relu(self.conv1(perception)))
        dx = self.p_dx(self.conv2(h)) * self.step_size
        fire = torch.rand(x.shape[0], 1, x.shape[2], x.shape[3], dtype=x.dtype, device=x.device)
        x = x + dx * (fire <= self.fire_rate).to(x.dtype)
        post_alive = self.alive_mask(x)
        return x * (pre_alive & post_alive).to(x.dtype)


class ProbedPolicy(Policy):
    """The demo CartPole policy with probes on both hidden layers."""

    def __init__(self) -> None:
        super().__init__()
        self.p_h1 = instrument.Probe("h1")
        self.p_h2 = instrument.Probe("h2")

    def forward(self, obs: Tensor) -> Tensor:
        h = self.p_h1(torch.tanh(self.fc1(obs)))
        h = self.p_h2(torch.tanh(self.fc2(h)))
        return self.head(h)


class KeepProbes(instrument.Observer):
    """The cheapest useful observer: keeps a reference to every probe value (stats would come at log time)."""

    def reset(self) -> None:
        self.kept: List[Dict[str, Tensor]] = []

    def observe(self, context) -> None:
        self.kept.append(context.probes)


def nca_rollout(rule: Callable, seed: Tensor, n_iter: int, observer=None) -> Tensor:
    x = seed
    for _ in range(n_iter):
        nxt = rule(x)
        if observer is not None:
            observer(instrument.StepContext(x, nxt))
        x = nxt
    return x


def cartpole_rollout(policy: Callable, n_steps: int, observer=None) -> Tensor:
    env = CartPole(num_envs=256, generator=torch.Generator().manual_seed(0))
    obs, total = env.reset(), torch.zeros(256)
    for _ in range(n_steps):
        action = policy(obs).argmax(dim=1)
        nxt, reward, _ = env.step(action)
        if observer is not None:
            observer(instrument.StepContext(obs, nxt, condition=action))
        obs, total = nxt, total + reward
    return total


def build(workload: str, mode: str, args, log_dir: str) -> Tuple[Dict[str, Callable[[], object]], List[object]]:
    """The four timed callables of one workload in one mode, and the two sessions behind them (closed by the
    caller once they are timed: a session dropped open keeps its writer thread, and the next one warns)."""
    torch.manual_seed(0)
    if workload == "nca":
        bare, probed = UpdateRule(), ProbedRule()
        seed = make_seed(args.batch, size=args.size)
        for m in (bare, probed):
            nn.init.normal_(m.conv2.weight, std=0.01)  # a trained-looking rule, not the zero-init identity
        probed.load_state_dict(bare.state_dict())

        def run(module, observer=None):
            return nca_rollout(module, seed, args.n_iter, observer)
    else:
        bare, probed = Policy(), ProbedPolicy()
        probed.load_state_dict(bare.state_dict())

        def run(module, observer=None):
            return cartpole_rollout(module, args.n_steps, observer)

    if mode == "scripted":
        bare_m, probed_m = torch.jit.script(bare), torch.jit.script(probed)
    elif mode == "compiled":
        bare_m, probed_m = torch.compile(bare), torch.compile(probed)
    else:
        bare_m, probed_m = bare, probed
    # Probes only (the loop hands contexts to s.observer), the same in every mode.
    inst = instrument.Instrumentation(observers=[KeepProbes()], backends=[], log_interval=1, log_dir=log_dir)
    inst.watch(probed_m, state=False)
    plain = instrument.Instrumentation(observers=[KeepProbes()], backends=[], log_interval=1, log_dir=log_dir)

    steps = {"on": 0, "observed": 0}  # a new step number per call: a session refuses to enter a step twice

    def on():
        steps["on"] += 1
        with inst.step(steps["on"]) as s:
            return run(probed_m, s.observer)

    def observed():
        steps["observed"] += 1
        with plain.step(steps["observed"]) as s:
            return run(bare_m, s.observer)

    with torch.no_grad():  # compile or warm every variant, "on" first (see the module docstring)
        for fn in (on, on) + (lambda: run(bare_m), lambda: run(probed_m)) * 2:
            fn()
    variants = {"bare": lambda: run(bare_m), "off": lambda: run(probed_m), "on": on, "observed": observed}
    return variants, [inst, plain]


def measure(variants: Dict[str, Callable], reps: int) -> Dict[str, float]:
    """Medians of per-repetition ratios: each variant to ``bare``, and ``on`` to ``observed`` (key
    ``on/observed``), every ratio paired within one repetition."""
    ratios: Dict[str, List[float]] = {name: [] for name in variants if name != "bare"}
    ratios["on/observed"] = []
    names = list(variants)
    with torch.no_grad():
        for _ in range(reps):
            random.shuffle(names)
            times = {}
            for name in names:
                start = time.perf_counter()
                variants[name]()
                times[name] = time.perf_counter() - start
            for name in variants:
                if name != "bare":
                    ratios[name].append(times[name] / times["bare"])
            ratios["on/observed"].append(times["on"] / times["observed"])
    return {name: statistics.median(values) for name, values in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (inductor)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--n-iter", type=int, default=32)
    parser.add_argument("--n-steps", type=int, default=100)
    parser.add_argument("--workloads", default="nca,cartpole")
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = ["eager", "scripted"] + (["compiled"] if args.compile else [])
    print(f"torch {torch.__version__}, {args.reps} reps, medians of per-rep ratios to the bare module")
    header = ("workload", "mode", "off/bare", "on/bare", "observed/bare", "on/observed")
    print("{:10} {:9} {:>9} {:>9} {:>14} {:>12}".format(*header))
    with tempfile.TemporaryDirectory() as log_dir:  # the sessions' run folders: not left in the working tree
        for workload in args.workloads.split(","):
            for mode in modes:
                variants, sessions = build(workload, mode, args, log_dir)
                try:
                    r = measure(variants, args.reps)
                finally:
                    for session in sessions:
                        session.close()
                print(f"{workload:10} {mode:9} {r['off']:9.3f} {r['on']:9.3f} {r['observed']:14.3f} "
                      f"{r['on/observed']:12.3f}", flush=True)


if __name__ == "__main__":
    main()
