"""Device side of a virtio 1.x packed virtqueue (virtio 1.x §2.8; VA-1 spec §4.6).

One descriptor ring that both sides write: the driver makes descriptors available by
setting AVAIL to its wrap counter and USED to the inverse; the device hands a whole
buffer back by writing one used descriptor (AVAIL = USED = its wrap counter) holding the
buffer id, then skipping as many ring slots as the buffer took. Two event-suppression
structures replace the split ring's flags and event indices: the driver's (driver area,
read here) says when it wants a used-buffer notification, the device's (device area,
written here) when the device wants an available-buffer notification.

Every rule is checked while a buffer is walked, before the device touches any of its
memory; a broken rule raises `RingError` naming it. All ring memory is reached through
the `DmaPort`. Written from the spec and hwspec alone (the driver side is its oracle).
"""
from __future__ import annotations

import struct

from hwspec import virtio as V

from ..ports import DmaFault, DmaPort
from .in_order import UsedOrder
from .queue import Queue
from .ring import Descriptor, DescriptorChain, RingError, ring_read, ring_write

_U64 = 1 << 64
_DESC = struct.Struct(V.PACKED_DESC.format)
_Bufs = tuple[list[Descriptor], list[Descriptor]]
_DESC_SIZE = V.PACKED_DESC.size
_EVENT = struct.Struct(V.PACKED_EVENT.format)
_FLAGS_OFF = V.PACKED_DESC.offsets["flags"]
_OFF_MASK = (1 << V.PACKED_EVENT_F_WRAP_CTR) - 1
_TABLE_FLAGS = V.DESC_F_WRITE   # the only valid flag inside an indirect table


def need_event(event: int, new: int, old: int, modulus: int) -> bool:
    """Has position `event` been passed moving from old to new (positions counted
    modulo `modulus` = twice the ring: the wrap counter is the top "bit")?"""
    return (new - event - 1) % modulus < (new - old) % modulus


class PackedRing:
    """One packed virtqueue's device side: its registers, frozen at DRIVER_OK, and the
    device's positions and wrap counters (both start at 1)."""

    drained = False   # DeviceRing.drained: never known here, the next pop looks

    def __init__(self, queue: Queue, *, indirect: bool, event_idx: bool,
                 in_order: bool = False) -> None:
        self.size = queue.size
        self.ready = queue.ready
        self.desc_ring = queue.desc_table
        self.driver_event = queue.avail_ring    # driver area: driver event suppression
        self.device_event = queue.used_ring     # device area: device event suppression
        self.indirect = indirect
        self.event_idx = event_idx
        self.in_order = in_order
        self.next_avail = 0
        self.avail_wrap = 1
        self.next_used = 0
        self.used_wrap = 1
        self._in_flight: dict[int, int] = {}   # buffer id -> ring slots its list took
        self._order = UsedOrder() if in_order else None
        self._signalled = 0                    # linear used position at the last check

    @staticmethod
    def alignment_ok(queue: Queue) -> bool:
        return (queue.desc_table % V.PACKED_DESC_ALIGN == 0
                and queue.avail_ring % V.PACKED_EVENT_ALIGN == 0
                and queue.used_ring % V.PACKED_EVENT_ALIGN == 0)

    @staticmethod
    def size_ok(size: int) -> bool:
        """Packed rings take any size 1 .. 2^15 (virtio 1.x §2.8.10.1)."""
        return 0 < size <= V.PACKED_QUEUE_SIZE_MAX

    # --- ring memory ---------------------------------------------------------------------

    _read = staticmethod(ring_read)
    _write = staticmethod(ring_write)

    def check_rings(self, dma: DmaPort) -> None:
        """The descriptor ring and both event structures must be backed (ring/dma)."""
        for addr, size, what in (
                (self.desc_ring, V.packed_ring_size(self.size), "descriptor ring"),
                (self.driver_event, V.PACKED_EVENT.size, "driver event suppression"),
                (self.device_event, V.PACKED_EVENT.size, "device event suppression")):
            if addr + size > _U64:
                raise RingError("ring/addr-overflow", f"{what} at {addr:#x} overflows")
            try:
                probe = getattr(dma, "probe_view", None)
                if probe is not None:
                    probe(addr, size)
                else:
                    dma.view(addr, size)
            except DmaFault as e:
                raise RingError("ring/dma", f"{what}: {e}") from None

    def _desc(self, dma: DmaPort, pos: int) -> tuple[int, int, int, int]:
        raw = self._read(dma, self.desc_ring + _DESC_SIZE * pos, _DESC_SIZE,
                         f"descriptor {pos}")
        addr, length, bid, flags = _DESC.unpack(raw)
        return addr, length, bid, flags

    def _flags(self, dma: DmaPort, pos: int) -> int:
        raw = self._read(dma, self.desc_ring + _DESC_SIZE * pos + _FLAGS_OFF, 2,
                         f"descriptor {pos} flags")
        return int.from_bytes(raw, "little")

    @staticmethod
    def _available(flags: int, wrap: int) -> bool:
        """AVAIL matches the wrap counter and USED does not (§2.8.1)."""
        return (flags >> V.PACKED_DESC_F_AVAIL & 1) == wrap and \
            (flags >> V.PACKED_DESC_F_USED & 1) != wrap

    def _check_polarity(self, flags: int, wrap: int, pos: int) -> None:
        """At the next position a descriptor is available, or left over from the last lap.
        AVAIL = USED = the current wrap counter would be a used descriptor of this lap
        where the device has written none: the driver set the flags wrong."""
        a = flags >> V.PACKED_DESC_F_AVAIL & 1
        u = flags >> V.PACKED_DESC_F_USED & 1
        if a == u == wrap:
            raise RingError("ring/packed-avail-flags",
                            f"descriptor {pos}: AVAIL={a} USED={u} with wrap counter {wrap} "
                            "(an available descriptor has USED = !AVAIL)")

    # --- event suppression -----------------------------------------------------------

    def _event(self, dma: DmaPort, addr: int, what: str) -> tuple[int, int]:
        off_wrap, flags = _EVENT.unpack(self._read(dma, addr, V.PACKED_EVENT.size, what))
        return off_wrap, flags

    def driver_event_state(self, dma: DmaPort) -> tuple[int, int]:
        """The driver's event suppression (flags, off_wrap), checked: reserved bits or the
        reserved value 3, DESC without EVENT_IDX, an offset beyond the ring."""
        off_wrap, flags = self._event(dma, self.driver_event, "driver event suppression")
        mode = flags & V.PACKED_EVENT_FLAGS_MASK
        if flags & ~V.PACKED_EVENT_FLAGS_MASK or mode == 0x3:
            raise RingError("ring/event-flags", f"driver event suppression flags {flags:#x} "
                            "(reserved value or bits)")
        if mode == V.PACKED_EVENT_FLAG_DESC:
            if not self.event_idx:
                raise RingError("ring/event-flags", "driver event suppression flags DESC "
                                "without VIRTIO_F_RING_EVENT_IDX")
            if off_wrap & _OFF_MASK >= self.size:
                raise RingError("ring/event-off-range",
                                f"driver event suppression offset {off_wrap & _OFF_MASK} "
                                f">= queue size {self.size}")
        return mode, off_wrap

    def _publish_device_event(self, dma: DmaPort) -> None:
        """EVENT_IDX: ask for a notification when the next descriptor the device will read
        is made available (without it the structure stays ENABLE, as zeroed)."""
        if self.event_idx:
            off_wrap = self.next_avail | self.avail_wrap << V.PACKED_EVENT_F_WRAP_CTR
            self._write(dma, self.device_event, _EVENT.pack(off_wrap, V.PACKED_EVENT_FLAG_DESC),
                        "device event suppression")

    # --- taking buffers --------------------------------------------------------------

    def pending(self, dma: DmaPort) -> int:
        """1 when a buffer is available at the device's position, else 0 (checked)."""
        flags = self._flags(dma, self.next_avail)
        self._check_polarity(flags, self.avail_wrap, self.next_avail)
        return int(self._available(flags, self.avail_wrap))

    def pop(self, dma: DmaPort) -> DescriptorChain | None:
        """The next available buffer, fully checked, or None (then the device event
        structure is published). Raises RingError without touching any buffer."""
        self.check_rings(dma)
        self.driver_event_state(dma)
        if not self.pending(dma):
            self._publish_device_event(dma)
            return None
        chain, slots = self._walk(dma)
        if chain.head >= self.size:
            raise RingError("ring/packed-id-range",
                            f"buffer id {chain.head} >= queue size {self.size}")
        if chain.head in self._in_flight:
            raise RingError("ring/packed-id-in-flight",
                            f"buffer id {chain.head} made available while in flight")
        if self._order is not None:
            self._order.taken(chain.head, chain.writable_len)
        self._in_flight[chain.head] = slots
        self.next_avail += slots
        if self.next_avail >= self.size:
            self.next_avail -= self.size
            self.avail_wrap ^= 1
        self._publish_device_event(dma)
        return chain

    def _walk(self, dma: DmaPort) -> tuple[DescriptorChain, int]:
        """The buffer starting at the device's position: (chain, ring slots it takes)."""
        bufs: _Bufs = ([], [])   # readable, writable: the chain's once the walk ends
        pos, wrap = self.next_avail, self.avail_wrap
        start = pos
        seen_write = False
        slots = 0
        while True:
            slots += 1
            if slots > self.size:
                raise RingError("ring/packed-chain-len",
                                f"list from descriptor {start} longer than the queue "
                                f"({self.size})")
            addr, length, bid, flags = self._desc(dma, pos)
            if slots > 1 and not self._available(flags, wrap):
                raise RingError("ring/packed-chain-flags",
                                f"descriptor {pos} continues the list from {start} but is "
                                f"not available (flags {flags:#x}, wrap counter {wrap})")
            nxt = bool(flags & V.DESC_F_NEXT)
            if flags & V.DESC_F_INDIRECT:
                if not self.indirect:
                    raise RingError("ring/indirect-not-negotiated",
                                    f"descriptor {pos} is INDIRECT")
                if nxt:
                    raise RingError("ring/indirect-next",
                                    f"descriptor {pos} has INDIRECT and NEXT")
                if slots > 1:
                    raise RingError("ring/indirect-in-list",
                                    f"INDIRECT descriptor {pos} inside a list from {start}")
                self._walk_table(dma, pos, addr, length, bufs)
                seen_write = True
            else:
                write = bool(flags & V.DESC_F_WRITE)
                if not write and seen_write:
                    raise RingError("ring/write-before-read",
                                    f"readable descriptor {pos} after a writable one")
                seen_write = seen_write or write
                self._add(dma, bufs, addr, length, write, f"descriptor {pos}")
            pos += 1
            if pos == self.size:
                pos, wrap = 0, wrap ^ 1
            if not nxt:
                # the buffer id is the last descriptor's (§2.8.6)
                return DescriptorChain(bid, bufs[0], bufs[1], self), slots

    def _walk_table(self, dma: DmaPort, pos: int, addr: int, length: int,
                    bufs: "_Bufs") -> None:
        """An indirect table: len/16 descriptors in a row; only WRITE may be set."""
        if length == 0 or length % _DESC_SIZE or length // _DESC_SIZE > self.size:
            raise RingError("ring/indirect-len", f"indirect table length {length} of "
                            f"descriptor {pos} (multiple of {_DESC_SIZE}, at most "
                            f"{self.size} entries)")
        raw = self._read(dma, addr, length, "indirect table")
        seen_write = False
        for i in range(length // _DESC_SIZE):
            a, n, _bid, flags = _DESC.unpack_from(raw, i * _DESC_SIZE)
            if flags & V.DESC_F_INDIRECT:
                raise RingError("ring/indirect-nested",
                                f"INDIRECT entry {i} in the indirect table of descriptor {pos}")
            if flags & ~_TABLE_FLAGS:
                raise RingError("ring/indirect-flags",
                                f"entry {i} of the indirect table of descriptor {pos} has "
                                f"flags {flags:#x} (only WRITE is valid)")
            write = bool(flags & V.DESC_F_WRITE)
            if not write and seen_write:
                raise RingError("ring/write-before-read",
                                f"readable entry {i} after a writable one in the indirect "
                                f"table of descriptor {pos}")
            seen_write = seen_write or write
            self._add(dma, bufs, a, n, write, f"indirect entry {i}")

    @staticmethod
    def _add(dma: DmaPort, bufs: "_Bufs", addr: int, length: int, write: bool,
             what: str) -> None:
        if addr + length > _U64:
            raise RingError("ring/addr-overflow", f"{what}: {addr:#x}+{length} overflows")
        if length:
            try:
                dma.view(addr, length)
            except DmaFault as e:
                raise RingError("ring/dma", f"{what} buffer: {e}") from None
        bufs[write].append(Descriptor(addr, length, write))

    # --- notifications from the driver -------------------------------------------------

    def check_notification(self, dma: DmaPort, next_off: int, next_wrap: int) -> None:
        """NOTIFICATION_DATA: the driver says its next descriptor is at (next_off,
        next_wrap). The ring must hold that: at most a ring ahead of the device, and the
        descriptor just before it available (the list before it was made available in
        order). Raises RingError (notify/data)."""
        if next_off >= self.size:
            raise RingError("notify/data", f"next_off {next_off} >= queue size {self.size}")
        m = 2 * self.size
        here = self.next_avail + (0 if self.avail_wrap else self.size)
        claim = next_off + (0 if next_wrap else self.size)
        ahead = (claim - here) % m
        if ahead > self.size:
            raise RingError("notify/data", f"next_off {next_off} wrap {next_wrap} is "
                            f"{ahead - m} descriptors behind the device's position "
                            f"{self.next_avail} wrap {self.avail_wrap}")
        if ahead == 0:
            return
        prev = claim - 1 if claim else m - 1
        pos, wrap = prev % self.size, int(prev < self.size)
        if not self._available(self._flags(dma, pos), wrap):
            raise RingError("notify/data", f"next_off {next_off} wrap {next_wrap}: "
                            f"descriptor {pos} before it is not available")

    # --- giving buffers back ---------------------------------------------------------

    def push_used(self, dma: DmaPort, head: int, length: int) -> None:
        """Give buffer `head` back with `length` bytes written (with IN_ORDER: once every
        buffer before it is back too, maybe in one batch)."""
        if self._order is None:
            self._write_used(dma, [head], length)
            return
        for ids, n in self._order.finish(head, length):
            self._write_used(dma, ids, n)

    def _write_used(self, dma: DmaPort, ids: list[int], length: int) -> None:
        """One used descriptor for the group `ids` (the last one's id and length) at the
        device's used position, then skip the slots the group took."""
        slots = 0
        for bid in ids:
            taken = self._in_flight.pop(bid, None)
            if taken is None:
                raise RingError("device/internal", f"used buffer id {bid} is not in flight")
            slots += taken
        w = self.used_wrap
        flags = ((V.DESC_F_AVAIL | V.DESC_F_USED) if w else 0) | \
            (V.DESC_F_WRITE if length else 0)
        self._write(dma, self.desc_ring + _DESC_SIZE * self.next_used,
                    _DESC.pack(0, length, ids[-1], flags), "used descriptor")
        self.next_used += slots
        if self.next_used >= self.size:
            self.next_used -= self.size
            self.used_wrap ^= 1

    def push_used_interrupt(self, dma: DmaPort, head: int, length: int) -> bool:
        """DeviceRing: push_used, then needs_interrupt."""
        self.push_used(dma, head, length)
        return self.needs_interrupt(dma)

    def _used_linear(self) -> int:
        return self.next_used + (0 if self.used_wrap else self.size)

    def needs_interrupt(self, dma: DmaPort) -> bool:
        """After giving buffers back: does the driver's event suppression ask for a used
        buffer notification? Raises RingError for a malformed structure."""
        old, new = self._signalled, self._used_linear()
        self._signalled = new
        if old == new:
            return False
        mode, off_wrap = self.driver_event_state(dma)
        if mode == V.PACKED_EVENT_FLAG_DISABLE:
            return False
        if mode == V.PACKED_EVENT_FLAG_ENABLE:
            return True
        wrap = off_wrap >> V.PACKED_EVENT_F_WRAP_CTR & 1
        event = (off_wrap & _OFF_MASK) + (0 if wrap else self.size)
        return need_event(event, new, old, 2 * self.size)
