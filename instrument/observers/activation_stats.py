"""ActivationStats: what every chosen submodule outputs, iteration by iteration (dead units, exploding layers).

Composer's activation monitor gives this diagnostic with several ``.item()`` host syncs per tensor inside its
hook. Here nothing leaves the device before the logger's one transfer. Forward hooks exist only during logging
steps: `attach` registers them, `detach` removes them.

Cost: a hook only keeps a reference to the output (`instrument.observers.buffer.IterationBuffer`, version
checked), and all calls of a module are reduced in one batched call at log time: on small outputs (an RL
policy's [256, 64] layers) ten kernel launches per call would cost more than the layer itself. Outputs of
``2**17`` elements or more are reduced as they come (their stack no longer fits in cache), as is every output
of a module once one was caught being modified in place after its hook ran (``nn.ReLU(inplace=True)`` after
it): that step's values of the module are dropped with one report. ``max_elements`` bounds the memory kept.

Numerics: the variance is the mean of ``(d - E[d])^2`` of ``d = x - r`` (two passes) with ``r`` the mean of a
strided sample of 32 output values (as in `instrument.observers.stats`), so an output whose mean is large next to
its spread keeps its precision; means are float32 pairwise sums (float64 outputs stay float64, also next to float32
modules, and int32, int64, uint32 and uint64 outputs are reduced in float64, as in `instrument.observers.stats`).
``absmax`` comes from the exact minimum and maximum. ``d`` is scaled by a power of two first
(`instrument.observers.stats.pow2_scale`, exact), so a diverging layer's std does not overflow while its spread
fits the dtype. ``zero_frac`` counts exact zeros as the mean of ``sign(x)^2`` with NaN read as 1 first
(``torch.sign(NaN)`` is 0, so an all-NaN layer read as dead): about 3x faster on CPU than summing ``x != 0``
(measured on torch 2.13).
"""

import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from instrument.core.context import reduction_dtype
from instrument.core.observer import Observer, over_ranks
from instrument.core.recompute import in_recompute
from instrument.errors import ConfigurationError
from instrument.observers.buffer import IterationBuffer, ModifiedInPlaceError
from instrument.observers.options import color_ranges
from instrument.observers.stats import pow2_scale, refuse_complex
from instrument.probes.compiled import ForwardSwitch, ancestors, hook_switch, unwrap
from instrument.probes.step_hook import step_hook
from instrument.probes.transforms import in_trace_check, outside_transforms, physical, transformed

__all__ = ["ActivationStats", "output_moments"]

log = logging.getLogger("instrument")

STATS = ("mean", "std", "absmax", "zero_frac")
_SAMPLE = 32


def batched_moments(outputs: Tensor, scratch: bool = False) -> Tensor:
    """[k, *output] -> [k, 6]: per output [shift r, mean(x - r), std, min, max, nonzero fraction].

    Everything `ActivationStats` reports follows from them (`_finish`). One temporary the size of ``outputs``
    (``scratch`` is accepted for `IterationBuffer` and not needed), no host sync.
    """
    refuse_complex("batched_moments", outputs)
    integral = not outputs.dtype.is_floating_point  # integers and bools: a whole reference keeps x - r exact
    k = outputs.shape[0]
    flat = outputs.reshape(k, -1)
    wide = reduction_dtype(flat.dtype, flat.device)  # float64 for int32/int64/uint32/uint64, else float32
    if flat.dtype != wide:
        flat = flat.to(wide)
    n = flat.shape[1]
    if n == 0:
        return torch.full((k, 6), float("nan"), dtype=flat.dtype, device=flat.device)
    low, high = flat.amin(1), flat.amax(1)
    reference = flat[:, :: max(1, n // _SAMPLE)][:, :_SAMPLE].mean(1, keepdim=True)
    reference = reference.nan_to_num_(0.0, 0.0, 0.0)  # an inf in the sample: no inf - inf = NaN (one kernel)
    if integral:
        reference = reference.round_()
    scale = pow2_scale(torch.maximum(high - reference[:, 0], reference[:, 0] - low))  # [k]
    temp = torch.nan_to_num(flat, nan=1.0)  # a NaN is not an exact zero, but torch.sign(NaN) is 0
    nonzero = temp.sign_().square_().mean(1)  # means, not sums: no division kernel
    shifted = torch.sub(flat, reference, out=temp).mul_(scale[:, None])  # the same buffer
    mean_shift = shifted.mean(1)  # means, not sums: no division kernel
    # Two passes: squares of the deviations from that mean, so nothing cancels when the sample was far off.
    var = shifted.sub_(mean_shift[:, None]).square_().mean(1)
    return torch.stack([reference[:, 0], mean_shift / scale, var.sqrt_().div_(scale), low, high, nonzero], 1)


def output_moments(x: Tensor) -> Tensor:
    """`batched_moments` of one output: [6]."""
    return batched_moments(x.detach().unsqueeze(0))[0]


def _finish(moments: Tensor) -> Tensor:
    """[..., 6] `output_moments` -> [..., 4] mean, std (population), absmax, zero_frac."""
    reference, mean_shift, std, low, high, nonzero = moments.unbind(-1)
    return torch.stack([reference + mean_shift, std, torch.maximum(-low, high), 1.0 - nonzero], -1)


def _module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


class ActivationStats(Observer):
    """Per-submodule output statistics over the rollout: mean, std, absmax and the fraction of exact zeros.

    Each chosen submodule's forward output (its first tensor, depth first, for a tuple, list or dict such as a
    ``ModelOutput``) is reduced over all its elements on
    every call during a logging step; a ReLU layer whose ``zero_frac`` nears 1 has dead units. Row ``k`` of a
    heatmap is the module's ``k``-th call in the step, which is rollout iteration ``k`` when each module runs
    once per iteration (a module called twice per iteration has twice the rows; missing rows are grey).
    Checkpoint recomputation is skipped, so each iteration counts once.

    Which modules: ``types`` (classes, or class names such as ``"Conv2d"``) and/or ``pattern`` (a regular
    expression searched in the module's qualified name, e.g. ``"^mlp\\."``); a module must match both when both
    are given. Default: every leaf module with parameters of its own, and ``nn.MultiheadAttention`` modules (their
    ``out_proj`` is never called: the attention reads its weights; their output's first tensor is the
    attention's). Modules are looked up in ``module`` if given, else in the modules watched with ``inst.watch``
    (names then start with the watched module's class name when more than one is watched, plus its position when
    two share a class). ``torch.compile`` wrappers
    are unwrapped; TorchScript modules cannot take Python forward hooks and are skipped with one warning (so a
    scripted model needs its eager original). A compiled model never calls hooks registered after its first
    compiled call: use the eager model on logging steps, or embedded probes (`instrument.Probe`).

    Metric keys (``<name>`` defaults to ``activations``; ``<module>`` is the qualified name, e.g. ``mlp.0``):

    =============================== ======== ==========================================================
    key                             kind     meaning
    =============================== ======== ==========================================================
    ``<name>/<module>/mean``        scalar   mean of the module's output, at its last call
    ``<name>/<module>/std``         scalar   population std of the output, at its last call
    ``<name>/<module>/absmax``      scalar   largest absolute value of the output, at its last call
    ``<name>/<module>/zero_frac``   scalar   fraction of output elements exactly 0, at its last call
    ``<name>/mean``                 image    iteration x module heatmap of the mean
    ``<name>/std``                  image    iteration x module heatmap of the std
    ``<name>/absmax``               image    iteration x module heatmap of the absmax
    ``<name>/zero_frac``            image    iteration x module heatmap of the zero fraction
    =============================== ======== ==========================================================

    Args:
        module: where to look for submodules; None: the watched modules.
        types: module classes (or class names) to hook.
        pattern: regular expression the qualified module name must contain (``re.search``).
        images: log the heatmaps (on by default).
        color_range: the heatmaps' colour scale: None, ``(lo, hi)``, ``"running"``, or a dict per statistic
            (e.g. ``{"zero_frac": (0, 1), "mean": "running"}``); see `IterationStats`.
        max_modules: hook at most this many modules (in ``named_modules`` order); None: all.
        max_elements: reduce early once the kept outputs of all modules hold this many elements (bounds memory).
    """

    default_name = "activations"

    def __init__(
        self,
        name: str = "",
        module: Optional[nn.Module] = None,
        types: Optional[Sequence[Union[Type[nn.Module], str]]] = None,
        pattern: Optional[str] = None,
        images: bool = True,
        color_range: Any = None,
        max_modules: Optional[int] = 64,
        max_elements: Optional[int] = 64 * 2**20,
    ) -> None:
        super().__init__(name)
        owner = f"ActivationStats({self.name!r})"
        if module is not None and not isinstance(module, nn.Module):
            raise ConfigurationError(f"{owner}: module must be a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(module, torch.jit.ScriptModule):
            raise ConfigurationError(
                f"{owner}: module is a TorchScript module, and Python forward hooks cannot be registered on "
                f"ScriptModules; pass the eager module it was scripted from and run that on logging steps."
            )
        if types is not None and (isinstance(types, (str, type)) or not isinstance(types, Sequence)):
            types = [types]  # one class or name alone
        bad = [t for t in (types or ()) if not isinstance(t, str) and not _module_class(t)]
        if bad:
            raise ConfigurationError(f"{owner}: types must be nn.Module subclasses or class names, got {bad!r}.")
        try:
            self.pattern = re.compile(pattern) if pattern is not None else None
        except (re.error, TypeError) as error:
            raise ConfigurationError(f"{owner}: pattern {pattern!r} is not a regular expression ({error}).") from None
        self.module = module
        self.types = tuple(types) if types is not None else None
        self.images = images
        self.color_range = color_ranges(owner, color_range, STATS)
        self.max_modules = max_modules
        self.max_elements = max_elements
        self._handles: List[RemovableHandle] = []
        self._switch: Optional[ForwardSwitch] = None  # under torch.compile, during a logging step (`hook_switch`)
        self._names: List[str] = []
        self._sums: List[IterationBuffer] = []  # per hooked module: its outputs, reduced to [calls, 6]
        self._calls: List[int] = []
        self._no_tensor: Dict[int, str] = {}  # this step's modules that ran with no real tensor in their output
        self._unbatched: Set[str] = set()  # modules whose outputs were modified in place: reduced as they come
        self._dropped: Set[int] = set()  # this step's modules whose values were lost that way
        self._warned: Dict[str, bool] = {}
        self._error: Optional[Exception] = None

    # ------------------------------------------------------------------ selection
    def _wanted(self, qualified: str, module: nn.Module) -> bool:
        if self.types is None and self.pattern is None:
            if isinstance(module, nn.MultiheadAttention):  # a leaf as far as its calls go (`_never_called`)
                return True
            return not any(True for _ in module.children()) and any(True for _ in module.parameters(recurse=False))
        if self.types is not None and not any(
            (type(module).__name__ == t) if isinstance(t, str) else isinstance(module, t) for t in self.types
        ):
            return False
        return self.pattern is None or self.pattern.search(qualified) is not None

    def select(self, roots: Sequence[nn.Module]) -> List[Tuple[str, nn.Module]]:
        """The (qualified name, module) pairs this observer hooks under ``roots``, each module once."""
        roots = [unwrap(r) for r in roots]
        seen, chosen, scripted, prefixes = set(), [], [], set()
        classes = [type(r).__name__ for r in roots]
        for i, root in enumerate(roots):
            prefix = "" if len(roots) == 1 else classes[i] + (str(i) if classes.count(classes[i]) > 1 else "")
            while prefix and prefix in prefixes:  # Rule at position 1 is Rule1, and so may a class be named
                prefix += "_"
            prefixes.add(prefix)
            for qualified, module in root.named_modules():
                if isinstance(module, torch.jit.ScriptModule):
                    scripted.append(qualified or type(module).__name__)
                    continue
                if _never_called(root, qualified):
                    continue
                if id(module) in seen or not self._wanted(qualified, module):
                    continue
                seen.add(id(module))
                name = ".".join(p for p in (prefix, qualified) if p) or type(module).__name__
                chosen.append((name, module))
        if scripted:
            self._warn_once(
                "scripted",
                f"instrument: ActivationStats({self.name!r}) skips TorchScript submodules {scripted[:4]}: Python "
                f"forward hooks cannot be registered on ScriptModules.",
            )
        if self.max_modules is not None and len(chosen) > self.max_modules:
            self._warn_once(
                "max_modules",
                f"instrument: ActivationStats({self.name!r}) matched {len(chosen)} modules and hooks the first "
                f"max_modules={self.max_modules}; narrow types/pattern or raise max_modules.",
            )
            chosen = chosen[: self.max_modules]
        return chosen

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self._names, self._sums, self._calls, self._error = [], [], [], None
        self._dropped: Set[int] = set()
        self._no_tensor = {}
        self.hook_seconds = 0.0  # the step's time in the forward hooks, counted in this observer's overhead

    def close(self) -> None:
        # What a step that raised before its log kept: the buffered outputs, and an error whose traceback holds
        # frames (the per-module call counts stay, for a look after the run).
        self._sums, self._error = [], None

    def attach(self, modules: Sequence[nn.Module]) -> None:
        self.detach()
        self.reset()
        roots = [self.module] if self.module is not None else list(modules)
        chosen = self.select(roots) if roots else []
        if not chosen:
            self._warn_once(
                "nothing",
                f"instrument: ActivationStats({self.name!r}) found no module to hook: "
                + ("watch a module with inst.watch(...) or pass module=... " if not roots else
                   "no submodule matches types/pattern (default: leaf modules with parameters) ")
                + "so it logs nothing.",
            )
        budget = None if self.max_elements is None else max(1, self.max_elements // max(1, len(chosen)))
        for index, (name, module) in enumerate(chosen):
            self._names.append(name)
            self._sums.append(IterationBuffer(batched_moments, budget, batched=name not in self._unbatched))
            self._calls.append(0)
            self._handles.append(module.register_forward_hook(step_hook(self._hook_for(index))))
        self._switch = hook_switch(_on_the_way([unwrap(r) for r in roots], [module for _, module in chosen]))
        if self._switch is not None:
            self._switch.on()

    def detach(self) -> None:
        switch, self._switch = self._switch, None
        if switch is not None:
            switch.off()
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _hook_for(self, index: int):
        buffer = self._sums[index]

        def hook(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            start = time.perf_counter()
            try:
                keep(output)
            finally:
                self.hook_seconds += time.perf_counter() - start

        def keep(output: Any) -> None:
            if in_recompute():  # checkpoint recomputation: this call was already seen in forward
                return
            if torch._C._is_tracing() or in_trace_check():  # torch.jit.trace running the module: no iteration
                return
            try:  # a hook runs inside the user's forward: a fault here must never reach training
                out = output_tensor(output)
                if out is None or out.is_complex():  # said at log time (`_say_no_tensor`)
                    if index not in self._no_tensor:
                        self._no_tensor[index] = _described(output, out)
                    return
                self._calls[index] += 1
                if transformed():  # under torch.func: the plain tensor (vmap: the whole batch), kept outside it
                    with outside_transforms(), torch.no_grad():
                        buffer.append(physical(out).detach())
                    return
                with torch.no_grad():
                    buffer.append(out.detach())  # shares the version counter: in-place changes are caught
            except ModifiedInPlaceError:  # caught while draining early: this step's values of the module go
                self._modified(index)
            except Exception as error:  # reported by the session's ledger when `log` re-raises it
                self._error = self._error or error

        return hook

    def log(self, logger, step: int) -> None:
        if self._error is not None and not isinstance(self._error, ModifiedInPlaceError):
            raise RuntimeError(
                f"ActivationStats({self.name!r}): a forward hook failed in this logging step ({self._error!r}); "
                f"training went on, this step's activation statistics are dropped"
            ) from self._error
        results: Dict[int, Tensor] = {}
        for m, buffer in enumerate(self._sums):
            try:
                rows = buffer.results()  # [calls, 6]
            except ModifiedInPlaceError:
                self._modified(m)
                continue
            if rows is not None and m not in self._dropped:
                results[m] = rows
        self._log_results(logger, step, results)
        if self._dropped:
            names = [self._names[m] for m in sorted(self._dropped)]
            raise ModifiedInPlaceError(
                f"ActivationStats({self.name!r}): the outputs of {names} were modified in place after their hooks "
                f"ran (an in-place op after the module, e.g. nn.ReLU(inplace=True)), so the references kept for "
                f"the batched reduction no longer hold the outputs; their values of this step are dropped (the "
                f"other modules' are logged) and from now on their outputs are reduced as they come"
            )

    def _modified(self, index: int) -> None:
        self._dropped.add(index)
        self._unbatched.add(self._names[index])

    def _say_no_tensor(self, step: int) -> None:
        for index, what in self._no_tensor.items():
            if not self._calls[index]:  # each call of the step had no tensor
                name = self._names[index]
                self._warn_once(
                    f"no tensor {name}",
                    f"instrument: ActivationStats({self.name!r}): module {name!r} ran in logging step {step}, but "
                    f"its output ({what}) holds no real tensor to reduce, so it has no statistics. It reduces a "
                    f"tensor output, or the first tensor (depth first) of a tuple, list or dict output; choose "
                    f"the submodule that makes the tensor (types=/pattern=). (Said once per module.)",
                )

    def _log_results(self, logger, step: int, results: Dict[int, Tensor]) -> None:
        self._say_no_tensor(step)
        present = sorted(results)
        if not present:
            if self._names and not any(self._calls) and not self._no_tensor:
                self._warn_once(
                    "silent",
                    f"instrument: none of the {len(self._names)} modules ActivationStats({self.name!r}) hooked "
                    f"ran in logging step {step}; a torch.compile'd model does not call hooks added after "
                    f"compiling (run the eager model on logging steps), and forward code inside backward is "
                    f"skipped.",
                )
            return
        names = [self._names[m] for m in present]
        rows = max(results[m].shape[0] for m in present)
        # The widest dtype among the modules' results: a float64 layer after a float32 one keeps its range and digits
        # (cast to the first module's float32, a std of 1e299 read inf); float32 widens to float64 exactly.
        device, dtype = results[present[0]].device, results[present[0]].dtype
        for m in present[1:]:
            dtype = torch.promote_types(dtype, results[m].dtype)
        finished = _finish(torch.cat([results[m].to(device, dtype) for m in present]))  # [calls, 4]
        table = torch.full((rows, len(present), 4), float("nan"), dtype=dtype, device=device)
        offset = 0
        for column, m in enumerate(present):
            n = results[m].shape[0]
            table[:n, column] = finished[offset:offset + n]
            offset += n
            last = finished[offset - 1].unbind()
            logger.log_metrics(
                {f"{names[column]}/{stat}": last[s] for s, stat in enumerate(STATS)}, step=step, prefix=self.name,
                reduce=over_ranks(logger, {f"{names[column]}/absmax": "max"}),
            )
        if self.images:
            for s, stat in enumerate(STATS):
                logger.log_heatmap(
                    f"{self.name}/{stat}", table[:, :, s], step, x_label="module", y_label="iter",
                    x_ticks=names, color_range=self.color_range[stat],
                )

    def _warn_once(self, kind: str, message: str) -> None:
        if not self._warned.get(kind):
            self._warned[kind] = True
            log.warning(message)


def _never_called(root: nn.Module, qualified: str) -> bool:
    """``nn.MultiheadAttention``'s ``out_proj``: the attention reads its weights in a functional call and never
    calls it, so a hook on it never runs (the attention itself is hooked by default instead)."""
    parent, _, leaf = qualified.rpartition(".")
    if leaf != "out_proj" or not qualified:
        return False
    try:
        owner = root.get_submodule(parent) if parent else root
    except AttributeError:
        return False
    return isinstance(owner, nn.MultiheadAttention)


def output_tensor(value: Any, depth: int = 0) -> Optional[Tensor]:
    """The tensor a module's output is reduced as: itself, or the first tensor, depth first, of a tuple, list or
    dict (a HuggingFace ``ModelOutput``: ``last_hidden_state``), a few levels deep."""
    if isinstance(value, Tensor):
        return value
    if depth < 4:
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
        for item in items:
            found = output_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _described(output: Any, found: Optional[Tensor]) -> str:
    if found is not None:
        return f"a complex tensor, {found.dtype}"
    return "None" if output is None else f"a {type(output).__name__}"


def _on_the_way(roots: Sequence[nn.Module], hooked: Sequence[nn.Module]) -> List[nn.Module]:
    """Each hooked module and the modules from its root down to it (`instrument.probes.compiled.hook_switch`);
    only looked up while torch.compile is in use."""
    if "torch._dynamo" not in sys.modules or not hooked:
        return []
    wanted = {id(module) for module in hooked}
    out: List[nn.Module] = []
    for root in roots:
        paths = [path for path, module in root.named_modules() if id(module) in wanted]
        out.extend(ancestors(root, paths, itself=True))
    return out
