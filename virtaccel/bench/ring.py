"""A bare split virtqueue in plain Python: the baseline for rows (d) and (e).

Layout as virtio 1.x (little endian) in one bytearray: descriptor table (16 bytes each:
addr u64, len u32, flags u16, next u16), avail ring (flags, idx, ring[n]) and used ring
(flags, idx, ring[n] of (id u32, len u32)). The driver adds a descriptor and publishes
it; the device pops it and pushes it to the used ring; the driver reaps it. No
notification, no interrupt, no VM exit: the least any ring round trip can cost in
Python, which is what the stack's null command is compared against.
"""
from __future__ import annotations

import struct

_DESC = struct.Struct("<QIHH")
_U16 = struct.Struct("<H")
_USED = struct.Struct("<II")


class BareRing:
    """Driver and device sides of one split ring of `size` entries."""

    def __init__(self, size: int = 256) -> None:
        if size < 1 or size & (size - 1):
            raise ValueError("ring size must be a power of two")
        self.size = size
        self.desc_off = 0
        self.avail_off = 16 * size
        self.used_off = self.avail_off + 4 + 2 * size + 2
        self.used_off = (self.used_off + 3) & ~3
        self.mem = bytearray(self.used_off + 4 + 8 * size + 2)
        self.free = list(range(size))
        self.avail_idx = 0          # driver's shadow of avail.idx
        self.last_used = 0          # driver: next used entry to reap
        self.last_avail = 0         # device: next avail entry to pop
        self.used_idx = 0           # device's shadow of used.idx

    # -- driver side ---------------------------------------------------------------
    def add(self, addr: int, length: int) -> int:
        """Put one descriptor in the avail ring (not yet published); returns its id."""
        head = self.free.pop()
        _DESC.pack_into(self.mem, self.desc_off + 16 * head, addr, length, 0, 0)
        _U16.pack_into(self.mem, self.avail_off + 4 + 2 * (self.avail_idx % self.size), head)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        return head

    def publish(self) -> None:
        """Write avail.idx (the store the device observes)."""
        _U16.pack_into(self.mem, self.avail_off + 2, self.avail_idx)

    def reap(self) -> list[tuple[int, int]]:
        """Every used (id, len) since the last reap; frees their descriptors."""
        (idx,) = _U16.unpack_from(self.mem, self.used_off + 2)
        out = []
        while self.last_used != idx:
            i, n = _USED.unpack_from(self.mem, self.used_off + 4 + 8 * (self.last_used % self.size))
            self.free.append(i)
            out.append((i, n))
            self.last_used = (self.last_used + 1) & 0xFFFF
        return out

    # -- device side ---------------------------------------------------------------
    def pop(self) -> tuple[int, int, int] | None:
        """The next available descriptor (id, addr, len), or None."""
        (idx,) = _U16.unpack_from(self.mem, self.avail_off + 2)
        if self.last_avail == idx:
            return None
        (head,) = _U16.unpack_from(self.mem, self.avail_off + 4 + 2 * (self.last_avail % self.size))
        self.last_avail = (self.last_avail + 1) & 0xFFFF
        addr, length, _flags, _next = _DESC.unpack_from(self.mem, self.desc_off + 16 * head)
        return head, addr, length

    def push(self, head: int, written: int) -> None:
        """Put (head, written) in the used ring and publish used.idx."""
        _USED.pack_into(self.mem, self.used_off + 4 + 8 * (self.used_idx % self.size), head, written)
        self.used_idx = (self.used_idx + 1) & 0xFFFF
        _U16.pack_into(self.mem, self.used_off + 2, self.used_idx)


def round_trip(ring: BareRing) -> None:
    """One descriptor: driver adds and publishes, device pops and pushes, driver reaps."""
    ring.add(0x1000, 64)
    ring.publish()
    got = ring.pop()
    assert got is not None
    ring.push(got[0], 0)
    done = ring.reap()
    assert len(done) == 1


def batch(ring: BareRing, count: int) -> int:
    """`count` descriptors (<= ring size) through the ring in one batch; returns count."""
    for _ in range(count):
        ring.add(0x1000, 64)
    ring.publish()
    while True:
        got = ring.pop()
        if got is None:
            break
        ring.push(got[0], 0)
    return len(ring.reap())
