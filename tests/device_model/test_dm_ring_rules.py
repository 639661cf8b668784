"""Every broken-ring rule of spec §4: NEEDS_RESET + config interrupt, the rule logged,
no memory written by the device, all queues stopped; reset + re-init restores function."""
from __future__ import annotations

import struct
from typing import Callable

import pytest
from dm_driver import INDIRECT, NEXT, WRITE, MockSplitQueue, Rig, nop

U64 = 1 << 64
Q = 2  # submitq[0]


def req_bytes(rig: Rig, ctx: int = 1) -> tuple[int, int]:
    cmd = rig.put(nop())
    req = rig.alloc.alloc(32)
    rig.dma.g_write(req, struct.pack("<IIQIIQ", ctx, 0, cmd, 8, 0, 1))
    resp = rig.alloc.alloc(32)
    rig.dma.g_write(resp, b"\xAA" * 32)
    return req, resp


def b_head_range(rig: Rig, q: MockSplitQueue) -> None:
    q.publish_head(q.size)


def b_avail_jump(rig: Rig, q: MockSplitQueue) -> None:
    q.w16(q.avail + 2, q.size + 1)


def b_next_range(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    q.write_desc(q.desc, 0, req, 32, NEXT, q.size)
    q.publish_head(0)


def b_loop(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    q.write_desc(q.desc, 0, req, 32, NEXT, 1)
    q.write_desc(q.desc, 1, req, 32, NEXT, 0)
    q.publish_head(0)


def b_self_loop(rig: Rig, q: MockSplitQueue) -> None:
    req, _ = req_bytes(rig)
    q.write_desc(q.desc, 3, req, 32, NEXT, 3)
    q.publish_head(3)


def _indirect(rig: Rig, q: MockSplitQueue, entries: list[tuple[int, int, int, int]],
              length: int | None = None, flags: int = INDIRECT) -> None:
    table = rig.alloc.alloc(16 * max(len(entries), 1) + 16)
    for i, (a, n, f, nx) in enumerate(entries):
        q.write_desc(table, i, a, n, f, nx)
    q.write_desc(q.desc, 0, table, 16 * len(entries) if length is None else length, flags, 1)
    q.publish_head(0)


def b_indirect_len0(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    _indirect(rig, q, [(req, 32, NEXT, 1), (resp, 32, WRITE, 0)], length=0)


def b_indirect_len24(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    _indirect(rig, q, [(req, 32, NEXT, 1), (resp, 32, WRITE, 0)], length=24)


def b_indirect_nested(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    inner = rig.alloc.alloc(32)
    _indirect(rig, q, [(req, 32, NEXT, 1), (inner, 32, INDIRECT, 0)])


def b_indirect_next(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    _indirect(rig, q, [(req, 32, NEXT, 1), (resp, 32, WRITE, 0)], flags=INDIRECT | NEXT)


def b_indirect_next_range(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    _indirect(rig, q, [(req, 32, NEXT, 2), (resp, 32, WRITE, 0)])


def b_indirect_loop(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    _indirect(rig, q, [(req, 32, NEXT, 1), (req, 32, NEXT, 0)])


def b_indirect_table_unbacked(rig: Rig, q: MockSplitQueue) -> None:
    q.write_desc(q.desc, 0, 0x1000, 32, INDIRECT, 0)
    q.publish_head(0)


def b_write_before_read(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    q.write_desc(q.desc, 0, resp, 32, WRITE | NEXT, 1)
    q.write_desc(q.desc, 1, req, 32, 0, 0)
    q.publish_head(0)


def b_addr_overflow(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    q.write_desc(q.desc, 0, req, 32, NEXT, 1)
    q.write_desc(q.desc, 1, U64 - 16, 32, WRITE, 0)
    q.publish_head(0)


def b_desc_outside_ram(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    q.write_desc(q.desc, 0, req, 32, NEXT, 1)
    q.write_desc(q.desc, 1, rig.dma.base + rig.dma.size - 8, 32, WRITE, 0)
    q.publish_head(0)


def b_desc_unmapped(rig: Rig, q: MockSplitQueue) -> None:
    req, resp = req_bytes(rig)
    rig.dma.holes.append((req, req + 32))
    q.write_desc(q.desc, 0, req, 32, NEXT, 1)
    q.write_desc(q.desc, 1, resp, 32, WRITE, 0)
    q.publish_head(0)


CASES: list[tuple[str, Callable[[Rig, MockSplitQueue], None], bool]] = [
    ("ring/head-range", b_head_range, True),
    ("ring/avail-idx-jump", b_avail_jump, True),
    ("ring/next-range", b_next_range, True),
    ("ring/loop", b_loop, True),
    ("ring/loop", b_self_loop, True),
    ("ring/indirect-len", b_indirect_len0, True),
    ("ring/indirect-len", b_indirect_len24, True),
    ("ring/indirect-nested", b_indirect_nested, True),
    ("ring/indirect-next", b_indirect_next, True),
    ("ring/next-range", b_indirect_next_range, True),
    ("ring/loop", b_indirect_loop, True),
    ("ring/dma", b_indirect_table_unbacked, True),
    ("ring/write-before-read", b_write_before_read, True),
    ("ring/addr-overflow", b_addr_overflow, True),
    ("ring/dma", b_desc_outside_ram, True),
    ("ring/dma", b_desc_unmapped, True),
]


def check_broken(rig: Rig, rule: str, queue: int = Q) -> None:
    q = rig.queues[queue]
    before = len(rig.dma.log)
    memory = rig.dma.mem.copy()   # ring views bypass the log
    used_before = q.used_idx()
    rig.kick(queue)
    rig.clock.run()
    assert rig.mmio.violations[-1].rule == rule, rig.mmio.violations
    assert [e["rule"] for e in rig.tracer.kinds("ring_broken")] == [rule]
    assert rig.r(0x70) & 0x40, "DEVICE_NEEDS_RESET"
    assert rig.r(0x60) & 2, "config-change interrupt"
    assert rig.irq.level
    assert q.used_idx() == used_before
    assert not [e for e in rig.dma.log[before:] if e[0] == "write"], "device wrote memory"
    assert (rig.dma.mem == memory).all(), "device wrote memory"


@pytest.mark.parametrize("views", [False, True], ids=["dma", "ring-view"])
@pytest.mark.parametrize("rule,build,_", CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_broken_ring(rule: str, build: Callable[[Rig, MockSplitQueue], None], _: bool,
                     views: bool) -> None:
    """Each rule, with the ring read through DMA calls and through one ring view (a
    port that offers ports.DmaPort.ring_view): the same rule, nothing written."""
    rig = Rig(qsize=8)
    if views:
        rig.dma.view_epoch = 0
    cid = rig.create_context()
    assert cid == 1
    build(rig, rig.queues[Q])
    ring = rig.dev.queues[Q]
    assert (ring._ring_mem(rig.dma) is not None) == views   # type: ignore[attr-defined]
    check_broken(rig, rule)
    # All queues of the function stop: a control request is not served.
    ctl = rig.queues[0]
    req = rig.alloc.alloc(16)
    resp = rig.alloc.alloc(8)
    rig.dma.g_write(req, struct.pack("<IIII", 1, 0, 0, 0))
    ctl.add([(req, 16, False), (resp, 8, True)])
    rig.kick(0)
    rig.clock.run()
    assert ctl.pop_used() is None
    # Reset + re-init restores full function.
    rig.init()
    assert rig.r(0x70) & 0x40 == 0 and rig.r(0x60) == 0 and not rig.irq.level
    cid = rig.create_context()
    r = rig.submit(cid, nop(16), fence=9)
    assert (r.status, r.fence) == (0, 9)


def test_indirect_not_negotiated() -> None:
    rig = Rig(qsize=8, features=(1 << 32) | (1 << 33))
    rig.create_context()
    b_indirect_loop(rig, rig.queues[Q])
    check_broken(rig, "ring/indirect-not-negotiated")


def test_broken_controlq_ring() -> None:
    rig = Rig(qsize=8)
    b_head_range(rig, rig.queues[0])
    check_broken(rig, "ring/head-range", queue=0)


def test_ring_area_unbacked() -> None:
    rig = Rig(qsize=8)
    rig.w(0x70, 0)
    rig.w(0x70, 1)
    rig.w(0x70, 3)
    rig.w(0x24, 1)
    rig.w(0x20, 1)
    rig.w(0x70, 3 | 8)
    rig.w(0x30, 0)
    rig.w(0x80, 0x2000)  # descriptor table outside guest RAM
    rig.w(0x90, rig.queues[0].avail)
    rig.w(0xA0, rig.queues[0].used)
    rig.w(0x44, 1)
    rig.w(0x70, 15)
    rig.kick(0)
    assert rig.mmio.violations[-1].rule == "ring/dma"
    assert rig.r(0x70) & 0x40


def test_eventq_avail_jump_breaks() -> None:
    rig = Rig(qsize=8)
    rig.queues[1].w16(rig.queues[1].avail + 2, 200)
    check_broken(rig, "ring/avail-idx-jump", queue=1)
