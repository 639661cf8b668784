"""Small uAPI helpers over a DeviceFile for the tests."""
from __future__ import annotations

import errno
from collections import Counter

import pytest

from gd_fakes import make_machine, nop_cmdbuf
from guest_driver import uapi as U
from guest_driver.boot import boot


def new(name, **fields):
    return U.ffi.new(f"struct drm_va1_{name} *", fields)


class Client:
    def __init__(self, f):
        self.f = f

    def ctx(self) -> int:
        c = new("context_create")
        self.f.ioctl(U.DRM_IOCTL_VA1_CONTEXT_CREATE, c)
        return c.context_id

    def destroy(self, cid: int) -> None:
        self.f.ioctl(U.DRM_IOCTL_VA1_CONTEXT_DESTROY, new("context_destroy", context_id=cid))

    def bo(self, size: int, flags: int = U.BO_HOST):
        b = new("bo_create", size=size, flags=flags)
        self.f.ioctl(U.DRM_IOCTL_VA1_BO_CREATE, b)
        return b.handle, b.addr

    def free(self, h: int) -> None:
        self.f.ioctl(U.DRM_IOCTL_VA1_BO_FREE, new("bo_free", handle=h))

    def cmdbuf(self, data: bytes) -> int:
        h, _ = self.bo(max(len(data), 8))
        self.f.mmap(h)[:len(data)] = list(data)
        return h

    def submit(self, cid, h, size, queue=0, offset=0, handles=()):
        s = new("submit", context_id=cid, queue=queue, cmdbuf_handle=h, cmdbuf_offset=offset,
                cmdbuf_size=size, buffer_count=len(handles))
        for i, x in enumerate(handles):
            s.handles[i] = x
        self.f.ioctl(U.DRM_IOCTL_VA1_SUBMIT, s)
        return s.fence_seq

    def wait(self, cid, seq, timeout=-1):
        w = new("wait", context_id=cid, fence_seq=seq, timeout_ns=timeout)
        self.f.ioctl(U.DRM_IOCTL_VA1_WAIT, w)
        return w


def booted(**kw):
    k, devs = make_machine(**kw)
    gos = boot(k)
    return k, devs[0], gos, Client(gos.open("/dev/accel/accel0"))


def signals(k):
    """How many times each (context, fence) was signalled."""
    return Counter((f["context"], f["fence"]) for f in k.trace.of("fence_signal"))


def in_flight(c, dev):
    """Hold the device's submits and queue four fences on two contexts and two queues:
    returns (context a, context b, the cmdbuf handle, [(context, fence_seq)])."""
    dev.hold_submits = True
    a, b = c.ctx(), c.ctx()
    h = c.cmdbuf(nop_cmdbuf(2))
    fences = [(a, c.submit(a, h, 16, queue=0)), (a, c.submit(a, h, 16, queue=1)),
              (b, c.submit(b, h, 16, queue=0)), (a, c.submit(a, h, 16, queue=0))]
    return a, b, h, fences


def expect_errno(err, fn, *a, match=None):
    with pytest.raises(OSError) as ei:
        fn(*a)
    assert ei.value.errno == err, f"{errno.errorcode.get(ei.value.errno)}: {ei.value}"
    if match:
        assert match in str(ei.value), str(ei.value)
    return ei.value


__all__ = ["new", "Client", "booted", "expect_errno", "in_flight", "nop_cmdbuf", "signals"]
