"""VA-1 over virtio-pci: reset and recovery through the MSI-X config vector, with every
fence completing exactly once, as over virtio-mmio (same driver code)."""
import errno
from collections import Counter

import pytest

from gd_helpers import Client, expect_errno, in_flight, nop_cmdbuf, signals
from gd_pci_fakes import make_pci_machine
from guest_driver.boot import boot
from guest_driver.virtio.pci import MODE_PER_QUEUE, MODE_SHARED
from hwspec import va1 as A
from hwspec import virtio as V
from hwspec import virtio_pci as VP


def booted(**kw):
    k, (dev,), m = make_pci_machine(**kw)
    gos = boot(k)
    assert gos.probe_errors == []
    return k, dev, gos, Client(gos.open("/dev/accel/accel0"))


@pytest.mark.parametrize("msix_n, mode", [(8, MODE_PER_QUEUE), (1, MODE_SHARED)])
def test_needs_reset_recovers_and_fences_complete_once(msix_n, mode):
    k, dev, gos, c = booted(msix_n=msix_n)
    d = gos.devices["/dev/accel/accel0"]
    assert d.transport.mode == mode
    a, b, h, fences = in_flight(c, dev)
    k.sched.run_all()
    allocs = k.irq.msi_allocs
    dev.set_needs_reset()
    k.sched.run_all()
    assert dev.resets == 2 and dev.status & V.STATUS_DRIVER_OK
    assert k.trace.of("reset")[0]["reason"].startswith("device set DEVICE_NEEDS_RESET")
    assert signals(k) == Counter({fk: 1 for fk in fences})
    assert all(c.wait(cid, s, 0).status == A.Status.ABORTED for cid, s in fences)
    # the reset unmapped every vector; re-initialisation routed them again, no new MSIs
    assert k.irq.msi_allocs == allocs
    want = {0: 1, 1: 2, 2: 3, 3: 4} if mode == MODE_PER_QUEUE else {0: 0, 1: 0, 2: 0, 3: 0}
    assert dev.msix_config == 0 and dev.qvec == want
    expect_errno(errno.ECANCELED, c.submit, a, h, 16, match="lost in a device reset")
    dev.hold_submits = False
    n = c.ctx()
    assert c.wait(n, c.submit(n, h, 16)).status == A.Status.OK
    assert max(signals(k).values()) == 1
    assert dev.violations == [] and dev.lost_interrupts == [] and k.stray_msi == []


def test_reset_while_blocked_in_wait_returns_aborted():
    k, dev, gos, c = booted()
    dev.hold_submits = True
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    seq = c.submit(cid, h, 8)
    k.sched.at(10_000, dev.set_needs_reset)
    assert c.wait(cid, seq, -1).status == A.Status.ABORTED
    assert signals(k) == Counter({(cid, seq): 1})


@pytest.mark.parametrize("bad, msg", [(("id", 256), "out of range"),
                                      (("len", 33), "exceeds its writable capacity")])
def test_bad_used_entry_is_detected_and_recovered(bad, msg):
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    dev.corrupt_used = bad
    seq = c.submit(cid, h, 8)
    assert c.wait(cid, seq, -1).status == A.Status.ABORTED
    err = k.trace.of("ring_error")
    assert len(err) == 1 and err[0]["queue"] == A.FIRST_SUBMITQ and msg in err[0]["error"]
    n = c.ctx()
    assert c.wait(n, c.submit(n, h, 8)).status == A.Status.OK
    assert signals(k)[(cid, seq)] == 1


def test_control_request_never_answered_times_out_and_resets():
    k, dev, gos, c = booted()
    dev.ignore_ctrl = True
    expect_errno(errno.ETIMEDOUT, c.ctx, match="did not answer")
    dev.ignore_ctrl = False
    assert c.ctx() == 1


def test_device_that_cannot_reset_is_dead_and_nothing_hangs():
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight(c, dev)
    dev.stuck_reset = True
    dev.set_needs_reset()
    k.sched.run_all()
    assert signals(k) == Counter({fk: 1 for fk in fences})
    assert all(c.wait(cid, s, -1).status == A.Status.ABORTED for cid, s in fences)
    expect_errno(errno.ENODEV, c.ctx, match="dead")
    c.f.close()


def test_context_fault_event_over_pci():
    k, dev, gos, c = booted()
    from gd_fakes import bad_cmdbuf
    bad_ctx, good_ctx = c.ctx(), c.ctx()
    w = c.wait(bad_ctx, c.submit(bad_ctx, c.cmdbuf(bad_cmdbuf()), 16))
    assert w.status == A.Status.BAD_OPCODE and w.error_offset == 8
    k.sched.run_all()
    assert [e["context"] for e in k.trace.of("context_fault")] == [bad_ctx]
    good = c.cmdbuf(nop_cmdbuf(1))
    assert c.wait(good_ctx, c.submit(good_ctx, good, 8)).status == A.Status.OK


def test_interrupts_counted_in_stats():
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    c.wait(cid, c.submit(cid, h, 8))
    st = c.f.dev.get_stats()
    assert st["submissions"] == 1 and st["interrupts"] >= 2


def run_scenario(seed_unused=0):
    k, dev, gos, c = booted()
    a, b, h, fences = in_flight(c, dev)
    k.sched.at(3000, dev.set_needs_reset)
    k.sched.run_all()
    dev.hold_submits = False
    n = c.ctx()
    c.wait(n, c.submit(n, h, 16))
    return k.trace.events, k.mmio.log, k.msi_log


def test_same_run_same_trace():
    assert run_scenario() == run_scenario()


def test_msix_config_vector_refused_after_reset_falls_back_then():
    k, dev, gos, c = booted()
    d = gos.devices["/dev/accel/accel0"]
    dev.vector_limit = 1  # from now on the device can only route to vector 0
    dev.set_needs_reset()
    k.sched.run_all()
    assert d.transport.mode == MODE_SHARED and not d.dead
    assert set(dev.qvec.values()) == {0} and len(k.irq.msi) == 1
    n = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    assert c.wait(n, c.submit(n, h, 8)).status == A.Status.OK
    assert VP.MSI_NO_VECTOR not in dev.qvec.values()
