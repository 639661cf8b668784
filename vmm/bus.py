"""The MMIO bus: non-overlapping regions, 1/2/4/8-byte accesses.

An access that hits no region (or straddles a region's end, or has a bad size) is
logged; a read returns all-ones and a write is dropped, as on a real bus.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

from .errors import VmmError


class MmioHandler(Protocol):
    def read(self, offset: int, size: int) -> int: ...

    def write(self, offset: int, size: int, value: int) -> None: ...


class BusError(VmmError, ValueError):
    """A bad request to an MMIO bus (invalid or overlapping region, none to remove).
    Nothing changed."""


@dataclass(frozen=True)
class Region:
    base: int
    size: int
    name: str
    handler: MmioHandler
    direct: bool = False  # mapped straight into the guest: no exit cost
    end: int = field(init=False, repr=False, compare=False)  # base + size

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", self.base + self.size)


@dataclass(frozen=True)
class UnclaimedAccess:
    addr: int
    size: int
    write: bool
    value: int
    reason: str


ACCESS_SIZES = (1, 2, 4, 8)
_CLAIMS_MAX = 4096   # claims kept at most (an access pattern over a whole BAR stays bounded)


class MmioBus:
    def __init__(self) -> None:
        self._bases: list[int] = []
        self._regions: list[Region] = []
        self.unclaimed: list[UnclaimedAccess] = []
        # (addr, size) -> region of the valid accesses seen (see claim); emptied in place
        # whenever the regions change, so holders of the dict see the change.
        self.claims: dict[tuple[int, int], Region] = {}

    def add(self, base: int, size: int, handler: MmioHandler, name: str, direct: bool = False) -> Region:
        if size <= 0 or base < 0 or base + size > 1 << 64:
            raise BusError(f"region {name!r} [{base:#x}, +{size:#x}) is not a valid range")
        region = Region(base, size, name, handler, direct)
        i = bisect.bisect_left(self._bases, base)
        for other in self._regions[max(0, i - 1):i + 1]:
            if other.base < region.end and region.base < other.end:
                raise BusError(f"region {name!r} [{base:#x}, {region.end:#x}) overlaps "
                               f"{other.name!r} [{other.base:#x}, {other.end:#x})")
        self._bases.insert(i, base)
        self._regions.insert(i, region)
        self.claims.clear()
        return region

    def remove(self, base: int) -> None:
        i = bisect.bisect_left(self._bases, base)
        if i == len(self._bases) or self._bases[i] != base:
            raise BusError(f"no region at {base:#x}")
        del self._bases[i]
        del self._regions[i]
        self.claims.clear()

    def find(self, addr: int, size: int) -> Region | None:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        region = self._regions[i]
        if addr + size <= region.end:
            return region
        return None

    def claim(self, addr: int, size: int) -> Region | None:
        """The region a valid access (1/2/4/8 bytes, wholly inside it) reaches, kept in
        `claims` so that a repeated access costs no lookup; None for an access read_in /
        write_in log as unclaimed."""
        if size not in ACCESS_SIZES:
            return None
        region = self.find(addr, size)
        if region is not None:
            if len(self.claims) >= _CLAIMS_MAX:
                self.claims.clear()
            self.claims[addr, size] = region
        return region

    def _unclaimed(self, addr: int, size: int, write: bool, value: int, reason: str) -> None:
        self.unclaimed.append(UnclaimedAccess(addr, size, write, value, reason))

    def read(self, addr: int, size: int) -> int:
        return self.read_in(self.find(addr, size), addr, size)

    def write(self, addr: int, size: int, value: int) -> None:
        self.write_in(self.find(addr, size), addr, size, value)

    def read_in(self, region: Region | None, addr: int, size: int) -> int:
        """read() with `region` = find(addr, size) already looked up by the caller."""
        if size not in ACCESS_SIZES:
            self._unclaimed(addr, size, False, 0, f"access size {size} is not 1, 2, 4 or 8")
            return (1 << 64) - 1
        if region is None:
            self._unclaimed(addr, size, False, 0, "no region")
            return (1 << (8 * size)) - 1
        return region.handler.read(addr - region.base, size) & ((1 << (8 * size)) - 1)

    def write_in(self, region: Region | None, addr: int, size: int, value: int) -> None:
        """write() with `region` = find(addr, size) already looked up by the caller."""
        if size not in ACCESS_SIZES:
            self._unclaimed(addr, size, True, value, f"access size {size} is not 1, 2, 4 or 8")
            return
        if region is None:
            self._unclaimed(addr, size, True, value, "no region")
            return
        region.handler.write(addr - region.base, size, value & ((1 << (8 * size)) - 1))
