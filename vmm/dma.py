"""Device DMA into guest memory, as the device model's DmaPort sees it.

`GuestDma` is the emulated attachment with no IOMMU: IOVA = guest physical address,
and only guest RAM is reachable (never another device's registers).
"""
from __future__ import annotations

import numpy as np
from device_model.ports import DmaFault

from .memory import GuestMemory


class GuestDma:
    def __init__(self, memory: GuestMemory) -> None:
        self.memory = memory
        self.bytes_read = 0
        self.bytes_written = 0

    def _check(self, iova: int, length: int, write: bool) -> None:
        if length < 0 or iova < 0 or iova + length > 1 << 64:
            raise DmaFault(iova, length, write, "address range overflows 64 bits")
        if not self.memory.contains(iova, length):
            raise DmaFault(iova, length, write, "not backed by guest RAM")

    def read(self, iova: int, length: int) -> bytes:
        self._check(iova, length, False)
        self.bytes_read += length
        return self.memory.read(iova, length)

    def write(self, iova: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        n = data.nbytes if isinstance(data, np.ndarray) else len(memoryview(data).cast("B"))
        self._check(iova, n, True)
        self.bytes_written += n
        self.memory.write(iova, data)

    def view(self, iova: int, length: int) -> np.ndarray:
        self._check(iova, length, True)
        return self.memory.view(iova, length)
