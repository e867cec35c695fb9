"""The probe operators and the recorder they write into.

An enabled `Probe` calls ``torch.ops.instrument.record(value, name, copy)``, a custom operator whose kernel is
plain Python and which returns nothing. Eager mode, TorchScript (also a module saved with ``torch.jit.save`` and
loaded in another process that imports instrument) and torch.compile (where the operator stays opaque: no graph
break, no recompile per call) all call that kernel at run time, so it can hand the value to the session without
tracing or scripting any Python of ours. With no recorder installed it stores nothing. Observers run later,
outside compiled code. The probe then returns its input itself: nothing is copied on the data path.

What the recorder keeps (a probe must deliver the value it saw, never one changed later, and copy as little as
it can):

* Eager and TorchScript: a reference and the tensor's version counter, which every in-place operation bumps.
  The value is delivered at the next observer call; if the version is unchanged then, the reference is
  delivered, no copy made. The first value of each probe in a logging step is also copied, so that a probe
  whose value the model changes in place (``h = probe(h); h.relu_()``) still delivers the value it saw; that
  probe is then copied at recording from then on. A probe that was unchanged on its first call but changed on a
  later one loses that value (never a wrong one: it is dropped with a warning) and is copied from then on.
* torch.compile (``copy=True``, which the probe passes when Dynamo traces it): a copy. Inductor reuses and
  overwrites the memory of intermediate tensors after their last use in the graph without touching version
  counters, so a reference could silently change.
* Inference tensors (``torch.inference_mode``) have no version counter: a copy.

The operator has no output, so TorchScript and FX would drop it as dead code; it is declared with conservative
alias analysis (TorchScript keeps such nodes) and registered as side-effecting with torch.fx.

Gradient probes (``grad=True``) additionally pass the value through `WatchGradient`, an autograd function whose
backward records the incoming gradient through a second opaque operator, ``instrument::record_grad`` (no
output, like ``record``), and passes the gradient on untouched: gradient probes need no tensor hook, so nothing
has to be registered or removed. Its forward returns a copy, not the input: a view made inside an autograd
function may not be changed in place, and ``h = probe(h); h.relu_()`` must keep working. Under torch.compile
the copy is a traced ``clone`` that Inductor fuses into the kernel producing the value (docs/probes.md says why
not an opaque operator). Gradient probes run in eager mode, under torch.compile and torch.func transforms.

Under ``torch.func.vmap`` the operators run their vmap rules (functorch's fallback refuses operators without
outputs): ``record`` and ``record_grad`` record the physical batch, vmapped dimension first (`_record_vmap`;
the chunks of ``vmap(..., chunk_size=k)`` are joined), and a ``call_end`` inside vmap is counted by the watch,
not delivered (`_call_end_vmap`). Under ``grad`` and the other autograd transforms the kernels receive the
plain tensors.

``instrument::call_end(previous, current, condition, token)`` marks the end of one forward call of a module
scripted with `instrument.script`, which compiles a forward hook calling it into the module (see
`instrument.probes.script`). Its kernel hands the call's state to the callback the session registered for
``token`` with `on_call_end` (for one logging step): the probes recorded during that call are then delivered
with it, exactly as a Python forward hook does for an eager module.

``instrument::probe`` (with ``instrument::probe_grad`` for its backward), the operator of earlier versions (it
records a copy, returns a copy), stays registered: modules saved by them with ``torch.jit.save`` still record.
All operators are registered when this module is imported. The overhead meter times ``record``'s kernel only.
"""

import logging
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from instrument.core.recompute import in_recompute
from instrument.errors import ProbeError
from instrument.probes.copies import same_layout_copy
from instrument.probes.transforms import chunked_vmap_call, in_trace_check

__all__ = ["Recorder", "WatchGradient", "active_recorder", "install", "on_call_end", "take_interrupt", "uninstall"]

log = logging.getLogger("instrument")


class Recorder:
    """What embedded probes record during one logging step.

    ``pending`` holds the latest value of each probe since the last `drain` (the dispatcher drains it at every
    observer call, so a context gets the values recorded during its iteration). ``gradients`` holds each
    gradient probe's gradients in the order backward delivered them, ``arrived`` the forward segment of each.
    ``copies`` counts the copies made. ``owner`` is the session whose logging step the recorder serves (one
    recorder per logging step): the warnings said once are said once per owner (None: once per process).
    """

    def __init__(self, owner: object = None) -> None:
        self.pending: Dict[str, Tuple[Tensor, int, Optional[Tensor]]] = {}
        self.gradients: Dict[str, List[Tensor]] = {}
        self.arrived: Dict[str, List[int]] = {}  # per gradient, the forward segment it came back to (`put`)
        self.calls: Dict[str, int] = {}  # forward records per probe name: the iterations its gradients pair with
        self.segments: Dict[str, List[int]] = {}  # per forward record, its segment: a backward ends one
        self._segment = 0
        self._after_gradient = False  # a gradient came since the last forward record: the next one starts a segment
        self.drained: Dict[str, int] = {}  # observer calls that took a value of each probe (its iterations)
        self.expected: Set[str] = set()  # gradient probes recorded, in eager mode, on a value that requires grad
        self.recorded = 0
        self.delivered = 0
        self.copies = 0
        self._checked: Set[str] = set()  # probes whose first value this step was unchanged at delivery
        # Per pending value recorded in a chunked vmap call, that call's frame (`put`: its chunks are joined).
        self._chunks: Dict[str, Any] = {}
        self._said, self._copied = _learned_by(owner)
        self.clock: Any = None  # the session's overhead meter, on a measured logging step (`_record` is timed)

    def put(self, name: str, value: Tensor, copy: bool = False) -> None:
        """Keep ``value`` for delivery: by reference when that is safe, else as a copy (module docstring)."""
        value = value.detach()
        chunked = chunked_vmap_call() if getattr(_rules, "depth", 0) else None
        if chunked is None:
            self._chunks.pop(name, None)
        else:
            # vmap(..., chunk_size=k) runs the function once per chunk: the latest value of each chunk of one call
            # is joined along the vmapped dimension (``prefix``: the chunks before this one), so the call
            # delivers its whole batch, as without chunks; the first chunk's records are the ones counted.
            known = self._chunks.get(name)
            prefix = None
            if known is not None and known[0] is chunked[0] and name in self.pending:  # the same vmapped call
                prefix = known[2] if known[1] is chunked[1] else self._pending_value(name)
            self._chunks[name] = (chunked[0], chunked[1], prefix)
            if prefix is not None:
                self.pending[name] = (torch.cat([prefix, value]), _UNTRACKED, None)
                self.copies += 1
                return
        self.recorded += 1
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._after_gradient:  # forward again after a backward (truncated BPTT, the next micro-batch)
            self._segment += 1
            self._after_gradient = False
        self.segments.setdefault(name, []).append(self._segment)
        if copy or name in self._copied or value.is_inference():
            self.copies += 1
            self.pending[name] = (value.clone(), _UNTRACKED, None)
            return
        backup = None
        if name not in self._checked:
            backup = value.clone()
            self.copies += 1
        self.pending[name] = (value, value._version, backup)

    def _pending_value(self, name: str) -> Tensor:
        """The pending value of ``name`` as it was recorded (its copy where it has changed since)."""
        value, version, backup = self.pending[name]
        return backup if version != _UNTRACKED and value._version != version and backup is not None else value

    def drain(self) -> Dict[str, Tensor]:
        """The values recorded since the last call, each exactly as it was when recorded."""
        pending, self.pending = self.pending, {}
        self._chunks = {}
        values: Dict[str, Tensor] = {}
        for name, (value, version, backup) in pending.items():
            self.drained[name] = self.drained.get(name, 0) + 1
            if version == _UNTRACKED or value._version == version:
                values[name] = value
                if backup is not None:
                    self._checked.add(name)
            elif backup is not None:
                values[name] = backup
                self._copied.add(name)
            else:
                self._copied.add(name)
                log.warning(
                    "instrument: the value of probe %r was modified in place after the probe, on a call where "
                    "earlier calls had left it unchanged; that value is dropped rather than logged wrong, and "
                    "this probe's values are copied from now on", name,
                )
        self.delivered += len(values)
        return values

    def discard(self) -> None:
        """Drop the values recorded since the last `drain`: those of a watched call that is not delivered (one
        inside ``torch.func.vmap``, which the state watch says itself), not reported as undelivered either."""
        self.recorded -= len(self.pending)
        self.pending, self._chunks = {}, {}

    def put_gradient(self, name: str, gradient: Tensor) -> None:
        if getattr(_rules, "depth", 0) and chunked_vmap_call() is not None:
            self._say("chunked", name, "instrument: gradient probe %r recorded gradients inside vmap(..., "
                      "chunk_size=k) (or jacrev with a chunk_size): they arrive one per chunk, so they do not pair "
                      "with the iterations one to one. Leave chunk_size out on logging steps. (Said once per probe "
                      "and session.)", name)
        self.gradients.setdefault(name, []).append(gradient)
        self.arrived.setdefault(name, []).append(self._segment)
        self._after_gradient = True

    def gradients_in_forward_order(self) -> Dict[str, List[Tensor]]:
        """Each probe's gradients indexed by iteration (docs/probes.md, "Gradient probes").

        The forward records are cut into segments where a forward follows a backward (truncated BPTT, one
        rollout per micro-batch), and each gradient belongs to the segment whose backward delivered it (a
        backward, also the nested ones of reentrant checkpointing, runs before the next segment's forward).
        Backward visits a chained segment's calls last to first, so each segment's gradients are reversed, and
        segments are kept in order. k > 1 whole passes over a segment (several losses backpropagated through one
        graph with ``retain_graph=True``, or an ``autograd.grad`` pass) are summed per call. Counts that cannot be
        paired, a probe called more than once per iteration, and a gradient probe that got no gradient at all are
        each said once per session."""
        out: Dict[str, List[Tensor]] = {}
        for name, values in self.gradients.items():
            n = self.calls.get(name, 0)
            paired, passes, unpaired, segments = _by_segment(values, self.arrived.get(name, []),
                                                             self.segments.get(name, []))
            out[name] = paired
            if passes > 1:
                self._say("passes", name, (
                    "instrument: gradient probe %r recorded %d gradients for %d forward calls: taken as %d "
                    "backward passes over the whole rollout (each delivered one gradient per call) and summed per "
                    "iteration, the gradient of the sum of what each pass differentiated. A torch.autograd.grad "
                    "or double-backward pass (a gradient penalty, create_graph=True) counts as a pass too, so "
                    "the function it differentiated is added as if it were a loss: call backward once, on the "
                    "sum of the losses, to get their gradient alone. (Said once per probe and session.)"
                ), name, len(values), n, passes)
            if unpaired:
                self._say("unpaired", name, (
                    "instrument: gradient probe %r recorded %d gradients in a step whose forward recorded it %d "
                    "times in %d segment(s) (a forward after a backward starts one), so they cannot be paired with "
                    "iterations: calls that send no gradient back (a burn-in or a collection run under torch.no_grad, "
                    "a backward over part of a segment, gradients from outside the watched calls); gradients[%r] "
                    "holds each segment's gradients reversed, segments in order, and gradients[%r][i] need not be "
                    "iteration i's. (Said once per probe and session.)"
                ), name, len(values), n, segments, name, name)
                continue
            iterations = self.drained.get(name, 0) + (name in self.pending)
            if self.drained.get(name, 0) and n > iterations:
                self._say("repeated", name, (
                    "instrument: gradient probe %r was called %d times in a step whose observers saw it in %d "
                    "iterations (more than once per iteration, e.g. a module called twice per iteration): "
                    "gradients[%r] holds one gradient per call, in call order, so gradients[%r][i] is not "
                    "iteration i's. Give each call its own probe name to pair them. (Said once per probe and "
                    "session.)"
                ), name, n, iterations, name, name)
        for name in sorted(self.expected.difference(self.gradients)):
            self._say("missing", name, (
                "instrument: gradient probe %r recorded forward values in a logging step but received no gradient: "
                "call backward() inside the `with inst.step(...)` block (gradients that arrive after the step "
                "ends are dropped), and check that the probed value reaches the loss. (Said once per probe and "
                "session.)"
            ), name)
        return out

    def _say(self, kind: str, name: str, message: str, *args: object) -> None:
        said = self._said.setdefault(kind, set())
        if name not in said:
            said.add(name)
            log.warning(message, *args)


def _by_segment(values: List[Tensor], arrived: List[int], forward: List[int]) -> Tuple[List[Tensor], int, bool, int]:
    """A probe's gradients in forward order: (gradients, the most whole passes summed over one segment, whether
    some segment's count could not be paired, the number of segments). ``arrived``: the segment of each gradient;
    ``forward``: of each forward call."""
    calls: Dict[int, int] = {}
    for segment in forward:
        calls[segment] = calls.get(segment, 0) + 1
    groups: Dict[int, List[Tensor]] = {}
    for value, segment in zip(values, arrived, strict=True):
        groups.setdefault(segment, []).append(value)
    out: List[Tensor] = []
    passes, unpaired = 1, False
    for segment in sorted(groups):
        group, m = groups[segment], calls.get(segment, 0)
        if m and len(group) > m and len(group) % m == 0:  # k whole passes over the segment, each last call first
            chunks = [group[start:start + m][::-1] for start in range(0, len(group), m)]
            out.extend(sum(parts[1:], parts[0]) for parts in zip(*chunks, strict=True))
            passes = max(passes, len(chunks))
            continue
        unpaired = unpaired or len(group) != m
        out.extend(group[::-1])
    unpaired = unpaired or any(segment not in groups for segment in calls)  # a segment that got no gradient
    return out, passes, unpaired, len(set(calls) | set(groups))


_UNTRACKED = -1  # no version to compare: the recorder holds its own copy
# Per session (owner: the Instrumentation whose step made the Recorder), what it learned: what was said once (kind
# -> names), and the names of probes whose value the model was seen to change in place after the probe (copied at
# recording from then on). Per session, not per process: a later session's unrelated model that reuses a probe's
# name ("hidden", in a sweep or a notebook) is not copied at every call for it.
_learned: "weakref.WeakKeyDictionary[object, Tuple[Dict[str, Set[str]], Set[str]]]" = weakref.WeakKeyDictionary()
_shared: Tuple[Dict[str, Set[str]], Set[str]] = ({}, set())  # an owner unknown or without weak references


def _learned_by(owner: object) -> Tuple[Dict[str, Set[str]], Set[str]]:
    """``owner``'s said-once sets and copied probe names, created on first use."""
    try:
        return _learned.setdefault(owner, ({}, set()))
    except TypeError:  # None, or an owner without weak references
        return _shared


_active: Optional[Recorder] = None


def active_recorder() -> Optional[Recorder]:
    return _active


def install(recorder: Recorder) -> None:
    """Make ``recorder`` the one enabled probes write into (for one logging step)."""
    global _active
    if _active is not None and _active is not recorder:
        raise ProbeError(
            "another Instrumentation is inside a logging step with embedded probes; probe values go to one "
            "session at a time. Finish that step first, or watch all models with one Instrumentation."
        )
    _active = recorder


def uninstall(recorder: Recorder) -> None:
    global _active
    if _active is recorder:
        _active = None


CallEnd = Callable[[Tensor, Tensor, Optional[Tensor]], None]
_call_ends: Dict[int, CallEnd] = {}  # token -> what to do when a compiled-in call boundary with it fires
# token -> the data_ptr of the watched boundary's own ``key`` tensor: a copy of the module (copy.deepcopy, a
# torch.jit.save / load) made during the step carries the token, switched on, but a key of its own storage.
_call_keys: Dict[int, int] = {}
# token -> what to do for such a call inside torch.func.vmap (`_call_end_vmap`), given one sample's shape.
_call_batched: Dict[int, Callable[[Optional[List[int]]], None]] = {}


def on_call_end(token: int, callback: Optional[CallEnd], key: Optional[int] = None,
                batched: Optional[Callable[[Optional[List[int]]], None]] = None) -> None:
    """Route ``instrument::call_end`` calls carrying ``token`` (and, for ``call_end_keyed``, the key tensor whose
    ``data_ptr()`` is ``key``) to ``callback``, and such calls inside ``torch.func.vmap`` to ``batched``; None
    removes the route."""
    for table, value in ((_call_ends, callback), (_call_keys, key), (_call_batched, batched)):
        if callback is None:
            table.pop(token, None)
        elif value is not None:
            table[token] = value


# ---------------------------------------------------------------------------------------------- the operators
# Defined with the low-level torch.library API rather than @torch.library.custom_op: the latter wraps the
# kernel so that its first call imports torch._dynamo (seconds, even for users who never compile).
_lib = torch.library.Library("instrument", "DEF")
# flexible_layout: Inductor hands the value over in whatever layout it computed it (channels-last after a CPU
# convolution, for instance). Without the tag it first copies the value into the eager layout, a transposing
# copy per call on top of the recorder's own, which made a compiled logging step with a probe about 5 % slower.
# The legacy operators that return a tensor return a copy in their input's layout (clone keeps strides, and so
# does the fake kernel's empty_like), so with the tag Inductor does not convert the result back either.
_FLEXIBLE = (torch.Tag.flexible_layout,)
_lib.define("record(Tensor value, str name, bool copy) -> ()", alias_analysis="CONSERVATIVE", tags=_FLEXIBLE)
_lib.define(
    "call_end(Tensor previous, Tensor current, Tensor? condition, int token) -> ()", alias_analysis="CONSERVATIVE"
)
_lib.define(  # what `instrument.script` compiles in now; call_end stays for modules saved before it
    "call_end_keyed(Tensor previous, Tensor current, Tensor? condition, int token, Tensor key) -> ()",
    alias_analysis="CONSERVATIVE",
)
_lib.define("record_grad(Tensor gradient, str name) -> ()", alias_analysis="CONSERVATIVE", tags=_FLEXIBLE)
_lib.define("probe(Tensor value, str name, bool grad) -> Tensor", tags=_FLEXIBLE)
_lib.define("probe_grad(Tensor gradient, str name) -> Tensor", tags=_FLEXIBLE)


def _record(value: Tensor, name: str, copy: bool) -> None:
    recorder = _active  # not in torch.jit.trace's check either, which runs the module again as plain Python
    if recorder is not None and not in_recompute() and not in_trace_check():
        clock = recorder.clock
        recorder.put(name, value, copy) if clock is None else clock.timed(recorder.put, name, value, copy)


# Ctrl-C (or a SystemExit) raised while observers ran from a call boundary: TorchScript would hand it to the
# caller as a RuntimeError, so a loop's `except KeyboardInterrupt` never ran. Kept here instead (nothing more is
# delivered in that step) and raised by the session when the step's block exits (`take_interrupt`).
_interrupted: List[BaseException] = []


def take_interrupt() -> Optional[BaseException]:
    """The Ctrl-C or SystemExit a call boundary's observers raised since the last call, once; else None."""
    return _interrupted.pop(0) if _interrupted else None


def _deliver_call(callback: CallEnd, previous: Tensor, current: Tensor, condition: Optional[Tensor]) -> None:
    if _interrupted:
        return
    try:
        callback(previous, current, condition)
    except Exception:
        raise
    except BaseException as exc:  # not wrapped into a RuntimeError by the TorchScript interpreter
        _interrupted.append(exc)


def _call_end(previous: Tensor, current: Tensor, condition: Optional[Tensor], token: int) -> None:
    callback = _call_ends.get(token)
    if callback is not None:
        _deliver_call(callback, previous, current, condition)


def _call_end_keyed(previous: Tensor, current: Tensor, condition: Optional[Tensor], token: int, key: Tensor) -> None:
    callback = _call_ends.get(token)
    if callback is not None and _call_keys.get(token) == key.data_ptr():  # the watched module, not a copy of it
        _deliver_call(callback, previous, current, condition)


def _record_grad(gradient: Tensor, name: str) -> None:
    recorder = _active
    if recorder is not None:
        # A copy: the backward may reuse the gradient's memory (compiled code) or accumulate into it.
        recorder.put_gradient(name, gradient.detach().clone())


def _probe(value: Tensor, name: str, grad: bool) -> Tensor:
    _record(value, name, True)
    return value.clone()


def _probe_grad(gradient: Tensor, name: str) -> Tensor:
    recorder = _active
    if recorder is not None:
        recorder.put_gradient(name, gradient.detach().clone())
    return gradient.clone()


def _probe_setup(ctx, inputs, output) -> None:
    _, ctx.probe_name, ctx.probe_grad = inputs


def _probe_backward(ctx, gradient: Tensor):
    if ctx.probe_grad:
        gradient = torch.ops.instrument.probe_grad(gradient, ctx.probe_name)
    return gradient, None, None


_lib.impl("record", _record, "CompositeExplicitAutograd")
_lib.impl("call_end", _call_end, "CompositeExplicitAutograd")
_lib.impl("call_end_keyed", _call_end_keyed, "CompositeExplicitAutograd")
_lib.impl("record_grad", _record_grad, "CompositeExplicitAutograd")
_lib.impl("probe", _probe, "CompositeExplicitAutograd")
_lib.impl("probe_grad", _probe_grad, "CompositeExplicitAutograd")
torch.library.register_fake("instrument::record", lambda value, name, copy: None, lib=_lib)
torch.library.register_fake("instrument::call_end", lambda previous, current, condition, token: None, lib=_lib)
torch.library.register_fake("instrument::record_grad", lambda gradient, name: None, lib=_lib)
torch.library.register_fake("instrument::probe", lambda value, name, grad: torch.empty_like(value), lib=_lib)
torch.library.register_fake("instrument::probe_grad", lambda grad, name: torch.empty_like(grad), lib=_lib)
torch.library.register_autograd("instrument::probe", _probe_backward, setup_context=_probe_setup, lib=_lib)


_rules = threading.local()  # .depth: `_record_vmap` calls in progress on this thread (a record may be a chunk's)



def _record_vmap(info, in_dims, value: Tensor, *args):
    """``record`` / ``record_grad`` under ``torch.func.vmap``: records the whole physical batch, the vmapped
    dimension moved to dim 0 (``[batch, ...]``), and returns nothing. The operator is called again rather than
    the kernel, so an enclosing vmap (or grad) level unwraps its own dimension in turn: nested vmaps record
    ``[outer, inner, ...]``. (functorch's fallback refuses operators without outputs.)"""
    if in_dims[0] is not None:
        value = value.movedim(in_dims[0], 0)
    _rules.depth = getattr(_rules, "depth", 0) + 1
    try:
        (torch.ops.instrument.record if len(args) == 2 else torch.ops.instrument.record_grad)(value, *args)
    finally:
        _rules.depth -= 1
    return None, None


def _call_end_vmap(info, in_dims, previous: Tensor, current: Tensor, condition: Optional[Tensor], token: int,
                   key: Optional[Tensor] = None):
    """A watched scripted module called from TorchScript code inside ``torch.func.vmap``: its states are one
    sample of a batch, which is not delivered; the watch counts the call and says why (`on_call_end`)."""
    batched = _call_batched.get(token)
    if batched is not None and (key is None or _call_keys.get(token) == key.data_ptr()):
        shape = None if in_dims[1] is None else [n for i, n in enumerate(current.shape) if i != in_dims[1]]
        batched(shape)
    return None, None


for _op, _rule in (("record", _record_vmap), ("record_grad", _record_vmap), ("call_end", _call_end_vmap),
                   ("call_end_keyed", _call_end_vmap)):
    torch.library.register_vmap(f"instrument::{_op}", _rule, lib=_lib)
# No output: without this, dead-code elimination (Dynamo, AOT autograd, and Inductor, which honours it from torch 2.10:
# the floor, instrument/torch_floor.py) would drop the call.
torch.fx.node.has_side_effect(torch.ops.instrument.record.default)
torch.fx.node.has_side_effect(torch.ops.instrument.call_end.default)
torch.fx.node.has_side_effect(torch.ops.instrument.record_grad.default)


class WatchGradient(torch.autograd.Function):
    """``value`` copied on the way forward; on the way back, the gradient is recorded under ``name`` (a copy,
    by ``instrument::record_grad``) and passed on as it is. Dynamo traces both directions into the graphs.

    Written with a separate ``setup_context`` and ``generate_vmap_rule``, as torch.func transforms require:
    under ``torch.func.grad`` / ``vjp`` the gradient recorded is the plain tensor of that transform's backward,
    under ``vmap`` the batched gradient with the vmapped dimension first (``record_grad``'s vmap rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: Tensor, name: str) -> Tensor:
        return same_layout_copy(value)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.probe_name = inputs[1]
        if not torch.compiler.is_compiling():  # eager only: compiled code does not run this Python
            recorder = _active
            if recorder is not None and ctx.needs_input_grad[0] and not in_recompute():
                recorder.expected.add(ctx.probe_name)  # a gradient should come back in this step
                # (`gradients_in_forward_order`)

    @staticmethod
    def backward(ctx, gradient: Tensor):
        torch.ops.instrument.record_grad(gradient, ctx.probe_name)
        return gradient, None
