"""Forward hooks that turn a watched module's calls into `StepContext`s.

A watched module is one whose forward is one rollout iteration: it receives the previous state as its first
argument and returns the next state (or a tuple whose first element is it). The hook exists only during a
logging step: `attach` registers it and returns the handle whose ``remove()`` restores the module exactly.
A ScriptModule takes no hook of its own: its calls are observed through the call boundary that
`instrument.script` compiles into it, or from Python (`instrument.probes.script.observe_calls`).

A module whose forward runs the whole rollout (a loop over its own submodule) is called once per step, so
observers would see one iteration and log ``iterations = 1`` for a 20-iteration rollout. After the first
logging step, a module that was called once is checked for that: when the source of its ``forward`` calls one
of its submodules inside a ``for`` or ``while`` loop it gets a warning naming that submodule, otherwise an INFO
message. The check reads the source (`ast`), registers nothing, so compiled graphs are untouched.

Calls made by ``torch.jit.trace`` are not iterations: while it traces the module the hooks return at once
(observer code run on tracer values would make the trace's sanity check fail), and so they do when its check
(``check_trace=True``) runs the module once more as plain Python (`instrument.probes.transforms`).

Under ``torch.func`` transforms the hooks work outside the transform (`instrument.probes.transforms`), on plain tensors:
grad-tracking wrappers (``grad``, ``vjp``, ``jacrev``, ``jvp``) hold the very values and are unwrapped; a tensor
batched by ``vmap`` is one sample of a batch that only the transform holds, so such a call is counted (the later
iterations keep their ``step_index``) but not delivered, and said once (`_skip_batched`).
"""

import ast
import inspect
import logging
import numbers
import os
import sys
import textwrap
from collections import abc
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from instrument.core.context import StepContext
from instrument.core.dispatch import observer_name
from instrument.core.recompute import RecomputeGuard, in_recompute
from instrument.errors import ConfigurationError
from instrument.probes import script
from instrument.probes.compiled import hook_switch, run_eagerly, unwrap
from instrument.probes.step_hook import step_hook
from instrument.probes.transforms import BATCHED, in_trace_check, outside_transforms, plain, transformed

__all__ = ["StateWatch"]

log = logging.getLogger("instrument")
_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")  # where torch.compile's frame wrapper lives


_UNKNOWN = object()


def first_tensor(value: Any) -> Optional[Tensor]:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def _channels(freeze_channels: Any) -> Optional[Tuple[int, ...]]:
    """``watch(freeze_channels=...)``: None, or channel indices (ints), refused otherwise before any step."""
    if freeze_channels is None:
        return None
    ok = isinstance(freeze_channels, abc.Sequence) and not isinstance(freeze_channels, (str, bytes))
    if not ok or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in freeze_channels):
        raise ConfigurationError(
            f"watch(freeze_channels=...) takes channel indices, a sequence of ints, got {freeze_channels!r} "
            f"({type(freeze_channels).__name__}); pass e.g. freeze_channels=(0, 1, 2), or None.")
    return tuple(int(k) for k in freeze_channels)


class StateWatch:
    """Observes every call of one module during a logging step.

    ``condition`` is taken from a ``condition=`` keyword argument or, failing that, a second positional tensor
    argument.
    """

    def __init__(
        self,
        module: nn.Module,
        deliver: Callable[[StepContext], None],
        freeze_channels: Optional[Sequence[int]] = None,
        name: str = "",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise ConfigurationError(
                f"watch() expects a torch.nn.Module whose forward is one rollout iteration, "
                f"got {type(module).__name__}."
            )
        self.module = module
        self.deliver = deliver
        self.freeze_channels = _channels(freeze_channels)
        # a ScriptModule's class is RecursiveScriptModule: its original_name is the class it was scripted from
        self.name = name or getattr(unwrap(module), "original_name", None) or type(module).__name__
        self.iterations = 0
        self._handle: Optional[Any] = None  # a RemovableHandle, or the scripted equivalent
        self._before_handle: Optional[Any] = None  # the pre-hook's (eager modules): the state before each call
        self._switch: Optional[Any] = None  # a compiled caller's hooked variant, during a step (`hook_switch`)
        # Per call in progress, keyed by id() of its state argument (calls may run on several threads): the state
        # tensor, its version before the call (None: an inference tensor keeps none) and a copy of it, taken
        # throughout the first logging step that calls the module (so that a forward changing its argument in
        # place on any call of it is caught and observed right), under inference mode (no version to tell), and
        # before every call once the forward is known to change its argument.
        self._calls: Dict[int, Tuple[Tensor, Optional[int], Optional[Tensor]]] = {}
        self._copy_input = False  # the forward changes its argument: copy it before every call
        self._said_unseen = False  # a call seen only after it changed its argument was reported (`_unseen_change`)
        self._last_out: Optional[Tuple[Tensor, Optional[int]]] = None  # the state the last call returned, version
        self.last_delivered: Optional[Tensor] = None  # the next_state of the last call delivered in this step
        self._known = False  # a whole logging step's calls were checked with copies and left their argument alone
        self._check_rollout = True  # checked once, after the first logging step (`_rollout_report`)
        self._said_uncalled = False  # a logging step that never called the module was reported
        self._said_vmap = False  # a call inside torch.func.vmap was reported (`_skip_batched`)
        self._said_compiled = False  # a call from inside a torch.compile'd caller was reported
        self._first_parameter: Any = _UNKNOWN  # forward's first parameter name (`_state_keyword`)
        self.guard = RecomputeGuard(
            f"watched module {self.name}",
            lambda: [observer_name(o) for o in getattr(deliver, "observers", ())],
        )

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def attach(self) -> Any:
        """Register the hook for one logging step; iteration indices start again at 0."""
        if self._handle is not None:
            return self._handle
        if self._before_handle is not None:  # left by an attach or detach cut short (Ctrl-C): removed first
            self._before_handle.remove()
            self._before_handle = None
        self.iterations = 0
        self.guard.begin()
        root = unwrap(self.module)
        if script.is_scripted(root):
            # run_eagerly: with a compiled caller, Dynamo would otherwise trace the hook and the observers it calls.
            self._handle = script.observe_calls(root, run_eagerly(self._hook), self._call_end,
                                                run_eagerly(self._before), self._skip_batched)
        else:
            # StepHook: a copy or a pickle of the module taken during the step gets an inert hook, and Dynamo
            # never traces the observers (`instrument.probes.step_hook`).
            self._before_handle = self.module.register_forward_pre_hook(step_hook(self._before), with_kwargs=True)
            self._handle = self.module.register_forward_hook(step_hook(self._hook), with_kwargs=True)
            if root is self.module:  # a compiled wrapper calls its hooks outside its own compiled code
                self._switch = hook_switch([root])
                if self._switch is not None:
                    self._switch.on()
        return self._handle

    def detach(self, report: bool = True) -> None:
        """Remove the step's hooks; ``report``: the step ran to its end, so a module it never called is said."""
        switch, self._switch = self._switch, None
        if switch is not None:
            switch.off()
        if self._before_handle is not None:  # first, and also when attach was cut short between the two hooks
            self._before_handle.remove()  # (removing is idempotent: a detach interrupted here is done again)
            self._before_handle = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._calls.clear()
            self._last_out = self.last_delivered = None  # the step's last state is not kept alive past the step
            if report and self.iterations:  # every call of a whole step checked with a copy
                self._known = True
            self.guard.end(self.iterations)
            if report and not self.iterations and not self.guard.recomputed:
                self._report_uncalled()
            if self._check_rollout and report and self.iterations:  # the first step that ran and called it
                self._check_rollout = False
                try:
                    self._rollout_report()
                except Exception:  # a diagnostic: it never costs the step
                    log.debug("instrument: the whole-rollout check of %s failed", self.name, exc_info=True)

    def _say_compiled_caller(self) -> None:
        """Warn once when the module is called from inside torch.compile'd code (a compiled caller of it): the
        step's hooks split that caller's graph, and Dynamo keeps the split for non-logging steps too."""
        self._said_compiled = True
        frame, depth = sys._getframe(2), 0
        while frame is not None and depth < 64:
            code = frame.f_code
            if code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME):
                if getattr(frame.f_locals.get("fn"), "__self__", None) is self.module:
                    return  # the module's own compiled wrapper (torch.compile(rule), watched inside): no caller
                log.warning(
                    "instrument: watched module %s is called inside a torch.compile'd caller. On a logging step its "
                    "hooks (run outside compiled code) split that caller's graph at each call, and Dynamo, which "
                    "does not guard on hooks, goes on running the split graph on non-logging steps too, so those "
                    "cost more than a bare step. Compile the watched module itself instead (`model.rule = "
                    "torch.compile(model.rule)`, watching it before or after), or embed instrument.Probe modules "
                    "in the model (docs/probes.md). (Said once.)", self.name,
                )
                return
            frame, depth = frame.f_back, depth + 1

    def _report_uncalled(self) -> None:
        if self._said_uncalled:
            return
        self._said_uncalled = True
        root = unwrap(self.module)
        custom_call = not script.is_scripted(root) and type(root).__call__ is not nn.Module.__call__
        log.warning(
            "instrument: watched module %s was not called in this logging step, or its calls bypass "
            "nn.Module.__call__ (`rule.forward(x)` called directly, or a class with its own __call__), which runs "
            "no hooks, so observers saw none of its iterations.%s%s (Said once.)", self.name,
            f" Its class {type(root).__name__} defines its own __call__: if that calls self.forward, no hook runs; "
            f"call the module through nn.Module.__call__ (rename the method), or watch with state=False and call "
            f"s.observer(StepContext(...)) in the loop." if custom_call else "",
            " If it runs inside a torch.compile'd caller, that caller may have been compiled without the hook "
            "(Dynamo does not guard on hooks; a forward of your own set on the module keeps instrument from "
            "switching it): compile the watched module itself, or watch with state=False and call "
            "s.observer(StepContext(...)) in the loop."
            if "torch._dynamo" in sys.modules else "",
        )

    def _rollout_report(self) -> None:
        """After the first logging step: say it when one call of the module was all that was observed."""
        if self.iterations != 1:
            return
        looped = _looped_submodule(self.module)
        if looped is not None:
            path, sub = looped
            log.warning(
                "instrument: watched module %s was called once in the first logging step, and its forward calls "
                "its submodule %r (%s) in a loop: it looks like a whole rollout, so observers see 1 iteration "
                "(iterations = 1). Watch the per-iteration module, inst.watch(model.%s), or watch this one with "
                "state=False and call s.observer(StepContext(previous, next)) in its loop.",
                self.name, path, type(sub).__name__, path,
            )
        else:
            log.info(
                "instrument: watched module %s was called once in the first logging step, so observers see 1 "
                "iteration. If its forward runs the whole rollout, watch the per-iteration module instead (or "
                "state=False and s.observer(StepContext(...)) in its loop).", self.name,
            )

    def _before(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Before each call: the state tensor and its version (and, where `_calls` says, a copy), so that the
        hook after the call has the state as it was."""
        if torch._C._is_tracing() or in_trace_check() or self.deliver.own_call(self.name):  # not an iteration
            return  # (torch.jit.trace running the module, or an observer calling it)
        if not self.iterations and not self._said_compiled and self._switch is not None:
            self._say_compiled_caller()
        clock = getattr(self.deliver, "clock", None)  # the session's overhead meter, on measured logging steps
        token = clock.own_start() if clock is not None else None
        try:
            if not transformed():  # outside torch.func transforms, no tensor is wrapped
                self._before_call(args, kwargs, False)
            else:  # inside one: copies are made outside it (`instrument.probes.transforms`), of the plain tensors
                with outside_transforms():
                    self._before_call(args, kwargs, True)
        finally:
            if token is not None:
                clock.own_stop(token)

    def _hook(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        if torch._C._is_tracing():  # (torch.jit.is_tracing without its Python check for TorchScript)
            return
        if in_trace_check() or self.deliver.own_call(self.name):  # and the probe values it recorded go with it
            self._discard_probe_values()
            return
        clock = getattr(self.deliver, "clock", None)  # its own work counts, the observers' fan-out inside it once
        token = clock.own_start() if clock is not None else None
        try:
            if not transformed():
                self._after_call(args, kwargs, output, False)
            else:  # observers too run outside the transform
                with outside_transforms():
                    self._after_call(args, kwargs, output, True)
        finally:
            if token is not None:
                clock.own_stop(token)

    def _before_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], wrapped: bool) -> None:
        """`_before`'s work; ``wrapped``: inside a torch.func transform, whose wrappers are taken off first."""
        if in_recompute():
            # Counted here, not after the call: non-reentrant checkpointing's early stop ends a recomputed
            # forward once it has what backward needs, so the hook after the call never runs for it.
            self.guard.skipped()
            return
        raw = args[0] if args else self._state_keyword(kwargs)
        state = first_tensor(raw)
        if wrapped:
            state = plain(state)
        if state is None or state is BATCHED:  # the hook after the call says what is wrong, or skips the call
            return
        version = None if state.is_inference() else state._version
        copy = state.detach().clone() if self._copy_input or not self._known or version is None else None
        self._calls[id(raw)] = (state, version, copy)

    def _after_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any, wrapped: bool) -> None:
        if in_recompute():  # counted in `_before`, which every call from Python runs first
            return
        raw = args[0] if args else self._state_keyword(kwargs)
        previous = first_tensor(raw)
        current = first_tensor(output)
        returned = None  # set where current becomes a copy of what the call returned
        condition = kwargs.get("condition")
        if not isinstance(condition, Tensor):  # none, or a number or a flag named condition: a positional tensor
            condition = args[1] if len(args) > 1 and isinstance(args[1], Tensor) else None
        if wrapped:
            shape = list(current.shape) if current is not None else None  # a BatchedTensor's: one sample's
            previous, current, condition = plain(previous), plain(current), plain(condition)
            if previous is BATCHED or current is BATCHED or condition is BATCHED:
                self._skip_batched(shape)
                return
        before = self._calls.pop(id(raw), None)
        if before is not None and previous is not None:
            original, version, copy = before
            changed = version is not None and original._version != version
            if original is not previous:  # a list state's replaced element: the element from before the call
                previous = original if copy is None else copy
            elif copy is not None and (changed or version is None or self._copy_input):
                previous = copy  # the state as it was before the call (unchanged, the argument itself is kept)
            if changed and not self._copy_input:  # this forward changes its argument: copy it from now on
                self._argument_changed(returned_it=current is original, observed=copy is not None)
            if copy is None and changed:  # cannot be observed right (said above): skipped, and so that the later
                self.iterations += 1  # calls keep their indices, counted
                return
            if version is None and current is original:  # an inference-mode forward returning its argument: it
                self._copy_input = True  # may change it, so the state it returns is delivered as a copy as well
            if current is not None and (current is original or not current.is_inference()) and (
                    self._copy_input or not self._known):
                # The next call may change this state in place, as this forward (or, in the first logging step,
                # any call) may change its argument, whether it returned it or a new tensor; observers keep what
                # they get until the step's end: a copy. (Not reused as the next call's copy from before it: a
                # write through .data between the calls would leave the version counter as it was. A new
                # inference tensor is not kept by reference by any observer, so it is not copied.)
                returned, current = current, current.detach().clone()
        elif previous is not None and current is not None and self._unseen_change(previous, current):
            return  # nothing ran before this call (a ScriptModule's state given as a keyword)
        if previous is None or current is None:
            raise ConfigurationError(
                f"watched module {self.name} must take the previous state as its first argument and return the "
                f"next state (or a tuple starting with it); got input types "
                f"{[type(a).__name__ for a in args]} and output type {type(output).__name__}. Watch the module "
                f"whose forward is one rollout iteration, or call s.observer(StepContext(...)) yourself."
            )
        self._deliver(previous, current, condition, returned)

    def _discard_probe_values(self) -> None:
        """Drop what this watch's session recorded since its last delivery: its own recorder (the dispatcher's),
        never the process-wide active one, which another session's thread may be filling."""
        recorder = getattr(self.deliver, "recorder", None)
        if recorder is not None:
            recorder.discard()

    def _skip_batched(self, shape: Optional[List[int]]) -> None:
        """A call inside ``torch.func.vmap``: the hook sees one sample of the batch (a BatchedTensor, whose
        other samples live in the physical tensor the transform holds), which observers cannot reduce or keep.
        Counted, so that the later iterations keep their step_index, not delivered, said once."""
        self.iterations += 1
        self._discard_probe_values()  # the probe values of this call go with it (else the next call would get them)
        if self._said_vmap:
            return
        self._said_vmap = True
        log.warning(
            "instrument: watched module %s was called inside torch.func.vmap: its hook received BatchedTensors "
            "(one sample%s), whose batch only the transform holds and which cannot be kept or reduced after it "
            "returns, so these calls are counted (the other iterations keep their step_index) but not delivered "
            "to observers. Call the module on the whole batch outside vmap, or watch it with state=False and "
            "hand the vmapped outputs to the observers yourself: s.observer(StepContext(previous_state=x, "
            "next_state=vmap(rule)(x))). Its probes record under vmap (the batch, vmapped dimension first). "
            "(Said once.)", self.name, f" of shape {shape}" if shape is not None else "",
        )

    def _argument_changed(self, returned_it: bool, observed: bool) -> None:
        """The state argument's version moved during a call: an in-place change, returned (``x.add_(dx); return
        x``: after the call that tensor holds the next state) or not (``x.clamp_(...); return x + dx``), or a
        write into memory it shares (ping-pong buffers, views of one storage). From now on the argument is
        copied before every call. Said once: with a copy taken before this call (throughout the first logging
        step) it is observed right, at INFO for a new tensor returned; without one it is not observed."""
        self._copy_input = True
        if returned_it:
            log.warning(
                "instrument: watched module %s changed its state argument in place during its forward (e.g. "
                "`x.add_(dx); return x`), so after the call that tensor already holds the next state. %s; from "
                "now on the argument is copied before each call on logging steps, and the state it returns as "
                "well (two clones per iteration: slower, but correct). Returning a new tensor (`return x + dx`) "
                "avoids the copies. (Said once.)", self.name,
                "This call is observed with a copy taken before it" if observed else
                "This call is not observed (previous_state and dx would be wrong: dx reads 0; the later "
                "iterations keep their step_index)",
            )
            return
        (log.info if observed else log.warning)(
            "instrument: the state argument of watched module %s changed during its forward (an in-place op on "
            "it, e.g. `x.clamp_(...)`, or a write into memory it shares), so after the call it no longer holds "
            "the previous state. %s; from now on it is copied before each call on logging steps, and the state "
            "the call returns is delivered as a copy (the next call may change it in place): two clones per "
            "iteration. (Said once.)", self.name,
            "This call is observed with the copy taken before it" if observed else
            "This call is not observed (previous_state and dx would be wrong; the later iterations keep their "
            "step_index)",
        )

    def _state_keyword(self, kwargs: Dict[str, Any]) -> Any:
        """The previous state of a call made with keywords only: the argument of forward's first parameter
        (``rule(condition=c, x=x)`` is ``x``), else the first keyword that is not ``condition``."""
        first = self._first_parameter
        if first is _UNKNOWN:  # looked up once: inspect.signature costs about 10 us
            try:
                param = next(iter(inspect.signature(unwrap(self.module).forward).parameters.values()))
                positional = (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
                first = param.name if param.kind in positional and param.name != "condition" else None
            except (StopIteration, TypeError, ValueError):
                first = None
            self._first_parameter = first
        if first in kwargs:
            return kwargs[first]
        return next((value for key, value in kwargs.items() if key != "condition"), None)

    def _call_end(self, previous: Tensor, current: Tensor, condition: Optional[Tensor]) -> None:
        """A scripted module's compiled-in call boundary fired (`instrument.probes.script`): a call from TorchScript
        code, where nothing runs before the call (`_unseen_change`)."""
        if in_recompute():
            self.guard.skipped()
            return
        clock = getattr(self.deliver, "clock", None)
        token = clock.own_start() if clock is not None else None
        try:
            if not self._unseen_change(previous, current):
                self._deliver(previous, current, condition)
        finally:
            if token is not None:
                clock.own_stop(token)

    def _unseen_change(self, previous: Tensor, current: Tensor) -> bool:
        """A call whose state before it nobody copied (from TorchScript code, or a ScriptModule called with the
        state as a keyword): True when it returned its own argument, changed in place during the call (``x.add_(dx);
        return x``: previous_state would be the next state, dx 0). Told by the version of the tensor the previous
        call returned, so the first such call of a step is not told. That call is counted, not delivered, and said
        once. A new tensor returned is never taken for one (the caller may change the state between calls)."""
        last, self._last_out = self._last_out, (current, _version(current))
        if current is not previous or last is None or last[0] is not previous or last[1] is None:
            return False
        if _version(previous) == last[1]:  # unchanged since the last call returned it: an identity step
            return False
        if not self._said_unseen:
            self._said_unseen = True
            log.warning(
                "instrument: watched ScriptModule %s changed its state argument in place and returned it (e.g. "
                "`x.add_(dx); return x`) in a call where instrument could not copy the state before it (a call "
                "from TorchScript code, or with the state as a keyword argument): previous_state would hold the "
                "next state and dx read 0. Such calls are counted but not delivered to observers (the first of a "
                "step cannot be told and was delivered). Return a new tensor (`return x + dx`), or call the "
                "module from Python with the state as its first positional argument. (Said once.)", self.name,
            )
        self.iterations += 1  # the later iterations keep their step_index
        return True

    def _deliver(self, previous: Tensor, current: Tensor, condition: Optional[Tensor],
                 returned: Optional[Tensor] = None) -> None:
        """``returned``: the tensor the call returned, where ``current`` is a copy of it: what the loop holds (and
        may hand to the next call, or to s.observer)."""
        returned = current if returned is None else returned
        self.guard.check_input(previous, returned)
        index = self.iterations
        self.iterations += 1
        self.last_delivered = returned  # what a loop that also calls s.observer would hand over again
        self.deliver(StepContext._of_call(previous, current, condition, index, self.freeze_channels))


def _version(tensor: Tensor) -> Optional[int]:
    """The tensor's version counter; None for an inference tensor, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _looped_submodule(module: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """``(name, child)`` of a child module that ``module.forward`` calls as ``self.<name>(...)`` inside a loop."""
    module = getattr(module, "_orig_mod", module)  # a torch.compile wrapper: read the module it wraps
    if isinstance(module, torch.jit.ScriptModule):  # compiled: no Python source to read
        return None
    children = dict(module.named_children())
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
    except Exception:  # no source (built-in, generated) or an unusual descriptor: no evidence
        return None
    function = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if function is None or not function.args.args:
        return None
    receiver = function.args.args[0].arg  # `self`, or whatever the forward calls it
    for loop in ast.walk(tree):
        if isinstance(loop, (ast.For, ast.While, ast.AsyncFor)):
            for node in ast.walk(loop):
                func = node.func if isinstance(node, ast.Call) else None
                if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == receiver
                        and func.attr in children):
                    return func.attr, children[func.attr]
    return None
