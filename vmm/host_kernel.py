"""Host-kernel services: what the host's own drivers (the VA-1 PF driver) run on.

Why: the PF driver (guest_driver.va1.pf) is written against guest_driver.kernel's
GuestKernel protocol, like every driver here. On the host it gets the same services,
backed by host resources instead of a VM's:

- memory: a region of host RAM (memfd-backed) at host physical `ram_base`, from which
  the driver allocates its rings (admin queue, controlq...). The PF does DMA through
  the host IOMMU like every function, so the host attaches the PF's requester ID to a
  DMA domain that maps exactly this RAM at IOVA = host physical address (the DMA API's
  identity domain, restricted to what the kernel handed the driver).
- mmio: loads and stores on the host physical bus (the PF's BAR, ECAM) with no exit
  cost: the host kernel runs natively.
- irq: MSI vectors from the host MSI domain, accepted only from the PF's requester ID
  (interrupt remapping); handlers run in the waiting task between events, as a guest's do.
- sched: the machine's scheduler, so host waits are virtual and interleave with guests.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from guest_driver.kernel import MsiMessage, PciHostBridge, PlatformDevice, RamRange

from .guest import GuestMmio, GuestSched
from .iommu import IommuDomain
from .machine import PendingIrq, WaitDomain
from .memory import GuestMemory, HostMemory
from .trace import SourceTracer

if TYPE_CHECKING:
    from .host import Host

HOST_KERNEL_RAM_BASE = 0x1000_0000      # host physical; below the host's MMIO windows
HOST_KERNEL_RAM_SIZE = 16 << 20
KERNEL_RESERVED = 1 << 20


class _PendingHandler(PendingIrq):
    def __init__(self, irq: "HostKernelIrq", msg: MsiMessage) -> None:
        self.irq = irq
        self.domain = irq.domain
        self.msg = msg
        self.queued = False

    def deliver(self) -> None:
        self.queued = False
        handler = self.irq.handlers.get(self.msg.data)
        if handler is not None:
            self.irq.delivered += 1
            handler()


class HostKernelIrq:
    """guest_driver.kernel.IrqChip on the host MSI domain, for one requester ID."""

    def __init__(self, host: "Host", requester_id: int, tracer: SourceTracer,
                 domain: WaitDomain | None = None) -> None:
        self.host = host
        self.domain = domain   # the host kernel its handlers belong to
        self.requester_id = requester_id
        self.trace = tracer
        self.handlers: dict[int, Callable[[], None]] = {}
        self._pending: dict[int, _PendingHandler] = {}
        self.delivered = 0

    def request_irq(self, line: int, handler: Callable[[], None], name: str) -> None:
        raise OSError(errno.ENODEV, f"host kernel: no INTx line {line} (MSI-X only)")

    def free_irq(self, line: int) -> None:
        raise OSError(errno.ENODEV, f"host kernel: no INTx line {line}")

    def alloc_msi(self, handler: Callable[[], None], name: str) -> MsiMessage:
        box: list[_PendingHandler] = []

        def fire() -> None:  # in the device event: queue for the waiting task
            p = box[0]
            if not p.queued:
                p.queued = True
                self.host.machine.pend_irq(p)

        msg = self.host.msi.alloc(fire, name, requester_id=self.requester_id)
        box.append(_PendingHandler(self, msg))
        self.handlers[msg.data] = handler
        return msg

    def free_msi(self, msg: MsiMessage) -> None:
        self.handlers.pop(msg.data, None)
        self.host.msi.free(msg)


@dataclass
class HostKernelServices:
    """Implements guest_driver.kernel.GuestKernel for host drivers (module docstring)."""
    memory: GuestMemory
    mmio: GuestMmio
    irq: HostKernelIrq
    sched: GuestSched
    trace: SourceTracer
    ram: RamRange
    platform_devices: tuple[PlatformDevice, ...] = field(default_factory=tuple)
    pci_hosts: tuple[PciHostBridge, ...] = field(default_factory=tuple)
    host_memory: HostMemory | None = None
    dma_domain: IommuDomain | None = None
    cmdline: str = ""

    def close(self) -> None:
        if self.host_memory is not None:
            self.host_memory.close()
            self.host_memory = None


def make_host_kernel(host: "Host", requester_id: int, name: str,
                     ram_size: int = HOST_KERNEL_RAM_SIZE) -> HostKernelServices:
    """Host-kernel services for the driver of function `requester_id`: its RAM is mapped
    for that requester's DMA in a domain of its own (IOVA = host physical address)."""
    hm = HostMemory(ram_size, name=f"virtaccel-{host.name}-{name}")
    memory = GuestMemory(hm, HOST_KERNEL_RAM_BASE, ram_size)
    domain = host.iommu.create_domain()
    host.iommu.map(domain, HOST_KERNEL_RAM_BASE, memory, HOST_KERNEL_RAM_BASE, ram_size)
    host.iommu.attach(requester_id, domain)
    machine = host.machine
    wait_domain = machine.wait_domain(f"{host.name}.{name}")
    mmio = GuestMmio(machine, host.bus, machine.trace.tracer(f"{host.name}.{name}.cpu"), 0)
    return HostKernelServices(
        memory=memory, mmio=mmio,
        irq=HostKernelIrq(host, requester_id, machine.trace.tracer(f"{host.name}.{name}.irq"),
                          wait_domain),
        sched=GuestSched(machine, wait_domain), trace=machine.trace.tracer(f"{host.name}.{name}"),
        ram=RamRange(HOST_KERNEL_RAM_BASE + KERNEL_RESERVED, ram_size - KERNEL_RESERVED),
        pci_hosts=(host.pci.info(),), host_memory=hm, dma_domain=domain)
