"""A small PciFunction for host-side tests (ECAM, BARs, MSI-X, VFIO), and its own checks.

Layout: BAR0 64-bit 16 KiB: page 0 scratch registers, page 1 doorbell, page 2 the MSI-X
table (4 vectors), page 3 the PBA. BAR2 32-bit 4 KiB of scratch. Caps: MSI-X at 0x40,
PCIe (FLR) at 0x50. A doorbell write of an IOVA makes the function DMA-read 64 bytes
there, write them back + 1 at IOVA + 64, and raise MSI-X vector 0 (or record the fault).
"""
from __future__ import annotations

import os
import struct
import sys
from typing import Callable

from device_model.pci.api import BarInfo, MsixInfo
from device_model.ports import DmaFault, DmaPort, MsiPort
from hwspec import pci as P
from vmm.host import Host, HostPciFunction
from vmm.machine import Machine

sys.path.insert(0, os.path.dirname(__file__))

NVEC = 4
BAR0_SIZE = 0x4000
BAR2_SIZE = 0x1000
DOORBELL = 0x1000
TABLE = 0x2000
PBA = 0x3000
MSIX_CAP = 0x40
EXP_CAP = 0x50


class FakePciFunction:
    def __init__(self, dma: DmaPort | None = None, msi: MsiPort | None = None) -> None:
        self.dma = dma
        self.msi = msi
        self.resets = 0
        self.doorbells: list[int] = []
        self.faults: list[DmaFault] = []
        self.on_doorbell: Callable[[int], None] | None = None
        self.dropped_writes = 0
        self._init()

    def _init(self) -> None:
        c = bytearray(4096)
        struct.pack_into("<HH", c, P.VENDOR_ID, 0x1AF4, 0x105A)
        struct.pack_into("<H", c, P.STATUS, P.STATUS_CAP_LIST)
        c[P.CLASS_DEVICE + 1] = P.CLASS_PROCESSING_ACCELERATOR
        c[P.CAPABILITY_LIST] = MSIX_CAP
        c[MSIX_CAP:MSIX_CAP + 2] = bytes([P.CAP_ID_MSIX, EXP_CAP])
        struct.pack_into("<HII", c, MSIX_CAP + 2, NVEC - 1, TABLE | 0, PBA | 0)
        c[EXP_CAP:EXP_CAP + 2] = bytes([P.CAP_ID_EXP, 0])
        struct.pack_into("<I", c, EXP_CAP + P.EXP_DEVCAP, P.EXP_DEVCAP_FLR)
        self.cfg = c
        self.bar_raw = [0] * 6
        self.scratch0 = bytearray(0x1000)
        self.scratch2 = bytearray(BAR2_SIZE)
        self.table = bytearray(NVEC * 16)
        for i in range(NVEC):
            self.table[i * 16 + 12] = 1
        self.pending: set[int] = set()

    # -- config ---------------------------------------------------------------------
    def _bar_value(self, i: int) -> int:
        if i == 0:
            return (self.bar_raw[0] & ~(BAR0_SIZE - 1) & 0xFFFFFFFF) | P.BASE_ADDRESS_MEM_TYPE_64 | P.BASE_ADDRESS_MEM_PREFETCH
        if i == 1:
            return self.bar_raw[1]
        if i == 2:
            return self.bar_raw[2] & ~(BAR2_SIZE - 1) & 0xFFFFFFFF
        return 0

    def config_read(self, offset: int, size: int) -> int:
        if size not in (1, 2, 4) or offset < 0 or offset + size > 4096:
            return (1 << (8 * size)) - 1 if size in (1, 2, 4) else 0xFFFFFFFF
        if P.BASE_ADDRESS_0 <= offset < P.BASE_ADDRESS_0 + 24:
            reg = offset & ~3
            v = self._bar_value((reg - P.BASE_ADDRESS_0) // 4)
            return (v >> (8 * (offset - reg))) & ((1 << (8 * size)) - 1)
        return int.from_bytes(self.cfg[offset:offset + size], "little")

    def config_write(self, offset: int, size: int, value: int) -> None:
        if size not in (1, 2, 4) or offset < 0 or offset + size > 4096:
            return
        if P.BASE_ADDRESS_0 <= offset < P.BASE_ADDRESS_0 + 24:
            reg = offset & ~3
            i = (reg - P.BASE_ADDRESS_0) // 4
            shift = 8 * (offset - reg)
            m = ((1 << (8 * size)) - 1) << shift
            self.bar_raw[i] = (self.bar_raw[i] & ~m) | ((value << shift) & m)
            return
        if offset == P.COMMAND and size >= 2:
            struct.pack_into("<H", self.cfg, P.COMMAND, value & 0x407)
            return
        if offset == MSIX_CAP + 2 and size == 2:
            old = struct.unpack_from("<H", self.cfg, offset)[0]
            struct.pack_into("<H", self.cfg, offset, (old & 0x7FF) | (value & 0xC000))
            self._flush()
            return
        if offset == EXP_CAP + P.EXP_DEVCTL and size >= 2:
            if value & P.EXP_DEVCTL_BCR_FLR:
                self.function_level_reset()
            return
        # everything else read-only

    # -- BARs -------------------------------------------------------------------------
    def bars(self) -> tuple[BarInfo, ...]:
        return (BarInfo(0, BAR0_SIZE, True, True), BarInfo(2, BAR2_SIZE, False, False))

    def msix_info(self) -> MsixInfo | None:
        return MsixInfo(NVEC, 0, TABLE, 0, PBA)

    def bar_read(self, index: int, offset: int, size: int) -> int:
        ones = (1 << (8 * size)) - 1
        if index == 2 and 0 <= offset and offset + size <= BAR2_SIZE:
            return int.from_bytes(self.scratch2[offset:offset + size], "little")
        if index != 0 or offset < 0 or offset + size > BAR0_SIZE:
            return ones
        if offset < 0x1000:
            return int.from_bytes(self.scratch0[offset:offset + size], "little")
        if TABLE <= offset < TABLE + NVEC * 16:
            r = offset - TABLE
            return int.from_bytes(self.table[r:r + size], "little")
        if offset == PBA:
            return sum(1 << v for v in self.pending) & ones
        return 0

    def bar_write(self, index: int, offset: int, size: int, value: int) -> None:
        if not self.cfg[P.COMMAND] & P.COMMAND_MEMORY:
            self.dropped_writes += 1  # like hardware: no decoding, no write
            return
        if index == 2 and 0 <= offset and offset + size <= BAR2_SIZE:
            self.scratch2[offset:offset + size] = value.to_bytes(size, "little")
            return
        if index != 0 or offset < 0 or offset + size > BAR0_SIZE:
            return
        if offset < 0x1000:
            self.scratch0[offset:offset + size] = value.to_bytes(size, "little")
        elif offset == DOORBELL:
            self.doorbells.append(value)
            if self.on_doorbell is not None:
                self.on_doorbell(value)
            else:
                self.work(value)
        elif TABLE <= offset < TABLE + NVEC * 16:
            r = offset - TABLE
            self.table[r:r + size] = value.to_bytes(size, "little")
            self._flush()

    # -- behaviour ---------------------------------------------------------------------
    def work(self, iova: int) -> None:
        """DMA-read 64 bytes at iova, write them + 1 at iova + 64, raise vector 0."""
        if self.dma is None:
            return
        try:
            data = self.dma.read(iova, 64)
            self.dma.write(iova + 64, bytes((b + 1) & 0xFF for b in data))
        except DmaFault as e:
            self.faults.append(e)
        self.fire(0)

    def _enabled(self) -> tuple[bool, bool]:
        flags = struct.unpack_from("<H", self.cfg, MSIX_CAP + 2)[0]
        return bool(flags & P.MSIX_FLAGS_ENABLE), bool(flags & P.MSIX_FLAGS_MASKALL)

    def fire(self, vector: int) -> None:
        enabled, maskall = self._enabled()
        if not enabled:
            return
        self.pending.add(vector)
        self._flush()

    def _flush(self) -> None:
        enabled, maskall = self._enabled()
        if not enabled or maskall or self.msi is None:
            return
        for v in sorted(self.pending):
            addr, data, ctrl = struct.unpack_from("<QII", self.table, v * 16)
            if not ctrl & 1:
                self.pending.discard(v)
                self.msi.send(addr, data)

    def function_level_reset(self) -> None:
        self.resets += 1
        self._init()


def fake_factory(dma, msi, source):  # type: ignore[no-untyped-def]
    """A `Host.add_function` factory: the fake is both the function and its ports."""
    f = FakePciFunction(dma, msi)
    return f, f


class FakeHostRig:
    """A traced machine and host with one FakePciFunction at bus:00.0 (`hf`, `fake`)."""

    def __init__(self, seed: int, bus: int) -> None:
        self.machine = Machine(seed, keep_trace=True)
        self.host = Host(self.machine)
        self.hf: HostPciFunction = self.host.add_function(fake_factory, bus=bus, dev=0)
        self.fake: FakePciFunction = self.hf.function  # type: ignore[assignment]


def test_fake_sizes_its_bars_through_config() -> None:
    from vmm.pci import size_bars
    bars = size_bars(FakePciFunction())
    assert [(b.index, b.size, b.is_64bit) for b in bars] == [(0, BAR0_SIZE, True), (2, BAR2_SIZE, False)]


def test_fake_msix_masks_and_pends() -> None:
    sent: list[tuple[int, int]] = []

    class Port:
        def send(self, address: int, data: int) -> None:
            sent.append((address, data))

    f = FakePciFunction(msi=Port())
    f.bar_write(0, TABLE + 8, 4, 0x41)
    assert f.dropped_writes == 1 and f.table[8] == 0  # memory decoding is off
    f.config_write(P.COMMAND, 2, P.COMMAND_MEMORY)
    f.config_write(MSIX_CAP + 2, 2, P.MSIX_FLAGS_ENABLE)
    f.bar_write(0, TABLE, 4, 0xFEE00000)
    f.bar_write(0, TABLE + 8, 4, 0x41)
    f.fire(0)
    assert sent == [] and f.bar_read(0, PBA, 8) == 1
    f.bar_write(0, TABLE + 12, 4, 0)
    assert sent == [(0xFEE00000, 0x41)] and f.bar_read(0, PBA, 8) == 0
