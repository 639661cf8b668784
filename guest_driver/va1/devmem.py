"""Device memory of one VA-1 function: addresses 0 .. device_memory_size-1 (datasheet §5).

The driver is the only allocator of this space, so buffers of different contexts and
processes never overlap.
"""
from __future__ import annotations

from ..mm import AllocError, RangeAllocator, align_up

DEVMEM_ALIGN = 256  # tensor-friendly; the device needs no more


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

    def free(self, addr: int) -> None:
        self._alloc.free(addr)

    @property
    def bytes_free(self) -> int:
        return self._alloc.bytes_free
