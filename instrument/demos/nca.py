"""A growing neural cellular automaton (Mordvintsev et al., "Growing Neural Cellular Automata", Distill 2020).

Sized for a CPU: a small grid, a procedurally drawn target (no download) and a short rollout, so a few
hundred training steps finish in about a minute on one thread. `UpdateRule` is exactly one rollout iteration
and is TorchScript-compatible, so the instrumentation can watch it eager or scripted; `NCA.forward` calls it
once per iteration so a forward hook on ``update_rule`` sees every iteration.
"""

import sys
import time
from typing import Any, Callable, Dict, List, Optional

import gin
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from instrument.checks import check_int, check_number
from instrument.demos.device import demo_device

__all__ = ["make_target", "make_seed", "UpdateRule", "NCA", "run_iterations", "rollout", "train_nca"]

# Three disc colours (RGB); where discs overlap the colours are averaged.
_DISC_COLOURS = ((1.0, 0.35, 0.3), (0.3, 0.8, 0.35), (0.3, 0.45, 1.0))


def make_target(size: int = 32, radius: float = 0.22, offset: float = 0.12) -> Tensor:
    """A procedural RGBA target [4, size, size]: three overlapping coloured discs around the centre pixel.

    Every disc covers the centre (``offset < radius``) so the shape is connected and contains the seed cell,
    which is what a growing NCA needs. Alpha is 1 inside, 0 outside; RGB is premultiplied by alpha, in [0, 1].
    ``radius`` and ``offset`` are fractions of ``size``.
    """
    centre = size // 2 + 0.5  # continuous coordinate of the seed pixel's centre
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    rgb_sum = torch.zeros(3, size, size)
    count = torch.zeros(size, size)
    for k, colour in enumerate(_DISC_COLOURS):
        angle = torch.tensor(torch.pi / 2 + 2 * torch.pi * k / len(_DISC_COLOURS))
        cy = centre - offset * size * torch.sin(angle)
        cx = centre + offset * size * torch.cos(angle)
        inside = (((yy - cy) ** 2 + (xx - cx) ** 2) <= (radius * size) ** 2).float()
        rgb_sum += torch.tensor(colour).view(3, 1, 1) * inside
        count += inside
    alpha = (count > 0).float()
    rgb = rgb_sum / count.clamp(min=1.0)  # already 0 outside, i.e. premultiplied
    return torch.cat([rgb, alpha.unsqueeze(0)], dim=0).clamp(0.0, 1.0)


def make_seed(batch: int, channels: int = 16, size: int = 32) -> Tensor:
    """The starting state [batch, channels, size, size]: one live cell (channels 3.. = 1) at the centre."""
    x = torch.zeros(batch, channels, size, size)
    x[:, 3:, size // 2, size // 2] = 1.0
    return x


def _perception_kernel(channels: int) -> Tensor:
    """Depthwise kernel [3*channels, 1, 3, 3]: identity, Sobel-x, Sobel-y for each channel, in that order."""
    identity = torch.zeros(3, 3)
    identity[1, 1] = 1.0
    sobel_x = torch.outer(torch.tensor([1.0, 2.0, 1.0]), torch.tensor([-1.0, 0.0, 1.0])) / 8.0
    sobel_y = sobel_x.t().contiguous()
    return torch.stack([identity, sobel_x, sobel_y]).repeat(channels, 1, 1).unsqueeze(1)


class UpdateRule(nn.Module):
    """One NCA iteration: perceive, per-cell MLP, stochastic update, alive masking.

    Perception is a fixed depthwise conv (identity, Sobel-x, Sobel-y per channel) with ZERO padding: the
    world is a bounded canvas, not a torus, as in the paper's 'SAME' convolution. The MLP is two 1x1 convs
    whose last layer starts at zero, so an untrained rule is the identity up to alive masking and training
    starts from a stable state. Fire masks come from the global RNG (``torch.rand``) so ``torch.manual_seed``
    reproduces a rollout exactly, eager or scripted.
    """

    def __init__(
        self,
        channels: int = 16,
        hidden: int = 128,
        fire_rate: float = 0.5,
        alive_threshold: float = 0.1,
        step_size: float = 1.0,
    ) -> None:
        super().__init__()
        if channels < 4:
            raise ValueError(f"UpdateRule needs at least 4 channels (RGBA), got {channels}")
        self.channels = channels
        self.fire_rate = fire_rate
        self.alive_threshold = alive_threshold
        self.step_size = step_size
        self.register_buffer("kernel", _perception_kernel(channels))
        self.conv1 = nn.Conv2d(3 * channels, hidden, kernel_size=1)
        self.conv2 = nn.Conv2d(hidden, channels, kernel_size=1)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def alive_mask(self, x: Tensor) -> Tensor:
        """Bool [B, 1, H, W]: a cell is alive if any cell in its 3x3 neighbourhood has alpha > threshold."""
        alpha = x[:, 3:4]
        return F.max_pool2d(alpha, kernel_size=3, stride=1, padding=1) > self.alive_threshold

    def forward(self, x: Tensor) -> Tensor:
        pre_alive = self.alive_mask(x)
        perception = F.conv2d(x, self.kernel, padding=1, groups=self.channels)
        dx = self.conv2(torch.relu(self.conv1(perception))) * self.step_size
        fire = torch.rand(x.shape[0], 1, x.shape[2], x.shape[3], dtype=x.dtype, device=x.device)
        x = x + dx * (fire <= self.fire_rate).to(x.dtype)
        post_alive = self.alive_mask(x)
        return x * (pre_alive & post_alive).to(x.dtype)


def run_iterations(
    rule: Callable[[Tensor], Tensor],
    x: Tensor,
    n_iter: int,
    checkpoint_every: int = 0,
    use_reentrant: bool = False,
) -> Tensor:
    """Apply ``rule`` ``n_iter`` times, optionally gradient-checkpointing chunks of ``checkpoint_every``.

    Checkpointing trades compute for memory on long rollouts; the RNG state is preserved so the recomputed
    chunk replays the same fire masks. Note that the recomputation during backward calls ``rule`` again, so
    forward hooks on it fire a second time for checkpointed chunks. No checkpointing happens when grad is
    disabled, where it would only cost time.
    """
    if checkpoint_every <= 0 or not torch.is_grad_enabled():
        for _ in range(n_iter):
            x = rule(x)
        return x

    def chunk(state: Tensor, k: int) -> Tensor:
        for _ in range(k):
            state = rule(state)
        return state

    done = 0
    while done < n_iter:
        k = min(checkpoint_every, n_iter - done)
        x = checkpoint(chunk, x, k, use_reentrant=use_reentrant)
        done += k
    return x


class NCA(nn.Module):
    """The automaton: ``forward(x, n_iter)`` calls ``self.update_rule`` once per iteration."""

    def __init__(
        self,
        channels: int = 16,
        hidden: int = 128,
        fire_rate: float = 0.5,
        alive_threshold: float = 0.1,
        checkpoint_every: int = 0,
    ) -> None:
        super().__init__()
        self.update_rule = UpdateRule(
            channels=channels, hidden=hidden, fire_rate=fire_rate, alive_threshold=alive_threshold
        )
        self.checkpoint_every = checkpoint_every

    def forward(self, x: Tensor, n_iter: int) -> Tensor:
        return run_iterations(self.update_rule, x, n_iter, checkpoint_every=self.checkpoint_every)


def rollout(model: NCA, seed: Tensor, n_iter: int, observer: Optional[Callable[[Any], Any]] = None) -> Tensor:
    """Explicit-evolver rollout: the loop itself hands each iteration to ``observer`` as a `StepContext`.

    This is the alternative to hooks for code that owns its loop. ``StepContext`` is imported lazily so the
    demo runs without the instrumentation package when no observer is given.
    """
    step_context: Any = None
    if observer is not None:
        from instrument.core.context import StepContext

        step_context = StepContext
    x = seed
    for i in range(n_iter):
        prev = x
        x = model.update_rule(x)
        if observer is not None:
            observer(step_context(previous_state=prev, next_state=x, step_index=i))
    return x


def _normalize_grads(model: nn.Module) -> None:
    """Per-parameter gradient normalisation (the paper's trick): stops long-rollout gradients exploding."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(p.grad.norm() + 1e-8)


def train_nca(
    instrumentation: Any = None,
    steps: int = 300,
    batch_size: int = 4,
    size: int = 24,
    channels: int = 16,
    n_iter_min: int = 24,
    n_iter_max: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    log_every_loss: bool = True,
    checkpoint_every: int = 0,
    hidden: int = 128,
    fire_rate: float = 0.5,
    normalize_grads: bool = True,
    device: Any = "cpu",
) -> Dict[str, Any]:
    """Train an NCA to grow `make_target` from `make_seed`; returns ``final_loss``, ``first_loss``, timings.

    The defaults (24x24 grid, batch 4, 24-32 iterations) are sized so 300 steps take about a minute on one
    CPU thread while the loss still falls several-fold; the paper's 64x64 / batch 8 / 64-96 is ~30x the work.

    With ``instrumentation`` the rule is watched (hooks observe every iteration) and each training step runs
    inside ``inst.step(step)``; the caller owns and closes the instrumentation. ``log_every_loss=False`` logs
    the loss only on the last step. ``seed`` fixes the init, the fire masks (global RNG) and the rollout
    lengths (a private generator), so two runs with the same arguments are identical. ``device``: where the
    model and its states live (`instrument.demos.device`: ``'cpu'``, ``'cuda'``, ``'auto'``...); the model is
    initialised on the CPU and moved, so a GPU run starts from the CPU run's weights.
    """
    for name, value, least, why, fix in (
        ("steps", steps, 1, "", 300), ("batch_size", batch_size, 1, "", 4), ("size", size, 4, "", 24),
        ("n_iter_min", n_iter_min, 1, "", 24), ("n_iter_max", n_iter_max, n_iter_min, "n_iter_min", n_iter_min),
        ("channels", channels, 4, "R, G, B and alpha, then the hidden ones", 16),
        ("hidden", hidden, 1, "the update MLP's width", 128),
        ("checkpoint_every", checkpoint_every, 0, "0: off", 0),
    ):
        check_int(f"train_nca {name}", value, least=least, why=why, fix=f"bind e.g. train_nca.{name} = {fix}")
    check_number("train_nca fire_rate", fire_rate, least=0, most=1, why="the chance that a cell updates",
                 fix="bind e.g. train_nca.fire_rate = 0.5")
    check_number("train_nca lr", lr, above=0, most=sys.float_info.max, expected="a finite number > 0",
                 fix="bind e.g. train_nca.lr = 2e-3")  # 1e999 reads as infinity: no learning rate
    dev = demo_device("train_nca", device)
    torch.manual_seed(seed)
    lengths_rng = torch.Generator().manual_seed(seed)
    model = NCA(channels=channels, hidden=hidden, fire_rate=fire_rate, checkpoint_every=checkpoint_every).to(dev)
    target = make_target(size).unsqueeze(0).expand(batch_size, -1, -1, -1).to(dev)
    seed_batch = make_seed(batch_size, channels, size).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    inst = instrumentation
    if inst is not None:
        inst.watch(model.update_rule)

    def train_step(n_iter: int) -> Tensor:
        x = model(seed_batch, n_iter)
        loss = F.mse_loss(x[:, :4], target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if normalize_grads:
            _normalize_grads(model)
        opt.step()
        return loss.detach()

    losses: List[Tensor] = []  # kept as tensors: no host sync per step
    start = time.perf_counter()
    cpu_start = time.process_time()
    for step in range(steps):
        n_iter = int(torch.randint(n_iter_min, n_iter_max + 1, (1,), generator=lengths_rng))
        if inst is None:
            loss = train_step(n_iter)
        else:
            with inst.step(step):
                loss = train_step(n_iter)
                if log_every_loss or step == steps - 1:
                    inst.logger.log_metrics({"loss": loss}, step=step, prefix="train")
        losses.append(loss)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start  # less skewed than wall time on a busy machine
    history = torch.stack(losses).tolist() if losses else []
    return {
        "final_loss": history[-1] if history else float("nan"),
        "first_loss": history[0] if history else float("nan"),
        "losses": history,
        "steps": steps,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "model": model,
    }


# gin at the edge: a config that imports this module (`import instrument.demos.nca`) can bind these;
# registered as copies, so calling them from Python ignores bindings.
gin.external_configurable(train_nca, name="train_nca")
