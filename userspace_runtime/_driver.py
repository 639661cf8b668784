"""Typed calls over the accel device file's ioctls (guest_driver.uapi).

The only module that builds uAPI structs. Every OSError is re-raised as DriverError
naming the request and its arguments.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from guest_driver import uapi

# errno values a driver may use for "the fence has not signalled yet".
_NOT_READY = frozenset({errno.ETIME, errno.ETIMEDOUT, errno.EBUSY, errno.EAGAIN})

PARAM_CODES: dict[str, int] = {
    name[len("PARAM_"):].lower(): value
    for name, value in vars(uapi).items() if name.startswith("PARAM_") and isinstance(value, int)
}


@dataclass(frozen=True)
class WaitResult:
    status: int
    error_offset: int
    start_ns: int
    end_ns: int


def _wrap(exc: OSError, what: str) -> Exception:
    from ._errors import DriverError
    code = exc.errno
    reason = exc.strerror or str(exc) or type(exc).__name__
    if code is None:
        return DriverError(f"{what} failed: {reason}")
    return DriverError(code, f"{what} failed: {reason}")


class DriverFile:
    """One open /dev/accel/accelN with a typed method per ioctl."""

    def __init__(self, file: uapi.DeviceFile, path: str) -> None:
        self.file = file
        self.path = path

    def _ioctl(self, request: int, arg: uapi.CData, what: str) -> None:
        try:
            self.file.ioctl(request, arg)
        except OSError as e:
            raise _wrap(e, f"{what} on {self.path}") from e

    def get_param(self, name: str) -> int:
        arg = uapi.new("struct drm_va1_get_param *")
        arg.param = PARAM_CODES[name]
        self._ioctl(uapi.DRM_IOCTL_VA1_GET_PARAM, arg, f"GET_PARAM({name})")
        return int(arg.value)

    def bo_create(self, size: int, flags: int) -> tuple[int, int]:
        """Returns (handle, addr): a device address for BO_DEVICE, an IOVA for BO_HOST."""
        arg = uapi.new("struct drm_va1_bo_create *")
        arg.size = size
        arg.flags = flags
        kind = "DEVICE" if flags == uapi.BO_DEVICE else "HOST"
        self._ioctl(uapi.DRM_IOCTL_VA1_BO_CREATE, arg, f"BO_CREATE(size={size}, {kind})")
        return int(arg.handle), int(arg.addr)

    def bo_free(self, handle: int) -> None:
        arg = uapi.new("struct drm_va1_bo_free *")
        arg.handle = handle
        self._ioctl(uapi.DRM_IOCTL_VA1_BO_FREE, arg, f"BO_FREE(handle={handle})")

    def mmap(self, handle: int, size: int) -> np.ndarray:
        try:
            view = self.file.mmap(handle)
        except OSError as e:
            raise _wrap(e, f"mmap(handle={handle}) on {self.path}") from e
        if view.dtype != np.uint8 or view.ndim != 1 or view.size < size:
            raise RuntimeError(f"mmap(handle={handle}) returned {view.dtype}{view.shape}, "
                               f"expected a uint8 view of at least {size} bytes")
        return view[:size]

    def context_create(self) -> int:
        arg = uapi.new("struct drm_va1_context_create *")
        self._ioctl(uapi.DRM_IOCTL_VA1_CONTEXT_CREATE, arg, "CONTEXT_CREATE")
        return int(arg.context_id)

    def context_destroy(self, context_id: int) -> None:
        arg = uapi.new("struct drm_va1_context_destroy *")
        arg.context_id = context_id
        self._ioctl(uapi.DRM_IOCTL_VA1_CONTEXT_DESTROY, arg, f"CONTEXT_DESTROY({context_id})")

    def submit(self, context_id: int, queue: int, cmdbuf_handle: int, cmdbuf_offset: int,
               cmdbuf_size: int, handles: Iterable[int], ncommands: int) -> int:
        """Queues a command buffer; returns its fence sequence number."""
        hs = list(handles)
        if len(hs) > uapi.MAX_SUBMIT_BUFFERS:  # pragma: no cover - the stream splits first
            raise ValueError(f"{len(hs)} buffers in one submission, "
                             f"max {uapi.MAX_SUBMIT_BUFFERS}")
        arg = uapi.new("struct drm_va1_submit *")
        arg.context_id = context_id
        arg.queue = queue
        arg.cmdbuf_handle = cmdbuf_handle
        arg.cmdbuf_offset = cmdbuf_offset
        arg.cmdbuf_size = cmdbuf_size
        arg.buffer_count = len(hs)
        for i, h in enumerate(hs):
            arg.handles[i] = h
        self._ioctl(uapi.DRM_IOCTL_VA1_SUBMIT, arg,
                    f"SUBMIT(context={context_id}, queue={queue}, {ncommands} commands, "
                    f"{cmdbuf_size} bytes, {len(hs)} buffers)")
        return int(arg.fence_seq)

    def wait(self, context_id: int, fence_seq: int, timeout_ns: int) -> WaitResult | None:
        """The fence's result, or None if it has not signalled within `timeout_ns`."""
        arg = uapi.new("struct drm_va1_wait *")
        arg.context_id = context_id
        arg.fence_seq = fence_seq
        arg.timeout_ns = timeout_ns
        try:
            self.file.ioctl(uapi.DRM_IOCTL_VA1_WAIT, arg)
        except OSError as e:
            if e.errno in _NOT_READY:
                return None
            raise _wrap(e, f"WAIT(context={context_id}, fence={fence_seq}) on {self.path}") \
                from e
        return WaitResult(int(arg.status), int(arg.error_offset), int(arg.start_ns),
                          int(arg.end_ns))

    def stats(self) -> dict[str, int]:
        arg = uapi.new("struct drm_va1_stats *")
        self._ioctl(uapi.DRM_IOCTL_VA1_GET_STATS, arg, "GET_STATS")
        return {name: int(getattr(arg, name))
                for name, _ in uapi.ffi.typeof("struct drm_va1_stats").fields}

    def close(self) -> None:
        self.file.close()
