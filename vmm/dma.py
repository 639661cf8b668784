"""Device DMA into guest memory, as the device model's DmaPort sees it.

`GuestDma` is the emulated attachment with no IOMMU: IOVA = guest physical address,
and only guest RAM is reachable (never another device's registers).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
from device_model.ports import DmaFault

from .memory import GuestMemory


class DmaFaultHook(Protocol):
    """What a fault plan (vmm.faults) plugs into a DMA port: it sees every access
    before it is made and may refuse it (returns the reason) as an IOMMU fault would."""

    def dma(self, iova: int, length: int, reads: bool, writes: bool) -> str | None: ...


class GuestDma:
    def __init__(self, memory: GuestMemory) -> None:
        self.memory = memory
        # All of guest RAM (it stays where it is for the VM's life): the hot paths check
        # a range against [base, end) and slice these.
        self._base, self._end = memory.base, memory.base + memory.size
        self._bytes = memory.bytes_view(memory.base, memory.size)
        self._array = memory.view(memory.base, memory.size)
        self.bytes_read = 0
        self.bytes_written = 0
        self._hook: DmaFaultHook | None = None
        # ring_view()s stay valid while this is unchanged (device_model.ports.DmaPort)
        self.view_epoch = 0

    @property
    def fault_hook(self) -> DmaFaultHook | None:
        """None unless a fault plan is installed; installing one ends every ring view,
        since the plan must see every access."""
        return self._hook

    @fault_hook.setter
    def fault_hook(self, hook: DmaFaultHook | None) -> None:
        self._hook = hook
        self.view_epoch += 1

    def ring_view(self, iova: int, length: int) -> memoryview | None:
        """[iova, iova+length) of guest RAM as a byte view for ring fields, or None while a
        fault plan watches DMA or when the range is not all RAM. Guest RAM stays where it
        is for the VM's life, so the view is valid until view_epoch changes. Accesses
        through it are not counted in bytes_read/bytes_written."""
        if self._hook is not None or not self.memory.contains(iova, length):
            return None
        return self.memory.bytes_view(iova, length)

    def _injected(self, iova: int, length: int, reads: bool, writes: bool) -> None:
        assert self._hook is not None
        reason = self._hook.dma(iova, length, reads, writes)
        if reason is not None:
            raise DmaFault(iova, length, writes, reason)

    def _check(self, iova: int, length: int, write: bool) -> None:
        if length < 0 or iova < 0 or iova + length > 1 << 64:
            raise DmaFault(iova, length, write, "address range overflows 64 bits")
        if not self.memory.contains(iova, length):
            raise DmaFault(iova, length, write, "not backed by guest RAM")

    def probe_view(self, iova: int, length: int) -> None:
        """Raises exactly the DmaFault view(iova, length) would, without making the view
        (an optional DmaPort method: device_model.virtio.split_ring probes rings with it)."""
        if length < 0 or iova < self._base or iova + length > self._end:
            self._check(iova, length, True)

    # The hot paths test "inside guest RAM" inline (which implies no 64-bit overflow)
    # and leave the reasons to _check.

    def read(self, iova: int, length: int) -> bytes:
        if self._hook is not None:
            self._injected(iova, length, True, False)
        off = iova - self._base
        if length < 0 or off < 0 or iova + length > self._end:
            self._check(iova, length, False)
        self.bytes_read += length
        return self._bytes[off:off + length].tobytes()

    def write(self, iova: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        if type(data) is bytes or type(data) is bytearray:
            n = len(data)
        else:
            n = data.nbytes if isinstance(data, np.ndarray) else len(memoryview(data).cast("B"))
        if self._hook is not None:
            self._injected(iova, n, False, True)
        off = iova - self._base
        if off < 0 or iova + n > self._end:
            self._check(iova, n, True)
        self.bytes_written += n
        if type(data) is bytes or type(data) is bytearray:
            self._bytes[off:off + n] = data
        else:
            self.memory.write(iova, data)

    def view(self, iova: int, length: int) -> np.ndarray:
        if self._hook is not None:
            self._injected(iova, length, True, True)
        off = iova - self._base
        if length < 0 or off < 0 or iova + length > self._end:
            self._check(iova, length, True)
        return self._array[off:off + length]
