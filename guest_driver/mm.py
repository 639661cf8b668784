"""Range allocators: guest physical memory for rings/slots/host buffers, and device memory.

One first-fit allocator over an address range, with alignment and explicit free. The
driver owns the guest RAM range the kernel gives it (RamRange), so every ring, request
slot and pinned host buffer comes from here and nothing overlaps.
"""
from __future__ import annotations

import bisect

from .errors import GuestDriverError

PAGE_SIZE = 4096


# One allocation's edit of the free list: (start, size, align, the free list (starts,
# ends) before it, the free list after it). An allocation builds a new free list and
# leaves the one before it as it was, so undoing or redoing the edit is one swap.
_FreeList = tuple[list[int], list[int]]
_Edit = tuple[int, int, int, _FreeList, _FreeList]


class AllocError(GuestDriverError, MemoryError):
    """No free range large enough (ENOMEM)."""


def align_up(value: int, align: int) -> int:
    return (value + align - 1) & ~(align - 1)


class RangeAllocator:
    """First-fit allocator over [base, base+size); free ranges kept sorted and coalesced."""

    def __init__(self, base: int, size: int, name: str = "range") -> None:
        if base < 0 or size < 0:
            raise ValueError(f"{name}: bad range base={base:#x} size={size:#x}")
        self.base = base
        self.size = size
        self.name = name
        self._free_starts: list[int] = [base] if size else []
        self._free_ends: list[int] = [base + size] if size else []
        self._allocated: dict[int, int] = {}  # start -> size
        # The newest allocation while no other operation followed it, and one freed
        # right after it was made (`_Edit`); see `alloc`.
        self._newest: _Edit | None = None
        self._undone: _Edit | None = None

    @property
    def bytes_free(self) -> int:
        return sum(e - s for s, e in zip(self._free_starts, self._free_ends))

    @property
    def bytes_allocated(self) -> int:
        return sum(self._allocated.values())

    def alloc(self, size: int, align: int = 1) -> int:
        """Return the start of a free range of `size` bytes aligned to `align` (power of two)."""
        if size <= 0:
            raise ValueError(f"{self.name}: allocation size must be > 0, got {size}")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.name}: alignment must be a power of two, got {align}")
        edit = self._undone
        if edit is not None and edit[1] == size and edit[2] == align:
            # Like the allocation freed right before it, with nothing in between (a
            # driver's copy of each command buffer, made and freed per submission): the
            # free list is as it was before that allocation, so first fit answers the
            # same address; the same edit of the list is made again without the search.
            self._free_starts, self._free_ends = edit[4]
            self._undone = None
            self._newest = edit
            self._allocated[edit[0]] = size
            return edit[0]
        self._undone = None
        starts, ends = self._free_starts, self._free_ends
        mask = align - 1
        for i, (start, end) in enumerate(zip(starts, ends)):
            lo = (start + mask) & ~mask   # align_up(start, align)
            hi = lo + size
            if hi <= end:
                # free range i becomes what is left of it on either side of [lo, hi)
                new_starts = [start, hi] if lo > start else [hi]
                new_ends = [lo, end] if lo > start else [end]
                if hi == end:
                    del new_starts[-1]
                    del new_ends[-1]
                after = (starts[:i] + new_starts + starts[i + 1:],
                         ends[:i] + new_ends + ends[i + 1:])
                self._free_starts, self._free_ends = after
                self._allocated[lo] = size
                self._newest = (lo, size, align, (starts, ends), after)
                return lo
        self._newest = None
        raise AllocError(f"{self.name}: out of memory: no free range of {size} bytes "
                         f"aligned to {align} ({self.bytes_free} bytes free)")

    def free(self, addr: int) -> None:
        """Give a range back; the part of it past the end (after a shrink) is dropped."""
        size = self._allocated.pop(addr, None)
        if size is None:
            raise ValueError(f"{self.name}: free of {addr:#x}, which is not allocated")
        edit = self._newest
        self._newest = None
        if edit is not None and edit[0] == addr:
            # nothing happened since it was allocated: the free list before it is what
            # _add_free would make (the free list being coalesced)
            self._free_starts, self._free_ends = edit[3]
            self._undone = edit
            return
        self._undone = None
        self._add_free(addr, min(addr + size, self.base + self.size))

    def _add_free(self, addr: int, end: int) -> None:
        """Insert [addr, end) into the free list, merged with adjacent free ranges."""
        if end <= addr:
            return
        i = bisect.bisect_left(self._free_starts, addr)
        if i > 0 and self._free_ends[i - 1] == addr:
            i -= 1
            addr = self._free_starts[i]
            del self._free_starts[i]
            del self._free_ends[i]
        if i < len(self._free_starts) and self._free_starts[i] == end:
            end = self._free_ends[i]
            del self._free_starts[i]
            del self._free_ends[i]
        self._free_starts.insert(i, addr)
        self._free_ends.insert(i, end)

    def resize(self, size: int) -> None:
        """Follow a new size of the range. Growing frees what no allocation covers;
        shrinking drops free space past the new end. Allocations that reach past it stay
        allocated (their owners still hold them); only their part below the end comes
        back when they are freed."""
        if size < 0:
            raise ValueError(f"{self.name}: bad size {size:#x}")
        self._newest = self._undone = None
        old_end, new_end = self.base + self.size, self.base + size
        self.size = size
        if new_end > old_end:
            lo = old_end
            for a, n in sorted(self._allocated.items()):
                if a + n <= lo or a >= new_end:
                    continue
                self._add_free(lo, a)
                lo = max(lo, a + n)
            self._add_free(lo, new_end)
            return
        keep = [(s, min(e, new_end)) for s, e in zip(self._free_starts, self._free_ends)
                if s < new_end]
        self._free_starts = [s for s, _ in keep]
        self._free_ends = [e for _, e in keep]

    def size_of(self, addr: int) -> int:
        return self._allocated[addr]


class PageAllocator(RangeAllocator):
    """Guest physical memory allocator; everything it hands out is at least 16-byte
    aligned (descriptor tables) and, by default, page aligned (IOMMU granularity)."""

    def alloc_pages(self, size: int) -> int:
        return self.alloc(align_up(size, PAGE_SIZE), PAGE_SIZE)

    def alloc_dma(self, size: int, align: int = 16) -> int:
        """`size` bytes (rounded up to 16) aligned to `align` (at least 16)."""
        return self.alloc((size + 15) & ~15, align if align > 16 else 16)
