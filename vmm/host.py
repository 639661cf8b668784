"""The host machine: its physical PCI functions, IOMMU, MSI domain and eventfds.

Why: passthrough only means something when the device belongs to someone other than
the guest. The host owns the "physical" VA-1 function(s): each has a requester ID
(bus:dev.fn), does all its DMA through the host IOMMU (`IommuDma(iommu, rid)`, so it
reaches nothing a VFIO container has not mapped), and sends its MSI-X messages to the
host MSI domain, whose vectors run host callbacks (the vfio-pci driver's, which signal
eventfds). Host firmware assigns the functions' BARs on a host PCI segment.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable

from device_model import DevicePorts, Va1Config, Va1Device, VirtioPciFunction
from device_model.pci.api import PciFunction
from device_model.ports import DmaPort, MsiPort, Tracer
from guest_driver.kernel import MsiMessage
from hwspec import pci as P

from .bus import MmioBus
from .eventfd import EventfdWaitQueues
from .iommu import Iommu, IommuDma, bdf, format_bdf
from .irq import UnknownMsi
from .machine import Machine
from .pci.host_bridge import PciHost, PciSlot
from .vfio.group import VfioGroup
from .vfio.pci_device import VfioPciDevice

HOST_MSI_FIRST = 0x30
HOST_MSI_LAST = 0xEF


class HostMsiDomain:
    """Host interrupt vectors -> callbacks, with interrupt remapping.

    Each function sends through its own port (`port(requester_id)`), so every message
    carries its requester ID, as an MSI write on PCIe does. A vector allocated for one
    requester only fires for messages from that requester: anything else is blocked
    and logged (an interrupt-remapping fault), so a guest that reprograms its
    function's physical MSI-X table (say, through the virtio PCI_CFG window) cannot
    raise another function's interrupts. A message runs its vector's callback
    synchronously, inside the device event that sent it."""

    def __init__(self, tracer: Tracer) -> None:
        self._trace = tracer
        self._vectors: dict[int, tuple[Callable[[], None], str, int | None]] = {}
        self.unknown: list[UnknownMsi] = []
        self.delivered = 0

    def alloc(self, callback: Callable[[], None], name: str,
              requester_id: int | None = None) -> MsiMessage:
        """A free vector for `callback`, accepted only from `requester_id` when given."""
        for v in range(HOST_MSI_FIRST, HOST_MSI_LAST + 1):
            if v not in self._vectors:
                self._vectors[v] = (callback, name, requester_id)
                return MsiMessage(P.MSI_ADDRESS_BASE, v)
        raise OSError(errno.ENOSPC, "host MSI vectors exhausted")

    def free(self, msg: MsiMessage) -> None:
        self._vectors.pop(msg.data, None)

    def allocated(self) -> int:
        return len(self._vectors)

    def port(self, requester_id: int) -> "HostMsiPort":
        return HostMsiPort(self, requester_id)

    def send(self, address: int, data: int) -> None:
        """A message with no requester ID (host-internal); only unowned vectors fire."""
        self.deliver(None, address, data)

    def deliver(self, requester_id: int | None, address: int, data: int) -> None:
        entry = None
        reason = "no such host vector"
        if P.MSI_ADDRESS_BASE <= address < P.MSI_ADDRESS_BASE + P.MSI_ADDRESS_SIZE:
            entry = self._vectors.get(data)
        else:
            reason = f"address {address:#x} is outside the MSI window"
        if entry is not None and entry[2] is not None and entry[2] != requester_id:
            who = "no requester" if requester_id is None else format_bdf(requester_id)
            reason = f"vector {data} belongs to {format_bdf(entry[2])}, not {who} (remapping)"
            entry = None
        if entry is None:
            self.unknown.append(UnknownMsi(address, data, reason))
            self._trace.emit("host_msi_blocked", address=address, data=data, reason=reason,
                             requester="" if requester_id is None else format_bdf(requester_id))
            return
        self.delivered += 1
        self._trace.emit("host_msi", vector=data, name=entry[1])
        entry[0]()


class HostMsiPort:
    """device_model.ports.MsiPort of one host function: its messages carry its ID."""

    def __init__(self, domain: HostMsiDomain, requester_id: int) -> None:
        self.domain = domain
        self.requester_id = requester_id

    def send(self, address: int, data: int) -> None:
        self.domain.deliver(self.requester_id, address, data)


@dataclass
class HostPciFunction:
    """One physical function: where it sits, how it reaches memory."""
    name: str               # "0000:01:00.0", as sysfs and VFIO name it
    requester_id: int
    function: PciFunction
    dma: IommuDma
    slot: PciSlot
    device: object = None   # the device core behind the function (e.g. Va1Device)
    group: VfioGroup | None = None


FunctionFactory = Callable[[DmaPort, MsiPort, str], tuple[PciFunction, object]]


class Host:
    """The host: IOMMU, MSI domain, eventfd wait queues, PCI segment 0000."""

    def __init__(self, machine: Machine, name: str = "host") -> None:
        self.machine = machine
        self.name = name
        self.tracer = machine.trace.tracer(name)
        self.iommu = Iommu(tracer=machine.trace.tracer(f"{name}.iommu"))
        self.msi = HostMsiDomain(machine.trace.tracer(f"{name}.msi"))
        self.eventfds = EventfdWaitQueues()
        self.bus = MmioBus()  # the host physical address space the BARs decode in
        self.pci = PciHost(self.bus, machine.trace.tracer(f"{name}.pci"), f"{name}.pci",
                           buses=4, ecam_base=0xE000_0000, mem_base=0x40_0000_0000,
                           mem_size=0x40_0000_0000, mem32_base=0xB000_0000)
        self.functions: dict[str, HostPciFunction] = {}
        self._next_group = 10

    def add_function(self, factory: FunctionFactory, bus: int = 1, dev: int = 0, fn: int = 0
                     ) -> HostPciFunction:
        """Plug a function in at bus:dev.fn: its DMA goes through the IOMMU as that
        requester, its MSIs to the host domain; firmware assigns its BARs and the host
        enables memory decoding and bus mastering (pci_enable_device)."""
        rid = bdf(bus, dev, fn)
        name = f"0000:{format_bdf(rid)}"
        if name in self.functions:
            raise ValueError(f"host already has a function at {name}")
        dma = IommuDma(self.iommu, rid)
        function, device = factory(dma, self.msi.port(rid), f"{self.name}.{format_bdf(rid)}")
        slot = self.pci.add(function, dev, fn, bus, name=name)
        self.pci.assign_bars(slot)
        cmd = function.config_read(P.COMMAND, 2)
        self.pci.write(P.ecam_offset(bus, dev, fn, P.COMMAND), 2,
                       cmd | P.COMMAND_MEMORY | P.COMMAND_MASTER)
        hf = HostPciFunction(name, rid, function, dma, slot, device)
        self.functions[name] = hf
        return hf

    def add_va1(self, config: Va1Config | None = None, bus: int = 1, dev: int = 0, fn: int = 0
                ) -> HostPciFunction:
        """A VA-1 virtio-pci function (device_model.VirtioPciFunction over Va1Device)."""
        def factory(dma: DmaPort, msi: MsiPort, source: str) -> tuple[PciFunction, object]:
            tracer = self.machine.trace.tracer(source)
            device = Va1Device(config or Va1Config(),
                               DevicePorts(dma=dma, clock=self.machine.sched, tracer=tracer))
            function: PciFunction = VirtioPciFunction(device, msi, tracer=tracer)
            return function, device
        return self.add_function(factory, bus, dev, fn)

    def bind_vfio(self, hf: HostPciFunction) -> VfioGroup:
        """Unbind from any host driver and bind to vfio-pci: the function gets an IOMMU
        group of its own (a VF behind ACS) holding a VfioPciDevice."""
        if hf.group is not None:
            return hf.group
        group = VfioGroup(self._next_group)
        self._next_group += 1
        device = VfioPciDevice(hf.function, self.msi, self.eventfds, hf.name,
                               self.machine.trace.tracer(f"{self.name}.vfio-pci.{format_bdf(hf.requester_id)}"),
                               requester_id=hf.requester_id)
        group.add_device(hf.name, device, hf.requester_id)
        hf.group = group
        return group
