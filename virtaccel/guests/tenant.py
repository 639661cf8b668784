"""Tenant programs: guest user programs that run in each tenant VM of a multi-tenant host.

Every program reaches its VF only through the device file's uAPI (guest_driver.uapi),
as a user process would; the guest's monotonic clock (the kernel's virtual clock) times
submissions, so completion latency = the fence's device end time - the time of submit.

The workload is a *checked GEMM*: submission i uploads A_i (m x k) and B_i (k x n), runs
`reps` GEMMs C = A_i @ B_i on the device and downloads C_i. A_i and B_i hold small
integers (as f32) drawn from the tenant's seed, so every product is exact in f32 and
C_i's CRC-32 is bit-exact: the host computes the expected checksums with numpy
(`expected_checksums`) and compares them with what the guest reports.
"""
from __future__ import annotations

import errno
import struct
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from guest_driver import uapi as U
from hwspec import isa
from hwspec.va1 import Status
from userspace_runtime import DriverError, DriverFile, WaitResult
from userspace_runtime.commands import CommandBufferBuilder

INPUT_RANGE = 3   # inputs are integers in [-INPUT_RANGE, INPUT_RANGE]


# -- the checked GEMM, host side and guest side alike ---------------------------------------

def gemm_inputs(seed: int, index: int, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A (m x k) and B (k x n), small integers as float32, from (seed, index)."""
    rng = np.random.default_rng([seed & (2**63 - 1), index])
    a = rng.integers(-INPUT_RANGE, INPUT_RANGE + 1, size=(m, k)).astype(np.float32)
    b = rng.integers(-INPUT_RANGE, INPUT_RANGE + 1, size=(k, n)).astype(np.float32)
    return a, b


def checksum(c: np.ndarray) -> int:
    """CRC-32 of a float32 array's bytes."""
    return zlib.crc32(np.ascontiguousarray(c, dtype=np.float32).tobytes())


def expected_checksums(seed: int, count: int, m: int = 16, k: int = 32, n: int = 16
                       ) -> list[int]:
    """What a correct device gives for submissions 0..count-1 (numpy, exact in float64)."""
    out = []
    for i in range(count):
        a, b = gemm_inputs(seed, i, m, k, n)
        c = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
        out.append(checksum(c))
    return out


def guest_now(os_: Any) -> int:
    """The guest's monotonic clock (virtual ns)."""
    return int(os_.kernel.sched.now_ns())


# -- the uAPI, through the runtime's ioctl client ---------------------------------------------

def wait_signalled(drv: DriverFile, ctx: int, fence: int, timeout_ns: int = -1) -> WaitResult:
    """WAIT for `fence` of context `ctx`; a fence that has not signalled within
    `timeout_ns` is an OSError (ETIME), as every other refusal of the driver is."""
    r = drv.wait(ctx, fence, timeout_ns)
    if r is None:
        raise DriverError(errno.ETIME, f"WAIT(context={ctx}, fence={fence}) on {drv.path}: "
                                       f"not signalled within {timeout_ns} ns")
    return r


@dataclass
class _Slot:
    host: int
    host_iova: int
    view: np.ndarray
    dev: int
    dev_addr: int
    index: int = -1
    queue: int = 0
    fence: int = 0
    submit_ns: int = 0


@dataclass
class Report:
    """What a tenant program returns (JSON-able through as_dict)."""
    seed: int
    m: int
    k: int
    n: int
    checksums: list[int] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)
    device_ns: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        ok = bool(self.statuses) and all(s == "OK" for s in self.statuses) and not self.errors
        return {"ok": ok, "seed": self.seed, "shape": [self.m, self.k, self.n],
                "completions": len(self.statuses), "checksums": list(self.checksums),
                "statuses": list(self.statuses), "latencies_ns": list(self.latencies_ns),
                "device_ns": list(self.device_ns), "errors": list(self.errors)}


class CheckedGemm:
    """Keeps `depth` checked-GEMM submissions in flight on each of `queues`."""

    def __init__(self, acc: DriverFile, seed: int, m: int, k: int, n: int, reps: int,
                 queues: Sequence[int], depth: int) -> None:
        self.acc, self.seed, self.m, self.k, self.n, self.reps = acc, seed, m, k, n, reps
        self.queues = list(queues)
        self.ctx = acc.context_create()
        self.report = Report(seed, m, k, n)
        self.sa, self.sb, self.sc = m * k * 4, k * n * 4, m * n * 4
        self.slots: list[_Slot] = []
        for q in self.queues:
            for _ in range(depth):
                data = self.sa + self.sb + self.sc
                size = data + 64 * (3 + reps) + 64
                h, iova = acc.bo_create(size, U.BO_HOST)
                d, daddr = acc.bo_create(data, U.BO_DEVICE)
                self.slots.append(_Slot(h, iova, acc.mmap(h, size), d, daddr, queue=q))
        self.next_index = 0
        self.inflight: deque[_Slot] = deque()

    def _build(self, s: _Slot) -> tuple[int, int]:
        """Write the inputs and the command buffer of s.index into the slot: (offset, length)."""
        a, b = gemm_inputs(self.seed, s.index, self.m, self.k, self.n)
        v = s.view
        v[:self.sa] = a.view(np.uint8).reshape(-1)
        v[self.sa:self.sa + self.sb] = b.view(np.uint8).reshape(-1)
        da, db, dc = s.dev_addr, s.dev_addr + self.sa, s.dev_addr + self.sa + self.sb
        cb = CommandBufferBuilder()
        cb.dma_h2d(s.host_iova, da, self.sa + self.sb)
        for _ in range(self.reps):
            cb.gemm(dtype="F32", m=self.m, n=self.n, k=self.k, a=da, b=db, c=dc)
        cb.dma_d2h(dc, s.host_iova + self.sa + self.sb, self.sc)
        raw = cb.bytes()
        off = self.sa + self.sb + self.sc
        off = -(-off // 8) * 8
        v[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return off, len(raw)

    def submit(self, s: _Slot, now_ns: int) -> None:
        s.index = self.next_index
        self.next_index += 1
        off, length = self._build(s)
        s.submit_ns = now_ns
        s.fence = self.acc.submit(self.ctx, s.queue, s.host, off, length, (s.dev,))
        self.inflight.append(s)

    def reap(self, s: _Slot) -> None:
        r = self.report
        try:
            w = wait_signalled(self.acc, self.ctx, s.fence)
        except OSError as e:
            r.errors.append(f"wait fence {s.fence}: {e}")
            r.statuses.append("ERROR")
            return
        status = w.status
        name = Status(status).name if status in Status._value2member_map_ else str(status)
        r.statuses.append(name)
        r.latencies_ns.append(w.end_ns - s.submit_ns)
        r.device_ns.append(w.end_ns - w.start_ns)
        c = s.view[self.sa + self.sb:self.sa + self.sb + self.sc].view(np.float32)
        r.checksums.append(checksum(c) if status == Status.OK else -1)


def checked_gemm(os: Any, seed: int = 0, *, count: int | None = None, duration_ns: int = 0,
                 m: int = 16, k: int = 32, n: int = 16, reps: int = 1, queues: int = 1,
                 depth: int = 1, think_ns: int = 0, device: str = "/dev/accel/accel0"
                 ) -> dict[str, Any]:
    """The tenant workload: checked GEMM submissions, `depth` in flight on each of the
    first `queues` submit queues, until `count` were submitted (count > 0) or the guest
    clock passed `duration_ns` (duration > 0; count then defaults to no limit, else to
    4). `think_ns` of guest sleep between a completion and the next submit (0:
    saturating). Returns Report.as_dict()."""
    if count is None:
        count = 0 if duration_ns > 0 else 4
    if count <= 0 and duration_ns <= 0:
        raise ValueError("checked_gemm: give count > 0 or duration_ns > 0")
    acc = DriverFile.open(os, device)
    nq = min(max(1, queues), acc.get_param("num_submit_queues"))
    w = CheckedGemm(acc, seed, m, k, n, reps, range(nq), max(1, depth))
    t0 = guest_now(os)

    def more() -> bool:
        if count > 0 and w.next_index >= count:
            return False
        return not (duration_ns > 0 and guest_now(os) - t0 >= duration_ns)

    free = list(w.slots)
    while free and more():
        w.submit(free.pop(0), guest_now(os))
    while w.inflight:
        s = w.inflight.popleft()
        w.reap(s)
        if think_ns:
            os.kernel.sched.sleep(think_ns)
        if more():
            w.submit(s, guest_now(os))
    rep = w.report.as_dict()
    rep["start_ns"], rep["end_ns"] = t0, guest_now(os)
    acc.close()
    return rep


def victim(os: Any, seed: int = 0, count: int = 8, m: int = 16, k: int = 32, n: int = 16,
           reps: int = 1, think_ns: int = 0) -> dict[str, Any]:
    """A well-behaved tenant: `count` checked GEMMs one at a time (closed loop)."""
    return checked_gemm(os, seed, count=count, m=m, k=k, n=n, reps=reps, think_ns=think_ns)


def verify(result: Any, seed: int) -> bool:
    """Host side: the guest's checksums are numpy's and every submission was OK."""
    if not isinstance(result, dict) or not result.get("ok"):
        return False
    m, k, n = result["shape"]
    sums = result["checksums"]
    return bool(sums) and sums == expected_checksums(seed, len(sums), m, k, n)


# -- raw command words (opcodes the builder may not have) -----------------------------------

def wait_command(addr: int, value: int) -> bytes:
    """WAIT: poll the host u64 at `addr` until it is >= value."""
    layout = isa.PAYLOAD[isa.Opcode.WAIT]
    length = isa.HEADER.size + layout.size
    return struct.pack(isa.HEADER.format, isa.Opcode.WAIT, 0, length) + struct.pack(
        layout.format, addr, value)


def call_command(addr: int, size: int) -> bytes:
    layout = isa.PAYLOAD[isa.Opcode.CALL]
    length = isa.HEADER.size + layout.size
    return struct.pack(isa.HEADER.format, isa.Opcode.CALL, 0, length) + struct.pack(
        layout.format, addr, size, 0)


__all__ = ["CheckedGemm", "Report", "checked_gemm", "checksum", "call_command",
           "expected_checksums", "gemm_inputs", "guest_now", "verify", "victim",
           "wait_command", "wait_signalled", "errno"]


checked_gemm.verify = verify  # type: ignore[attr-defined]   # virtaccel.images checks results with it
victim.verify = verify  # type: ignore[attr-defined]
