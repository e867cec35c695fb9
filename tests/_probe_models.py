"""Small NCA-like update rules with and without embedded probes, shared by the probe tests.

Kept in a real file (not defined inside tests) because TorchScript compiles from source.
"""

from typing import List, Tuple

import torch
from torch import Tensor, nn

import instrument

CHANNELS = 4


class Rule(nn.Module):
    """One NCA iteration: depthwise 3x3 perception, 1x1-conv MLP, residual update; two probes inside."""

    def __init__(self, channels: int = CHANNELS, hidden: int = 8, grad: bool = False) -> None:
        super().__init__()
        self.perceive = nn.Conv2d(channels, 3 * channels, 3, padding=1, groups=channels, bias=False)
        self.fc0 = nn.Conv2d(3 * channels, hidden, 1)
        self.fc1 = nn.Conv2d(hidden, channels, 1)
        self.p_hidden = instrument.Probe("hidden", grad=grad)
        self.p_update = instrument.Probe("update")

    def forward(self, x: Tensor) -> Tensor:
        h = self.p_hidden(torch.relu(self.fc0(self.perceive(x))))
        return x + self.p_update(self.fc1(h))


class BareRule(nn.Module):
    """`Rule` without probes; same parameter names, so ``load_state_dict`` moves weights between them."""

    def __init__(self, channels: int = CHANNELS, hidden: int = 8) -> None:
        super().__init__()
        self.perceive = nn.Conv2d(channels, 3 * channels, 3, padding=1, groups=channels, bias=False)
        self.fc0 = nn.Conv2d(3 * channels, hidden, 1)
        self.fc1 = nn.Conv2d(hidden, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc0(self.perceive(x)))
        return x + self.fc1(h)


class Model(nn.Module):
    """A whole rollout in one forward: not one iteration, so it is watched with ``state=False``."""

    def __init__(self) -> None:
        super().__init__()
        self.rule = Rule()
        self.encoder_probe = instrument.Probe("seed")

    def forward(self, x: Tensor, n: int) -> Tensor:
        x = self.encoder_probe(x)
        for _ in range(n):
            x = self.rule(x)
        return x


class TwoSameNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Identity(), instrument.Probe("h"))
        self.b = instrument.Probe("h")

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def reference(rule: nn.Module, x: Tensor, n: int) -> List[dict]:
    """What each iteration's probes must hold, computed from the rule's layers directly."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            h = torch.relu(rule.fc0(rule.perceive(x)))
            update = rule.fc1(h)
            out.append({"hidden": h, "update": update})
            x = x + update
    return out


class InPlaceRule(nn.Module):
    """Changes the probed value in place right after the probe (an in-place activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.p_h = instrument.Probe("h")

    def forward(self, x: Tensor) -> Tensor:
        h = self.p_h(torch.sin(3.0 * x))
        h.relu_()
        return h + 1.0



class StateInPlaceRule(nn.Module):
    """`Rule`'s update, added to its state argument in place and returned (``x.add_(dx); return x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Rule()

    def forward(self, x: Tensor) -> Tensor:
        dx = self.inner(x) - x
        x.add_(dx)
        return x

class Loop(nn.Module):
    """A rollout loop around an update rule, for scripting whole: TorchScript calls the rule, not Python. With
    ``clamp`` the loop itself changes the state in place between calls (not the rule's in-place change)."""

    def __init__(self, rule: nn.Module, clamp: bool = False) -> None:
        super().__init__()
        self.rule = rule
        self.clamp = clamp

    def forward(self, x: Tensor, n: int) -> Tensor:
        for _ in range(n):
            x = self.rule(x)
            if self.clamp:
                x.clamp_(-3.0, 3.0)
        return x


class CondRule(nn.Module):
    """A conditioned iteration returning a tuple: ``(next, hidden)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(CHANNELS, CHANNELS)
        self.p_h = instrument.Probe("h")

    def forward(self, x: Tensor, condition: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.p_h(torch.tanh(self.fc(x) + condition))
        return x + h, h


class ReuseRule(nn.Module):
    """A rule whose probed intermediates Inductor would overwrite: ``a`` is dead after ``c1`` and ``b`` has
    the same size, so compiled code may write ``b`` into ``a``'s memory; ``out`` is returned."""

    def __init__(self, channels: int = CHANNELS) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(channels, channels, 1)
        self.c1 = nn.Conv2d(channels, channels, 1)
        self.c2 = nn.Conv2d(channels, channels, 1)
        self.p_a = instrument.Probe("a")
        self.p_out = instrument.Probe("out")

    def forward(self, x: Tensor) -> Tensor:
        a = self.p_a(torch.sin(self.c0(x)) * 3)
        b = torch.cos(self.c1(a)) + 1
        return self.p_out(torch.tanh(self.c2(b)) * 2 + b)

    def reference(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        a = torch.sin(self.c0(x)) * 3
        b = torch.cos(self.c1(a)) + 1
        return a, torch.tanh(self.c2(b)) * 2 + b


def hidden_gradients(rule: nn.Module, x: Tensor, n: int, loss=lambda x: x.square().mean()) -> List[Tensor]:
    """Eager autograd's gradient of each iteration's hidden activations for ``loss(x)`` (default
    ``x.square().mean()``) after ``n`` iterations: what a gradient probe on them must deliver."""
    hidden = []
    for _ in range(n):
        h = torch.relu(rule.fc0(rule.perceive(x)))
        h.retain_grad()
        hidden.append(h)
        x = x + rule.fc1(h)
    loss(x).backward()
    return [h.grad for h in hidden]


class KeepProbes(instrument.Observer):
    """Keeps each call's probe values, cloned where they are (on a GPU: no host sync)."""

    def __init__(self, probes: Tuple[str, ...] = ("hidden", "update"), name: str = "keep") -> None:
        super().__init__(name)
        self.probes = tuple(probes)
        self.seen: List[dict] = []

    def reset(self) -> None:
        self.seen = []

    def observe(self, context) -> None:
        self.seen.append({name: value.clone() for name, value in context.probes.items()})
