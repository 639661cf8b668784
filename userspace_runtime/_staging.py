"""Host staging memory: HOST buffers mapped once and bump-allocated, reused per fence.

A stream copies upload data, download results and its command buffers through here.
Each block remembers the last submission (stream-local sequence number) that uses it;
once that submission has completed the block is idle and is reused from its start.
Blocks are mapped once (zero-copy numpy views) and freed only when the stream goes.
"""
from __future__ import annotations

import errno
from typing import Callable

import numpy as np

from guest_driver import uapi

from .driver_file import DriverFile
from ._errors import DriverError

ALIGN = 64          # every region starts on a cache line (and any dtype's alignment)
PAGE = 4096
DEFAULT_BLOCK = 1 << 20


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class StagingBlock:
    """One mapped HOST buffer of a pool."""

    __slots__ = ("handle", "iova", "size", "view", "mem", "used", "last_seq")

    def __init__(self, handle: int, iova: int, size: int, view: np.ndarray) -> None:
        self.handle = handle
        self.iova = iova
        self.size = size
        self.view = view             # uint8, length `size`
        self.mem = view.data         # the same bytes as a memoryview (cheap to slice)
        self.used = 0                # bump pointer
        self.last_seq = -1           # last submission that uses this block

    def region(self, offset: int, nbytes: int) -> np.ndarray:
        return self.view[offset:offset + nbytes]


class Region:
    """`nbytes` bytes at `offset` in a staging block (made once per upload, download or
    submission: a plain slotted object, cheap to build)."""

    __slots__ = ("block", "offset", "nbytes")

    def __init__(self, block: StagingBlock, offset: int, nbytes: int) -> None:
        self.block = block
        self.offset = offset
        self.nbytes = nbytes

    @property
    def iova(self) -> int:
        return self.block.iova + self.offset

    @property
    def handle(self) -> int:
        return self.block.handle

    def array(self) -> np.ndarray:
        """Zero-copy uint8 view of this region."""
        return self.block.region(self.offset, self.nbytes)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Copy `data` (exactly `nbytes` bytes) into the region: one memcpy."""
        self.block.mem[self.offset:self.offset + self.nbytes] = data

    def __repr__(self) -> str:
        return f"<Region handle={self.block.handle} offset={self.offset} nbytes={self.nbytes}>"


class StagingPool:
    """Bump allocator over HOST buffers, one pool per stream.

    `is_idle(seq)` says whether submission `seq` has completed; `poll()` asks the
    driver (without blocking) so that finished blocks can be reused before a sync.
    """

    def __init__(self, drv: DriverFile, is_idle: Callable[[int], bool],
                 poll: Callable[[], None], block_size: int = DEFAULT_BLOCK) -> None:
        self._drv = drv
        self._is_idle = is_idle
        self._poll = poll
        self.block_size = block_size
        self.blocks: list[StagingBlock] = []
        self._current: StagingBlock | None = None

    def alloc(self, nbytes: int, seq: int) -> Region:
        """A region of `nbytes` usable by submission `seq` (and not before it ends)."""
        cur = self._current
        if cur is not None:
            start = self._bump(cur, nbytes, seq)
            if start is not None:
                return Region(cur, start, nbytes)
        block, start = self._place(nbytes, seq)
        return Region(block, start, nbytes)

    def put(self, data: bytes | bytearray | memoryview, seq: int) -> tuple[StagingBlock, int]:
        """Copy `data` into a region for submission `seq` (alloc + Region.write): the
        block and offset it went to, with no Region built."""
        nbytes = len(data)
        cur = self._current
        start = None if cur is None else self._bump(cur, nbytes, seq)
        if cur is None or start is None:
            cur, start = self._place(nbytes, seq)
        cur.mem[start:start + nbytes] = data
        return cur, start

    @staticmethod
    def _bump(block: StagingBlock, nbytes: int, seq: int) -> int | None:
        """Take `nbytes` from the tail of `block` for submission `seq`: their offset, or
        None if the tail is too short."""
        start = (block.used + ALIGN - 1) // ALIGN * ALIGN
        if start + nbytes > block.size:
            return None
        block.used = start + nbytes
        if block.last_seq < seq:
            block.last_seq = seq
        return start

    def _place(self, nbytes: int, seq: int) -> tuple[StagingBlock, int]:
        """Where `nbytes` go once the tail of the block in use is too short: an idle
        block, from its start; else the tail of any busy block; else, after asking the
        driver what finished, an idle block again; else a new block."""
        block = self._find_idle(nbytes)
        if block is None:
            for b in self.blocks:
                start = self._bump(b, nbytes, seq)
                if start is not None:
                    return b, start
            if self.blocks:
                self._poll()
                block = self._find_idle(nbytes)
        if block is None:
            block = self._new_block(nbytes)
        block.used = 0
        self._current = block
        start = self._bump(block, nbytes, seq)
        assert start == 0, "an idle or new block holds at least nbytes"
        return block, start

    def _find_idle(self, nbytes: int) -> StagingBlock | None:
        best: StagingBlock | None = None
        for b in self.blocks:
            if b.size >= nbytes and (best is None or b.size < best.size) \
                    and self._is_idle(b.last_seq):
                best = b
        return best

    def _new_block(self, nbytes: int) -> StagingBlock:
        size = max(self.block_size, _round_up(nbytes, PAGE))
        try:
            handle, iova = self._drv.bo_create(size, uapi.BO_HOST)
        except DriverError as e:
            if e.errno != errno.ENOMEM:
                raise
            self.trim()  # give back idle blocks, then try once more
            handle, iova = self._drv.bo_create(size, uapi.BO_HOST)
        try:
            view = self._drv.mmap(handle, size)
        except BaseException:
            self._drv.bo_free(handle)
            raise
        block = StagingBlock(handle, iova, size, view)
        self.blocks.append(block)
        return block

    def trim(self) -> None:
        """Free every idle block (returns guest memory under pressure)."""
        keep = []
        for b in self.blocks:
            if self._is_idle(b.last_seq):
                self._drv.bo_free(b.handle)
                if b is self._current:
                    self._current = None
            else:
                keep.append(b)
        self.blocks = keep

    def release_all(self) -> None:
        """Free every block; the caller guarantees nothing in flight still uses them."""
        blocks, self.blocks, self._current = self.blocks, [], None
        for b in blocks:
            self._drv.bo_free(b.handle)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.blocks)
