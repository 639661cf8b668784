"""Invariants of a run, checked from its trace events (docs/faults.md, "Invariants").

Why: a fault plan is only useful if something says, after the run, whether the stack
kept its promise. The promise, for every function of every VM:

- every submitted fence is signalled exactly once, with OK or a named error status;
- no guest task waits past a virtual-time bound (nor forever);
- a function no fault was injected on is unaffected: its fences succeed, its tasks end
  well, its device work completes;
- the device logs no strict-mode violation against a function the project's own driver
  runs (functions driven by a foreign guest kernel are left out: `foreign`).

An `Invariants` watcher is attached to a launched Session before its guests run; it
reads every trace event as it happens (no kept trace needed) and `check()` names every
breach. Which fences exist is read from both sides: the device's `submit_start` /
`submit_end` (by the function's trace source) and the guest driver's `fence_signal` and
fence `wait` events (by `<vm>.kernel`); fence numbers are dense per context, so a
signalled fence n also says fences 1 .. n-1 of that context were issued.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from hwspec.va1 import Status
from vmm.faults import fault_targets
from vmm.trace import TraceEvent

if TYPE_CHECKING:
    from ..session import Session

# Longer than the driver's own recovery: its submission watchdog (2 s without progress),
# then a reset whose control requests may each take their 1 s timeout.
DEFAULT_WAIT_BOUND_NS = 5_000_000_000
# Faults that reset a function behind its driver: until the driver's own "reset" event
# on that VM, what it writes to the function (a doorbell to a queue the reset disabled)
# is the fault's doing, not a driver bug.
_RESETS_BEHIND = frozenset({"flr", "vf_reset", "needs_reset"})
"""Longer than any wait the driver means to make (a control request's 1 s timeout)."""

BREACH_KINDS = ("lost_fence", "double_signal", "unnamed_status", "hung_wait",
                "victim_error", "victim_failed", "victim_stalled", "driver_violation",
                "run_error")
"""run_error: the run itself raised (not a guest program's error: the machine's)."""

@dataclass(frozen=True)
class Breach:
    """One broken invariant: its kind (BREACH_KINDS), where (a VM or a task), when."""
    kind: str
    where: str
    t_ns: int
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.where} at {self.t_ns} ns: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "where": self.where, "t_ns": self.t_ns,
                "detail": self.detail}


class Invariants:
    """Watches a launched session's trace; `check()` returns the breaches (docstring)."""

    def __init__(self, session: "Session", *, wait_bound_ns: int = DEFAULT_WAIT_BOUND_NS,
                 foreign: Iterable[str] = ()) -> None:
        if isinstance(wait_bound_ns, bool) or not isinstance(wait_bound_ns, int) \
                or wait_bound_ns < 1:
            raise ValueError(f"wait_bound_ns {wait_bound_ns!r}: a virtual time >= 1 ns")
        self.wait_bound_ns = wait_bound_ns
        self.vm_names = [vm.name for vm in session.vms]
        self.foreign = set(foreign)
        unknown = sorted(self.foreign - set(self.vm_names))
        if unknown:
            raise ValueError(f"foreign VMs {', '.join(unknown)}: not in this session")
        self._device: dict[str, str] = {}
        for t in fault_targets(session.vms, session.host).values():
            if t.source is not None:
                self._device[t.source] = t.vm.name
        self._kernel = {f"{n}.kernel": n for n in self.vm_names}
        self.breaches: list[Breach] = []
        self.faulted: set[str] = set()            # VMs a fault was injected on
        self.injected = 0
        self._first_fault_ns: int | None = None
        self._signalled: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._waited: dict[tuple[str, int, int], int] = {}
        self._signals_by_seq: Counter[tuple[str, int]] = Counter()
        self._ended_by_seq: Counter[tuple[str, int]] = Counter()
        self._running: dict[str, dict[tuple[int, int], int]] = defaultdict(dict)
        self._waits: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
        self._task_end: dict[str, bool] = {}
        self._victim_errors: list[Breach] = []
        self._reset_behind: set[str] = set()        # VMs whose function a fault reset
        self.excused_violations = 0
        self._last_ns = 0
        session.watch(self)

    # -- events ---------------------------------------------------------------------

    def __call__(self, ev: TraceEvent) -> None:
        self._last_ns = ev.t_ns
        src = ev.source
        if src == "machine":
            self._machine(ev)
        elif src == "faults":
            if ev.kind == "fault_injected":
                self.injected += 1
                fn = str(ev.get("function"))
                self.faulted.add(fn)
                if self._first_fault_ns is None:
                    self._first_fault_ns = ev.t_ns
                if ev.get("action") in _RESETS_BEHIND:
                    self._reset_behind.add(fn)
        elif src in self._kernel:
            self._driver(self._kernel[src], ev)
        elif src in self._device:
            self._dev(self._device[src], ev)

    def _machine(self, ev: TraceEvent) -> None:
        task = str(ev.get("task"))
        if ev.kind == "wait":
            self._waits[task].append((ev.t_ns, str(ev.get("what")), _int(ev.get("timeout", -1))))
        elif ev.kind == "wake":
            stack = self._waits.get(task)
            if not stack:
                return
            t0, what, timeout = stack.pop()
            if what == "sleep":
                return
            if ev.get("time_limit") is not None:
                self.breaches.append(Breach("hung_wait", task, t0,
                                            f"waited for {what} until the run's time limit "
                                            f"({ev.get('time_limit')} ns) ended it"))
            elif timeout < 0 and not ev.get("ok"):
                self.breaches.append(Breach("hung_wait", task, t0,
                                            f"waited for {what} forever (no event could end it)"))
            elif ev.t_ns - t0 > self.wait_bound_ns:
                self.breaches.append(Breach("hung_wait", task, t0,
                                            f"waited for {what} {ev.t_ns - t0} ns (bound "
                                            f"{self.wait_bound_ns} ns)"))
        elif ev.kind == "task_end":
            self._task_end[task] = bool(ev.get("ok"))

    def _driver(self, vm: str, ev: TraceEvent) -> None:
        if ev.kind == "reset":
            self._reset_behind.discard(vm)
        elif ev.kind == "fence_signal":
            ctx, seq, status = _int(ev.get("context")), _int(ev.get("fence")), ev.get("status")
            done = self._signalled[(vm, ctx)]
            if seq in done:
                self.breaches.append(Breach("double_signal", vm, ev.t_ns,
                                            f"context {ctx} fence {seq} signalled again "
                                            f"(status {status})"))
            done.add(seq)
            self._signals_by_seq[(vm, seq)] += 1
            name = _status_name(status)
            if name is None:
                self.breaches.append(Breach("unnamed_status", vm, ev.t_ns,
                                            f"context {ctx} fence {seq} signalled with status "
                                            f"{status!r}, which names no error"))
            elif name != "OK" and vm not in self.faulted:
                self._victim_errors.append(Breach(
                    "victim_error", vm, ev.t_ns,
                    f"context {ctx} fence {seq} failed with {name} on a function no fault "
                    "was injected on"))
        elif ev.kind == "wait" and ev.get("what") == "fence":
            key = (vm, _int(ev.get("context")), _int(ev.get("fence")))
            self._waited.setdefault(key, ev.t_ns)

    def _dev(self, vm: str, ev: TraceEvent) -> None:
        kind = ev.kind
        if kind == "submit_start":
            self._running[vm][(_int(ev.get("context")), _int(ev.get("fence")))] = ev.t_ns
        elif kind == "submit_end":
            self._running[vm].pop((_int(ev.get("context")), _int(ev.get("fence"))), None)
            self._ended_by_seq[(vm, _int(ev.get("fence")))] += 1
        elif kind in ("reset", "flr"):
            self._running[vm].clear()   # the driver aborts what was in flight
        elif kind == "violation" and vm in self._reset_behind:
            self.excused_violations += 1
        elif kind == "violation" and vm not in self.foreign:
            self.breaches.append(Breach("driver_violation", vm, ev.t_ns,
                                        f"strict-mode rule {ev.get('rule')}: "
                                        f"{ev.get('message')}"))

    # -- the verdict ----------------------------------------------------------------

    def check(self, results: Mapping[str, bool] | None = None) -> list[Breach]:
        """Every breach of the run so far, in a stable order. `results`: VM name -> its
        program's verdict (ok and correct), when the caller has it (`run_image`)."""
        out = list(self.breaches)
        for (vm, ctx), done in sorted(self._signalled.items()):
            missing = [n for n in range(1, max(done) + 1) if n not in done]
            if missing:
                out.append(Breach("lost_fence", vm, self._last_ns,
                                  f"context {ctx} fences {_ranges(missing)} never signalled "
                                  f"(fence {max(done)} was)"))
        for (vm, ctx, seq), t in sorted(self._waited.items()):
            if seq not in self._signalled.get((vm, ctx), ()):
                out.append(Breach("lost_fence", vm, t,
                                  f"context {ctx} fence {seq} waited on, never signalled"))
        for (vm, seq), ended in sorted(self._ended_by_seq.items()):
            signalled = self._signals_by_seq.get((vm, seq), 0)
            if ended > signalled:
                out.append(Breach("lost_fence", vm, self._last_ns,
                                  f"the device completed {ended} submission(s) with fence "
                                  f"{seq}, the driver signalled {signalled}"))
        out.extend(self._victim_errors)
        for vm in self.vm_names:
            if vm in self.faulted:
                continue
            for (ctx, seq), t in sorted(self._running[vm].items()):
                out.append(Breach("victim_stalled", vm, t,
                                  f"device context {ctx} fence {seq} started, never "
                                  "completed"))
            for task, ok in sorted(self._task_end.items()):
                if not ok and _task_vm(task, self.vm_names) == vm:
                    out.append(Breach("victim_failed", vm, self._last_ns,
                                      f"task {task} ended with an error"))
            if results is not None and results.get(vm) is False:
                out.append(Breach("victim_failed", vm, self._last_ns,
                                  "its program's result is not ok (or not correct)"))
        return out

    @property
    def victims(self) -> list[str]:
        """The VMs no fault was injected on."""
        return [v for v in self.vm_names if v not in self.faulted]


def _status_name(status: object) -> str | None:
    if isinstance(status, bool) or not isinstance(status, int):
        return None
    try:
        return Status(status).name
    except ValueError:
        return None


def _int(v: object) -> int:
    return v if isinstance(v, int) else -1


def _task_vm(task: str, vms: list[str]) -> str | None:
    """The VM a task runs in: its name is the VM's, or starts with it and a dot."""
    best = None
    for vm in vms:
        if (task == vm or task.startswith(vm + ".")) and (best is None or len(vm) > len(best)):
            best = vm
    return best


def _ranges(ns: list[int]) -> str:
    if len(ns) > 6:
        return f"{', '.join(map(str, ns[:5]))}, ... ({len(ns)} in all)"
    return ", ".join(map(str, ns))
