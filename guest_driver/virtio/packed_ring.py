"""Packed virtqueue, driver side (virtio 1.x §2.8; VA-1 datasheet §4.6); drivers get it
from `ring_factory.make_driver_ring` and use it as a `ring.DriverRing`.

One descriptor ring in one allocation with the two event-suppression structures and the
indirect tables: [descriptors][driver event][device event][indirect tables]. The driver
fills slots in ring order, flipping its wrap counter at the end; a request's descriptors
all carry its buffer id, and the head's flags are written last so the device never sees
half a request. The device answers with one used descriptor per request (or per batch,
with IN_ORDER); the driver knows how many slots each id took and skips them.

Like the split ring, everything the device writes is checked against the driver's own
record (ids in flight, their slot counts and writable capacity); a bad used descriptor
sets `broken` to a named reason. Written independently of the device side.
"""
from __future__ import annotations

import struct
from collections import deque
from typing import Generic, Sequence, TypeVar

from hwspec import virtio as V

from ..kernel import PhysMemory
from ..mm import RangeAllocator, align_up
from .ring import QueueFull, RingError, Segment

__all__ = ["PackedQueue"]

T = TypeVar("T")

_DESC = struct.Struct(V.PACKED_DESC.format)
_EVENT = struct.Struct(V.PACKED_EVENT.format)
_U16 = struct.Struct("<H")
_DSIZE = V.PACKED_DESC.size
_FLAGS_AT = V.PACKED_DESC.offsets["flags"]
_WRAP_BIT = V.PACKED_EVENT_F_WRAP_CTR


class PackedQueue(Generic[T]):
    """One packed virtqueue: slot and id allocation, publication, used reaping."""

    # no used index (the device marks used descriptors): `has_used()` says (DriverRing)
    used_view: memoryview | None = None
    used_off = 0
    last_used = 0

    def __init__(self, memory: PhysMemory, alloc: RangeAllocator, index: int, num: int, *,
                 indirect: bool, event_idx: bool, in_order: bool = False,
                 notification_data: bool = False, max_indirect: int = 8) -> None:
        if not 0 < num <= V.PACKED_QUEUE_SIZE_MAX:
            raise ValueError(f"packed queue size {num} outside 1..{V.PACKED_QUEUE_SIZE_MAX}")
        self.memory = memory
        self.index = index
        self.num = num
        self.indirect = indirect
        self.event_idx = event_idx
        self.in_order = in_order
        self.notify_with_data = notification_data
        self.features = ((1 << V.F_RING_PACKED)
                         | (1 << V.F_RING_INDIRECT_DESC if indirect else 0)
                         | (1 << V.F_RING_EVENT_IDX if event_idx else 0)
                         | (1 << V.F_IN_ORDER if in_order else 0)
                         | (1 << V.F_NOTIFICATION_DATA if notification_data else 0))
        self.max_indirect = max_indirect if indirect else 0
        self._drv_event = align_up(V.packed_ring_size(num), V.PACKED_EVENT_ALIGN)
        self._dev_event = self._drv_event + V.PACKED_EVENT.size
        self._tables = align_up(self._dev_event + V.PACKED_EVENT.size, V.PACKED_DESC_ALIGN)
        self._table_size = _DSIZE * self.max_indirect
        self.total = self._tables + num * self._table_size
        self._alloc = alloc
        self.base = alloc.alloc(self.total, 4096)
        self._mem = memory.view(self.base, self.total).data.cast("B")
        self.broken: str | None = None
        self.reset()

    # ---- addresses handed to the transport ----------------------------------------------
    @property
    def desc_addr(self) -> int:
        return self.base

    @property
    def driver_addr(self) -> int:
        return self.base + self._drv_event

    @property
    def device_addr(self) -> int:
        return self.base + self._dev_event

    def reset(self) -> None:
        """Empty ring, wrap counters 1 (after a device or queue reset; drained first)."""
        self.memory.write(self.base, bytes(self.total))
        self._slot, self._wrap = 0, 1            # where the next request goes
        self._used_slot, self._used_wrap = 0, 1  # where the next used descriptor lands
        self._free_slots = self.num
        self._ids = list(range(self.num - 1, -1, -1))
        self._tokens: dict[int, T] = {}          # id -> token, in the order made available
        self._slots: dict[int, int] = {}         # id -> ring slots it took
        self._wcap: dict[int, int] = {}          # id -> writable bytes
        self._order: deque[int] = deque()        # IN_ORDER: ids in the order made available
        self._kicked = 0
        self.broken = None
        self._irq_off = False   # driver event flags hold DISABLE (disable_interrupts)

    def release(self) -> None:
        self._alloc.free(self.base)

    @property
    def in_flight(self) -> int:
        return len(self._tokens)

    @property
    def num_free(self) -> int:
        return self._free_slots if self._ids else 0

    def descs_needed(self, nsegs: int) -> int:
        return 1 if self._use_indirect(nsegs) else nsegs

    def _use_indirect(self, nsegs: int) -> bool:
        return self.indirect and 1 < nsegs <= self.max_indirect

    def _linear(self, slot: int, wrap: int) -> int:
        """A ring position with its wrap counter as one number modulo 2 * num."""
        return slot + (0 if wrap else self.num)

    # ---- adding requests ---------------------------------------------------------------
    def add(self, readable: Sequence[Segment], writable: Sequence[Segment], token: T) -> int:
        """Make one request available (not yet notified); return its buffer id."""
        if self.broken:
            raise RingError(f"queue {self.index} is broken: {self.broken}")
        segs = [(a, n, 0) for a, n in readable] + [(a, n, V.DESC_F_WRITE) for a, n in writable]
        if not segs:
            raise ValueError("a request needs at least one segment")
        if len(segs) > self.num and not self._use_indirect(len(segs)):
            raise ValueError(f"{len(segs)} segments cannot fit queue {self.index} of {self.num}")
        need = self.descs_needed(len(segs))
        if need > self.num_free:
            raise QueueFull(f"queue {self.index}: {need} descriptors needed, "
                            f"{self.num_free} free")
        bid = self._ids.pop()
        if self._use_indirect(len(segs)):
            toff = self._tables + bid * self._table_size
            for i, (addr, length, flags) in enumerate(segs):
                _DESC.pack_into(self._mem, toff + i * _DSIZE, addr, length, 0, flags)
            ring_descs = [(self.base + toff, _DSIZE * len(segs), V.DESC_F_INDIRECT)]
        else:
            ring_descs = [(a, n, f | (V.DESC_F_NEXT if i < len(segs) - 1 else 0))
                          for i, (a, n, f) in enumerate(segs)]
        head_slot, head_flags = self._slot, 0
        for i, (addr, length, flags) in enumerate(ring_descs):
            avail = (V.DESC_F_AVAIL if self._wrap else V.DESC_F_USED)
            if i == 0:
                head_flags = flags | avail
                _DESC.pack_into(self._mem, self._slot * _DSIZE, addr, length, bid, 0)
            else:
                _DESC.pack_into(self._mem, self._slot * _DSIZE, addr, length, bid,
                                flags | avail)
            self._slot += 1
            if self._slot == self.num:
                self._slot, self._wrap = 0, self._wrap ^ 1
        # the head's flags last: the device never sees a half-written request
        _U16.pack_into(self._mem, head_slot * _DSIZE + _FLAGS_AT, head_flags)
        self._free_slots -= len(ring_descs)
        self._tokens[bid] = token
        self._slots[bid] = len(ring_descs)
        self._wcap[bid] = sum(n for _, n in writable)
        if self.in_order:
            self._order.append(bid)
        return bid

    def add_pair(self, raddr: int, rlen: int, waddr: int, wlen: int, token: T) -> bool:
        """`add` of one readable and one writable segment, then `kick_prepare` (DriverRing)."""
        self.add(((raddr, rlen),), ((waddr, wlen),), token)
        return self.kick_prepare()

    def kick_prepare(self) -> bool:
        """Whether the device must be notified of what was added since the last call."""
        new, old = self._linear(self._slot, self._wrap), self._kicked
        self._kicked = new
        if new == old:
            return False
        off_wrap, flags = _EVENT.unpack_from(self._mem, self._dev_event)
        mode = flags & V.PACKED_EVENT_FLAGS_MASK
        if mode == V.PACKED_EVENT_FLAG_DISABLE:
            return False
        if mode == V.PACKED_EVENT_FLAG_DESC and self.event_idx:
            off = off_wrap & ((1 << _WRAP_BIT) - 1)
            if off < self.num:
                event = self._linear(off, off_wrap >> _WRAP_BIT & 1)
                m = 2 * self.num
                return (new - event - 1) % m < (new - old) % m
        return True  # ENABLE, or a structure the driver cannot read: notify

    def notification_data(self) -> int | None:
        """NOTIFICATION_DATA: next_off | next_wrap << 15 of the next slot to fill."""
        if not self.notify_with_data:
            return None
        return self._slot | self._wrap << 15

    # ---- reaping ----------------------------------------------------------------------
    def _used_flags(self) -> int:
        return int(_U16.unpack_from(self._mem, self._used_slot * _DSIZE + _FLAGS_AT)[0])

    def _is_used(self, flags: int) -> bool:
        w = self._used_wrap
        return (flags >> V.PACKED_DESC_F_USED & 1) == w and (flags >> V.PACKED_DESC_F_AVAIL & 1) == w

    def has_used(self) -> bool:
        return not self.broken and bool(self._tokens) and self._is_used(self._used_flags())

    def get_used(self) -> list[tuple[T, int]]:
        """Reap every used descriptor the device wrote; check each one. On a bad one
        `broken` is set (naming what was wrong) and reaping stops; what came before it
        is returned normally."""
        out: list[tuple[T, int]] = []
        while not self.broken and self._tokens:
            flags = self._used_flags()
            if not self._is_used(flags):
                break
            _, ulen, bid, _ = _DESC.unpack_from(self._mem, self._used_slot * _DSIZE)
            if bid >= self.num:
                self.broken = f"used id {bid} out of range (queue size {self.num})"
                break
            if bid not in self._tokens:
                self.broken = f"used id {bid} is not a request in flight"
                break
            if not flags & V.DESC_F_WRITE:
                ulen = 0   # the length is reserved without WRITE (§2.8.4)
            if ulen > self._wcap[bid]:
                self.broken = (f"used len {ulen} for id {bid} exceeds its writable capacity "
                               f"{self._wcap[bid]}")
                break
            batch = [bid]
            if self.in_order:
                if bid not in self._order:
                    self.broken = f"used id {bid} is not in the in-order list"
                    break
                batch = []
                while True:
                    b = self._order.popleft()
                    batch.append(b)
                    if b == bid:
                        break
            for b in batch:
                token = self._tokens.pop(b)
                got = ulen if b == bid else self._wcap[b]   # skipped: used completely
                self._advance(self._slots.pop(b))
                self._wcap.pop(b)
                self._ids.append(b)
                out.append((token, got))
        return out

    def _advance(self, slots: int) -> None:
        self._free_slots += slots
        self._used_slot += slots
        if self._used_slot >= self.num:
            self._used_slot -= self.num
            self._used_wrap ^= 1

    def enable_interrupts(self) -> bool:
        """Ask for an interrupt at the next used descriptor (EVENT_IDX: at exactly that
        slot, else ENABLE); True if used descriptors are already there."""
        if self.event_idx:
            _EVENT.pack_into(self._mem, self._drv_event,
                             self._used_slot | self._used_wrap << _WRAP_BIT,
                             V.PACKED_EVENT_FLAG_DESC)
        elif self._irq_off:
            _EVENT.pack_into(self._mem, self._drv_event, 0, V.PACKED_EVENT_FLAG_ENABLE)
            self._irq_off = False
        return self.has_used()

    def disable_interrupts(self) -> None:
        """Driver event suppression DISABLE (virtio 1.x §2.8.10)."""
        _EVENT.pack_into(self._mem, self._drv_event, 0, V.PACKED_EVENT_FLAG_DISABLE)
        self._irq_off = True

    def drain(self) -> list[T]:
        """Take back every request in flight (device or queue reset), in the order they
        were made available."""
        tokens = list(self._tokens.values())
        self._tokens.clear()
        return tokens
