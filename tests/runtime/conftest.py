"""Test doubles for the runtime: a fake accel device file that records every ioctl.

The fake checks uAPI arguments the way a driver would (known handles, HOST command
buffers, live contexts) and, when a submission "runs", moves bytes for the data-movement
commands (DMA, FILL, SIGNAL, TIMESTAMP) so uploads and downloads can be checked end to
end. It does no compute: GEMM and ELEMENTWISE leave memory untouched. Commands are
decoded here with `struct` straight from the hwspec layouts, independently of the
runtime's own encoder/decoder.
"""
from __future__ import annotations

import errno
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

from guest_driver import uapi
from hwspec import isa, va1
from hwspec.isa import Opcode

sys.path.insert(0, os.path.dirname(__file__))  # this directory's helper modules (rt_*.py)

REQUEST_NAMES = {v: k[len("DRM_IOCTL_VA1_"):] for k, v in vars(uapi).items()
                 if k.startswith("DRM_IOCTL_VA1_")}
HOST_IOVA_BASE = 0x4000_0000


def raw_decode(data: bytes) -> list[dict[str, Any]]:
    """Decode a command buffer field by field with struct, from hwspec layouts only."""
    out = []
    pos = 0
    while pos < len(data):
        hdr = {name: struct.unpack_from("<" + code, data, pos + isa.HEADER.offsets[name])[0]
               for name, code in isa.HEADER.fields}
        cmd: dict[str, Any] = {"offset": pos, **hdr}
        layout = isa.PAYLOAD.get(hdr["opcode"])
        if layout is not None:
            base = pos + isa.HEADER.size
            for name, code in layout.fields:
                cmd[name] = struct.unpack_from("<" + code, data, base + layout.offsets[name])[0]
        assert hdr["length"] >= isa.HEADER.size
        out.append(cmd)
        pos += hdr["length"]
    return out


@dataclass
class FakeBO:
    handle: int
    flags: int
    size: int
    addr: int
    mem: np.ndarray | None = None  # HOST buffers only


@dataclass
class FakeSubmission:
    context_id: int
    queue: int
    cmdbuf: bytes
    handles: list[int]
    fence: int
    commands: list[dict[str, Any]] = field(default_factory=list)
    result: tuple[int, int, int, int] | None = None  # status, error_offset, start, end


DeviceHook = Callable[["FakeDeviceFile", FakeSubmission], "tuple[int, int] | None"]


class FakeDeviceFile:
    """Records ioctls; see module docstring for what it does and does not emulate."""

    CMD_NS = 100  # fake duration of every command

    def __init__(self, *, mem_size: int = 32 << 20, max_cmdbuf: int = 1 << 20,
                 num_queues: int = 2, dtype_mask: int = 0b11,
                 features: int = (1 << va1.F_FP16) | (1 << va1.F_TIMESTAMP)) -> None:
        self.param_values = {
            uapi.PARAM_DEVICE_MEMORY_SIZE: mem_size,
            uapi.PARAM_NUM_SUBMIT_QUEUES: num_queues,
            uapi.PARAM_NUM_COMPUTE_UNITS: 4,
            uapi.PARAM_ISA_VERSION: va1.ISA_VERSION,
            uapi.PARAM_DTYPE_MASK: dtype_mask,
            uapi.PARAM_MAX_CMDBUF_SIZE: max_cmdbuf,
            uapi.PARAM_PEAK_FLOPS: 50 * 10**12,
            uapi.PARAM_MEM_BANDWIDTH: 10**12,
            uapi.PARAM_LINK_BANDWIDTH: 32 * 10**9,
            uapi.PARAM_CMD_OVERHEAD_NS: 500,
            uapi.PARAM_MAX_CONTEXTS: 64,
            uapi.PARAM_FEATURES: features,
            uapi.PARAM_SCRATCHPAD_SIZE: 1 << 20,
            uapi.PARAM_MAX_CALL_DEPTH: 8,
        }
        self.device_mem = np.zeros(mem_size, np.uint8)
        self.bos: dict[int, FakeBO] = {}
        self.freed: list[int] = []
        self.contexts: set[int] = set()
        self.log: list[str] = []
        self.submissions: list[FakeSubmission] = []
        self.fail: dict[str, int] = {}       # request name -> errno to raise once
        self.hook: DeviceHook | None = None  # may return (status, error_offset)
        self.hold = False                    # True: submissions run only on a blocking WAIT
        self.clock = 1_000
        self.closed = False
        self._next_handle = 1
        self._next_iova = HOST_IOVA_BASE
        self._next_dev = 0
        self._next_ctx = 1
        self._fences: dict[int, int] = {}

    # -- DeviceFile -------------------------------------------------------------------

    def ioctl(self, request: int, arg: Any) -> None:
        name = REQUEST_NAMES[request]
        assert uapi.ffi.typeof(arg) is uapi.ffi.typeof(uapi.IOCTL_STRUCT[request] + " *")
        self.log.append(name)
        if name in self.fail:
            code = self.fail.pop(name)
            raise OSError(code, errno.errorcode.get(code, "error"))
        getattr(self, "_" + name.lower())(arg)

    def mmap(self, handle: int) -> np.ndarray:
        bo = self.bos.get(handle)
        if bo is None or bo.mem is None:
            raise OSError(errno.EINVAL, "not a HOST buffer")
        return bo.mem

    def close(self) -> None:
        self.closed = True

    # -- ioctls ---------------------------------------------------------------------

    def _get_param(self, arg: Any) -> None:
        if arg.param not in self.param_values:
            raise OSError(errno.EINVAL, "bad param")
        arg.value = self.param_values[arg.param]

    def _bo_create(self, arg: Any) -> None:
        size, flags = int(arg.size), int(arg.flags)
        if size == 0 or flags not in (uapi.BO_DEVICE, uapi.BO_HOST):
            raise OSError(errno.EINVAL, "bad size/flags")
        h = self._next_handle
        self._next_handle += 1
        if flags == uapi.BO_HOST:
            bo = FakeBO(h, flags, size, self._next_iova, np.zeros(size, np.uint8))
            self._next_iova += (size + 0xFFF) & ~0xFFF
        else:
            if self._next_dev + size > self.device_mem.size:
                raise OSError(errno.ENOMEM, "out of device memory")
            bo = FakeBO(h, flags, size, self._next_dev)
            self._next_dev += (size + 255) & ~255
        self.bos[h] = bo
        arg.handle = h
        arg.addr = bo.addr

    def _bo_free(self, arg: Any) -> None:
        if arg.handle not in self.bos:
            raise OSError(errno.ENOENT, "no such buffer")
        del self.bos[arg.handle]
        self.freed.append(int(arg.handle))

    def _context_create(self, arg: Any) -> None:
        assert arg.flags == 0
        cid = self._next_ctx
        self._next_ctx += 1
        self.contexts.add(cid)
        arg.context_id = cid

    def _context_destroy(self, arg: Any) -> None:
        if arg.context_id not in self.contexts:
            raise OSError(errno.ENOENT, "no such context")
        self.contexts.remove(arg.context_id)

    def _submit(self, arg: Any) -> None:
        if arg.context_id not in self.contexts:
            raise OSError(errno.ENOENT, "no such context")
        if arg.queue >= self.param_values[uapi.PARAM_NUM_SUBMIT_QUEUES]:
            raise OSError(errno.EINVAL, "bad queue")
        bo = self.bos.get(arg.cmdbuf_handle)
        if bo is None or bo.mem is None:
            raise OSError(errno.EINVAL, "cmdbuf is not a HOST buffer")
        off, size = int(arg.cmdbuf_offset), int(arg.cmdbuf_size)
        if size == 0 or size % 8 or off + size > bo.size:
            raise OSError(errno.EINVAL, "bad cmdbuf range")
        if size > self.param_values[uapi.PARAM_MAX_CMDBUF_SIZE]:
            raise OSError(errno.E2BIG, "cmdbuf too large")
        n = int(arg.buffer_count)
        if n > uapi.MAX_SUBMIT_BUFFERS:
            raise OSError(errno.EINVAL, "too many buffers")
        handles = [int(arg.handles[i]) for i in range(n)]
        for h in handles:
            if h not in self.bos:
                raise OSError(errno.ENOENT, f"no buffer {h}")
        fence = self._fences.get(arg.context_id, 0) + 1
        self._fences[arg.context_id] = fence
        data = bytes(bo.mem[off:off + size])
        sub = FakeSubmission(int(arg.context_id), int(arg.queue), data, handles, fence,
                             raw_decode(data))
        self.submissions.append(sub)
        arg.fence_seq = fence
        if not self.hold:
            self.run(sub)

    def _wait(self, arg: Any) -> None:
        sub = next((s for s in self.submissions
                    if s.context_id == arg.context_id and s.fence == arg.fence_seq), None)
        if sub is None:
            raise OSError(errno.EINVAL, "no such fence")
        if sub.result is None:
            if arg.timeout_ns == 0:
                raise OSError(errno.ETIME, "timer expired")
            self.run_pending()
        assert sub.result is not None
        arg.status, arg.error_offset, arg.start_ns, arg.end_ns = sub.result

    def _get_stats(self, arg: Any) -> None:
        arg.submissions = len(self.submissions)
        arg.commands = sum(len(s.commands) for s in self.submissions)

    # -- the pretend device -------------------------------------------------------------

    def run_pending(self) -> None:
        for s in self.submissions:
            if s.result is None:
                self.run(s)

    def host(self, iova: int, size: int) -> np.ndarray:
        for bo in self.bos.values():
            if bo.mem is not None and bo.addr <= iova and iova + size <= bo.addr + bo.size:
                return bo.mem[iova - bo.addr:iova - bo.addr + size]
        raise AssertionError(f"IOVA range {iova:#x}+{size} is not in any HOST buffer")

    def run(self, sub: FakeSubmission) -> None:
        start = self.clock
        status, off = 0, va1.NO_OFFSET
        if self.hook is not None:
            r = self.hook(self, sub)
            if r is not None:
                status, off = r
        if status == 0:
            t = start
            for c in sub.commands:
                self._move(c, t)
                t += self.CMD_NS
        self.clock = start + self.CMD_NS * len(sub.commands)
        sub.result = (status, off, start, self.clock)

    def _move(self, c: dict[str, Any], t: int) -> None:
        op, dev = c["opcode"], self.device_mem
        if op == Opcode.DMA_H2D:
            dev[c["dst"]:c["dst"] + c["size"]] = self.host(c["src"], c["size"])
        elif op == Opcode.DMA_D2H:
            self.host(c["dst"], c["size"])[:] = dev[c["src"]:c["src"] + c["size"]]
        elif op == Opcode.DMA_D2D:
            dev[c["dst"]:c["dst"] + c["size"]] = dev[c["src"]:c["src"] + c["size"]].copy()
        elif op == Opcode.FILL:
            pat = np.frombuffer(struct.pack("<I", c["pattern"]), np.uint8)
            dev[c["dst"]:c["dst"] + c["size"]] = np.tile(pat, c["size"] // 4)
        elif op == Opcode.TIMESTAMP:
            self.host(c["addr"], 8)[:] = np.frombuffer(struct.pack("<Q", t), np.uint8)
        elif op == Opcode.SIGNAL:
            self.host(c["addr"], 8)[:] = np.frombuffer(struct.pack("<Q", c["value"]), np.uint8)


class FakeOS:
    def __init__(self, **kwargs: Any) -> None:
        self.files: dict[str, FakeDeviceFile] = {}
        self.kwargs = kwargs

    @property
    def file(self) -> FakeDeviceFile:
        return self.files["/dev/accel/accel0"]

    def open(self, path: str) -> FakeDeviceFile:
        if not path.startswith("/dev/accel/accel") or path.endswith("9"):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        f = self.files.setdefault(path, FakeDeviceFile(**self.kwargs))
        f.closed = False
        return f


@pytest.fixture
def fake_os() -> FakeOS:
    return FakeOS()


@pytest.fixture
def make_os() -> Callable[..., FakeOS]:
    return FakeOS


@pytest.fixture(name="raw_decode")
def raw_decode_fixture() -> Callable[[bytes], list[dict[str, Any]]]:
    return raw_decode
