"""PCI / PCIe configuration space of one function (PCI Local Bus 3.0 ch. 6, PCIe 4.0 ch. 7).

Why a helper: every PCI function of the model (a virtio-pci function today, the SR-IOV
PF and its VFs later) needs the same 4 KiB image with per-bit write masks, the BAR
sizing protocol and capability chains. Behaviour that is not a plain read/write of bits
(MSI-X Message Control, FLR, the virtio PCI_CFG window) is attached as read/write hooks
on byte ranges, so the image stays the single source of truth for register values.

Nothing the guest can do makes `read`/`write` raise: a bad access is logged through the
`log(rule, message)` callback, reads all-ones, and a bad write changes nothing.
"""
from __future__ import annotations

from typing import Callable

from hwspec import pci as P

from .api import BarInfo

ConfigHook = Callable[[int, int], None]
LogFn = Callable[[str, str], None]

_STD_CAP_START = P.STD_HEADER_SIZEOF
_ACCESS_SIZES = (1, 2, 4)


def all_ones(size: int) -> int:
    """What a master abort reads as: all-ones of the access width (32 bits if odd)."""
    return (1 << (8 * size)) - 1 if 0 < size <= 8 else 0xFFFF_FFFF


def no_log(rule: str, message: str) -> None:
    return None


class ConfigSpace:
    """A 4 KiB type-0 configuration header plus capability lists.

    `data` is the register image; `wmask` has a 1 for every bit software may write.
    Device-side code changes read-only bits with `put` (no mask)."""

    def __init__(self, vendor_id: int, device_id: int, revision: int, class_code: int,
                 subsystem_vendor_id: int, subsystem_id: int, interrupt_pin: int = 0,
                 log: LogFn | None = None) -> None:
        """`class_code` is 24 bits: base class << 16 | sub-class << 8 | prog-if."""
        self.data = bytearray(P.CFG_SPACE_EXP_SIZE)
        self.wmask = bytearray(P.CFG_SPACE_EXP_SIZE)
        self.log: LogFn = log if log is not None else no_log
        self._read_hooks: list[tuple[int, int, ConfigHook]] = []
        self._write_hooks: list[tuple[int, int, ConfigHook]] = []
        self._bars: dict[int, BarInfo] = {}
        self._last_std_cap = 0      # offset of the last standard cap (0: none yet)
        self._next_std_cap = _STD_CAP_START
        self._last_ext_cap = 0
        self._next_ext_cap = P.EXT_CAP_START
        self._defaults = bytes()

        self.put(P.VENDOR_ID, 2, vendor_id)
        self.put(P.DEVICE_ID, 2, device_id)
        self.put(P.REVISION_ID, 1, revision)
        self.put(P.CLASS_PROG, 1, class_code & 0xFF)
        self.put(P.CLASS_DEVICE, 2, class_code >> 8 & 0xFFFF)
        self.put(P.HEADER_TYPE, 1, P.HEADER_TYPE_NORMAL)
        self.put(P.SUBSYSTEM_VENDOR_ID, 2, subsystem_vendor_id)
        self.put(P.SUBSYSTEM_ID, 2, subsystem_id)
        self.put(P.INTERRUPT_PIN, 1, interrupt_pin)
        self.set_wmask(P.COMMAND, 2,
                       P.COMMAND_MEMORY | P.COMMAND_MASTER | P.COMMAND_INTX_DISABLE)
        self.set_wmask(P.INTERRUPT_LINE, 1, 0xFF)   # a scratch byte for firmware/OS

    # --- raw device-side access ---------------------------------------------------------

    def get(self, offset: int, size: int) -> int:
        return int.from_bytes(self.data[offset:offset + size], "little")

    def put(self, offset: int, size: int, value: int) -> None:
        self.data[offset:offset + size] = (value & all_ones(size)).to_bytes(size, "little")

    def set_wmask(self, offset: int, size: int, mask: int) -> None:
        self.wmask[offset:offset + size] = (mask & all_ones(size)).to_bytes(size, "little")

    @property
    def command(self) -> int:
        return self.get(P.COMMAND, 2)

    def on_read(self, offset: int, length: int, hook: ConfigHook) -> None:
        """`hook(offset, size)` runs before any read overlapping the range (it may
        refresh `data`)."""
        self._read_hooks.append((offset, offset + length, hook))

    def on_write(self, offset: int, length: int, hook: ConfigHook) -> None:
        """`hook(offset, size)` runs after any write overlapping the range was merged."""
        self._write_hooks.append((offset, offset + length, hook))

    # --- BARs -------------------------------------------------------------------------

    def add_bar(self, index: int, size: int, is_64bit: bool, prefetchable: bool) -> BarInfo:
        """A memory BAR of `size` bytes (power of two, >= 4 KiB). The register's writable
        bits are the address bits above the size, so writing all-ones reads back the
        size mask with the read-only type bits (the sizing protocol)."""
        last = index + (1 if is_64bit else 0)
        if size < 0x1000 or size & (size - 1) or not 0 <= index or last >= P.NUM_BARS:
            raise ValueError(f"bad BAR {index} of size {size:#x}")
        if any(i in self._bars or (i - 1 in self._bars and self._bars[i - 1].is_64bit)
               for i in range(index, last + 1)):
            raise ValueError(f"BAR {index} overlaps another BAR")
        info = BarInfo(index, size, is_64bit, prefetchable)
        self._bars[index] = info
        reg = P.BASE_ADDRESS_0 + 4 * index
        flags = (P.BASE_ADDRESS_MEM_TYPE_64 if is_64bit else P.BASE_ADDRESS_MEM_TYPE_32) | (
            P.BASE_ADDRESS_MEM_PREFETCH if prefetchable else 0)
        self.put(reg, 4, flags)
        mask = ~(size - 1) & ((1 << 64) - 1 if is_64bit else 0xFFFF_FFFF)
        self.set_wmask(reg, 4, mask & P.BASE_ADDRESS_MEM_MASK)
        if is_64bit:
            self.set_wmask(reg + 4, 4, mask >> 32)
        return info

    def bars(self) -> tuple[BarInfo, ...]:
        return tuple(self._bars[i] for i in sorted(self._bars))

    def bar_address(self, index: int) -> int:
        """Where software placed BAR `index` (0 until it is programmed)."""
        info = self._bars.get(index)
        if info is None:
            return 0
        reg = P.BASE_ADDRESS_0 + 4 * index
        addr = self.get(reg, 4) & P.BASE_ADDRESS_MEM_MASK
        if info.is_64bit:
            addr |= self.get(reg + 4, 4) << 32
        return addr

    # --- capabilities -----------------------------------------------------------------

    def add_capability(self, cap_id: int, body: bytes, wmask: bytes | None = None) -> int:
        """Append a standard capability (from 0x40, dword-aligned) and link it.
        `body` is what follows the 2-byte (id, next) header; returns the cap's offset."""
        off = self._next_std_cap
        end = off + 2 + len(body)
        if end > P.CFG_SPACE_SIZE:
            raise ValueError("standard capabilities overflow the 256-byte header")
        self.data[off] = cap_id
        self.data[off + 1] = 0
        self.data[off + 2:end] = body
        if wmask is not None:
            self.wmask[off + 2:off + 2 + len(wmask)] = wmask
        if self._last_std_cap:
            self.data[self._last_std_cap + P.CAP_LIST_NEXT] = off
        else:
            self.put(P.CAPABILITY_LIST, 1, off)
            self.put(P.STATUS, 2, self.get(P.STATUS, 2) | P.STATUS_CAP_LIST)
        self._last_std_cap = off
        self._next_std_cap = (end + 3) & ~3
        return off

    def add_ext_capability(self, cap_id: int, version: int, body: bytes,
                           wmask: bytes | None = None) -> int:
        """Append a PCIe extended capability (from 0x100, with the 32-bit ext-cap
        header); `body` follows the header. Returns the cap's offset."""
        off = self._next_ext_cap
        end = off + 4 + len(body)
        if end > P.CFG_SPACE_EXP_SIZE:
            raise ValueError("extended capabilities overflow the 4 KiB space")
        self.put(off, 4, P.ext_cap_header(cap_id, version, 0))
        self.data[off + 4:end] = body
        if wmask is not None:
            self.wmask[off + 4:off + 4 + len(wmask)] = wmask
        if self._last_ext_cap:
            prev = self.get(self._last_ext_cap, 4)
            self.put(self._last_ext_cap, 4, P.ext_cap_header(
                P.ext_cap_id(prev), P.ext_cap_ver(prev), off))
        self._last_ext_cap = off
        self._next_ext_cap = (end + 3) & ~3
        return off

    # --- reset ------------------------------------------------------------------------

    def seal_defaults(self) -> None:
        """Remember the current image as the power-on / FLR state."""
        self._defaults = bytes(self.data)

    def reset(self) -> None:
        """Back to the sealed power-on image (BARs unassigned, command 0, caps idle)."""
        if self._defaults:
            self.data[:] = self._defaults

    # --- software access (ECAM) -------------------------------------------------------

    def _valid(self, offset: int, size: int) -> bool:
        return (size in _ACCESS_SIZES and 0 <= offset and offset + size <= len(self.data)
                and offset % size == 0)

    def read(self, offset: int, size: int) -> int:
        """A configuration read; a bad one reads all-ones. Never raises."""
        if not self._valid(offset, size):
            self.log("pci/config-access", f"{size}-byte config read at {offset:#x}")
            return all_ones(size)
        for lo, hi, hook in list(self._read_hooks):
            if offset < hi and offset + size > lo:
                hook(offset, size)
        return self.get(offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        """A configuration write through the write masks. Never raises."""
        if not self._valid(offset, size):
            self.log("pci/config-access", f"{size}-byte config write at {offset:#x}")
            return
        value &= all_ones(size)
        for i in range(size):
            m = self.wmask[offset + i]
            if m:
                b = value >> (8 * i) & 0xFF
                self.data[offset + i] = (self.data[offset + i] & ~m & 0xFF) | (b & m)
        for lo, hi, hook in list(self._write_hooks):
            if offset < hi and offset + size > lo:
                hook(offset, size)


def add_pcie_endpoint_cap(config: ConfigSpace, on_flr: Callable[[], None]) -> int:
    """A PCI Express capability (v2, endpoint) advertising Function Level Reset.

    Setting DEVCTL.BCR_FLR calls `on_flr` (the bit always reads 0). Returns the offset."""
    body = bytearray(P.CAP_EXP_ENDPOINT_SIZEOF_V2 - 2)
    flags = (2 & P.EXP_FLAGS_VERS) | (P.EXP_TYPE_ENDPOINT << 4 & P.EXP_FLAGS_TYPE)
    body[P.EXP_FLAGS - 2:P.EXP_FLAGS] = flags.to_bytes(2, "little")
    body[P.EXP_DEVCAP - 2:P.EXP_DEVCAP + 2] = P.EXP_DEVCAP_FLR.to_bytes(4, "little")
    wmask = bytearray(len(body))
    wmask[P.EXP_DEVCTL - 2:P.EXP_DEVCTL] = b"\xff\xff"   # every DEVCTL control is R/W
    off = config.add_capability(P.CAP_ID_EXP, bytes(body), bytes(wmask))
    devctl = off + P.EXP_DEVCTL

    def devctl_written(offset: int, size: int) -> None:
        value = config.get(devctl, 2)
        if value & P.EXP_DEVCTL_BCR_FLR:
            config.put(devctl, 2, value & ~P.EXP_DEVCTL_BCR_FLR)
            on_flr()

    config.on_write(devctl, 2, devctl_written)
    return off
