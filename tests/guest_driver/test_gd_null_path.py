"""The null round trip's shortcuts keep the driver's behaviour: an interrupt looks at
every queue but reaps only those whose used ring moved, a fence is its own guest-state
wait condition, and SUBMIT's checks still refuse what they refused."""
from __future__ import annotations

import errno
import struct
from types import SimpleNamespace
from typing import Any

import pytest

from gd_fakes import RAM_BASE, FakeMemory, bad_cmdbuf, make_machine, nop_cmdbuf
from gd_helpers import Client, booted, expect_errno
from guest_driver.boot import boot
from guest_driver.kernel import plain_emitter, reads_guest_state_only
from guest_driver.mm import PageAllocator
from guest_driver.virtio.packed_ring import PackedQueue
from guest_driver.virtio.split_ring import QueueFull, RingError, SplitQueue
from guest_driver.va1.driver import _used_look
from guest_driver.va1.fence import FenceTimeline
from hwspec import va1 as A


class _Tracer:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def emit(self, kind: str, **fields: object) -> None:
        self.events.append((kind, fields))


def test_an_interrupt_reaps_only_the_queues_whose_used_ring_moved() -> None:
    k, dev, gos, c = booted()
    drv = c.f.dev
    reaped: list[int] = []
    for q in drv._queues:
        def spy(q=q, real=q.ring.get_used):  # type: ignore[no-untyped-def]
            reaped.append(q.index)
            return real()
        q.ring.get_used = spy
    cid = c.ctx()
    reaped.clear()
    h = c.cmdbuf(nop_cmdbuf(2))
    seq = c.submit(cid, h, 16, queue=1)
    assert c.wait(cid, seq).status == A.Status.OK
    assert set(reaped) == {A.FIRST_SUBMITQ + 1}
    # the other queues were left with their interrupts on: the next completion on
    # queue 0 still interrupts and completes
    seq = c.submit(cid, h, 16, queue=0)
    assert c.wait(cid, seq).status == A.Status.OK
    assert A.FIRST_SUBMITQ in reaped and dev.violations == []


def test_a_fence_is_its_own_guest_state_wait_condition() -> None:
    tracer = _Tracer()
    tl = FenceTimeline(7, tracer)
    fence = tl.next(0)
    assert reads_guest_state_only(fence) and fence() is False
    tl.signal(fence, A.Status.OK)
    assert fence() is True
    assert tracer.events == [("fence_signal", {"context": 7, "fence": 1,
                                               "status": int(A.Status.OK)})]


def test_submit_still_refuses_a_faulted_or_destroyed_context_and_a_dead_device() -> None:
    k, dev, gos, c = booted()
    drv = c.f.dev
    h = c.cmdbuf(nop_cmdbuf(2))
    cid = c.ctx()
    ctx = c.f._contexts[cid]
    ctx.faulted, ctx.fault_status = True, int(A.Status.BAD_OPCODE)
    expect_errno(errno.ECANCELED, c.submit, cid, h, 16, match="faulted")
    ctx.faulted = False
    ctx.lost = True
    expect_errno(errno.ECANCELED, c.submit, cid, h, 16, match="lost in a device reset")
    ctx.lost = False
    ctx.destroyed = True
    expect_errno(errno.ENOENT, c.submit, cid, h, 16, match="destroyed")
    ctx.destroyed = False
    drv.dead = "test"
    expect_errno(errno.ENODEV, c.submit, cid, h, 16, match="device is dead")


# ---- the split ring's usual request and the interrupt's look at the used index ----------

def _twin_rings(**opts: bool) -> tuple[list[Any], list[Any]]:
    """Two split rings alike, each in its own memory at the same addresses."""
    rings, mems = [], []
    for _ in range(2):
        mem = FakeMemory()
        rings.append(SplitQueue(mem, PageAllocator(mem.base, mem.size), 2, 8,
                                max_indirect=2, **opts))
        mems.append(mem)
    return rings, mems


def _use(mem: FakeMemory, ring: SplitQueue[Any], head: int, length: int) -> None:
    """The device's side: head used with `length` bytes written."""
    idx = mem.u16(ring.device_addr + 2)
    mem.write(ring.device_addr + 4 + 8 * (idx % ring.num), struct.pack("<II", head, length))
    mem.put16(ring.device_addr + 2, idx + 1)


def _ring_state(ring: SplitQueue[Any], mem: FakeMemory) -> tuple[object, ...]:
    return (mem.read(ring.base, ring.layout.total), list(ring._free_descs), ring._tokens,
            ring._chains, ring._wcap, ring.avail_idx, ring._kicked_idx, ring.in_flight,
            list(ring._heads), ring.has_used())


@pytest.mark.parametrize("opts", [dict(indirect=True, event_idx=True),
                                  dict(indirect=False, event_idx=False),
                                  dict(indirect=True, event_idx=False, in_order=True),
                                  dict(indirect=False, event_idx=True, in_order=True)])
def test_add_pair_writes_and_records_what_add_does(opts: dict[str, bool]) -> None:
    (fast, slow), (mf, ms) = _twin_rings(**opts)
    n = 0
    kicks = set()
    for rnd in range(40):   # past a wrap of the 8 entries, with reaps in between
        for _ in range(rnd % 5):
            if fast.num_free < fast.descs_needed(2):
                break
            # what the device asks for: avail_event (EVENT_IDX), else used.flags
            for mem, ring in ((mf, fast), (ms, slow)):
                if ring.event_idx:
                    mem.put16(ring.device_addr + ring.layout.avail_event - ring.layout.used,
                              n // 3)
                else:
                    mem.put16(ring.device_addr, n % 3 == 0)   # VRING_USED_F_NO_NOTIFY
            a = 0x1000 + 64 * n
            kick = fast.add_pair(a, 32, a + 32, 24, n)
            slow.add(((a, 32),), ((a + 32, 24),), n)
            assert kick == slow.kick_prepare()
            kicks.add(kick)
            n += 1
            assert _ring_state(fast, mf) == _ring_state(slow, ms)
        heads = [h for h, t in enumerate(fast._tokens) if t is not None]
        for h in sorted(heads, key=lambda h: fast._tokens[h])[:2]:   # oldest first
            _use(mf, fast, h, 24)
            _use(ms, slow, h, 24)
        assert fast.get_used() == slow.get_used()
        assert _ring_state(fast, mf) == _ring_state(slow, ms)
    assert kicks == {True, False}


def test_add_pair_falls_back_to_add_on_a_full_or_broken_ring() -> None:
    (ring, _), (mem, _) = _twin_rings(indirect=False, event_idx=False)
    for i in range(4):
        ring.add_pair(0x1000, 8, 0x2000, 8, i)
    with pytest.raises(QueueFull, match="2 descriptors needed, 0 free"):
        ring.add_pair(0x1000, 8, 0x2000, 8, 9)
    ring.broken = "test"
    with pytest.raises(RingError, match="is broken: test"):
        ring.add_pair(0x1000, 8, 0x2000, 8, 9)


def test_the_used_index_read_inline_says_what_has_used_says() -> None:
    (ring, _), (mem, _) = _twin_rings(indirect=True, event_idx=True)
    assert ring.used_view is not None

    def inline() -> bool:
        assert ring.used_view is not None
        return struct.unpack_from("<H", ring.used_view, ring.used_off)[0] != ring.last_used
    for i in range(30):
        heads = [ring.add([(0x1000, 8)], [(0x2000, 8)], (i, j)) for j in range(i % 3 + 1)]
        assert inline() is ring.has_used() is False
        for h in heads:
            _use(mem, ring, h, 8)
            assert inline() is ring.has_used() is True
        ring.get_used()
        assert inline() is ring.has_used() is False
    mem_p = FakeMemory()
    packed = PackedQueue(mem_p, PageAllocator(mem_p.base, mem_p.size), 2, 8, indirect=False,
                         event_idx=False)
    assert packed.used_view is None   # no used index: the interrupt asks has_used()


def test_each_interrupt_is_counted_once_and_reaps_only_a_ready_device() -> None:
    k, dev, gos, c = booted()
    drv = c.f.dev
    reaps: list[int] = []
    real = drv._reap_all

    def spy() -> None:
        reaps.append(drv.interrupts)
        real()
    drv._reap_all = spy   # type: ignore[method-assign]
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(2))
    before = drv.interrupts
    assert c.wait(cid, c.submit(cid, h, 16)).status == A.Status.OK
    assert drv.interrupts > before and reaps[-1] == drv.interrupts   # used buffers: reaped
    n, r = drv.interrupts, len(reaps)
    drv._interrupt(False, [A.FIRST_SUBMITQ])   # an interrupt naming its queue
    assert drv.interrupts == n + 1 and len(reaps) == r
    drv.ready = False
    drv._interrupt(False, None)                # not ready: counted, nothing reaped
    assert drv.interrupts == n + 2 and len(reaps) == r


# --- round 6: the driver's events through emit_plain, the interrupt's look in C --------

class _PlainTrace:
    """A tracer with emit_plain: records every event and which method brought it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []
        self.plain: list[str] = []

    def emit(self, kind: str, **fields: object) -> None:
        self.events.append((kind, fields))

    def emit_plain(self, kind: str, fields: dict[str, object]) -> None:
        self.plain.append(kind)
        self.events.append((kind, dict(fields)))


def _round_trips(k: Any, c: Any, bad: bool = False) -> None:
    """Submissions on both submit queues and their waits (a failing one when `bad`)."""
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(2))
    for queue in (0, 1, 0, 0, 1):
        assert c.wait(cid, c.submit(cid, h, 16, queue=queue)).status == A.Status.OK
    seqs = [c.submit(cid, h, 16, queue=q) for q in (1, 0, 1)]
    for seq in seqs:
        assert c.wait(cid, seq).status == A.Status.OK
    if bad:
        hb = c.cmdbuf(bad_cmdbuf())
        assert c.wait(cid, c.submit(cid, hb, 16)).status != A.Status.OK


def test_plain_emitter_takes_emit_plain_only_for_plain_fixed_values() -> None:
    class Name(str):
        pass
    plain, only_emit = _PlainTrace(), _Tracer()
    assert plain_emitter(plain, "dev0", 3) == plain.emit_plain
    fallback = plain_emitter(plain, Name("dev0"))
    fallback("kick", {"dev": Name("dev0"), "queue": 2})
    assert plain.plain == [] and plain.events == [("kick", {"dev": "dev0", "queue": 2})]
    plain_emitter(only_emit)("reap", {"queue": 2, "count": 1})
    assert only_emit.events == [("reap", {"queue": 2, "count": 1})]


def test_the_drivers_events_through_emit_plain_are_those_of_emit() -> None:
    runs = []
    for trace in (_Tracer(), _PlainTrace()):
        k, devs = make_machine()
        k.trace = trace   # type: ignore[assignment]
        c = Client(boot(k).open("/dev/accel/accel0"))
        _round_trips(k, c, bad=True)
        runs.append(trace.events)
    assert runs[0] == runs[1]
    assert {"kick", "reap", "fence_signal"} <= set(trace.plain)
    # a wait carries the context id the timeline was given: always through emit (checks)
    assert "wait" not in trace.plain and any(e[0] == "wait" for e in trace.events)
    k, devs = make_machine()
    k.trace = trace = _PlainTrace()   # type: ignore[assignment]
    c = Client(boot(k).open("/dev/accel/accel0"))
    drv = c.f.dev
    fence = drv.submit(drv.create_context(), 0, drv.alloc.alloc_dma(16), 16)
    trace.plain.clear()
    assert drv.wait_fence(fence, None) is True and fence.signalled
    assert "wait" not in trace.plain and any(e[0] == "wait" for e in trace.events)


def _twin_runs(prepare: Any) -> list[list[tuple[str, dict[str, object]]]]:
    """The same round trips with the used indexes read through u16 views and with
    every ring asked `has_used()`."""
    runs = []
    for views in (True, False):
        k, dev, gos, c = booted()
        drv = c.f.dev
        assert [e[0] for e in drv._look] == drv._queues
        assert all(e[2] is not None for e in drv._look)
        if not views:
            drv._look = tuple((q, r, None, 0) for q, r, _, _ in drv._look)
        prepare(drv)
        _round_trips(k, c, bad=True)
        runs.append(k.trace.events)
    return runs


def test_the_interrupts_u16_views_reap_what_has_used_reaps() -> None:
    with_views, asked = _twin_runs(lambda drv: None)
    assert with_views == asked
    assert sum(1 for kind, _ in with_views if kind == "reap") >= 8


def test_a_broken_ring_is_reaped_and_recovers_as_before() -> None:
    k, dev, gos, c = booted()
    drv = c.f.dev
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(2))
    seq = c.submit(cid, h, 16)
    drv._queues[A.EVENTQ].ring.broken = "broken by the test"
    assert c.wait(cid, seq).status == A.Status.ABORTED
    assert drv.resets == 1
    assert any(kind == "ring_error" and f["queue"] == A.EVENTQ
               for kind, f in k.trace.events)
    # set up again with the queues of the new generation
    assert [e[0] for e in drv._look] == drv._queues and drv.ready


def test_rings_without_a_used_index_view_are_asked_has_used() -> None:
    alloc = PageAllocator(RAM_BASE, 1 << 20)
    packed: PackedQueue[int] = PackedQueue(FakeMemory(), alloc, 2, 8, indirect=True,
                                           event_idx=True)
    assert _used_look(SimpleNamespace(ring=packed))[2:] == (None, 0)  # type: ignore[arg-type]
    split: SplitQueue[int] = SplitQueue(FakeMemory(), alloc, 2, 8, indirect=True,
                                        event_idx=True)
    q = SimpleNamespace(ring=split)
    _, _, view, at = _used_look(q)  # type: ignore[arg-type]
    assert view is not None and view[at] == split.used_idx() == 0
    split._ring[split.used_off:split.used_off + 2] = struct.pack("<H", 0x1234)
    assert view[at] == split.used_idx() == 0x1234
