"""Streams, events and pending downloads: ordered work on one submit queue.

A stream accumulates commands in an open command buffer ("chunk"). `flush()` copies it
into a HOST staging region and submits it (SUBMIT) with the handles of every buffer its
commands use; the driver keeps those alive until the fence. A chunk is sealed and
submitted early when it would exceed the device's max_cmdbuf_size or the uAPI's limit
of buffers per submission, so any amount of work fits. Chunks complete in order (one
submit queue runs its submissions one at a time), which lets one number, the last
completed chunk, say which staging blocks are idle and which downloads are ready.
"""
from __future__ import annotations

import os as _os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

import numpy as np

from guest_driver import uapi
from hwspec import isa, va1
from hwspec.isa import Activation, EltOp, Opcode

from ._builder import (COMPUTE_DTYPES, U32_MAX, CommandBufferBuilder, Name, as_activation,
                       as_eltop, check_f32)
from ._device import Buffer, Context
from ._errors import DeviceError, DriverError, UseAfterFreeError
from ._staging import Region, StagingPool

_CMD_ALIGN = isa.ALIGN
_LENGTH = {op: isa.command_length(op) for op in Opcode}
_DMA_LEN = _LENGTH[Opcode.DMA_H2D]
_H2D, _D2H, _D2D = Opcode.DMA_H2D, Opcode.DMA_D2H, Opcode.DMA_D2D
_GEMM_LEN = _LENGTH[Opcode.GEMM]
_OK = va1.Status.OK  # read once: an enum member access is a Python-level lookup on 3.11
_NO_OFFSET = va1.NO_OFFSET


def _caller() -> tuple[str, int]:
    """Where the user code that called the public Stream method is (for names), taken
    now and formatted by `_where` only if a name is ever read."""
    try:
        f = sys._getframe(2)
    except ValueError:  # pragma: no cover - shallow stack
        return "?", 0
    return f.f_code.co_filename, f.f_lineno


def _where(site: tuple[str, int]) -> str:
    return f"{_os.path.basename(site[0])}:{site[1]}"


SUBMISSION_HISTORY = 1024   # results a Stream keeps (Stream.submissions)


@dataclass(frozen=True, init=False)
class SubmissionResult:
    """How one submitted command buffer ended, as WAIT reported it."""

    seq: int                 # stream-local submission number
    fence_seq: int | None    # None if SUBMIT itself failed
    queue: int
    status: int
    error_offset: int | None
    start_ns: int
    end_ns: int
    commands: int
    cmdbuf_size: int

    def __init__(self, seq: int, fence_seq: int | None, queue: int, status: int,
                 error_offset: int | None, start_ns: int, end_ns: int, commands: int,
                 cmdbuf_size: int) -> None:
        # One dict update, not the generated frozen __init__'s object.__setattr__ per
        # field: a stream makes one of these per submission.
        self.__dict__.update(seq=seq, fence_seq=fence_seq, queue=queue, status=status,
                             error_offset=error_offset, start_ns=start_ns, end_ns=end_ns,
                             commands=commands, cmdbuf_size=cmdbuf_size)

    @property
    def ok(self) -> bool:
        return self.status == va1.Status.OK

    @property
    def device_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


class _Chunk:
    """One command buffer of a stream: open, then in flight until retired. A retired
    chunk is dead (nothing outside the stream holds a chunk, and the stream drops it
    from its in-flight queue as it retires it): the stream opens it again for a later
    submission (`Stream._reopen`) instead of building a new one."""

    # Set when the chunk is submitted (class defaults until then: these four are read
    # only once it is in flight; `_reopen` clears the two a failed submission sets).
    fence: int | None = None
    submit_error: BaseException | None = None
    nbytes = 0
    commands = 0

    def __init__(self, seq: int, builder: CommandBufferBuilder) -> None:
        self.seq = seq
        self.builder = builder
        self.handles: dict[int, None] = {}   # ordered set
        self.downloads: list[Pending] = []


class Pending:
    """The result of `Stream.download`: an array once its submission has completed.

    `result()` waits (flushing the stream if needed) and returns the array, or raises
    the error that failed the submission. Data is copied out of staging exactly once.
    """

    __slots__ = ("_stream", "_seq", "_region", "_waiting", "_shape", "_dtype", "_out",
                 "_array", "_error")

    def __init__(self, stream: Stream, seq: int, region: Region | None, shape: tuple[int, ...],
                 dtype: np.dtype[Any], out: np.ndarray | None) -> None:
        self._stream = stream
        self._seq = seq
        self._region: Region | None = region
        self._waiting = True
        self._shape = shape
        self._dtype = dtype
        self._out = out
        self._array: np.ndarray | None = None
        self._error: BaseException | None = None

    def _complete(self, error: BaseException | None) -> None:
        region, self._region = self._region, None
        self._waiting = False
        if error is not None:
            self._error = error
            return
        if region is None:  # the DMA wrote straight into the pinned `out`
            self._array = self._out
            return
        src = region.array().view(self._dtype).reshape(self._shape)
        if self._out is None:
            self._array = src.copy()
        else:
            np.copyto(self._out, src)
            self._array = self._out

    def done(self) -> bool:
        """True once the download's submission completed (successfully or not)."""
        if self._waiting and not self._stream.destroyed:
            self._stream._poll_through(self._seq)
        return not self._waiting

    def result(self, timeout_ns: int | None = None) -> np.ndarray:
        """The downloaded array (waits for it); raises the submission's error."""
        if self._waiting:
            if self._stream.destroyed:
                raise UseAfterFreeError("download: its stream was destroyed before it ran")
            self._stream._wait_through(self._seq, timeout_ns, raise_errors=False)
        if self._error is not None:
            raise self._error
        assert self._array is not None
        return self._array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.result()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        state = "error" if self._error else "ready" if self._array is not None else "pending"
        return f"<Pending download {self._shape} {self._dtype} {state}>"


class Event:
    """A point in a stream, stamped with device time by a TIMESTAMP command."""

    def __init__(self, stream: Stream, seq: int, slot: np.ndarray) -> None:
        self.stream = stream
        self._seq = seq
        self._slot = slot

    def query(self) -> bool:
        """True if the device has passed this event (submits pending work; never blocks)."""
        self.stream._check("event query")
        return self.stream._poll_through(self._seq)

    def synchronize(self, timeout_ns: int | None = None) -> None:
        """Wait until the device has passed this event; raise if its work failed."""
        self.stream._check("event synchronize")
        self.stream._wait_through(self._seq, timeout_ns, raise_errors=True)

    @property
    def timestamp_ns(self) -> int:
        """Device time (ns) at which the event was reached (waits for it)."""
        self.synchronize()
        return int(self._slot.view("<u8")[0])

    def elapsed_ns(self, end: Event) -> int:
        """Device time from this event to `end` (like cudaEventElapsedTime(self, end))."""
        if not isinstance(end, Event):
            raise TypeError(f"elapsed_ns needs an Event, got {type(end).__name__}")
        if end.stream.context is not self.stream.context:
            raise ValueError("elapsed_ns: the events belong to different contexts")
        return end.timestamp_ns - self.timestamp_ns


class Stream:
    """An in-order queue of commands on one submit queue of a context."""

    def __init__(self, context: Context, queue: int) -> None:
        self.context = context
        self.queue = queue
        self._drv = context._drv
        self._device = context.device
        # The compute dtypes this device has (its parameters never change once open).
        self._compute_ok = frozenset(d for d in COMPUTE_DTYPES
                                     if context.device.supports_dtype(d))
        params = context.device.params
        limit = min(params["max_cmdbuf_size"], 0xFFFF_FFFF)
        self._max_cmdbuf = limit - limit % _CMD_ALIGN
        self._retired: _Chunk | None = None   # the last chunk retired, to open again
        self._open = self._reopen(0)
        self._inflight: deque[_Chunk] = deque()
        self._completed_seq = -1
        self._first_error: tuple[int, BaseException] | None = None
        # The newest SUBMISSION_HISTORY results (older ones are released: a stream's
        # memory does not grow with its submissions); device_ns counts them all.
        self.submissions: deque[SubmissionResult] = deque(maxlen=SUBMISSION_HISTORY)
        self._device_ns = 0
        self.destroyed = False
        self._staging = StagingPool(self._drv, lambda seq: seq <= self._completed_seq,
                                    self._poll)

    # -- state ----------------------------------------------------------------------

    def _check(self, what: str) -> None:
        if self.destroyed:
            raise UseAfterFreeError(f"{what}: the stream was destroyed")
        self.context._check_alive(what)

    @property
    def error(self) -> BaseException | None:
        """The first error of this stream (sticky: the context is faulted after it)."""
        return None if self._first_error is None else self._first_error[1]

    @property
    def device_ns(self) -> int:
        """Sum of device time over the completed submissions."""
        return self._device_ns

    @property
    def pending_commands(self) -> int:
        """Commands appended but not yet submitted."""
        return self._open.builder.command_count

    def disassemble(self) -> str:
        """Listing of the commands not yet submitted (with the call that made each)."""
        return self._open.builder.disassemble()

    def _uses_unsubmitted(self, handle: int) -> bool:
        return handle in self._open.handles

    def _buffer(self, buf: Any, what: str) -> Buffer:
        """`buf` if it is a usable Buffer of this stream's context. Every caller has run
        `_check` first, so the context is known alive: only a freed buffer or another
        context's needs `check_usable` (which raises the error)."""
        if not isinstance(buf, Buffer):
            raise TypeError(f"{what} must be a Buffer, got {type(buf).__name__}")
        if buf.freed or buf.context is not self.context:
            buf.check_usable(self.context, what)
        return buf

    # -- appending ------------------------------------------------------------------

    def _room(self, length: int, handles: Collection[int]) -> _Chunk:
        """The open chunk, once a command of `length` bytes that uses `handles` fits in
        it: the chunk is submitted first if the command or its new handles would not."""
        ch = self._open
        size = len(ch.builder)
        if size:
            used = ch.handles
            if (size + length > self._max_cmdbuf
                    or (len(used) + len(handles) > uapi.MAX_SUBMIT_BUFFERS
                        and len(used) + len({h: None for h in handles if h not in used})
                        > uapi.MAX_SUBMIT_BUFFERS)):
                self._submit_open()
                return self._open
        return ch

    def _append(self, length: int, handles: Collection[int],
                emit: Callable[[CommandBufferBuilder], int],
                regions: Iterable[Region] = ()) -> _Chunk:
        """Emit a command of `length` bytes that uses `handles` into the open chunk
        (see `_room`)."""
        ch = self._room(length, handles)
        emit(ch.builder)
        used = ch.handles
        for h in handles:
            used[h] = None
        for r in regions:
            if r.block.last_seq < ch.seq:
                r.block.last_seq = ch.seq
        return ch

    def _append_dma(self, opcode: Opcode, handle_a: int, handle_b: int, src: int, dst: int,
                    nbytes: int, name: Name, region: Region | None = None) -> _Chunk:
        """`_append` of one DMA between the buffers `handle_a` and `handle_b`, which the
        stream has checked (uploads, downloads, copies), with no closure to make."""
        ch = self._room(_DMA_LEN, (handle_a, handle_b))
        ch.builder._dma_unchecked(opcode, src, dst, nbytes, name)
        used = ch.handles
        used[handle_a] = None
        used[handle_b] = None
        if region is not None and region.block.last_seq < ch.seq:
            region.block.last_seq = ch.seq
        return ch

    def upload(self, buf: Buffer, data: Any) -> None:
        """Copy `data` (same shape and dtype as `buf`) to the device.

        The data is copied once, now, into a HOST staging region, so the caller may
        reuse its array immediately; a DMA_H2D moves it when the stream runs.

        The fast way: `data` in pinned host memory (`Device.alloc_host`). Then there is
        no staging copy: the DMA_H2D reads the array itself when the stream runs, so
        leave it unmodified until then.
        """
        if self.destroyed or self.context.destroyed:
            self._check("upload")
        if type(buf) is not Buffer or buf.freed or buf.context is not self.context:
            buf = self._buffer(buf, "upload")
        arr = data if type(data) is np.ndarray else np.asarray(data)
        if arr.dtype is not buf.dtype and arr.dtype != buf.dtype:
            raise TypeError(f"upload: data has dtype {arr.dtype} but the buffer is "
                            f"{buf.dtype}; convert it with .astype(np.{buf.dtype.name})")
        if arr.shape != buf.shape:
            raise ValueError(f"upload: data has shape {arr.shape} but the buffer is {buf.shape}")
        pinned = self._device._pinned_iova(arr)
        if pinned is not None:  # zero copy: one DMA straight out of the pinned array
            handle, iova = pinned
            site = _caller()
            name = lambda: (f"upload pinned {buf.shape} {buf.dtype} -> {buf.addr:#x} "
                            f"({_where(site)})")
            self._append_dma(_H2D, buf.handle, handle, iova, buf.addr, buf.nbytes, name)
            return
        region = self._staging.alloc(buf.nbytes, self._open.seq)
        np.copyto(region.array().view(buf.dtype).reshape(buf.shape), arr, casting="no")
        site = _caller()
        name = lambda: f"upload {buf.shape} {buf.dtype} -> {buf.addr:#x} ({_where(site)})"
        self._append_dma(_H2D, buf.handle, region.handle, region.iova, buf.addr, buf.nbytes,
                         name, region)

    def download(self, buf: Buffer, out: np.ndarray | None = None) -> Pending:
        """DMA_D2H `buf`; the Pending's result() is the array after the stream has run
        (written into `out` if given).

        The fast way: `out` in pinned host memory (`Device.alloc_host`, or a C-contiguous
        view of it). Then the DMA writes `out` itself, with no staging copy; its contents
        are undefined until the download completes. Otherwise the DMA writes a staging
        region and `result()` copies it out once."""
        if self.destroyed or self.context.destroyed:
            self._check("download")
        if type(buf) is not Buffer or buf.freed or buf.context is not self.context:
            buf = self._buffer(buf, "download")
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"download: out must be a numpy array, got {type(out).__name__}")
            if (out.dtype is not buf.dtype and out.dtype != buf.dtype) or out.shape != buf.shape:
                raise ValueError(f"download: out is {out.shape} {out.dtype} but the buffer is "
                                 f"{buf.shape} {buf.dtype}")
            if not out.flags.writeable:
                raise ValueError("download: out is read-only")
            pinned = self._device._pinned_iova(out)
            if pinned is not None:  # one DMA straight into the pinned array, no staging
                handle, iova = pinned
                site = _caller()
                name = lambda: (f"download pinned {buf.shape} {buf.dtype} <- {buf.addr:#x} "
                                f"({_where(site)})")
                ch = self._append_dma(_D2H, buf.handle, handle, buf.addr, iova, buf.nbytes,
                                      name)
                pending = Pending(self, ch.seq, None, buf.shape, buf.dtype, out)
                ch.downloads.append(pending)
                return pending
        region = self._staging.alloc(buf.nbytes, self._open.seq)
        site = _caller()
        name = lambda: (f"download {buf.shape} {buf.dtype} <- {buf.addr:#x} "
                        f"({_where(site)})")
        ch = self._append_dma(_D2H, buf.handle, region.handle, buf.addr, region.iova,
                              buf.nbytes, name, region)
        pending = Pending(self, ch.seq, region, buf.shape, buf.dtype, out)
        ch.downloads.append(pending)
        return pending

    def copy(self, dst: Buffer, src: Buffer) -> None:
        """Device-to-device copy (DMA_D2D) between buffers of the same dtype and size."""
        self._check("copy")
        dst = self._buffer(dst, "copy dst")
        src = self._buffer(src, "copy src")
        if dst.dtype != src.dtype or dst.size != src.size:
            raise ValueError(f"copy: src is {src.shape} {src.dtype}, dst is "
                             f"{dst.shape} {dst.dtype}: dtype and element count must match")
        site = _caller()
        name = lambda: f"copy {src.addr:#x} -> {dst.addr:#x} ({_where(site)})"
        self._append_dma(_D2D, dst.handle, src.handle, src.addr, dst.addr, src.nbytes, name)

    def fill(self, buf: Buffer, value: int | float) -> None:
        """Set every element of `buf` to `value` (FILL; a tail under 4 bytes by DMA)."""
        self._check("fill")
        buf = self._buffer(buf, "fill")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"fill: value must be a number, got {type(value).__name__}")
        if buf.dtype.kind == "i" and float(value) != int(value):
            raise ValueError(f"fill: {value!r} is not an integer, the buffer is {buf.dtype}")
        try:
            with np.errstate(over="raise"):
                elem = np.array(value, dtype=buf.dtype)
        except (OverflowError, FloatingPointError):
            raise ValueError(f"fill: {value!r} does not fit in {buf.dtype}") from None
        if buf.dtype.kind == "f" and np.isfinite(value) and not np.isfinite(elem):
            raise ValueError(f"fill: {value!r} does not fit in {buf.dtype}")
        raw = elem.tobytes() * (4 // buf.dtype.itemsize)
        pattern = int.from_bytes(raw, "little")
        body = buf.nbytes - buf.nbytes % 4
        site = _caller()
        if body:
            self._append(_LENGTH[Opcode.FILL], (buf.handle,),
                         lambda b: b.fill(buf.addr, body, pattern,
                                          name=lambda: f"fill {buf.shape} {buf.dtype} = "
                                                       f"{value!r} ({_where(site)})"))
        tail = buf.nbytes - body
        if tail:
            region = self._staging.alloc(tail, self._open.seq)
            region.array()[:] = np.frombuffer(raw[:tail], np.uint8)
            self._append_dma(_H2D, buf.handle, region.handle, region.iova, buf.addr + body,
                             tail, lambda: f"fill tail {tail} bytes ({_where(site)})", region)

    def gemm(self, a: Buffer, b: Buffer, c: Buffer, bias: Buffer | None = None,
             alpha: float = 1.0, beta: float = 0.0, trans_a: bool = False,
             trans_b: bool = False, activation: str | Activation | None = None) -> None:
        """c = act(alpha * op(a) @ op(b) + beta * c + bias) on the device.

        a is m x k (k x m with trans_a), b is k x n (n x k with trans_b), c is m x n and
        bias has n elements; all share one compute dtype (float32 or float16).
        """
        if self.destroyed or self.context.destroyed:
            self._check("gemm")
        ctx = self.context
        if not (type(a) is Buffer and type(b) is Buffer and type(c) is Buffer
                and not (a.freed or b.freed or c.freed)
                and a.context is ctx and b.context is ctx and c.context is ctx
                and (bias is None or (type(bias) is Buffer and not bias.freed
                                      and bias.context is ctx and bias.dtype is a.dtype))
                and len(a.shape) == 2 and len(b.shape) == 2 and len(c.shape) == 2
                and b.dtype is a.dtype and c.dtype is a.dtype
                and a.isa_dtype in self._compute_ok):
            # Not the common case at a glance: every check, in order, names what is wrong.
            a, b, c, bias = self._gemm_operands(a, b, c, bias)
        handles = ((a.handle, b.handle, c.handle) if bias is None
                   else (a.handle, b.handle, c.handle, bias.handle))
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
        if kb != k:
            raise ValueError(f"gemm: inner dimensions differ: op(a) is {m}x{k} but op(b) is "
                             f"{kb}x{n}")
        if c.shape != (m, n):
            raise ValueError(f"gemm: c must be {m}x{n} for op(a) {m}x{k} @ op(b) {k}x{n}, "
                             f"it is {c.shape}")
        if bias is not None and bias.shape not in ((n,), (1, n)):
            raise ValueError(f"gemm: bias must have shape ({n},) or (1, {n}), it is {bias.shape}")
        act = as_activation(activation)
        alpha, beta = check_f32(alpha, "gemm alpha"), check_f32(beta, "gemm beta")
        dt = a.isa_dtype
        has_bias = bias is not None
        site = _caller()

        def name() -> str:
            extra = "".join([" +bias" if has_bias else "",
                             f" {act.name.lower()}" if act != Activation.NONE else ""])
            return f"gemm {m}x{k} @ {k}x{n} {a.dtype_name}{extra} ({_where(site)})"

        bias_addr = None if bias is None else bias.addr
        emit: Callable[[CommandBufferBuilder], int]
        if m <= U32_MAX and n <= U32_MAX and k <= U32_MAX:  # then the rest is checked
            emit = lambda bld: bld._gemm_unchecked(dt, m, n, k, a.addr, b.addr, c.addr,
                                                   bias_addr, alpha, beta, trans_a, trans_b,
                                                   act, name)
        else:  # the builder names the dimension out of range
            emit = lambda bld: bld.gemm(dtype=dt, m=m, n=n, k=k, a=a.addr, b=b.addr,
                                        c=c.addr, bias=bias_addr, alpha=alpha, beta=beta,
                                        trans_a=trans_a, trans_b=trans_b, activation=act,
                                        name=name)
        self._append(_GEMM_LEN, handles, emit)

    def _gemm_operands(self, a: Any, b: Any, c: Any, bias: Any
                       ) -> tuple[Buffer, Buffer, Buffer, Buffer | None]:
        a = self._buffer(a, "gemm a")
        b = self._buffer(b, "gemm b")
        c = self._buffer(c, "gemm c")
        ops = [("a", a), ("b", b), ("c", c)]
        if bias is not None:
            bias = self._buffer(bias, "gemm bias")
            ops.append(("bias", bias))
        for nm, x in ops[:3]:
            if len(x.shape) != 2:
                raise ValueError(f"gemm: {nm} must be 2-D, it is {x.shape}")
        self._compute_dtype("gemm", ops)
        return a, b, c, bias

    def elementwise(self, op: str | EltOp, a: Buffer, b: Buffer | None, out: Buffer) -> None:
        """out = a op b ("add", "mul") or out = op(a) ("relu": pass b=None)."""
        self._check("elementwise")
        eop = as_eltop(op)
        a = self._buffer(a, "elementwise a")
        out = self._buffer(out, "elementwise out")
        ops = [("a", a), ("out", out)]
        if eop in isa.UNARY_ELT_OPS:
            if b is not None:
                raise ValueError(f"elementwise {eop.name.lower()} is unary: pass b=None")
        else:
            if b is None:
                raise ValueError(f"elementwise {eop.name.lower()} is binary: b is required")
            b = self._buffer(b, "elementwise b")
            ops.insert(1, ("b", b))
        self._compute_dtype("elementwise", ops)
        for nm, x in ops[1:]:
            if x.shape != a.shape:
                raise ValueError(f"elementwise: {nm} has shape {x.shape} but a has {a.shape}")
        dt = a.isa_dtype
        site = _caller()
        name = lambda: (f"elementwise {eop.name.lower()} {a.shape} {a.dtype_name} "
                        f"({_where(site)})")
        b_addr = None if b is None else b.addr
        self._append(_LENGTH[Opcode.ELEMENTWISE], [x.handle for _, x in ops],
                     lambda bld: bld.elementwise(eop, dtype=dt, count=a.size, a=a.addr,
                                                 b=b_addr, out=out.addr, name=name))

    def _compute_dtype(self, what: str, ops: list[tuple[str, Buffer]]) -> None:
        first = ops[0][1].dtype
        for nm, x in ops[1:]:
            if x.dtype != first:
                raise TypeError(f"{what}: {nm} is {x.dtype} but {ops[0][0]} is {first}; "
                                f"all operands must share one dtype")
        if ops[0][1].isa_dtype not in COMPUTE_DTYPES:
            raise TypeError(f"{what}: dtype {first} is not a compute dtype "
                            f"(float32 or float16)")
        if not self.context.device.supports_dtype(ops[0][1].isa_dtype):
            raise TypeError(f"{what}: this device does not compute in {first} (dtype_mask "
                            f"{self.context.device.params['dtype_mask']:#x})")

    def enqueue(self, commands: CommandBufferBuilder,
                buffers: Iterable[Buffer] = ()) -> None:
        """Append prebuilt commands as they are (compiled code, negative tests).

        The runtime cannot see which buffers raw addresses refer to: list them in
        `buffers` so the driver keeps them alive. The commands stay in one submission,
        and `DeviceError.command` still names them by their records in `commands`.
        """
        if self.destroyed or self.context.destroyed:
            self._check("enqueue")
        exact = type(commands) is CommandBufferBuilder
        if not exact and not isinstance(commands, CommandBufferBuilder):
            raise TypeError(f"enqueue needs a CommandBufferBuilder, got "
                            f"{type(commands).__name__}")
        bufs = [self._buffer(b, "enqueue buffer") for b in buffers]
        size = len(commands)
        if size == 0:
            return
        if size % _CMD_ALIGN or size > self._max_cmdbuf:
            raise ValueError(f"enqueue: {size} bytes of commands; a submission takes a "
                             f"multiple of {_CMD_ALIGN} up to {self._max_cmdbuf}")
        if not bufs:   # _append with no handles: no dict or closure to build
            self._room(size, ()).builder.extend(commands)
            return
        handles = {b.handle: None for b in bufs}
        if len(handles) > uapi.MAX_SUBMIT_BUFFERS:
            raise ValueError(f"enqueue: {len(handles)} buffers, a submission takes at most "
                             f"{uapi.MAX_SUBMIT_BUFFERS}")
        self._append(size, handles, lambda b: b.extend(commands))

    def record_event(self) -> Event:
        """An Event at this point of the stream (a TIMESTAMP into a HOST slot)."""
        self._check("record_event")
        if not self.context.device.has_feature(va1.F_TIMESTAMP):
            raise RuntimeError("record_event: the device did not negotiate VA1_F_TIMESTAMP")
        handle, iova, slot = self.context._timestamp_slot()
        site = _caller()
        name = lambda: f"event ({_where(site)})"
        ch = self._append(_LENGTH[Opcode.TIMESTAMP], (handle,),
                          lambda b: b.timestamp(iova, name=name))
        return Event(self, ch.seq, slot)

    # -- submission and completion ------------------------------------------------------

    def _submit_open(self) -> int | None:
        ch = self._open
        bld = ch.builder
        size = len(bld)
        if not size:
            return None
        self._open = self._reopen(ch.seq + 1)
        ch.nbytes, ch.commands = size, bld.command_count  # sealed: _retire reports them
        try:
            # One memcpy into staging, no Region built around the bytes. The view is
            # released at once: an export would stop the builder from being cleared
            # when the chunk is reused (a traceback may keep the frames holding it).
            with bld.view() as data:
                block, offset = self._staging.put(data, ch.seq)
            ch.fence = self._drv.submit(self.context.id, self.queue, block.handle,
                                        offset, size, ch.handles, ch.commands)
        except BaseException as e:
            # Queued anyway, so that completion stays in order: retiring it fails its
            # downloads with this error and frees its staging for reuse.
            ch.submit_error = e
            if isinstance(e, DriverError):
                # The driver refuses a faulted context's submissions: report the
                # earlier submission's DeviceError (the cause), chained to the refusal.
                if self._inflight:
                    self._wait_through(ch.seq - 1, None, raise_errors=False)
                if self._first_error is not None and isinstance(self._first_error[1],
                                                                DeviceError):
                    raise self._first_error[1] from e
            raise
        finally:
            self._inflight.append(ch)
        return ch.fence

    def _reopen(self, seq: int) -> _Chunk:
        """The open chunk `seq`: the last retired one cleared (its commands, handles,
        fence and submission error), else a new one. Chunks in flight are never
        touched: their builders name their commands when they fail."""
        ch = self._retired
        if ch is None:
            return _Chunk(seq, CommandBufferBuilder(self._max_cmdbuf))
        self._retired = None
        ch.seq = seq
        ch.fence = ch.submit_error = None
        ch.builder.clear()
        if ch.handles:
            ch.handles.clear()
        return ch

    def flush(self) -> int | None:
        """Submit the commands appended so far; returns the fence (None if none)."""
        self._check("flush")
        return self._submit_open()

    def _retire(self, ch: _Chunk, r: tuple[int, int, int, int] | None) -> None:
        """Record chunk `ch`'s completion (`r` the (status, error_offset, start_ns, end_ns)
        WAIT reported, or None if it was never submitted)."""
        self._inflight.popleft()
        err: BaseException | None
        if r is None:
            err = ch.submit_error
            res = SubmissionResult(ch.seq, None, self.queue, va1.Status.ABORTED, None, 0, 0,
                                   ch.commands, ch.nbytes)
        else:
            status, error_offset, start_ns, end_ns = r
            off = None if error_offset == _NO_OFFSET else error_offset
            res = SubmissionResult(ch.seq, ch.fence, self.queue, status, off, start_ns,
                                   end_ns, ch.commands, ch.nbytes)
            err = None if status == _OK else self._device_error(ch, status, off)
            if end_ns > start_ns:
                self._device_ns += end_ns - start_ns
        self.submissions.append(res)
        self._completed_seq = ch.seq
        if err is not None and self._first_error is None:
            self._first_error = (ch.seq, err)
        if ch.downloads:
            for p in ch.downloads:
                p._complete(err)
            ch.downloads.clear()
        self._retired = ch

    def _device_error(self, ch: _Chunk, status: int, off: int | None) -> DeviceError:
        """The DeviceError of chunk `ch`, naming the command at `off`."""
        rec = None if off is None else ch.builder.command_at(off)
        return DeviceError(status, off, None if rec is None else rec.name,
                           fence_seq=ch.fence or 0, context_id=self.context.id,
                           queue=self.queue)

    def _wait_one(self, ch: _Chunk, timeout_ns: int) -> bool:
        if ch.fence is None:
            self._retire(ch, None)
            return True
        r = self._drv.wait_fields(self.context.id, ch.fence, timeout_ns)
        if r is None:
            return False
        self._retire(ch, r)
        return True

    def _poll(self) -> None:
        """Retire every chunk that has completed, without blocking."""
        while self._inflight and self._wait_one(self._inflight[0], 0):
            pass

    def _poll_through(self, seq: int) -> bool:
        if seq >= self._open.seq:
            self._submit_open()
        self._poll()
        return seq <= self._completed_seq

    def _wait_through(self, seq: int, timeout_ns: int | None, *, raise_errors: bool) -> None:
        if seq >= self._open.seq:
            self._submit_open()
        t = -1 if timeout_ns is None else int(timeout_ns)
        inflight = self._inflight
        while inflight and inflight[0].seq <= seq:
            ch = inflight[0]
            if not self._wait_one(ch, t):
                raise TimeoutError(f"fence {ch.fence} of context {self.context.id} queue "
                                   f"{self.queue} did not signal within {t} ns")
        if raise_errors and self._first_error is not None and self._first_error[0] <= seq:
            raise self._first_error[1]

    def query(self) -> bool:
        """True if all work appended so far has completed (submits it; never blocks)."""
        self._check("query")
        return self._poll_through(self._open.seq - (0 if self._open.builder.size else 1))

    def synchronize(self, timeout_ns: int | None = None) -> None:
        """Submit pending commands and wait for all of them; raises the stream's first
        DeviceError (naming the status and the command at the error offset)."""
        if self.destroyed or self.context.destroyed:
            self._check("synchronize")
        self._submit_open()
        self._wait_through(self._open.seq - 1, timeout_ns, raise_errors=True)

    def destroy(self) -> None:
        """Drop unsubmitted commands, wait for submitted ones (errors are kept in
        `error`, not raised) and free the staging memory."""
        if self.destroyed:
            return
        dropped = self._open
        self._open = self._reopen(dropped.seq + 1)
        for p in dropped.downloads:
            p._complete(UseAfterFreeError("download: its stream was destroyed before it "
                                          "was submitted"))
        try:
            while self._inflight:
                self._wait_one(self._inflight[0], -1)
        finally:
            self.destroyed = True
            if self in self.context.streams:
                self.context.streams.remove(self)
            self._completed_seq = self._open.seq
            self._staging.release_all()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None and not self.destroyed:
                self.synchronize()
        finally:
            self.destroy()

    def __repr__(self) -> str:
        return (f"<Stream context={self.context.id} queue={self.queue} "
                f"pending={self.pending_commands} inflight={len(self._inflight)}>")
