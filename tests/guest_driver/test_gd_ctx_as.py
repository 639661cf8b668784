"""Context address spaces: every DEVICE buffer of a file mapped into every context of
that file (CONTEXT_MAP, va = pa), unmapped on free (deferred while busy), and the
fallback to flat contexts on a device without address spaces."""
import errno
import random

import pytest

from gd_helpers import Client, expect_errno, new, nop_cmdbuf
from gd_sriov_fakes import make_as_machine
from guest_driver import uapi as U
from guest_driver.boot import boot
from hwspec import va1 as A

RW = A.CTX_MAP_READ | A.CTX_MAP_WRITE


def setup(**kw):
    k, dev = make_as_machine(**kw)
    gos = boot(k)
    assert gos.probe_errors == []
    return k, dev, gos, gos.devices["/dev/accel/accel0"]


def maps_of(dev, drv, ctx_uid):
    """The fake device's table of one uAPI context: va -> (pa, size, flags)."""
    ctx = next(c for c in drv._contexts.values() if c.uid == ctx_uid)
    return dev.maps[ctx.device_id], ctx.device_id


def test_map_on_create_both_ways_with_page_rounding():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    h1, a1 = c.bo(100, U.BO_DEVICE)
    h2, a2 = c.bo(5000, U.BO_DEVICE)
    c.bo(64, U.BO_HOST)                       # host buffers are never mapped
    assert (a1, a2) == (0, A.CTX_PAGE)        # CTX_PAGE-aligned, sizes rounded up
    cid = c.ctx()                             # existing buffers mapped into a new context
    table, dcid = maps_of(dev, drv, cid)
    assert table == {a1: (a1, A.CTX_PAGE, RW), a2: (a2, 2 * A.CTX_PAGE, RW)}
    h3, a3 = c.bo(A.CTX_PAGE, U.BO_DEVICE)    # a new buffer into every existing context
    assert a3 == 3 * A.CTX_PAGE
    cid2 = c.ctx()
    for x in (cid, cid2):
        t, _ = maps_of(dev, drv, x)
        assert sorted(t) == [a1, a2, a3]
    assert dcid not in dev.flat and drv.ctx_as is True and drv.address_spaces
    assert dev.reaches(dcid, a2 + 5000 - 1) and not dev.reaches(dcid, 5 * A.CTX_PAGE)
    assert dev.violations == []


def test_other_files_contexts_do_not_reach_my_buffers():
    k, dev, gos, drv = setup()
    a = Client(gos.open("/dev/accel/accel0"))
    b = Client(gos.open("/dev/accel/accel0"))
    ca, cb = a.ctx(), b.ctx()
    _, addr_a = a.bo(8192, U.BO_DEVICE)
    _, addr_b = b.bo(4096, U.BO_DEVICE)
    ta, da = maps_of(dev, drv, ca)
    tb, db = maps_of(dev, drv, cb)
    assert list(ta) == [addr_a] and list(tb) == [addr_b]
    assert dev.reaches(da, addr_a, 8192) and not dev.reaches(da, addr_b)
    assert dev.reaches(db, addr_b, 4096) and not dev.reaches(db, addr_a)


def test_free_unmaps_from_every_context_before_memory_is_reused():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    x, y = c.ctx(), c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    free0 = drv.devmem.bytes_free
    n = len(dev.map_log)
    c.free(h)
    unmaps = dev.map_log[n:]
    assert [u[0] for u in unmaps] == ["UNMAP", "UNMAP"] and {u[2] for u in unmaps} == {addr}
    assert maps_of(dev, drv, x)[0] == {} and maps_of(dev, drv, y)[0] == {}
    assert drv.devmem.bytes_free == free0 + 4096
    other = Client(gos.open("/dev/accel/accel0"))
    oc = other.ctx()
    _, again = other.bo(4096, U.BO_DEVICE)
    assert again == addr                       # reused only after the unmaps
    assert list(maps_of(dev, drv, oc)[0]) == [addr]
    assert not dev.reaches(maps_of(dev, drv, x)[1], addr)


def test_busy_buffer_unmap_and_free_are_deferred_until_its_fence():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    cid = c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    cmd = c.cmdbuf(nop_cmdbuf(1))
    dev.hold_submits = True
    seq = c.submit(cid, cmd, 8, handles=[h])
    n = len(dev.map_log)
    free0 = drv.devmem.bytes_free
    c.free(h)
    assert dev.map_log[n:] == []                      # busy: nothing unmapped yet
    assert list(maps_of(dev, drv, cid)[0]) == [addr]
    assert drv.devmem.bytes_free == free0
    dev.release_held()
    k.sched.run_all()                                 # fence signalled in IRQ context
    assert dev.map_log[n:] == [] and len(drv.deferred) == 1   # queued, not done in IRQ
    w = c.wait(cid, seq)                              # next ioctl runs the deferred work
    assert w.status == A.Status.OK
    assert [e[0] for e in dev.map_log[n:]] == ["UNMAP"]
    assert maps_of(dev, drv, cid)[0] == {} and drv.devmem.bytes_free == free0 + 4096
    assert drv.deferred == []


def test_context_created_after_a_deferred_free_does_not_get_the_freed_buffer():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    cid = c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    dev.hold_submits = True
    seq = c.submit(cid, c.cmdbuf(nop_cmdbuf(1)), 8, handles=[h])
    c.free(h)
    cid2 = c.ctx()
    assert maps_of(dev, drv, cid2)[0] == {}
    dev.release_held()
    c.wait(cid, seq)
    assert maps_of(dev, drv, cid)[0] == {}


def test_fallback_to_flat_on_a_device_without_address_spaces():
    k, dev, gos, drv = setup(ctx_as=False)            # older device: MAP is BAD_ARG
    c = Client(gos.open("/dev/accel/accel0"))
    h, addr = c.bo(4096, U.BO_DEVICE)
    cid = c.ctx()                                     # first MAP answers BAD_ARG
    assert drv.ctx_as is False and not drv.address_spaces
    fb = k.trace.of("ctx_as_fallback")
    assert len(fb) == 1 and "BAD_ARG" in fb[0]["reason"]
    cid2 = c.ctx()                                    # FLAT refused by the old device: flags 0
    assert k.trace.of("ctx_flat_flag_refused") and drv._flat_flag == 0
    c.bo(4096, U.BO_DEVICE)
    c.free(h)
    assert all(ctx.flat for ctx in drv._contexts.values())
    w = c.wait(cid2, c.submit(cid2, c.cmdbuf(nop_cmdbuf(2)), 16))
    assert w.status == A.Status.OK and c.wait(cid, c.submit(cid, c.cmdbuf(nop_cmdbuf(1)), 8)
                                              ).status == A.Status.OK
    assert dev.violations == []


def test_fallback_uses_the_flat_flag_when_the_device_knows_it():
    k, dev, gos, drv = setup()
    dev.map_fail["MAP"] = A.Status.BAD_ARG            # MAP unknown, FLAT flag known
    c = Client(gos.open("/dev/accel/accel0"))
    c.bo(4096, U.BO_DEVICE)
    c.ctx()
    assert drv.ctx_as is False
    cid2 = c.ctx()
    _, dcid = maps_of(dev, drv, cid2)
    assert dcid in dev.flat and drv._flat_flag == A.CTX_CREATE_FLAT
    n = len(dev.map_log)
    c.bo(4096, U.BO_DEVICE)
    assert dev.map_log[n:] == []                      # no MAP once flat


def test_bad_arg_after_maps_worked_is_einval_not_fallback():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    c.ctx()
    c.bo(4096, U.BO_DEVICE)
    dev.map_fail["MAP"] = A.Status.BAD_ARG
    expect_errno(errno.EINVAL, c.bo, 4096, U.BO_DEVICE, match="CONTEXT_MAP")
    assert drv.ctx_as is True


def test_map_failure_in_bo_create_undoes_everything():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    x, y = c.ctx(), c.ctx()
    free0 = drv.devmem.bytes_free
    _, dy = maps_of(dev, drv, y)
    orig = dev.ctrl_extra

    def fail_second_ctx(typ, cid, flags, res, req):
        if typ == A.CtrlType.CONTEXT_MAP and cid == dy:
            dev.map_fail["MAP"] = A.Status.NO_RESOURCES
        return orig(typ, cid, flags, res, req)
    dev.ctrl_extra = fail_second_ctx
    e = expect_errno(errno.ENOMEM, c.bo, 4096, U.BO_DEVICE, match="mapping table is full")
    assert f"context {y}" in str(e)
    assert maps_of(dev, drv, x)[0] == {} and maps_of(dev, drv, y)[0] == {}
    assert drv.devmem.bytes_free == free0 and list(c.f._bos) == []


def test_map_failure_in_context_create_destroys_the_context():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    c.bo(4096, U.BO_DEVICE)
    c.bo(4096, U.BO_DEVICE)
    dev.max_mappings = 1
    expect_errno(errno.ENOMEM, c.ctx)
    assert dev.contexts == {} and c.f._contexts == {}
    dev.max_mappings = 8
    cid = c.ctx()
    assert len(maps_of(dev, drv, cid)[0]) == 2


@pytest.mark.parametrize("status, err", [(A.Status.OUT_OF_BOUNDS, errno.EINVAL),
                                         (A.Status.BAD_CONTEXT, errno.ECANCELED),
                                         (A.Status.BAD_REQUEST, errno.EIO)])
def test_map_status_to_errno(status, err):
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    c.ctx()
    c.bo(4096, U.BO_DEVICE)
    dev.map_fail["MAP"] = status
    expect_errno(err, c.bo, 4096, U.BO_DEVICE, match=A.Status(status).name
                 if status != A.Status.BAD_CONTEXT else "does not know the context")


def test_failed_unmap_keeps_the_memory_out_of_circulation():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    free0 = drv.devmem.bytes_free
    dev.map_fail["UNMAP"] = A.Status.BAD_REQUEST
    c.free(h)
    assert drv.devmem.bytes_free == free0 and c.f.leaked == [addr]
    assert k.trace.of("devmem_leak") and k.trace.of("ctx_unmap_failed")
    _, again = c.bo(4096, U.BO_DEVICE)
    assert again != addr


def test_after_a_device_reset_free_needs_no_unmap():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    free0 = drv.devmem.bytes_free
    drv.reset("test")
    n = len(dev.map_log)
    c.free(h)
    assert dev.map_log[n:] == [] and drv.devmem.bytes_free == free0 + 4096


def test_close_destroys_contexts_then_frees_without_unmaps():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    c.ctx()
    c.ctx()
    c.bo(4096, U.BO_DEVICE)
    n = len(dev.map_log)
    c.f.close()
    assert dev.map_log[n:] == [] and dev.contexts == {} and dev.maps == {}
    assert drv.devmem.bytes_free == drv.devmem.size


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_ops_keep_each_context_mapped_to_exactly_its_files_buffers(seed):
    rng = random.Random(seed)
    k, dev, gos, drv = setup()
    files = [Client(gos.open("/dev/accel/accel0")) for _ in range(3)]
    for _ in range(120):
        c = rng.choice(files)
        dev_bos = [h for h, bo in c.f._bos.items() if bo.flags == U.BO_DEVICE]
        r = rng.random()
        if r < 0.35:
            c.bo(rng.randint(1, 3 * A.CTX_PAGE), U.BO_DEVICE)
        elif r < 0.55 and dev_bos:
            c.free(rng.choice(dev_bos))
        elif r < 0.75 and len(c.f._contexts) < 4:
            c.ctx()
        elif c.f._contexts:
            c.destroy(rng.choice(list(c.f._contexts)))
    for c in files:
        want = {bo.addr: -(-bo.size // A.CTX_PAGE) * A.CTX_PAGE
                for bo in c.f._bos.values() if bo.flags == U.BO_DEVICE}
        for ctx in c.f._contexts.values():
            table = dev.maps[ctx.device_id]
            assert {va: s for va, (pa, s, _) in table.items()} == want
            assert all(va == pa and f == RW for va, (pa, s, f) in table.items())
            for other in files:
                if other is c:
                    continue
                for bo in other.f._bos.values():
                    if bo.flags == U.BO_DEVICE:
                        assert not dev.reaches(ctx.device_id, bo.addr)
    live = sum(-(-bo.size // A.CTX_PAGE) * A.CTX_PAGE for c in files
               for bo in c.f._bos.values() if bo.flags == U.BO_DEVICE)
    assert drv.devmem.bytes_free == drv.devmem.size - live
    # plus the driver's own FLAT context, made for scrubbing reused memory (nothing mapped)
    kctx = {drv._kctx.device_id} if drv._kctx is not None else set()
    assert kctx and all(dev.maps[i] == {} and i in dev.flat for i in kctx)
    assert set(dev.maps) == {ctx.device_id for c in files
                             for ctx in c.f._contexts.values()} | kctx
    assert dev.fills and all(f[0] in kctx and f[3] == 0 for f in dev.fills)
    assert dev.violations == []


def test_get_param_and_uapi_unchanged():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    p = new("get_param", param=U.PARAM_DEVICE_MEMORY_SIZE)
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_PARAM, p)
    assert p.value == 256 << 20
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_CONTEXT_CREATE,
                 new("context_create", flags=1))   # FLAT is the driver's business only


def test_unlisted_buffer_stays_mapped_while_any_submission_of_the_file_runs():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    cid = c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    other = Client(gos.open("/dev/accel/accel0"))
    ocid = other.ctx()
    dev.hold_submits = True
    seq = c.submit(cid, c.cmdbuf(nop_cmdbuf(1)), 8)          # h not listed in handles
    free0 = drv.devmem.bytes_free
    c.free(h)
    assert addr in maps_of(dev, drv, cid)[0] and drv.devmem.bytes_free == free0
    _, oaddr = other.bo(4096, U.BO_DEVICE)                    # cannot get h's memory yet
    assert oaddr != addr
    dev.release_held()
    assert c.wait(cid, seq).status == A.Status.OK
    assert maps_of(dev, drv, cid)[0] == {} and drv.devmem.bytes_free == free0 - 4096 + 4096
    assert c.f._in_flight == {}
    _, again = other.bo(4096, U.BO_DEVICE)
    assert again == addr and list(maps_of(dev, drv, ocid)[0]) == [oaddr, addr]


def test_faulted_context_is_skipped_by_map_and_tolerated_by_unmap():
    k, dev, gos, drv = setup()
    c = Client(gos.open("/dev/accel/accel0"))
    good, bad = c.ctx(), c.ctx()
    h, addr = c.bo(4096, U.BO_DEVICE)
    from gd_fakes import bad_cmdbuf
    w = c.wait(bad, c.submit(bad, c.cmdbuf(bad_cmdbuf()), 16))
    assert w.status == A.Status.BAD_OPCODE
    n = len(dev.map_log)
    h2, addr2 = c.bo(4096, U.BO_DEVICE)                      # only into the good context
    assert [(e[0], e[2]) for e in dev.map_log[n:]] == [("MAP", addr2)]
    assert addr2 in maps_of(dev, drv, good)[0] and addr2 not in maps_of(dev, drv, bad)[0]
    dev.map_fail["UNMAP"] = A.Status.CONTEXT_FAULTED          # the device refuses: fine
    free0 = drv.devmem.bytes_free
    c.free(h)
    assert drv.devmem.bytes_free == free0 + 4096 and c.f.leaked == []
