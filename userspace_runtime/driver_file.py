"""The runtime's ioctl client: typed calls over the accel device file's uAPI
(guest_driver.uapi), one method per ioctl.

Public: a guest program that wants the raw uAPI (its own command buffers, its own
fences) uses this rather than building the structs itself.

    drv = DriverFile.open(os)                       # /dev/accel/accel0
    n = drv.get_param("num_submit_queues")
    handle, iova = drv.bo_create(1 << 16, uapi.BO_HOST)
    view = drv.mmap(handle)                         # uint8 view of the HOST buffer
    ctx = drv.context_create()
    fence = drv.submit(ctx, 0, handle, 0, size, handles=(dev_handle,))
    r = drv.wait(ctx, fence)                        # WaitResult(status, error_offset, start_ns, end_ns)
    t = drv.wait_fields(ctx, fence)                 # the same fields as a plain tuple
    drv.stats(); drv.context_destroy(ctx); drv.close()

The only module that builds uAPI structs. Every OSError of the driver is re-raised as
DriverError (an OSError keeping the driver's errno) naming the request and its
arguments.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from guest_driver import uapi

from ._errors import DriverError

# errno values a driver may use for "the fence has not signalled yet".
_NOT_READY = frozenset({errno.ETIME, errno.ETIMEDOUT, errno.EBUSY, errno.EAGAIN})

# The two structs of every round trip, looked up once (uapi.new looks them up per call),
# and what SUBMIT and WAIT call, read once.
_SUBMIT_T = uapi.ffi.typeof("struct drm_va1_submit *")
_WAIT_T = uapi.ffi.typeof("struct drm_va1_wait *")
_new = uapi.ffi.new
_SUBMIT = uapi.DRM_IOCTL_VA1_SUBMIT
_WAIT = uapi.DRM_IOCTL_VA1_WAIT
_MAX_BUFFERS = uapi.MAX_SUBMIT_BUFFERS

PARAM_CODES: dict[str, int] = {
    name[len("PARAM_"):].lower(): value
    for name, value in vars(uapi).items() if name.startswith("PARAM_") and isinstance(value, int)
}


@dataclass(frozen=True, init=False)
class WaitResult:
    """A signalled fence: the VA-1 status of its submission, the byte offset of the
    failing command (va1.NO_OFFSET if none) and the device times it ran between."""
    status: int
    error_offset: int
    start_ns: int
    end_ns: int

    def __init__(self, status: int, error_offset: int, start_ns: int, end_ns: int) -> None:
        # One dict update, not the generated frozen __init__'s object.__setattr__ per
        # field: every WAIT makes one.
        self.__dict__.update(status=status, error_offset=error_offset, start_ns=start_ns,
                             end_ns=end_ns)


def _wrap(exc: OSError, what: str) -> Exception:
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

    @classmethod
    def open(cls, os: uapi.GuestOS, path: str = "/dev/accel/accel0") -> "DriverFile":
        """Open the device file `path` in the guest `os` (DriverError if it cannot)."""
        try:
            file = os.open(path)
        except OSError as e:
            raise DriverError(e.errno or 0, f"cannot open {path}: {e.strerror or e}") from e
        return cls(file, path)

    def _ioctl(self, request: int, arg: uapi.CData, what: str) -> None:
        try:
            self.file.ioctl(request, arg)
        except OSError as e:
            raise _wrap(e, f"{what} on {self.path}") from e

    def get_param(self, name: str) -> int:
        """GET_PARAM by name: a key of PARAM_CODES (uapi.PARAM_X is "x")."""
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

    def mmap(self, handle: int, size: int | None = None) -> np.ndarray:
        """A uint8 view of HOST buffer `handle`: its first `size` bytes, or all of it."""
        try:
            view = self.file.mmap(handle)
        except OSError as e:
            raise _wrap(e, f"mmap(handle={handle}) on {self.path}") from e
        want = 0 if size is None else size
        if view.dtype != np.uint8 or view.ndim != 1 or view.size < want:
            raise RuntimeError(f"mmap(handle={handle}) returned {view.dtype}{view.shape}, "
                               f"expected a uint8 view of at least {want} bytes")
        return view if size is None else view[:size]

    def context_create(self) -> int:
        """A new device context of this file; its id."""
        arg = uapi.new("struct drm_va1_context_create *")
        self._ioctl(uapi.DRM_IOCTL_VA1_CONTEXT_CREATE, arg, "CONTEXT_CREATE")
        return int(arg.context_id)

    def context_destroy(self, context_id: int) -> None:
        arg = uapi.new("struct drm_va1_context_destroy *")
        arg.context_id = context_id
        self._ioctl(uapi.DRM_IOCTL_VA1_CONTEXT_DESTROY, arg, f"CONTEXT_DESTROY({context_id})")

    def submit(self, context_id: int, queue: int, cmdbuf_handle: int, cmdbuf_offset: int,
               cmdbuf_size: int, handles: Iterable[int] = (), ncommands: int | None = None
               ) -> int:
        """Queue the command buffer at `cmdbuf_offset`, `cmdbuf_size` bytes into HOST
        buffer `cmdbuf_handle`, on submit queue `queue` of context `context_id`, with
        the buffers `handles` it uses; returns its fence sequence number. `ncommands`
        (how many commands it holds) only goes into an error's message."""
        # No handles (a stream's empty ordered set): no list; the new struct's count is 0.
        hs: tuple[int, ...] | list[int] = ()
        if type(handles) is not dict or handles:
            hs = list(handles)
            if len(hs) > _MAX_BUFFERS:  # pragma: no cover - the stream splits first
                raise ValueError(f"{len(hs)} buffers in one submission, max {_MAX_BUFFERS}")
        arg: uapi.CData = _new(_SUBMIT_T)
        arg.context_id = context_id
        arg.queue = queue
        arg.cmdbuf_handle = cmdbuf_handle
        arg.cmdbuf_offset = cmdbuf_offset
        arg.cmdbuf_size = cmdbuf_size
        if hs:
            arg.buffer_count = len(hs)
            arg.handles[0:len(hs)] = hs
        try:
            self.file.ioctl(_SUBMIT, arg)
        except OSError as e:  # _ioctl, with the message made only when it is needed
            what = (f"SUBMIT(context={context_id}, queue={queue}, "
                    + ("" if ncommands is None else f"{ncommands} commands, ")
                    + f"{cmdbuf_size} bytes, {len(hs)} buffers)")
            raise _wrap(e, f"{what} on {self.path}") from e
        fence: int = arg.fence_seq   # cffi reads an integer field as an int
        return fence

    def wait(self, context_id: int, fence_seq: int, timeout_ns: int = -1
             ) -> WaitResult | None:
        """The fence's result, or None if it has not signalled within `timeout_ns`
        (virtual ns; < 0 waits forever; the driver answered ETIME, ETIMEDOUT, EBUSY or
        EAGAIN). Any other error of the driver is a DriverError."""
        r = self.wait_fields(context_id, fence_seq, timeout_ns)
        return None if r is None else WaitResult(*r)

    def wait_fields(self, context_id: int, fence_seq: int, timeout_ns: int = -1
                    ) -> tuple[int, int, int, int] | None:
        """`wait` without the WaitResult: (status, error_offset, start_ns, end_ns), for
        a caller that waits on every submission and keeps its own record of each."""
        arg: uapi.CData = _new(_WAIT_T)
        arg.context_id = context_id
        arg.fence_seq = fence_seq
        arg.timeout_ns = timeout_ns
        try:
            self.file.ioctl(_WAIT, arg)
        except OSError as e:
            if e.errno in _NOT_READY:
                return None
            raise _wrap(e, f"WAIT(context={context_id}, fence={fence_seq}) on {self.path}") \
                from e
        # cffi reads an integer field as an int: no int() per field.
        return arg.status, arg.error_offset, arg.start_ns, arg.end_ns

    def stats(self) -> dict[str, int]:
        """GET_STATS: the function's counters by field name of struct drm_va1_stats."""
        arg = uapi.new("struct drm_va1_stats *")
        self._ioctl(uapi.DRM_IOCTL_VA1_GET_STATS, arg, "GET_STATS")
        return {name: int(getattr(arg, name))
                for name, _ in uapi.ffi.typeof("struct drm_va1_stats").fields}

    def close(self) -> None:
        self.file.close()
