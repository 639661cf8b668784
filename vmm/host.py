"""The host machine: its physical PCI functions, IOMMU, MSI domain and eventfds, assembled.

Why: passthrough only means something when the device belongs to someone other than
the guest. The host owns the "physical" VA-1 function(s): each has a requester ID
(bus:dev.fn), does all its DMA through the host IOMMU (`IommuDma(iommu, rid)`, so it
reaches nothing a VFIO container has not mapped), and sends its MSI-X messages to the
host MSI domain, whose vectors run host callbacks (the vfio-pci driver's, which signal
eventfds). Host firmware assigns the functions' BARs on a host PCI segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

from device_model import DevicePorts, Va1Config, Va1Device, VirtioPciFunction
from device_model.pci.api import PciFunction
from device_model.ports import DmaPort, MsiPort
from hwspec import pci as P
from hwspec import va1 as A
from hwspec.va1 import VfResources

from .bus import MmioBus
from .host_kernel import HostKernelServices, make_host_kernel
from .sriov import HostSriovPlatform, PfDriver, SriovError
from .eventfd import EventfdWaitQueues
from .iommu import Iommu, IommuDma, bdf, format_bdf
from .machine import Machine
from .msi import HOST_MSI_REMAPPED_LAST, HostMsiDomain, RequesterMsiPort
from .pci.host_bridge import PciHost, PciSlot
from .vfio.group import VfioGroup
from .vfio.pci_device import VfioPciDevice

if TYPE_CHECKING:
    from guest_driver.va1.pf import VA1Pf

    from .vdpa.bus import VdpaBus


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
    pf: "HostPciFunction | None" = None   # a VF: its physical function
    vf_index: int | None = None           # a VF: its number, 1-based
    msi: RequesterMsiPort | None = None   # the port its MSI-X messages leave by


FunctionFactory = Callable[[DmaPort, MsiPort, str], tuple[PciFunction, object]]
# (PF device ports, PF MSI port, the host's SR-IOV platform, trace source) -> (PF, card)
CardFactory = Callable[[DevicePorts, MsiPort, HostSriovPlatform, str], tuple[PciFunction, object]]
# (host-kernel services, the PF's HostPciFunction) -> a probed PF driver
PfDriverFactory = Callable[[HostKernelServices, "HostPciFunction"], PfDriver]


class Host:
    """The host: IOMMU, MSI domain, eventfd wait queues, PCI segment 0000."""

    def __init__(self, machine: Machine, name: str = "host", page_size: int = 4096) -> None:
        """`page_size`: the host CPU's page (4 KiB; 16 or 64 KiB on some arm64 hosts),
        which an SR-IOV PF's System Page Size is set to (vmm.sriov)."""
        if page_size < 4096 or page_size & (page_size - 1):
            raise ValueError(f"host page size {page_size:#x} is not a power of two >= 4 KiB")
        self.machine = machine
        self.name = name
        self.page_size = page_size
        self.tracer = machine.trace.tracer(name)
        self.iommu = Iommu(tracer=machine.trace.tracer(f"{name}.iommu"))
        self.msi = HostMsiDomain(machine.trace.tracer(f"{name}.msi"), last=HOST_MSI_REMAPPED_LAST,
                                 name=f"{name}.msi")
        self.eventfds = EventfdWaitQueues()
        self.bus = MmioBus()  # the host physical address space the BARs decode in
        self.pci = PciHost(self.bus, machine.trace.tracer(f"{name}.pci"), f"{name}.pci",
                           buses=4, ecam_base=0xE000_0000, mem_base=0x40_0000_0000,
                           mem_size=0x40_0000_0000, mem32_base=0xB000_0000)
        self.functions: dict[str, HostPciFunction] = {}
        self._next_group = 10
        self.sriov: dict[str, HostSriovPlatform] = {}       # PF name -> its SR-IOV platform
        self.kernels: dict[str, HostKernelServices] = {}    # PF name -> host-kernel services
        self.pf_drivers: dict[str, PfDriver] = {}           # PF name -> bound PF driver
        self.pf_driver_factory: PfDriverFactory | None = None
        self._vdpa: "VdpaBus | None" = None

    @property
    def vdpa(self) -> "VdpaBus":
        """The host's vdpa bus (management devices, vdpa devices, vhost-vdpa files)."""
        if self._vdpa is None:
            from .vdpa.bus import VdpaBus
            self._vdpa = VdpaBus(self)
        return self._vdpa

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
        msi = self.msi.port(rid)
        function, device = factory(dma, msi, f"{self.name}.{format_bdf(rid)}")
        slot = self.pci.add(function, dev, fn, bus, name=name)
        self.pci.assign_bars(slot)
        cmd = function.config_read(P.COMMAND, 2)
        self.pci.write(P.ecam_offset(bus, dev, fn, P.COMMAND), 2,
                       cmd | P.COMMAND_MEMORY | P.COMMAND_MASTER)
        hf = HostPciFunction(name, rid, function, dma, slot, device, msi=msi)
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
        virtfn_ids = None
        if hf.pf is not None:  # a VF: vfio-pci shows the PF's vendor and the VF Device ID
            platform = self.sriov.get(hf.pf.name)
            did = platform._cfg(P.SRIOV_VF_DID, 2) if platform is not None and platform.cap else 0
            virtfn_ids = (hf.pf.function.config_read(P.VENDOR_ID, 2), did)
        device = VfioPciDevice(hf.function, self.msi, self.eventfds, hf.name,
                               self.machine.trace.tracer(f"{self.name}.vfio-pci.{format_bdf(hf.requester_id)}"),
                               requester_id=hf.requester_id, virtfn_ids=virtfn_ids)
        group.add_device(hf.name, device, hf.requester_id)
        hf.group = group
        return group

    def drop_vfio(self, hf: HostPciFunction) -> None:
        """A function leaves the host (VF disable): forget its VFIO group."""
        group = hf.group
        hf.group = None
        if group is not None and getattr(group, "container", None) is not None:
            try:
                group.unset_container()
            except Exception:  # noqa: BLE001 - the function is gone either way
                pass

    # -- SR-IOV ------------------------------------------------------------------------

    def add_va1_card(self, config: Va1Config | None = None, *, bus: int = 1, dev: int = 0,
                     fn: int = 0, card_factory: CardFactory | None = None,
                     **card_options: Any) -> HostPciFunction:
        """A VA-1 card: a PF with the SR-IOV capability (device_model.va1.card.Va1Card by
        default; `card_factory` builds another). Firmware places its BAR and its VF BARs;
        the host's SR-IOV platform puts VFs on this segment when VF Enable is set."""
        rid = bdf(bus, dev, fn)
        platform = HostSriovPlatform(self, rid, f"0000:{format_bdf(rid)}")
        make = card_factory or default_card_factory(config, **card_options)

        def factory(dma: DmaPort, msi: MsiPort, source: str) -> tuple[PciFunction, object]:
            ports = DevicePorts(dma=dma, clock=self.machine.sched,
                                tracer=self.machine.trace.tracer(source))
            return make(ports, msi, platform, source)
        hf = self.add_function(factory, bus, dev, fn)
        try:
            platform.attach(hf)
        except SriovError:
            self.pci.remove(hf.slot)        # a PF the host cannot use leaves no trace
            self.functions.pop(hf.name, None)
            raise
        self.sriov[hf.name] = platform
        return hf

    def _pf(self, pf: HostPciFunction | str | None) -> HostPciFunction:
        if isinstance(pf, HostPciFunction):
            return pf
        if pf is None:
            if not self.sriov:
                raise SriovError(f"{self.name}: no SR-IOV capable function (add_va1_card first)")
            return self.functions[next(iter(self.sriov))]
        if pf not in self.sriov:
            raise SriovError(f"{self.name}: {pf!r} is not an SR-IOV PF "
                             f"(have {', '.join(self.sriov) or 'none'})")
        return self.functions[pf]

    def sriov_platform(self, pf: HostPciFunction | str | None = None) -> HostSriovPlatform:
        return self.sriov[self._pf(pf).name]

    def vfs(self, pf: HostPciFunction | str | None = None) -> list[HostPciFunction]:
        """The enabled VFs of `pf` (the first card by default), VF 1 first."""
        return list(self.sriov_platform(pf).vfs)

    def host_kernel(self, pf: HostPciFunction | str | None = None) -> HostKernelServices:
        """The host-kernel services the PF's driver runs on (made on first use)."""
        hf = self._pf(pf)
        k = self.kernels.get(hf.name)
        if k is None:
            k = self.kernels[hf.name] = make_host_kernel(self, hf.requester_id,
                                                         f"pf-{format_bdf(hf.requester_id)}")
        return k

    def pf_driver(self, pf: HostPciFunction | str | None = None) -> PfDriver:
        """The PF's host driver, bound and probed on first use (in the calling context:
        the main thread before guests run, or a host task)."""
        hf = self._pf(pf)
        drv = self.pf_drivers.get(hf.name)
        if drv is None:
            make = self.pf_driver_factory or default_pf_driver_factory
            drv = self.pf_drivers[hf.name] = make(self.host_kernel(hf), hf)
        return drv

    def enable_sriov(self, num_vfs: int, resources: Sequence[VfResources | Mapping[str, int]] | None = None,
                     *, pf: HostPciFunction | str | None = None, bind: bool = True
                     ) -> list[HostPciFunction]:
        """Enable `num_vfs` VFs through the PF driver, provision each through the admin
        queue (`resources[i]` for VF i+1; defaults otherwise) and bind them to vfio-pci.
        Returns the VFs, VF 1 first. Runs in main-thread mode or in a host task."""
        hf = self._pf(pf)
        platform = self.sriov[hf.name]
        total = platform.total_vfs
        if not isinstance(num_vfs, int) or isinstance(num_vfs, bool) or not 1 <= num_vfs <= total:
            raise SriovError(f"{hf.name}: {num_vfs!r} VFs asked, the PF has 1 .. {total}")
        if resources is not None and len(resources) != num_vfs:
            raise SriovError(f"{hf.name}: {len(resources)} resource sets for {num_vfs} VFs")
        self._check_unassigned(hf)
        res = [VfResources.from_mapping(r) for r in resources] if resources is not None \
            else [default_vf_resources(num_vfs)] * num_vfs
        drv = self.pf_driver(hf)
        drv.sriov_configure(num_vfs)
        if len(platform.vfs) != num_vfs:
            raise SriovError(f"{hf.name}: {num_vfs} VFs configured, {len(platform.vfs)} appeared")
        for n, r in enumerate(res, start=1):
            drv.set_resources(n, r)
        self.tracer.emit("sriov_enabled", pf=hf.name, vfs=num_vfs)
        if bind:
            for vf in platform.vfs:
                self.bind_vfio(vf)
        return list(platform.vfs)

    def _check_unassigned(self, hf: HostPciFunction) -> None:
        busy = [v.name for v in self.sriov[hf.name].vfs
                if v.group is not None and v.group.container is not None]
        if busy:
            raise SriovError(f"{hf.name}: VFs {', '.join(busy)} are assigned to VMs; "
                             "release them (close the VMs) before changing NumVFs")

    def disable_sriov(self, pf: HostPciFunction | str | None = None) -> None:
        """Disable every VF of `pf` (SriovError while one is assigned to a VM)."""
        hf = self._pf(pf)
        self._check_unassigned(hf)
        self.pf_driver(hf).sriov_configure(0)

    def close(self) -> None:
        for k in self.kernels.values():
            k.close()


def default_vf_resources(num_vfs: int) -> VfResources:
    """An equal share of the card's VF memory pool (capped at 64 MiB), weight 1."""
    pool = A.DEFAULT_CARD_MEMORY - A.DEFAULT_PF_MEMORY
    share = min(64 << 20, pool // max(1, num_vfs)) // A.PARTITION_ALIGN * A.PARTITION_ALIGN
    return VfResources(device_memory=share)


def default_card_factory(config: Va1Config | None = None, **options: Any) -> CardFactory:
    """Build device_model.va1.card.Va1Card (the device side of SR-IOV)."""
    def make(ports: DevicePorts, msi: MsiPort, platform: HostSriovPlatform, source: str
             ) -> tuple[PciFunction, object]:
        try:
            from device_model.va1.card import Va1Card
        except ImportError as e:
            raise SriovError(f"device_model.va1.card.Va1Card is not available ({e}); "
                             "pass card_factory=") from None
        card = Va1Card(config or Va1Config(), ports, **options)
        pf = card.physical_function(msi=msi, platform=platform, tracer=ports.tracer)
        return pf, card
    return make


def default_pf_driver_factory(kernel: HostKernelServices, hf: HostPciFunction) -> PfDriver:
    """guest_driver.va1.pf's PF driver, probed on the PF as the host kernel sees it."""
    try:
        from guest_driver.va1 import pf as pfmod
    except ImportError as e:
        raise SriovError(f"guest_driver.va1.pf is not available ({e}); "
                         "set Host.pf_driver_factory") from None
    from guest_driver.pci.config import Bdf, ConfigSpace
    from guest_driver.pci.scan import read_function
    bridge = kernel.pci_hosts[0]
    bdf_ = Bdf(0, hf.slot.bus, hf.slot.dev, hf.slot.fn)
    fn = read_function(ConfigSpace(kernel.mmio, bridge.ecam_base, bdf_), bridge)
    drv = pfmod.probe_pf(kernel, fn, name=f"pf-{format_bdf(hf.requester_id)}", host=bridge)
    return _PfDriverAdapter(drv)


class _PfDriverAdapter:
    """guest_driver.va1.pf.VA1Pf as a PfDriver: set_resources takes a mapping too,
    stats come as a dict."""

    def __init__(self, drv: "VA1Pf") -> None:
        self.drv = drv

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drv, name)

    def sriov_configure(self, num_vfs: int) -> int:
        return int(self.drv.sriov_configure(num_vfs))

    def set_resources(self, vf: int, resources: VfResources | Mapping[str, int]) -> None:
        self.drv.set_resources(vf, VfResources.from_mapping(resources))

    def get_resources(self, vf: int) -> VfResources:
        return self.drv.get_resources(vf)

    def stop(self, vf: int) -> None:
        self.drv.stop(vf)

    def resume(self, vf: int) -> None:
        self.drv.resume(vf)

    def stats(self, vf: int) -> dict[str, int]:
        from dataclasses import asdict
        return {k: int(v) for k, v in asdict(self.drv.stats(vf)).items()}

    def reset_vf(self, vf: int) -> None:
        self.drv.reset_vf(vf)
