"""The CUDA/HIP-like runtime API over the VA-1 accel device file.

    dev = Device(os)                       # /dev/accel/accel0, dev.params
    ctx = dev.create_context()
    a = ctx.alloc((64, 512), np.float32)   # device Buffer
    s = ctx.create_stream()
    s.upload(a, x); s.gemm(a, w, c, bias=b, activation="relu")
    y = s.download(c); s.synchronize(); y.result()

Public names only; the implementation lives in the private modules beside this one.
"""
from __future__ import annotations

from ._device import Buffer, Context, Device, DeviceParams
from ._errors import ContextMismatchError, DeviceError, DriverError, UseAfterFreeError
from ._stream import Event, Pending, Stream, SubmissionResult

__all__ = [
    "Buffer",
    "Context",
    "ContextMismatchError",
    "Device",
    "DeviceError",
    "DeviceParams",
    "DriverError",
    "Event",
    "Pending",
    "Stream",
    "SubmissionResult",
    "UseAfterFreeError",
]
