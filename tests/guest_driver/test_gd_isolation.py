"""Isolation between the open files (processes) of one guest, on the fake device: host
addresses checked per file at SUBMIT (and the checked bytes are what the device reads),
reused device memory scrubbed, device context ids quarantined while a destroyed
context's work can complete, and the device-memory allocator following a resize."""
import errno
import struct

import pytest

from gd_fakes import bad_cmdbuf, nop_cmdbuf
from gd_helpers import Client, booted, expect_errno, new
from gd_sriov_fakes import make_as_machine
from guest_driver import uapi as U
from guest_driver.boot import boot
from guest_driver.mm import RangeAllocator
from guest_driver.va1.devmem import DeviceMemory
from hwspec import isa
from hwspec import va1 as A

PAGE = A.CTX_PAGE


def cmd(op, **fields) -> bytes:
    lay = isa.PAYLOAD[op]
    return struct.pack(isa.HEADER.format, op, 0, isa.HEADER.size + lay.size) + struct.pack(
        lay.format, *(fields.get(n, 0) for n in lay.names))


def two_files(**kw):
    k, dev, gos, a = booted(**kw)
    b = Client(gos.open("/dev/accel/accel0"))
    return k, dev, gos.devices["/dev/accel/accel0"], a, b


def submit_raw(c, cid, raw, handles=()):
    h = c.cmdbuf(raw)
    return c.submit(cid, h, len(raw), handles=handles), h


# ------------------------------------------------------------------ host addresses
FOREIGN = {
    "dma_h2d": lambda x: cmd(isa.Opcode.DMA_H2D, src=x, dst=0, size=64),
    "dma_d2h": lambda x: cmd(isa.Opcode.DMA_D2H, src=0, dst=x, size=64),
    "signal": lambda x: cmd(isa.Opcode.SIGNAL, addr=x, value=1),
    "timestamp": lambda x: cmd(isa.Opcode.TIMESTAMP, addr=x),
    "wait": lambda x: cmd(isa.Opcode.WAIT, addr=x, value=1),
    "call": lambda x: cmd(isa.Opcode.CALL, addr=x, size=8),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_host_range_in_another_files_buffer_is_efault_and_nothing_is_queued(kind):
    k, dev, drv, a, b = two_files()
    ha, ia = a.bo(4096)
    a.f.mmap(ha)[:] = 0x5A
    cb = b.ctx()
    raw = nop_cmdbuf(1) + FOREIGN[kind](ia + 8)
    kicks = len(k.trace.of("kick"))
    e = expect_errno(errno.EFAULT, submit_raw, b, cb, raw)
    assert "command at offset 8" in str(e) and "not inside a HOST buffer of this file" in str(e)
    assert f"[{ia + 8:#x}" in str(e)
    k.sched.run_all()
    assert dev.cmdbufs == [] and len(k.trace.of("kick")) == kicks
    assert (a.f.mmap(ha) == 0x5A).all()
    assert b.f._contexts[cb].timeline.last_seq == 0        # no fence was issued


def test_ring_memory_and_unowned_ram_are_refused():
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    q = drv._queues[A.FIRST_SUBMITQ]
    for addr in (q.ring.desc_addr, q.slot_addr(0), drv._queues[A.CONTROLQ].slot_base,
                 0x1000, (1 << 64) - 8):
        expect_errno(errno.EFAULT, submit_raw, a, cid,
                     cmd(isa.Opcode.DMA_D2H, src=0, dst=addr, size=8))
    assert dev.cmdbufs == []


def test_own_buffers_are_accepted_to_the_byte_and_not_one_past():
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    h, iova = a.bo(100)
    seq, _ = submit_raw(a, cid, cmd(isa.Opcode.SIGNAL, addr=iova + 92, value=0x1234))
    assert a.wait(cid, seq).status == A.Status.OK
    assert struct.unpack("<Q", bytes(a.f.mmap(h)[92:100]))[0] == 0x1234
    e = expect_errno(errno.EFAULT, submit_raw, a, cid,
                     cmd(isa.Opcode.SIGNAL, addr=iova + 93, value=1))
    assert "SIGNAL" in str(e)
    h2, iova2 = a.bo(4096)            # two buffers side by side: a range may not span both
    expect_errno(errno.EFAULT, submit_raw, a, cid,
                 cmd(isa.Opcode.DMA_H2D, src=iova + 64, dst=0, size=iova2 - iova))
    # the command buffer's own HOST buffer is one of the file's
    raw = nop_cmdbuf(1) + cmd(isa.Opcode.SIGNAL, addr=0, value=5)
    hc = a.cmdbuf(raw + bytes(8))
    iova_c = a.f._bos[hc].addr
    a.f.mmap(hc)[8 + 8:8 + 16] = list(struct.pack("<Q", iova_c + len(raw)))
    seq = a.submit(cid, hc, len(raw))
    assert a.wait(cid, seq).status == A.Status.OK
    assert struct.unpack("<Q", bytes(a.f.mmap(hc)[len(raw):len(raw) + 8]))[0] == 5


def test_the_same_buffer_is_refused_again_once_the_buffer_it_names_is_freed():
    """A checked buffer is kept per file under its bytes: submitted again it runs again,
    and once a buffer it names is freed (or another is created at that address) the very
    same command buffer is checked anew and refused."""
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    h, iova = a.bo(4096)
    raw = nop_cmdbuf(1) + cmd(isa.Opcode.SIGNAL, addr=iova + 8, value=7)
    hc = a.cmdbuf(raw)
    for _ in range(2):
        assert a.wait(cid, a.submit(cid, hc, len(raw))).status == A.Status.OK
    assert struct.unpack("<Q", bytes(a.f.mmap(h)[8:16]))[0] == 7
    a.free(h)
    e = expect_errno(errno.EFAULT, a.submit, cid, hc, len(raw))
    assert "command at offset 8 (SIGNAL)" in str(e)
    _, ib = b.bo(4096)                  # the address may now be another file's buffer
    expect_errno(errno.EFAULT, a.submit, cid, hc, len(raw))


def test_zero_sizes_and_commands_after_an_unparseable_one_are_left_to_the_device():
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    _, ib = b.bo(4096)
    # a zero-size DMA touches nothing (the device refuses it: BAD_SHAPE)
    seq, _ = submit_raw(a, cid, cmd(isa.Opcode.DMA_H2D, src=ib, dst=0, size=0))
    # nothing after a command the device refuses runs: the walk stops there
    seq2, _ = submit_raw(b, b.ctx(), bad_cmdbuf() + cmd(isa.Opcode.SIGNAL, addr=0x1000))
    k.sched.run_all()
    assert len(dev.cmdbufs) == 2


def test_callees_are_checked_copied_and_patched():
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    _, foreign = b.bo(4096)
    h, iova = a.bo(4096)
    view = a.f.mmap(h)
    good = cmd(isa.Opcode.SIGNAL, addr=iova + 2048, value=3)
    view[1024:1024 + len(good)] = list(good)
    inner = cmd(isa.Opcode.CALL, addr=iova + 1024, size=len(good))
    view[512:512 + len(inner)] = list(inner)
    top = nop_cmdbuf(1) + cmd(isa.Opcode.CALL, addr=iova + 512, size=len(inner))
    dev.hold_submits = True
    seq, hc = submit_raw(a, cid, top)
    # user space rewrites everything after SUBMIT: the device still gets what was checked
    view[1024:1024 + len(good)] = list(cmd(isa.Opcode.SIGNAL, addr=foreign, value=3))
    a.f.mmap(hc)[:8] = 0xFF
    dev.release_held()
    k.sched.run_all()
    (ctx_id, shadow, read), = dev.cmdbufs
    assert shadow != a.f._bos[hc].addr and read[:8] == nop_cmdbuf(1)
    callee1 = struct.unpack_from("<Q", read, 8 + 8)[0]
    assert callee1 != iova + 512           # patched to the driver's copy
    assert dev.mem.read(callee1, len(inner))[:8] == inner[:8]
    callee2 = struct.unpack_from("<Q", dev.mem.read(callee1, len(inner)), 8)[0]
    assert dev.mem.read(callee2, len(good)) == good   # the checked bytes, not the rewrite
    a.wait(cid, seq)            # (the fake device knows no CALL: its status is no matter)
    # a foreign range in a callee is refused, naming the top-level CALL and the path
    view[1024:1024 + len(good)] = list(cmd(isa.Opcode.SIGNAL, addr=foreign, value=3))
    e = expect_errno(errno.EFAULT, submit_raw, a, a.ctx(), top)
    assert "command at offset 8 (CALL; callee offset 0/0) (SIGNAL)" in str(e)


def test_calls_the_device_refuses_are_not_followed():
    k, dev, drv, a, b = two_files(config={"max_call_depth": 1, "max_cmdbuf_size": 2048})
    cid = a.ctx()
    _, foreign = b.bo(4096)
    h, iova = a.bo(4096)
    view = a.f.mmap(h)
    evil = cmd(isa.Opcode.SIGNAL, addr=foreign, value=1)
    view[1024:1024 + len(evil)] = list(evil)
    deep = cmd(isa.Opcode.CALL, addr=iova + 1024, size=len(evil))   # depth 2 > 1
    view[0:len(deep)] = list(deep)
    top = cmd(isa.Opcode.CALL, addr=iova, size=len(deep))
    seq, _ = submit_raw(a, cid, top)          # accepted: the device fails it CALL_DEPTH
    for size in (0, 12, 2056):                # BAD_SHAPE / CMDBUF_TOO_LARGE: never read
        submit_raw(a, a.ctx(), cmd(isa.Opcode.CALL, addr=iova + 1024, size=size))
    k.sched.run_all()
    assert len(dev.cmdbufs) == 4 and all(len(c[2]) == 24 for c in dev.cmdbufs)
    # but the range of a CALL is always checked
    expect_errno(errno.EFAULT, submit_raw, a, a.ctx(), cmd(isa.Opcode.CALL, addr=foreign, size=8))


def test_referenced_host_buffers_are_pinned_until_the_fence():
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    h, iova = a.bo(4096)
    dev.hold_submits = True
    seq, hc = submit_raw(a, cid, cmd(isa.Opcode.SIGNAL, addr=iova, value=77))   # h not listed
    free0 = drv.alloc.bytes_free
    a.free(h)
    assert drv.alloc.bytes_free == free0          # still in use by the submission
    _, other = b.bo(4096)
    assert other != iova                          # not handed to anyone else meanwhile
    dev.release_held()
    assert a.wait(cid, seq).status == A.Status.OK
    assert struct.unpack("<Q", drv.kernel.memory.read(iova, 8))[0] == 77
    assert drv.alloc.bytes_free > free0 - 4096    # released (and the copy) after the fence


def test_an_efault_changes_nothing_and_the_file_goes_on():
    k, dev, drv, a, b = two_files()
    cid = a.ctx()
    _, foreign = b.bo(4096)
    free0 = drv.alloc.bytes_free
    expect_errno(errno.EFAULT, submit_raw, a, cid, cmd(isa.Opcode.SIGNAL, addr=foreign))
    h = a.cmdbuf(nop_cmdbuf(2))
    assert drv.alloc.bytes_free == free0 - 2 * 4096   # the two cmdbufs: no copy kept
    assert all(bo.busy == 0 for bo in a.f._bos.values())
    assert a.wait(cid, a.submit(cid, h, 16)).status == A.Status.OK


# ------------------------------------------------------------------ scrubbing
def as_files(**kw):
    k, dev = make_as_machine(**kw)
    gos = boot(k)
    a, b = Client(gos.open("/dev/accel/accel0")), Client(gos.open("/dev/accel/accel0"))
    return k, dev, gos.devices["/dev/accel/accel0"], a, b


def test_reused_device_memory_is_zeroed_before_the_new_owner_gets_it():
    k, dev, drv, a, b = as_files()
    h1, addr1 = a.bo(2 * PAGE, U.BO_DEVICE)
    assert dev.fills == [] and drv._kctx is None        # fresh memory: nothing to scrub
    a.free(h1)
    assert dev.fills == [] and drv.devmem.bytes_dirty == 2 * PAGE   # free costs nothing
    cb = b.ctx()
    n = len(dev.map_log)
    h2, addr2 = b.bo(3 * PAGE, U.BO_DEVICE)
    assert addr2 == addr1
    kctx = drv._kctx
    assert kctx is not None and kctx.device_id in dev.flat
    assert dev.fills == [(kctx.device_id, addr1, 2 * PAGE, 0)]  # only the dirty part
    assert [m[0] for m in dev.map_log[n:]] == ["MAP"]             # mapped after the scrub
    assert drv.devmem.bytes_dirty == 0
    b.free(h2)
    b.bo(PAGE, U.BO_DEVICE)
    assert dev.fills[-1] == (kctx.device_id, addr1, PAGE, 0)
    assert drv._kctx is kctx                                      # one context, reused
    assert len(kctx.timeline.fences) == 2 and b.f._contexts[cb].timeline.last_seq == 0


def test_the_drivers_context_yields_its_slot_to_a_user():
    k, dev, drv, a, b = as_files(config={"max_contexts": 2})
    h, _ = a.bo(PAGE, U.BO_DEVICE)
    a.free(h)
    a.ctx()
    b.bo(PAGE, U.BO_DEVICE)                 # scrub: the driver's context takes slot 2
    assert drv._kctx is not None and len(dev.contexts) == 2
    b.ctx()                                 # a user wants it: the idle one is destroyed
    assert drv._kctx is None and len(dev.contexts) == 2
    assert k.trace.of("kernel_context_released")


def test_no_context_left_to_scrub_is_enospc_and_changes_nothing():
    k, dev, drv, a, b = as_files(config={"max_contexts": 1})
    h, addr = a.bo(PAGE, U.BO_DEVICE)
    a.free(h)
    a.ctx()
    free0 = drv.devmem.bytes_free
    e = expect_errno(errno.ENOSPC, b.bo, PAGE, U.BO_DEVICE)
    assert "BO_CREATE" in str(e)
    assert drv.devmem.bytes_free == free0 and drv.devmem.bytes_dirty == PAGE
    assert b.f._bos == {} and dev.fills == []


def test_failed_scrub_gives_the_memory_back_dirty():
    k, dev, drv, a, b = as_files()
    h, addr = a.bo(PAGE, U.BO_DEVICE)
    a.free(h)
    dev.hold_submits = True

    def reset_during_scrub(cond, timeout_ns, what, _orig=k.sched.wait_until):
        if what.endswith("fence"):
            drv.recover("test")
        return _orig(cond, timeout_ns, what)
    k.sched.wait_until = reset_during_scrub
    e = expect_errno(errno.EIO, b.bo, PAGE, U.BO_DEVICE)
    assert "scrub" in str(e) and "ABORTED" in str(e)
    k.sched.wait_until = reset_during_scrub.__defaults__[0]
    assert drv.devmem.bytes_dirty == PAGE and b.f._bos == {}
    dev.hold_submits = False
    _, again = b.bo(PAGE, U.BO_DEVICE)           # a new driver context after the reset
    assert again == addr and dev.fills and drv.devmem.bytes_dirty == 0


def test_dirty_ranges_unit():
    m = DeviceMemory(16 * PAGE)
    a = m.alloc(4 * PAGE)
    b = m.alloc(4 * PAGE)
    m.free(a)
    m.free(b)
    assert m.dirty_in(0, 16 * PAGE) == [(0, 8 * PAGE)]
    m.mark_clean([(PAGE, 2 * PAGE)])
    assert m.dirty_in(0, 16 * PAGE) == [(0, PAGE), (3 * PAGE, 5 * PAGE)]
    assert m.dirty_in(2 * PAGE, 2 * PAGE) == [(3 * PAGE, PAGE)]
    m.resize(4 * PAGE)
    assert m.bytes_dirty == 2 * PAGE and m.size == 4 * PAGE


# ------------------------------------------------------------------ context-id quarantine
def test_a_destroyed_contexts_id_is_held_until_its_work_completed():
    k, dev, drv, a, b = two_files()
    ca = a.ctx()
    old = a.f._contexts[ca]
    dev.hold_submits = True
    seq, _ = submit_raw(a, ca, bad_cmdbuf())     # in flight, will fault when it runs
    a.f.close()                                   # mid-submission
    assert drv._quarantine == {old.device_id: old}
    cb = b.ctx()
    new_ctx = b.f._contexts[cb]
    assert new_ctx.device_id != old.device_id     # the device offered the old id: held
    assert set(drv._held) == {old.device_id}
    dev.release_held()
    k.sched.run_all()                             # the late fault lands on the held id
    assert old.timeline.get(seq).status == A.Status.BAD_OPCODE
    assert dev.contexts[old.device_id] is True and dev.contexts[new_ctx.device_id] is False
    assert not new_ctx.faulted
    h = b.cmdbuf(nop_cmdbuf(1))
    assert b.wait(cb, b.submit(cb, h, 8)).status == A.Status.OK
    assert drv._quarantine == {} and drv._held == {}   # released by the next ioctl
    assert old.device_id not in dev.contexts
    cc = b.ctx()
    assert b.f._contexts[cc].device_id == old.device_id     # reusable now


def test_an_idle_destroyed_context_id_is_reused_at_once():
    k, dev, drv, a, b = two_files()
    ca = a.ctx()
    dev_id = a.f._contexts[ca].device_id
    h = a.cmdbuf(nop_cmdbuf(1))
    assert a.wait(ca, a.submit(ca, h, 8)).status == A.Status.OK
    a.destroy(ca)
    assert drv._quarantine == {}
    assert b.f._contexts[b.ctx()].device_id == dev_id


def test_a_reset_ends_every_quarantine():
    k, dev, drv, a, b = two_files()
    ca = a.ctx()
    dev.hold_submits = True
    submit_raw(a, ca, nop_cmdbuf(1))
    a.destroy(ca)
    b.ctx()
    assert drv._quarantine and drv._held
    drv.recover("test")
    assert drv._quarantine == {} and drv._held == {}
    dev.hold_submits = False
    cb = b.ctx()
    assert b.wait(cb, b.submit(cb, b.cmdbuf(nop_cmdbuf(1)), 8)).status == A.Status.OK


# ------------------------------------------------------------------ resize
def param(c, p):
    g = new("get_param", param=p)
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_PARAM, g)
    return g.value


def test_allocator_follows_a_config_change_both_ways():
    k, dev, drv, a, b = two_files(config={"device_memory_size": 16 * PAGE})
    h_low, low = a.bo(4 * PAGE, U.BO_DEVICE)
    h_high, high = a.bo(8 * PAGE, U.BO_DEVICE)    # [4, 12) pages
    dev.cfg["device_memory_size"] = 8 * PAGE
    dev._signal_config()
    k.sched.run_all()
    assert param(a, U.PARAM_DEVICE_MEMORY_SIZE) == drv.devmem.size == 8 * PAGE
    assert k.trace.of("devmem_resize") == [{"dev": drv.name, "old": 16 * PAGE,
                                            "new": 8 * PAGE}]
    expect_errno(errno.ENOMEM, a.bo, PAGE, U.BO_DEVICE)   # the live buffer holds the rest
    a.free(h_high)                                        # only its part below the end
    assert drv.devmem.bytes_free == 4 * PAGE
    expect_errno(errno.ENOMEM, a.bo, 5 * PAGE, U.BO_DEVICE)
    dev.cfg["device_memory_size"] = 32 * PAGE
    dev._signal_config()
    k.sched.run_all()
    assert param(b, U.PARAM_DEVICE_MEMORY_SIZE) == drv.devmem.size == 32 * PAGE
    assert drv.devmem.bytes_free == 28 * PAGE
    _, big = b.bo(28 * PAGE, U.BO_DEVICE)
    assert big == 4 * PAGE


def test_allocator_follows_the_size_read_at_a_reset():
    k, dev, drv, a, b = two_files(config={"device_memory_size": 16 * PAGE})
    dev.cfg["device_memory_size"] = 64 * PAGE
    drv.recover("test")
    assert param(a, U.PARAM_DEVICE_MEMORY_SIZE) == drv.devmem.size == 64 * PAGE
    a.bo(64 * PAGE, U.BO_DEVICE)


def test_range_allocator_resize_keeps_allocations_past_the_end():
    r = RangeAllocator(0x1000, 0x10000, "t")
    x = r.alloc(0x4000)
    y = r.alloc(0x8000)                    # [0x5000, 0xD000)
    r.resize(0x6000)                       # end 0x7000: y crosses it
    assert r.bytes_free == 0
    r.resize(0x20000)                      # end 0x21000: free again past y only
    assert r.bytes_free == 0x21000 - 0xD000
    r.resize(0x6000)
    r.free(y)
    assert r.bytes_free == 0x7000 - 0x5000
    r.free(x)
    assert r.bytes_free == 0x6000 and r.alloc(0x6000) == 0x1000
    with pytest.raises(ValueError):
        r.resize(-1)
