"""The guest kernel services one VM hands its drivers (guest_driver.kernel protocols)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
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


# The value mask of an access of 1, 2, 4 or 8 bytes, by size.
_MASKS = (0, 0xFF, 0xFFFF, 0, 0xFFFF_FFFF, 0, 0, 0, 0xFFFF_FFFF_FFFF_FFFF)
_NO_CLAIMS: dict[tuple[int, int], Region] = {}   # never written: no access is fast


class GuestMmio:
    """Guest loads/stores to MMIO space: a trap into the device, charged an exit,
    unless the region is mapped straight into the guest (passthrough)."""

    def __init__(self, machine: Machine, bus: MmioBus, tracer: SourceTracer, exit_cost_ns: int) -> None:
        self._charge = machine.charge
        self._bus = bus
        self._claims = bus.claims   # the bus's, emptied in place when its regions change
        # The claims the fast path may use: the bus's, or none while a fault plan watches.
        self._fast_claims = self._claims
        self._hook: MmioFaultHook | None = None
        self._trace = tracer
        self.exit_cost_ns = exit_cost_ns
        self.exits = 0
        self.direct_accesses = 0

    @property
    def fault_hook(self) -> MmioFaultHook | None:
        """None unless a fault plan is installed; while one is, every access takes the
        general path (which asks it for the exit delay)."""
        return self._hook

    @fault_hook.setter
    def fault_hook(self, hook: MmioFaultHook | None) -> None:
        self._hook = hook
        self._fast_claims = self._claims if hook is None else _NO_CLAIMS

    # An access the bus has claimed before (a valid size, wholly inside one region) goes
    # straight to the region's handler: MmioBus.read_in/write_in's work for it, inline.
    # Any other access takes the bus's own path, which logs it as unclaimed. The common
    # case, a claimed trapped access with no fault plan, traces ints it has tested as
    # plain (SourceTracer.emit_plain).

    def read(self, addr: int, size: int) -> int:
        region = self._fast_claims.get((addr, size))
        if region is None or region.direct:
            return self._read(addr, size, region)
        value = region.handler.read(addr - region.base, size) & _MASKS[size]
        self._trace_exit("mmio_read", addr, size, value)
        self._charge(self.exit_cost_ns)
        return value

    def write(self, addr: int, size: int, value: int) -> None:
        region = self._fast_claims.get((addr, size))
        if region is None or region.direct:
            self._write(addr, size, value, region)
            return
        self._trace_exit("mmio_write", addr, size, value)
        region.handler.write(addr - region.base, size, value & _MASKS[size])
        self._charge(self.exit_cost_ns)

    def _trace_exit(self, kind: str, addr: int, size: int, value: int) -> None:
        """Count and trace a trapped access: exact ints go through emit_plain, anything
        else through the checked emit."""
        self.exits += 1
        if type(addr) is int and type(size) is int and type(value) is int:
            self._trace.emit_plain(kind, {"addr": addr, "size": size, "value": value,
                                          "exit": True})
        else:
            self._trace.emit(kind, addr=addr, size=size, value=value, exit=True)

    def _read(self, addr: int, size: int, claimed: Region | None = None) -> int:
        """read() in general: an access claimed now or never, a direct region, a fault
        plan's exit delay. `claimed`: the region read() found claimed, if any."""
        bus = self._bus
        region = claimed or self._claims.get((addr, size)) or bus.claim(addr, size)
        if region is not None:
            value = region.handler.read(addr - region.base, size) & _MASKS[size]
        else:
            region = bus.find(addr, size)
            value = bus.read_in(region, addr, size)
        if region is None or not region.direct:
            self._trace_exit("mmio_read", addr, size, value)
            self._charge_exit(addr, size)
        else:
            self.direct_accesses += 1
            self._trace.emit("mmio_read", addr=addr, size=size, value=value, exit=False)
        return value

    def _write(self, addr: int, size: int, value: int, claimed: Region | None = None) -> None:
        """write() in general (see _read)."""
        bus = self._bus
        claimed = claimed or self._claims.get((addr, size)) or bus.claim(addr, size)
        region = claimed if claimed is not None else bus.find(addr, size)
        exit_ = region is None or not region.direct
        if exit_:
            self._trace_exit("mmio_write", addr, size, value)
        else:
            self.direct_accesses += 1
            self._trace.emit("mmio_write", addr=addr, size=size, value=value, exit=False)
        if claimed is not None:
            claimed.handler.write(addr - claimed.base, size, value & _MASKS[size])
        else:
            bus.write_in(region, addr, size, value)
        if exit_:
            self._charge_exit(addr, size)

    def _charge_exit(self, addr: int, size: int) -> None:
        """Charge a trapped access of the general path: the exit, plus the fault plan's
        delay while one is installed."""
        hook = self._hook
        self._charge(self.exit_cost_ns if hook is None
                     else self.exit_cost_ns + hook.exit_delay_ns(addr, size))


class GuestTimer(PendingIrq):
    """One kernel timer (guest_driver.kernel.KernelTimer): a machine event that pends
    the timer for delivery in guest context, as an interrupt is; delivery runs `fn`. No
    trace event of its own, so a timer whose fn does nothing leaves the trace as it was.
    The timer is its own event callback (`__call__`): no bound method per start."""

    __slots__ = ("_pend", "domain", "_fn", "_event")

    def __init__(self, machine: Machine, delay_ns: int, fn: Callable[[], None],
                 what: str, domain: WaitDomain | None = None) -> None:
        self._pend = machine.pend_irq
        self.domain = domain
        self._fn: Callable[[], None] | None = fn   # None once cancelled or delivered
        self._event = machine.sched.schedule(max(0, int(delay_ns)), self, what)

    def __call__(self) -> None:
        if self._fn is not None:
            self._pend(self)

    @property
    def cancelled(self) -> bool:
        """Cancelled, or delivered (fn ran)."""
        return self._fn is None

    def deliver(self) -> None:
        fn = self._fn
        if fn is not None:
            self._fn = None
            fn()

    def cancel(self) -> None:
        self._fn = None
        self._event[2] = None   # Timer.cancel inlined


class GuestSched:
    """`domain`: the guest kernel these services belong to; a wait condition its driver
    marks with guest_driver.kernel.guest_state is declared with it (vmm.machine)."""

    def __init__(self, machine: Machine, domain: WaitDomain | None = None) -> None:
        self._machine = machine
        self.domain = domain
        # A driver's read of the time is the scheduler's clock, and start_timer(delay_ns,
        # fn, what) builds the timer: one call each.
        self.now_ns: Callable[[], int] = machine.sched.now_ns
        self.start_timer: Callable[[int, Callable[[], None], str], GuestTimer] = \
            partial(GuestTimer, machine, domain=domain)
        # wait_until(cond, timeout_ns, what) is the machine's: a condition marked with
        # guest_state is declared with this kernel's domain (vmm.machine), any other is
        # not. The machine asks `declared` once the wait begins: at once for a wait with
        # a deadline, only once it has to block for a wait without one.
        self.wait_until: Callable[[Callable[[], bool], int | None, str], bool] = partial(
            machine.wait_declared, domain, None if domain is None else reads_guest_state_only)

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
