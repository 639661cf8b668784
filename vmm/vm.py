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
    from .vdpa.frontend import VdpaMmioFrontend, VdpaPciFrontend, VhostBackend

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


@dataclass
class VdpaVa1:
    """A vdpa device of a host given to this VM: vhost-vdpa file, backend, frontend."""
    device_name: str
    host: "Host"
    backend: "VhostBackend"
    frontend: "VdpaPciFrontend | VdpaMmioFrontend"
    transport: str                  # "pci" or "mmio"
    slot: PciSlot | None = None     # pci
    platform: PlatformDevice | None = None   # mmio


class Vm:
    def __init__(self, machine: Machine, name: str = "vm0", ram_size: int = 256 << 20,
                 ram_base: int = 0, exit_cost_ns: int = 1000, cmdline: str = "") -> None:
        if ram_size <= KERNEL_RESERVED:
            raise ValueError(f"VM {name!r}: RAM of {ram_size} bytes is too small "
                             f"(more than {KERNEL_RESERVED} needed)")
        self.machine = machine
        self.name = name
        self.host = HostMemory(ram_size, name=f"virtaccel-{name}")
        self.memory = GuestMemory(self.host, ram_base, ram_size)
        self.bus = MmioBus()
        # This guest kernel's code: its tasks, interrupt handlers and timers
        # (vmm.machine's ready set).
        self.domain = machine.wait_domain(name)
        self.irqchip = InterruptController(machine, f"{name}.irq", domain=self.domain)
        self.mmio = GuestMmio(machine, self.bus, machine.trace.tracer(f"{name}.cpu"), exit_cost_ns)
        self.accelerators: list[EmulatedVa1] = []
        self.pci_accelerators: list[EmulatedVa1Pci] = []
        self.passthrough: list[PassthroughVa1] = []
        self.vdpa: list[VdpaVa1] = []
        self._pci: PciHost | None = None
        self._irqfds: dict[int, IrqfdRegistry] = {}
        self.closed = False
        self.kernel = GuestKernelServices(
            memory=self.memory, mmio=self.mmio, irq=self.irqchip,
            sched=GuestSched(machine, self.domain),
            trace=machine.trace.tracer(f"{name}.kernel"),
            ram=RamRange(ram_base + KERNEL_RESERVED, ram_size - KERNEL_RESERVED),
            cmdline=cmdline)
        self.os: GuestOS | None = None
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

    def attach_va1_vdpa(self, host: "Host", device: str, transport: str = "pci") -> VdpaVa1:
        """Give this VM the host's vdpa device `device`, as QEMU's vhost-vdpa device
        does: open its /dev/vhost-vdpa-N, put guest RAM in the IOTLB at IOVA = GPA, and
        show the guest an emulated VA-1 over `transport` ("pci" or "mmio") whose queue
        setup goes to the device and whose doorbells and interrupts are eventfds."""
        from .vdpa.frontend import VdpaMmioFrontend, VdpaPciFrontend, VhostBackend
        if transport not in ("pci", "mmio"):
            raise ValueError(f"vdpa transport {transport!r}: one of pci, mmio")
        dev = host.vdpa.device(device)
        vhost = host.vdpa.open(dev.vhost_path, [self.memory], process=self)
        try:
            if transport == "pci":
                source = f"{self.name}.vdpa.{self._free_dev():02x}"
            else:
                source = f"{self.name}.vdpa.mmio{len(self.kernel.platform_devices)}"
            tracer = self.machine.trace.tracer(source)
            backend = VhostBackend(vhost, self.memory, host.eventfds, self.irqfd(host.eventfds),
                                   tracer, owner=self)
        except BaseException:
            vhost.close()
            raise
        try:
            if transport == "pci":
                pci = VdpaPciFrontend(backend, self.irqchip.msi_port(), tracer)
                attached = VdpaVa1(device, host, backend, pci, transport,
                                   slot=self.attach_pci(pci, source))
            else:
                index = len(self.kernel.platform_devices)
                base = MMIO_BASE + index * virtio_mmio.REGION_SIZE
                line = FIRST_MMIO_IRQ + index
                mmio = VdpaMmioFrontend(backend, self.irqchip.line(line), tracer)
                for off, size, handler in mmio.regions():
                    self.bus.add(base + off, size, handler, name=f"{source}+{off:#x}")
                platform = PlatformDevice("virtio,mmio", base, virtio_mmio.REGION_SIZE, line)
                self.kernel.platform_devices = self.kernel.platform_devices + (platform,)
                attached = VdpaVa1(device, host, backend, mmio, transport, platform=platform)
        except BaseException:
            backend.close()
            raise
        self.vdpa.append(attached)
        return attached

    def boot(self) -> GuestOS:
        """Run the guest kernel's probe of its devices (in guest context)."""
        from guest_driver.boot import boot
        self.os = boot(self.kernel)
        return self.os

    def spawn_program(self, program: Callable[[GuestOS], Any], name: str | None = None) -> GuestTask:
        """A guest task that boots this VM's kernel, then runs `program(os)`."""
        slot = len(self.programs)
        self.programs.append(None)

        def task() -> Any:
            os_ = self.boot()
            self.programs[slot] = os_
            return program(os_)
        return self.machine.spawn(task, name or f"{self.name}.init", self.domain)

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
        for v in self.vdpa:
            v.backend.close()
        self.host.close()
