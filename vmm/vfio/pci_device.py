"""vfio-pci for one PCI function: the host driver behind a VFIO device fd.

Why: this is the kernel half of passthrough. It lets an untrusted user (the VMM, on a
guest's behalf) drive a physical function without being able to break the host: config
space is virtualised where it matters, the MSI-X table is never reachable (the host
programs it with host vectors), interrupts come out as eventfd signals, and DMA is
confined by the container's IOMMU domain (not here: the function's DmaPort already
goes through it).

linux/vfio.h semantics (drivers/vfio/pci/vfio_pci_core.c, vfio_pci_config.c,
vfio_pci_intrs.c), with these choices:
- Regions: BAR0-5 (index = BAR number; the upper half of a 64-bit BAR has size 0),
  ROM and VGA of size 0, CONFIG (4 KiB when the function has PCIe caps). Region offsets
  are index << 40 (VFIO_PCI_OFFSET_SHIFT). A memory BAR is READ|WRITE|MMAP; the BAR
  holding the MSI-X table also has CAPS with a SPARSE_MMAP capability listing the BAR
  minus the page(s) of the MSI-X table and PBA. Region reads and writes of the table
  and PBA pages read all-ones and drop writes (the kernel protects them too).
- Config region: BARs are virtual (the user's writes land in a virtual copy, sizing
  with all-ones works against the real size, the physical BARs keep the host's
  addresses); the ROM BAR reads 0; the MSI-X ENABLE and MASKALL bits are virtual (the
  host enables MSI-X itself at SET_IRQS); a write of PCIe DEVCTL.BCR_FLR resets the
  function (as VFIO_DEVICE_RESET); everything else passes through.
- IRQs: only MSI-X (index 2) has vectors: count = table size, flags EVENTFD | MASKABLE
  | NORESIZE. INTx, MSI, ERR and REQ report count 0 (this host driver does not offer
  them), so SET_IRQS on them is EINVAL.
- SET_IRQS (MSI-X): TRIGGER+EVENTFD enables MSI-X with start+count vectors on first use
  (then any subrange of those; fd -1 clears a trigger), TRIGGER+DATA_NONE with count 0
  disables, TRIGGER+NONE/BOOL with count > 0 fires the triggers (loopback, for
  testing), MASK/UNMASK (NONE or BOOL) set the physical per-vector mask bit. Bad
  argsz, flags, index, start or count: EINVAL naming the field; an fd that is not an
  eventfd: EBADF. A failed call changes nothing.
- RESET: function-level reset, then the host restores what it owns (BARs, COMMAND,
  the MSI-X table with host messages and the enable bit), as pci_try_reset_function
  saves and restores config state around the FLR.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from device_model.pci.api import BarInfo, MsixInfo, PciFunction
from guest_driver.kernel import MsiMessage
from hwspec import pci as P

from device_model.ports import Tracer

from ..eventfd import EventfdWaitQueues, is_eventfd
from ..iommu import PAGE_SIZE
from . import uapi
from .container import _check_argsz, _check_index, _expect, vfio_error
from .uapi import CData

VFIO_PCI_OFFSET_SHIFT = 40
ALL_ONES32 = 0xFFFF_FFFF
BAR_END = P.BASE_ADDRESS_0 + 4 * P.NUM_BARS
ROM_ADDRESS = 0x30
MSIX_VIRT_BITS = P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL


def region_offset(index: int) -> int:
    """VFIO_PCI_INDEX_TO_OFFSET."""
    return index << VFIO_PCI_OFFSET_SHIFT


def _page_down(x: int) -> int:
    return x & ~(PAGE_SIZE - 1)


def _page_up(x: int) -> int:
    return -(-x // PAGE_SIZE) * PAGE_SIZE


def find_capability(function: PciFunction, cap_id: int) -> int | None:
    """Offset of the first standard capability `cap_id`, walking the list (bounded)."""
    if not function.config_read(P.STATUS, 2) & P.STATUS_CAP_LIST:
        return None
    ptr = function.config_read(P.CAPABILITY_LIST, 1) & 0xFC
    for _ in range(48):
        if ptr < 0x40:
            return None
        if function.config_read(ptr + P.CAP_LIST_ID, 1) == cap_id:
            return ptr
        ptr = function.config_read(ptr + P.CAP_LIST_NEXT, 1) & 0xFC
    return None


@dataclass(frozen=True)
class SparseArea:
    offset: int
    size: int


def _indexed_request(arg: CData, struct: str, minsz_field: str, name: str,
                     count: int) -> tuple[CData, int]:
    """The struct behind `arg` and its `index`, after the argsz and index checks of an
    info ioctl (EINVAL if argsz ends before `minsz_field` or index >= `count`)."""
    s = _expect(arg, struct)
    _check_argsz(s, struct, minsz_field, name)
    index = int(s.index)
    _check_index(name, index, count)
    return s, index


class BarMapping:
    """What mmap() of a BAR area gives the VMM: loads and stores that reach the device
    registers with no one in between (an MmioHandler, offsets from the area start)."""

    def __init__(self, function: PciFunction, index: int, offset: int, size: int) -> None:
        self.function = function
        self.index = index
        self.offset = offset
        self.size = size

    def read(self, offset: int, size: int) -> int:
        return self.function.bar_read(self.index, self.offset + offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.function.bar_write(self.index, self.offset + offset, size, value)


class VfioPciDevice:
    """Implements vmm.vfio.device_api.VfioDevice for one PciFunction."""

    def __init__(self, function: PciFunction, host_msi: "HostMsi", eventfds: EventfdWaitQueues,
                 name: str, tracer: Tracer, requester_id: int | None = None,
                 virtfn_ids: tuple[int, int] | None = None) -> None:
        """`virtfn_ids` = (vendor, device) makes this an SR-IOV VF's device: as Linux's
        vfio-pci does for a VF, the Vendor/Device ID (0xFFFF in a VF's config space)
        read the PF's vendor and VF Device ID, and Command.Memory Space (hardwired 0 in a
        VF: the PF's VF MSE decodes its BARs) is a virtual bit the user may set."""
        self.function = function
        self.requester_id = requester_id
        self.virtfn_ids = virtfn_ids
        self._vmem = 0
        self.host_msi = host_msi
        self.eventfds = eventfds
        self.name = name
        self.trace = tracer
        self._bars: dict[int, BarInfo] = {b.index: b for b in function.bars()}
        self._bar_flags: dict[int, int] = {}
        self._bar_dword: dict[int, tuple[int, str]] = {}  # BAR register -> (bar index, lo|hi)
        for b in self._bars.values():
            flags = function.config_read(P.BASE_ADDRESS_0 + 4 * b.index, 4) & 0xF
            if flags == 0:  # an SR-IOV VF: its BAR registers read 0; describe the BAR itself
                flags = (P.BASE_ADDRESS_MEM_TYPE_64 if b.is_64bit else 0) \
                    | (P.BASE_ADDRESS_MEM_PREFETCH if b.prefetchable else 0)
            self._bar_flags[b.index] = flags
            self._bar_dword[b.index] = (b.index, "lo")
            if b.is_64bit:
                self._bar_dword[b.index + 1] = (b.index, "hi")
        self._vbar = [0] * P.NUM_BARS
        self.msix: MsixInfo | None = function.msix_info()
        self.msix_cap = find_capability(function, P.CAP_ID_MSIX)
        self.exp_cap = find_capability(function, P.CAP_ID_EXP)
        self._vmsix_flags = 0
        self.config_size = P.CFG_SPACE_EXP_SIZE if self.exp_cap is not None else P.CFG_SPACE_SIZE
        # MSI-X state owned by the host driver
        self.msix_enabled = 0                     # vectors enabled (0: off)
        self._host_msgs: list[MsiMessage] = []
        self._triggers: dict[int, int] = {}       # vector -> eventfd
        self._masked: set[int] = set()
        self.resets = 0
        self.host_irqs = 0

    # -- layout -----------------------------------------------------------------------

    def _protected(self, index: int) -> list[tuple[int, int]]:
        """Page-rounded [start, end) ranges of BAR `index` holding the MSI-X table/PBA."""
        m = self.msix
        if m is None:
            return []
        out = []
        if m.table_bar == index:
            out.append((_page_down(m.table_offset),
                        _page_up(m.table_offset + m.count * P.MSIX_ENTRY_SIZE)))
        if m.pba_bar == index:
            out.append((_page_down(m.pba_offset), _page_up(m.pba_offset + 8 * (-(-m.count // 64)))))
        out.sort()
        merged: list[tuple[int, int]] = []
        for s, e in out:
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
            else:
                merged.append((s, e))
        return merged

    def sparse_areas(self, index: int) -> list[SparseArea]:
        """The mmap-able areas of BAR `index` (all of it, minus MSI-X pages)."""
        bar = self._bars.get(index)
        if bar is None:
            return []
        areas, pos = [], 0
        for s, e in self._protected(index):
            if s > pos:
                areas.append(SparseArea(pos, s - pos))
            pos = max(pos, e)
        if pos < bar.size:
            areas.append(SparseArea(pos, bar.size - pos))
        return areas

    def _region_size(self, index: int) -> int:
        if index in self._bars:
            return self._bars[index].size
        if index == uapi.VFIO_PCI_CONFIG_REGION_INDEX:
            return self.config_size
        return 0

    # -- VfioDevice: info ---------------------------------------------------------------

    def get_info(self, info: CData) -> None:
        s = _expect(info, "vfio_device_info")
        _check_argsz(s, "vfio_device_info", "num_irqs", "VFIO_DEVICE_GET_INFO")
        s.flags = uapi.VFIO_DEVICE_FLAGS_PCI | uapi.VFIO_DEVICE_FLAGS_RESET
        s.num_regions = uapi.VFIO_PCI_NUM_REGIONS
        s.num_irqs = uapi.VFIO_PCI_NUM_IRQS
        if s.argsz >= uapi.offsetofend("vfio_device_info", "cap_offset"):
            s.cap_offset = 0

    def get_region_info(self, info: CData) -> None:
        s, index = _indexed_request(info, "vfio_region_info", "offset",
                                    "VFIO_DEVICE_GET_REGION_INFO", uapi.VFIO_PCI_NUM_REGIONS)
        size = self._region_size(index)
        flags = 0
        if size:
            flags = uapi.VFIO_REGION_INFO_FLAG_READ | uapi.VFIO_REGION_INFO_FLAG_WRITE
            if index in self._bars:
                flags |= uapi.VFIO_REGION_INFO_FLAG_MMAP
        cap = b""
        if index in self._bars and self._protected(index):
            areas = self.sparse_areas(index)
            hdr: CData = uapi.ffi.new("struct vfio_region_info_cap_sparse_mmap *",
                                      {"areas": len(areas)})
            hdr.header.id = uapi.VFIO_REGION_INFO_CAP_SPARSE_MMAP
            hdr.header.version = 1
            hdr.header.next = 0
            hdr.nr_areas = len(areas)
            for i, a in enumerate(areas):
                hdr.areas[i].offset = a.offset
                hdr.areas[i].size = a.size
            cap = bytes(uapi.ffi.buffer(hdr, uapi.ffi.sizeof(hdr[0])))
            flags |= uapi.VFIO_REGION_INFO_FLAG_CAPS
        base = uapi.ffi.sizeof("struct vfio_region_info")
        s.flags = flags
        s.size = size
        s.offset = region_offset(index)
        s.cap_offset = 0
        if cap:
            if s.argsz < base + len(cap):
                s.argsz = base + len(cap)  # ask for a bigger buffer, as the kernel does
            else:
                ptr = uapi.ffi.cast("uint8_t *", uapi.ffi.addressof(s))
                uapi.ffi.buffer(ptr + base, len(cap))[:] = cap
                s.cap_offset = base

    def get_irq_info(self, info: CData) -> None:
        s, index = _indexed_request(info, "vfio_irq_info", "count",
                                    "VFIO_DEVICE_GET_IRQ_INFO", uapi.VFIO_PCI_NUM_IRQS)
        s.flags = uapi.VFIO_IRQ_INFO_EVENTFD | uapi.VFIO_IRQ_INFO_NORESIZE
        if index == uapi.VFIO_PCI_MSIX_IRQ_INDEX:
            s.flags |= uapi.VFIO_IRQ_INFO_MASKABLE
        s.count = self._irq_count(index)

    def _irq_count(self, index: int) -> int:
        if index == uapi.VFIO_PCI_MSIX_IRQ_INDEX and self.msix is not None and self.msix_cap is not None:
            return self.msix.count
        return 0

    # -- VfioDevice: SET_IRQS -------------------------------------------------------------

    def set_irqs(self, irq_set: CData) -> None:
        s = _expect(irq_set, "vfio_irq_set")
        name = "VFIO_DEVICE_SET_IRQS"
        minsz = _check_argsz(s, "vfio_irq_set", "count", name)
        flags = int(s.flags)
        known = uapi.VFIO_IRQ_SET_DATA_TYPE_MASK | uapi.VFIO_IRQ_SET_ACTION_TYPE_MASK
        data_type = flags & uapi.VFIO_IRQ_SET_DATA_TYPE_MASK
        action = flags & uapi.VFIO_IRQ_SET_ACTION_TYPE_MASK
        if flags & ~known or bin(data_type).count("1") != 1 or bin(action).count("1") != 1:
            raise vfio_error(errno.EINVAL, f"{name}: flags {flags:#x} must be one DATA_* and one "
                                           "ACTION_* bit")
        index, start, count = int(s.index), int(s.start), int(s.count)
        _check_index(name, index, uapi.VFIO_PCI_NUM_IRQS)
        max_count = self._irq_count(index)
        if max_count == 0:
            raise vfio_error(errno.EINVAL, f"{name}: index {index} has no interrupts on this "
                                           "device (only MSI-X, index 2)")
        if start >= max_count:
            raise vfio_error(errno.EINVAL, f"{name}: start {start} is beyond the {max_count} "
                                           f"vectors of index {index}")
        if start + count > max_count:
            raise vfio_error(errno.EINVAL, f"{name}: start {start} + count {count} exceeds the "
                                           f"{max_count} vectors of index {index}")
        elem = {uapi.VFIO_IRQ_SET_DATA_NONE: 0, uapi.VFIO_IRQ_SET_DATA_BOOL: 1,
                uapi.VFIO_IRQ_SET_DATA_EVENTFD: 4}[data_type]
        if s.argsz - minsz < count * elem:
            raise vfio_error(errno.EINVAL, f"{name}: argsz {s.argsz} holds less than count {count} "
                                           f"x {elem}-byte data")
        raw = bytes(uapi.ffi.buffer(s.data, count * elem)) if elem and count else b""
        if elem == 4:
            values = [int(v) for v in np.frombuffer(raw, dtype="<i4")]
        elif elem == 1:
            values = [int(v) for v in raw]
        else:
            values = [1] * count
        if action == uapi.VFIO_IRQ_SET_ACTION_TRIGGER:
            self._set_trigger(data_type, start, count, values)
        else:
            self._set_mask(action == uapi.VFIO_IRQ_SET_ACTION_MASK, data_type, start, count, values)

    def _set_trigger(self, data_type: int, start: int, count: int, values: list[int]) -> None:
        name = "VFIO_DEVICE_SET_IRQS"
        if data_type == uapi.VFIO_IRQ_SET_DATA_NONE and count == 0:
            self._msix_disable()
            return
        if data_type != uapi.VFIO_IRQ_SET_DATA_EVENTFD:
            for i, v in zip(range(start, start + count), values):
                if v and i in self._triggers:
                    self.eventfds.signal(self._triggers[i])
            return
        for fd in values:
            if fd < -1 or (fd >= 0 and not _is_eventfd(fd)):
                raise vfio_error(errno.EBADF, f"{name}: fd {fd} is not an eventfd")
        if self.msix_enabled and start + count > self.msix_enabled:
            raise vfio_error(errno.EINVAL, f"{name}: MSI-X is enabled with {self.msix_enabled} "
                                           f"vectors; start {start} + count {count} exceeds them "
                                           "(NORESIZE: disable first)")
        if not self.msix_enabled:
            self._msix_enable(start + count)
        for i, fd in zip(range(start, start + count), values):
            if fd < 0:
                self._triggers.pop(i, None)
            else:
                self._triggers[i] = fd
        self.trace.emit("set_irqs", start=start, count=count, triggers=len(self._triggers))

    def _set_mask(self, mask: bool, data_type: int, start: int, count: int, values: list[int]) -> None:
        name = "VFIO_DEVICE_SET_IRQS"
        what = "MASK" if mask else "UNMASK"
        if data_type == uapi.VFIO_IRQ_SET_DATA_EVENTFD:
            raise vfio_error(errno.EINVAL, f"{name}: ACTION_{what} takes DATA_NONE or DATA_BOOL for MSI-X")
        if not self.msix_enabled:
            raise vfio_error(errno.EINVAL, f"{name}: ACTION_{what}: MSI-X is not enabled")
        if start + count > self.msix_enabled:
            raise vfio_error(errno.EINVAL, f"{name}: ACTION_{what}: start {start} + count {count} "
                                           f"exceeds the {self.msix_enabled} enabled vectors")
        for i, v in zip(range(start, start + count), values):
            if not v:
                continue
            if mask:
                self._masked.add(i)
            else:
                self._masked.discard(i)
            self._write_ctrl(i)

    # -- physical MSI-X ---------------------------------------------------------------------

    def _table_write(self, vector: int, field: int, value: int) -> None:
        """Write the physical table, with memory decoding on for the write even if the
        user turned it off (vfio_pci_memory_lock_and_enable)."""
        assert self.msix is not None
        cmd = self.function.config_read(P.COMMAND, 2)
        if not cmd & P.COMMAND_MEMORY:
            self.function.config_write(P.COMMAND, 2, cmd | P.COMMAND_MEMORY)
        self.function.bar_write(self.msix.table_bar,
                                self.msix.table_offset + vector * P.MSIX_ENTRY_SIZE + field, 4, value)
        if not cmd & P.COMMAND_MEMORY:
            self.function.config_write(P.COMMAND, 2, cmd)

    def _write_ctrl(self, vector: int) -> None:
        self._table_write(vector, P.MSIX_ENTRY_VECTOR_CTRL,
                          P.MSIX_ENTRY_CTRL_MASKBIT if vector in self._masked else 0)

    def _program_table(self) -> None:
        for i, msg in enumerate(self._host_msgs):
            self._table_write(i, P.MSIX_ENTRY_VECTOR_CTRL, P.MSIX_ENTRY_CTRL_MASKBIT)
            self._table_write(i, P.MSIX_ENTRY_LOWER_ADDR, msg.address & ALL_ONES32)
            self._table_write(i, P.MSIX_ENTRY_UPPER_ADDR, msg.address >> 32)
            self._table_write(i, P.MSIX_ENTRY_DATA, msg.data)
            self._write_ctrl(i)

    def _phys_msix_flags(self, set_bits: int, clear_bits: int) -> None:
        assert self.msix_cap is not None
        off = self.msix_cap + P.MSIX_FLAGS
        v = self.function.config_read(off, 2)
        self.function.config_write(off, 2, (v | set_bits) & ~clear_bits & 0xFFFF)

    def _msix_enable(self, nvec: int) -> None:
        self._host_msgs = [self.host_msi.alloc(self._host_irq_cb(i), f"vfio-msix[{i}]({self.name})",
                                               self.requester_id)
                           for i in range(nvec)]
        self._masked.clear()
        self._phys_msix_flags(P.MSIX_FLAGS_MASKALL, 0)
        self._phys_msix_flags(P.MSIX_FLAGS_ENABLE, 0)
        self._program_table()
        self._phys_msix_flags(0, P.MSIX_FLAGS_MASKALL)
        self.msix_enabled = nvec
        self.trace.emit("msix_enable", vectors=nvec)

    def _msix_disable(self) -> None:
        if not self.msix_enabled:
            return
        self._phys_msix_flags(0, P.MSIX_FLAGS_ENABLE)
        for msg in self._host_msgs:
            self.host_msi.free(msg)
        self._host_msgs = []
        self._triggers.clear()
        self._masked.clear()
        self.msix_enabled = 0
        self.trace.emit("msix_disable")

    def _host_irq_cb(self, vector: int) -> Callable[[], None]:
        def cb() -> None:
            self.host_irqs += 1
            fd = self._triggers.get(vector)
            if fd is not None:
                self.eventfds.signal(fd)
        return cb

    # -- RESET ------------------------------------------------------------------------------

    def reset(self) -> None:
        f = self.function
        saved = [(reg, f.config_read(reg, 4)) for reg in range(P.BASE_ADDRESS_0, BAR_END, 4)]
        cmd = f.config_read(P.COMMAND, 2)
        self.trace.emit("reset", name=self.name)
        f.function_level_reset()
        self.resets += 1
        for reg, v in saved:
            f.config_write(reg, 4, v)
        f.config_write(P.COMMAND, 2, cmd)  # memory decoding first: the table is in a BAR
        if self.msix_enabled:
            self._phys_msix_flags(P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL, 0)
            self._program_table()
            self._phys_msix_flags(0, P.MSIX_FLAGS_MASKALL)

    def close_device(self) -> None:
        """The last device fd closed (vfio_pci_core_close_device): interrupts off, host
        vectors freed, and a reset, so the function does no DMA for a user that is gone."""
        self._msix_disable()
        self._vmsix_flags = 0
        self._vbar = [0] * P.NUM_BARS
        self._vmem = 0
        self.reset()

    # -- regions ----------------------------------------------------------------------------

    def _check_range(self, what: str, index: int, offset: int, length: int) -> None:
        size = self._region_size(index)
        if index >= uapi.VFIO_PCI_NUM_REGIONS or size == 0:
            raise vfio_error(errno.EINVAL, f"{what}: region {index} does not exist on {self.name}")
        if offset < 0 or length < 0 or offset + length > size:
            raise vfio_error(errno.EINVAL, f"{what}: [{offset:#x}, +{length:#x}) is outside region "
                                           f"{index} ({size:#x} bytes)")

    def region_read(self, index: int, offset: int, length: int) -> bytes:
        self._check_range("read", index, offset, length)
        out = bytearray()
        for off, size in _chunks(offset, length):
            if index == uapi.VFIO_PCI_CONFIG_REGION_INDEX:
                v = self._cfg_read(off, size)
            elif self._in_protected(index, off, size):
                v = (1 << (8 * size)) - 1
            else:
                v = self.function.bar_read(index, off, size)
            out += int(v).to_bytes(size, "little")
        return bytes(out)

    def region_write(self, index: int, offset: int, data: bytes) -> None:
        data = bytes(data)
        self._check_range("write", index, offset, len(data))
        pos = 0
        for off, size in _chunks(offset, len(data)):
            v = int.from_bytes(data[pos:pos + size], "little")
            pos += size
            if index == uapi.VFIO_PCI_CONFIG_REGION_INDEX:
                self._cfg_write(off, size, v)
            elif not self._in_protected(index, off, size):
                self.function.bar_write(index, off, size, v)

    def region_mmap(self, index: int, offset: int, length: int) -> BarMapping:
        """mmap() of a BAR area listed in its sparse areas (all of it when it has no
        MSI-X pages); EINVAL elsewhere."""
        what = "mmap"
        if index not in self._bars:
            raise vfio_error(errno.EINVAL, f"{what}: region {index} is not a mappable BAR")
        if length <= 0 or (offset | length) & (PAGE_SIZE - 1):
            raise vfio_error(errno.EINVAL, f"{what}: offset {offset:#x} and length {length:#x} "
                                           "must be page-aligned and non-zero")
        for a in self.sparse_areas(index):
            if a.offset <= offset and offset + length <= a.offset + a.size:
                return BarMapping(self.function, index, offset, length)
        raise vfio_error(errno.EINVAL, f"{what}: BAR{index} [{offset:#x}, +{length:#x}) is not inside "
                                       "an mmap-able area (the MSI-X table and PBA pages are not)")

    def _in_protected(self, index: int, off: int, size: int) -> bool:
        return any(s < off + size and off < e for s, e in self._protected(index))

    # -- config virtualisation ------------------------------------------------------------------

    def _virt_dword(self, reg: int) -> int:
        """Value of a virtualised config dword (BARs, ROM)."""
        if reg == ROM_ADDRESS:
            return 0
        i = (reg - P.BASE_ADDRESS_0) // 4
        slot = self._bar_dword.get(i)
        if slot is None:
            return 0
        bar = self._bars[slot[0]]
        mask = ~(bar.size - 1)
        if slot[1] == "lo":
            return (self._vbar[i] & mask & 0xFFFF_FFF0) | self._bar_flags[bar.index]
        return self._vbar[i] & (mask >> 32) & ALL_ONES32

    def _is_virtual(self, off: int) -> bool:
        return P.BASE_ADDRESS_0 <= off < BAR_END or ROM_ADDRESS <= off < ROM_ADDRESS + 4

    def _virtfn_fix(self, off: int, size: int, v: int) -> int:
        """A VF's virtual ID bytes and Memory Space bit over the physical value."""
        assert self.virtfn_ids is not None
        ids = (self.virtfn_ids[0] | self.virtfn_ids[1] << 16).to_bytes(4, "little")
        for i in range(size):
            b = off + i
            if b < 4:
                v = (v & ~(0xFF << (8 * i))) | (ids[b] << (8 * i))
            elif b == P.COMMAND:
                v = (v & ~(P.COMMAND_MEMORY << (8 * i))) | (self._vmem << (8 * i))
        return v

    def _cfg_read(self, off: int, size: int) -> int:
        if off + size > self.config_size:
            return (1 << (8 * size)) - 1
        if self._is_virtual(off):
            reg = off & ~3
            return (self._virt_dword(reg) >> (8 * (off - reg))) & ((1 << (8 * size)) - 1)
        v = self.function.config_read(off, size)
        if self.virtfn_ids is not None and off < P.COMMAND + 1:
            v = self._virtfn_fix(off, size, v)
        if self.msix_cap is not None:
            flags_off = self.msix_cap + P.MSIX_FLAGS
            if off < flags_off + 2 and flags_off < off + size:
                shift = 8 * (flags_off - off)
                if shift >= 0:
                    virt = MSIX_VIRT_BITS << shift
                    v = (v & ~virt) | ((self._vmsix_flags << shift) & virt)
                else:  # a byte access to the upper byte of the flags
                    virt = MSIX_VIRT_BITS >> -shift
                    v = (v & ~virt) | ((self._vmsix_flags >> -shift) & virt)
                v &= (1 << (8 * size)) - 1
        return v

    def _cfg_write(self, off: int, size: int, value: int) -> None:
        if off + size > self.config_size or off >= P.EXT_CAP_START:
            return  # extended capabilities (SR-IOV...) are read-only to the user
        if self._is_virtual(off):
            reg = off & ~3
            if reg == ROM_ADDRESS:
                return
            i = (reg - P.BASE_ADDRESS_0) // 4
            shift = 8 * (off - reg)
            m = ((1 << (8 * size)) - 1) << shift
            self._vbar[i] = (self._vbar[i] & ~m) | ((value << shift) & m)
            return
        if self.msix_cap is not None:
            flags_off = self.msix_cap + P.MSIX_FLAGS
            if off < flags_off + 2 and flags_off < off + size:
                shift = 8 * (flags_off - off)
                bits = (value >> shift) if shift >= 0 else (value << -shift)
                covered = (((1 << (8 * size)) - 1) >> shift) if shift >= 0 else \
                    (((1 << (8 * size)) - 1) << -shift)
                keep = MSIX_VIRT_BITS & ~covered
                self._vmsix_flags = (self._vmsix_flags & keep) | (bits & MSIX_VIRT_BITS & covered)
                return  # the rest of the flags word is read-only
        if self.virtfn_ids is not None and off <= P.COMMAND < off + size:
            self._vmem = (value >> (8 * (P.COMMAND - off))) & P.COMMAND_MEMORY
        flr = False
        if self.exp_cap is not None:
            devctl = self.exp_cap + P.EXP_DEVCTL
            if off <= devctl and devctl + 2 <= off + size:
                shift = 8 * (devctl - off)
                if (value >> shift) & P.EXP_DEVCTL_BCR_FLR:
                    flr = True
                    value &= ~(P.EXP_DEVCTL_BCR_FLR << shift)
            elif off == devctl + 1 and value & (P.EXP_DEVCTL_BCR_FLR >> 8):
                flr = True
                value &= ~(P.EXP_DEVCTL_BCR_FLR >> 8)
        self.function.config_write(off, size, value)
        if flr:
            self.reset()


def _chunks(offset: int, length: int) -> list[tuple[int, int]]:
    """Split [offset, offset+length) into naturally aligned 4/2/1-byte accesses."""
    out = []
    pos, end = offset, offset + length
    while pos < end:
        for size in (4, 2, 1):
            if pos % size == 0 and pos + size <= end:
                out.append((pos, size))
                pos += size
                break
    return out


def _is_eventfd(fd: int) -> bool:
    """Whether `fd` is an open eventfd (what eventfd_ctx_fdget checks)."""
    return is_eventfd(fd) is True


class HostMsi(Protocol):
    """The host MSI domain as vfio-pci uses it (vmm.msi.HostMsiDomain)."""

    def alloc(self, callback: Callable[[], None], name: str,
              requester_id: int | None = None) -> MsiMessage: ...

    def free(self, msg: MsiMessage) -> None: ...
