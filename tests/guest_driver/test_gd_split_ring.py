import struct

import pytest

from gd_fakes import DeviceBroken, FakeMemory, walk_chain
from guest_driver.mm import PageAllocator
from guest_driver.virtio.split_ring import QueueFull, RingLayout, SplitQueue, vring_need_event
from hwspec import virtio as V


def mkq(num, indirect=False, event_idx=False, mem=None):
    mem = mem or FakeMemory()
    alloc = PageAllocator(mem.base, mem.size)
    return mem, SplitQueue(mem, alloc, 3, num, indirect=indirect, event_idx=event_idx)


class DevSide:
    """Minimal device side over the ring memory (virtio 1.x §2.7), for ring tests."""

    def __init__(self, mem, q, indirect=False):
        self.mem, self.q, self.indirect = mem, q, indirect
        self.last_avail = 0
        self.used_idx = 0

    def take(self):
        out = []
        idx = self.mem.u16(self.q.driver_addr + 2)
        while self.last_avail != idx:
            head = self.mem.u16(self.q.driver_addr + 4 + 2 * (self.last_avail % self.q.num))
            self.last_avail = (self.last_avail + 1) & 0xFFFF
            out.append((head, *walk_chain(self.mem, self.q.desc_addr, self.q.num, head,
                                          self.indirect)))
        return out

    def put(self, head, ln):
        slot = self.used_idx % self.q.num
        self.mem.write(self.q.device_addr + 4 + 8 * slot, struct.pack("<II", head, ln))
        self.used_idx = (self.used_idx + 1) & 0xFFFF
        self.mem.put16(self.q.device_addr + 2, self.used_idx)


@pytest.mark.parametrize("num", [1 << i for i in range(9)])
def test_layout_every_size(num):
    lay = RingLayout(num, 0)
    assert lay.desc % V.DESC_ALIGN == 0 and lay.avail % V.AVAIL_ALIGN == 0
    assert lay.used % V.USED_ALIGN == 0
    assert lay.avail >= V.desc_table_size(num)
    assert lay.used >= lay.avail + V.avail_ring_size(num)
    assert lay.used_event == lay.avail + V.avail_ring_size(num) - 2
    assert lay.avail_event == lay.used + V.used_ring_size(num) - 2
    mem, q = mkq(num)
    assert q.desc_addr % 16 == 0 and q.driver_addr % 2 == 0 and q.device_addr % 4 == 0
    dev = DevSide(mem, q)
    # fill the ring completely with 1-segment requests, twice around
    for rnd in range(2):
        heads = [q.add([(0x1000 + i, 8)], [], f"t{rnd}{i}") for i in range(num)]
        assert sorted(heads) == list(range(num))
        with pytest.raises(QueueFull):
            q.add([(0, 8)], [], "x")
        got = dev.take()
        assert [h for h, _, _ in got] == heads
        assert [rd for _, rd, _ in got] == [[(0x1000 + i, 8)] for i in range(num)]
        for h, _, _ in got:
            dev.put(h, 0)
        assert [t for t, _ in q.get_used()] == [f"t{rnd}{i}" for i in range(num)]
        assert q.num_free == num and q.broken is None


@pytest.mark.parametrize("num, indirect", [(1, True), (4, False), (4, True), (256, True)])
def test_index_wraparound_16bit(num, indirect):
    mem, q = mkq(num, indirect=indirect)
    dev = DevSide(mem, q, indirect=indirect)
    total = 0
    per = num if indirect else num // 2
    for rnd in range((70000 + per - 1) // per):
        for i in range(per):
            q.add([(0x2000, 8)], [(0x3000, 16)], total + i)
        for h, rd, wr in dev.take():
            assert wr == [(0x3000, 16)]
            dev.put(h, 16)
        got = q.get_used()
        assert [t for t, _ in got] == list(range(total, total + per))
        assert all(ln == 16 for _, ln in got)
        total += per
    assert total > 65536
    assert q.avail_idx == total & 0xFFFF == mem.u16(q.driver_addr + 2)
    assert q.last_used == total & 0xFFFF and q.broken is None


def test_indirect_used_for_multi_segment_only():
    mem, q = mkq(8, indirect=True)
    dev = DevSide(mem, q, indirect=True)
    h1 = q.add([(0x100, 32)], [(0x200, 32)], "two")
    h2 = q.add([(0x300, 16)], [], "one")
    assert q.num_free == 6  # one descriptor each
    flags1 = struct.unpack_from("<H", mem.read(q.desc_addr + 16 * h1 + 12, 2))[0]
    flags2 = struct.unpack_from("<H", mem.read(q.desc_addr + 16 * h2 + 12, 2))[0]
    assert flags1 == V.DESC_F_INDIRECT and flags2 == 0
    got = dev.take()
    assert got == [(h1, [(0x100, 32)], [(0x200, 32)]), (h2, [(0x300, 16)], [])]
    # the same request without indirect uses a chain of 2
    mem2, q2 = mkq(8)
    q2.add([(0x100, 32)], [(0x200, 32)], "two")
    assert q2.num_free == 6
    assert DevSide(mem2, q2).take()[0][1:] == ([(0x100, 32)], [(0x200, 32)])
    with pytest.raises(DeviceBroken, match="indirect-not-negotiated"):
        DevSide(mem, q, indirect=False).take()


def test_vring_need_event_matches_spec():
    assert vring_need_event(0, 1, 0)
    assert not vring_need_event(5, 3, 0)
    assert vring_need_event(0xFFFF, 1, 0xFFFE)  # across the wrap
    assert not vring_need_event(2, 0xFFFF, 0xFFFD)


def test_event_idx_kick_suppression():
    mem, q = mkq(16, event_idx=True)
    dev = DevSide(mem, q)
    q.add([(0, 8)], [], 1)
    assert q.kick_prepare()            # avail_event 0 lies in [0, 1)
    assert not q.kick_prepare()        # nothing new
    dev.take()                         # device has read 1; it publishes avail_event=5
    mem.put16(q.device_addr + 4 + 8 * 16, 5)
    for i in range(3):
        q.add([(0, 8)], [], 2 + i)
    assert not q.kick_prepare()        # new idx 4: event 5 not crossed
    q.add([(0, 8)], [], 9)
    q.add([(0, 8)], [], 10)
    assert q.kick_prepare()            # idx 4 -> 6 crosses 5


def test_no_notify_flag_without_event_idx():
    mem, q = mkq(4)
    mem.put16(q.device_addr, V.USED_F_NO_NOTIFY)
    q.add([(0, 8)], [], 1)
    assert not q.kick_prepare()
    mem.put16(q.device_addr, 0)
    q.add([(0, 8)], [], 2)
    assert q.kick_prepare()


def test_used_event_published_after_reaping():
    mem, q = mkq(8, event_idx=True)
    dev = DevSide(mem, q)
    for i in range(3):
        q.add([(0, 8)], [], i)
    for h, _, _ in dev.take():
        dev.put(h, 0)
    assert len(q.get_used()) == 3
    assert q.enable_interrupts() is False
    assert mem.u16(q.driver_addr + 4 + 2 * 8) == 3


@pytest.mark.parametrize("bad, msg", [
    (("id", 8), "out of range"),
    (("id", 5), "not the head of a request in flight"),
    (("len", 17), "exceeds its writable capacity 16"),
    (("idx", 9), "used.idx jumped"),
])
def test_bad_used_entries_break_ring_with_named_error(bad, msg):
    mem, q = mkq(8)
    dev = DevSide(mem, q)
    q.add([(0, 8)], [(0x100, 16)], "good")
    q.add([(0, 8)], [(0x100, 16)], "victim")
    (h0, *_), (h1, *_) = dev.take()
    dev.put(h0, 16)
    kind, val = bad
    if kind == "idx":
        dev.put(h1, 0)
        mem.put16(q.device_addr + 2, val)
        assert q.get_used() == []
    else:
        dev.put(val if kind == "id" else h1, val if kind == "len" else 0)
        assert q.get_used() == [("good", 16)]
    assert q.broken is not None and msg in q.broken
    assert q.get_used() == []          # stays broken, no crash
    # what is still in flight can be taken back (a jumped idx reaps nothing at all)
    assert q.drain() == (["good", "victim"] if kind == "idx" else ["victim"])


@pytest.mark.parametrize("in_order", [False, True])
def test_reaped_chains_give_their_descriptors_back_in_take_order(in_order):
    """Without IN_ORDER the lowest free descriptor comes out first again; with it, the
    next one in ring order (virtio 1.x §2.7.9)."""
    mem = FakeMemory()
    q = SplitQueue(mem, PageAllocator(mem.base, mem.size), 3, 8, indirect=False,
                   event_idx=False, in_order=in_order)
    dev = DevSide(mem, q)
    head = q.add([(0x1000, 8), (0x1008, 8)], [(0x2000, 8)], "a")
    assert head == 0 and q.num_free == 5
    dev.take()
    dev.put(head, 8)
    assert q.get_used() == [("a", 8)] and q.num_free == 8
    heads = [q.add([(0x3000 + 8 * i, 8)], [], i) for i in range(4)]
    assert heads == ([3, 4, 5, 6] if in_order else [0, 1, 2, 3])
