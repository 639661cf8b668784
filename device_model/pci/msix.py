"""MSI-X: capability, vector table and Pending Bit Array (PCI Local Bus 3.0 §6.8.2).

Why its own module: every PCI function of the model signals through MSI-X the same way.
The Message Control register lives in the configuration image (one source of truth);
the table and PBA live here and are reached through the owning function's BAR.

Delivery rules: with ENABLE clear nothing is sent (and nothing is pended). A vector
fired while its MASKBIT is set, while the function is masked (MASKALL), or while Bus
Master is off, sets its pending bit instead; the message is sent, and the bit cleared,
as soon as none of those holds. A message is `MsiPort.send(address, data)`.
"""
from __future__ import annotations

import struct
from typing import Callable

from hwspec import pci as P

from ..ports import MsiPort, NullTracer, Tracer
from .api import MsixInfo
from .config import ConfigSpace, LogFn, no_log

_ENTRY = P.MSIX_ENTRY_SIZE
# writable bits of each dword of a table entry
_DWORD_WMASK = {
    P.MSIX_ENTRY_LOWER_ADDR: 0xFFFF_FFFC,   # bits 1:0 are 0 (DWORD-aligned messages)
    P.MSIX_ENTRY_UPPER_ADDR: 0xFFFF_FFFF,
    P.MSIX_ENTRY_DATA: 0xFFFF_FFFF,
    P.MSIX_ENTRY_VECTOR_CTRL: P.MSIX_ENTRY_CTRL_MASKBIT,
}


class Msix:
    """One function's MSI-X state: adds its capability to `config` at construction."""

    def __init__(self, config: ConfigSpace, count: int, table_bar: int, table_offset: int,
                 pba_bar: int, pba_offset: int, msi: MsiPort, tracer: Tracer | None = None,
                 log: LogFn | None = None,
                 bus_master: Callable[[], bool] | None = None) -> None:
        if not 1 <= count <= P.MSIX_FLAGS_QSIZE + 1:
            raise ValueError(f"MSI-X table size {count}")
        if table_offset & 7 or pba_offset & 7:
            raise ValueError("MSI-X table and PBA offsets must be QWORD aligned")
        self.config = config
        self.count = count
        self.msi = msi
        self.tracer: Tracer = tracer if tracer is not None else NullTracer()
        self.log: LogFn = log if log is not None else no_log
        self._bus_master = bus_master if bus_master is not None else (lambda: True)
        self.info = MsixInfo(count, table_bar, table_offset, pba_bar, pba_offset)
        body = struct.pack("<HII", (count - 1) & P.MSIX_FLAGS_QSIZE,
                           (table_offset & P.MSIX_TABLE_OFFSET) | (table_bar & P.MSIX_TABLE_BIR),
                           (pba_offset & P.MSIX_PBA_OFFSET) | (pba_bar & P.MSIX_PBA_BIR))
        wmask = struct.pack("<HII", P.MSIX_FLAGS_ENABLE | P.MSIX_FLAGS_MASKALL, 0, 0)
        self.cap = config.add_capability(P.CAP_ID_MSIX, body, wmask)
        config.on_write(self.cap + P.MSIX_FLAGS, 2, lambda off, size: self.flush())
        self.table = bytearray(count * _ENTRY)
        self.pba = bytearray((count + 63) // 64 * 8)
        self.reset()

    # --- state ------------------------------------------------------------------------

    def reset(self) -> None:
        """Power-on / FLR state of table and PBA: every vector masked, nothing pending.
        (Message Control is part of the config image and is reset with it.)"""
        self.table[:] = bytes(len(self.table))
        for v in range(self.count):
            self._put(v, P.MSIX_ENTRY_VECTOR_CTRL, P.MSIX_ENTRY_CTRL_MASKBIT)
        self.pba[:] = bytes(len(self.pba))

    @property
    def control(self) -> int:
        return self.config.get(self.cap + P.MSIX_FLAGS, 2)

    @property
    def enabled(self) -> bool:
        return bool(self.control & P.MSIX_FLAGS_ENABLE)

    @property
    def function_masked(self) -> bool:
        return bool(self.control & P.MSIX_FLAGS_MASKALL)

    @property
    def table_size(self) -> int:
        return len(self.table)

    @property
    def pba_size(self) -> int:
        return len(self.pba)

    def _get(self, vector: int, field: int) -> int:
        off = vector * _ENTRY + field
        return int.from_bytes(self.table[off:off + 4], "little")

    def _put(self, vector: int, field: int, value: int) -> None:
        off = vector * _ENTRY + field
        self.table[off:off + 4] = (value & 0xFFFF_FFFF).to_bytes(4, "little")

    def masked(self, vector: int) -> bool:
        return bool(self._get(vector, P.MSIX_ENTRY_VECTOR_CTRL) & P.MSIX_ENTRY_CTRL_MASKBIT)

    def pending(self, vector: int) -> bool:
        return bool(self.pba[vector // 8] >> (vector % 8) & 1)

    def _set_pending(self, vector: int, on: bool) -> None:
        if on:
            self.pba[vector // 8] |= 1 << (vector % 8)
        else:
            self.pba[vector // 8] &= ~(1 << (vector % 8)) & 0xFF

    def _blocked(self, vector: int) -> bool:
        return self.function_masked or self.masked(vector) or not self._bus_master()

    # --- signalling -------------------------------------------------------------------

    def fire(self, vector: int) -> None:
        """The function wants to interrupt on `vector`: send, pend, or (disabled or no
        such vector) do nothing."""
        if not self.enabled or not 0 <= vector < self.count:
            return
        if self._blocked(vector):
            self._set_pending(vector, True)
            self.tracer.emit("msix_pending", vector=vector)
            return
        self._send(vector)

    def _send(self, vector: int) -> None:
        addr = (self._get(vector, P.MSIX_ENTRY_UPPER_ADDR) << 32
                | self._get(vector, P.MSIX_ENTRY_LOWER_ADDR))
        data = self._get(vector, P.MSIX_ENTRY_DATA)
        self.tracer.emit("msix", vector=vector, address=addr, data=data)
        self.msi.send(addr, data)

    def flush(self) -> None:
        """Send every pending vector that is no longer blocked (after an unmask, a
        Message Control write, or Bus Master being turned on)."""
        if not self.enabled:
            return
        for v in range(self.count):
            if self.pending(v) and not self._blocked(v):
                self._set_pending(v, False)
                self._send(v)

    # --- BAR access (offsets relative to the table / PBA) -----------------------------

    @staticmethod
    def _size_ok(offset: int, size: int) -> bool:
        return size in (4, 8) and offset % size == 0

    def _read(self, data: bytearray, what: str, offset: int, size: int) -> int:
        """Aligned DWORD or QWORD reads only (PCI 3.0 §6.8.2); others read 0, logged;
        beyond the end of `data` reads 0."""
        if not self._size_ok(offset, size):
            self.log("msix/access-size", f"{size}-byte MSI-X {what} read at {offset:#x}")
            return 0
        if offset + size > len(data):
            return 0
        return int.from_bytes(data[offset:offset + size], "little")

    def table_read(self, offset: int, size: int) -> int:
        """Aligned DWORD or QWORD reads only (PCI 3.0 §6.8.2); others read 0, logged."""
        return self._read(self.table, "table", offset, size)

    def table_write(self, offset: int, size: int, value: int) -> None:
        if not self._size_ok(offset, size):
            self.log("msix/access-size", f"{size}-byte MSI-X table write at {offset:#x}")
            return
        if offset + size > len(self.table):
            return
        for i in range(0, size, 4):
            off = offset + i
            field = off % _ENTRY
            dword = value >> (8 * i) & 0xFFFF_FFFF
            self._put(off // _ENTRY, field, dword & _DWORD_WMASK[field])
        self.flush()

    def pba_read(self, offset: int, size: int) -> int:
        return self._read(self.pba, "PBA", offset, size)

    def pba_write(self, offset: int, size: int, value: int) -> None:
        """Pending bits are read-only: software must not write them."""
        self.log("msix/pba-write", f"{size}-byte write of {value:#x} to the PBA at "
                 f"{offset:#x}")
