"""Device memory of one VA-1 function: addresses 0 .. device_memory_size-1 (datasheet §5).

The driver is the only allocator of this space, so buffers of different contexts and
processes never overlap. Every range is CTX_PAGE-aligned and a whole number of CTX_PAGEs,
so it can be mapped into a context's private address space (CONTEXT_MAP) on its own.
"""
from __future__ import annotations

from hwspec.va1 import CTX_PAGE

from ..mm import AllocError, RangeAllocator, align_up

DEVMEM_ALIGN = CTX_PAGE  # the granule of context address-space mappings


class DeviceMemory:
    def __init__(self, size: int) -> None:
        self.size = size
        self._alloc = RangeAllocator(0, size, "device memory")

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
        self._alloc.free(addr)

    @property
    def bytes_free(self) -> int:
        return self._alloc.bytes_free
