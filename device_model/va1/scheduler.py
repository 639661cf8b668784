"""Card-level scheduling of the compute units across functions (spec "Scheduling").

Every function (the PF, each VF, or the one function of a single-function device) has a
`FunctionSched`: its weight, priority, exec quantum, preemption timeout, a stop flag and
its virtual time. A free compute unit goes to the runnable function with

1. the highest priority (strict levels 2 > 1 > 0), then
2. the lowest virtual time (weighted fair queueing: a function's virtual time grows by
   device time / weight as its commands run), then
3. the lowest function number;

that function's processor then picks its next queue round robin. A function that becomes
runnable after being idle starts at max(its virtual time, the lowest virtual time of the
active functions), so idle time is not banked.

A pick or a preemption check looks only at the active functions (queued work or runs),
not at every function of the card: on a card with many idle VFs a dispatch costs what
the busy ones cost.

Preemption happens only at command boundaries (the engine checks at each boundary): a
run yields its engine when its function is stopped or has Bus Master off, when a
function of strictly higher priority is waiting, or when it has run at least the
function's exec quantum on this engine and another function of the same or higher
priority is waiting. The preempted
submission goes back to the head of its queue and resumes later at its next command, on
whichever engine picks it.

A failure while a function starts its work (`start_next` raising) is that function's
alone: it is handed to its processor's `failed` and the dispatch goes on for the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hwspec import va1

if TYPE_CHECKING:  # pragma: no cover
    from .engine import CommandProcessor, Submission, _Run


@dataclass
class FunctionSched:
    index: int                          # 0 = PF (or the only function), n = VF n
    processor: "CommandProcessor"
    weight: int = va1.DEFAULT_WEIGHT
    priority: int = va1.DEFAULT_PRIORITY
    exec_quantum_ns: int = va1.DEFAULT_EXEC_QUANTUM_NS
    preemption_timeout_ns: int = va1.DEFAULT_PREEMPTION_TIMEOUT_NS
    stopped: bool = False               # VF_STOP
    bus_master: bool = True             # PCI Command.Bus Master of the function
    vt: float = 0.0
    running: int = 0                    # runs on engines now
    preemptions: int = 0
    timeouts: int = 0
    busy_ns: int = field(default=0)     # device time used (for stats and tests)

    @property
    def halted(self) -> bool:
        """Nothing of the function may start, and its runs yield at the next command
        boundary: stopped by its PF, or Bus Master off (no DMA)."""
        return self.stopped or not self.bus_master

    def charge(self, ns: int) -> None:
        self.vt += ns / self.weight
        self.busy_ns += ns


class Scheduler:
    """The compute units of a card and the functions competing for them."""

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self.engines: list["_Run | None"] = [None] * num_engines
        self.functions: list[FunctionSched] = []
        # The only function when there is exactly one (else None): kept by register and
        # unregister, the only places `functions` changes.
        self.lone: FunctionSched | None = None
        # function index -> the function, for every function that has work or runs (it
        # may also hold idle ones: the pick in `dispatch` drops them). Entered by `became_active`.
        self._active: dict[int, FunctionSched] = {}
        self._dispatching = False
        self._again = False

    def register(self, processor: "CommandProcessor", index: int) -> FunctionSched:
        fs = FunctionSched(index, processor)
        fs.vt = self.min_active_vt(fs)
        self.functions.append(fs)
        self.functions.sort(key=lambda f: f.index)
        self._set_lone()
        return fs

    def unregister(self, fs: FunctionSched) -> None:
        if fs in self.functions:
            self.functions.remove(fs)
            self._set_lone()
        if self._active.get(fs.index) is fs:
            del self._active[fs.index]
        self.dispatch()

    def _set_lone(self) -> None:
        functions = self.functions
        self.lone = functions[0] if len(functions) == 1 else None

    # --- WFQ bookkeeping ----------------------------------------------------------------

    def min_active_vt(self, exclude: FunctionSched | None = None) -> float:
        """The lowest virtual time of the functions with work or runs (`exclude` aside);
        with none, the highest of all functions (0.0 with none at all)."""
        low: float | None = None
        for f in self._active.values():
            if f is not exclude and (f.running or f.processor.has_work()) \
                    and (low is None or f.vt < low):
                low = f.vt
        if low is not None:
            return low
        high: float | None = None
        for f in self.functions:
            if f is not exclude and (high is None or f.vt > high):
                high = f.vt
        return 0.0 if high is None else high

    def became_active(self, fs: FunctionSched) -> None:
        """`fs` had no work and now has some: do not let it bank idle time. Every path
        that gives an idle function work calls this, so a function with work or runs is
        always in the active set (the pick in `dispatch` drops only idle ones)."""
        fs.vt = max(fs.vt, self.min_active_vt(fs))
        self._active[fs.index] = fs

    def competitor_waiting(self, fs: FunctionSched, quantum_expired: bool) -> bool:
        """Should a run of `fs` yield its engine at this boundary?"""
        if fs.halted:
            return True
        if self.lone is not None:
            return False
        prio = fs.priority
        for f in self._active.values():
            if f.priority > prio or (quantum_expired and f.priority == prio):
                if f is not fs and not f.halted and f.processor.startable():
                    return True
        return False

    def other_waiting(self, fs: FunctionSched) -> bool:
        """Any other runnable function (for WAIT, which yields at each poll)."""
        prio = fs.priority
        for f in self._active.values():
            if f.priority >= prio and f is not fs and not f.halted \
                    and f.processor.startable():
                return True
        return False

    # --- dispatch ---------------------------------------------------------------------

    def start_lone(self, fs: FunctionSched, sub: Submission) -> bool:
        """Start `sub` at `fs`, the only function, which the caller found idle with
        nothing queued: what became_active and dispatch would do, without the pick (it
        could only find fs). False, doing nothing, when fs is not the lone function, a
        dispatch is under way or no engine is free."""
        engines = self.engines
        if self.lone is not fs or self._dispatching or None not in engines:
            return False
        self.became_active(fs)
        if self._start(fs, engines.index(None), sub):
            self.dispatch()
        return True

    def _start(self, fs: FunctionSched, engine: int, sub: Submission | None = None) -> bool:
        """`fs` starts its next work (or `sub`) on `engine`; a failure is its alone
        (its processor's `failed`). Dispatches asked for meanwhile wait for the end of
        the start: True when one was."""
        self._dispatching = True
        self._again = False
        try:
            fs.processor.start_next(engine, sub)
        except Exception as e:  # that function alone fails; the others go on
            fs.processor.failed(e)
        finally:
            self._dispatching = False
        return self._again

    def dispatch(self) -> None:
        """Give free engines to functions with work: each free engine to the startable
        function first by (priority, virtual time, function number). The pick drops the
        active functions it finds idle from the active set."""
        if self._dispatching:
            self._again = True
            return
        active = self._active
        lone = self.lone
        if lone is not None and not lone.processor.has_work():
            # A lone function with nothing to start (the active set holds registered
            # functions only): all the pick would do is drop it from the active set if
            # an engine is free and it runs nothing.
            if not lone.running and None in self.engines:
                active.pop(lone.index, None)
            return
        while True:   # a start's nested dispatches are this loop's next pick
            engine = None
            for i, r in enumerate(self.engines):
                if r is None:
                    engine = i
                    break
            fs: FunctionSched | None = None
            if engine is not None:   # the pick
                for f in list(active.values()):
                    if not f.processor.startable():
                        if not f.running and not f.processor.has_work():
                            del active[f.index]
                        continue
                    if f.stopped or not f.bus_master:  # halted
                        continue
                    if fs is None or (-f.priority, f.vt, f.index) < (-fs.priority, fs.vt,
                                                                     fs.index):
                        fs = f
            if engine is None or fs is None:
                return
            self._start(fs, engine)
