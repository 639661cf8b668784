"""userspace_runtime.DriverFile, the runtime's public ioctl client, on the fake device
file: one ioctl per call with the arguments given, errors as DriverError (an OSError
keeping the driver's errno)."""
from __future__ import annotations

import errno
from typing import Any

import numpy as np
import pytest

from guest_driver import uapi
from userspace_runtime import CommandBufferBuilder, DriverError, DriverFile, WaitResult


def test_open_submit_wait_stats_close(fake_os: Any) -> None:
    drv = DriverFile.open(fake_os)
    f = fake_os.file
    assert drv.path == "/dev/accel/accel0"
    assert drv.get_param("num_submit_queues") == 2
    h, iova = drv.bo_create(4096, uapi.BO_HOST)
    d, _addr = drv.bo_create(4096, uapi.BO_DEVICE)
    view = drv.mmap(h)                      # the whole buffer without a size
    assert view.dtype == np.uint8 and view.size == 4096 and drv.mmap(h, 64).size == 64
    cb = CommandBufferBuilder()
    cb.nop()
    cb.nop()
    raw = cb.bytes()
    view[128:128 + len(raw)] = np.frombuffer(raw, np.uint8)
    ctx = drv.context_create()
    fence = drv.submit(ctx, 1, h, 128, len(raw), (d,))
    sub = f.submissions[-1]
    assert (sub.context_id, sub.queue, sub.handles, len(sub.commands)) == (ctx, 1, [d], 2)
    r = drv.wait(ctx, fence)                # waits forever by default
    assert isinstance(r, WaitResult) and r.status == 0 and r.end_ns > r.start_ns
    assert drv.stats()["submissions"] == 1
    drv.context_destroy(ctx)
    drv.close()
    assert f.log == ["GET_PARAM", "BO_CREATE", "BO_CREATE", "CONTEXT_CREATE", "SUBMIT",
                     "WAIT", "GET_STATS", "CONTEXT_DESTROY"] and f.closed


def test_wait_not_signalled_is_none(fake_os: Any) -> None:
    drv = DriverFile.open(fake_os)
    fake_os.file.hold = True
    h, _ = drv.bo_create(64, uapi.BO_HOST)
    drv.mmap(h)[:8] = np.frombuffer(_nop(), np.uint8)
    ctx = drv.context_create()
    fence = drv.submit(ctx, 0, h, 0, 8)
    assert drv.wait(ctx, fence, 0) is None
    assert drv.wait_fields(ctx, fence, 0) is None
    r = drv.wait(ctx, fence, -1)
    assert r is not None
    # wait_fields is wait's answer as a plain tuple, in WaitResult's field order.
    t = drv.wait_fields(ctx, fence, -1)
    assert t == (r.status, r.error_offset, r.start_ns, r.end_ns)
    assert t is not None and [type(v) for v in t] == [int] * 4   # ints, as cffi reads them
    assert type(fence) is int


def _nop() -> bytes:
    cb = CommandBufferBuilder()
    cb.nop()
    return cb.bytes()


def test_errors_are_oserrors_with_the_drivers_errno_and_name_the_call(fake_os: Any) -> None:
    with pytest.raises(DriverError) as ei:
        DriverFile.open(fake_os, "/dev/accel/accel9")
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOENT
    drv = DriverFile.open(fake_os)
    h, _ = drv.bo_create(64, uapi.BO_HOST)
    with pytest.raises(OSError) as e2:
        drv.submit(99, 0, h, 0, 8)
    assert e2.value.errno == errno.ENOENT and "SUBMIT(context=99, queue=0, 8 bytes" in str(e2.value)
    ctx = drv.context_create()
    with pytest.raises(DriverError) as e3:
        drv.wait(ctx, 7)
    assert e3.value.errno == errno.EINVAL and "WAIT(context=" in str(e3.value)
