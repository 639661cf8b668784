"""Device, Context and Buffer: the objects that own driver resources.

A Device is one open /dev/accel/accelN. A Context is a device context (CONTEXT_CREATE)
and owns its device buffers, streams and event timestamp pages; destroying it releases
all of them. Buffers are typed (shape, dtype) views of one device allocation, so every
command argument can be checked against them before anything reaches the device.
"""
from __future__ import annotations

import errno
import math
import operator
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence, SupportsIndex

import numpy as np

from guest_driver import uapi
from hwspec import isa
from hwspec.isa import DType

from .driver_file import PARAM_CODES, DriverFile
from ._errors import ContextMismatchError, DriverError, UseAfterFreeError

if TYPE_CHECKING:
    from ._stream import Stream

_NUMPY_TO_DTYPE: dict[np.dtype[Any], DType] = {np.dtype(v): k for k, v in isa.DTYPE_NUMPY.items()}
TIMESTAMP_PAGE = 4096
# GET_PARAMs the runtime cannot work without.
REQUIRED_PARAMS = frozenset({"num_submit_queues", "max_cmdbuf_size", "dtype_mask", "features"})
_TS_SIZE = 8


def to_numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """A numpy dtype the VA-1 ISA has (float32, float16, int8, int32), else ValueError."""
    if isinstance(dtype, DType):
        known: np.dtype[Any] = np.dtype(isa.DTYPE_NUMPY[dtype])
        return known
    dt: np.dtype[Any] | None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in _NUMPY_TO_DTYPE:
        names = ", ".join(str(np.dtype(v)) for v in isa.DTYPE_NUMPY.values())
        raise ValueError(f"dtype {dtype!r} is not a VA-1 dtype (one of {names})")
    return dt


def isa_dtype(dtype: np.dtype[Any]) -> DType:
    return _NUMPY_TO_DTYPE[dtype]


def _address(arr: np.ndarray) -> int:
    """The address of `arr`'s first byte (`arr.ctypes.data` runs numpy's Python ctypes
    helper: about 100 µs on caches a 64 MiB copy has just flushed)."""
    return int(arr.__array_interface__["data"][0])


class DeviceParams(Mapping[str, int]):
    """Every GET_PARAM value, by lower-case name (`params["device_memory_size"]` or
    `params.device_memory_size`)."""

    def __init__(self, values: Mapping[str, int]) -> None:
        self._values = dict(values)

    def __getitem__(self, key: str) -> int:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["_values"][name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(f"no device parameter {name!r}") from None

    def __repr__(self) -> str:
        return f"DeviceParams({self._values!r})"


class Device:
    """An open VA-1 device file: its parameters and the contexts created on it."""

    def __init__(self, os: uapi.GuestOS, index: int = 0) -> None:
        index = operator.index(index)
        if index < 0:
            raise ValueError(f"device index must be >= 0, got {index}")
        self.index = index
        self.path = f"/dev/accel/accel{index}"
        self._drv = DriverFile.open(os, self.path)
        self._closed = False
        self.contexts: list[Context] = []
        # Pinned host arrays (alloc_host): (data address, nbytes, handle, iova, array).
        self._pinned: list[tuple[int, int, int, int, np.ndarray]] = []
        # id() of each array alloc_host returned -> (handle, iova): `_pinned` holds the
        # arrays, so an id here cannot be reused by another object until free_host.
        self._pinned_by_id: dict[int, tuple[int, int]] = {}
        try:
            self.params = DeviceParams(self._read_params())
        except BaseException:
            self._drv.close()
            raise

    def _read_params(self) -> dict[str, int]:
        """Every GET_PARAM the uAPI names; a driver that lacks one the runtime can do
        without (EINVAL) leaves it out rather than failing the open."""
        values: dict[str, int] = {}
        for name in PARAM_CODES:
            try:
                values[name] = self._drv.get_param(name)
            except DriverError as e:
                if name in REQUIRED_PARAMS or e.errno != errno.EINVAL:
                    raise
        return values

    # -- capabilities -----------------------------------------------------------

    def has_feature(self, bit: int) -> bool:
        """Whether feature bit `bit` (e.g. hwspec.va1.F_TIMESTAMP) was negotiated."""
        return bool(self.params["features"] >> bit & 1)

    def supports_dtype(self, dtype: Any) -> bool:
        """Whether the device computes in `dtype` (dtype_mask)."""
        code = dtype if isinstance(dtype, DType) else isa_dtype(to_numpy_dtype(dtype))
        return bool(self.params["dtype_mask"] >> code & 1)

    # -- lifetime ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UseAfterFreeError(f"device {self.path} is closed")

    def create_context(self) -> Context:
        self._check_open()
        ctx = Context(self, self._drv.context_create())
        self.contexts.append(ctx)
        return ctx

    # -- pinned host memory -----------------------------------------------------

    def alloc_host(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """A zeroed numpy array in pinned host memory (a HOST buffer object mapped into
        this process, like cudaHostAlloc): the fast way to feed the device.

        `Stream.upload` from such an array (or any C-contiguous view of one) is a single
        DMA_H2D straight out of it, with no staging copy. The DMA reads the array when
        the stream runs, so do not modify it until then (synchronize, or wait on an
        Event recorded after the upload). Free it with `free_host` (or close the
        device)."""
        self._check_open()
        shp = _shape(shape)
        dt = to_numpy_dtype(dtype)
        nbytes = max(1, int(np.prod(shp, dtype=np.int64)) * dt.itemsize)
        handle, iova = self._drv.bo_create(nbytes, uapi.BO_HOST)
        try:
            raw = self._drv.mmap(handle, nbytes)
        except BaseException:
            self._drv.bo_free(handle)
            raise
        n = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        arr = raw[:n].view(dt).reshape(shp)
        self._pinned.append((_address(raw), nbytes, handle, iova, arr))
        self._pinned_by_id[id(arr)] = (handle, iova)
        return arr

    def free_host(self, array: np.ndarray) -> None:
        """Free an array made by `alloc_host` (in-flight uploads keep its buffer alive)."""
        for i, p in enumerate(self._pinned):
            if p[4] is array:
                del self._pinned[i]
                del self._pinned_by_id[id(array)]
                if not self._closed:
                    self._drv.bo_free(p[2])
                return
        raise ValueError("free_host: not an array made by this device's alloc_host")

    def _pinned_iova(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(handle, iova) when `arr` is a C-contiguous view inside a pinned array."""
        if not self._pinned or not arr.flags.c_contiguous:
            return None
        hit = self._pinned_by_id.get(id(arr))
        if hit is not None:  # an array alloc_host returned (kept alive by _pinned)
            return hit
        ptr = _address(arr)
        for start, nbytes, handle, iova, _ in self._pinned:
            if start <= ptr and ptr + arr.nbytes <= start + nbytes:
                return handle, iova + (ptr - start)
        return None

    def stats(self) -> dict[str, int]:
        """Driver statistics (GET_STATS): submissions, commands, device time ..."""
        self._check_open()
        return self._drv.stats()

    def close(self) -> None:
        """Destroy every context and close the device file (idempotent)."""
        if self._closed:
            return
        try:
            for ctx in list(self.contexts):
                ctx.destroy()
            for p in self._pinned:
                self._drv.bo_free(p[2])
        finally:
            self._pinned = []
            self._pinned_by_id.clear()
            self._closed = True
            self._drv.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.contexts)} contexts"
        return f"<Device {self.path} {state}>"


class Buffer:
    """A device memory allocation with a shape and a VA-1 dtype.

    `addr` is the device address commands use; `handle` the driver's BO handle.
    """

    def __init__(self, context: Context, handle: int, addr: int,
                 shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.context = context
        self.handle = handle
        self.addr = addr
        self.shape = shape
        self.dtype = dtype
        self.dtype_name = dtype.name
        self.size = math.prod(shape)
        self.nbytes = self.size * dtype.itemsize
        self.isa_dtype: DType = isa_dtype(dtype)
        self.freed = False

    @property
    def ndim(self) -> int:
        return len(self.shape)


    def check_usable(self, context: Context, what: str) -> None:
        """Raise if this buffer is freed or belongs to another context than `context`."""
        if self.freed:
            raise UseAfterFreeError(f"{what}: {self!r} was freed")
        if self.context is not context:
            raise ContextMismatchError(
                f"{what}: {self!r} belongs to context {self.context.id}, "
                f"not to context {context.id}")
        context._check_alive(what)

    def free(self) -> None:
        """Release the device memory. Streams with unsubmitted commands that use the
        buffer are flushed first, so the driver keeps it alive until they finish."""
        if self.freed:
            raise UseAfterFreeError(f"{self!r} was already freed")
        self.context._free_buffer(self)

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return (f"<Buffer handle={self.handle} addr={self.addr:#x} "
                f"shape={self.shape} dtype={self.dtype}{state}>")


def _shape(shape: int | SupportsIndex | Sequence[int | SupportsIndex]) -> tuple[int, ...]:
    if isinstance(shape, (int, SupportsIndex)) and not isinstance(shape, bool):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        dims = tuple(shape)
    else:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, SupportsIndex)):
            raise TypeError(f"shape {shape!r}: dimension {d!r} is not an integer")
        v = operator.index(d)
        if v <= 0:
            raise ValueError(f"shape {shape!r}: every dimension must be >= 1")
        out.append(v)
    if not out:
        raise ValueError("shape () has no elements: device buffers need at least one")
    return tuple(out)


class Context:
    """A device context: buffers, streams and events live and die with it."""

    def __init__(self, device: Device, context_id: int) -> None:
        self.device = device
        self.id = context_id
        self._drv = device._drv
        self.destroyed = False
        self.buffers: dict[int, Buffer] = {}
        self.streams: list[Stream] = []
        self._ts_pages: list[tuple[int, int, np.ndarray]] = []  # (handle, iova, view)
        self._ts_free: list[tuple[int, int]] = []               # (page index, slot)

    def _check_alive(self, what: str = "context") -> None:
        if self.destroyed:
            raise UseAfterFreeError(f"{what}: context {self.id} was destroyed")

    # -- buffers -------------------------------------------------------------------

    def alloc(self, shape: int | Sequence[int], dtype: Any = np.float32) -> Buffer:
        """Allocate a device buffer (BO_DEVICE) of `shape` and a VA-1 `dtype`."""
        self._check_alive("alloc")
        dims = _shape(shape)
        dt = to_numpy_dtype(dtype)
        nbytes = math.prod(dims) * dt.itemsize
        mem = self.device.params.get("device_memory_size")
        if mem is not None and nbytes > mem:
            raise ValueError(f"alloc {dims} {dt}: {nbytes} bytes exceed the device memory "
                             f"of {mem} bytes")
        handle, addr = self._drv.bo_create(nbytes, uapi.BO_DEVICE)
        buf = Buffer(self, handle, addr, dims, dt)
        self.buffers[handle] = buf
        return buf

    def _free_buffer(self, buf: Buffer) -> None:
        for s in self.streams:
            if s._uses_unsubmitted(buf.handle):
                s.flush()
        self._drv.bo_free(buf.handle)
        buf.freed = True
        self.buffers.pop(buf.handle, None)

    # -- streams and events ------------------------------------------------------------

    def create_stream(self, queue: int = 0) -> Stream:
        """A stream on submit queue `queue` (0 .. num_submit_queues-1)."""
        from ._stream import Stream
        self._check_alive("create_stream")
        nq = self.device.params["num_submit_queues"]
        if isinstance(queue, bool) or not isinstance(queue, (int, SupportsIndex)) \
                or not 0 <= operator.index(queue) < nq:
            raise ValueError(f"queue {queue!r} does not exist: the device has {nq} submit "
                             f"queues (0 .. {nq - 1})")
        stream = Stream(self, operator.index(queue))
        self.streams.append(stream)
        return stream

    def _timestamp_slot(self) -> tuple[int, int, np.ndarray]:
        """(handle, iova, 8-byte view) of a free timestamp slot in a HOST page."""
        if not self._ts_free:
            handle, iova = self._drv.bo_create(TIMESTAMP_PAGE, uapi.BO_HOST)
            view = self._drv.mmap(handle, TIMESTAMP_PAGE)
            page = len(self._ts_pages)
            self._ts_pages.append((handle, iova, view))
            self._ts_free = [(page, s) for s in reversed(range(TIMESTAMP_PAGE // _TS_SIZE))]
        page, slot = self._ts_free.pop()
        handle, iova, view = self._ts_pages[page]
        off = slot * _TS_SIZE
        return handle, iova + off, view[off:off + _TS_SIZE]

    def synchronize(self) -> None:
        """Synchronize every stream of the context (raises the first DeviceError)."""
        self._check_alive("synchronize")
        for s in list(self.streams):
            s.synchronize()

    # -- lifetime -------------------------------------------------------------------

    def destroy(self) -> None:
        """Wait for in-flight work (without raising its errors), free every buffer,
        stream and timestamp page, and destroy the device context."""
        if self.destroyed:
            return
        first: BaseException | None = None
        for s in list(self.streams):
            try:
                s.destroy()
            except BaseException as e:  # keep releasing; report the first failure
                first = first or e
        for buf in list(self.buffers.values()):
            try:
                self._drv.bo_free(buf.handle)
            except BaseException as e:
                first = first or e
            buf.freed = True
        self.buffers.clear()
        for handle, _, _ in self._ts_pages:
            try:
                self._drv.bo_free(handle)
            except BaseException as e:
                first = first or e
        self._ts_pages.clear()
        self._ts_free.clear()
        self.destroyed = True
        if self in self.device.contexts:
            self.device.contexts.remove(self)
        self._drv.context_destroy(self.id)
        if first is not None:
            raise first

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = " destroyed" if self.destroyed else ""
        return f"<Context {self.id} buffers={len(self.buffers)} streams={len(self.streams)}{state}>"

