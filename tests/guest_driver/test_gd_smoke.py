from gd_fakes import make_machine, nop_cmdbuf
from guest_driver import uapi as U
from guest_driver.boot import boot
from hwspec import va1 as A


def test_boot_submit_wait_roundtrip():
    k, (dev,) = make_machine()
    gos = boot(k)
    f = gos.open("/dev/accel/accel0")
    c = U.ffi.new("struct drm_va1_context_create *")
    f.ioctl(U.DRM_IOCTL_VA1_CONTEXT_CREATE, c)
    assert c.context_id == 1
    bo = U.ffi.new("struct drm_va1_bo_create *", {"size": 4096, "flags": U.BO_HOST})
    f.ioctl(U.DRM_IOCTL_VA1_BO_CREATE, bo)
    view = f.mmap(bo.handle)
    view[:32] = list(nop_cmdbuf(4))
    s = U.ffi.new("struct drm_va1_submit *", {"context_id": c.context_id, "queue": 0,
                                              "cmdbuf_handle": bo.handle, "cmdbuf_size": 32})
    f.ioctl(U.DRM_IOCTL_VA1_SUBMIT, s)
    assert s.fence_seq == 1
    w = U.ffi.new("struct drm_va1_wait *", {"context_id": c.context_id, "fence_seq": 1,
                                            "timeout_ns": -1})
    f.ioctl(U.DRM_IOCTL_VA1_WAIT, w)
    assert w.status == A.Status.OK
    assert w.end_ns - w.start_ns == 4 * dev.CMD_NS
    assert dev.violations == []
    st = U.ffi.new("struct drm_va1_stats *")
    f.ioctl(U.DRM_IOCTL_VA1_GET_STATS, st)
    assert st.submissions == 1 and st.commands == 4 and st.interrupts >= 1
