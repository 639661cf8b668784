"""Every ioctl's bad-argument cases: the errno, a message naming the problem, no change."""
import errno

import numpy as np
import pytest

from gd_helpers import booted, expect_errno, new, nop_cmdbuf
from guest_driver import uapi as U
from hwspec import va1 as A


@pytest.fixture
def env():
    return booted()


def test_unknown_ioctl_and_wrong_struct_are_enotty(env):
    k, dev, gos, c = env
    expect_errno(errno.ENOTTY, c.f.ioctl, 0xDEAD, new("get_param"), match="unknown ioctl")
    expect_errno(errno.ENOTTY, c.f.ioctl, U.DRM_IOCTL_VA1_GET_PARAM, new("bo_free"),
                 match="struct drm_va1_get_param")
    expect_errno(errno.ENOTTY, c.f.ioctl, U.DRM_IOCTL_VA1_GET_PARAM, {"param": 0})
    expect_errno(errno.ENOTTY, c.f.ioctl, U.DRM_IOCTL_VA1_WAIT,
                 U.ffi.new("struct drm_va1_wait[1]"))


def test_get_param_values_and_errors(env):
    k, dev, gos, c = env
    p = new("get_param", param=U.PARAM_DEVICE_MEMORY_SIZE)
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_PARAM, p)
    assert p.value == dev.cfg["device_memory_size"]
    p = new("get_param", param=U.PARAM_NUM_SUBMIT_QUEUES)
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_PARAM, p)
    assert p.value == 2
    p = new("get_param", param=U.PARAM_FEATURES)
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_PARAM, p)
    assert p.value == dev.features
    bad = new("get_param", param=99, value=7)
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_GET_PARAM, bad, match="param 99")
    assert bad.value == 7
    bad = new("get_param", param=0, index=1, value=7)
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_GET_PARAM, bad, match="index")
    assert bad.value == 7


def test_bo_create_errors(env):
    k, dev, gos, c = env
    before = c.f.dev.alloc.bytes_free
    for fields, err, msg in [
        (dict(size=4096, flags=0), errno.EINVAL, "flags"),
        (dict(size=4096, flags=3), errno.EINVAL, "flags"),
        (dict(size=0, flags=U.BO_HOST), errno.EINVAL, "size"),
        (dict(size=1 << 40, flags=U.BO_HOST), errno.ENOMEM, "bytes"),
        (dict(size=(256 << 20) + 1, flags=U.BO_DEVICE), errno.ENOMEM, "device memory"),
    ]:
        b = new("bo_create", **fields)
        expect_errno(err, c.f.ioctl, U.DRM_IOCTL_VA1_BO_CREATE, b, match=msg)
        assert b.handle == 0 and b.addr == 0
    assert c.f.dev.alloc.bytes_free == before
    h, addr = c.bo(100, U.BO_DEVICE)
    assert h == 1 and 0 <= addr < dev.cfg["device_memory_size"]
    h2, addr2 = c.bo(100, U.BO_HOST)
    assert h2 == 2 and addr2 % 4096 == 0
    assert k.ram.base <= addr2 < k.ram.base + k.ram.size


def test_mmap_is_zero_copy_and_checked(env):
    k, dev, gos, c = env
    h, addr = c.bo(64)
    v = c.f.mmap(h)
    assert v.dtype == np.uint8 and v.shape == (64,)
    v[:4] = [1, 2, 3, 4]
    assert k.memory.read(addr, 4) == b"\x01\x02\x03\x04"
    d, _ = c.bo(64, U.BO_DEVICE)
    expect_errno(errno.EINVAL, c.f.mmap, d, match="device memory")
    expect_errno(errno.ENOENT, c.f.mmap, 99, match="handle 99")


def test_bo_free_errors(env):
    k, dev, gos, c = env
    h, _ = c.bo(64)
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_BO_FREE,
                 new("bo_free", handle=h, pad=1), match="pad")
    c.f.mmap(h)  # still there
    expect_errno(errno.ENOENT, c.free, 77, match="handle 77")
    c.free(h)
    expect_errno(errno.ENOENT, c.free, h)


def test_context_errors(env):
    k, dev, gos, c = env
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_CONTEXT_CREATE,
                 new("context_create", flags=1), match="flags")
    assert dev.contexts == {}
    cid = c.ctx()
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_CONTEXT_DESTROY,
                 new("context_destroy", context_id=cid, pad=2), match="pad")
    expect_errno(errno.ENOENT, c.destroy, cid + 10, match=f"context {cid + 10}")
    assert len(dev.contexts) == 1
    c.destroy(cid)
    assert dev.contexts == {}
    expect_errno(errno.ENOENT, c.destroy, cid)


def test_context_limit_is_enospc():
    k, dev, gos, c = booted(config={"max_contexts": 2})
    c.ctx()
    c.ctx()
    expect_errno(errno.ENOSPC, c.ctx, match="max_contexts 2")


def test_contexts_and_buffers_are_per_file(env):
    k, dev, gos, c = env
    other = type(c)(gos.open("/dev/accel/accel0"))
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    expect_errno(errno.ENOENT, other.destroy, cid)
    expect_errno(errno.ENOENT, other.f.mmap, h)
    ocid = other.ctx()
    expect_errno(errno.ENOENT, other.submit, ocid, h, 8)


@pytest.mark.parametrize("kw, err, msg", [
    (dict(cid=999), errno.ENOENT, "context 999"),
    (dict(queue=2), errno.EINVAL, "queue 2"),
    (dict(h=999), errno.ENOENT, "handle 999"),
    (dict(h="dev"), errno.EINVAL, "not a HOST buffer"),
    (dict(size=0), errno.EINVAL, "multiple of 8"),
    (dict(size=12), errno.EINVAL, "multiple of 8"),
    (dict(offset=(16 << 10) - 8, size=16), errno.EINVAL, "outside buffer"),
    (dict(offset=1 << 31, size=8), errno.EINVAL, "outside buffer"),
    (dict(size=8 << 10), errno.EINVAL, "max_cmdbuf_size"),
    (dict(handles=[5000]), errno.ENOENT, "handle 5000"),
])
def test_submit_errors(kw, err, msg):
    k, dev, gos, c = booted(config={"max_cmdbuf_size": 4096})
    cid = c.ctx()
    h, _ = c.bo(16 << 10)
    c.f.mmap(h)[:8] = list(nop_cmdbuf(1))
    dh, _ = c.bo(64, U.BO_DEVICE)
    args = dict(cid=cid, h=h, size=8, queue=0, offset=0, handles=[dh])
    args.update(kw)
    if args["h"] == "dev":
        args["h"] = dh
    s = new("submit", context_id=args["cid"], queue=args["queue"], cmdbuf_handle=args["h"],
            cmdbuf_offset=args["offset"], cmdbuf_size=args["size"],
            buffer_count=len(args["handles"]))
    for i, x in enumerate(args["handles"]):
        s.handles[i] = x
    expect_errno(err, c.f.ioctl, U.DRM_IOCTL_VA1_SUBMIT, s, match=msg)
    assert s.fence_seq == 0
    k.sched.run_all()
    assert dev.stats["submissions"] == 0
    assert c.f._bos[h].busy == 0 and c.f._bos[dh].busy == 0
    # and the next good submission still gets fence 1
    assert c.submit(cid, h, 8, handles=[dh]) == 1


def test_submit_buffer_count_over_64():
    k, dev, gos, c = booted()
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(1))
    s = new("submit", context_id=cid, cmdbuf_handle=h, cmdbuf_size=8, buffer_count=65)
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_SUBMIT, s, match="buffer_count 65")


def test_wait_errors_and_poll(env):
    k, dev, gos, c = env
    cid = c.ctx()
    h = c.cmdbuf(nop_cmdbuf(2))
    expect_errno(errno.EINVAL, c.wait, cid, 1, match="never issued")
    seq = c.submit(cid, h, 16)
    expect_errno(errno.ENOENT, c.wait, cid + 5, seq, match="context")
    expect_errno(errno.EINVAL, c.wait, cid, 0, match="fence 0")
    expect_errno(errno.EINVAL, c.wait, cid, seq + 1, match="never issued")
    expect_errno(errno.EINVAL, c.f.ioctl, U.DRM_IOCTL_VA1_WAIT,
                 new("wait", context_id=cid, fence_seq=seq, pad=1), match="pad")
    w = new("wait", context_id=cid, fence_seq=seq, timeout_ns=0, status=77)
    expect_errno(errno.ETIME, c.f.ioctl, U.DRM_IOCTL_VA1_WAIT, w)  # poll: not done yet
    assert w.status == 77
    expect_errno(errno.ETIME, c.wait, cid, seq, 50)                 # too short
    w = c.wait(cid, seq, 10**9)
    assert w.status == A.Status.OK and w.error_offset == A.NO_OFFSET
    assert w.end_ns > w.start_ns > 0
    assert c.wait(cid, seq, 0).status == A.Status.OK               # poll once done


def test_get_stats_and_closed_file(env):
    k, dev, gos, c = env
    s = new("stats")
    c.f.ioctl(U.DRM_IOCTL_VA1_GET_STATS, s)
    assert s.submissions == 0
    cid = c.ctx()
    c.f.close()
    assert dev.contexts == {}  # close destroyed the file's contexts
    expect_errno(errno.EBADF, c.f.ioctl, U.DRM_IOCTL_VA1_GET_STATS, new("stats"))
    expect_errno(errno.EBADF, c.f.mmap, 1)
    c.f.close()  # idempotent


def test_open_unknown_path():
    k, dev, gos, c = booted()
    expect_errno(errno.ENOENT, gos.open, "/dev/accel/accel1", match="accel0")
