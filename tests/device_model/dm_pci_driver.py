"""A mock DRIVER side of virtio-pci for device tests, written from the PCI and virtio 1.x
specs (§4.1) with its numbers re-typed on purpose: it shares no code with device_model
or hwspec, so a wrong number on the device side cannot hide behind the same number here.

It walks the capability list from config space, sizes and places BAR0, finds the virtio
structures, programs MSI-X and brings a VA-1 up over the split queues of dm_driver."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from dm_driver import ACK, DRV, DRV_OK, FEAT_OK, Bump, MockSplitQueue, Resp, fake_va1
from dm_fakes import FakeIrq

from device_model import Va1Config, VirtioPciFunction

# PCI config header / capabilities (PCI Local Bus 3.0, PCIe base spec)
CMD, STATUS, CAP_PTR, BAR0 = 0x04, 0x06, 0x34, 0x10
CMD_MEM, CMD_MASTER, CMD_INTX_OFF = 0x2, 0x4, 0x400
ST_CAP_LIST, ST_INTX = 0x10, 0x08
CAP_VNDR, CAP_MSIX, CAP_EXP = 0x09, 0x11, 0x10
MSIX_ENABLE, MSIX_MASKALL = 0x8000, 0x4000
# virtio_pci_cap cfg_type (virtio 1.x §4.1.4)
COMMON, NOTIFY, ISR, DEVICE, PCI_CFG = 1, 2, 3, 4, 5
# virtio_pci_common_cfg offsets (virtio 1.x §4.1.4.3)
DFSEL, DF, GFSEL, GF, MSIX_CFG, NUMQ, DSTATUS, CFGGEN = 0, 4, 8, 12, 16, 18, 20, 21
QSEL, QSIZE, QMSIX, QENABLE, QNOFF = 22, 24, 26, 28, 30
QDESC, QAVAIL, QUSED = 32, 40, 48
NO_VECTOR = 0xFFFF
BAR0_ADDR = 0xE000_0000
MSI_ADDR = 0xFEE0_0000


class RecordingMsi:
    """An MsiPort that records every (address, data) message."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def send(self, address: int, data: int) -> None:
        self.sent.append((address, data))


@dataclass(frozen=True)
class VirtioCap:
    at: int            # config-space offset of the capability
    cap_len: int
    cfg_type: int
    bar: int
    offset: int
    length: int
    extra: int         # notify_off_multiplier for NOTIFY; 0 otherwise


class PciDriver:
    """Config-space and BAR accessors plus discovery of one virtio-pci function."""

    def __init__(self, fn: VirtioPciFunction) -> None:
        self.fn = fn

    def cr(self, off: int, size: int = 4) -> int:
        return self.fn.config_read(off, size)

    def cw(self, off: int, size: int, v: int) -> None:
        self.fn.config_write(off, size, v)

    def caps(self) -> list[tuple[int, int]]:
        """(cap id, offset) for every standard capability, walking from 0x34."""
        assert self.cr(STATUS, 2) & ST_CAP_LIST
        out: list[tuple[int, int]] = []
        off = self.cr(CAP_PTR, 1) & 0xFC
        while off:
            assert 0x40 <= off < 0x100 and len(out) < 48, off
            out.append((self.cr(off, 1), off))
            off = self.cr(off + 1, 1) & 0xFC
        return out

    def cap(self, cap_id: int) -> int:
        return next(o for i, o in self.caps() if i == cap_id)

    def virtio_caps(self) -> dict[int, VirtioCap]:
        found: dict[int, VirtioCap] = {}
        for cid, off in self.caps():
            if cid != CAP_VNDR:
                continue
            cap_len, cfg_type, bar = self.cr(off + 2, 1), self.cr(off + 3, 1), self.cr(off + 4, 1)
            extra = self.cr(off + 16, 4) if cfg_type == NOTIFY else 0
            found.setdefault(cfg_type, VirtioCap(off, cap_len, cfg_type, bar,
                                                 self.cr(off + 8, 4), self.cr(off + 12, 4),
                                                 extra))
        return found

    def size_bar(self, index: int) -> tuple[int, bool]:
        """The BAR sizing protocol; returns (size, is_64bit) and restores the BAR."""
        reg = BAR0 + 4 * index
        lo = self.cr(reg)
        self.cw(reg, 4, 0xFFFF_FFFF)
        mask = self.cr(reg)
        self.cw(reg, 4, lo)
        is64 = (mask & 0x6) == 0x4
        mask &= ~0xF
        if is64:
            hi = self.cr(reg + 4)
            self.cw(reg + 4, 4, 0xFFFF_FFFF)
            mask |= self.cr(reg + 4) << 32
            self.cw(reg + 4, 4, hi)
            return ((~mask) & (2**64 - 1)) + 1, True
        return ((~mask) & 0xFFFF_FFFF) + 1, False

    def enable(self) -> None:
        self.cw(BAR0, 4, BAR0_ADDR & 0xFFFF_FFFF)
        self.cw(BAR0 + 4, 4, BAR0_ADDR >> 32)
        self.cw(CMD, 2, CMD_MEM | CMD_MASTER)


class PciRig(PciDriver):
    """Fake platform + Va1Device + VirtioPciFunction + a minimal VA-1 driver over
    virtio-pci with one MSI-X vector per queue (vector i+1 for queue i, 0 for config)."""

    def __init__(self, config: Va1Config | None = None, features: int | None = None,
                 qsize: int = 16, ram: int = 8 << 20, msix: bool = True,
                 intx: bool = False, event_idx: bool = True) -> None:
        """`event_idx=False` declines RING_EVENT_IDX, so every used buffer interrupts
        (this mock driver never moves used_event)."""
        self.dma, self.clock, self.tracer, self.config, self.dev = fake_va1(config, ram)
        self.msi = RecordingMsi()
        self.irq = FakeIrq()
        super().__init__(VirtioPciFunction(self.dev, self.msi, tracer=self.tracer,
                                           intx=self.irq if intx else None))
        self.alloc = Bump(self.dma)
        self.qsize = qsize
        self.features = features
        self.event_idx = event_idx
        self.queues: list[MockSplitQueue] = []
        self.use_msix = msix
        self.enable()
        self.vcaps = self.virtio_caps()
        self.common = self.vcaps[COMMON].offset
        if msix:
            self.setup_msix()
        self.init()

    # BAR accessors (the rig only uses BAR0, checked by the tests)
    def br(self, off: int, size: int) -> int:
        return self.fn.bar_read(0, off, size)

    def bw(self, off: int, size: int, v: int) -> None:
        self.fn.bar_write(0, off, size, v)

    def c8(self, off: int) -> int:
        return self.br(self.common + off, 1)

    def c16(self, off: int) -> int:
        return self.br(self.common + off, 2)

    def c32(self, off: int) -> int:
        return self.br(self.common + off, 4)

    def w8(self, off: int, v: int) -> None:
        self.bw(self.common + off, 1, v)

    def w16(self, off: int, v: int) -> None:
        self.bw(self.common + off, 2, v)

    def w32(self, off: int, v: int) -> None:
        self.bw(self.common + off, 4, v)

    def msix_table(self) -> tuple[int, int, int, int]:
        """(cap offset, table size, table BAR offset, PBA BAR offset)."""
        cap = self.cap(CAP_MSIX)
        ctrl = self.cr(cap + 2, 2)
        table, pba = self.cr(cap + 4), self.cr(cap + 8)
        assert table & 7 == 0 and pba & 7 == 0  # both in BAR0
        return cap, (ctrl & 0x7FF) + 1, table & ~7, pba & ~7

    @staticmethod
    def msg(vector: int) -> tuple[int, int]:
        return MSI_ADDR | (vector << 4), 0x40 + vector

    def setup_msix(self) -> None:
        cap, n, table, _ = self.msix_table()
        for v in range(n):
            addr, data = self.msg(v)
            self.bw(table + 16 * v, 4, addr)
            self.bw(table + 16 * v + 4, 4, 0)
            self.bw(table + 16 * v + 8, 4, data)
            self.bw(table + 16 * v + 12, 4, 0)   # unmask
        self.cw(cap + 2, 2, MSIX_ENABLE)

    def offered(self) -> int:
        self.w32(DFSEL, 0)
        lo = self.c32(DF)
        self.w32(DFSEL, 1)
        return lo | self.c32(DF) << 32

    def reset_and_ack(self) -> None:
        """Status 0, then ACKNOWLEDGE and DRIVER."""
        self.w8(DSTATUS, 0)
        self.w8(DSTATUS, ACK)
        self.w8(DSTATUS, ACK | DRV)

    def accept_features(self, feats: int) -> None:
        """Write both driver feature words and set FEATURES_OK (which must stick)."""
        self.w32(GFSEL, 0)
        self.w32(GF, feats & 0xFFFFFFFF)
        self.w32(GFSEL, 1)
        self.w32(GF, feats >> 32)
        self.w8(DSTATUS, ACK | DRV | FEAT_OK)
        assert self.c8(DSTATUS) & FEAT_OK

    def setup_queue(self, index: int, vector: int | None,
                    check_vector: bool = False) -> MockSplitQueue:
        """A new ring for queue `index`: size, MSI-X `vector` (read back if
        `check_vector`), the three addresses, enable."""
        q = MockSplitQueue(self.dma, self.alloc, self.qsize)
        self.w16(QSEL, index)
        assert self.c16(QSIZE) > 0
        self.w16(QSIZE, self.qsize)
        if vector is not None:
            self.w16(QMSIX, vector)
            if check_vector:
                assert self.c16(QMSIX) == vector
        for off, addr in ((QDESC, q.desc), (QAVAIL, q.avail), (QUSED, q.used)):
            self.w32(off, addr & 0xFFFFFFFF)
            self.w32(off + 4, addr >> 32)
        self.w16(QENABLE, 1)
        return q

    def init(self) -> None:
        self.reset_and_ack()
        feats = self.offered() if self.features is None else self.features
        if not self.event_idx:
            feats &= ~(1 << 29)
        self.accept_features(feats)
        if self.use_msix:
            self.w16(MSIX_CFG, 0)
            assert self.c16(MSIX_CFG) == 0
        nq = self.c16(NUMQ)
        self.queues = []
        for i in range(nq):
            self.queues.append(self.setup_queue(i, i + 1 if self.use_msix else None,
                                                check_vector=True))
        self.w8(DSTATUS, ACK | DRV | FEAT_OK | DRV_OK)
        assert self.c8(DSTATUS) == ACK | DRV | FEAT_OK | DRV_OK
        self.vio_before = len(self.fn.violations)

    def notify_addr(self, queue: int) -> int:
        self.w16(QSEL, queue)
        return self.vcaps[NOTIFY].offset + self.c16(QNOFF) * self.vcaps[NOTIFY].extra

    def kick(self, queue: int = 2) -> None:
        self.bw(self.notify_addr(queue), 2, queue)

    def dev_cfg(self, off: int, size: int = 4) -> int:
        return self.br(self.vcaps[DEVICE].offset + off, size)

    # controlq / submit, as dm_driver.Rig does over mmio
    def ctrl(self, type_: int, ctx: int = 0, resp_len: int = 8, flags: int = 0,
             extra: bytes = b"") -> bytes:
        q = self.queues[0]
        req = self.alloc.alloc(16 + len(extra))
        resp = self.alloc.alloc(resp_len)
        self.dma.g_write(req, struct.pack("<IIII", type_, ctx, flags, 0) + extra)
        q.add([(req, 16 + len(extra), False), (resp, resp_len, True)])
        self.kick(0)
        self.clock.run()
        got = q.pop_used()
        assert got is not None
        return self.dma.g_read(resp, got[1])

    def create_context(self, flat: bool = True) -> int:
        st, cid = struct.unpack("<II", self.ctrl(1, flags=1 if flat else 0))
        assert st == 0
        return int(cid)

    def put(self, data: bytes, align: int = 64) -> int:
        addr = self.alloc.alloc(len(data), align)
        self.dma.g_write(addr, data)
        return addr

    def submit_nowait(self, ctx: int, cmdbuf: bytes, fence: int = 1, queue: int = 2) -> int:
        q = self.queues[queue]
        addr = self.put(cmdbuf)
        req = self.alloc.alloc(32)
        resp = self.alloc.alloc(32)
        self.dma.g_write(req, struct.pack("<IIQIIQ", ctx, 0, addr, len(cmdbuf), 0, fence))
        q.add([(req, 32, False), (resp, 32, True)])
        return resp

    def submit(self, ctx: int, cmdbuf: bytes, fence: int = 1, queue: int = 2) -> Resp:
        r = self.submit_nowait(ctx, cmdbuf, fence, queue)
        self.kick(queue)
        self.clock.run()
        got = self.queues[queue].pop_used()
        assert got is not None and got[1] == 32, got
        return Resp(*struct.unpack("<IIQQQ", self.dma.g_read(r, 32)))

    def isr(self) -> int:
        return self.br(self.vcaps[ISR].offset, 1)


__all__ = ["ACK", "DRV", "DRV_OK", "FEAT_OK", "FakeIrq", "PciDriver", "PciRig",
           "RecordingMsi", "VirtioCap"]
