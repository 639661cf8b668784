"""A virtual machine: guest RAM, an MMIO bus, an interrupt controller, attached
accelerators, and the guest kernel services its drivers run on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from device_model import DevicePorts, MmioTransport, Va1Config, Va1Device, VirtioPciFunction
from guest_driver.kernel import PlatformDevice, RamRange
from guest_driver.uapi import GuestOS
from hwspec import virtio_mmio

from .bus import MmioBus
from .dma import GuestDma
from .eventfd import EventfdWaitQueues, IrqfdRegistry
from .guest import GuestKernelServices, GuestMmio, GuestSched
from .irq import InterruptController
from .machine import GuestTask, Machine
from .memory import GuestMemory, HostMemory
from .msi import RequesterMsiPort
from .pci.host_bridge import PciHost, PciSlot

if TYPE_CHECKING:
    from device_model.pci.api import PciFunction

    from .host import Host, HostPciFunction
    from .vfio.container import VfioContainer
    from .vfio.passthrough import VfioPciPassthrough

MMIO_BASE = 0xD000_0000
FIRST_MMIO_IRQ = 5
KERNEL_RESERVED = 1 << 20  # the guest kernel's own image and data below this


@dataclass
class EmulatedVa1:
    """A VA-1 function attached to one VM over virtio-mmio (no host sharing)."""
    device: Va1Device
    transport: MmioTransport
    platform: PlatformDevice


@dataclass
class EmulatedVa1Pci:
    """A VA-1 virtio-pci function emulated for one VM: DMA straight into guest RAM,
    MSI-X to the VM's interrupt controller, every register access trapped."""
    device: Va1Device
    function: VirtioPciFunction
    slot: PciSlot
    msi: RequesterMsiPort | None = None   # the port its MSI-X messages leave by


@dataclass
class PassthroughVa1:
    """A host function assigned to this VM through VFIO."""
    host_function: "HostPciFunction"
    container: "VfioContainer"
    endpoint: "VfioPciPassthrough"
    slot: PciSlot


class Vm:
    def __init__(self, machine: Machine, name: str = "vm0", ram_size: int = 256 << 20,
                 ram_base: int = 0, exit_cost_ns: int = 1000) -> None:
        if ram_size <= KERNEL_RESERVED:
            raise ValueError(f"VM {name!r}: RAM of {ram_size} bytes is too small "
                             f"(more than {KERNEL_RESERVED} needed)")
        self.machine = machine
        self.name = name
        self.host = HostMemory(ram_size, name=f"virtaccel-{name}")
        self.memory = GuestMemory(self.host, ram_base, ram_size)
        self.bus = MmioBus()
        self.irqchip = InterruptController(machine, f"{name}.irq")
        self.mmio = GuestMmio(machine, self.bus, machine.trace.tracer(f"{name}.cpu"), exit_cost_ns)
        self.accelerators: list[EmulatedVa1] = []
        self.pci_accelerators: list[EmulatedVa1Pci] = []
        self.passthrough: list[PassthroughVa1] = []
        self._pci: PciHost | None = None
        self._irqfds: dict[int, IrqfdRegistry] = {}
        self.closed = False
        self.kernel = GuestKernelServices(
            memory=self.memory, mmio=self.mmio, irq=self.irqchip, sched=GuestSched(machine),
            trace=machine.trace.tracer(f"{name}.kernel"),
            ram=RamRange(ram_base + KERNEL_RESERVED, ram_size - KERNEL_RESERVED))
        self.os: GuestOS | None = None
        # The optional virtio features the guest's VA-1 driver may accept (its module
        # parameter; None: the driver's defaults). Set before the guest boots.
        self.guest_features: int | None = None
        # Each spawned program's GuestOS once it booted, in spawn order (fault plans'
        # kill_process picks one).
        self.programs: list[GuestOS | None] = []

    def attach_va1_mmio(self, config: Va1Config | None = None) -> EmulatedVa1:
        index = len(self.kernel.platform_devices)
        base = MMIO_BASE + index * virtio_mmio.REGION_SIZE
        line = FIRST_MMIO_IRQ + index
        source = f"{self.name}.va1.{index}"
        tracer = self.machine.trace.tracer(source)
        device = Va1Device(config or Va1Config(),
                           DevicePorts(dma=GuestDma(self.memory), clock=self.machine.sched, tracer=tracer))
        transport = MmioTransport(device, irq=self.irqchip.line(line), tracer=tracer)
        self.bus.add(base, virtio_mmio.REGION_SIZE, transport, name=source)
        platform = PlatformDevice("virtio,mmio", base, virtio_mmio.REGION_SIZE, line)
        self.kernel.platform_devices = self.kernel.platform_devices + (platform,)
        attached = EmulatedVa1(device, transport, platform)
        self.accelerators.append(attached)
        return attached

    # -- PCI -----------------------------------------------------------------------------

    @property
    def pci(self) -> PciHost:
        """The VM's PCI host bridge (made on first use and described to the guest)."""
        if self._pci is None:
            self._pci = PciHost(self.bus, self.machine.trace.tracer(f"{self.name}.pci"), f"{self.name}.pci")
            self.kernel.pci_hosts = self.kernel.pci_hosts + (self._pci.info(),)
        return self._pci

    def _free_dev(self) -> int:
        for dev in range(1, 32):
            if self.pci.slot_at(0, dev, 0) is None:
                return dev
        raise ValueError(f"VM {self.name!r}: PCI bus 0 is full")

    def attach_pci(self, function: "PciFunction", name: str, dev: int | None = None) -> PciSlot:
        """Plug `function` into bus 0 and let firmware assign its BARs."""
        slot = self.pci.add(function, self._free_dev() if dev is None else dev, name=name)
        try:
            self.pci.assign_bars(slot)
        except BaseException:
            self.pci.remove(slot)
            raise
        return slot

    def attach_va1_pci(self, config: Va1Config | None = None) -> EmulatedVa1Pci:
        """VA-1 over virtio-pci, emulated: DMA is GuestDma (IOVA = GPA, RAM only), MSI-X
        goes to this VM's interrupt controller; the first one sits at 00:01.0."""
        dev = self._free_dev()
        source = f"{self.name}.va1pci.{dev}"
        tracer = self.machine.trace.tracer(source)
        device = Va1Device(config or Va1Config(),
                           DevicePorts(dma=GuestDma(self.memory), clock=self.machine.sched, tracer=tracer))
        msi = self.irqchip.msi_port()
        function = VirtioPciFunction(device, msi, tracer=tracer)
        slot = self.attach_pci(function, source, dev)
        attached = EmulatedVa1Pci(device, function, slot, msi)
        self.pci_accelerators.append(attached)
        return attached

    def irqfd(self, eventfds: EventfdWaitQueues) -> IrqfdRegistry:
        """This VM's irqfd registry on a host's eventfds (KVM_IRQFD)."""
        reg = self._irqfds.get(id(eventfds))
        if reg is None:
            reg = self._irqfds[id(eventfds)] = IrqfdRegistry(eventfds)
        return reg

    def attach_va1_passthrough(self, host: "Host", function: "HostPciFunction") -> PassthroughVa1:
        """Assign a host function by VFIO, as QEMU's -device vfio-pci does: bind it to
        vfio-pci, open container, group and device, map all guest RAM at IOVA = GPA,
        and put the function on this VM's PCI bus (BARs direct-mapped but for the
        MSI-X pages, MSI-X routed through eventfds and irqfds)."""
        from .vfio import uapi
        from .vfio.container import VfioContainer, vaddr_of
        from .vfio.passthrough import VfioPciPassthrough
        group = host.bind_vfio(function)
        container = VfioContainer(host.iommu, [self.memory])
        group.set_container(container)
        devfile = None
        try:
            container.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
            m = uapi.new("struct vfio_iommu_type1_dma_map *")
            m.flags = uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE
            m.vaddr = vaddr_of(self.memory, self.memory.base)
            m.iova = self.memory.base
            m.size = self.memory.size
            container.iommu_map_dma(m)
            devfile = group.get_device_fd(function.name)
            dev = self._free_dev()
            source = f"{self.name}.vfio.{dev:02x}"
            endpoint = VfioPciPassthrough(devfile, self.irqchip, self.irqfd(host.eventfds),
                                          self.machine.trace.tracer(source))
            slot = self.attach_pci(endpoint, source, dev)
        except BaseException:
            if devfile is not None:
                devfile.close()
            group.unset_container()  # drops the domain and its mappings
            raise
        attached = PassthroughVa1(function, container, endpoint, slot)
        self.passthrough.append(attached)
        return attached

    def boot(self) -> GuestOS:
        """Run the guest kernel's probe of its devices (in guest context)."""
        from guest_driver.boot import boot
        self.os = boot(self.kernel, optional_features=self.guest_features)
        return self.os

    def spawn_program(self, program: Callable[[GuestOS], Any], name: str | None = None) -> GuestTask:
        """A guest task that boots this VM's kernel, then runs `program(os)`."""
        slot = len(self.programs)
        self.programs.append(None)

        def task() -> Any:
            os_ = self.boot()
            self.programs[slot] = os_
            return program(os_)
        return self.machine.spawn(task, name or f"{self.name}.init")

    def close(self) -> None:
        """Release assigned functions (interrupts, device files, IOMMU mappings) and
        guest RAM. The attachment records stay for inspection."""
        if self.closed:
            return
        self.closed = True
        for p in self.passthrough:
            p.endpoint.close()
            group = p.host_function.group
            if group is not None and group.container is p.container:
                group.unset_container()  # the last group out drops every IOMMU mapping
        self.host.close()
