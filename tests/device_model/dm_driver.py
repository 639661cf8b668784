"""A mock DRIVER side for device tests, written from the spec (virtio 1.x §2.7 and the
VA-1 datasheet), sharing no code with device_model: a split queue that lays out its rings
by hand, and a tiny VA-1 driver over the mmio transport."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from dm_fakes import FakeClock, FakeDma, FakeIrq, RecordingTracer

from device_model import DevicePorts, MmioTransport, Va1Config, Va1Device

# Numbers re-derived from the virtio spec on purpose (independent of device code).
NEXT, WRITE, INDIRECT = 1, 2, 4


class Bump:
    """Guest memory allocator."""

    def __init__(self, dma: FakeDma, start: int | None = None) -> None:
        self.dma = dma
        self.ptr = dma.base if start is None else start

    def alloc(self, size: int, align: int = 16) -> int:
        self.ptr = (self.ptr + align - 1) // align * align
        addr = self.ptr
        self.ptr += max(size, 1)
        assert self.ptr <= self.dma.base + self.dma.size, "test guest RAM exhausted"
        return addr


class MockSplitQueue:
    """Driver view of one split virtqueue in guest memory."""

    def __init__(self, dma: FakeDma, alloc: Bump, size: int) -> None:
        self.dma = dma
        self.size = size
        self.desc = alloc.alloc(16 * size, 16)
        self.avail = alloc.alloc(4 + 2 * size + 2, 2)
        self.used = alloc.alloc(4 + 8 * size + 2, 4)
        self.free = list(range(size))
        self.avail_idx = 0
        self.last_used = 0
        self.chains: dict[int, list[int]] = {}

    # layout offsets (virtio 1.x §2.7): used_event after avail ring, avail_event after used
    @property
    def used_event_addr(self) -> int:
        return self.avail + 4 + 2 * self.size

    @property
    def avail_event_addr(self) -> int:
        return self.used + 4 + 8 * self.size

    def w16(self, addr: int, v: int) -> None:
        self.dma.g_write(addr, struct.pack("<H", v & 0xFFFF))

    def r16(self, addr: int) -> int:
        return int(struct.unpack("<H", self.dma.g_read(addr, 2))[0])

    def write_desc(self, table: int, i: int, addr: int, length: int, flags: int,
                   nxt: int) -> None:
        self.dma.g_write(table + 16 * i, struct.pack("<QIHH", addr, length, flags, nxt))

    def add(self, bufs: list[tuple[int, int, bool]], indirect_table: int | None = None) -> int:
        """Make a chain of (addr, len, device_writable) available; returns its head."""
        if indirect_table is not None:
            for i, (a, n, w) in enumerate(bufs):
                fl = (WRITE if w else 0) | (NEXT if i + 1 < len(bufs) else 0)
                self.write_desc(indirect_table, i, a, n, fl, i + 1)
            head = self.free.pop(0)
            self.write_desc(self.desc, head, indirect_table, 16 * len(bufs), INDIRECT, 0)
            self.chains[head] = [head]
        else:
            idxs = [self.free.pop(0) for _ in bufs]
            for j, (i, (a, n, w)) in enumerate(zip(idxs, bufs)):
                nxt = idxs[j + 1] if j + 1 < len(idxs) else 0
                fl = (WRITE if w else 0) | (NEXT if j + 1 < len(idxs) else 0)
                self.write_desc(self.desc, i, a, n, fl, nxt)
            head = idxs[0]
            self.chains[head] = idxs
        self.publish_head(head)
        return head

    def publish_head(self, head: int) -> None:
        self.w16(self.avail + 4 + 2 * (self.avail_idx % self.size), head)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        self.w16(self.avail + 2, self.avail_idx)

    def used_idx(self) -> int:
        return self.r16(self.used + 2)

    def pop_used(self) -> tuple[int, int] | None:
        if self.last_used == self.used_idx():
            return None
        slot = self.last_used % self.size
        hid, ln = struct.unpack("<II", self.dma.g_read(self.used + 4 + 8 * slot, 8))
        self.last_used = (self.last_used + 1) & 0xFFFF
        self.free.extend(self.chains.pop(hid))
        return int(hid), int(ln)


# --- VA-1 over mmio ---------------------------------------------------------------------

ACK, DRV, DRV_OK, FEAT_OK, NEEDS_RESET = 1, 2, 4, 8, 0x40


@dataclass
class Resp:
    status: int
    error_offset: int
    fence: int
    start_ns: int
    end_ns: int


def fake_va1(config: Va1Config | None, ram: int
             ) -> tuple[FakeDma, FakeClock, RecordingTracer, Va1Config, Va1Device]:
    """A Va1Device (default config unless `config`) on fake ports with `ram` bytes of
    DMA memory: (dma, clock, tracer, config, device)."""
    dma, clock, tracer = FakeDma(size=ram), FakeClock(), RecordingTracer()
    config = config or Va1Config()
    dev = Va1Device(config, DevicePorts(dma=dma, clock=clock, tracer=tracer))
    return dma, clock, tracer, config, dev


class Rig:
    """Fake platform + device + transport + a minimal VA-1 driver."""

    def __init__(self, config: Va1Config | None = None, features: int | None = None,
                 qsize: int = 16, ram: int = 8 << 20) -> None:
        self.dma, self.clock, self.tracer, self.config, self.dev = fake_va1(config, ram)
        self.irq = FakeIrq()
        self.mmio = MmioTransport(self.dev, irq=self.irq, tracer=self.tracer)
        self.alloc = Bump(self.dma)
        self.qsize = qsize
        self.features = features
        self.queues: list[MockSplitQueue] = []
        self.init()

    def r(self, off: int) -> int:
        return self.mmio.read(off, 4)

    def w(self, off: int, v: int) -> None:
        self.mmio.write(off, 4, v)

    def offered(self) -> int:
        self.w(0x14, 0)
        lo = self.r(0x10)
        self.w(0x14, 1)
        return lo | self.r(0x10) << 32

    def init(self) -> None:
        self.w(0x70, 0)
        self.w(0x70, ACK)
        self.w(0x70, ACK | DRV)
        feats = self.offered() if self.features is None else self.features
        self.w(0x24, 0)
        self.w(0x20, feats & 0xFFFFFFFF)
        self.w(0x24, 1)
        self.w(0x20, feats >> 32)
        self.w(0x70, ACK | DRV | FEAT_OK)
        assert self.r(0x70) & FEAT_OK
        nq = 2 + self.r(0x100)
        self.queues = []
        for i in range(nq):
            q = MockSplitQueue(self.dma, self.alloc, self.qsize)
            self.w(0x30, i)
            self.w(0x38, self.qsize)
            for lo, addr in ((0x80, q.desc), (0x90, q.avail), (0xA0, q.used)):
                self.w(lo, addr & 0xFFFFFFFF)
                self.w(lo + 4, addr >> 32)
            self.w(0x44, 1)
            self.queues.append(q)
        self.w(0x70, ACK | DRV | FEAT_OK | DRV_OK)
        assert self.r(0x70) == ACK | DRV | FEAT_OK | DRV_OK
        self.vio_before = len(self.mmio.violations)

    def ack_irq(self) -> int:
        st = self.r(0x60)
        self.w(0x64, st)
        return st

    # controlq
    def ctrl(self, type_: int, ctx: int = 0, flags: int = 0, reserved: int = 0,
             resp_len: int = 8) -> bytes:
        q = self.queues[0]
        req = self.alloc.alloc(16)
        resp = self.alloc.alloc(resp_len)
        self.dma.g_write(req, struct.pack("<IIII", type_, ctx, flags, reserved))
        q.add([(req, 16, False), (resp, resp_len, True)])
        self.w(0x50, 0)
        self.clock.run()
        got = q.pop_used()
        assert got is not None
        return self.dma.g_read(resp, got[1])

    def create_context(self, flat: bool = True) -> int:
        """CONTEXT_CREATE; FLAT (flags bit 0: VA = PA over the whole function memory)
        unless `flat=False` (a private address space, empty until CONTEXT_MAP)."""
        st, cid = struct.unpack("<II", self.ctrl(1, flags=1 if flat else 0))
        assert st == 0
        return int(cid)

    def destroy_context(self, cid: int) -> int:
        st, _ = struct.unpack("<II", self.ctrl(2, cid))
        return int(st)

    def stats(self) -> tuple[int, ...]:
        return struct.unpack("<IIQQQQQ", self.ctrl(3, resp_len=48))

    # submit
    def put(self, data: bytes, align: int = 64) -> int:
        addr = self.alloc.alloc(len(data), align)
        self.dma.g_write(addr, data)
        return addr

    def submit_nowait(self, ctx: int, cmdbuf: bytes | None, fence: int = 1, queue: int = 2,
                      addr: int | None = None, length: int | None = None, flags: int = 0,
                      reserved: int = 0) -> int:
        """Post a submission; returns the response address."""
        q = self.queues[queue]
        if addr is None:
            assert cmdbuf is not None
            addr = self.put(cmdbuf)
        if length is None:
            assert cmdbuf is not None
            length = len(cmdbuf)
        req = self.alloc.alloc(32)
        resp = self.alloc.alloc(32)
        self.dma.g_write(req, struct.pack("<IIQIIQ", ctx, flags, addr, length, reserved,
                                          fence))
        q.add([(req, 32, False), (resp, 32, True)])
        return resp

    def kick(self, queue: int = 2) -> None:
        self.w(0x50, queue)

    def resp(self, addr: int) -> Resp:
        return Resp(*struct.unpack("<IIQQQ", self.dma.g_read(addr, 32)))

    def submit(self, ctx: int, cmdbuf: bytes, fence: int = 1, queue: int = 2,
               **kw: int) -> Resp:
        r = self.submit_nowait(ctx, cmdbuf, fence, queue, **kw)
        self.kick(queue)
        self.clock.run()
        got = self.queues[queue].pop_used()
        assert got is not None and got[1] == 32, got
        return self.resp(r)

    def post_event_buffer(self, size: int = 24) -> int:
        buf = self.alloc.alloc(size)
        self.queues[1].add([(buf, size, True)])
        self.w(0x50, 1)
        return buf


# --- command encoders (from the ISA table) -----------------------------------------------

def hdr(op: int, length: int, flags: int = 0) -> bytes:
    return struct.pack("<HHI", op, flags, length)


def nop(length: int = 8) -> bytes:
    return hdr(0, length) + bytes(length - 8)


def fill(dst: int, size: int, pattern: int, reserved: int = 0) -> bytes:
    return hdr(1, 32) + struct.pack("<QQII", dst, size, pattern, reserved)


def h2d(src: int, dst: int, size: int) -> bytes:
    return hdr(2, 32) + struct.pack("<QQQ", src, dst, size)


def d2h(src: int, dst: int, size: int) -> bytes:
    return hdr(3, 32) + struct.pack("<QQQ", src, dst, size)


def d2d(src: int, dst: int, size: int) -> bytes:
    return hdr(4, 32) + struct.pack("<QQQ", src, dst, size)


def gemm(m: int, n: int, k: int, a: int, b: int, c: int, bias: int = 0, alpha: float = 1.0,
         beta: float = 0.0, dtype: int = 0, act: int = 0, flags: int = 0,
         reserved: int = 0) -> bytes:
    return hdr(0x10, 64, flags) + struct.pack("<BBHIIIQQQQff", dtype, act, reserved, m, n, k,
                                              a, b, c, bias, alpha, beta)


def eltwise(op: int, dtype: int, count: int, a: int, b: int, out: int, reserved: int = 0,
            reserved2: int = 0) -> bytes:
    return hdr(0x11, 48) + struct.pack("<BBHIQQQQ", op, dtype, reserved, reserved2, count, a,
                                       b, out)


def signal(addr: int, value: int) -> bytes:
    return hdr(0x20, 24) + struct.pack("<QQ", addr, value)


def timestamp(addr: int) -> bytes:
    return hdr(0x21, 16) + struct.pack("<Q", addr)
