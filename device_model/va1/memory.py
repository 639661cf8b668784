"""Device memory: the card's one lazily zeroed byte array, and each function's partition
of it (a function's device addresses run 0 .. size-1, whatever its place on the card).

The card array is an anonymous mapping (pages cost only once touched); `scrub` gives a
range back to the kernel (MADV_DONTNEED), so it reads zero again without being touched.
Views are zero-copy so that engines compute straight into device memory.
"""
from __future__ import annotations

import mmap

import numpy as np

_PAGE = mmap.PAGESIZE
_HUGE_MIN = 64 << 20  # device memories at least this big ask for transparent huge pages
_SKEW = 2048  # where a function's own memory starts in its mapping (DeviceMemory)


class CardMemory:
    """All device memory of a card."""

    def __init__(self, size: int) -> None:
        self.size = size
        # private anonymous: MADV_DONTNEED then really gives zero-fill pages back
        self._map = (mmap.mmap(-1, max(size, _PAGE),
                               flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
                               | getattr(mmap, "MAP_NORESERVE", 0))
                     if size else None)
        if self._map is not None and size >= _HUGE_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
            # Big device memories: transparent huge pages make bulk copies (DMA, GEMM
            # operands) about 10% faster (fewer TLB misses). Small ones stay 4 KiB so
            # many small functions do not zero-fill 2 MiB per first touch.
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # pragma: no cover - kernels without THP
                pass
        self.data = (np.frombuffer(self._map, dtype=np.uint8, count=size)
                     if self._map is not None else np.zeros(0, dtype=np.uint8))

    def scrub(self, base: int, length: int) -> None:
        """Zero [base, base+length) (whole pages are dropped, the edges written)."""
        if length <= 0:
            return
        lo = -(-base // _PAGE) * _PAGE
        hi = (base + length) // _PAGE * _PAGE
        if self._map is None or hi <= lo or not hasattr(self._map, "madvise"):
            self.data[base:base + length] = 0
            return
        self.data[base:lo] = 0
        self.data[hi:base + length] = 0
        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def partition(self, base: int, size: int) -> "DeviceMemory":
        return DeviceMemory(size, self.data[base:base + size], base=base)


class DeviceMemory:
    """One function's memory: `size` bytes at card offset `base`."""

    def __init__(self, size: int, data: np.ndarray | None = None, base: int = 0) -> None:
        self.size = size
        self.base = base
        if data is None:
            # Its own memory (no card): lazily zeroed like the card's, starting half a
            # page into it. Host placement only, for copies to and from (page-aligned)
            # guest RAM: 16 bytes into a page (where a malloc'ed array starts) a 128 KiB
            # upload aliases every 4 KiB and takes 45 us instead of 3; at the same offset
            # as the guest pages, 64 MiB copies run about 5 % slower than half a page off.
            data = CardMemory(size + _SKEW).data[_SKEW:]
        self.data = data

    def contains(self, addr: int, length: int) -> bool:
        """Is [addr, addr+length) inside memory? (Python ints: no overflow.)"""
        return 0 <= addr and 0 <= length and addr + length <= self.size

    def view_in(self, addr: int, length: int) -> np.ndarray | None:
        """Zero-copy uint8 view of [addr, addr+length), or None when it is not inside
        memory (`contains`, inlined: the decode path checks and views every operand)."""
        if 0 <= addr and 0 <= length and addr + length <= self.size:
            return self.data[addr:addr + length]
        return None

    def bytes_view(self, addr: int, length: int) -> np.ndarray:
        """Zero-copy uint8 view; raises ValueError when out of range."""
        view = self.view_in(addr, length)
        if view is None:
            raise ValueError(f"device range {addr:#x}+{length:#x} outside {self.size:#x}")
        return view

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
