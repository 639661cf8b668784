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
- FLR: the function's PCI config space, written from the host side.

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
from hwspec import pci as P

from .dma import GuestDma
from .errors import VmmError
from .host import Host
from .iommu import IommuDma
from .irq import Line
from .machine import Machine
from .msi import RequesterMsiPort
from .pci.host_bridge import PciHost, PciSlot
from .trace import TraceEvent
from .vfio.pci_device import find_capability
from .vm import Vm

EVENT_KINDS = ("submission", "command", "kick", "interrupt", "dma")
INTERRUPT_ACTIONS = ("drop_interrupt", "delay_interrupt", "duplicate_interrupt")
DMA_ACTIONS = ("fail_dma_read", "fail_dma_write")
IMPLEMENTED = INTERRUPT_ACTIONS + DMA_ACTIONS + ("delay_mmio_exit", "flr")
PLANNED = ("hang_engine", "needs_reset", "vf_reset", "vf_stop", "iommu_unmap", "kill_process")
ACTIONS = IMPLEMENTED + PLANNED
DELAY_REQUIRED = ("delay_interrupt", "delay_mmio_exit")
DELAY_OPTIONAL = ("duplicate_interrupt",)
DUPLICATE_DELAY_NS = 10_000   # the copy arrives after the original was handled
MAX_NS = (1 << 63) - 1
ENTRY_KEYS = ("name", "function", "action", "at_ns", "after", "on", "probability", "delay_ns")
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
        for key in ("at_ns", "after", "delay_ns"):
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
                                     pci=(host.pci, hf.slot) if host is not None else None))
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
        default_factory=lambda: {k: deque() for k in ("interrupt", "read", "write", "mmio")})
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
        else:
            self.machine.sched.schedule(0, lambda: self._flr(armed, f), "fault-flr")

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


def fault_seed(seed: int) -> int:
    """The seed of a plan's own RNG, derived from the machine's."""
    return (seed * 1_000_003 + _SEED_SALT) % (1 << 64)
