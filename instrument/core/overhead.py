"""What instrumentation costs, measured in every run on its logging steps: `OverheadMeter`.

Users cannot tell from a benchmark of someone else's workload what instrument costs in theirs, so each
logging step measures itself and the next logging step logs the result:

===================================  ==============================================================
key                                  meaning
===================================  ==============================================================
``instrument/overhead/<observer>``   seconds the observer took in that logging step: ``reset``,
                                     ``attach``, every ``observe`` call, its own forward hooks
                                     (``Observer.hook_seconds``: ActivationStats), ``observe_gradients``,
                                     ``detach`` and ``log``, summed (observers of one name add up)
``instrument/overhead/commit``       seconds the training thread spent in ``Logger.commit``
``instrument/overhead/component/<c>`` seconds step component ``c``'s ``log`` took (by its name)
``instrument/overhead/hooks``        seconds the session's own per-call work took outside the
                                     observers: the watched modules' pre- and post-forward hooks
                                     (`StateWatch`, with the state copies they make) and the
                                     embedded probes' ``record`` kernel (the values it keeps)
``instrument/overhead/fraction``     share (0-1) of the logging step, from entering
                                     ``with inst.step(n)`` to leaving it, spent in instrument:
                                     starting and ending the step (attaching and removing hooks,
                                     probes on and off, observer lifecycle, components, the
                                     commit), every observer fan-out (handing over probe values
                                     included), the observers' own hooks, and ``hooks`` above
                                     (a fan-out run from inside a hook counted once)
``instrument/overhead/instrument``   those seconds themselves (the numerator of the fraction)
===================================  ==============================================================

The step, the commit and the fraction of logging step ``n`` are known only after its commit, so they are
logged with the record of a later logging step: the keys at a logging step describe the newest earlier logging
step that was measured and whose clocks can be read. That is normally the logging step before it (the keys at
step ``n + log_interval`` describe step ``n``); a logging step that raised is not measured, so the one after it
logs the one before it, or nothing when there is none left unlogged; on a CUDA run a step whose events have not
completed is logged at a later logging step. When several measured steps become readable at the same logging
step, only the newest is logged: the older ones it supersedes are dropped (the logger would otherwise average
them into one value per key at that step), though each is still judged against the budget. The last logging
step of a run is measured but not logged.

Not counted, because no code of instrument runs there to time it: torch's own slower ``Module.__call__`` path
that any registered hook switches a module to (its hook dispatch, per call of a watched module or of a module
hooked by an observer), the dispatch of the ``instrument::record`` operator and a `Probe` module's own call. On a
loop of many small watched calls that is a real share of the step, so the keys are a lower bound of the cost.

Clocks: every span is training-thread time (``time.perf_counter``): what instrument keeps the loop's thread
busy, which on a GPU includes launching the observers' kernels but not their run time on the device (that
overlaps the model's kernels). When the run uses CUDA (CUDA initialised in this process) the step's total
is also taken from two CUDA events around it, and the larger of the two totals is the fraction's
denominator: a GPU-bound step is as long as its stream, a launch-bound one as long as its thread. The events
are read at a later logging step once ``query()`` says they completed, never with a sync (a step whose
events are still pending is logged at a later logging step). Per-call CUDA events are not used on purpose:
an event pair around every observer call and fan-out (six per rollout iteration) cost a launch-bound RL loop
on an H100 more than the observers themselves. Non-logging steps run none of this. The budget warning
(``Instrumentation(overhead_budget=...)``) names what cost the most (`costliest`: an observer, a step component,
the hooks or the commit), judges the second measured logging step on (the first pays one-time costs: imports,
first renders, opening files) and stays quiet while a step spends under 5 ms in instrument.
"""

import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from instrument.checks import check_number

__all__ = ["OverheadMeter", "PREFIX", "costliest", "over_budget"]

PREFIX = "instrument/overhead/"
COMPONENT = PREFIX + "component/"  # a step component's key: its name after this
# Below this much instrument time in a logging step the budget warning stays quiet: a toy loop whose step is
# a millisecond is "over budget" at any share, and a warning there would only teach users to ignore it.
QUIET_SECONDS = 0.005
_RESERVED = ("commit", "fraction", "instrument", "hooks")
_PREFIXED = ("component/", "observer/")  # an observer so named is keyed under "observer/": never a component's key
_MAX_PENDING = 8  # measured steps whose CUDA events have not completed yet


class _Sheet:
    """The raw marks of one logging step: ``time.perf_counter`` readings, and on a CUDA run the two events
    recorded on the current stream at its start and end."""

    __slots__ = ("step", "events", "enter", "begun", "ending", "exit", "calls", "observers", "commit", "own",
                 "components")

    def __init__(self, step: int, events: Optional[List[Any]], enter: float) -> None:
        self.step, self.events, self.enter = step, events, enter
        self.begun: Optional[float] = None
        self.ending: Optional[float] = None
        self.exit: Optional[float] = None
        # Sums, not lists of spans: the per-iteration calls add a float (no tuple, no list growth), which on a
        # 200-iteration RL logging step is most of what measuring costs.
        self.calls = 0.0
        self.observers: Dict[str, float] = {}
        self.commit = 0.0
        self.own = 0.0  # the session's own per-call work outside observers (`own_start` / `own_stop`)
        self.components: Dict[str, float] = {}  # step components' log, by name (inside the step's end already)


class OverheadMeter:
    """Times one logging step at a time; `ready` returns the scalars of the steps measured before.

    The session calls ``enter`` / ``begun`` around its start of the step, the dispatcher ``mark`` /
    ``stop`` around an observer's lifecycle call, ``call_start`` / ``lap`` (after each observer) /
    ``call_stop`` around each fan-out, the watched modules' hooks and the probes' record op ``own_start`` /
    ``own_stop`` around their own work, the session ``ending``, ``commit_seconds`` and ``exit`` around its end
    of the step, or ``discard`` when it raised.
    """

    @classmethod
    def for_budget(cls, budget: Optional[float]) -> Optional["OverheadMeter"]:
        """A meter for ``Instrumentation(overhead_budget=budget)``; None (no measuring at all) for None."""
        if budget is None:
            return None
        check_number("overhead_budget", budget, above=0, none=True, noun="a share of the logging step",
                     why="None turns the overhead report off", fix="bind e.g. Instrumentation.overhead_budget = 0.1")
        return cls()

    def __init__(self) -> None:
        self._sheet: Optional[_Sheet] = None
        self._done: List[_Sheet] = []
        self._read = 0
        self.steps_measured = 0

    # ---------------------------------------------------------------- marks (training thread)
    def mark(self) -> float:
        return time.perf_counter()

    def enter(self, step: int) -> None:
        events = [_recorded()] if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._sheet = _Sheet(step, events, time.perf_counter())

    def begun(self) -> None:
        if self._sheet is not None:
            self._sheet.begun = self.mark()

    def call_start(self) -> float:
        return time.perf_counter()

    def call_stop(self, start: float, end: Optional[float] = None) -> None:
        """End a fan-out begun at ``start``; ``end``: when it ended, if already read (the last `lap`)."""
        if self._sheet is not None:
            self._sheet.calls += (time.perf_counter() if end is None else end) - start

    def stop(self, name: str, start: float) -> None:
        """End an observer's span begun with ``start = meter.mark()``."""
        self.lap(name, start)

    def hooks(self, name: str, seconds: Any) -> None:
        """Add the time an observer spent in hooks of its own (`Observer.hook_seconds`) to its span and to the
        step's time in instrument."""
        sheet = self._sheet
        if sheet is not None and type(seconds) is float and seconds > 0:
            sheet.observers[name] = sheet.observers.get(name, 0.0) + seconds
            sheet.calls += seconds

    def own_start(self) -> Tuple[float, float]:
        """Begin a span of the session's own per-call work (a watched module's hook, a probe's record); the token
        for `own_stop`. Two clock reads per span in all."""
        sheet = self._sheet
        return time.perf_counter(), (sheet.calls if sheet is not None else 0.0)

    def own_stop(self, token: Tuple[float, float]) -> None:
        """End a span begun with ``token = own_start()``: the whole span counts once in the step's time in
        instrument (a fan-out to the observers inside it, already counted by `call_stop`, is not added twice) and
        what it spent outside observer fan-outs goes to ``hooks``."""
        sheet = self._sheet
        if sheet is not None:
            start, before = token
            span = time.perf_counter() - start
            sheet.own += span - (sheet.calls - before)
            sheet.calls = before + span

    def timed(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` inside an `own_start` / `own_stop` span."""
        token = self.own_start()
        try:
            return fn(*args)
        finally:
            self.own_stop(token)

    def lap(self, name: str, start: float) -> float:
        """End an observer's span begun at ``start`` and return now, where the next observer's span begins (one
        clock read per observer call in a fan-out)."""
        now = time.perf_counter()
        sheet = self._sheet
        if sheet is not None:
            spans = sheet.observers
            spans[name] = spans.get(name, 0.0) + (now - start)
        return now

    def component(self, name: str, start: float) -> None:
        """End a step component's ``log`` begun with ``start = meter.mark()`` (attributed by name only: the time
        is inside the step's end, which is counted whole)."""
        sheet = self._sheet
        if sheet is not None:
            sheet.components[name] = sheet.components.get(name, 0.0) + (time.perf_counter() - start)

    def ending(self) -> None:
        if self._sheet is not None:
            self._sheet.ending = self.mark()

    def commit_seconds(self, seconds: float) -> None:
        if self._sheet is not None:
            self._sheet.commit += seconds

    def exit(self) -> None:
        sheet = self._sheet
        if sheet is None:
            return
        end = time.perf_counter()
        self._sheet = None
        if sheet.begun is not None and sheet.ending is not None:
            sheet.exit = end
            if sheet.events is not None:
                sheet.events.append(_recorded())
            self._done.append(sheet)
            self.steps_measured += 1
            if len(self._done) > _MAX_PENDING:  # a GPU that never catches up: keep the newest, never wait
                self._done.pop(0)

    def discard(self) -> None:
        """The step raised: its measurement is incomplete and is not reported."""
        self._sheet = None

    # ---------------------------------------------------------------- reading (next logging step)
    def ready(self) -> List[Tuple[int, Dict[str, float], bool]]:
        """``(measured step, scalars, warm)`` of every finished step whose clocks can be read without waiting;
        ``warm`` is False for the first measured step, which pays one-time costs (lazy imports, first
        renders, opening files) that later steps do not."""
        out = []
        while self._done and _complete(self._done[0]):
            sheet = self._done.pop(0)
            self._read += 1
            out.append((sheet.step, _scalars(sheet), self._read > 1))
        return out


def _recorded() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _complete(sheet: _Sheet) -> bool:
    # CUDA events complete in stream order: the exit event is the last one recorded.
    return sheet.events is None or sheet.events[-1].query()


def _scalars(sheet: _Sheet) -> Dict[str, float]:
    out = {}
    for name, seconds in sheet.observers.items():
        key = PREFIX + (f"{name}_observer" if name in _RESERVED  # an observer named "commit"
                        else f"observer/{name}" if name.startswith(_PREFIXED) else name)  # or "component/x"
        out[key] = out.get(key, 0.0) + seconds
    out[PREFIX + "commit"] = sheet.commit
    out[PREFIX + "hooks"] = max(0.0, sheet.own)
    for name, seconds in sheet.components.items():
        out[COMPONENT + name] = seconds
    inside = (sheet.begun - sheet.enter) + (sheet.exit - sheet.ending) + sheet.calls
    total = sheet.exit - sheet.enter
    if sheet.events is not None:  # both completed (checked by query), so elapsed_time does not wait
        try:
            total = max(total, sheet.events[0].elapsed_time(sheet.events[1]) / 1000.0)
        except RuntimeError:  # the current device changed inside the step: the events are on two devices
            pass
    out[PREFIX + "fraction"] = min(1.0, max(0.0, inside / total)) if total > 0 else 0.0
    out[PREFIX + "instrument"] = inside
    return out


def costliest(scalars: Dict[str, float]) -> Tuple[str, float]:
    """What took the most time in a measured step, among all the meter attributes by name: each observer,
    ``commit``, ``hooks`` and each step component (``component/<name>``)."""
    costs = {k[len(PREFIX):]: v for k, v in scalars.items() if k not in (PREFIX + "fraction", PREFIX + "instrument")}
    name = max(costs, key=costs.get)
    return name, costs[name]


def over_budget(step: int, scalars: Dict[str, float], budget: Optional[float], log_interval: int) -> Optional[str]:
    """The warning for a measured step whose fraction exceeds ``budget`` (None when it does not)."""
    fraction = scalars[PREFIX + "fraction"]
    if budget is None or fraction <= budget or scalars[PREFIX + "instrument"] < QUIET_SECONDS:
        return None
    name, seconds = costliest(scalars)
    if name == "commit":
        advice = f"log fewer values or images per step, or raise log_interval (now {log_interval})"
    elif name.startswith("component/"):
        advice = (f"make that step component log less, raise log_interval (now {log_interval}), or remove it "
                  f"(ComponentHandle.remove)")
    elif name == "hooks":
        advice = (f"raise log_interval (now {log_interval}), or watch a module called fewer times per step (the "
                  f"watch and probe hooks run on every call)")
    else:
        advice = (f"raise log_interval (now {log_interval}), drop that observer, or turn its images off "
                  f"(e.g. IterationStats(images=False))")
    return (
        f"logging step {step} spent {100 * fraction:.0f}% of its time in instrument, over overhead_budget="
        f"{budget:g}; the costliest is {_what(name)} ({seconds:.4f} s in that step). To spend less: {advice}. "
        f"The share of the whole run is about this divided by log_interval. Instrumentation(overhead_budget=None) "
        f"turns this report off; this warning is given once per run."
    )


def _what(name: str) -> str:
    """How the warning names a key's subject: ``observer 'x'``, ``step component 'y'``, ``the commit``..."""
    if name.startswith("component/"):
        return f"step component {name[len('component/'):]!r}"
    if name.startswith("observer/"):
        return f"observer {name[len('observer/'):]!r}"
    if name in ("commit", "hooks"):
        return {"commit": "'commit' (Logger.commit)", "hooks": "'hooks' (the watch and probe hooks)"}[name]
    return f"observer {name!r}"
