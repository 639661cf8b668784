"""An open /dev/accel/accelN: the uAPI of guest_driver.uapi on top of a VA1Device.

Buffers and contexts belong to the open file that made them (another file's handles
are ENOENT, as with DRM GEM handles). Every ioctl validates all of its arguments before
it changes anything; errors are OSError(errno, message naming the bad argument).

Address spaces: every context of a file has a private device address space holding
exactly the file's DEVICE buffers, each mapped at va = pa = its device address (READ |
WRITE, whole CTX_PAGEs): on BO_CREATE into every existing context, on CONTEXT_CREATE every
existing buffer. BO_FREE unmaps from every context before the device memory goes back
(after the last submission using it, when it is busy). So a file's contexts reach only
its own buffers. With address spaces, a DEVICE buffer is busy for every submission of
its file in flight when it is freed, listed in `handles` or not: any of them may reach
it through the mapping, and its memory must not go to another file before they end. The unmaps of a deferred free run in task context: the interrupt
handler that drops the last use queues them on the device (`run_deferred`), and every
ioctl runs that queue first and last.

SUBMIT checks every host address of the command buffer against the file's own HOST
buffers and hands the device a checked copy (`cmdcheck`); BO_CREATE zeroes the part of
a new DEVICE buffer that an earlier owner left dirty (`devmem`, `VA1Device.scrub`).
"""
from __future__ import annotations

import bisect
import errno
from dataclasses import dataclass
from typing import Any, Callable

import _cffi_backend
import numpy as np

from hwspec import va1 as A

from .. import uapi as U
from ..mm import AllocError, PAGE_SIZE, align_up
from .cmdcheck import CheckCache
from .driver import Context, VA1Device, VA1Error
from .fence import Fence

U32_MAX = 0xFFFFFFFF
_CData = U.ffi.CData
# what ffi.typeof(cdata) calls once it has told a cdata from a C declaration string
# (ioctl asks it only about cdata, on every call)
_typeof = _cffi_backend.typeof


@dataclass
class BufferObject:
    handle: int
    flags: int
    size: int
    addr: int          # device address (DEVICE) or IOVA = guest physical address (HOST)
    busy: int = 0      # submissions in flight that use it
    free_pending: bool = False
    released: bool = False
    map_size: int = 0  # DEVICE: bytes mapped into contexts (size rounded to CTX_PAGE)


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
        ops: dict[int, Callable[[Any], None]] = {
            U.DRM_IOCTL_VA1_GET_PARAM: self._get_param,
            U.DRM_IOCTL_VA1_BO_CREATE: self._bo_create,
            U.DRM_IOCTL_VA1_BO_FREE: self._bo_free,
            U.DRM_IOCTL_VA1_CONTEXT_CREATE: self._context_create,
            U.DRM_IOCTL_VA1_CONTEXT_DESTROY: self._context_destroy,
            U.DRM_IOCTL_VA1_SUBMIT: self._submit,
            U.DRM_IOCTL_VA1_WAIT: self._wait,
            U.DRM_IOCTL_VA1_GET_STATS: self._get_stats,
        }
        self.leaked: list[int] = []  # device addresses kept because an unmap failed
        self._in_flight: dict[int, Fence] = {}  # id(fence) -> fence of this file, unsignalled
        # each request's handler and the cffi type it takes, looked up once (ioctl is on
        # every submission)
        self._ops: dict[int, tuple[Callable[[Any], None], Any]] = {
            req: (op, U.ffi.typeof(U.IOCTL_STRUCT[req] + " *")) for req, op in ops.items()}
        self._owner: Callable[[int, int], BufferObject | None] | None = None
        self._checks: CheckCache[BufferObject] = CheckCache()

    # ------------------------------------------------------------------ entry points
    def ioctl(self, request: int, arg: Any) -> None:
        if self.closed:
            raise _err(errno.EBADF, f"{self.path}: file is closed")
        entry = self._ops.get(request) if isinstance(request, int) else None
        if entry is None:
            raise _err(errno.ENOTTY, f"{self.path}: unknown ioctl request {request!r}")
        op, arg_type = entry
        if not isinstance(arg, _CData) or _typeof(arg) is not arg_type:
            want = U.IOCTL_STRUCT[request]
            got = _typeof(arg).cname if isinstance(arg, _CData) else type(arg).__name__
            raise _err(errno.ENOTTY, f"{self.path}: ioctl {request:#x} takes a '{want} *', "
                                     f"got {got}")
        dev = self.dev
        if dev.deferred:
            dev.run_deferred()
        try:
            op(arg)
        finally:
            if dev.deferred:
                dev.run_deferred()

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
        self._owner = None
        self.closed = True
        self.dev.run_deferred()

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
        bo = BufferObject(self._next_handle, flags, size, addr)
        if flags == U.BO_DEVICE:
            assert self.dev.devmem is not None
            bo.map_size = self.dev.devmem.mapped_size(addr)
            self._scrub(bo)
            done: list[Context] = []
            try:
                for ctx in list(self._contexts.values()):
                    if self._map(ctx, bo):
                        done.append(ctx)
            except BaseException:
                if self._unmap_all(bo, done):
                    self.dev.devmem.free(addr)
                else:
                    self.leaked.append(addr)
                raise
        handle = self._next_handle
        self._next_handle += 1
        self._bos[handle] = bo
        self._owner = None
        a.handle = handle
        a.addr = addr

    def _scrub(self, bo: BufferObject) -> None:
        """Zero what an earlier owner left in the new buffer's memory (its dirty part;
        see devmem) before anyone can map it; on failure the memory goes back, still
        dirty, and BO_CREATE fails."""
        devmem = self.dev.devmem
        assert devmem is not None
        dirty = devmem.dirty_in(bo.addr, bo.map_size)
        if not dirty:
            return
        try:
            self.dev.scrub(dirty)
        except (VA1Error, AllocError) as e:
            devmem.free(bo.addr)
            if isinstance(e, AllocError):
                raise _err(errno.ENOMEM, f"BO_CREATE: no guest RAM to scrub device memory: "
                                         f"{e}") from None
            raise _err(e.errno or errno.EIO, f"BO_CREATE: {e}") from None
        devmem.mark_clean(dirty)

    # ------------------------------------------------------------------ address spaces
    def _map(self, ctx: Context, bo: BufferObject) -> bool:
        """Map one DEVICE buffer into one context (va = pa). A context that is gone (lost
        in a reset, destroyed) needs nothing. Returns whether a mapping was made."""
        if ctx.destroyed or ctx.lost or ctx.generation != self.dev.generation:
            return False
        if ctx.faulted:
            return False  # runs nothing until destroyed: nothing to reach
        try:
            return self.dev.ctx_map(ctx, bo.addr, bo.addr, bo.map_size,
                                    A.CTX_MAP_READ | A.CTX_MAP_WRITE)
        except VA1Error:
            if ctx.lost or ctx.generation != self.dev.generation:
                return False  # the reset took the context (and its mappings) away
            raise

    def _unmap_all(self, bo: BufferObject, contexts: list[Context]) -> bool:
        """Unmap bo from these contexts; True when no context can reach it any more."""
        clean = True
        for ctx in contexts:
            try:
                self.dev.ctx_unmap(ctx, bo.addr)
            except VA1Error as e:
                if ctx.faulted and ctx.device_id in self.dev._contexts:
                    ctx.mappings.pop(bo.addr, None)  # can never run again: cannot reach it
                    continue
                if bo.addr in ctx.mappings and not (ctx.lost or ctx.destroyed):
                    clean = False
                    self.dev.kernel.trace.emit("ctx_unmap_failed", dev=self.dev.name,
                                               context=ctx.uid, va=bo.addr, error=str(e))
        return clean

    def _bo_free(self, a: Any) -> None:
        if a.pad != 0:
            raise _err(errno.EINVAL, f"BO_FREE: pad must be 0, got {a.pad}")
        bo = self._bo(int(a.handle))
        del self._bos[bo.handle]
        self._owner = None
        self._free_bo(bo)

    def _free_bo(self, bo: BufferObject) -> None:
        bo.free_pending = True
        if bo.flags == U.BO_DEVICE and self.dev.address_spaces:
            def drop(_fence: Fence) -> None:
                self._drop_use(bo)
            for fence in list(self._in_flight.values()):
                bo.busy += 1
                fence.add_callback(drop)
        if bo.busy == 0:
            self._release(bo)

    def _drop_use(self, bo: BufferObject) -> None:
        bo.busy -= 1
        if bo.busy == 0 and bo.free_pending:
            self._last_use_done(bo)

    def _last_use_done(self, bo: BufferObject) -> None:
        """A fence dropped bo's last use (interrupt context: must not wait)."""
        if bo.flags == U.BO_DEVICE and self._mapped_in(bo):
            self.dev.deferred.append(lambda: self._release(bo))
        else:
            self._release(bo)

    def _mapped_in(self, bo: BufferObject) -> list[Context]:
        return [c for c in self._contexts.values() if bo.addr in c.mappings]

    def _release(self, bo: BufferObject) -> None:
        """Give the memory back; a DEVICE buffer is unmapped from every context first
        (task context). If an unmap fails the memory is kept (leaked, traced): a context
        could still reach it, and it must never be handed to someone else."""
        if bo.released:
            return
        bo.released = True
        if bo.flags == U.BO_DEVICE:
            assert self.dev.devmem is not None
            if not self._unmap_all(bo, self._mapped_in(bo)):
                self.leaked.append(bo.addr)
                self.dev.kernel.trace.emit("devmem_leak", dev=self.dev.name, addr=bo.addr,
                                           size=bo.map_size)
                return
            self.dev.devmem.free(bo.addr)
        else:
            self.dev.alloc.free(bo.addr)

    def _context_create(self, a: Any) -> None:
        if a.flags != 0:
            raise _err(errno.EINVAL, f"CONTEXT_CREATE: flags must be 0, got {a.flags:#x}")
        ctx = self.dev.create_context()
        try:
            for bo in list(self._bos.values()):
                if bo.flags == U.BO_DEVICE and not bo.free_pending:
                    self._map(ctx, bo)
        except BaseException:
            try:
                self.dev.destroy_context(ctx)
            except OSError:
                pass  # reset or dead: the context is gone either way
            raise
        self._contexts[ctx.uid] = ctx
        a.context_id = ctx.uid

    def _context_destroy(self, a: Any) -> None:
        if a.pad != 0:
            raise _err(errno.EINVAL, f"CONTEXT_DESTROY: pad must be 0, got {a.pad}")
        ctx = self._ctx(int(a.context_id))
        self.dev.destroy_context(ctx)
        del self._contexts[ctx.uid]

    def _submit(self, a: Any) -> None:
        # the integer fields of a cffi struct read as Python ints: no int() needed
        dev = self.dev
        ctx = self._contexts.get(a.context_id)   # _ctx
        if ctx is None:
            ctx = self._ctx(a.context_id)
        nq = dev.num_submit_queues
        queue = a.queue
        if queue >= nq:
            raise _err(errno.EINVAL, f"SUBMIT: queue {queue} out of range 0..{nq - 1}")
        cmd = self._bos.get(a.cmdbuf_handle)   # _bo
        if cmd is None:
            cmd = self._bo(a.cmdbuf_handle)
        if cmd.flags != U.BO_HOST:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf_handle {cmd.handle} is not a HOST buffer")
        off, size = a.cmdbuf_offset, a.cmdbuf_size
        if size == 0 or size % 8:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf_size {size} must be > 0 and a multiple "
                                     "of 8")
        if off + size > cmd.size:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf range [{off}, {off + size}) is outside "
                                     f"buffer {cmd.handle} of {cmd.size} bytes")
        config = dev.config
        max_size = config["max_cmdbuf_size"]
        if size > max_size:
            raise _err(errno.EINVAL, f"SUBMIT: cmdbuf_size {size} exceeds max_cmdbuf_size "
                                     f"{max_size}")
        count = a.buffer_count
        if count > U.MAX_SUBMIT_BUFFERS:
            raise _err(errno.EINVAL, f"SUBMIT: buffer_count {count} exceeds "
                                     f"{U.MAX_SUBMIT_BUFFERS}")
        bos = [cmd]
        if count:
            handles: list[int] = U.ffi.unpack(a.handles, count)  # type: ignore[assignment]
            bos += [self._bo(h) for h in handles]
        dev.check_submit(ctx)
        mem = dev.kernel.memory
        owner = self._owner
        if owner is None:
            owner = self._owner = self._make_host_owner()
        checked = self._checks.check(mem.read(cmd.addr + off, size), owner, mem.read,
                                     max_size, config["max_call_depth"])
        if checked.used:
            listed = {id(b) for b in bos}
            bos += [b for b in checked.used if id(b) not in listed]  # pinned until the fence
        alloc = dev.alloc
        try:
            shadow = alloc.alloc_dma(checked.size, 64)
        except AllocError as e:
            raise _err(errno.ENOMEM, f"SUBMIT: no guest RAM for the driver's copy of the "
                                     f"command buffer ({checked.size} bytes): {e}") from None
        plain = checked.plain
        mem.write(shadow, plain if plain is not None else checked.image(shadow))
        for bo in bos:
            bo.busy += 1

        def done(fence: Fence) -> None:
            self._in_flight.pop(id(fence), None)
            alloc.free(shadow)
            for b in bos:
                b.busy -= 1
                if b.busy == 0 and b.free_pending:
                    self._last_use_done(b)
        try:
            fence = dev.submit(ctx, queue, shadow, size, on_done=done, checked=True)
        except BaseException:
            alloc.free(shadow)
            for bo in bos:
                bo.busy -= 1
                if bo.busy == 0 and bo.free_pending:
                    self._release(bo)
            raise
        if not fence.signalled:
            self._in_flight[id(fence)] = fence
        a.fence_seq = fence.seq

    def _make_host_owner(self) -> Callable[[int, int], BufferObject | None]:
        """`owner(addr, size)`: this file's HOST buffer holding [addr, addr+size); kept
        in `_owner` by SUBMIT and made again only after a BO_CREATE or BO_FREE."""
        hosts = sorted((b.addr, b.addr + b.size, b) for b in self._bos.values()
                       if b.flags == U.BO_HOST)
        starts = [h[0] for h in hosts]

        def owner(addr: int, size: int) -> BufferObject | None:
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr + size <= hosts[i][1]:
                return hosts[i][2]
            return None
        return owner

    def _wait(self, a: Any) -> None:
        if a.pad != 0:
            raise _err(errno.EINVAL, f"WAIT: pad must be 0, got {a.pad}")
        ctx = self._contexts.get(a.context_id)   # _ctx (cffi integer fields are ints)
        if ctx is None:
            ctx = self._ctx(a.context_id)
        seq = a.fence_seq
        fence = ctx.timeline.fences.get(seq)   # timeline.get
        if fence is None:
            if ctx.timeline.released(seq):   # read OK once already; its record is gone
                a.status, a.error_offset, a.start_ns, a.end_ns = int(A.Status.OK), \
                    A.NO_OFFSET, 0, 0
                return
            raise _err(errno.EINVAL, f"WAIT: fence {seq} was never issued on context "
                                     f"{ctx.uid} (last {ctx.timeline.last_seq})")
        timeout = a.timeout_ns
        if not self.dev.wait_fence(fence, None if timeout < 0 else timeout):
            raise _err(errno.ETIME, f"WAIT: fence {seq} of context {ctx.uid} not signalled "
                                    f"within {timeout} ns")
        a.status = fence.status
        a.error_offset = fence.error_offset
        a.start_ns = fence.start_ns
        a.end_ns = fence.end_ns
        ctx.timeline.release(fence)

    def _get_stats(self, a: Any) -> None:
        stats = self.dev.get_stats()
        for name in ("submissions", "commands", "device_time_ns", "dma_bytes", "faults",
                     "interrupts", "lost_interrupts", "polled_completions",
                     "watchdog_fires", "resets"):
            setattr(a, name, stats[name])
