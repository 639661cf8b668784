"""The null round trip's shortcuts keep the driver's behaviour: an interrupt looks at
every queue but reaps only those whose used ring moved, a fence is its own guest-state
wait condition, and SUBMIT's checks still refuse what they refused."""
from __future__ import annotations

import errno

from gd_fakes import nop_cmdbuf
from gd_helpers import booted, expect_errno
from guest_driver.kernel import reads_guest_state_only
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
