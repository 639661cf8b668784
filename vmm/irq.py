"""A VM's interrupt controller: level-triggered lines and message-signalled interrupts.

A device raises a line; after the delivery latency the interrupt is queued and its
handler runs in guest context at the guest's next wait. A line still high after its
handler returns is delivered again (level semantics), after the latency once more.

MSI (x86 style): the guest allocates a vector and gets the message a device must write
(`MsiMessage`: an address in the 0xFEE00000 window, data = the vector). Messages are
decoded, logged and counted by the controller's `GuestMsiDomain` (the shared delivery
path of vmm/msi.py): a message sent to the controller (`deliver_msi`, or
`msi_port().send` from a device) is edge-triggered: it is queued after the latency and
its handler runs at the guest's next wait; a second message for a vector already pending
is coalesced, as the local APIC's IRR holds one bit per vector. A message for no
allocated vector is logged (`unknown_msi`) and traced, never raised: it comes from a
device the guest programmed, possibly wrongly.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Protocol

from guest_driver.kernel import MsiMessage
from hwspec.pci import MSI_ADDRESS_BASE

from .errors import VmmError
from .machine import Machine, PendingIrq, WaitDomain
from .msi import MsiDomain, RequesterMsiPort, UnknownMsi

STORM_LIMIT = 100_000
MSI_FIRST_VECTOR = 32    # x86: 0-31 are exceptions
MSI_LAST_VECTOR = 0xEF   # 0xF0 and up are the kernel's own (IPIs, timers)


class IrqError(VmmError, ValueError):
    """A bad request to a VM's interrupt controller (no such line, line taken, MSI not
    allocated here). Nothing changed."""


class LineFaultHook(Protocol):
    """What a fault plan (vmm.faults) plugs into a line: it sees every level the device
    asks for and returns whether it takes effect now (it applies deferred ones itself,
    through `Line.apply_level`)."""

    def line(self, line: "Line", level: bool) -> bool: ...


class Line(PendingIrq):
    def __init__(self, chip: "InterruptController", number: int) -> None:
        self.chip = chip
        self.domain = chip.domain
        self.number = number
        self.level = False
        self.handler: Callable[[], None] | None = None
        self.name = ""
        self.scheduled = False
        self.queued = False
        self.delivered = 0
        self.storm = 0
        self.disabled = False
        self._hook: LineFaultHook | None = None
        self._sched = chip.machine.sched
        self._label = f"irq{number}"
        self._tracer = chip.tracer
        self._pend = chip.machine.pend_irq
        self._fire_cb = self._fire   # one bound method, not one per arm

    @property
    def fault_hook(self) -> LineFaultHook | None:
        """None unless a fault plan is installed; while one is, set_level asks it first."""
        return self._hook

    @fault_hook.setter
    def fault_hook(self, hook: LineFaultHook | None) -> None:
        self._hook = hook
        if hook is None:
            self.__dict__.pop("set_level", None)
        else:
            self.__dict__["set_level"] = self._set_level_hooked

    def apply_level(self, level: bool) -> None:
        """The level the controller sees (set_level past the fault hook)."""
        level = bool(level)
        if level == self.level:
            return
        self.level = level
        # Plain by construction: the line's number (from range()) and a bool.
        self._tracer.emit_plain("irq_line", {"line": self.number, "level": level})
        if level:
            self._arm()

    # device side (device_model.ports.IrqLine): with no fault hook the level the device
    # asks for is the level the controller sees (the hook's setter puts a check first).
    set_level = apply_level

    def _set_level_hooked(self, level: bool) -> None:
        level = bool(level)
        assert self._hook is not None
        if self._hook.line(self, level):
            self.apply_level(level)

    def _arm(self) -> None:
        if self.scheduled or self.queued or self.handler is None or self.disabled:
            return
        self.scheduled = True
        self._sched.schedule(self.chip.latency_ns, self._fire_cb, self._label)

    def _fire(self) -> None:
        self.scheduled = False
        if self.level and self.handler is not None and not self.queued:
            self.queued = True
            self._pend(self)

    # guest side, in guest context
    def deliver(self) -> None:
        self.queued = False
        if not self.level or self.handler is None or self.disabled:
            return
        self.delivered += 1
        self._tracer.emit_plain("irq", {"line": self.number})
        self.handler()
        if self.level:
            self.storm += 1
            if self.storm > STORM_LIMIT:
                self.disabled = True
                self.chip.trace.emit(self.chip.source, "irq_storm", {"line": self.number})
                return
            self._arm()
        else:
            self.storm = 0


class MsiVector(PendingIrq):
    """One allocated MSI vector: edge-triggered, pending at most once (an MsiTarget of
    the controller's GuestMsiDomain: an accepted message pends it for the guest)."""

    requester_id: ClassVar[None] = None   # a VM's vectors take messages from any device
    trace_fields: ClassVar[dict[str, object]] = {}

    def __init__(self, chip: "InterruptController", vector: int, handler: Callable[[], None],
                 name: str) -> None:
        self.chip = chip
        self.domain = chip.domain
        self.vector = vector
        self.handler: Callable[[], None] | None = handler
        self.name = name
        self.pending = False     # scheduled or queued, not yet delivered
        self.received = 0
        self.coalesced = 0
        self.delivered = 0

    def message(self) -> MsiMessage:
        return MsiMessage(MSI_ADDRESS_BASE, self.vector)

    def raise_(self) -> None:
        self.received += 1
        if self.pending:
            self.coalesced += 1
            return
        self.pending = True
        self.chip.machine.sched.schedule(self.chip.latency_ns, self._fire, f"msi{self.vector}")

    fire = raise_

    def _fire(self) -> None:
        self.chip.machine.pend_irq(self)

    def deliver(self) -> None:
        self.pending = False
        if self.handler is None:  # freed while in flight: dropped, as after free_irq
            return
        self.delivered += 1
        self.chip.trace.emit(self.chip.source, "msi", {"vector": self.vector})
        self.handler()


class GuestMsiDomain(MsiDomain[MsiVector]):
    """A VM's MSI vectors (x86: 32..0xEF, data = the 8-bit vector)."""

    refused_kind = "msi_unknown"
    accepted_kind = "msi_send"
    vector_mask = 0xFF


class InterruptController:
    """Implements guest_driver.kernel.IrqChip for the guest and hands lines and MSI
    ports to devices."""

    def __init__(self, machine: Machine, source: str, lines: int = 64, latency_ns: int = 200,
                 domain: WaitDomain | None = None) -> None:
        self.machine = machine
        self.domain = domain   # the guest kernel its handlers belong to
        self.trace = machine.trace
        self.source = source
        self.tracer = machine.trace.tracer(source)   # the same events as trace.emit(source, ...)
        self.latency_ns = latency_ns
        self._lines = [Line(self, n) for n in range(lines)]
        self.msi = GuestMsiDomain(machine.trace.tracer(source), source,
                                  MSI_FIRST_VECTOR, MSI_LAST_VECTOR)

    @property
    def unknown_msi(self) -> list[UnknownMsi]:
        """Messages refused for no allocated vector (or outside the window)."""
        return self.msi.unknown

    def line(self, number: int) -> Line:
        if not 0 <= number < len(self._lines):
            raise IrqError(f"interrupt line {number} does not exist (0..{len(self._lines) - 1})")
        return self._lines[number]

    def request_irq(self, line: int, handler: Callable[[], None], name: str) -> None:
        ln = self.line(line)
        if ln.handler is not None:
            raise IrqError(f"interrupt line {line} already has handler {ln.name!r}")
        ln.handler, ln.name, ln.disabled, ln.storm = handler, name, False, 0
        if ln.level:
            ln._arm()

    def free_irq(self, line: int) -> None:
        ln = self.line(line)
        ln.handler, ln.name = None, ""

    # -- MSI ----------------------------------------------------------------------------

    def alloc_msi(self, handler: Callable[[], None], name: str) -> MsiMessage:
        """The lowest free vector; OSError(ENOSPC) when all are taken."""
        vec = self.msi.add_vector(lambda v: MsiVector(self, v, handler, name))
        self.trace.emit(self.source, "msi_alloc", {"vector": vec, "name": name})
        return MsiMessage(MSI_ADDRESS_BASE, vec)

    def free_msi(self, msg: MsiMessage) -> None:
        vec = self.msi.vector(msg.data) if msg.address == MSI_ADDRESS_BASE else None
        if vec is None:
            raise IrqError(f"MSI message (address {msg.address:#x}, data {msg.data:#x}) "
                           "was not allocated here")
        vec.handler = None
        self.msi.remove_vector(msg.data)
        self.trace.emit(self.source, "msi_free", {"vector": msg.data})

    def msi_vector(self, vector: int) -> MsiVector | None:
        return self.msi.vector(vector)

    def deliver_msi(self, address: int, data: int) -> None:
        """A DWORD write of `data` to `address` reached the interrupt window."""
        self.msi.deliver(None, address, data)

    def msi_port(self) -> RequesterMsiPort:
        """Where a device attached to this VM sends its MSI/MSI-X messages."""
        return self.msi.port(None)
