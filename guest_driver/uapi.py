"""The VA-1 device file's user API, shaped like a Linux accel (DRM) driver's uapi header.

User space reaches the driver only through this module: `open_accel()` gives a
`DeviceFile`; `ioctl(request, arg)` takes a cffi struct built with `new(...)` (that is,
`ffi.new(...)`) from the header below; `mmap(handle)` maps a host buffer. Errors are `OSError` with an errno.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from cffi import FFI

HEADER = """
struct drm_va1_get_param {
    uint32_t param;
    uint32_t index;
    uint64_t value;
};

struct drm_va1_bo_create {
    uint64_t size;
    uint32_t flags;      /* VA1_BO_DEVICE or VA1_BO_HOST */
    uint32_t handle;     /* out */
    uint64_t addr;       /* out: device address (DEVICE) or IOVA (HOST) */
};

struct drm_va1_bo_free {
    uint32_t handle;
    uint32_t pad;
};

struct drm_va1_context_create {
    uint32_t flags;
    uint32_t context_id; /* out */
};

struct drm_va1_context_destroy {
    uint32_t context_id;
    uint32_t pad;
};

struct drm_va1_submit {
    uint32_t context_id;
    uint32_t queue;          /* submit queue index, 0 .. NUM_SUBMIT_QUEUES-1 */
    uint32_t cmdbuf_handle;  /* a HOST buffer holding the command buffer */
    uint32_t cmdbuf_offset;
    uint32_t cmdbuf_size;
    uint32_t buffer_count;   /* handles[] the commands use; kept alive until the fence */
                             /* every host IOVA a command names must lie in one HOST
                                buffer of this file, else EFAULT (docs/driver.md) */
    uint32_t handles[64];
    uint64_t fence_seq;      /* out */
};

struct drm_va1_wait {
    uint32_t context_id;
    uint32_t pad;
    uint64_t fence_seq;
    int64_t timeout_ns;      /* virtual; < 0 waits forever */
    uint32_t status;         /* out: VA-1 status code of the submission */
    uint32_t error_offset;   /* out */
    uint64_t start_ns;       /* out: device time the submission started */
    uint64_t end_ns;         /* out */
};

struct drm_va1_stats {
    uint64_t submissions;
    uint64_t commands;
    uint64_t device_time_ns;
    uint64_t dma_bytes;
    uint64_t faults;
    uint64_t interrupts;
    uint64_t lost_interrupts;    /* driver: polls that found completions an interrupt lost */
    uint64_t polled_completions; /* driver: completions those polls reaped */
    uint64_t watchdog_fires;     /* driver: submit queues without progress in the bound */
    uint64_t resets;             /* driver: resets of the function (any cause) */
};
"""

ffi = FFI()
ffi.cdef(HEADER)

# A cffi cdata. Its fields are those of the C struct, known only at run time: the cffi
# stubs type cdata as an opaque object, so struct cdata is Any here.
CData = Any


_CTYPES: dict[str, Any] = {}


def new(cdecl: str, init: Any = None) -> CData:
    """`ffi.new(cdecl, init)`: a zeroed (or `init`-filled) struct to pass to `ioctl`."""
    ctype = _CTYPES.get(cdecl)
    if ctype is None:
        ctype = _CTYPES[cdecl] = ffi.typeof(cdecl)
    return ffi.new(ctype, init)

MAX_SUBMIT_BUFFERS = 64

# Parameters for GET_PARAM.
PARAM_DEVICE_MEMORY_SIZE = 0
PARAM_NUM_SUBMIT_QUEUES = 1
PARAM_NUM_COMPUTE_UNITS = 2
PARAM_ISA_VERSION = 3
PARAM_DTYPE_MASK = 4
PARAM_MAX_CMDBUF_SIZE = 5
PARAM_PEAK_FLOPS = 6
PARAM_MEM_BANDWIDTH = 7
PARAM_LINK_BANDWIDTH = 8
PARAM_CMD_OVERHEAD_NS = 9
PARAM_MAX_CONTEXTS = 10
PARAM_FEATURES = 11
PARAM_SCRATCHPAD_SIZE = 12
PARAM_MAX_CALL_DEPTH = 13

# BO_CREATE flags.
BO_DEVICE = 1  # device memory; addr is a device address of this function
BO_HOST = 2    # pinned guest memory; addr is the IOVA the device uses; mmap-able

# ioctl numbers as <linux/ioctl.h> encodes them, on the DRM base 'd' like drivers/accel.
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_WRITE, _IOC_READ = 1, 2
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40


def _iowr(nr: int, struct_name: str) -> int:
    size = ffi.sizeof(struct_name)
    return (((_IOC_READ | _IOC_WRITE) << _IOC_DIRSHIFT) | (DRM_IOCTL_BASE << _IOC_TYPESHIFT)
            | ((DRM_COMMAND_BASE + nr) << _IOC_NRSHIFT) | (size << _IOC_SIZESHIFT))


DRM_IOCTL_VA1_GET_PARAM = _iowr(0x00, "struct drm_va1_get_param")
DRM_IOCTL_VA1_BO_CREATE = _iowr(0x01, "struct drm_va1_bo_create")
DRM_IOCTL_VA1_BO_FREE = _iowr(0x02, "struct drm_va1_bo_free")
DRM_IOCTL_VA1_CONTEXT_CREATE = _iowr(0x03, "struct drm_va1_context_create")
DRM_IOCTL_VA1_CONTEXT_DESTROY = _iowr(0x04, "struct drm_va1_context_destroy")
DRM_IOCTL_VA1_SUBMIT = _iowr(0x05, "struct drm_va1_submit")
DRM_IOCTL_VA1_WAIT = _iowr(0x06, "struct drm_va1_wait")
DRM_IOCTL_VA1_GET_STATS = _iowr(0x07, "struct drm_va1_stats")

IOCTL_STRUCT = {
    DRM_IOCTL_VA1_GET_PARAM: "struct drm_va1_get_param",
    DRM_IOCTL_VA1_BO_CREATE: "struct drm_va1_bo_create",
    DRM_IOCTL_VA1_BO_FREE: "struct drm_va1_bo_free",
    DRM_IOCTL_VA1_CONTEXT_CREATE: "struct drm_va1_context_create",
    DRM_IOCTL_VA1_CONTEXT_DESTROY: "struct drm_va1_context_destroy",
    DRM_IOCTL_VA1_SUBMIT: "struct drm_va1_submit",
    DRM_IOCTL_VA1_WAIT: "struct drm_va1_wait",
    DRM_IOCTL_VA1_GET_STATS: "struct drm_va1_stats",
}


class DeviceFile(Protocol):
    """An open /dev/accel/accelN."""

    def ioctl(self, request: int, arg: CData) -> None:
        """Raises OSError(errno) on bad arguments; the struct's out fields are filled."""
        ...

    def mmap(self, handle: int) -> np.ndarray:
        """Zero-copy writable uint8 view of a HOST buffer."""
        ...

    def close(self) -> None: ...


class GuestOS(Protocol):
    """What a guest user program is handed: the device files of its guest."""

    def open(self, path: str) -> DeviceFile: ...
