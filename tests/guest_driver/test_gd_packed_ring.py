"""Driver side of the packed virtqueue and the IN_ORDER split ring, against a device
written here by hand from the spec (virtio 1.x §2.7.9, §2.8)."""
from __future__ import annotations

import struct

from gd_fakes import FakeMemory

from guest_driver.mm import PageAllocator
from guest_driver.virtio.packed_ring import PackedQueue
from guest_driver.virtio.split_ring import SplitQueue

AVAIL, USED = 1 << 7, 1 << 15
NEXT, WRITE, INDIRECT = 1, 2, 4


def _packed(num: int = 4, **opts: bool) -> tuple[PackedQueue[str], FakeMemory]:
    mem = FakeMemory()
    options = dict(indirect=False, event_idx=False, in_order=False, notification_data=False)
    options.update(opts)
    return PackedQueue(mem, PageAllocator(mem.base, mem.size), 2, num, max_indirect=4,
                       **options), mem


def _desc(mem: FakeMemory, ring: PackedQueue[str], slot: int) -> tuple[int, int, int, int]:
    return struct.unpack("<QIHH", mem.read(ring.desc_addr + 16 * slot, 16))


def _use(mem: FakeMemory, ring: PackedQueue[str], slot: int, bid: int, length: int,
         wrap: int) -> None:
    flags = (AVAIL | USED if wrap else 0) | (WRITE if length else 0)
    mem.write(ring.desc_addr + 16 * slot, struct.pack("<QIHH", 0, length, bid, flags))


def test_a_request_is_laid_out_with_its_id_and_the_wrap_counter() -> None:
    ring, mem = _packed()
    bid = ring.add([(0x1000, 16)], [(0x2000, 8)], "a")
    assert _desc(mem, ring, 0) == (0x1000, 16, bid, AVAIL | NEXT)
    assert _desc(mem, ring, 1) == (0x2000, 8, bid, AVAIL | WRITE)
    assert ring.num_free == 2 and ring.kick_prepare()   # device event ENABLE (zeroed)
    assert not ring.kick_prepare()                      # nothing new since


def test_used_descriptors_are_reaped_and_skip_their_slots_across_the_wrap() -> None:
    ring, mem = _packed(num=3)
    a = ring.add([(0x1000, 16)], [(0x2000, 8)], "a")    # slots 0-1
    _use(mem, ring, 0, a, 8, 1)
    assert ring.get_used() == [("a", 8)]
    b = ring.add([(0x1000, 16)], [(0x2000, 8)], "b")    # slots 2, 0 (wrap counter 0)
    assert _desc(mem, ring, 0)[3] == USED | WRITE        # AVAIL = 0, USED = 1: wrap 0
    _use(mem, ring, 2, b, 4, 1)
    assert ring.get_used() == [("b", 4)]
    assert not ring.has_used() and ring.num_free == 3


def test_a_bad_used_descriptor_breaks_the_ring_with_a_reason() -> None:
    ring, mem = _packed()
    ring.add([(0x1000, 16)], [(0x2000, 8)], "a")
    _use(mem, ring, 0, 3, 8, 1)                          # id 3 is not in flight
    assert ring.get_used() == [] and "not a request in flight" in (ring.broken or "")
    ring2, mem2 = _packed()
    bid = ring2.add([(0x1000, 16)], [(0x2000, 8)], "a")
    _use(mem2, ring2, 0, bid, 9, 1)                       # more than its writable 8
    assert ring2.get_used() == [] and "exceeds" in (ring2.broken or "")


def test_in_order_batch_completes_every_request_before_the_named_one() -> None:
    ring, mem = _packed(num=8, in_order=True)
    ids = [ring.add([(0x1000, 16)], [(0x2000, 8)], t) for t in "abc"]
    _use(mem, ring, 0, ids[2], 8, 1)                     # one used descriptor for all three
    assert ring.get_used() == [("a", 8), ("b", 8), ("c", 8)]
    assert ring.num_free == 8


def test_event_idx_sets_the_driver_event_and_reads_the_device_event() -> None:
    ring, mem = _packed(event_idx=True)
    ring.enable_interrupts()
    assert struct.unpack("<HH", mem.read(ring.driver_addr, 4)) == (0 | 1 << 15, 0x2)
    mem.write(ring.device_addr, struct.pack("<HH", 3 | 1 << 15, 0x2))  # kick me at slot 3
    ring.add([(0x1000, 16)], [], "a")
    assert not ring.kick_prepare()
    ring.add([(0x1000, 16)], [(0x2000, 8)], "b")         # slots 1-2: slot 3 not reached
    assert not ring.kick_prepare()
    ring.add([(0x1000, 16)], [], "c")                    # slot 3 made available
    assert ring.kick_prepare()
    mem.write(ring.device_addr, struct.pack("<HH", 0, 0x1))             # DISABLE
    assert ring.get_used() == []


def test_indirect_request_takes_one_slot() -> None:
    ring, mem = _packed(indirect=True)
    bid = ring.add([(0x1000, 16)], [(0x2000, 8)], "a")
    addr, length, got, flags = _desc(mem, ring, 0)
    assert (length, got, flags) == (32, bid, AVAIL | INDIRECT) and ring.num_free == 3
    table = mem.read(addr, 32)
    assert struct.unpack_from("<QIHH", table, 16) == (0x2000, 8, 0, WRITE)


def test_notification_data_follows_the_next_slot_and_wrap() -> None:
    ring, _ = _packed(num=2, notification_data=True)
    assert ring.notification_data() == 0 | 1 << 15
    ring.add([(0x1000, 16)], [(0x2000, 8)], "a")
    assert ring.notification_data() == 0                  # slot 0, wrap counter 0


def test_split_in_order_uses_descriptors_in_ring_order_and_reaps_batches() -> None:
    mem = FakeMemory()
    ring: SplitQueue[str] = SplitQueue(mem, PageAllocator(mem.base, mem.size), 2, 4,
                                       indirect=False, event_idx=False, in_order=True,
                                       notification_data=True)
    heads = [ring.add([(0x1000, 16)], [(0x2000, 8)], t) for t in "ab"]
    assert heads == [0, 2] and ring.notification_data() == 2
    lay = ring.layout
    # the device used both: one element (the last head) at slot 0, used.idx moved by 2
    mem.write(ring.base + lay.used_ring, struct.pack("<II", 2, 8))
    mem.write(ring.base + lay.used_idx, struct.pack("<H", 2))
    assert ring.get_used() == [("a", 8), ("b", 8)]
    assert ring.add([(0x1000, 16)], [(0x2000, 8)], "c") == 0     # 0 again, in ring order
