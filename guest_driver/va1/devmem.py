"""Device memory of one VA-1 function: addresses 0 .. device_memory_size-1 (datasheet §5).

The driver is the only allocator of this space, so buffers of different contexts and
processes never overlap. Every range is CTX_PAGE-aligned and a whole number of CTX_PAGEs,
so it can be mapped into a context's private address space (CONTEXT_MAP) on its own.

Scrubbing: memory that was freed is *dirty* (it holds the last owner's data) until the
driver zeroes it. The driver zeroes on allocate, and only the dirty part of the new
range (the memory of a function starts zeroed: §10, a fresh or FLR'd partition): memory
that is freed and never handed out again costs nothing.

The size follows the device configuration (`resize`, after a VF resize by its PF).
"""
from __future__ import annotations

import bisect

from hwspec.va1 import CTX_PAGE

from ..mm import AllocError, RangeAllocator, align_up

DEVMEM_ALIGN = CTX_PAGE  # the granule of context address-space mappings


class DeviceMemory:
    def __init__(self, size: int) -> None:
        self._alloc = RangeAllocator(0, size, "device memory")
        self._dirty: list[tuple[int, int]] = []  # sorted, disjoint, not adjacent

    @property
    def size(self) -> int:
        return self._alloc.size

    def alloc(self, size: int) -> int:
        if size <= 0:
            raise ValueError(f"device buffer size must be > 0, got {size}")
        if size > self.size:
            raise AllocError(f"device memory: {size} bytes requested, function has {self.size}")
        return self._alloc.alloc(align_up(size, DEVMEM_ALIGN), DEVMEM_ALIGN)

    def mapped_size(self, addr: int) -> int:
        """Bytes reserved at addr (the request rounded up to CTX_PAGE)."""
        return self._alloc.size_of(addr)

    def free(self, addr: int) -> None:
        """Give a range back; it is dirty until scrubbed."""
        size = self._alloc.size_of(addr)
        self._alloc.free(addr)
        self._mark_dirty(addr, min(addr + size, self.size))

    def resize(self, size: int) -> None:
        """The function's memory is now `size` bytes (live buffers past it stay theirs
        until freed; nothing past it is handed out again)."""
        self._alloc.resize(size)
        self._dirty = [(s, min(e, size)) for s, e in self._dirty if s < size]

    @property
    def bytes_free(self) -> int:
        return self._alloc.bytes_free

    # ------------------------------------------------------------------ scrubbing
    def dirty_in(self, addr: int, size: int) -> list[tuple[int, int]]:
        """The dirty parts of [addr, addr+size) as (start, length)."""
        end = addr + size
        out = []
        i = max(bisect.bisect_right(self._dirty, (addr, addr)) - 1, 0)
        for s, e in self._dirty[i:]:
            if s >= end:
                break
            lo, hi = max(s, addr), min(e, end)
            if lo < hi:
                out.append((lo, hi - lo))
        return out

    def mark_clean(self, ranges: list[tuple[int, int]]) -> None:
        """These ranges were zeroed."""
        for a, n in ranges:
            lo, hi = a, a + n
            kept: list[tuple[int, int]] = []
            for s, e in self._dirty:
                if e <= lo or s >= hi:
                    kept.append((s, e))
                    continue
                if s < lo:
                    kept.append((s, lo))
                if e > hi:
                    kept.append((hi, e))
            self._dirty = kept

    @property
    def bytes_dirty(self) -> int:
        return sum(e - s for s, e in self._dirty)

    def _mark_dirty(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        merged: list[tuple[int, int]] = []
        for s, e in self._dirty:
            if e < lo or s > hi:
                merged.append((s, e))
            else:
                lo, hi = min(lo, s), max(hi, e)
        merged.append((lo, hi))
        self._dirty = sorted(merged)
