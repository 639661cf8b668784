"""Device-side split virtqueue vs the virtio 1.x layout, driven by an independent mock
driver queue: every power-of-two size, chains of several lengths, index wraparound."""
from __future__ import annotations

import struct

import pytest
from dm_driver import Bump, MockSplitQueue
from dm_fakes import FakeDma

from device_model.virtio.queue import Queue
from device_model.virtio.ring import RingError
from device_model.virtio.ring_factory import make_device_ring
from device_model.virtio.split_ring import SplitRing, vring_need_event
from hwspec import virtio as V

SIZES = [1 << i for i in range(16)]  # 1 .. 32768 (virtio's max; VA-1's default max is 256)
EVENT_IDX = 1 << 29
INDIRECT = 1 << 28


def make(size: int, features: int = 0, ram: int = 4 << 20
         ) -> tuple[FakeDma, Bump, MockSplitQueue, SplitRing]:
    dma = FakeDma(size=ram)
    alloc = Bump(dma)
    mq = MockSplitQueue(dma, alloc, size)
    regs = Queue(max(size, 256))
    regs.size = size
    regs.desc_table, regs.avail_ring, regs.used_ring = mq.desc, mq.avail, mq.used
    regs.ready = True
    q = make_device_ring(features, regs)
    assert isinstance(q, SplitRing)
    return dma, alloc, mq, q


@pytest.mark.parametrize("size", SIZES)
def test_layout_offsets_match_virtio(size: int) -> None:
    # hwspec sizes: descriptor table 16*N, avail 6+2N, used 6+8N.
    assert V.desc_table_size(size) == 16 * size
    assert V.avail_ring_size(size) == 4 + 2 * size + 2
    assert V.used_ring_size(size) == 4 + 8 * size + 2
    dma, alloc, mq, q = make(size, EVENT_IDX, ram=(64 * size) + (1 << 16))
    buf = alloc.alloc(8)
    mq.add([(buf, 8, True)])
    chain = q.pop(dma)
    assert chain is not None and chain.head == 0 and chain.writable_len == 8
    # avail_event published right after the used ring = next index to read (1)
    assert mq.r16(mq.avail_event_addr) == 1
    q.push_used(dma, chain.head, 3)
    assert mq.used_idx() == 1
    assert struct.unpack("<II", dma.g_read(mq.used + 4, 8)) == (chain.head, 3)
    # used_event read right after the avail ring: 0 -> interrupt on the first entry
    mq.w16(mq.used_event_addr, 0)
    assert q.needs_interrupt(dma)
    # now used_event = 5: pushing entry 2 does not cross it
    mq.w16(mq.used_event_addr, 5)
    mq.pop_used()
    mq.add([(buf, 8, True)])
    c2 = q.pop(dma)
    assert c2 is not None
    q.push_used(dma, c2.head, 0)
    assert not q.needs_interrupt(dma)


@pytest.mark.parametrize("size", [1 << i for i in range(9)])
def test_round_trips_of_chains(size: int) -> None:
    dma, alloc, mq, q = make(size)
    bufs = [alloc.alloc(16 + size) for _ in range(size)]
    lengths = sorted({1, 2, 3, size} & set(range(1, size + 1)))
    for rnd in range(3):
        for n in lengths:
            nread = n // 2
            spec = [(bufs[i], 16 + i, i >= nread) for i in range(n)]
            for i in range(nread):
                dma.g_write(bufs[i], bytes([rnd * 16 + i + 1]) * (16 + i))
            head = mq.add(spec)
            chain = q.pop(dma)
            assert chain is not None and chain.head == head
            assert [(d.addr, d.length) for d in chain.readable] == [(a, ln) for a, ln, w in spec if not w]
            assert [(d.addr, d.length) for d in chain.writable] == [(a, ln) for a, ln, w in spec if w]
            expect = b"".join(bytes([rnd * 16 + i + 1]) * (16 + i) for i in range(nread))
            assert chain.read(dma, 10**6) == expect
            payload = (bytes(range(251)) * 400)[: chain.writable_len]
            assert chain.write(dma, payload) == len(payload)
            got = b"".join(dma.g_read(a, ln) for a, ln, w in spec if w)
            assert got == payload
            assert q.pop(dma) is None
            q.push_used(dma, chain.head, len(payload))
            assert mq.pop_used() == (head, len(payload))


@pytest.mark.parametrize("size", [1, 2, 8, 256])
def test_indices_wrap_at_16_bits(size: int) -> None:
    dma, alloc, mq, q = make(size, EVENT_IDX)
    start = 0x10000 - 3 * size
    q.last_avail_idx = q.next_used_idx = q._signalled_used = start
    mq.avail_idx = mq.last_used = start
    mq.w16(mq.avail + 2, start)
    mq.w16(mq.used + 2, start)
    buf = alloc.alloc(4)
    seen = 0
    for i in range(6 * size):
        mq.add([(buf, 4, True)])
        chain = q.pop(dma)
        assert chain is not None
        q.push_used(dma, chain.head, i & 3)
        assert mq.pop_used() == (chain.head, i & 3)
        seen += 1
    assert q.last_avail_idx == (start + seen) & 0xFFFF < start
    assert mq.used_idx() == (start + seen) & 0xFFFF
    assert mq.r16(mq.avail_event_addr) == (start + seen) & 0xFFFF


def test_indirect_round_trip() -> None:
    dma, alloc, mq, q = make(8, INDIRECT)
    table = alloc.alloc(16 * 5)
    bufs = [alloc.alloc(32) for _ in range(5)]
    spec = [(bufs[0], 32, False), (bufs[1], 8, False), (bufs[2], 32, True),
            (bufs[3], 4, True), (bufs[4], 1, True)]
    head = mq.add(spec, indirect_table=table)
    chain = q.pop(dma)
    assert chain is not None and chain.head == head
    assert chain.readable_len == 40 and chain.writable_len == 37


@pytest.mark.parametrize("views", [False, True])
def test_indirect_table_read_once_through_a_ring_view(views: bool) -> None:
    """With ring views the indirect table is read through the ring's buffer window (no DMA
    call for it at all); without (a port that wants every access, as under a fault plan)
    entry by entry after its view() check. Same chain."""
    dma, alloc, mq, q = make(8, INDIRECT)
    dma.view_epoch = 0 if views else None
    table = alloc.alloc(16 * 3)
    bufs = [alloc.alloc(32) for _ in range(3)]
    spec = [(bufs[0], 32, False), (bufs[1], 0, True), (bufs[2], 24, True)]
    head = mq.add(spec, indirect_table=table)
    dma.log.clear()
    chain = q.pop(dma)
    assert chain is not None and chain.head == head and chain.ring is q
    assert [(d.addr, d.length, d.write) for d in chain.readable + chain.writable] == spec
    assert (chain.readable_len, chain.writable_len) == (32, 24)
    table_reads = [a for kind, a, n in dma.log if kind == "read" and table <= a < table + 48]
    assert (("view", table, 48) in dma.log) is not views
    assert table_reads == ([] if views else [table, table + 16, table + 32])


def test_need_event_formula() -> None:
    # virtio 1.x: interrupt when new_idx passes event_idx (mod 2^16)
    assert vring_need_event(0, 1, 0)
    assert not vring_need_event(1, 1, 0)
    assert vring_need_event(0xFFFF, 0, 0xFFFF)
    assert vring_need_event(2, 5, 0)
    assert not vring_need_event(7, 5, 0)


def test_no_interrupt_flag_without_event_idx() -> None:
    dma, alloc, mq, q = make(4)
    buf = alloc.alloc(4)
    mq.add([(buf, 4, True)])
    c = q.pop(dma)
    assert c is not None
    mq.w16(mq.avail, 1)  # VIRTQ_AVAIL_F_NO_INTERRUPT
    q.push_used(dma, c.head, 0)
    assert not q.needs_interrupt(dma)
    mq.pop_used()
    mq.w16(mq.avail, 0)
    mq.add([(buf, 4, True)])
    c = q.pop(dma)
    assert c is not None
    q.push_used(dma, c.head, 0)
    assert q.needs_interrupt(dma)
    assert not q.needs_interrupt(dma)  # nothing new since


def test_ring_error_carries_rule() -> None:
    dma, alloc, mq, q = make(4)
    mq.w16(mq.avail + 2, 5)
    with pytest.raises(RingError) as ei:
        q.pop(dma)
    assert ei.value.rule == "ring/avail-idx-jump"
