"""Fault plans: declared faults the platform injects where the hardware would fail.

Why: a driver under test must be pushed through lost interrupts, DMA faults and resets,
and a failing run must replay from its seed. The device and driver under test are the
real ones; the faults sit in the platform's ports (docs/faults.md):

- interrupts: a function's MSI port (`vmm.msi.RequesterMsiPort`, for emulated pci and
  for VFIO/SR-IOV functions, whose messages go on to the host MSI domain, vfio-pci and
  the irqfd) or its level line (`vmm.irq.Line`, virtio-mmio);
- DMA: the function's DMA port (`vmm.dma.GuestDma`, `vmm.iommu.IommuDma`), refused as
  an IOMMU fault would be (the device gets a DmaFault, nothing moves);
- MMIO exits: the VM's `vmm.guest.GuestMmio`;
- FLR: the function's PCI config space, written from the host side;
- VF reset / stop: the host's PF driver (its admin queue), run in a host task;
- IOMMU unmap: the function's IOMMU domain (the host's IOMMU driver unmapping a range);
- an engine hang, an internal error (NEEDS_RESET): the device's test port
  (`device_model.va1.device.FaultPort`), as a failure found inside the device;
- a guest process killed: its guest OS's exit path (`AccelGuestOS.kill`), closing its
  device files through the uAPI's close.

Actions that need a task context (the admin queue's waits, the guest kernel's close)
run in one task the injector spawns when it is installed ("faults"): it waits until a
trigger hands it work, and ends when every other task has ended.

A `FaultPlan` is checked entry by entry when it is made (`FaultPlanError` names the
entry); a `FaultInjector` resolves the functions against what a session built, then
plugs hooks in. With no plan installed every hook is None: nothing is counted, nothing
is traced, the run is the same as before. Every injected fault is a trace event
`fault_injected` from source "faults" naming the entry, the action and the function.
Probabilities are drawn from a `random.Random` of its own, seeded from the machine's
seed, so a plan never perturbs the machine's RNG and a seed replays the same faults.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

from device_model.pci.api import PciFunction
from device_model.va1.device import FaultPort
from hwspec import pci as P

from .dma import GuestDma
from .errors import VmmError
from .host import Host
from .iommu import PAGE_MASK, PAGE_SIZE, IommuDma, IommuError
from .iommu import Mapping as IommuMapping
from .irq import Line
from .machine import GuestDeadlock, GuestTask, Machine, TaskState
from .msi import RequesterMsiPort
from .pci.host_bridge import PciHost, PciSlot
from .trace import TraceEvent
from .vfio.pci_device import find_capability
from .vm import Vm

EVENT_KINDS = ("submission", "command", "kick", "interrupt", "dma")
INTERRUPT_ACTIONS = ("drop_interrupt", "delay_interrupt", "duplicate_interrupt")
DMA_ACTIONS = ("fail_dma_read", "fail_dma_write")
DEVICE_ACTIONS = ("hang_engine", "needs_reset")      # through the device's FaultPort
TASK_ACTIONS = ("vf_reset", "vf_stop", "kill_process")   # need a task context
IMPLEMENTED = INTERRUPT_ACTIONS + DMA_ACTIONS + ("delay_mmio_exit", "flr") + DEVICE_ACTIONS \
    + ("vf_reset", "vf_stop", "iommu_unmap", "kill_process")
PLANNED: tuple[str, ...] = ()
ACTIONS = IMPLEMENTED + PLANNED
DELAY_REQUIRED = ("delay_interrupt", "delay_mmio_exit")
DELAY_OPTIONAL = ("duplicate_interrupt",)
DURATION_ACTIONS = ("vf_stop", "iommu_unmap")   # undone after duration_ns when given
DUPLICATE_DELAY_NS = 10_000   # the copy arrives after the original was handled
MAX_NS = (1 << 63) - 1
ENTRY_KEYS = ("name", "function", "action", "at_ns", "after", "on", "probability", "delay_ns",
              "duration_ns", "iova", "length", "process")
_SEED_SALT = 0xFA_0175


class FaultPlanError(VmmError, ValueError):
    """A fault plan entry that cannot run (unknown action, trigger out of range, no such
    function, missing parameter); names the entry and the field. Nothing installed."""

    def __init__(self, index: int, name: str, field: str | None, problem: str) -> None:
        self.index = index
        self.name = name
        self.field = field
        self.problem = problem
        label = f"faults[{index}]" + (f" ({name!r})" if name else "")
        where = f".{field}" if field else ""
        super().__init__(f"fault plan entry {label}{where}: {problem}")


@dataclass(frozen=True)
class FaultEntry:
    """One fault: on `function`, when the trigger holds, do `action`.

    Trigger, exactly one of: `at_ns` (absolute virtual time); `after` = N with `on` (the
    Nth event of that kind on the function); `probability` = p with `on` (each such
    event, independently)."""
    function: str
    action: str
    at_ns: int | None = None
    after: int | None = None
    on: str | None = None
    probability: float | None = None
    delay_ns: int | None = None
    duration_ns: int | None = None    # vf_stop: resume after; iommu_unmap: map back after
    iova: int | None = None           # iommu_unmap: the range (else the next DMA's pages)
    length: int | None = None
    process: int | None = None        # kill_process: the Nth program spawned in the VM
    name: str = ""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], index: int) -> "FaultEntry":
        """An entry from a table (a VM image's [[faults]]): every key and type checked."""
        name = raw.get("name", "")
        name = name if isinstance(name, str) else ""
        for key in raw:
            if key not in ENTRY_KEYS:
                raise FaultPlanError(index, name, key,
                                     f"unknown key (allowed: {', '.join(ENTRY_KEYS)})")
        for key in ("function", "action"):
            if key not in raw:
                raise FaultPlanError(index, name, key, "missing")
        texts = ("name", "function", "action", "on")
        for key in texts:
            if key in raw and not isinstance(raw[key], str):
                raise FaultPlanError(index, name, key,
                                     f"must be text, not {type(raw[key]).__name__}")
        for key in ("at_ns", "after", "delay_ns", "duration_ns", "iova", "length", "process"):
            v = raw.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise FaultPlanError(index, name, key,
                                     f"must be an integer, not {type(v).__name__} {v!r}")
        p = raw.get("probability")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))):
            raise FaultPlanError(index, name, "probability",
                                 f"must be a number, not {type(p).__name__} {p!r}")
        return cls(**{k: raw[k] for k in raw})

    def as_dict(self) -> dict[str, Any]:
        """The entry as a [[faults]] table (only the fields it sets)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) not in (None, "")}

    @property
    def event_kind(self) -> str | None:
        return self.on if self.at_ns is None else None


def _check_entry(e: FaultEntry, i: int) -> None:
    def fail(fld: str | None, problem: str) -> FaultPlanError:
        return FaultPlanError(i, e.name, fld, problem)

    if not isinstance(e.name, str):
        raise fail("name", "must be text")
    if not isinstance(e.function, str) or not e.function.strip():
        raise fail("function", "missing (a VM name, vf<N> or a PCI name)")
    if e.action not in ACTIONS:
        raise fail("action", f"unknown action {e.action!r} (one of: {', '.join(ACTIONS)})")
    if e.action in PLANNED:
        raise fail("action", f"{e.action!r} is not implemented yet "
                             f"(implemented: {', '.join(IMPLEMENTED)})")
    given = [k for k in ("at_ns", "after", "probability") if getattr(e, k) is not None]
    if not given:
        raise fail(None, "no trigger: give at_ns, after (with on) or probability (with on)")
    if len(given) > 1:
        raise fail(given[1], f"{' and '.join(given)} given: an entry has one trigger")
    if e.at_ns is not None:
        if not _is_int(e.at_ns) or not 0 <= e.at_ns <= MAX_NS:
            raise fail("at_ns", f"{e.at_ns!r}: a virtual time in ns, 0 .. 2**63-1")
        if e.on is not None:
            raise fail("on", "only with after or probability (at_ns is a time, not an event)")
    else:
        if e.on is None:
            raise fail("on", f"missing: which events {given[0]} counts "
                             f"(one of: {', '.join(EVENT_KINDS)})")
        if e.on not in EVENT_KINDS:
            raise fail("on", f"unknown event kind {e.on!r} (one of: {', '.join(EVENT_KINDS)})")
        if e.after is not None and (not _is_int(e.after) or not 1 <= e.after <= MAX_NS):
            raise fail("after", f"{e.after!r}: the Nth event counts from 1 (N >= 1)")
        p = e.probability
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or math.isnan(p) or not 0.0 <= p <= 1.0):
            raise fail("probability", f"{p!r} is outside [0, 1]")
    if e.action in DELAY_REQUIRED and e.delay_ns is None:
        raise fail("delay_ns", f"missing: {e.action} needs the delay in virtual ns")
    if e.delay_ns is not None:
        if e.action not in DELAY_REQUIRED + DELAY_OPTIONAL:
            raise fail("delay_ns", f"{e.action} takes no delay_ns")
        lo = 0 if e.action in DELAY_OPTIONAL else 1
        if not _is_int(e.delay_ns) or not lo <= e.delay_ns <= MAX_NS:
            raise fail("delay_ns", f"{e.delay_ns!r}: {lo} .. 2**63-1 ns")
    if e.duration_ns is not None:
        if e.action not in DURATION_ACTIONS:
            raise fail("duration_ns", f"{e.action} takes no duration_ns (only "
                                      f"{', '.join(DURATION_ACTIONS)})")
        if not _is_int(e.duration_ns) or not 1 <= e.duration_ns <= MAX_NS:
            raise fail("duration_ns", f"{e.duration_ns!r}: 1 .. 2**63-1 ns")
    for key in ("iova", "length"):
        if getattr(e, key) is not None and e.action != "iommu_unmap":
            raise fail(key, f"{e.action} takes no {key} (only iommu_unmap)")
    if e.action == "iommu_unmap" and (e.iova is None) != (e.length is None):
        missing = "length" if e.length is None else "iova"
        raise fail(missing, "iova and length go together (neither: the next DMA's pages)")
    if e.iova is not None and e.length is not None:
        if not _is_int(e.iova) or e.iova < 0 or e.iova & PAGE_MASK:
            raise fail("iova", f"{e.iova!r}: a {PAGE_SIZE}-byte aligned IOVA >= 0")
        if not _is_int(e.length) or e.length < 1 or e.length & PAGE_MASK:
            raise fail("length", f"{e.length!r}: a positive multiple of {PAGE_SIZE} bytes")
        if e.iova + e.length > 1 << 64:
            raise fail("length", f"[{e.iova:#x}, +{e.length:#x}) overflows 64 bits")
    if e.process is not None:
        if e.action != "kill_process":
            raise fail("process", f"{e.action} takes no process (only kill_process)")
        if not _is_int(e.process) or not 1 <= e.process <= 1 << 20:
            raise fail("process", f"{e.process!r}: the Nth program spawned in the VM, N >= 1")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class FaultPlan:
    """Fault entries, each checked when the plan is made (FaultPlanError names it)."""

    def __init__(self, entries: Sequence[FaultEntry | Mapping[str, Any]] = ()) -> None:
        out: list[FaultEntry] = []
        names: set[str] = set()
        for i, raw in enumerate(entries):
            e = raw if isinstance(raw, FaultEntry) else FaultEntry.from_mapping(raw, i)
            _check_entry(e, i)
            if e.name:
                if e.name in names:
                    raise FaultPlanError(i, e.name, "name", "used by another entry")
                names.add(e.name)
            out.append(e)
        self.entries: tuple[FaultEntry, ...] = tuple(out)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"FaultPlan({list(self.entries)!r})"

    def label(self, index: int) -> str:
        """How the trace names entry `index`: its name, else faults[index]."""
        return self.entries[index].name or f"faults[{index}]"

    def check_functions(self, known: Callable[[str], bool]) -> None:
        """FaultPlanError for the first entry whose function `known` refuses."""
        for i, e in enumerate(self.entries):
            if not known(e.function):
                raise FaultPlanError(i, e.name, "function", f"no function {e.function!r}")


# -- what can be hit --------------------------------------------------------------------


@dataclass
class FaultTarget:
    """One accelerator function as the injector reaches it."""
    name: str                                  # canonical: the VM's name
    aliases: tuple[str, ...]                   # vf<N>, PCI name
    vm: Vm
    dma: GuestDma | IommuDma | None
    device: object                             # the device core (for kicks)
    source: str | None                         # its trace source (submissions, commands)
    msi: RequesterMsiPort | None = None
    line: Line | None = None
    pci: tuple[PciHost, PciSlot] | None = None  # where its config space is written (FLR)
    host: Host | None = None                   # an assigned function's host
    pf: str | None = None                      # a VF: its PF's PCI name
    vf: int | None = None                      # a VF: its number (1-based)
    vdpa: bool = False                         # a function behind vhost-vdpa


def fault_targets(vms: Sequence[Vm], host: Host | None = None) -> dict[str, FaultTarget]:
    """Every accelerator function attached to `vms`, by each name it answers to (the VM's
    name; for a VF also vf<N> and its PCI name; for a VFIO function its PCI name). An
    assigned function's config space is written on `host`'s PCI segment."""
    out: dict[str, FaultTarget] = {}
    for vm in vms:
        found: list[FaultTarget] = []
        for a in vm.accelerators:
            line = a.transport.irq if isinstance(a.transport.irq, Line) else None
            found.append(FaultTarget(vm.name, (), vm, _dma(a.device.dma), a.device,
                                     _source(a.device), line=line))
        for p in vm.pci_accelerators:
            found.append(FaultTarget(vm.name, (), vm, _dma(p.device.dma), p.device,
                                     _source(p.device), msi=p.msi, pci=(vm.pci, p.slot)))
        for t in vm.passthrough:
            hf = t.host_function
            aliases = (hf.name,) if hf.vf_index is None else (f"vf{hf.vf_index}", hf.name)
            found.append(FaultTarget(vm.name, aliases, vm, hf.dma, hf.device,
                                     _source(hf.device), msi=hf.msi,
                                     pci=(host.pci, hf.slot) if host is not None else None,
                                     host=host, pf=hf.pf.name if hf.pf is not None else None,
                                     vf=hf.vf_index))
        for v in getattr(vm, "vdpa", ()):
            hf = v.backend.vhost.parent.hf
            aliases = (hf.name,) if hf.vf_index is None else (f"vf{hf.vf_index}", hf.name)
            found.append(FaultTarget(vm.name, aliases, vm, hf.dma, hf.device,
                                     _source(hf.device), msi=hf.msi, host=host,
                                     pf=hf.pf.name if hf.pf is not None else None,
                                     vf=hf.vf_index, vdpa=True))
        for n, target in enumerate(found):
            if n:
                target.name = f"{vm.name}.{n}"
            for name in (target.name,) + target.aliases:
                out[name] = target
    return out


def _dma(port: object) -> GuestDma | IommuDma | None:
    return port if isinstance(port, (GuestDma, IommuDma)) else None


def _source(device: object) -> str | None:
    src = getattr(getattr(device, "tracer", None), "source", None)
    return src if isinstance(src, str) else None


# -- the injector -------------------------------------------------------------------------


@dataclass(frozen=True)
class InjectedFault:
    """One fault that happened, as traced."""
    t_ns: int
    entry: str
    action: str
    function: str
    detail: tuple[tuple[str, object], ...] = ()


@dataclass
class _Armed:
    index: int
    entry: FaultEntry


@dataclass
class _Function:
    """Per-function state: event counts, entries by trigger kind, faults waiting for
    the next operation they apply to. Implements every hook protocol of vmm."""
    injector: "FaultInjector"
    target: FaultTarget
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_KINDS, 0))
    by_kind: dict[str, list[int]] = field(default_factory=dict)
    armed: dict[str, deque[_Armed]] = field(
        default_factory=lambda: {k: deque() for k in ("interrupt", "read", "write", "mmio",
                                                      "unmap")})
    wanted: bool = False                  # the level the device last asked for (a line)
    deferred: bool = False                # a delayed rise is pending
    applying: bool = False

    # events -----------------------------------------------------------------------
    def count(self, kind: str) -> None:
        self.counts[kind] += 1
        entries = self.by_kind.get(kind)
        if entries:
            self.injector._event(self, kind, entries)

    def _take(self, op: str) -> _Armed | None:
        q = self.armed[op]
        return q.popleft() if q else None

    # MsiFaultHook -----------------------------------------------------------------
    def msi(self, port: RequesterMsiPort, address: int, data: int) -> None:
        self.count("interrupt")
        armed = self._take("interrupt")
        if armed is None:
            port.pass_on(address, data)
            return
        e = armed.entry
        inj = self.injector
        if e.action == "drop_interrupt":
            inj._injected(armed, self, vector=data)
        elif e.action == "delay_interrupt":
            assert e.delay_ns is not None
            inj._injected(armed, self, vector=data, delay_ns=e.delay_ns)
            inj.machine.sched.schedule(e.delay_ns, lambda: port.pass_on(address, data),
                                       "fault-delayed-msi")
        else:
            delay = DUPLICATE_DELAY_NS if e.delay_ns is None else e.delay_ns
            inj._injected(armed, self, vector=data, delay_ns=delay)
            port.pass_on(address, data)
            inj.machine.sched.schedule(delay, lambda: port.pass_on(address, data),
                                       "fault-duplicate-msi")

    # LineFaultHook ----------------------------------------------------------------
    def line(self, line: Line, level: bool) -> bool:
        if self.applying:
            return True
        rise = level and not self.wanted
        self.wanted = level
        if self.deferred:
            return False              # the delayed rise applies the level wanted then
        if not rise:
            return True
        self.count("interrupt")
        armed = self._take("interrupt")
        if armed is None:
            return True
        e = armed.entry
        if e.action == "drop_interrupt":
            self.injector._injected(armed, self, line=line.number)
            return False
        assert e.delay_ns is not None  # duplicate_interrupt is refused on a line
        self.injector._injected(armed, self, line=line.number, delay_ns=e.delay_ns)
        self.deferred = True

        def apply() -> None:
            self.deferred = False
            self.applying = True
            try:
                line.apply_level(self.wanted)
            finally:
                self.applying = False
        self.injector.machine.sched.schedule(e.delay_ns, apply, "fault-delayed-irq")
        return False

    # DmaFaultHook -----------------------------------------------------------------
    def dma(self, iova: int, length: int, reads: bool, writes: bool) -> str | None:
        self.count("dma")
        for op, hit in (("read", reads), ("write", writes)):
            if hit and self.armed[op]:
                armed = self.armed[op].popleft()
                self.injector._injected(armed, self, iova=iova, length=length)
                return f"injected by fault plan entry {self.injector.plan.label(armed.index)}"
        unmap = self._take("unmap")
        if unmap is not None and length > 0:
            # The pages of this very access go away first: its translation then takes
            # the IOMMU's own fault ("not mapped"), as a DMA racing an unmap would.
            lo = iova & ~PAGE_MASK
            hi = (iova + length + PAGE_MASK) & ~PAGE_MASK
            self.injector._unmap(unmap, self, lo, hi - lo)
        return None

    # MmioFaultHook ----------------------------------------------------------------
    def exit_delay_ns(self, addr: int, size: int) -> int:
        armed = self._take("mmio")
        if armed is None:
            return 0
        delay = armed.entry.delay_ns or 0
        self.injector._injected(armed, self, addr=addr, delay_ns=delay)
        return delay

    # kicks ------------------------------------------------------------------------
    def wrap_notify(self) -> None:
        device = self.target.device
        orig: Callable[[int], None] = getattr(device, "notify")

        def notify(queue_index: int) -> None:
            self.count("kick")
            orig(queue_index)
        setattr(device, "notify", notify)


class FaultInjector:
    """A FaultPlan resolved against `targets` (fault_targets) and installed on `machine`.

    Everything is checked before the first hook goes in: a FaultPlanError leaves the
    machine untouched."""

    def __init__(self, machine: Machine, plan: FaultPlan, targets: Mapping[str, FaultTarget]
                 ) -> None:
        self.machine = machine
        self.plan = plan
        self.rng = random.Random(fault_seed(machine.seed))
        self.trace = machine.trace.tracer("faults")
        self.injected: list[InjectedFault] = []
        self._functions: dict[int, _Function] = {}
        self._by_source: dict[str, _Function] = {}
        self._resolved: list[_Function] = []
        self._jobs: deque[Callable[[], None]] = deque()
        self.task: GuestTask | None = None
        self.failures: list[tuple[str, str]] = []   # (entry, error) of actions that failed
        now = machine.now_ns()
        for i, e in enumerate(plan.entries):
            t = targets.get(e.function)
            if t is None:
                have = ", ".join(sorted(targets)) or "none"
                raise FaultPlanError(i, e.name, "function",
                                     f"no function {e.function!r} in this session (have: {have})")
            _check_target(i, e, t)
            if e.at_ns is not None and e.at_ns < now:
                raise FaultPlanError(i, e.name, "at_ns",
                                     f"{e.at_ns} ns is already past: the machine is at "
                                     f"{now} ns when the plan is installed")
            self._resolved.append(self._function(t))
        self._install()

    def _function(self, t: FaultTarget) -> _Function:
        f = self._functions.get(id(t))
        if f is None:
            f = self._functions[id(t)] = _Function(self, t)
        return f

    def _install(self) -> None:
        watch = False
        needs: dict[int, set[str]] = {}
        for i, (e, f) in enumerate(zip(self.plan.entries, self._resolved)):
            need = needs.setdefault(id(f), set())
            kind = e.event_kind
            if kind is not None:
                f.by_kind.setdefault(kind, []).append(i)
                need.add(kind)
                watch = watch or kind in ("submission", "command")
            else:
                assert e.at_ns is not None
                self.machine.sched.schedule_at(e.at_ns, self._at(i, f), "fault-at")
            if e.action in INTERRUPT_ACTIONS:
                need.add("interrupt")
            elif e.action in DMA_ACTIONS:
                need.add("dma")
            elif e.action == "delay_mmio_exit":
                need.add("mmio")
            elif e.action == "iommu_unmap" and e.iova is None:
                need.add("dma")
        for f in self._functions.values():
            need = needs.get(id(f), set())
            t = f.target
            if "interrupt" in need:
                if t.msi is not None:
                    t.msi.fault_hook = f
                elif t.line is not None:
                    t.line.fault_hook = f
            if "dma" in need and t.dma is not None:
                t.dma.fault_hook = f
            if "mmio" in need:
                t.vm.mmio.fault_hook = f
            if "kick" in need:
                f.wrap_notify()
            if t.source is not None:
                self._by_source[t.source] = f
        if watch:
            self.machine.trace.watch(self._watch)
        if any(e.action in TASK_ACTIONS for e in self.plan.entries):
            self.task = self.machine.spawn(self._task_main, "faults")

    # -- the task that runs actions needing a task context -------------------------------
    def _task_main(self) -> None:
        """Run queued actions (admin commands, a guest's exit path) until every other
        task has ended."""
        while True:
            try:
                self.machine.wait_until(lambda: bool(self._jobs) or self._others_done(),
                                        None, "fault plan actions")
            except GuestDeadlock:
                return   # the guests are stuck: theirs to report, not this task's
            while self._jobs:
                self._jobs.popleft()()
            if self._others_done():
                return

    def _others_done(self) -> bool:
        return all(t.state is TaskState.DONE for t in self.machine.tasks if t is not self.task)

    def _job(self, armed: _Armed, f: _Function, action: Callable[[], object]) -> None:
        """Queue `action` for the fault task; a failure is traced, never raised into
        the task (which serves every entry)."""
        def run() -> None:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - reported as the entry's failure
                label = self.plan.label(armed.index)
                error = f"{type(exc).__name__}: {exc}"
                self.failures.append((label, error))
                self.trace.emit("fault_failed", entry=label, action=armed.entry.action,
                                function=f.target.name, error=error)
        self._jobs.append(run)

    def _at(self, index: int, f: _Function) -> Callable[[], None]:
        return lambda: self._fire(index, f)

    def _watch(self, ev: TraceEvent) -> None:
        f = self._by_source.get(ev.source)
        if f is None:
            return
        if ev.kind == "submit_start":
            f.count("submission")
        elif ev.kind == "cmd":
            f.count("command")

    def _event(self, f: _Function, kind: str, entries: list[int]) -> None:
        n = f.counts[kind]
        for i in entries:
            e = self.plan.entries[i]
            if e.after is not None:
                if n == e.after:
                    self._fire(i, f)
            elif e.probability is not None and self.rng.random() < e.probability:
                self._fire(i, f)

    def _fire(self, index: int, f: _Function) -> None:
        """The entry's trigger held: arm its fault on the next operation it applies to
        (an FLR runs as an event of its own, never inside the device's code)."""
        e = self.plan.entries[index]
        armed = _Armed(index, e)
        if e.action in INTERRUPT_ACTIONS:
            f.armed["interrupt"].append(armed)
        elif e.action == "fail_dma_read":
            f.armed["read"].append(armed)
        elif e.action == "fail_dma_write":
            f.armed["write"].append(armed)
        elif e.action == "delay_mmio_exit":
            f.armed["mmio"].append(armed)
        elif e.action == "iommu_unmap":
            if e.iova is None:
                f.armed["unmap"].append(armed)
            else:
                assert e.length is not None
                iova, length = e.iova, e.length
                self.machine.sched.schedule(0, lambda: self._unmap(armed, f, iova, length),
                                            "fault-unmap")
        elif e.action in DEVICE_ACTIONS:
            self.machine.sched.schedule(0, lambda: self._device(armed, f), "fault-device")
        elif e.action == "vf_reset":
            self._job(armed, f, lambda: self._vf_reset(armed, f))
        elif e.action == "vf_stop":
            self._job(armed, f, lambda: self._vf_stop(armed, f))
        elif e.action == "kill_process":
            self._job(armed, f, lambda: self._kill(armed, f))
        else:
            self.machine.sched.schedule(0, lambda: self._flr(armed, f), "fault-flr")

    def _skipped(self, armed: _Armed, f: _Function, reason: str) -> None:
        self.trace.emit("fault_skipped", entry=self.plan.label(armed.index),
                        action=armed.entry.action, function=f.target.name, reason=reason)

    def _device(self, armed: _Armed, f: _Function) -> None:
        """hang_engine / needs_reset through the function's FaultPort (spec §14)."""
        port = _fault_port(f.target.device)
        assert port is not None
        label = self.plan.label(armed.index)
        if armed.entry.action == "hang_engine":
            self._injected(armed, f)
            port.hang_next_command()
        elif port.live:
            self._injected(armed, f)
            port.internal_error(f"internal error (fault plan entry {label})")
        else:
            self._skipped(armed, f, "the function is not live (reset, not yet DRIVER_OK, "
                                    "or NEEDS_RESET already)")

    def _unmap(self, armed: _Armed, f: _Function, iova: int, length: int) -> None:
        """Unmap [iova, iova + length) from the function's IOMMU domain (splitting
        mappings at the edges, as the host's IOMMU driver may); with duration_ns the
        pages that were mapped are mapped back that much later."""
        dma = f.target.dma
        assert isinstance(dma, IommuDma)
        iommu = dma.iommu
        domain = iommu.domain_of(dma.requester_id)
        if domain is None:
            self._skipped(armed, f, "the function is attached to no IOMMU domain")
            return
        end = iova + length
        gone = [m._slice(max(m.iova, iova), min(m.end, end) - max(m.iova, iova))
                for m in domain.overlapping(iova, length)]
        unmapped = iommu.unmap(domain, iova, length)
        self._injected(armed, f, iova=iova, length=length, unmapped=unmapped)
        duration = armed.entry.duration_ns
        if duration is not None and gone:
            self.machine.sched.schedule(duration, lambda: self._remap(armed, f, gone),
                                        "fault-remap")

    def _remap(self, armed: _Armed, f: _Function, gone: list[IommuMapping]) -> None:
        dma = f.target.dma
        assert isinstance(dma, IommuDma)
        iommu = dma.iommu
        domain = iommu.domain_of(dma.requester_id)
        if domain is None:
            self._skipped(armed, f, "map back: the function left its IOMMU domain")
            return
        mapped = 0
        for m in gone:
            try:
                iommu.map(domain, m.iova, m.backing, m.address, m.size, read=m.read,
                          write=m.write)
                mapped += m.size
            except IommuError:
                pass   # mapped again meanwhile (the VMM remapped it): leave it as it is
        self._cleared(armed, f, mapped=mapped)

    def _cleared(self, armed: _Armed, f: _Function, **detail: int) -> None:
        """A fault with a duration is undone (VF resumed, pages mapped back)."""
        self.trace.emit("fault_cleared", entry=self.plan.label(armed.index),
                        action=armed.entry.action, function=f.target.name, **detail)

    def _pf_driver(self, f: _Function) -> Any:
        t = f.target
        assert t.host is not None and t.pf is not None
        return t.host.pf_driver(t.pf)

    def _vf_reset(self, armed: _Armed, f: _Function) -> None:
        """VF_RESET of the VF through the host's PF driver (its admin queue)."""
        assert f.target.vf is not None
        self._injected(armed, f, vf=f.target.vf)
        self._pf_driver(f).reset_vf(f.target.vf)

    def _vf_stop(self, armed: _Armed, f: _Function) -> None:
        """VF_STOP through the PF driver; VF_RESUME duration_ns after it, when given."""
        vf = f.target.vf
        assert vf is not None
        self._injected(armed, f, vf=vf)
        self._pf_driver(f).stop(vf)
        duration = armed.entry.duration_ns
        if duration is None:
            return

        def resume() -> None:
            self._pf_driver(f).resume(vf)
            self._cleared(armed, f, vf=vf)
        self.machine.sched.schedule(duration, lambda: self._job(armed, f, resume),
                                    "fault-vf-resume")

    def _kill(self, armed: _Armed, f: _Function) -> None:
        """The VM's Nth program dies: its guest OS's exit path closes its device files
        (run in the fault task, standing for that guest's kernel)."""
        n = armed.entry.process or 1
        programs = f.target.vm.programs
        os_ = programs[n - 1] if n <= len(programs) else None
        if os_ is None:
            self._skipped(armed, f, f"no program {n} booted in {f.target.vm.name} "
                                    f"({len(programs)} spawned)")
            return
        kill = getattr(os_, "kill", None)
        if kill is None:
            self._skipped(armed, f, f"program {n}'s guest OS has no exit path (kill)")
            return
        if getattr(os_, "killed", False):
            self._skipped(armed, f, f"program {n} was killed already")
            return
        open_files = [x for x in getattr(os_, "files", ()) if not getattr(x, "closed", True)]
        self._injected(armed, f, process=n, files=len(open_files))
        kill()

    def _flr(self, armed: _Armed, f: _Function) -> None:
        """Host-side FLR through config space, as Linux's pci_reset_function does it:
        save the header (command, BARs), set DEVCTL.BCR_FLR, restore the header. The
        function's virtio and MSI-X state are not restored."""
        assert f.target.pci is not None
        host, slot = f.target.pci
        self._injected(armed, f)
        function: PciFunction = slot.function
        cap = find_capability(function, P.CAP_ID_EXP)
        if cap is None:
            self.trace.emit("fault_skipped", entry=self.plan.label(armed.index),
                            action="flr", function=f.target.name, reason="no PCIe capability")
            return

        def ecam(reg: int) -> int:
            return P.ecam_offset(slot.bus, slot.dev, slot.fn, reg)
        bars = [(reg, host.read(ecam(reg), 4)) for reg in range(P.BASE_ADDRESS_0, 0x28, 4)]
        command = host.read(ecam(P.COMMAND), 2)
        devctl = host.read(ecam(cap + P.EXP_DEVCTL), 2)
        host.write(ecam(cap + P.EXP_DEVCTL), 2, devctl | P.EXP_DEVCTL_BCR_FLR)
        for reg, value in bars:
            host.write(ecam(reg), 4, value)
        host.write(ecam(P.COMMAND), 2, command)

    def _injected(self, armed: _Armed, f: _Function, **detail: int) -> None:
        label = self.plan.label(armed.index)
        self.trace.emit("fault_injected", entry=label, action=armed.entry.action,
                        function=f.target.name, **detail)
        self.injected.append(InjectedFault(self.machine.now_ns(), label, armed.entry.action,
                                           f.target.name, tuple(detail.items())))

    def counts(self, function: str) -> dict[str, int]:
        """Events counted so far on `function` (only the kinds its entries watch)."""
        for f in self._functions.values():
            if function == f.target.name or function in f.target.aliases:
                return dict(f.counts)
        raise KeyError(function)


def _check_target(i: int, e: FaultEntry, t: FaultTarget) -> None:
    """Refuse an action the target's attachment cannot take (before anything runs)."""
    if e.action == "flr" and t.vdpa:
        raise FaultPlanError(i, e.name, "action",
                             f"{e.function!r} is behind vhost-vdpa: the guest's function is "
                             "the VMM's emulated frontend, an FLR of the hardware under it "
                             "is not a guest-visible event (use needs_reset)")
    if e.action == "flr" and t.pci is None:
        raise FaultPlanError(i, e.name, "action",
                             f"{e.function!r} is not a PCI function (virtio-mmio): no FLR")
    if e.action in INTERRUPT_ACTIONS and t.msi is None and t.line is None:
        raise FaultPlanError(i, e.name, "action", f"{e.function!r}: no interrupt port to hit")
    if e.action == "duplicate_interrupt" and t.msi is None:
        raise FaultPlanError(i, e.name, "action",
                             f"{e.function!r} raises a level-triggered line: a level has no "
                             "duplicate message (duplicate_interrupt needs MSI-X: pci, vfio, "
                             "sriov)")
    if (e.action in DMA_ACTIONS or e.on == "dma") and t.dma is None:
        raise FaultPlanError(i, e.name, "action", f"{e.function!r}: no DMA port to hit")
    if e.on in ("submission", "command") and t.source is None:
        raise FaultPlanError(i, e.name, "on", f"{e.function!r}: its events are not traced")
    if e.action in ("vf_reset", "vf_stop") and (t.vf is None or t.host is None or t.pf is None):
        raise FaultPlanError(i, e.name, "action",
                             f"{e.function!r} is not an SR-IOV VF: {e.action} is an admin "
                             "command of the VF's PF (sriov attachments only)")
    if e.action == "iommu_unmap" and not isinstance(t.dma, IommuDma):
        raise FaultPlanError(i, e.name, "action",
                             f"{e.function!r} has no IOMMU: an emulated function's DMA goes "
                             "straight to guest physical addresses, there is nothing to "
                             "unmap (iommu_unmap needs vfio or sriov)")
    if e.action in DEVICE_ACTIONS and _fault_port(t.device) is None:
        raise FaultPlanError(i, e.name, "action",
                             f"{e.function!r}: its device has no fault port ({e.action} "
                             "needs a VA-1 function)")


def _fault_port(device: object) -> FaultPort | None:
    port = getattr(device, "fault_port", None)
    return port if isinstance(port, FaultPort) else None


def fault_seed(seed: int) -> int:
    """The seed of a plan's own RNG, derived from the machine's."""
    return (seed * 1_000_003 + _SEED_SALT) % (1 << 64)
