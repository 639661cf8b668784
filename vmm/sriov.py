"""The host side of SR-IOV: where a PF's virtual functions live and how they reach memory.

Why: a VA-1 card is one PCIe physical function whose VFs appear when software sets
NumVFs and VF Enable in its SR-IOV capability. The device model creates the VF
functions; the *platform* (this module) decides what they are attached to, exactly as
the PCI core and the IOMMU do on a real host (device_model.pci.api.SriovPlatform):

- VF n (1-based) has requester ID = PF RID + First VF Offset + (n-1) * VF Stride, on
  the PF's PCI segment; its config space answers ECAM there.
- Its DMA goes through the host IOMMU by its own RID (`IommuDma(iommu, rid)`): attached
  to no domain it reaches nothing; bound to VFIO it gets a domain of its own.
- Its MSI-X messages go to the host MSI domain through a port that stamps its RID, so
  interrupt remapping only lets it raise vectors allocated for it.
- Its BARs are not in its own config space (SR-IOV VFs read 0 there): firmware first
  sets the PF's System Page Size to the smallest supported size that is at least the
  host page (as Linux sriov_init does; none: SR-IOV is refused), then sizes the PF's VF
  BARn registers (per-VF size, which the PF pads to a system page), reserves size *
  TotalVFs in the host window and writes the base; VF n's BARn decodes at base +
  (n-1) * size while VF MSE is set in the PF's SR-IOV control register.
- Clearing VF Enable takes every VF off the bus: BARs unmapped, slots emptied, VFIO
  groups dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from device_model import DevicePorts
from device_model.pci.api import PciFunction
from device_model.ports import MsiPort
from hwspec import pci as P
from hwspec import va1 as A
from hwspec.va1 import VfResources

from .errors import VmmError
from .iommu import IommuDma, format_bdf
from .msi import RequesterMsiPort
from .pci.host_bridge import BarWindow, PciError, size_bar_registers

if TYPE_CHECKING:
    from .host import Host, HostPciFunction

ALL_ONES32 = 0xFFFF_FFFF
MAX_EXT_CAPS = (P.CFG_SPACE_EXP_SIZE - P.EXT_CAP_START) // 4


class SriovError(VmmError, ValueError):
    """A bad SR-IOV request to the host (no capability, VF out of range...). Nothing changed."""


class PfDriver(Protocol):
    """The PF management API the host runs in host-kernel context (guest_driver.va1.pf)."""

    def sriov_configure(self, num_vfs: int) -> int: ...

    def set_resources(self, vf: int, resources: VfResources) -> None: ...

    def get_resources(self, vf: int) -> VfResources: ...

    def stop(self, vf: int) -> None: ...

    def resume(self, vf: int) -> None: ...

    def stats(self, vf: int) -> dict[str, int]: ...

    def reset_vf(self, vf: int) -> None: ...


def find_ext_cap(function: PciFunction, cap_id: int) -> int | None:
    """Config offset of extended capability `cap_id` (walk from 0x100, bounded)."""
    off = P.EXT_CAP_START
    for _ in range(MAX_EXT_CAPS):
        header = function.config_read(off, 4)
        if header in (0, ALL_ONES32):
            return None
        if P.ext_cap_id(header) == cap_id:
            return off
        nxt = P.ext_cap_next(header)
        if nxt < P.EXT_CAP_START or nxt == off:
            return None
        off = nxt
    return None


@dataclass(frozen=True)
class VfBar:
    """One VF BAR as firmware sized it in the PF's SR-IOV capability."""
    index: int
    size: int           # per VF
    is_64bit: bool
    prefetchable: bool


def size_vf_bars(function: PciFunction, cap: int) -> list[VfBar]:
    """Size VF BAR0..5 of the SR-IOV capability at `cap` (all-ones, read back, restore)."""
    return [VfBar(*bar) for bar in size_bar_registers(function, cap + P.SRIOV_BAR)]


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class HostSriovPlatform:
    """device_model.pci.api.SriovPlatform of one host PF (see module docstring)."""

    def __init__(self, host: "Host", pf_requester_id: int, pf_name: str) -> None:
        self.host = host
        self.pf_rid = pf_requester_id
        self.pf_name = pf_name
        self.pf: "HostPciFunction | None" = None   # set once the PF is plugged in
        self.cap: int | None = None
        self.vf_bars: list[VfBar] = []
        self.vf_bar_base: dict[int, int] = {}      # VF BAR index -> base firmware assigned
        self.vfs: list["HostPciFunction"] = []
        self._ports: dict[int, tuple[DevicePorts, MsiPort, IommuDma]] = {}
        self._mapped: dict[tuple[int, int], int] = {}  # (vf, bar) -> host address mapped
        self.trace = host.machine.trace.tracer(f"{host.name}.sriov.{format_bdf(pf_requester_id)}")

    # -- the capability as the PF shows it -------------------------------------------

    def _cfg(self, reg: int, size: int) -> int:
        assert self.pf is not None and self.cap is not None
        return self.pf.function.config_read(self.cap + reg, size)

    @property
    def total_vfs(self) -> int:
        return self._cfg(P.SRIOV_TOTAL_VF, 2) if self.cap is not None and self.pf else A.DEFAULT_TOTAL_VFS

    def vf_requester_id(self, vf: int) -> int:
        """PF RID + First VF Offset + (vf-1) * VF Stride (as the capability says now)."""
        if self.pf is None or self.cap is None:
            offset, stride = A.SRIOV_FIRST_VF_OFFSET, A.SRIOV_VF_STRIDE
        else:
            offset, stride = self._cfg(P.SRIOV_VF_OFFSET, 2), self._cfg(P.SRIOV_VF_STRIDE, 2)
        rid = self.pf_rid + offset + (vf - 1) * stride
        if not 0 <= rid <= 0xFFFF:
            raise SriovError(f"VF {vf} of {self.pf_name}: requester ID {rid:#x} is not a BDF")
        return rid

    def attach(self, pf: "HostPciFunction") -> None:
        """The PF is on the bus: find its SR-IOV capability and let firmware place VF BARs."""
        self.pf = pf
        self.cap = find_ext_cap(pf.function, P.EXT_CAP_ID_SRIOV)
        if self.cap is None:
            raise SriovError(f"{pf.name} has no SR-IOV extended capability")
        self.set_page_size(self.host.page_size)
        self.assign_vf_bars()
        self.host.pci.config_hooks[(pf.slot.bus, pf.slot.dev, pf.slot.fn)] = self._pf_config_written

    def set_page_size(self, page_size: int) -> int:
        """System Page Size := the smallest size the PF supports that is >= `page_size`
        (VF BARs then start on host pages, so each can be mapped on its own). Returns
        the size set; SriovError if the PF supports none."""
        assert self.pf is not None and self.cap is not None
        shift = max(0, page_size.bit_length() - 1 - 12)
        usable = self._cfg(P.SRIOV_SUP_PGSIZE, 4) & ~((1 << shift) - 1) & 0xFFFF_FFFF
        if not usable:
            raise SriovError(f"{self.pf_name}: Supported Page Sizes "
                             f"{self._cfg(P.SRIOV_SUP_PGSIZE, 4):#x} has no size >= the "
                             f"host page ({page_size:#x})")
        bit = usable & -usable
        self.pf.function.config_write(self.cap + P.SRIOV_SYS_PGSIZE, 4, bit)
        return 1 << (12 + bit.bit_length() - 1)

    def assign_vf_bars(self) -> dict[int, int]:
        """Firmware: size each VF BAR, reserve size * TotalVFs in the host window, write
        the base into the PF's VF BAR register. Returns {bar index: base}."""
        assert self.pf is not None and self.cap is not None
        f = self.pf.function
        self.vf_bars = size_vf_bars(f, self.cap)
        total = max(1, self.total_vfs)
        for bar in self.vf_bars:
            span = _pow2_ceil(bar.size * total)
            base = self.host.pci.allocate(span, bar.is_64bit)
            reg = self.cap + P.SRIOV_BAR + 4 * bar.index
            f.config_write(reg, 4, base & ALL_ONES32)
            if bar.is_64bit:
                f.config_write(reg + 4, 4, base >> 32)
            self.vf_bar_base[bar.index] = base
            self.trace.emit("vf_bar_assign", bar=bar.index, base=base, size=bar.size, vfs=total)
        return dict(self.vf_bar_base)

    def _read_vf_bar_base(self, bar: VfBar) -> int:
        lo = self._cfg(P.SRIOV_BAR + 4 * bar.index, 4) & P.BASE_ADDRESS_MEM_MASK
        hi = self._cfg(P.SRIOV_BAR + 4 * bar.index + 4, 4) if bar.is_64bit else 0
        return lo | hi << 32

    # -- SriovPlatform ------------------------------------------------------------------

    def vf_ports(self, vf: int) -> tuple[DevicePorts, MsiPort]:
        """DMA through the IOMMU by the VF's RID, the host clock, an MSI port with its RID."""
        if not 1 <= vf <= 0xFFFF:
            raise SriovError(f"VF number {vf} is not 1-based")
        rid = self.vf_requester_id(vf)
        dma = IommuDma(self.host.iommu, rid)
        tracer = self.host.machine.trace.tracer(f"{self.host.name}.{format_bdf(rid)}")
        ports = DevicePorts(dma=dma, clock=self.host.machine.sched, tracer=tracer)
        msi = self.host.msi.port(rid)
        self._ports[vf] = (ports, msi, dma)
        return ports, msi

    def vfs_enabled(self, vfs: Sequence[PciFunction]) -> None:
        """VF Enable went to 1: put VF 1..len(vfs) on the host segment at their RIDs."""
        from .host import HostPciFunction
        if self.vfs:
            self._remove_vfs()
        for n, function in enumerate(vfs, start=1):
            rid = self.vf_requester_id(n)
            if n not in self._ports:
                self.vf_ports(n)
            msi = self._ports[n][1]
            dma = self._ports[n][2]
            name = f"0000:{format_bdf(rid)}"
            bus, dev, fn = rid >> 8, rid >> 3 & 0x1F, rid & 7
            try:
                slot = self.host.pci.add(function, dev, fn, bus, name=name)
            except PciError as e:
                self.trace.emit("vf_add_failed", vf=n, error=str(e))
                continue
            hf = HostPciFunction(name, rid, function, dma, slot,
                                 device=getattr(function, "device", None), pf=self.pf, vf_index=n,
                                 msi=msi if isinstance(msi, RequesterMsiPort) else None)
            self.host.functions[name] = hf
            self.vfs.append(hf)
            self.trace.emit("vf_add", vf=n, rid=format_bdf(rid))
        self.refresh_bars()

    def vfs_disabled(self) -> None:
        """VF Enable went to 0: every VF leaves the bus, its BARs and VFIO group too."""
        self._remove_vfs()
        self._ports.clear()

    def _remove_vfs(self) -> None:
        for hf in reversed(self.vfs):
            n = hf.vf_index or 0
            for bar in self.vf_bars:
                self._unmap(n, bar.index)
            self.host.pci.remove(hf.slot)
            self.host.functions.pop(hf.name, None)
            self.host.drop_vfio(hf)
            self.trace.emit("vf_remove", vf=n, rid=format_bdf(hf.requester_id))
        self.vfs = []

    # -- VF BAR decoding ------------------------------------------------------------------

    def _pf_config_written(self, reg: int, size: int) -> None:
        if self.cap is not None and reg + size > self.cap and reg < self.cap + P.EXT_CAP_SRIOV_SIZEOF:
            self.refresh_bars()

    def _unmap(self, vf: int, index: int) -> None:
        addr = self._mapped.pop((vf, index), None)
        if addr is not None:
            self.host.bus.remove(addr)
            self.trace.emit("vf_bar_unmap", vf=vf, bar=index, address=addr)

    def vf_bar_address(self, vf: int, index: int = 0) -> int | None:
        """Where VF `vf`'s BAR `index` decodes on the host now (None: not decoded)."""
        return self._mapped.get((vf, index))

    def refresh_bars(self) -> None:
        """Map VF n's BARs at base + (n-1) * size while VF MSE is set; unmap otherwise."""
        if self.pf is None or self.cap is None:
            return
        mse = bool(self._cfg(P.SRIOV_CTRL, 2) & P.SRIOV_CTRL_MSE)
        for hf in self.vfs:
            n = hf.vf_index or 0
            for bar in self.vf_bars:
                base = self._read_vf_bar_base(bar)
                want = base + (n - 1) * bar.size if mse and base else None
                have = self._mapped.get((n, bar.index))
                if have == want:
                    continue
                self._unmap(n, bar.index)
                if want is None:
                    continue
                try:
                    self.host.bus.add(want, bar.size, BarWindow(hf.function, bar.index),
                                      name=f"{hf.name}.vf{n}.bar{bar.index}")
                except Exception as e:  # noqa: BLE001 - a conflict is logged, never fatal
                    self.trace.emit("vf_bar_conflict", vf=n, bar=bar.index, address=want,
                                    error=str(e))
                    continue
                self._mapped[(n, bar.index)] = want
                self.trace.emit("vf_bar_map", vf=n, bar=bar.index, address=want, size=bar.size)
