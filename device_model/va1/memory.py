"""Device memory of one function: a flat numpy byte array, addresses 0 .. size-1.

np.zeros gives lazily-backed pages, so a 256 MiB function costs only what it touches.
Views are zero-copy so that engines compute straight into device memory.
"""
from __future__ import annotations

import numpy as np


class DeviceMemory:
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = np.zeros(size, dtype=np.uint8)

    def contains(self, addr: int, length: int) -> bool:
        """Is [addr, addr+length) inside memory? (Python ints: no overflow.)"""
        return 0 <= addr and 0 <= length and addr + length <= self.size

    def bytes_view(self, addr: int, length: int) -> np.ndarray:
        """Zero-copy uint8 view; raises ValueError when out of range."""
        if not self.contains(addr, length):
            raise ValueError(f"device range {addr:#x}+{length:#x} outside {self.size:#x}")
        return self.data[addr:addr + length]

    def typed_view(self, addr: int, dtype: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Zero-copy view of `shape` elements of `dtype` (may be unaligned)."""
        dt = np.dtype(dtype)
        count = 1
        for s in shape:
            count *= s
        return self.bytes_view(addr, count * dt.itemsize).view(dt).reshape(shape)

    def read(self, addr: int, length: int) -> bytes:
        return self.bytes_view(addr, length).tobytes()

    def write(self, addr: int, data: bytes) -> None:
        self.bytes_view(addr, len(data))[:] = np.frombuffer(data, dtype=np.uint8)
