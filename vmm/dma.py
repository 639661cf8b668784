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

    def probe_view(self, iova: int, length: int) -> None:
        """Raises exactly the DmaFault view(iova, length) would, without making the view
        (an optional DmaPort method: device_model.virtio.split_ring probes rings with it)."""
        self._check(iova, length, True)

    # The hot paths test "inside guest RAM" inline (which implies no 64-bit overflow)
    # and leave the reasons to _check.

    def read(self, iova: int, length: int) -> bytes:
        mem = self.memory
        if length < 0 or iova < mem.base or iova + length > mem.base + mem.size:
            self._check(iova, length, False)
        self.bytes_read += length
        return mem.read(iova, length)

    def write(self, iova: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        if type(data) is bytes or type(data) is bytearray:
            n = len(data)
        else:
            n = data.nbytes if isinstance(data, np.ndarray) else len(memoryview(data).cast("B"))
        mem = self.memory
        if iova < mem.base or iova + n > mem.base + mem.size:
            self._check(iova, n, True)
        self.bytes_written += n
        mem.write(iova, data)

    def view(self, iova: int, length: int) -> np.ndarray:
        mem = self.memory
        if length < 0 or iova < mem.base or iova + length > mem.base + mem.size:
            self._check(iova, length, True)
        return mem.view(iova, length)
