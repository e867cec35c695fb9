"""GradientStats: gradient, weight and update norms per parameter, what ``wandb.watch`` shows, on logging steps only.

Why it is cheap: nothing is registered on a module (gradients are read where they are, after backward, at the
end of the ``inst.step`` block), norms are computed with ``torch._foreach_norm`` (one fused kernel per device
and dtype for all parameters, not one per parameter), and every result stays on the device until the logger's
one batched transfer. The only copy is the weight snapshot for the update ratio, taken in ``attach`` (logging
steps only) and released in ``detach`` (also when the step raised), so non-logging steps hold no copy.

The global norm is computed exactly as ``torch.nn.utils.clip_grad_norm_`` computes it before clipping
(grouped by device and dtype, ``_foreach_norm`` per group, then the vector norm of the stacked norms), so it is
bitwise equal to what that function returns when the same gradients are given in the same order.
"""

import logging
import re
from typing import Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from instrument.core.dtensors import by_kind, classic_fsdp, dtensor_placements, is_replicated, kinds
from instrument.core.loss_scale import LossScale, divided, divisors
from instrument.core.observer import Observer
from instrument.errors import ConfigurationError

log = logging.getLogger("instrument")

__all__ = ["GradientStats", "grad_norms", "select_parameters"]


def _key_dtype(device: torch.device) -> torch.dtype:
    """The dtype of every logged key: float64 (float32 on MPS, which has none), so one call is one block."""
    return torch.float32 if device.type == "mps" else torch.float64


_PER = ("param", "module", "global")
Patterns = Union[None, str, Sequence[str]]

try:  # the grouping clip_grad_norm_ itself uses; private, so fall back to one group per tensor without it
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
except ImportError:  # pragma: no cover - depends on the torch version
    _group_tensors_by_device_and_dtype = None


def _not_global(key: str, root: str) -> str:
    """A parameter or submodule named ``global`` (``add_module("global", ...)``) would log ``norm/global`` and
    overwrite the global norm: it is named from its root module's class instead (``Net.global``)."""
    return f"{root}.global" if key == "global" else key


def _compile(patterns: Patterns, what: str) -> List["re.Pattern[str]"]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigurationError(
                f"GradientStats {what} takes regular expressions (a str or a list of str), got "
                f"{type(pattern).__name__} ({pattern!r})."
            )
        try:
            out.append(re.compile(pattern))
        except re.error as exc:
            raise ConfigurationError(f"GradientStats {what} pattern {pattern!r} is not a valid regex: {exc}.") from exc
    return out


def select_parameters(
    modules: Sequence[nn.Module], include: Patterns = None, exclude: Patterns = None
) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the trainable parameters of ``modules``, each parameter once.

    Names are as in ``named_parameters()`` of their module (``.`` kept); with several modules each name gets the
    module's class name in front (``Rule.conv.weight``), and a running index where class names repeat.
    ``include``/``exclude`` are regular expressions searched (``re.search``) in that name.
    """
    keep, drop = _compile(include, "include"), _compile(exclude, "exclude")
    seen = set()
    out: List[Tuple[str, nn.Parameter]] = []
    labels: Dict[str, int] = {}
    used = set()
    for module in modules:
        module = getattr(module, "_orig_mod", module)  # a torch.compile wrapper: its module's own names
        label = ""
        if len(modules) > 1:
            label = type(module).__name__
            labels[label] = labels.get(label, 0) + 1
            if labels[label] > 1:
                label = f"{label}{labels[label] - 1}"
            while label in used:  # a second Rule is Rule1, and so may a class be named: one key per parameter
                label += "_"
            used.add(label)
            label += "."
        for name, param in module.named_parameters():
            name = label + name
            if not param.requires_grad or id(param) in seen:
                continue
            if keep and not any(p.search(name) for p in keep):
                continue
            if any(p.search(name) for p in drop):
                continue
            seen.add(id(param))
            out.append((name, param))
    return out


def _dense_grad(p: nn.Parameter) -> bool:
    """The parameter has a gradient in the strided layout (a sparse one, from nn.Embedding(sparse=True), has no
    ``_foreach_norm``: it failed the whole log, losing every other norm of the step)."""
    return p.grad is not None and p.grad.layout == torch.strided


_HALF = (torch.float16, torch.bfloat16)


def foreach_norms(tensors: Sequence[Tensor]) -> List[Tensor]:
    """L2 norms of ``tensors`` (one fused ``_foreach_norm`` per dtype), float16 and bfloat16 ones computed and
    returned in float32: in their own dtype a float16 weight norm above 65504 read inf (a [10000] tensor of
    1000s) and a bfloat16 one kept 3 significant digits. For weights and updates only: gradient norms stay
    those of ``clip_grad_norm_`` (`grad_norms`)."""
    mixed = by_kind(tensors, foreach_norms)
    if mixed is not None:
        return mixed
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    if len(by_dtype) == 1 and tensors[0].dtype not in _HALF:
        return list(torch._foreach_norm(list(tensors), 2.0))
    out: List[Tensor] = [tensors[0]] * len(tensors)
    for dtype, indices in by_dtype.items():
        wide = {"dtype": torch.float32} if dtype in _HALF else {}
        for i, norm in zip(indices, torch._foreach_norm([tensors[i] for i in indices], 2.0, **wide), strict=True):
            out[i] = norm
    return out


def _copies(tensors: List[Tensor]) -> List[Tensor]:
    return list(torch._foreach_mul(tensors, 1.0))


def grad_norms(tensors: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(per-tensor L2 norms [n], global L2 norm)`` with the global one computed as ``clip_grad_norm_`` does.

    One ``_foreach_norm`` per (device, dtype) group; the per-tensor norms come back in the order given, on the
    first tensor's device.
    """
    mixed = by_kind(tensors, lambda group: grad_norms(group)[0].unbind())
    if mixed is not None:  # plain tensors beside DTensors: each kind's norms apart, the global norm of them all
        norms = torch.stack([norm.to(tensors[0].device) for norm in mixed])
        return norms, torch.linalg.vector_norm(norms, 2.0)
    first = tensors[0].device
    if _group_tensors_by_device_and_dtype is not None:
        groups = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
        ordered: List[Tensor] = []
        positions: List[int] = []
        for (device, _), ([group], indices) in groups.items():
            if device.type in ("cpu", "cuda"):
                ordered.extend(torch._foreach_norm(group, 2.0))
            else:
                ordered.extend(torch.linalg.vector_norm(g, 2.0) for g in group)
            positions.extend(indices)
    else:  # pragma: no cover
        ordered, positions = [torch.linalg.vector_norm(g, 2.0) for g in tensors], list(range(len(tensors)))
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in ordered]), 2.0)
    in_order: List[Tensor] = [ordered[0]] * len(ordered)
    for position, norm in zip(positions, ordered, strict=True):
        in_order[position] = norm.to(first)
    return torch.stack(in_order), total


def _unscaled(norms: Tensor, total: Tensor, scales: Sequence[Optional[Tensor]]) -> Tuple[Tensor, Tensor]:
    """Gradient norms of loss-scaled gradients divided by their scales (None: not scaled), and the global norm:
    divided as well when one scale covers every gradient (then what ``clip_grad_norm_`` returns after
    ``unscale_``, exactly for GradScaler's powers of two), else taken again from the divided norms."""
    if all(s is not None for s in scales) and all(s is scales[0] for s in scales):
        return divided(norms, scales[0]), divided(total, scales[0])
    norms = norms / divisors(scales, norms)
    return norms, torch.linalg.vector_norm(norms, 2.0)


class GradientStats(Observer):
    """Gradient, weight and update norms of a model's parameters, read at the end of each logging step.

    It answers "is it learning, and is it stable?": exploding or vanishing gradients (``norm``), weights that
    grow without bound (``weight_norm``), and learning rates too large or too small for a layer
    (``update_ratio``: around 1e-3 per step is the usual healthy order of magnitude). Gradients are read after
    backward and before they are zeroed, at the end of the ``with inst.step(...)`` block: zero them at the start
    of the step (``opt.zero_grad()`` before ``loss.backward()``), as usual.

    Metric keys (``<name>`` defaults to ``grad_stats``; ``<param>`` as in ``named_parameters()`` of the watched
    module, or ``<module>`` with ``per="module"``; one named ``global`` is ``<RootClass>.global``):

    =================================== ========= ================================================================
    key                                 kind      meaning
    =================================== ========= ================================================================
    ``<name>/norm/global``              scalar    L2 norm over all gradients (what ``clip_grad_norm_`` returns)
    ``<name>/norm/<param>``             scalar    L2 norm of the parameter's gradient
    ``<name>/weight_norm/<param>``      scalar    L2 norm of the parameter after the optimizer step
    ``<name>/update_ratio/<param>``     scalar    ``||w_after - w_before|| / ||w_before||`` over the step
    ``<name>/grad_hist/<param>``        histogram the gradient's values (``histograms=True``)
    ``<name>/weight_hist/<param>``      histogram the parameter's values (``histograms=True``)
    =================================== ========= ================================================================

    Args:
        module: the model whose parameters are covered; None (default) covers the modules watched with
            ``inst.watch`` (each parameter once).
        per: ``"param"`` (default) one key per parameter; ``"module"`` one per module that owns parameters
            (``<module>`` is its path, ``""`` for the root written as its class name); ``"global"`` only
            ``norm/global``: one fused norm pass over the gradients and nothing else.
        update_ratio: snapshot the weights at the start of each logging step for ``update_ratio`` (a copy of
            the covered parameters, held only during the logging step). The optimizer step must run inside
            the ``with inst.step(...)`` block, or the ratio is 0.
        weight_norm: log ``weight_norm``.
        histograms: log gradient and weight histograms per parameter (host work on the writer thread).
        include, exclude: regular expressions (a str or a list) searched in parameter names: only names
            matching some ``include`` (default: all) and no ``exclude`` are covered.
        name: the key prefix.

    Range: every norm of a float32 parameter is a float32 ``_foreach_norm`` (gradient norms bit for bit those of
    ``clip_grad_norm_``; weight and update norms too, since a float64 one measured 24x slower on CPU): its squares
    underflow, so float32 weights whose elements all lie below about 2e-23 in magnitude read ``weight_norm`` 0 and
    ``update_ratio`` NaN (0 / 0), and a NaN ratio means the weight norm before the step read 0 (all zeros, or
    underflow), not that nothing changed; see docs/observers.md.

    Parameters without a gradient in the step (``p.grad is None``) are left out of every norm, as
    ``clip_grad_norm_`` leaves them out; a step where none of them has one is said once (a WARNING naming the
    usual causes). With ``Instrumentation(grad_scaler=scaler)``, gradients still loss-scaled when read (the
    optimizer step after the block) are divided by the scale (`instrument.core.loss_scale`).

    Works with scripted and compiled models alike (only parameters are read); under gradient checkpointing the
    gradients are the same, so the keys are too.
    """

    default_name = "grad_stats"
    wants_loss_scale = True  # the session hands it `loss_scale` (Instrumentation(grad_scaler=...))

    def __init__(
        self,
        module: Optional[nn.Module] = None,
        per: Literal["param", "module", "global"] = "param",
        update_ratio: bool = True,
        weight_norm: bool = True,
        histograms: bool = False,
        include: Patterns = None,
        exclude: Patterns = None,
        name: str = "",
    ) -> None:
        super().__init__(name)
        if module is not None and not isinstance(module, nn.Module):
            raise ConfigurationError(
                f"GradientStats(module=...) takes a torch.nn.Module, got {type(module).__name__}; pass the "
                f"model itself, or leave it out to cover the modules watched with inst.watch."
            )
        if per not in _PER:
            raise ConfigurationError(f"GradientStats per must be one of {_PER}, got {per!r}.")
        self.module = module
        self.per = per
        self.update_ratio = update_ratio and per != "global"
        self.weight_norm = weight_norm and per != "global"
        self.histograms = histograms
        self.include, self.exclude = include, exclude
        _compile(include, "include"), _compile(exclude, "exclude")  # fail at construction, not at the first step
        self._params: List[Tuple[str, nn.Parameter]] = []
        self._before: Optional[List[Tensor]] = None
        self._update: Optional[Tuple[List[Tensor], List[Tensor]]] = None
        self._modules: List[nn.Module] = []
        self._said_sparse = False
        self._said_fsdp = False  # classic FSDP parameters were left out (said once)
        self._said_sharded = False  # histograms of sharded DTensor parameters were left out (said once)
        self._said_no_grad = False  # a logging step where no covered parameter had a gradient was reported
        # Set by Instrumentation(grad_scaler=...): gradients read while still loss-scaled are divided by the scale.
        self.loss_scale: Optional[LossScale] = None

    def reset(self) -> None:
        self._params, self._before, self._update = [], None, None

    def close(self) -> None:
        """The parameters and modules of the last logging step go: the observer may outlive the model."""
        self.reset()
        self._modules = []

    def attach(self, modules: Sequence[nn.Module]) -> None:
        self._modules = [self.module] if self.module is not None else list(modules)
        self._params = select_parameters(self._modules, self.include, self.exclude)
        flattened = [name for name, p in self._params if classic_fsdp(p)]
        if flattened:  # a rank's shard norms, not the parameters': those are left out, the others logged
            self._say_classic_fsdp(flattened)
            self._params = [(name, p) for name, p in self._params if not classic_fsdp(p)]
        if self.loss_scale is not None:  # a gradient this step leaves untouched is not its scaled backward's
            self.loss_scale.track([p for _, p in self._params])
        if self.update_ratio and self._params:
            with torch.no_grad():
                # x * 1 is a bitwise copy; the foreach form is one fused kernel per group instead of one each. A
                # float16 or bfloat16 parameter's copy is float32 (exact), so that its update is subtracted in
                # float32: in its own dtype a weight going from 1 + 2**-7 to -2**-9 read an update ratio of 1.0
                # for 1.0019 (docs/observers.md: half-precision update ratios are computed in float32).
                params = [p for _, p in self._params]  # under no_grad: no detached alias of each needed
                others = [p for p in params if p.dtype not in _HALF]
                copies = iter((by_kind(others, _copies, scalars=False) or _copies(others)) if others else ())
                self._before = [p.float() if p.dtype in _HALF else next(copies) for p in params]

    def detach(self) -> None:
        """The optimizer step is done: the update norms now, and the snapshot is released in any case."""
        before, self._before = self._before, None
        if before is None or not self._params:
            return
        with torch.no_grad():
            base = foreach_norms(before)
            after = [p for _, p in self._params]
            # The snapshot is ours: in place. Grouped by whether the dtypes match, so that a float32 copy less a
            # half-precision parameter (a per-tensor loop on CUDA) does not take the others off the fused kernel.
            widened = [b.dtype != a.dtype for b, a in zip(before, after, strict=True)]
            for kind in (False, True):
                group = [i for i, w in enumerate(widened) if w == kind]
                for members in kinds(after, group):  # each kind apart: the fused kernel refuses a mix
                    torch._foreach_sub_([before[i] for i in members], [after[i] for i in members])
            self._update = (foreach_norms(before), base)

    def _say_sparse(self, names: List[str]) -> None:
        if names and not self._said_sparse:
            self._said_sparse = True
            log.warning(
                "instrument: GradientStats(%r): the gradients of %s are sparse (nn.Embedding(sparse=True)); they are "
                "left out of every gradient norm and histogram (torch's clip_grad_norm_ cannot take them either), "
                "the other parameters are logged. (Said once.)", self.name, names,
            )

    def _say_classic_fsdp(self, names: List[str]) -> None:
        if not self._said_fsdp:
            self._said_fsdp = True
            shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            log.warning(
                "instrument: GradientStats(%r): %s were flattened by a classic FullyShardedDataParallel: each rank "
                "holds only its shard of them, and their norms, update ratios and histograms would be one rank's "
                "shard's, not the parameters', so they are left out, as if excluded (norm/global covers the other "
                "parameters). Shard the model with FSDP2 (torch.distributed.fsdp.fully_shard), whose DTensor "
                "gradients are reduced over the whole parameter, to log them. (Said once.)", self.name, shown,
            )

    def _say_sharded(self, name: str, placements: tuple) -> None:
        if not self._said_sharded:
            self._said_sharded = True
            log.warning(
                "instrument: GradientStats(%r): the parameter %r and its gradient are DTensors with placements %s "
                "(FSDP2 fully_shard): each rank holds only a shard, so their histograms are not logged (a shard's "
                "values are not the parameter's, and gathering every parameter would cost a collective and its full "
                "size each logging step). The norms are logged, reduced over the whole parameter. (Said once.)",
                self.name, name, placements,
            )

    def _say_no_gradient(self, step: int) -> None:
        if self._said_no_grad:
            return
        self._said_no_grad = True
        log.warning(
            "instrument: GradientStats(%r): none of the %d covered parameters had a gradient at the end of logging "
            "step %d, so no norm/* key is logged (update_ratio reads 0 where they did not change). Usual causes: "
            "no backward() ran in this step, backward() runs after the `with inst.step` block, zero_grad() runs "
            "before the block ends, or the parameters trained are not the module's own (torch.func.functional_call "
            "with a separate parameter dict: cover the module whose parameters the optimizer updates). (Said once.)",
            self.name, len(self._params), step,
        )

    def _keys(self, present: Sequence[bool]) -> Tuple[List[str], List[List[int]]]:
        """Key names and the parameter positions behind each, over the parameters marked ``present``."""
        root = type(self._modules[0]).__name__ if self._modules else ""
        if self.per != "module":
            positions = [i for i, ok in enumerate(present) if ok]
            return [_not_global(self._params[i][0], root) for i in positions], [[i] for i in positions]
        grouped: Dict[str, List[int]] = {}  # module -> its parameters' positions, in first-seen order (a dict: a
        for i, (name, _) in enumerate(self._params):  # list's index() made this quadratic in the modules)
            if present[i]:
                grouped.setdefault(name.rpartition(".")[0] or root, []).append(i)
        return [_not_global(key, root) for key in grouped], list(grouped.values())

    @staticmethod
    def _per_key(values: Tensor, members: List[List[int]], positions: List[int]) -> Tensor:
        """One L2 norm per key, as float: ``values[j]`` is the norm of parameter ``positions[j]``.

        With one parameter per key (``per="param"``) that is ``values`` itself; a module's key is the norm of
        its parameters' norms. A few vectorised ops, never one op per parameter in the common cases.
        """
        # A module's norm from its parameters' norms squared in float64 (float32 on MPS): a handful of values,
        # and float16 norms or float32 norms below ~3e-23 would square to inf or 0.
        values = values.to(_key_dtype(values.device))
        flat = [i for m in members for i in m]
        if flat != positions:  # keys over a subset, or grouped out of order: pick the members first
            where = {p: j for j, p in enumerate(positions)}
            values = torch.stack([values[where[i]] for i in flat])
        if len(members) == len(flat):
            return values
        sums = torch.split(values.square(), [len(m) for m in members])
        return torch.stack([part.sum() for part in sums]).sqrt_()

    def log(self, logger, step: int) -> None:
        # Under no_grad whoever calls it (a session's end already is): the gradients and parameters are taken as
        # they are, with no detached alias of each (6,000 tensor objects at 3,000 parameter tensors), and no norm
        # of a parameter may carry autograd graph into the logger.
        with torch.no_grad():
            self._log(logger, step)

    def _log(self, logger, step: int) -> None:
        metrics: Dict[str, Tensor] = {}
        everything = list(range(len(self._params)))
        dense = [_dense_grad(p) for _, p in self._params]
        self._say_sparse([name for (name, p), ok in zip(self._params, dense, strict=True)
                          if p.grad is not None and not ok])
        with_grad = [i for i, ok in enumerate(dense) if ok]
        # An optimizer step after the block (gradient accumulation, a second optimizer): the gradients GradScaler
        # has not unscaled yet are the scaled loss's, so their norms and values are divided by the scale here.
        scales: List[Optional[Tensor]] = [None] * len(self._params)
        if self.loss_scale is not None and with_grad:
            for i, scale in zip(with_grad, self.loss_scale.scales([self._params[i][1] for i in with_grad]),
                                strict=True):
                scales[i] = scale
        if with_grad:
            norms, total = grad_norms([self._params[i][1].grad for i in with_grad])
            if any(scales[i] is not None for i in with_grad):
                norms, total = _unscaled(norms, total, [scales[i] for i in with_grad])
            # In the dtype of the other keys (float64; float32 on MPS), exact: one dtype keeps the whole call on the
            # logger's one-block path, where a float32 among float64 values sent every key, and every later call of
            # the interval, down the per-key path (1.3-1.6x the logging step's logger time at 100-1,000 tensors).
            metrics["norm/global"] = total.to(_key_dtype(total.device))
            if self.per != "global":
                keys, members = self._keys(dense)
                per_key = self._per_key(norms, members, with_grad)
                metrics.update(zip([f"norm/{k}" for k in keys], per_key.unbind(), strict=True))
        elif self._params and not any(p.grad is not None for _, p in self._params):
            self._say_no_gradient(step)
        keys, members = self._keys([True] * len(self._params))
        if self.weight_norm and self._params:
            weights = torch.stack(foreach_norms([p for _, p in self._params]))
            per_key = self._per_key(weights, members, everything)
            metrics.update(zip([f"weight_norm/{k}" for k in keys], per_key.unbind(), strict=True))
        if self._update is not None:
            change, base = (torch.stack(norms) for norms in self._update)
            ratios = self._per_key(change, members, everything) / self._per_key(base, members, everything)
            metrics.update(zip([f"update_ratio/{k}" for k in keys], ratios.unbind(), strict=True))
            self._update = None
        if metrics:
            logger.log_metrics(metrics, step=step, prefix=self.name)
        if self.histograms:
            root = type(self._modules[0]).__name__ if self._modules else ""
            for (name, p), ok, scale in zip(self._params, dense, scales, strict=True):
                name = _not_global(name, root)
                placements = dtensor_placements(p)
                if placements is not None and not is_replicated(placements):
                    self._say_sharded(name, placements)
                    continue
                if ok:
                    grad = p.grad.detach()
                    logger.log_histogram(f"{self.name}/grad_hist/{name}", grad if scale is None else
                                         divided(grad, scale), step)
                logger.log_histogram(f"{self.name}/weight_hist/{name}", p.detach(), step)
