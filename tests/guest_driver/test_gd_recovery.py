"""Fences complete exactly once through resets, faults and a misbehaving device."""
import errno
from collections import Counter

import pytest

from gd_fakes import OFFERED, bad_cmdbuf
from gd_helpers import Client, booted, expect_errno, in_flight, nop_cmdbuf, signals
from guest_driver import uapi as U
from hwspec import va1 as A
from hwspec import virtio as V


def in_flight_setup(c, dev):
    a, b, h, fences = in_flight(c, dev)
    assert [s for _, s in fences] == [1, 2, 1, 3]
    return a, b, h, fences


def test_needs_reset_aborts_every_in_flight_fence_once_and_recovers():
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight_setup(c, dev)
    k.sched.run_all()
    assert not k.trace.of("fence_signal")
    dev.set_needs_reset()
    k.sched.run_all()
    assert dev.resets == 2 and dev.status & V.STATUS_DRIVER_OK  # boot + recovery
    assert k.trace.of("reset")[0]["reason"].startswith("device set DEVICE_NEEDS_RESET")
    sig = signals(k)
    assert sig == Counter({fk: 1 for fk in fences})
    for cid, seq in fences:
        w = c.wait(cid, seq, 0)
        assert w.status == A.Status.ABORTED and w.error_offset == A.NO_OFFSET
    # old contexts are gone; destroying them is allowed, submitting is not
    expect_errno(errno.ECANCELED, c.submit, a, h, 16, match="lost in a device reset")
    c.destroy(b)
    # the device came back: eventq re-posted, new contexts work
    dev.hold_submits = False
    assert len(dev.queues[A.EVENTQ].pending) == dev.queues[A.EVENTQ].num
    n = c.ctx()
    seq = c.submit(n, h, 16)
    assert seq == 1 and c.wait(n, seq).status == A.Status.OK
    assert signals(k)[(n, 1)] == 1 and max(signals(k).values()) == 1
    assert dev.violations == []
    assert gos.devices["/dev/accel/accel0"].resets == 1


def test_reset_while_task_blocked_in_wait_returns_aborted():
    k, dev, gos, c = booted()
    dev.hold_submits = True
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    seq = c.submit(cid, h, 8)
    k.sched.at(10_000, dev.set_needs_reset)
    w = c.wait(cid, seq, -1)  # would hang forever without the recovery
    assert w.status == A.Status.ABORTED
    assert k.trace.of("wait")[-1] == {"dev": "accel0", "what": "fence", "timeout_ns": -1,
                                       "context": cid, "fence": seq}


@pytest.mark.parametrize("bad, msg", [(("id", 256), "out of range"),
                                      (("id", 3), "not the head"),
                                      (("len", 33), "exceeds its writable capacity")])
def test_bad_used_entry_from_device_is_detected_and_recovered(bad, msg):
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    dev.corrupt_used = bad
    seq = c.submit(cid, h, 8)
    w = c.wait(cid, seq, -1)
    assert w.status == A.Status.ABORTED
    err = k.trace.of("ring_error")
    assert len(err) == 1 and err[0]["queue"] == A.FIRST_SUBMITQ and msg in err[0]["error"]
    assert len(k.trace.of("reset")) == 1 and signals(k)[(cid, seq)] == 1
    n = c.ctx()
    assert c.wait(n, c.submit(n, h, 8)).status == A.Status.OK


def test_control_request_never_answered_times_out_and_resets():
    k, dev, gos, c = booted()
    dev.ignore_ctrl = True
    e = expect_errno(errno.ETIMEDOUT, c.ctx, match="did not answer")
    assert "CONTEXT_CREATE" in str(e)
    assert len(k.trace.of("reset")) == 1
    dev.ignore_ctrl = False
    assert c.ctx() == 1  # the failed create consumed no id
    assert dev.contexts == {1: False}


def test_context_fault_marks_context_and_spares_others():
    k, dev, gos, c = booted()
    bad_ctx, good_ctx = c.ctx(), c.ctx()
    bad = c.cmdbuf(bad_cmdbuf())
    good = c.cmdbuf(nop_cmdbuf(1))
    w = c.wait(bad_ctx, c.submit(bad_ctx, bad, 16))
    assert w.status == A.Status.BAD_OPCODE and w.error_offset == 8
    k.sched.run_all()
    ev = k.trace.of("context_fault")
    assert len(ev) == 1 and ev[0]["context"] == bad_ctx and ev[0]["status"] == A.Status.BAD_OPCODE
    expect_errno(errno.ECANCELED, c.submit, bad_ctx, good, 8, match="faulted (status BAD_OPCODE)")
    assert c.wait(good_ctx, c.submit(good_ctx, good, 8)).status == A.Status.OK
    c.destroy(bad_ctx)
    n = c.ctx()
    assert c.wait(n, c.submit(n, good, 8)).status == A.Status.OK


def test_event_alone_marks_context_faulted():
    """CONTEXT_FAULT from the eventq is enough (e.g. the response is still to come)."""
    k, dev, gos, c = booted()
    cid = c.ctx()
    good = c.cmdbuf(nop_cmdbuf(1))
    k.sched.run_all()
    dev._post_event(1, 9, A.Status.OUT_OF_BOUNDS, 16)
    k.sched.run_all()
    expect_errno(errno.ECANCELED, c.submit, cid, good, 8, match="OUT_OF_BOUNDS")
    # the event buffer was re-posted
    k.sched.run_all()
    assert len(dev.queues[A.EVENTQ].pending) == dev.queues[A.EVENTQ].num


@pytest.mark.parametrize("offered", [OFFERED, OFFERED & ~(1 << V.F_RING_INDIRECT_DESC)])
def test_full_submit_ring_blocks_until_space(offered):
    k, dev, gos, c = booted(num_max=4, offered=offered)
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    seqs = [c.submit(cid, h, 8) for _ in range(12)]
    assert seqs == list(range(1, 13))
    waits = [w for w in k.trace.of("wait") if w["what"] == "submit_space"]
    assert waits and all(w["queue"] == A.FIRST_SUBMITQ for w in waits)
    assert all(c.wait(cid, s).status == A.Status.OK for s in seqs)
    assert max(signals(k).values()) == 1 and len(signals(k)) == 12


def test_reset_while_blocked_on_ring_space_gives_ecanceled():
    k, dev, gos, c = booted(num_max=2, offered=OFFERED & ~(1 << V.F_RING_INDIRECT_DESC))
    dev.hold_submits = True
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    first = c.submit(cid, h, 8)  # the only request that fits (2 descriptors)
    k.sched.at(5000, dev.set_needs_reset)
    expect_errno(errno.ECANCELED, c.submit, cid, h, 8)
    assert c.wait(cid, first, 0).status == A.Status.ABORTED
    assert signals(k) == Counter({(cid, 1): 1})


def test_busy_buffer_free_is_deferred_until_fence():
    k, dev, gos, c = booted()
    dev.hold_submits = True
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    d, _ = c.bo(4096, U.BO_DEVICE)
    alloc, devmem = c.f.dev.alloc, c.f.dev.devmem
    host_before, dev_before = alloc.bytes_free, devmem.bytes_free
    seq = c.submit(cid, h, 8, handles=[d])
    shadow = host_before - alloc.bytes_free   # the driver's copy of the command buffer
    assert 0 < shadow <= 64
    c.free(h)
    c.free(d)
    expect_errno(errno.ENOENT, c.f.mmap, h)
    assert alloc.bytes_free == host_before - shadow and devmem.bytes_free == dev_before
    dev.release_held()
    assert c.wait(cid, seq).status == A.Status.OK
    assert alloc.bytes_free == host_before + 4096
    assert devmem.bytes_free == dev_before + 4096


def test_event_idx_suppresses_kicks_and_plain_mode_kicks_each_time():
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    kicks0 = len(k.trace.of("kick"))
    seqs = [c.submit(cid, h, 8) for _ in range(5)]  # device has not looked yet
    sq_kicks = [x for x in k.trace.of("kick")[kicks0:] if x["queue"] == A.FIRST_SUBMITQ]
    assert len(sq_kicks) == 1
    assert all(c.wait(cid, s).status == A.Status.OK for s in seqs)
    k2, dev2, _, c2 = booted(offered=OFFERED & ~(1 << V.F_RING_EVENT_IDX))
    cid2 = c2.ctx()
    h2 = c2.cmdbuf(nop_cmdbuf(1))
    kicks0 = len(k2.trace.of("kick"))
    for _ in range(5):
        c2.submit(cid2, h2, 8)
    assert len(k2.trace.of("kick")[kicks0:]) == 5
    # every kick is exactly one QueueNotify write
    notifies = [v for d_, a, s, v in k2.mmio.log if d_ == "w" and a & 0xFFF == 0x050]
    assert len(notifies) == len(k2.trace.of("kick"))


def test_irq_handler_costs_two_mmio_accesses():
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    seq = c.submit(cid, h, 8)
    k.sched.run_all()
    n0 = len(k.mmio.log)
    irq = k.irq.handlers[k.platform_devices[0].irq]
    dev.isr |= 1
    irq()
    assert len(k.mmio.log) - n0 == 2
    assert c.wait(cid, seq, 0).status == A.Status.OK


def run_scenario():
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight_setup(c, dev)
    k.sched.at(3000, dev.set_needs_reset)
    k.sched.run_all()
    dev.hold_submits = False
    n = c.ctx()
    c.wait(n, c.submit(n, h, 16))
    return k.trace.events, k.mmio.log


def test_same_run_same_trace():
    assert run_scenario() == run_scenario()


def test_close_with_work_in_flight_then_reset_still_signals_once():
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight_setup(c, dev)
    c.f.close()
    k.sched.run_all()
    dev.set_needs_reset()
    k.sched.run_all()
    assert signals(k) == Counter({fk: 1 for fk in fences})
    dev.hold_submits = False
    c2 = Client(gos.open("/dev/accel/accel0"))
    n = c2.ctx()
    h2 = c2.cmdbuf(nop_cmdbuf(1))
    assert c2.wait(n, c2.submit(n, h2, 8)).status == A.Status.OK


def test_wrong_fence_seq_echo_is_a_device_error():
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    dev.corrupt_seq = True
    seq = c.submit(cid, h, 8)
    assert c.wait(cid, seq).status == A.Status.ABORTED
    assert "fence_seq 2 for a request with fence_seq 1" in k.trace.of("reset")[0]["reason"]
    assert signals(k) == Counter({(cid, 1): 1})


def test_device_that_cannot_reset_is_dead_and_nothing_hangs():
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight_setup(c, dev)
    dev.stuck_reset = True
    dev.set_needs_reset()
    k.sched.run_all()
    assert signals(k) == Counter({fk: 1 for fk in fences})
    assert all(c.wait(cid, s, -1).status == A.Status.ABORTED for cid, s in fences)
    expect_errno(errno.ENODEV, c.ctx, match="dead")
    expect_errno(errno.ENODEV, c.submit, a, h, 16, match="dead")
    expect_errno(errno.ENODEV, c.bo, 64, match="dead")
    c.f.close()  # still closes cleanly


def test_config_change_without_needs_reset_rereads_config():
    k, dev, gos, c = booted()
    dev.cfg["max_contexts"] = 3
    dev.isr |= 2
    dev.raise_irq()
    k.sched.run_all()
    assert k.trace.of("config_change") and not k.trace.of("reset")
    p = U.ffi.new("struct drm_va1_get_param *", {"param": U.PARAM_MAX_CONTEXTS})
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_PARAM, p)
    assert p.value == 3


def test_bad_used_entry_on_eventq_recovers_without_crashing():
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight_setup(c, dev)
    k.sched.run_all()
    dev.corrupt_queue, dev.corrupt_used = A.EVENTQ, ("len", 4096)
    dev._post_event(1, 1, A.Status.BAD_OPCODE, 0)
    k.sched.run_all()
    err = k.trace.of("ring_error")
    assert [e["queue"] for e in err] == [A.EVENTQ] and "writable capacity" in err[0]["error"]
    assert signals(k) == Counter({fk: 1 for fk in fences})
    dev.hold_submits = False
    n = c.ctx()
    assert c.wait(n, c.submit(n, h, 16)).status == A.Status.OK
