"""PCI configuration space through ECAM (PCIe base spec §7.2.2; ACPI MCFG).

A function's 4 KiB config space is MMIO at ecam_base + ecam_offset(bus, dev, fn, reg);
accesses are 1, 2 or 4 bytes, naturally aligned, as a CPU does them. A slot with no
function behind it reads all-ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from hwspec import pci as P

from ..errors import GuestDriverError
from ..kernel import MmioAccessor


class PciError(GuestDriverError, RuntimeError):
    """Malformed or unusable config space of one function (message names it)."""


@dataclass(frozen=True, order=True)
class Bdf:
    """Bus/device/function, ordered as a scan visits them."""
    segment: int
    bus: int
    dev: int
    fn: int

    def __str__(self) -> str:
        return f"{self.segment:04x}:{self.bus:02x}:{self.dev:02x}.{self.fn}"


class ConfigSpace:
    """Config accessors of one function."""

    def __init__(self, mmio: MmioAccessor, ecam_base: int, bdf: Bdf) -> None:
        self.mmio = mmio
        self.bdf = bdf
        self.base = ecam_base + P.ecam_offset(bdf.bus, bdf.dev, bdf.fn)

    def _addr(self, reg: int, size: int) -> int:
        if reg < 0 or reg + size > P.CFG_SPACE_EXP_SIZE or reg % size:
            raise ValueError(f"{self.bdf}: config access of {size} bytes at {reg:#x} is not "
                             "naturally aligned inside the 4 KiB config space")
        return self.base + reg

    def read8(self, reg: int) -> int:
        return self.mmio.read(self._addr(reg, 1), 1) & 0xFF

    def read16(self, reg: int) -> int:
        return self.mmio.read(self._addr(reg, 2), 2) & 0xFFFF

    def read32(self, reg: int) -> int:
        return self.mmio.read(self._addr(reg, 4), 4) & 0xFFFFFFFF

    def write8(self, reg: int, value: int) -> None:
        self.mmio.write(self._addr(reg, 1), 1, value & 0xFF)

    def write16(self, reg: int, value: int) -> None:
        self.mmio.write(self._addr(reg, 2), 2, value & 0xFFFF)

    def write32(self, reg: int, value: int) -> None:
        self.mmio.write(self._addr(reg, 4), 4, value & 0xFFFFFFFF)
