"""Host memory (one memfd, mapped shared) and guest RAM carved out of it.

Guest RAM is a slice of host memory, so the VMM, the device model's DMA and the guest
all see the same bytes with zero-copy numpy views. Every access is bounds-checked.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from .errors import VmmError


class GuestMemoryError(VmmError, ValueError):
    """An access outside guest RAM. Nothing was read or written."""


class HostMemory:
    """An anonymous shared memory file; pages are only allocated when touched."""

    def __init__(self, size: int, name: str = "virtaccel-host") -> None:
        if size <= 0 or size % mmap.PAGESIZE:
            raise ValueError(f"host memory size {size} must be a positive multiple of {mmap.PAGESIZE}")
        self.size = size
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._next = 0

    def carve(self, size: int) -> tuple[int, np.ndarray]:
        """Reserve `size` bytes (page-aligned); returns (host offset, view)."""
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        if self._next + size > self.size:
            raise MemoryError(f"host memory exhausted: {size} bytes asked, "
                              f"{self.size - self._next} left of {self.size}")
        off = self._next
        self._next += size
        return off, self.array[off:off + size]

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # views still alive; the mapping goes with them
        os.close(self._fd)


class GuestMemory:
    """Guest RAM: `size` bytes at guest physical `base`. Implements guest_driver's PhysMemory."""

    def __init__(self, host: HostMemory, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self.host_offset, self._ram = host.carve(size)
        self._ram = self._ram[:size]
        self._mv = self._ram.data  # memoryview: small accesses are cheaper than numpy slices

    def contains(self, gpa: int, length: int) -> bool:
        return length >= 0 and gpa >= self.base and gpa + length <= self.base + self.size

    def _offset(self, gpa: int, length: int) -> int:
        if length < 0 or gpa < self.base or gpa + length > self.base + self.size:
            raise GuestMemoryError(
                f"guest physical range [{gpa:#x}, {gpa + length:#x}) is outside guest RAM "
                f"[{self.base:#x}, {self.base + self.size:#x})")
        return gpa - self.base

    def view(self, gpa: int, length: int) -> np.ndarray:
        off = gpa - self.base
        if length < 0 or off < 0 or off + length > self.size:
            self._offset(gpa, length)  # raises
        return self._ram[off:off + length]

    def bytes_view(self, gpa: int, length: int) -> memoryview:
        """A writable byte memoryview of [gpa, gpa+length) (checked once, here)."""
        off = self._offset(gpa, length)
        return self._mv[off:off + length]

    def read(self, gpa: int, length: int) -> bytes:
        off = gpa - self.base
        if length < 0 or off < 0 or off + length > self.size:
            self._offset(gpa, length)  # raises
        return self._mv[off:off + length].tobytes()

    def write(self, gpa: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        if type(data) is bytes or type(data) is bytearray:
            n = len(data)
            off = gpa - self.base
            if off < 0 or off + n > self.size:
                self._offset(gpa, n)  # raises
            self._mv[off:off + n] = data
            return
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) \
            else data.reshape(-1).view(np.uint8)
        off = self._offset(gpa, src.size)
        self._ram[off:off + src.size] = src
