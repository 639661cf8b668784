"""The guest kernel services one VM hands its drivers (guest_driver.kernel protocols)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from guest_driver.kernel import PciHostBridge, PlatformDevice, RamRange, reads_guest_state_only

from .bus import MmioBus, Region
from .irq import InterruptController
from .machine import Machine, PendingIrq, WaitDomain
from .memory import GuestMemory
from .trace import SourceTracer


class MmioFaultHook(Protocol):
    """What a fault plan (vmm.faults) plugs into a VM's MMIO path: extra virtual time
    for a trapped access (an exit delayed)."""

    def exit_delay_ns(self, addr: int, size: int) -> int: ...


class GuestMmio:
    """Guest loads/stores to MMIO space: a trap into the device, charged an exit,
    unless the region is mapped straight into the guest (passthrough)."""

    fault_hook: MmioFaultHook | None = None   # None unless a fault plan is installed

    def __init__(self, machine: Machine, bus: MmioBus, tracer: SourceTracer, exit_cost_ns: int) -> None:
        self._machine = machine
        self._bus = bus
        self._trace = tracer
        self.exit_cost_ns = exit_cost_ns
        self.exits = 0
        self.direct_accesses = 0

    def _route(self, addr: int, size: int) -> tuple[Region | None, bool]:
        """The access's region (the one bus lookup it costs) and whether it exits."""
        region = self._bus.find(addr, size)
        if region is None or not region.direct:
            self.exits += 1
            return region, True
        self.direct_accesses += 1
        return region, False

    def _exit(self, addr: int, size: int) -> None:
        self._machine.charge(self.exit_cost_ns if self.fault_hook is None
                             else self.exit_cost_ns + self.fault_hook.exit_delay_ns(addr, size))

    def read(self, addr: int, size: int) -> int:
        region, exit_ = self._route(addr, size)
        value = self._bus.read_in(region, addr, size)
        self._trace.emit("mmio_read", addr=addr, size=size, value=value, exit=exit_)
        if exit_:
            self._exit(addr, size)
        return value

    def write(self, addr: int, size: int, value: int) -> None:
        region, exit_ = self._route(addr, size)
        self._trace.emit("mmio_write", addr=addr, size=size, value=value, exit=exit_)
        self._bus.write_in(region, addr, size, value)
        if exit_:
            self._exit(addr, size)


class GuestTimer(PendingIrq):
    """One kernel timer (guest_driver.kernel.KernelTimer): a machine event that pends
    `fn` for delivery in guest context, as an interrupt is. No trace event of its own,
    so a timer whose fn does nothing leaves the trace as it was."""

    def __init__(self, machine: Machine, delay_ns: int, fn: Callable[[], None],
                 what: str, domain: WaitDomain | None = None) -> None:
        self._machine = machine
        self.domain = domain
        self._fn = fn
        self.cancelled = False
        self._event = machine.sched.schedule(max(0, int(delay_ns)), self._fire, what)

    def _fire(self) -> None:
        if not self.cancelled:
            self._machine.pend_irq(self)

    def deliver(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._fn()

    def cancel(self) -> None:
        self.cancelled = True
        self._event.cancel()


class GuestSched:
    """`domain`: the guest kernel these services belong to; a wait condition its driver
    marks with guest_driver.kernel.guest_state is declared with it (vmm.machine)."""

    def __init__(self, machine: Machine, domain: WaitDomain | None = None) -> None:
        self._machine = machine
        self._now = machine.sched.now_ns
        self.domain = domain

    def start_timer(self, delay_ns: int, fn: Callable[[], None], what: str) -> GuestTimer:
        return GuestTimer(self._machine, delay_ns, fn, what, self.domain)

    def now_ns(self) -> int:
        return self._now()

    def wait_until(self, cond: Callable[[], bool], timeout_ns: int | None, what: str) -> bool:
        domain = self.domain if reads_guest_state_only(cond) else None
        return self._machine.wait_until(cond, timeout_ns, what, domain)

    def sleep(self, ns: int) -> None:
        self._machine.sleep(ns)


@dataclass
class GuestKernelServices:
    """Implements guest_driver.kernel.GuestKernel."""
    memory: GuestMemory
    mmio: GuestMmio
    irq: InterruptController
    sched: GuestSched
    trace: SourceTracer
    ram: RamRange
    platform_devices: tuple[PlatformDevice, ...] = field(default_factory=tuple)
    pci_hosts: tuple[PciHostBridge, ...] = field(default_factory=tuple)
    cmdline: str = ""
