"""The VMM half of VFIO passthrough (what QEMU's vfio-pci does): present an assigned
function to the guest.

Why: the guest must see an ordinary PCI function at addresses its own firmware chose,
with the data path (doorbells, registers) going straight to the device, while the host
keeps everything that could hurt it. So:
- config space is read and written through the VFIO config region (the host driver
  virtualises the BARs, so the guest sees the addresses written by its firmware);
- each BAR's sparse-mmap areas are mmap()ed and mapped into the guest as direct bus
  regions (no exit); the rest of the BAR, i.e. the MSI-X table and PBA pages, traps;
- the MSI-X table the guest sees is emulated here. When the guest enables MSI-X, every
  vector gets an eventfd (os.eventfd), handed to the host driver with SET_IRQS and
  assigned as an irqfd: a signal injects the MSI the guest wrote in table entry i,
  unless the guest masked it (entry mask bit or MASKALL), in which case it is pending
  in the emulated PBA and injected when unmasked.
"""
from __future__ import annotations

import errno
import os
from typing import Callable, Sequence

import numpy as np

from device_model.pci.api import BarInfo, MsixInfo
from hwspec import pci as P

from ..eventfd import IrqfdRegistry, new_eventfd
from ..irq import InterruptController
from ..pci.host_bridge import BarRegion, BarWindow
from ..trace import SourceTracer
from . import uapi
from .group import VfioDeviceFile
from .pci_device import SparseArea, find_capability, region_offset
from .uapi import CData

CONFIG = uapi.VFIO_PCI_CONFIG_REGION_INDEX


def query_region(devfile: VfioDeviceFile, index: int) -> tuple[int, int, int, list[SparseArea]]:
    """GET_REGION_INFO with the capability chain: (size, flags, offset, sparse areas).
    Asks twice when the first buffer is too small, as QEMU does."""
    argsz = uapi.ffi.sizeof("struct vfio_region_info")
    for _ in range(2):
        buf: CData = uapi.ffi.new("uint8_t[]", argsz)
        info: CData = uapi.ffi.cast("struct vfio_region_info *", buf)
        info.argsz = argsz
        info.index = index
        devfile.get_region_info(info)
        if info.argsz > argsz:
            argsz = int(info.argsz)
            continue
        areas: list[SparseArea] = []
        off = int(info.cap_offset) if info.flags & uapi.VFIO_REGION_INFO_FLAG_CAPS else 0
        while off:
            hdr: CData = uapi.ffi.cast("struct vfio_info_cap_header *", buf + off)
            if hdr.id == uapi.VFIO_REGION_INFO_CAP_SPARSE_MMAP:
                cap: CData = uapi.ffi.cast("struct vfio_region_info_cap_sparse_mmap *",
                                           buf + off)
                areas = [SparseArea(int(cap.areas[i].offset), int(cap.areas[i].size))
                         for i in range(cap.nr_areas)]
            off = int(hdr.next)
        if not areas and info.flags & uapi.VFIO_REGION_INFO_FLAG_MMAP and info.size:
            areas = [SparseArea(0, int(info.size))]
        return int(info.size), int(info.flags), int(info.offset), areas
    raise OSError(errno.EINVAL, f"region {index}: info buffer size did not settle")


def set_irqs(devfile: VfioDeviceFile, flags: int, index: int, start: int, values: Sequence[int],
             count: int | None = None) -> None:
    """Build a `struct vfio_irq_set` (s32 fds for DATA_EVENTFD, u8 for DATA_BOOL)."""
    n = len(values) if count is None else count
    if flags & uapi.VFIO_IRQ_SET_DATA_EVENTFD:
        data = np.asarray(values, dtype="<i4").tobytes()
    elif flags & uapi.VFIO_IRQ_SET_DATA_BOOL:
        data = bytes(int(bool(v)) for v in values)
    else:
        data = b""
    s = uapi.new("struct vfio_irq_set *", {"data": max(len(data), 1)})
    s.argsz = uapi.offsetofend("vfio_irq_set", "count") + len(data)
    s.flags, s.index, s.start, s.count = flags, index, start, n
    if data:
        uapi.ffi.buffer(s.data, len(data))[:] = data
    devfile.set_irqs(s)


class VfioPciPassthrough:
    """A PciFunction (plus bar_regions) for the VM's host bridge, backed by a VFIO
    device file."""

    def __init__(self, devfile: VfioDeviceFile, chip: InterruptController, irqfd: IrqfdRegistry,
                 tracer: SourceTracer) -> None:
        self.devfile = devfile
        self.chip = chip
        self.irqfd = irqfd
        self.trace = tracer
        info = uapi.new("struct vfio_device_info *")
        devfile.get_info(info)
        if not info.flags & uapi.VFIO_DEVICE_FLAGS_PCI:
            raise OSError(errno.EINVAL, f"{devfile.name}: not a vfio-pci device")
        self.regions: dict[int, tuple[int, int, int, list[SparseArea]]] = {}
        for index in range(min(int(info.num_regions), uapi.VFIO_PCI_NUM_REGIONS)):
            self.regions[index] = query_region(devfile, index)
        irq = uapi.new("struct vfio_irq_info *")
        irq.index = uapi.VFIO_PCI_MSIX_IRQ_INDEX
        devfile.get_irq_info(irq)
        self.msix_count = int(irq.count)
        self._bars = self._read_bars()
        self.msix_cap = find_capability(self, P.CAP_ID_MSIX)
        self._msix = self._read_msix()
        n = self._msix.count if self._msix else 0
        self.table = bytearray(n * P.MSIX_ENTRY_SIZE)
        for i in range(n):
            self.table[i * 16 + P.MSIX_ENTRY_VECTOR_CTRL] = P.MSIX_ENTRY_CTRL_MASKBIT
        self.pending: set[int] = set()
        self.enabled = False
        self.maskall = False
        self._fds: list[int] = []
        self.injected = 0

    # -- discovery ----------------------------------------------------------------------

    def _read_bars(self) -> tuple[BarInfo, ...]:
        bars = []
        for i in range(P.NUM_BARS):
            size = self.regions.get(i, (0, 0, 0, []))[0]
            if not size:
                continue
            lo = self.config_read(P.BASE_ADDRESS_0 + 4 * i, 4)
            bars.append(BarInfo(i, size, lo & P.BASE_ADDRESS_MEM_TYPE_MASK == P.BASE_ADDRESS_MEM_TYPE_64,
                                bool(lo & P.BASE_ADDRESS_MEM_PREFETCH)))
        return tuple(bars)

    def _read_msix(self) -> MsixInfo | None:
        if self.msix_cap is None or not self.msix_count:
            return None
        table = self.config_read(self.msix_cap + P.MSIX_TABLE, 4)
        pba = self.config_read(self.msix_cap + P.MSIX_PBA, 4)
        qsize = (self.config_read(self.msix_cap + P.MSIX_FLAGS, 2) & P.MSIX_FLAGS_QSIZE) + 1
        return MsixInfo(qsize, table & P.MSIX_TABLE_BIR, table & P.MSIX_TABLE_OFFSET,
                        pba & P.MSIX_PBA_BIR, pba & P.MSIX_PBA_OFFSET)

    # -- PciFunction ----------------------------------------------------------------------

    def config_read(self, offset: int, size: int) -> int:
        try:
            return int.from_bytes(self.devfile.region_read(CONFIG, offset, size), "little")
        except OSError:
            return (1 << (8 * size)) - 1 if size in (1, 2, 4) else 0xFFFF_FFFF

    def config_write(self, offset: int, size: int, value: int) -> None:
        if size not in (1, 2, 4):
            return
        try:
            self.devfile.region_write(CONFIG, offset, (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little"))
        except OSError:
            return
        if self.msix_cap is not None:
            flags = self.msix_cap + P.MSIX_FLAGS
            if offset < flags + 2 and flags < offset + size:
                self._msix_control_changed()

    def bars(self) -> tuple[BarInfo, ...]:
        return self._bars

    def msix_info(self) -> MsixInfo | None:
        return self._msix

    def function_level_reset(self) -> None:
        self.devfile.reset()

    def _in_table(self, index: int, offset: int, size: int) -> int | None:
        m = self._msix
        if m is None or index != m.table_bar:
            return None
        rel = offset - m.table_offset
        if 0 <= rel and rel + size <= m.count * P.MSIX_ENTRY_SIZE:
            return rel
        return None

    def _in_pba(self, index: int, offset: int, size: int) -> int | None:
        m = self._msix
        if m is None or index != m.pba_bar:
            return None
        rel = offset - m.pba_offset
        if 0 <= rel and rel + size <= 8 * (-(-m.count // 64)):
            return rel
        return None

    def bar_read(self, index: int, offset: int, size: int) -> int:
        rel = self._in_table(index, offset, size)
        if rel is not None:
            return int.from_bytes(self.table[rel:rel + size], "little")
        rel = self._in_pba(index, offset, size)
        if rel is not None:
            bits = sum(1 << v for v in self.pending)
            return (bits >> (8 * rel)) & ((1 << (8 * size)) - 1)
        try:
            return int.from_bytes(self.devfile.region_read(index, offset, size), "little")
        except OSError:
            return (1 << (8 * size)) - 1

    def bar_write(self, index: int, offset: int, size: int, value: int) -> None:
        rel = self._in_table(index, offset, size)
        if rel is not None:
            self.table[rel:rel + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
            self.trace.emit("msix_table_write", entry=rel // 16, field=rel % 16, value=value)
            self._maybe_deliver(rel // 16)
            return
        if self._in_pba(index, offset, size) is not None:
            return  # the PBA is read-only
        try:
            self.devfile.region_write(index, offset, (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little"))
        except OSError:
            return

    def bar_regions(self, index: int) -> Sequence[BarRegion]:
        """Sparse-mmap areas mapped direct, the gaps (MSI-X table and PBA) trapped."""
        size, _, _, areas = self.regions.get(index, (0, 0, 0, []))
        out: list[BarRegion] = []
        pos = 0
        for a in sorted(areas, key=lambda a: a.offset):
            if a.offset > pos:
                out.append(BarRegion(pos, a.offset - pos, BarWindow(self, index, pos)))
            mapping = self.devfile.region_mmap(index, a.offset, a.size)
            if isinstance(mapping, np.ndarray):
                # Plain memory, not registers: the bus maps handlers only, so this area
                # is trapped like the gaps (QEMU's slow path when it cannot map a BAR).
                out.append(BarRegion(a.offset, a.size, BarWindow(self, index, a.offset)))
            else:
                out.append(BarRegion(a.offset, a.size, mapping, direct=True))
            pos = a.offset + a.size
        if pos < size:
            out.append(BarRegion(pos, size - pos, BarWindow(self, index, pos)))
        return out

    # -- MSI-X routing --------------------------------------------------------------------

    def _entry(self, i: int) -> tuple[int, int, bool]:
        e = self.table[i * 16:(i + 1) * 16]
        addr = int.from_bytes(e[0:8], "little")
        data = int.from_bytes(e[8:12], "little")
        masked = bool(e[12] & P.MSIX_ENTRY_CTRL_MASKBIT)
        return addr, data, masked

    def _inject(self, i: int) -> None:
        addr, data, masked = self._entry(i)
        if masked or self.maskall or not self.enabled:
            self.pending.add(i)
            self.trace.emit("msix_pending", entry=i)
            return
        self.injected += 1
        self.trace.emit("msix_inject", entry=i, address=addr, data=data)
        self.chip.deliver_msi(addr, data)

    def _maybe_deliver(self, i: int) -> None:
        if i in self.pending and self.enabled and not self.maskall and not self._entry(i)[2]:
            self.pending.discard(i)
            self._inject(i)

    def _injector(self, i: int) -> Callable[[], None]:
        return lambda: self._inject(i)

    def _msix_control_changed(self) -> None:
        flags = self.config_read(self.msix_cap + P.MSIX_FLAGS, 2)  # type: ignore[operator]
        enable = bool(flags & P.MSIX_FLAGS_ENABLE)
        self.maskall = bool(flags & P.MSIX_FLAGS_MASKALL)
        if enable and not self.enabled and self._msix is not None:
            self._fds = [new_eventfd() for _ in range(self._msix.count)]
            for i, fd in enumerate(self._fds):
                self.irqfd.assign(fd, self._injector(i))
            set_irqs(self.devfile, uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_TRIGGER,
                     uapi.VFIO_PCI_MSIX_IRQ_INDEX, 0, self._fds)
            self.enabled = True
            self.trace.emit("msix_enable", vectors=len(self._fds))
        elif not enable and self.enabled:
            self._teardown()
        if self.enabled and not self.maskall:
            for i in sorted(self.pending):
                self._maybe_deliver(i)

    def _teardown(self) -> None:
        if self.enabled and not self.devfile.closed:
            set_irqs(self.devfile, uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_TRIGGER,
                     uapi.VFIO_PCI_MSIX_IRQ_INDEX, 0, [], count=0)
        for fd in self._fds:
            self.irqfd.deassign(fd)
            os.close(fd)
        self._fds = []
        self.enabled = False
        self.trace.emit("msix_disable")

    def close(self) -> None:
        """Detach: interrupts off, eventfds closed, the device file released."""
        if self.enabled:
            self._teardown()
        self.devfile.close()


__all__ = ["VfioPciPassthrough", "query_region", "set_irqs", "region_offset"]
