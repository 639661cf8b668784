"""Device side of the packed virtqueue (virtio 1.x §2.8; spec §4.6), driven by a driver
written here by hand from the spec: wrap counters, lists, indirect tables, buffer ids,
used descriptors, event suppression, IN_ORDER batches, NOTIFICATION_DATA claims, and
every rule answered with its name before any buffer is touched."""
from __future__ import annotations

import struct

import pytest
from dm_fakes import FakeDma

from device_model.virtio.packed_ring import PackedRing
from device_model.virtio.queue import Queue
from device_model.virtio.ring import RingError

AVAIL, USED = 1 << 7, 1 << 15
NEXT, WRITE, INDIRECT = 1, 2, 4
BASE = 0x4000_0000
RING, DRV_EV, DEV_EV = BASE, BASE + 0x1000, BASE + 0x1004
BUF = BASE + 0x10_0000


class HandDriver:
    """The driver half, minimal: slots in ring order, wrap counter from 1."""

    def __init__(self, dma: FakeDma, size: int) -> None:
        self.dma, self.size = dma, size
        self.slot, self.wrap = 0, 1

    def desc(self, slot: int, addr: int, length: int, bid: int, flags: int) -> None:
        self.dma.write(RING + 16 * slot, struct.pack("<QIHH", addr, length, bid, flags))

    def flags(self, write: bool = False, nxt: bool = False, wrap: int | None = None) -> int:
        w = self.wrap if wrap is None else wrap
        return ((AVAIL if w else USED) | (WRITE if write else 0) | (NEXT if nxt else 0))

    def add(self, bid: int, segs: list[tuple[int, int, bool]]) -> int:
        """Make one buffer available (head flags last); returns its first slot."""
        first, head_flags = self.slot, 0
        for i, (addr, length, write) in enumerate(segs):
            f = self.flags(write, i < len(segs) - 1)
            if i == 0:
                head_flags = f
                self.desc(self.slot, addr, length, bid, 0)
            else:
                self.desc(self.slot, addr, length, bid, f)
            self.slot += 1
            if self.slot == self.size:
                self.slot, self.wrap = 0, self.wrap ^ 1
        self.dma.write(RING + 16 * first + 14, struct.pack("<H", head_flags))
        return first

    def used(self, slot: int) -> tuple[int, int, int]:
        _, length, bid, flags = struct.unpack("<QIHH", self.dma.read(RING + 16 * slot, 16))
        return bid, length, flags

    def driver_event(self, off_wrap: int, flags: int) -> None:
        self.dma.write(DRV_EV, struct.pack("<HH", off_wrap, flags))


def _ring(size: int = 8, **opts: bool) -> tuple[PackedRing, HandDriver, FakeDma]:
    dma = FakeDma(BASE, 4 << 20)
    q = Queue(64)
    q.size, q.ready = size, True
    q.desc_table, q.avail_ring, q.used_ring = RING, DRV_EV, DEV_EV
    options = dict(indirect=True, event_idx=False, in_order=False)
    options.update(opts)
    return PackedRing(q, **options), HandDriver(dma, size), dma


def _req(n: int = 0) -> list[tuple[int, int, bool]]:
    return [(BUF + 0x100 * n, 16, False), (BUF + 0x100 * n + 0x40, 24, True)]


def test_a_list_is_taken_and_given_back_as_one_used_descriptor() -> None:
    ring, drv, dma = _ring()
    drv.add(5, _req())
    chain = ring.pop(dma)
    assert chain is not None and chain.head == 5
    assert [(d.addr, d.length) for d in chain.readable] == [(BUF, 16)]
    assert [(d.addr, d.length) for d in chain.writable] == [(BUF + 0x40, 24)]
    assert ring.pop(dma) is None
    ring.push_used(dma, 5, 24)
    assert drv.used(0) == (5, 24, AVAIL | USED | WRITE)     # AVAIL = USED = wrap 1
    assert (ring.next_used, ring.used_wrap) == (2, 1)       # skipped the list's 2 slots
    assert ring.needs_interrupt(dma)                        # ENABLE (zeroed structure)


def test_wrap_counters_flip_at_the_end_of_the_ring() -> None:
    ring, drv, dma = _ring(size=3)
    for lap in range(4):
        bid = lap % 2
        drv.add(bid, [(BUF, 8, True)])
        chain = ring.pop(dma)
        assert chain is not None and chain.head == bid, lap
        ring.push_used(dma, bid, 0)
    # 4 single-slot buffers in a ring of 3: both sides are at slot 1 of the second lap
    assert (ring.next_avail, ring.avail_wrap, ring.next_used, ring.used_wrap) == (1, 0, 1, 0)
    bid, length, flags = drv.used(0)
    assert bid == 1 and flags & (AVAIL | USED) == 0         # written with wrap counter 0
    assert not flags & WRITE                                # nothing written: no WRITE


def test_indirect_table_holds_the_whole_buffer() -> None:
    ring, drv, dma = _ring()
    table = BUF + 0x8000
    dma.write(table, struct.pack("<QIHH", BUF, 16, 0, 0) + struct.pack("<QIHH", BUF + 64, 8,
                                                                       0, WRITE))
    drv.desc(0, table, 32, 3, drv.flags() | INDIRECT)
    drv.slot = 1
    chain = ring.pop(dma)
    assert chain is not None and chain.head == 3
    assert (chain.readable_len, chain.writable_len) == (16, 8)
    assert ring.next_avail == 1


@pytest.mark.parametrize("case,rule", [
    ("both-flags", "ring/packed-avail-flags"),
    ("id-range", "ring/packed-id-range"),
    ("id-in-flight", "ring/packed-id-in-flight"),
    ("chain-wraps-bad", "ring/packed-chain-flags"),
    ("chain-too-long", "ring/packed-chain-len"),
    ("write-then-read", "ring/write-before-read"),
    ("indirect-next", "ring/indirect-next"),
    ("indirect-nested", "ring/indirect-nested"),
    ("indirect-len", "ring/indirect-len"),
    ("indirect-flags", "ring/indirect-flags"),
    ("indirect-in-list", "ring/indirect-in-list"),
    ("event-reserved", "ring/event-flags"),
    ("event-desc-no-event-idx", "ring/event-flags"),
    ("event-off-range", "ring/event-off-range"),
])
def test_each_rule_is_named_before_any_buffer_is_touched(case: str, rule: str) -> None:
    ring, drv, dma = _ring(size=4, event_idx=case == "event-off-range")
    if case == "both-flags":
        drv.desc(0, BUF, 8, 0, AVAIL | USED)
    elif case == "id-range":
        drv.add(4, _req())
    elif case == "id-in-flight":
        drv.add(1, [(BUF, 8, True)])
        assert ring.pop(dma) is not None
        drv.add(1, [(BUF + 8, 8, True)])
    elif case == "chain-wraps-bad":
        drv.slot = 3
        ring.next_avail = 3
        drv.desc(3, BUF, 8, 0, drv.flags(nxt=True))
        drv.desc(0, BUF + 8, 8, 0, drv.flags(write=True))   # wrap counter not flipped
    elif case == "chain-too-long":
        for s in range(4):          # every descriptor says NEXT: 5 in a ring of 4
            drv.desc(s, BUF, 8, 0, drv.flags(nxt=True))
    elif case == "write-then-read":
        drv.add(0, [(BUF, 8, True), (BUF + 8, 8, False)])
    elif case.startswith("indirect"):
        table = BUF + 0x8000
        entry = {"indirect-nested": INDIRECT, "indirect-flags": NEXT}.get(case, 0)
        dma.write(table, struct.pack("<QIHH", BUF, 16, 0, entry))
        length = 24 if case == "indirect-len" else 16
        flags = drv.flags(nxt=case == "indirect-next") | INDIRECT
        if case == "indirect-in-list":
            drv.desc(1, table, 16, 0, drv.flags() | INDIRECT)
            drv.desc(0, BUF, 8, 0, drv.flags(nxt=True))
        else:
            drv.desc(0, table, length, 0, flags)
    elif case == "event-reserved":
        drv.driver_event(0, 0x3)
        drv.add(0, _req())
    elif case == "event-desc-no-event-idx":
        drv.driver_event(0, 0x2)
        drv.add(0, _req())
    elif case == "event-off-range":
        drv.driver_event(4 | 1 << 15, 0x2)
        drv.add(0, _req())
    dma.log.clear()
    with pytest.raises(RingError) as exc:
        ring.pop(dma)
    assert exc.value.rule == rule
    assert [e for e in dma.log if e[0] == "write" or (e[0] == "read" and e[1] >= BUF
                                                      and e[1] < BUF + 0x8000)] == []


def test_in_order_batches_complete_buffers_and_keeps_short_ones_apart() -> None:
    ring, drv, dma = _ring(in_order=True)
    for bid in (7, 2, 5):
        drv.add(bid, [(BUF + bid * 64, 8, False), (BUF + bid * 64 + 32, 16, True)])
        assert ring.pop(dma) is not None
    ring.push_used(dma, 5, 16)          # finished first, held: 7 and 2 are before it
    ring.push_used(dma, 2, 16)
    assert (ring.next_used, ring.used_wrap) == (0, 1)        # nothing written yet
    ring.push_used(dma, 7, 16)          # all three complete: one batch, id of the last
    assert drv.used(0) == (5, 16, AVAIL | USED | WRITE)
    assert ring.next_used == 6
    drv.add(1, [(BUF, 8, False), (BUF + 32, 16, True)])
    drv.add(3, [(BUF, 8, False), (BUF + 32, 16, True)])
    assert ring.pop(dma) is not None and ring.pop(dma) is not None
    ring.push_used(dma, 3, 16)
    ring.push_used(dma, 1, 4)           # short: ends its own batch with its real length
    assert drv.used(6) == (1, 4, AVAIL | USED | WRITE)
    assert (ring.next_used, ring.used_wrap) == (2, 0)      # 10 slots in a ring of 8
    bid, length, flags = drv.used(0)
    assert (bid, length) == (3, 16) and flags & (AVAIL | USED) == 0


def test_event_idx_interrupts_only_when_the_driver_event_is_passed() -> None:
    ring, drv, dma = _ring(event_idx=True)
    drv.driver_event(4 | 1 << 15, 0x2)     # notify me when slot 4 (wrap 1) is used
    for bid in range(4):
        drv.add(bid, [(BUF, 8, True)])
    for bid in range(4):
        assert ring.pop(dma) is not None
    interrupts = []
    for bid in range(4):
        ring.push_used(dma, bid, 8)
        interrupts.append(ring.needs_interrupt(dma))
    assert interrupts == [False, False, False, False]
    drv.add(4, [(BUF, 8, True)])
    assert ring.pop(dma) is not None
    ring.push_used(dma, 4, 8)
    assert ring.needs_interrupt(dma)
    drv.driver_event(0, 0x1)               # DISABLE
    drv.add(5, [(BUF, 8, True)])
    assert ring.pop(dma) is not None
    ring.push_used(dma, 5, 8)
    assert not ring.needs_interrupt(dma)


def test_device_event_names_the_next_descriptor_with_event_idx() -> None:
    ring, drv, dma = _ring(size=2, event_idx=True)
    drv.add(0, [(BUF, 8, True)])
    drv.add(1, [(BUF, 8, True)])
    assert ring.pop(dma) is not None and ring.pop(dma) is not None and ring.pop(dma) is None
    off_wrap, flags = struct.unpack("<HH", dma.read(DEV_EV, 4))
    assert (off_wrap, flags) == (0 | 0 << 15, 0x2)           # slot 0 of the lap with wrap 0


@pytest.mark.parametrize("claim,ok", [((0, 1), True), ((2, 1), True), ((3, 1), False),
                                      ((0, 0), False), ((9, 1), False)])
def test_notification_data_must_name_what_the_ring_holds(claim: tuple[int, int],
                                                         ok: bool) -> None:
    ring, drv, dma = _ring()
    drv.add(0, _req())                     # slots 0-1: the driver's next slot is 2, wrap 1
    if ok:
        ring.check_notification(dma, *claim)
    else:
        with pytest.raises(RingError) as exc:
            ring.check_notification(dma, *claim)
        assert exc.value.rule == "notify/data"


def test_any_queue_size_up_to_2_15() -> None:
    assert PackedRing.size_ok(3) and PackedRing.size_ok(1 << 15)
    assert not PackedRing.size_ok(0) and not PackedRing.size_ok((1 << 15) + 1)
