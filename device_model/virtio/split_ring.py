"""Device side of a virtio 1.x split virtqueue (virtio 1.x §2.7; VA-1 spec §4).

Built by `ring_factory.make_device_ring` on the queue registers a transport holds, with
the ring features the driver negotiated (INDIRECT_DESC, EVENT_IDX). The device pops
chains and pushes used entries. Every ring rule of spec §4 is checked while a chain is
walked, before the device touches any buffer of it; a broken ring raises `RingError`
naming the rule. All ring memory is reached through the `DmaPort`.
"""
from __future__ import annotations

import struct
from typing import Iterable

from hwspec import virtio as V

from ..ports import DmaFault, DmaPort
from ..testing_breaks import BREAKS
from .in_order import UsedOrder
from .queue import Queue
from .ring import Descriptor, DescriptorChain, DmaWindow, RingError, ring_read, ring_write

_U64 = 1 << 64
_new_tuple = tuple.__new__
_new_chain = object.__new__
_DESC_FMT = V.DESC.format
_DESC_UNPACK = struct.Struct(_DESC_FMT).unpack
_DESC_FROM = struct.Struct(_DESC_FMT).unpack_from
_TWO_DESC_FROM = struct.Struct(_DESC_FMT + _DESC_FMT.lstrip("<=>!@")).unpack_from
_U16_FROM = struct.Struct("<H").unpack_from
_U16_INTO = struct.Struct("<H").pack_into
_USED_ELEM_INTO = struct.Struct(V.USED_ELEM.format).pack_into
_DESC_SIZE = V.DESC.size
_USED_ELEM_FMT = V.USED_ELEM.format
_USED_ELEM_SIZE = V.USED_ELEM.size
_AVAIL_ELEM = V.AVAIL_ELEM
_F_NEXT, _F_WRITE, _F_INDIRECT = V.DESC_F_NEXT, V.DESC_F_WRITE, V.DESC_F_INDIRECT
_TWO_DESC = 2 * _DESC_SIZE


def vring_need_event(event_idx: int, new_idx: int, old_idx: int) -> bool:
    """virtio 1.x §2.7.10: has `event_idx` been passed moving from old to new?"""
    return ((new_idx - event_idx - 1) & 0xFFFF) < ((new_idx - old_idx) & 0xFFFF)


class SplitRing:
    """One split virtqueue's device side: its registers, frozen at DRIVER_OK, and the
    device's indices."""

    drained: bool
    """Set by every pop: True when it took, through the ring view, the last chain the
    avail.idx it read offered, and published avail_event as an empty pop would. A pop
    right after it (no avail.idx written since) finds nothing and writes the same value:
    the device may skip it (DeviceRing.drained)."""

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
        # Fixed while the ring lives: the areas check_rings probes and the offsets of
        # the fields read and written on every request.
        self._areas = (
            (self.desc_table, V.desc_table_size(self.size), "descriptor table"),
            (self.avail_ring, V.avail_ring_size(self.size), "driver area"),
            (self.used_ring, V.used_ring_size(self.size), "device area"))
        self._avail_idx_at = self.avail_ring + 2
        self._avail_elems_at = self.avail_ring + V.AVAIL_HEADER
        self._used_event_at = self.avail_ring + V.AVAIL_HEADER + V.AVAIL_ELEM * self.size
        self._avail_event_at = self.used_ring + V.USED_HEADER + _USED_ELEM_SIZE * self.size
        self._used_elems_at = self.used_ring + V.USED_HEADER
        self._lo = min(a for a, _, _ in self._areas)
        self._span = max(a + n for a, n, _ in self._areas) - self._lo
        # The same fields' offsets in the ring view (_ring_mem: offset 0 = `_lo`).
        lo = self._lo
        self._desc_off = self.desc_table - lo
        self._avail_flags_off = self.avail_ring - lo
        self._avail_idx_off = self._avail_idx_at - lo
        self._avail_elems_off = self._avail_elems_at - lo
        self._used_event_off = self._used_event_at - lo
        self._used_idx_off = self.used_ring + 2 - lo
        self._used_elems_off = self._used_elems_at - lo
        self._avail_event_off = self._avail_event_at - lo
        self._mem: memoryview | None = None   # see _ring_mem
        self._mem_dma: object = None
        self._mem_epoch = -1
        self._bufs = DmaWindow()   # buffers and indirect tables, while _mem is valid
        self.drained = False

    @staticmethod
    def alignment_ok(queue: Queue) -> bool:
        return (queue.desc_table % V.DESC_ALIGN == 0 and queue.avail_ring % V.AVAIL_ALIGN == 0
                and queue.used_ring % V.USED_ALIGN == 0)

    # --- ring memory helpers ---------------------------------------------------------

    _read = staticmethod(ring_read)
    _write = staticmethod(ring_write)

    def check_rings(self, dma: DmaPort) -> None:
        """All three ring areas must be backed (ring/dma) before any is used."""
        probe = getattr(dma, "probe_view", None)  # view()'s check, no view
        for addr, size, what in self._areas:
            if addr + size > _U64:
                raise RingError("ring/addr-overflow", f"{what} at {addr:#x} overflows")
            try:
                if probe is not None:
                    probe(addr, size)
                else:
                    dma.view(addr, size)
            except DmaFault as e:
                raise RingError("ring/dma", f"{what}: {e}") from None

    def avail_idx(self, dma: DmaPort) -> int:
        return int.from_bytes(self._read(dma, self._avail_idx_at, 2, "avail.idx"), "little")

    def avail_flags(self, dma: DmaPort) -> int:
        return int.from_bytes(self._read(dma, self.avail_ring, 2, "avail.flags"), "little")

    def used_event(self, dma: DmaPort) -> int:
        return int.from_bytes(self._read(dma, self._used_event_at, 2, "used_event"), "little")

    def publish_avail_event(self, dma: DmaPort) -> None:
        """EVENT_IDX: tell the driver the next available index the device will read."""
        if self.event_idx:
            self._write(dma, self._avail_event_at,
                        (self.last_avail_idx & 0xFFFF).to_bytes(2, "little"), "avail_event")

    def pending(self, dma: DmaPort) -> int:
        """Chains the driver made available that the device has not read (checked)."""
        n = (self.avail_idx(dma) - self.last_avail_idx) & 0xFFFF
        if n > self.size and not (BREAKS and "ring/skip-avail-idx-check" in BREAKS):
            raise RingError("ring/avail-idx-jump",
                            f"avail.idx moved {n} past {self.last_avail_idx} (queue size "
                            f"{self.size})")
        return n

    def _ring_mem(self, dma: DmaPort) -> memoryview | None:
        """The three ring areas as one byte view (offset 0 = `_lo`), while the port
        vouches for it (ports.DmaPort's optional ring_view and view_epoch); None: every
        access goes through read/write, each checked. A view is only handed out for
        memory that is backed for good, so check_rings holds while it is valid.

        The users test first whether the view they hold is still valid (`_mem` while
        `dma is _mem_dma and dma.view_epoch == _mem_epoch`) and call this only when not:
        `_mem_dma` is only ever a port that has a view_epoch."""
        epoch = getattr(dma, "view_epoch", None)
        if epoch is None:
            self._mem, self._mem_dma = None, None
            return None
        mem = None
        if self._lo + self._span <= _U64:
            mem = dma.ring_view(self._lo, self._span)  # type: ignore[attr-defined]
        self._mem, self._mem_dma, self._mem_epoch = mem, dma, epoch
        return mem

    # --- popping ---------------------------------------------------------------------

    def pop(self, dma: DmaPort) -> DescriptorChain | None:
        """The next available chain, fully checked, or None (then avail_event is
        published). Raises RingError without touching any buffer."""
        if dma is self._mem_dma and dma.view_epoch == self._mem_epoch:  # type: ignore[attr-defined]
            mem = self._mem
        else:
            mem = self._ring_mem(dma)
        if mem is not None:
            # Through the ring view: the same checks in the same order as below.
            last = self.last_avail_idx
            size = self.size
            n = (_U16_FROM(mem, self._avail_idx_off)[0] - last) & 0xFFFF
            if n > size and not (BREAKS and "ring/skip-avail-idx-check" in BREAKS):
                raise RingError("ring/avail-idx-jump",
                                f"avail.idx moved {n} past {last} (queue size {size})")
            if n == 0:
                self.drained = False
                if self.event_idx:
                    _U16_INTO(mem, self._avail_event_off, last)
                return None
            head = _U16_FROM(mem, self._avail_elems_off + _AVAIL_ELEM * (last % size))[0]
            if head >= size and not (BREAKS and "ring/skip-index-range" in BREAKS):
                raise RingError("ring/head-range", f"head {head} >= queue size {self.size}")
            if self._order is not None:
                if head != self._next_desc:
                    raise RingError("ring/in-order-desc", f"head {head}: with IN_ORDER the "
                                    f"next chain starts at descriptor {self._next_desc}")
                chain = self._walk(dma, head, mem)
                self._order.taken(head, chain.writable_len)
            else:
                # The usual request: one INDIRECT descriptor whose two-entry table (a
                # readable buffer, NEXT to entry 1, a writable one) and both buffers lie
                # in the walk's valid window. Every check of _walk passes for it (the
                # window lies below 2^64); it builds the same chain. Anything else: _walk.
                addr, length, flags, _ = _DESC_FROM(mem, self._desc_off + _DESC_SIZE * head)
                w = self._bufs
                if (flags == _F_INDIRECT and length == _TWO_DESC and self.indirect
                        and dma is w.dma and w.epoch == self._mem_epoch
                        and w.lo <= addr and addr + length <= w.hi):
                    wlo, whi = w.lo, w.hi
                    ra, rn, rf, rnext, wa, wn, wf, _ = _TWO_DESC_FROM(w.mem, addr - wlo)
                    if (rf == _F_NEXT and rnext == 1 and wf == _F_WRITE
                            and rn and wlo <= ra and ra + rn <= whi
                            and wn and wlo <= wa and wa + wn <= whi):
                        chain = _new_chain(DescriptorChain)
                        chain.head, chain.ring = head, self
                        chain.readable = [_new_tuple(Descriptor, (ra, rn, False))]
                        chain.writable = [_new_tuple(Descriptor, (wa, wn, True))]
                        chain.readable_len, chain.writable_len = rn, wn
                    else:
                        chain = self._walk(dma, head, mem)
                else:
                    chain = self._walk(dma, head, mem)
            last = self.last_avail_idx = (last + 1) & 0xFFFF
            if self.event_idx:
                _U16_INTO(mem, self._avail_event_off, last)
            self.drained = n == 1
            return chain
        self.drained = False
        self.check_rings(dma)
        if self.pending(dma) == 0:
            self.publish_avail_event(dma)
            return None
        slot = self.last_avail_idx % self.size
        raw = self._read(dma, self._avail_elems_at + V.AVAIL_ELEM * slot, 2, "avail.ring")
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

    def _walk(self, dma: DmaPort, head: int, mem: memoryview | None = None) -> DescriptorChain:
        """Follow and check the chain at `head`; `mem`: the ring view (_ring_mem), which
        holds the descriptor table, and means the port's probe_view is exact and nobody
        watches single accesses (so an indirect table is read through a view instead of
        once per descriptor, and a buffer inside the ring's DmaWindow needs no probe:
        the port vouches for it)."""
        readable: list[Descriptor] = []
        writable: list[Descriptor] = []
        rlen = wlen = 0
        probe = dma.view if mem is None else dma.probe_view  # type: ignore[attr-defined]
        w = self._bufs
        epoch = self._mem_epoch   # the port's view_epoch while `mem` is (pop just checked)
        table = self.desc_table
        entries = self.size
        idx = head
        count = 0
        in_indirect = False
        # where the descriptors are read from, and the offset of `table` in it
        src = mem
        base = self._lo
        while True:
            count += 1
            if count > entries:
                where = "indirect table" if in_indirect else "queue size"
                raise RingError("ring/loop", f"chain from head {head} longer than the {where}"
                                f" ({entries})")
            at = table + _DESC_SIZE * idx
            if src is not None:
                addr, length, flags, nxt = _DESC_FROM(src, at - base)
            else:
                if at + _DESC_SIZE > _U64:
                    self._read(dma, at, _DESC_SIZE, f"descriptor {idx}")  # raises
                try:
                    raw = dma.read(at, _DESC_SIZE)
                except DmaFault as e:
                    raise RingError("ring/dma", f"descriptor {idx}: {e}") from None
                addr, length, flags, nxt = _DESC_UNPACK(raw)
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
                table, entries, idx, count, in_indirect = addr, length // _DESC_SIZE, 0, 0, True
                if mem is not None and (
                        dma is w.dma and w.epoch == epoch
                        and w.lo <= addr and addr + length <= w.hi
                        or w.cover(dma, addr, length)):
                    src, base = w.mem, w.lo
                    continue
                try:
                    view = dma.view(addr, length)
                except DmaFault as e:
                    raise RingError("ring/dma", f"indirect table: {e}") from None
                src = view.data if mem is not None else None
                base = addr
                continue
            if addr + length > _U64:
                raise RingError("ring/addr-overflow",
                                f"descriptor {idx}: {addr:#x}+{length} overflows")
            write = flags & V.DESC_F_WRITE
            if not write and writable and not (
                    BREAKS and "ring/skip-write-before-read" in BREAKS):
                raise RingError("ring/write-before-read",
                                f"readable descriptor {idx} after a writable one")
            if length and not (
                    mem is not None and (
                        dma is w.dma and w.epoch == epoch
                        and w.lo <= addr and addr + length <= w.hi
                        or w.cover(dma, addr, length))):
                try:
                    probe(addr, length)
                except DmaFault as e:
                    raise RingError("ring/dma", f"descriptor {idx} buffer: {e}") from None
            if write:   # Descriptor(addr, length, True), without its __new__ frame
                writable.append(_new_tuple(Descriptor, (addr, length, True)))
                wlen += length
            else:
                readable.append(_new_tuple(Descriptor, (addr, length, False)))
                rlen += length
            if not flags & V.DESC_F_NEXT:
                if self._order is not None:
                    self._next_desc = ((head if in_indirect else idx) + 1) % self.size
                # DescriptorChain(head, readable, writable, self, rlen, wlen), without
                # its __init__ frame (the lengths are summed already)
                chain = _new_chain(DescriptorChain)
                chain.head, chain.readable, chain.writable, chain.ring = (
                    head, readable, writable, self)
                chain.readable_len, chain.writable_len = rlen, wlen
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
        batches: Iterable[tuple[int, int, int]]   # (id, length, chains) per used element
        if self._order is None:
            batches = ((head, length, 1),)
        else:
            batches = [(ids[-1], n, len(ids)) for ids, n in self._order.finish(head, length)]
        if dma is self._mem_dma and dma.view_epoch == self._mem_epoch:  # type: ignore[attr-defined]
            mem = self._mem
        else:
            mem = self._ring_mem(dma)
        for elem_id, elem_len, count in batches:
            elem = self._used_elems_at + _USED_ELEM_SIZE * (self.next_used_idx % self.size)
            if mem is not None:
                _USED_ELEM_INTO(mem, elem - self._lo, elem_id, elem_len)
                self.next_used_idx = (self.next_used_idx + count) & 0xFFFF
                _U16_INTO(mem, self._used_idx_off, self.next_used_idx)
                continue
            self._write(dma, elem, struct.pack(_USED_ELEM_FMT, elem_id, elem_len), "used.ring")
            self.next_used_idx = (self.next_used_idx + count) & 0xFFFF
            self._write(dma, self.used_ring + 2, self.next_used_idx.to_bytes(2, "little"),
                        "used.idx")

    def push_used_interrupt(self, dma: DmaPort, head: int, length: int) -> bool:
        """push_used, then needs_interrupt (DeviceRing). Without IN_ORDER and with a
        valid ring view (the usual completion), in one pass through the view: the same
        writes and the same reads as the two calls, which take everything else."""
        if (self._order is None and dma is self._mem_dma
                and dma.view_epoch == self._mem_epoch  # type: ignore[attr-defined]
                and (mem := self._mem) is not None):
            old = self.next_used_idx
            _USED_ELEM_INTO(mem, self._used_elems_off + _USED_ELEM_SIZE * (old % self.size),
                            head, length)
            new = self.next_used_idx = (old + 1) & 0xFFFF
            _U16_INTO(mem, self._used_idx_off, new)
        else:
            self.push_used(dma, head, length)
        return self.needs_interrupt(dma)

    def needs_interrupt(self, dma: DmaPort) -> bool:
        """After pushing used entries: should the driver be interrupted?"""
        old, new = self._signalled_used, self.next_used_idx
        self._signalled_used = new
        if old == new:
            return False
        if dma is self._mem_dma and dma.view_epoch == self._mem_epoch:  # type: ignore[attr-defined]
            mem = self._mem
        else:
            mem = self._ring_mem(dma)
        if mem is not None:
            if self.event_idx:
                return vring_need_event(_U16_FROM(mem, self._used_event_off)[0], new, old)
            return not _U16_FROM(mem, self._avail_flags_off)[0] & V.AVAIL_F_NO_INTERRUPT
        if self.event_idx:
            return vring_need_event(self.used_event(dma), new, old)
        return not self.avail_flags(dma) & V.AVAIL_F_NO_INTERRUPT


