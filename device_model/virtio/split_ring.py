"""Device side of a virtio 1.x split virtqueue (virtio 1.x §2.7; VA-1 spec §4).

Built by `ring_factory.make_device_ring` on the queue registers a transport holds, with
the ring features the driver negotiated (INDIRECT_DESC, EVENT_IDX). The device pops
chains and pushes used entries. Every ring rule of spec §4 is checked while a chain is
walked, before the device touches any buffer of it; a broken ring raises `RingError`
naming the rule. All ring memory is reached through the `DmaPort`.
"""
from __future__ import annotations

import struct

from hwspec import virtio as V

from ..ports import DmaFault, DmaPort
from ..testing_breaks import BREAKS
from .in_order import UsedOrder
from .queue import Queue
from .ring import Descriptor, DescriptorChain, RingError, ring_read, ring_write

_U64 = 1 << 64
_DESC_FMT = V.DESC.format
_DESC_SIZE = V.DESC.size
_USED_ELEM_FMT = V.USED_ELEM.format
_USED_ELEM_SIZE = V.USED_ELEM.size


def vring_need_event(event_idx: int, new_idx: int, old_idx: int) -> bool:
    """virtio 1.x §2.7.10: has `event_idx` been passed moving from old to new?"""
    return ((new_idx - event_idx - 1) & 0xFFFF) < ((new_idx - old_idx) & 0xFFFF)


class SplitRing:
    """One split virtqueue's device side: its registers, frozen at DRIVER_OK, and the
    device's indices."""

    def __init__(self, queue: Queue, *, indirect: bool, event_idx: bool,
                 in_order: bool = False) -> None:
        self.size = queue.size
        self.ready = queue.ready
        self.desc_table = queue.desc_table
        self.avail_ring = queue.avail_ring
        self.used_ring = queue.used_ring
        self.event_idx = event_idx
        self.indirect = indirect
        self.in_order = in_order
        self.last_avail_idx = 0
        self.next_used_idx = 0
        self._signalled_used = 0
        self._order = UsedOrder() if in_order else None
        self._next_desc = 0     # IN_ORDER: the descriptor the next chain must start at

    @staticmethod
    def alignment_ok(queue: Queue) -> bool:
        return (queue.desc_table % V.DESC_ALIGN == 0 and queue.avail_ring % V.AVAIL_ALIGN == 0
                and queue.used_ring % V.USED_ALIGN == 0)

    # --- ring memory helpers ---------------------------------------------------------

    _read = staticmethod(ring_read)
    _write = staticmethod(ring_write)

    def check_rings(self, dma: DmaPort) -> None:
        """All three ring areas must be backed (ring/dma) before any is used."""
        for addr, size, what in (
                (self.desc_table, V.desc_table_size(self.size), "descriptor table"),
                (self.avail_ring, V.avail_ring_size(self.size), "driver area"),
                (self.used_ring, V.used_ring_size(self.size), "device area")):
            if addr + size > _U64:
                raise RingError("ring/addr-overflow", f"{what} at {addr:#x} overflows")
            try:
                probe = getattr(dma, "probe_view", None)  # view()'s check, no view
                if probe is not None:
                    probe(addr, size)
                else:
                    dma.view(addr, size)
            except DmaFault as e:
                raise RingError("ring/dma", f"{what}: {e}") from None

    def avail_idx(self, dma: DmaPort) -> int:
        return int.from_bytes(self._read(dma, self.avail_ring + 2, 2, "avail.idx"), "little")

    def avail_flags(self, dma: DmaPort) -> int:
        return int.from_bytes(self._read(dma, self.avail_ring, 2, "avail.flags"), "little")

    def used_event(self, dma: DmaPort) -> int:
        off = self.avail_ring + V.AVAIL_HEADER + V.AVAIL_ELEM * self.size
        return int.from_bytes(self._read(dma, off, 2, "used_event"), "little")

    def publish_avail_event(self, dma: DmaPort) -> None:
        """EVENT_IDX: tell the driver the next available index the device will read."""
        if self.event_idx:
            off = self.used_ring + V.USED_HEADER + _USED_ELEM_SIZE * self.size
            self._write(dma, off, (self.last_avail_idx & 0xFFFF).to_bytes(2, "little"),
                        "avail_event")

    def pending(self, dma: DmaPort) -> int:
        """Chains the driver made available that the device has not read (checked)."""
        n = (self.avail_idx(dma) - self.last_avail_idx) & 0xFFFF
        if n > self.size and not (BREAKS and "ring/skip-avail-idx-check" in BREAKS):
            raise RingError("ring/avail-idx-jump",
                            f"avail.idx moved {n} past {self.last_avail_idx} (queue size "
                            f"{self.size})")
        return n

    # --- popping ---------------------------------------------------------------------

    def pop(self, dma: DmaPort) -> DescriptorChain | None:
        """The next available chain, fully checked, or None (then avail_event is
        published). Raises RingError without touching any buffer."""
        self.check_rings(dma)
        if self.pending(dma) == 0:
            self.publish_avail_event(dma)
            return None
        slot = self.last_avail_idx % self.size
        raw = self._read(dma, self.avail_ring + V.AVAIL_HEADER + V.AVAIL_ELEM * slot, 2,
                         "avail.ring")
        head = int.from_bytes(raw, "little")
        if head >= self.size and not (BREAKS and "ring/skip-index-range" in BREAKS):
            raise RingError("ring/head-range", f"head {head} >= queue size {self.size}")
        if self._order is not None and head != self._next_desc:
            raise RingError("ring/in-order-desc", f"head {head}: with IN_ORDER the next "
                            f"chain starts at descriptor {self._next_desc}")
        chain = self._walk(dma, head)
        if self._order is not None:
            self._order.taken(head, chain.writable_len)
        self.last_avail_idx = (self.last_avail_idx + 1) & 0xFFFF
        self.publish_avail_event(dma)
        chain.ring = self
        return chain

    def check_notification(self, dma: DmaPort, next_off: int, next_wrap: int) -> None:
        """NOTIFICATION_DATA: the notified avail index (next_off | next_wrap << 15) lies
        between the device's next entry and avail.idx (notify/data)."""
        claim = (next_off | next_wrap << 15) & 0xFFFF
        avail = self.avail_idx(dma)
        ahead = (claim - self.last_avail_idx) & 0xFFFF
        if ahead > (avail - self.last_avail_idx) & 0xFFFF:
            raise RingError("notify/data", f"notified avail index {claim}, but avail.idx is "
                            f"{avail} and the device is at {self.last_avail_idx}")

    def _walk(self, dma: DmaPort, head: int) -> DescriptorChain:
        chain = DescriptorChain(head)
        table = self.desc_table
        entries = self.size
        idx = head
        count = 0
        in_indirect = False
        seen_write = False
        while True:
            count += 1
            if count > entries:
                where = "indirect table" if in_indirect else "queue size"
                raise RingError("ring/loop", f"chain from head {head} longer than the {where}"
                                f" ({entries})")
            raw = self._read(dma, table + _DESC_SIZE * idx, _DESC_SIZE, f"descriptor {idx}")
            addr, length, flags, nxt = struct.unpack(_DESC_FMT, raw)
            if flags & V.DESC_F_INDIRECT:
                if not self.indirect:
                    raise RingError("ring/indirect-not-negotiated",
                                    f"descriptor {idx} is INDIRECT")
                if in_indirect:
                    raise RingError("ring/indirect-nested",
                                    f"INDIRECT descriptor {idx} inside an indirect table")
                if flags & V.DESC_F_NEXT:
                    raise RingError("ring/indirect-next",
                                    f"descriptor {idx} has INDIRECT and NEXT")
                if length == 0 or length % _DESC_SIZE:
                    raise RingError("ring/indirect-len",
                                    f"indirect table length {length} of descriptor {idx}")
                if addr + length > _U64:
                    raise RingError("ring/addr-overflow",
                                    f"indirect table {addr:#x}+{length} overflows")
                try:
                    dma.view(addr, length)
                except DmaFault as e:
                    raise RingError("ring/dma", f"indirect table: {e}") from None
                table, entries, idx, count, in_indirect = addr, length // _DESC_SIZE, 0, 0, True
                continue
            if addr + length > _U64:
                raise RingError("ring/addr-overflow",
                                f"descriptor {idx}: {addr:#x}+{length} overflows")
            write = bool(flags & V.DESC_F_WRITE)
            if not write and seen_write and not (
                    BREAKS and "ring/skip-write-before-read" in BREAKS):
                raise RingError("ring/write-before-read",
                                f"readable descriptor {idx} after a writable one")
            seen_write = seen_write or write
            if length:
                try:
                    dma.view(addr, length)
                except DmaFault as e:
                    raise RingError("ring/dma", f"descriptor {idx} buffer: {e}") from None
            (chain.writable if write else chain.readable).append(Descriptor(addr, length, write))
            if not flags & V.DESC_F_NEXT:
                if self._order is not None:
                    self._next_desc = ((head if in_indirect else idx) + 1) % self.size
                return chain
            if nxt >= entries and not (BREAKS and "ring/skip-index-range" in BREAKS):
                raise RingError("ring/next-range", f"descriptor {idx}: next {nxt} >= {entries}")
            if self._order is not None and not in_indirect and nxt != (idx + 1) % entries:
                raise RingError("ring/in-order-desc", f"descriptor {idx}: next {nxt}, with "
                                f"IN_ORDER it is {(idx + 1) % entries}")
            idx = nxt

    # --- used ring -------------------------------------------------------------------

    def push_used(self, dma: DmaPort, head: int, length: int) -> None:
        """Return a chain: write the used element, then publish used.idx. With IN_ORDER
        the chain goes back once every chain before it has, a run of them as one batch:
        one element (the last chain's id and length) at the batch's first slot, used.idx
        moved by the batch size (virtio 1.x §2.7.9)."""
        if self._order is None:
            self._write_used(dma, head, length, 1)
            return
        for ids, n in self._order.finish(head, length):
            self._write_used(dma, ids[-1], n, len(ids))

    def _write_used(self, dma: DmaPort, head: int, length: int, count: int) -> None:
        slot = self.next_used_idx % self.size
        elem = self.used_ring + V.USED_HEADER + _USED_ELEM_SIZE * slot
        self._write(dma, elem, struct.pack(_USED_ELEM_FMT, head, length), "used.ring")
        self.next_used_idx = (self.next_used_idx + count) & 0xFFFF
        self._write(dma, self.used_ring + 2, self.next_used_idx.to_bytes(2, "little"),
                    "used.idx")

    def needs_interrupt(self, dma: DmaPort) -> bool:
        """After pushing used entries: should the driver be interrupted?"""
        old, new = self._signalled_used, self.next_used_idx
        self._signalled_used = new
        if old == new:
            return False
        if self.event_idx:
            return vring_need_event(self.used_event(dma), new, old)
        return not self.avail_flags(dma) & V.AVAIL_F_NO_INTERRUPT


