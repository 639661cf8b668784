"""An open /dev/accel/accelN: the uAPI of guest_driver.uapi on top of a VA1Device.

Buffers and contexts belong to the open file that made them (another file's handles
are ENOENT, as with DRM GEM handles). Every ioctl validates all of its arguments before
it changes anything; errors are OSError(errno, message naming the bad argument).
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import uapi as U
from ..mm import AllocError, PAGE_SIZE, align_up
from .driver import Context, VA1Device, VA1Error
from .fence import Fence

U32_MAX = 0xFFFFFFFF


@dataclass
class BufferObject:
    handle: int
    flags: int
    size: int
    addr: int          # device address (DEVICE) or IOVA = guest physical address (HOST)
    busy: int = 0      # submissions in flight that use it
    free_pending: bool = False
    released: bool = False


def _err(err: int, msg: str) -> VA1Error:
    return VA1Error(err, msg)


class VA1File:
    """DeviceFile implementation."""

    def __init__(self, dev: VA1Device, path: str) -> None:
        self.dev = dev
        self.path = path
        self.closed = False
        self._bos: dict[int, BufferObject] = {}
        self._next_handle = 1
        self._contexts: dict[int, Context] = {}
        self._ops: dict[int, Callable[[Any], None]] = {
            U.DRM_IOCTL_VA1_GET_PARAM: self._get_param,
            U.DRM_IOCTL_VA1_BO_CREATE: self._bo_create,
            U.DRM_IOCTL_VA1_BO_FREE: self._bo_free,
            U.DRM_IOCTL_VA1_CONTEXT_CREATE: self._context_create,
            U.DRM_IOCTL_VA1_CONTEXT_DESTROY: self._context_destroy,
            U.DRM_IOCTL_VA1_SUBMIT: self._submit,
            U.DRM_IOCTL_VA1_WAIT: self._wait,
            U.DRM_IOCTL_VA1_GET_STATS: self._get_stats,
        }

    # ------------------------------------------------------------------ entry points
    def ioctl(self, request: int, arg: Any) -> None:
        if self.closed:
            raise _err(errno.EBADF, f"{self.path}: file is closed")
        op = self._ops.get(request) if isinstance(request, int) else None
        if op is None:
            raise _err(errno.ENOTTY, f"{self.path}: unknown ioctl request {request!r}")
        want = U.IOCTL_STRUCT[request]
        if not isinstance(arg, U.ffi.CData) or U.ffi.typeof(arg) is not U.ffi.typeof(want + " *"):
            got = U.ffi.typeof(arg).cname if isinstance(arg, U.ffi.CData) else type(arg).__name__
            raise _err(errno.ENOTTY, f"{self.path}: ioctl {request:#x} takes a '{want} *', "
                                     f"got {got}")
        op(arg)

    def mmap(self, handle: int) -> np.ndarray:
        if self.closed:
            raise _err(errno.EBADF, f"{self.path}: file is closed")
        bo = self._bo(handle)
        if bo.flags != U.BO_HOST:
            raise _err(errno.EINVAL, f"buffer {handle} is device memory; only HOST buffers "
                                     "can be mapped")
        return self.dev.kernel.memory.view(bo.addr, bo.size)

    def close(self) -> None:
        """Destroy this file's contexts and free its buffers (busy ones when idle)."""
        if self.closed:
            return
        for ctx in list(self._contexts.values()):
            try:
                self.dev.destroy_context(ctx)
            except OSError:
                pass  # the device reset or died: the context is gone either way
        self._contexts.clear()
        for bo in list(self._bos.values()):
            self._free_bo(bo)
        self._bos.clear()
        self.closed = True

    # ------------------------------------------------------------------ lookups
    def _bo(self, handle: int) -> BufferObject:
        bo = self._bos.get(handle)
        if bo is None:
            raise _err(errno.ENOENT, f"no buffer with handle {handle}")
        return bo

    def _ctx(self, context_id: int) -> Context:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise _err(errno.ENOENT, f"no context {context_id} in this file")
        return ctx

    # ------------------------------------------------------------------ ioctls
    def _get_param(self, a: Any) -> None:
        cfg = self.dev.config
        params = {
            U.PARAM_DEVICE_MEMORY_SIZE: cfg["device_memory_size"],
            U.PARAM_NUM_SUBMIT_QUEUES: self.dev.num_submit_queues,
            U.PARAM_NUM_COMPUTE_UNITS: cfg["num_compute_units"],
            U.PARAM_ISA_VERSION: cfg["isa_version"],
            U.PARAM_DTYPE_MASK: cfg["dtype_mask"],
            U.PARAM_MAX_CMDBUF_SIZE: cfg["max_cmdbuf_size"],
            U.PARAM_PEAK_FLOPS: cfg["peak_flops"],
            U.PARAM_MEM_BANDWIDTH: cfg["mem_bandwidth"],
            U.PARAM_LINK_BANDWIDTH: cfg["link_bandwidth"],
            U.PARAM_CMD_OVERHEAD_NS: cfg["cmd_overhead_ns"],
            U.PARAM_MAX_CONTEXTS: cfg["max_contexts"],
            U.PARAM_FEATURES: self.dev.features,
            U.PARAM_SCRATCHPAD_SIZE: cfg["scratchpad_size"],
            U.PARAM_MAX_CALL_DEPTH: cfg["max_call_depth"],
        }
        if a.param not in params:
            raise _err(errno.EINVAL, f"GET_PARAM: unknown param {a.param}")
        if a.index != 0:
            raise _err(errno.EINVAL, f"GET_PARAM: index must be 0, got {a.index}")
        a.value = params[a.param]

    def _bo_create(self, a: Any) -> None:
        size, flags = int(a.size), int(a.flags)
        if flags not in (U.BO_DEVICE, U.BO_HOST):
            raise _err(errno.EINVAL, f"BO_CREATE: flags must be BO_DEVICE ({U.BO_DEVICE}) or "
                                     f"BO_HOST ({U.BO_HOST}), got {flags}")
        if size == 0:
            raise _err(errno.EINVAL, "BO_CREATE: size must be > 0")
        if self._next_handle > U32_MAX:
            raise _err(errno.ENOSPC, "BO_CREATE: handle space exhausted")
        self.dev.check_alive()
        try:
            if flags == U.BO_DEVICE:
                assert self.dev.devmem is not None
                addr = self.dev.devmem.alloc(size)
            else:
                addr = self.dev.alloc.alloc(align_up(size, PAGE_SIZE), PAGE_SIZE)
                self.dev.kernel.memory.write(addr, bytes(size))  # no stale data to user space
        except AllocError as e:
            raise _err(errno.ENOMEM, f"BO_CREATE: {size} bytes: {e}") from None
        handle = self._next_handle
        self._next_handle += 1
        self._bos[handle] = BufferObject(handle, flags, size, addr)
        a.handle = handle
        a.addr = addr

    def _bo_free(self, a: Any) -> None:
        if a.pad != 0:
            raise _err(errno.EINVAL, f"BO_FREE: pad must be 0, got {a.pad}")
        bo = self._bo(int(a.handle))
        del self._bos[bo.handle]
        self._free_bo(bo)

    def _free_bo(self, bo: BufferObject) -> None:
        bo.free_pending = True
        if bo.busy == 0:
            self._release(bo)

    def _release(self, bo: BufferObject) -> None:
        if bo.released:
            return
        bo.released = True
        if bo.flags == U.BO_DEVICE:
            assert self.dev.devmem is not None
            self.dev.devmem.free(bo.addr)
        else:
            self.dev.alloc.free(bo.addr)

    def _context_create(self, a: Any) -> None:
        if a.flags != 0:
            raise _err(errno.EINVAL, f"CONTEXT_CREATE: flags must be 0, got {a.flags:#x}")
        ctx = self.dev.create_context()
        self._contexts[ctx.uid] = ctx
        a.context_id = ctx.uid

    def _context_destroy(self, a: Any) -> None:
        if a.pad != 0:
            raise _err(errno.EINVAL, f"CONTEXT_DESTROY: pad must be 0, got {a.pad}")
        ctx = self._ctx(int(a.context_id))
        self.dev.destroy_context(ctx)
        del self._contexts[ctx.uid]

    def _submit(self, a: Any) -> None:
        ctx = self._ctx(int(a.context_id))
        nq = self.dev.num_submit_queues
        if a.queue >= nq:
            raise _err(errno.EINVAL, f"SUBMIT: queue {a.queue} out of range 0..{nq - 1}")
        cmd = self._bo(int(a.cmdbuf_handle))
        if cmd.flags != U.BO_HOST:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf_handle {cmd.handle} is not a HOST buffer")
        off, size = int(a.cmdbuf_offset), int(a.cmdbuf_size)
        if size == 0 or size % 8:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf_size {size} must be > 0 and a multiple "
                                     "of 8")
        if off + size > cmd.size:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf range [{off}, {off + size}) is outside "
                                     f"buffer {cmd.handle} of {cmd.size} bytes")
        max_size = self.dev.config["max_cmdbuf_size"]
        if size > max_size:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf_size {size} exceeds max_cmdbuf_size "
                                     f"{max_size}")
        count = int(a.buffer_count)
        if count > U.MAX_SUBMIT_BUFFERS:
            raise _err(errno.EINVAL, f"SUBMIT: buffer_count {count} exceeds "
                                     f"{U.MAX_SUBMIT_BUFFERS}")
        bos = [cmd] + [self._bo(int(a.handles[i])) for i in range(count)]
        self.dev.check_alive()
        self.dev.check_ctx(ctx)
        for bo in bos:
            bo.busy += 1

        def done(_fence: Fence) -> None:
            for b in bos:
                b.busy -= 1
                if b.busy == 0 and b.free_pending:
                    self._release(b)
        try:
            fence = self.dev.submit(ctx, int(a.queue), cmd.addr + off, size, on_done=done)
        except BaseException:
            for bo in bos:
                bo.busy -= 1
                if bo.busy == 0 and bo.free_pending:
                    self._release(bo)
            raise
        a.fence_seq = fence.seq

    def _wait(self, a: Any) -> None:
        if a.pad != 0:
            raise _err(errno.EINVAL, f"WAIT: pad must be 0, got {a.pad}")
        ctx = self._ctx(int(a.context_id))
        seq = int(a.fence_seq)
        fence = ctx.timeline.get(seq)
        if fence is None:
            raise _err(errno.EINVAL, f"WAIT: fence {seq} was never issued on context "
                                     f"{ctx.uid} (last {ctx.timeline.last_seq})")
        timeout = int(a.timeout_ns)
        if not self.dev.wait_fence(fence, None if timeout < 0 else timeout):
            raise _err(errno.ETIME, f"WAIT: fence {seq} of context {ctx.uid} not signalled "
                                    f"within {timeout} ns")
        a.status = fence.status
        a.error_offset = fence.error_offset
        a.start_ns = fence.start_ns
        a.end_ns = fence.end_ns

    def _get_stats(self, a: Any) -> None:
        stats = self.dev.get_stats()
        for name in ("submissions", "commands", "device_time_ns", "dma_bytes", "faults",
                     "interrupts"):
            setattr(a, name, stats[name])
