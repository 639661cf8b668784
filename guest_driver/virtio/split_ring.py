"""Split virtqueue, driver side (virtio 1.x §2.7; VA-1 datasheet §4); drivers get it
from `ring_factory.make_driver_ring` and use it as a `ring.DriverRing`.

The driver keeps its own record of every chain it made available (descriptor ids,
writable capacity, the caller's token) and never re-reads descriptors from shared
memory. What the device writes (used.idx, used.ring[].id/.len) is checked against that
record: a bad entry sets `broken` to a named reason instead of crashing or hanging.
"""
from __future__ import annotations

import struct
from collections import deque
from typing import Callable, Generic, Iterable, Sequence, TypeVar

from hwspec import virtio as V

from ..kernel import PhysMemory
from ..mm import RangeAllocator, align_up
from .ring import QueueFull, RingError, Segment

__all__ = ["QueueFull", "RingError", "RingLayout", "SplitQueue", "vring_need_event"]

T = TypeVar("T")

_DESC = struct.Struct(V.DESC.format)
_DESC2 = struct.Struct("<" + 2 * V.DESC.format.lstrip("<"))   # two descriptors in a row
_DSIZE = V.DESC.size
_USED_ELEM = struct.Struct(V.USED_ELEM.format)
_U16 = struct.Struct("<H")


def vring_need_event(event_idx: int, new_idx: int, old_idx: int) -> bool:
    """virtio 1.x §2.7.10: notify iff event_idx lies in [old_idx, new_idx) (mod 2^16)."""
    return ((new_idx - event_idx - 1) & 0xFFFF) < ((new_idx - old_idx) & 0xFFFF)


class RingLayout:
    """Offsets of one split ring inside a single contiguous allocation."""

    def __init__(self, num: int, max_indirect: int) -> None:
        if num <= 0 or num & (num - 1) or num > V.QUEUE_SIZE_MAX:
            raise ValueError(f"queue size {num} is not a power of two in 1..{V.QUEUE_SIZE_MAX}")
        self.num = num
        self.desc = 0
        self.avail = align_up(V.desc_table_size(num), V.AVAIL_ALIGN)
        self.used = align_up(self.avail + V.avail_ring_size(num), V.USED_ALIGN)
        self.indirect = align_up(self.used + V.used_ring_size(num), V.DESC_ALIGN)
        self.indirect_stride = V.DESC.size * max_indirect
        self.total = self.indirect + num * self.indirect_stride
        # fields inside the areas
        self.avail_idx = self.avail + 2
        self.avail_ring = self.avail + V.AVAIL_HEADER
        self.used_event = self.avail + V.AVAIL_HEADER + V.AVAIL_ELEM * num
        self.used_idx = self.used + 2
        self.used_ring = self.used + V.USED_HEADER
        self.avail_event = self.used + V.USED_HEADER + V.USED_ELEM.size * num


class SplitQueue(Generic[T]):
    """One split virtqueue: descriptor free list, avail publication, used reaping."""

    def __init__(self, memory: PhysMemory, alloc: RangeAllocator, index: int, num: int, *,
                 indirect: bool, event_idx: bool, in_order: bool = False,
                 notification_data: bool = False, max_indirect: int = 8) -> None:
        self.memory = memory
        self.index = index
        self.num = num
        self.indirect = indirect
        self.event_idx = event_idx
        self.in_order = in_order
        self.notify_with_data = notification_data
        self.features = ((1 << V.F_RING_INDIRECT_DESC if indirect else 0)
                         | (1 << V.F_RING_EVENT_IDX if event_idx else 0)
                         | (1 << V.F_IN_ORDER if in_order else 0)
                         | (1 << V.F_NOTIFICATION_DATA if notification_data else 0))
        self.max_indirect = max_indirect if indirect else 0
        self.layout = RingLayout(num, self.max_indirect)
        self._pair_need = self.descs_needed(2)   # what `add_pair` takes
        self._alloc = alloc
        self.base = alloc.alloc(self.layout.total, 4096)
        # The whole ring allocation as one memoryview, bounds-checked once here: every
        # field access is then a struct pack_into/unpack_from at a fixed offset.
        self._ring = memory.view(self.base, self.layout.total).data.cast("B")
        # where the device publishes used.idx (DriverRing.used_view)
        self.used_view: memoryview | None = self._ring
        self.used_off = self.layout.used_idx
        self.broken: str | None = None
        self._free: list[int] = []
        self._ring_order: deque[int] = deque()   # IN_ORDER: free descriptors, ring order
        self._heads: deque[int] = deque()        # IN_ORDER: heads in the order made available
        self._tokens: list[T | None] = []
        self._chains: list[tuple[int, ...]] = []
        self._wcap: list[int] = []
        self.avail_idx = 0
        self.last_used = 0
        self._kicked_idx = 0
        self.in_flight = 0
        self.reset()

    # ---- addresses handed to the transport ----------------------------------------------
    @property
    def desc_addr(self) -> int:
        return self.base + self.layout.desc

    @property
    def driver_addr(self) -> int:
        return self.base + self.layout.avail

    @property
    def device_addr(self) -> int:
        return self.base + self.layout.used

    def reset(self) -> None:
        """Forget everything (after a device reset; tokens must have been drained)."""
        self.memory.write(self.base, bytes(self.layout.total))
        self._free = list(range(self.num - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._ring_order = deque(range(self.num))      # IN_ORDER: 0, 1, 2, ... wrapping
        self._bind_free()
        self._heads = deque()
        self._tokens = [None] * self.num
        self._chains = [()] * self.num
        self._wcap = [0] * self.num
        self.avail_idx = 0
        self.last_used = 0
        self._kicked_idx = 0
        self.in_flight = 0
        self.broken = None
        self._irq_off = False   # avail.flags holds NO_INTERRUPT (disable_interrupts)

    def release(self) -> None:
        self._alloc.free(self.base)

    def _bind_free(self) -> None:
        """Bind the free descriptors of this ring's kind once (after every reset):
        `_take()` hands out the lowest free one, or with IN_ORDER the next in ring order
        (virtio 1.x §2.7.9: the driver uses descriptors in ring order); `_give_back`
        returns a chain as `add` recorded it (reversed without IN_ORDER, so that the
        lowest id comes out first again)."""
        free: list[int] | deque[int] = self._ring_order if self.in_order else self._free
        self._free_descs = free
        self._take: Callable[[], int] = (self._ring_order.popleft if self.in_order
                                         else self._free.pop)
        self._give_back: Callable[[Iterable[int]], None] = free.extend

    @property
    def num_free(self) -> int:
        return len(self._free_descs)

    def descs_needed(self, nsegs: int) -> int:
        return 1 if self._use_indirect(nsegs) else nsegs

    def _use_indirect(self, nsegs: int) -> bool:
        return self.indirect and 1 < nsegs <= self.max_indirect

    # ---- adding requests ---------------------------------------------------------------
    def add(self, readable: Sequence[Segment], writable: Sequence[Segment], token: T) -> int:
        """Make one request available (not yet notified); return its head id."""
        if self.broken:
            raise RingError(f"queue {self.index} is broken: {self.broken}")
        nsegs = len(readable) + len(writable)
        if not nsegs:
            raise ValueError("a request needs at least one segment")
        indirect = self.indirect and 1 < nsegs <= self.max_indirect   # _use_indirect
        if nsegs > self.num and not indirect:
            raise ValueError(f"{nsegs} segments cannot fit queue {self.index} of {self.num}")
        need = 1 if indirect else nsegs
        if need > len(self._free_descs):   # num_free
            raise QueueFull(f"queue {self.index}: {need} descriptors needed, "
                            f"{self.num_free} free")
        ring = self._ring
        lay = self.layout
        pack = _DESC.pack_into
        # one pass over the segments, readable then writable; each descriptor links to
        # the next one of the chain (NEXT), the last to none
        if indirect:
            head = self._take()
            chain: tuple[int, ...] = (head,)
            toff = lay.indirect + head * lay.indirect_stride
            i = 0
            for segs, wflag in ((readable, 0), (writable, V.DESC_F_WRITE)):
                for addr, length in segs:
                    i += 1
                    if i < nsegs:
                        pack(ring, toff, addr, length, wflag | V.DESC_F_NEXT, i)
                    else:
                        pack(ring, toff, addr, length, wflag, 0)
                    toff += _DSIZE
            pack(ring, lay.desc + head * _DSIZE, self.base + toff - _DSIZE * nsegs,
                 _DSIZE * nsegs, V.DESC_F_INDIRECT, 0)
        else:
            take = self._take
            ids = [take() for _ in range(nsegs)]
            chain = tuple(ids) if self.in_order else tuple(reversed(ids))   # _give_back order
            head = ids[0]
            i = 0
            for segs, wflag in ((readable, 0), (writable, V.DESC_F_WRITE)):
                for addr, length in segs:
                    i += 1
                    if i < nsegs:
                        pack(ring, lay.desc + ids[i - 1] * _DSIZE, addr, length,
                             wflag | V.DESC_F_NEXT, ids[i])
                    else:
                        pack(ring, lay.desc + ids[i - 1] * _DSIZE, addr, length, wflag, 0)
        wcap = 0
        for _, n in writable:
            wcap += n
        self._tokens[head] = token
        self._chains[head] = chain
        self._wcap[head] = wcap
        self.in_flight += 1
        if self.in_order:
            self._heads.append(head)
        slot = self.avail_idx % self.num
        _U16.pack_into(ring, lay.avail_ring + V.AVAIL_ELEM * slot, head)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        _U16.pack_into(ring, lay.avail_idx, self.avail_idx)
        return head

    def add_pair(self, raddr: int, rlen: int, waddr: int, wlen: int, token: T) -> bool:
        """`add(((raddr, rlen),), ((waddr, wlen),), token)` then `kick_prepare()`, the
        usual request written in one go: an indirect table of two when the ring has
        them, else two descriptors. A broken ring or too few free descriptors go to
        `add`, which raises."""
        if self.broken or len(self._free_descs) < self._pair_need:
            self.add(((raddr, rlen),), ((waddr, wlen),), token)
            return self.kick_prepare()
        ring = self._ring
        lay = self.layout
        take = self._take
        head = take()
        if self._pair_need == 1:   # indirect
            toff = lay.indirect + head * lay.indirect_stride
            _DESC2.pack_into(ring, toff, raddr, rlen, V.DESC_F_NEXT, 1,
                             waddr, wlen, V.DESC_F_WRITE, 0)
            _DESC.pack_into(ring, lay.desc + head * _DSIZE, self.base + toff, 2 * _DSIZE,
                            V.DESC_F_INDIRECT, 0)
            self._chains[head] = (head,)
        else:
            nxt = take()
            _DESC.pack_into(ring, lay.desc + head * _DSIZE, raddr, rlen, V.DESC_F_NEXT, nxt)
            _DESC.pack_into(ring, lay.desc + nxt * _DSIZE, waddr, wlen, V.DESC_F_WRITE, 0)
            self._chains[head] = (head, nxt) if self.in_order else (nxt, head)
        self._tokens[head] = token
        self._wcap[head] = wlen
        self.in_flight += 1
        if self.in_order:
            self._heads.append(head)
        old = self.avail_idx
        _U16.pack_into(ring, lay.avail_ring + V.AVAIL_ELEM * (old % self.num), head)
        self.avail_idx = new = (old + 1) & 0xFFFF
        _U16.pack_into(ring, lay.avail_idx, new)
        return self.kick_prepare()

    def kick_prepare(self) -> bool:
        """Whether the device must be notified of what was added since the last call."""
        new, old = self.avail_idx, self._kicked_idx
        self._kicked_idx = new
        if new == old:
            return False
        if self.event_idx:
            event: int = _U16.unpack_from(self._ring, self.layout.avail_event)[0]
            return vring_need_event(event, new, old)
        (flags,) = _U16.unpack_from(self._ring, self.layout.used)
        return not flags & V.USED_F_NO_NOTIFY

    def notification_data(self) -> int | None:
        """NOTIFICATION_DATA: the avail index (next_off: its 15 low bits, next_wrap: bit
        15), i.e. the 16 bits after the queue index in the notification."""
        return self.avail_idx if self.notify_with_data else None

    # ---- reaping ----------------------------------------------------------------------
    def used_idx(self) -> int:
        return int(_U16.unpack_from(self._ring, self.layout.used_idx)[0])

    def has_used(self) -> bool:
        return (not self.broken   # used_idx(), inline: looked at on every interrupt
                and _U16.unpack_from(self._ring, self.layout.used_idx)[0] != self.last_used)

    def get_used(self) -> list[tuple[T, int]]:
        """Reap every used entry the device published; check each one.

        On a bad entry `broken` is set (naming what was wrong) and reaping stops; the
        entries before it are returned normally.
        """
        out: list[tuple[T, int]] = []
        if self.broken:
            return out
        used_idx = _U16.unpack_from(self._ring, self.layout.used_idx)[0]   # used_idx()
        pending = (used_idx - self.last_used) & 0xFFFF
        if not pending:
            return out
        if pending > self.in_flight:
            self.broken = (f"used.idx jumped to {used_idx} from {self.last_used}: {pending} "
                           f"entries but only {self.in_flight} requests in flight")
            return out
        ring = self._ring
        used_ring, esize = self.layout.used_ring, V.USED_ELEM.size
        num, tokens, chains, wcaps = self.num, self._tokens, self._chains, self._wcap
        while pending:
            last = self.last_used
            uid, ulen = _USED_ELEM.unpack_from(ring, used_ring + esize * (last % num))
            if uid >= num:
                self.broken = f"used id {uid} out of range (queue size {num})"
                return out
            token = tokens[uid]
            if token is None:
                self.broken = f"used id {uid} is not the head of a request in flight"
                return out
            if ulen > wcaps[uid]:
                self.broken = (f"used len {ulen} for id {uid} exceeds its writable capacity "
                               f"{wcaps[uid]}")
                return out
            if not self.in_order:   # one element, one request
                tokens[uid] = None
                self._give_back(chains[uid])
                chains[uid] = ()
                self.in_flight -= 1
                out.append((token, ulen))
                self.last_used = (last + 1) & 0xFFFF
                pending -= 1
                continue
            # one element may stand for a batch ending at uid (virtio 1.x §2.7.9)
            if uid not in self._heads:
                self.broken = f"used id {uid} is not in the in-order list"
                return out
            n = self._heads.index(uid) + 1
            if n > pending:
                self.broken = (f"used id {uid} ends a batch of {n} but used.idx moved "
                               f"only {pending}")
                return out
            for h in [self._heads.popleft() for _ in range(n)]:
                tok = tokens[h]
                assert tok is not None
                tokens[h] = None
                self._give_back(chains[h])
                chains[h] = ()
                self.in_flight -= 1
                out.append((tok, ulen if h == uid else wcaps[h]))
            self.last_used = (last + n) & 0xFFFF
            pending -= n
        return out

    def enable_interrupts(self) -> bool:
        """Ask for an interrupt at the next used entry; True if entries are already pending
        (the caller must reap again: they may have landed before used_event was seen)."""
        if self.event_idx:
            _U16.pack_into(self._ring, self.layout.used_event, self.last_used)
        elif self._irq_off:
            _U16.pack_into(self._ring, self.layout.avail, 0)   # avail.flags
            self._irq_off = False
        return (not self.broken  # has_used()
                and _U16.unpack_from(self._ring, self.layout.used_idx)[0] != self.last_used)

    def disable_interrupts(self) -> None:
        """EVENT_IDX: used_event one behind the next entry (used.idx never passes it
        until it wraps); else VRING_AVAIL_F_NO_INTERRUPT (virtio 1.x §2.7.7, §2.7.10)."""
        if self.event_idx:
            _U16.pack_into(self._ring, self.layout.used_event, (self.last_used - 1) & 0xFFFF)
        else:
            _U16.pack_into(self._ring, self.layout.avail, V.AVAIL_F_NO_INTERRUPT)
            self._irq_off = True

    def drain(self) -> list[T]:
        """Take back every request in flight (device reset); tokens in head order."""
        tokens = [t for t in self._tokens if t is not None]
        self._tokens = [None] * self.num
        self.in_flight = 0
        self._heads.clear()
        return tokens
