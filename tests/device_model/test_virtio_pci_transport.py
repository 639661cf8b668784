"""virtio-pci modern transport of VA-1: identity, capability list, BAR0 layout, common
configuration, MSI-X vectors, ISR/INTx, notifications, PCI_CFG window, strict rules,
bad accesses, broken ring and FLR."""
from __future__ import annotations

import os
import re
import struct

import pytest
from dm_driver import nop
from dm_pci_driver import (ACK, CFGGEN, COMMON, DEVICE, DFSEL, DRV, DRV_OK, DSTATUS, FEAT_OK,
                           GF, GFSEL, ISR, MSIX_CFG, NO_VECTOR, NOTIFY, NUMQ, PCI_CFG, QDESC,
                           QENABLE, QMSIX, QNOFF, QSEL, QSIZE, PciDriver, PciRig,
                           RecordingMsi)
from dm_fakes import FakeClock, FakeDma, FakeIrq, RecordingTracer

from device_model import DevicePorts, Va1Config, Va1Device, VirtioPciFunction
from device_model.pci.api import BarInfo, MsixInfo, PciFunction
from hwspec import va1
from hwspec import virtio_pci as VP


def bare(config: Va1Config | None = None, intx: FakeIrq | None = None
         ) -> tuple[VirtioPciFunction, RecordingMsi, FakeDma]:
    dma = FakeDma()
    msi = RecordingMsi()
    dev = Va1Device(config or Va1Config(), DevicePorts(dma, FakeClock(), RecordingTracer()))
    return VirtioPciFunction(dev, msi, tracer=RecordingTracer(), intx=intx), msi, dma


def rules(fn: VirtioPciFunction, since: int = 0) -> list[str]:
    return [v.rule for v in fn.violations[since:]]


def test_is_a_pci_function() -> None:
    fn, _, _ = bare()
    f: PciFunction = fn
    assert f.bars() == (BarInfo(0, 0x8000, True, False),)
    assert f.msix_info() == MsixInfo(count=5, table_bar=0, table_offset=0x4000, pba_bar=0,
                                     pba_offset=0x5000)


def test_config_header() -> None:
    fn, _, _ = bare()
    d = PciDriver(fn)
    assert d.cr(0x00, 2) == 0x1AF4 == va1.PCI_VENDOR_ID
    assert d.cr(0x02, 2) == 0x1040 + 60 == va1.PCI_DEVICE_ID
    assert d.cr(0x08, 1) == 1                           # revision: modern
    assert d.cr(0x08, 4) >> 24 == 0x12                  # processing accelerator
    assert d.cr(0x09, 4) == 0xFFFF_FFFF                 # misaligned: all-ones
    assert d.cr(0x0A, 2) == 0x1200 and d.cr(0x09, 1) == 0
    assert d.cr(0x0E, 1) == 0
    assert d.cr(0x2C, 2) == 0x1AF4 and d.cr(0x2E, 2) == 0x4156 >= 0x40
    assert d.cr(0x3D, 1) == 0                           # no INTx wired
    assert d.cr(0x04, 2) == 0                           # decoders off at power-on
    fn2, _, _ = bare(intx=FakeIrq())
    assert PciDriver(fn2).cr(0x3D, 1) == 1              # INTA


def test_bar0_sizing() -> None:
    fn, _, _ = bare()
    d = PciDriver(fn)
    assert d.size_bar(0) == (0x8000, True)
    assert d.cr(0x10) & 0xF == 0x4                      # memory, 64-bit, not prefetchable
    for i in range(2, 6):
        d.cw(0x10 + 4 * i, 4, 0xFFFF_FFFF)
        assert d.cr(0x10 + 4 * i) == 0
    d.cw(0x10, 4, 0xFEBF_F000)
    d.cw(0x14, 4, 0x2)
    assert fn.config.bar_address(0) == 0x2_FEBF_8000


def test_capability_list_and_virtio_caps() -> None:
    fn, _, _ = bare(Va1Config(num_submit_queues=3))
    d = PciDriver(fn)
    ids = [i for i, _ in d.caps()]
    assert ids.count(0x09) == 5 and 0x11 in ids and 0x10 in ids
    caps = d.virtio_caps()
    assert set(caps) == {COMMON, NOTIFY, ISR, DEVICE, PCI_CFG}
    want = {COMMON: (16, 0x0000, 60), ISR: (16, 0x1000, 1), DEVICE: (16, 0x2000, 72),
            NOTIFY: (20, 0x3000, 5 * 4), PCI_CFG: (20, 0, 0)}
    for t, (cap_len, offset, length) in want.items():
        c = caps[t]
        assert (c.cap_len, c.bar, c.offset, c.length) == (cap_len, 0, offset, length), t
        assert d.cr(c.at + 5, 1) == 0 and d.cr(c.at + 6, 2) == 0   # id, padding
    assert caps[NOTIFY].extra == 4
    for t in (COMMON, ISR, DEVICE, NOTIFY):                  # each on its own page
        c = caps[t]
        assert c.offset % 0x1000 == 0 and c.offset + c.length <= 0x8000
    # vendor caps are read-only (except the PCI_CFG window fields)
    c = caps[COMMON]
    d.cw(c.at + 8, 4, 0x1234)
    assert d.cr(c.at + 8, 4) == 0


def test_msix_table_size_is_one_plus_queues() -> None:
    for n in (1, 2, 5):
        fn, _, _ = bare(Va1Config(num_submit_queues=n))
        cap = PciDriver(fn).cap(0x11)
        assert (fn.config_read(cap + 2, 2) & 0x7FF) + 1 == 1 + 2 + n


def test_common_config_basics_and_device_config() -> None:
    rig = PciRig(msix=False)
    assert rig.c16(NUMQ) == 4
    want = 1 << 0 | 1 << 2 | 1 << 28 | 1 << 29 | 1 << 32 | 1 << 33   # datasheet §2
    assert rig.offered() & want == want and rig.offered() == rig.dev.avail_features()
    rig.w32(DFSEL, 2)
    assert rig.c32(4) == 0
    rig.w32(GFSEL, 1)
    assert rig.c32(GF) == 0b11
    assert rig.c8(CFGGEN) == 0
    for i in range(4):
        rig.w16(QSEL, i)
        assert rig.c16(QNOFF) == i and rig.c16(QENABLE) == 1 and rig.c16(QSIZE) == 16
    rig.w16(QSEL, 2)
    q = rig.queues[2]
    assert rig.c32(QDESC) == q.desc & 0xFFFFFFFF
    assert rig.br(rig.common + QDESC, 8) == q.desc              # 64-bit access allowed
    image = b"".join(rig.dev_cfg(i, 1).to_bytes(1, "little") for i in range(72))
    assert image == rig.config.pack()
    assert rig.dev_cfg(8, 8) == rig.config.device_memory_size
    assert rig.fn.violations == []


def test_vector_beyond_table_reads_no_vector() -> None:
    rig = PciRig()
    rig.w16(MSIX_CFG, 5)                                    # table has 5 entries: 0..4
    assert rig.c16(MSIX_CFG) == NO_VECTOR
    rig.w16(MSIX_CFG, 4)
    assert rig.c16(MSIX_CFG) == 4
    rig.w16(MSIX_CFG, NO_VECTOR)
    assert rig.c16(MSIX_CFG) == NO_VECTOR
    rig.w16(QSEL, 3)
    rig.w16(QMSIX, 0x7FF)
    assert rig.c16(QMSIX) == NO_VECTOR
    rig.w16(QMSIX, 0)
    assert rig.c16(QMSIX) == 0                              # vectors may be shared
    assert rig.fn.violations == []


def test_queue_select_out_of_range() -> None:
    fn, _, _ = bare()
    d = PciDriver(fn)
    d.cw(0x04, 2, 0x6)
    fn.bar_write(0, DSTATUS, 1, ACK)
    fn.bar_write(0, QSEL, 2, 4)
    assert fn.bar_read(0, QSIZE, 2) == 0
    assert fn.bar_read(0, QENABLE, 2) == 0 and fn.bar_read(0, QMSIX, 2) == NO_VECTOR
    for off, size, v in ((QSIZE, 2, 16), (QENABLE, 2, 1), (QMSIX, 2, 0), (QDESC, 4, 0x1000)):
        fn.bar_write(0, off, size, v)
    assert rules(fn) == ["queue/bad-select"] * 4
    fn.bar_write(0, QSEL, 2, 0xFFFF)
    assert fn.bar_read(0, QSIZE, 2) == 0


def test_queue_registers_after_driver_ok() -> None:
    rig = PciRig()
    rig.w16(QSEL, 2)
    before = (rig.c16(QSIZE), rig.c32(QDESC), rig.c16(QENABLE))
    rig.w16(QSIZE, 8)
    rig.w32(QDESC, 0x1000)
    rig.w32(QDESC + 4, 1)
    rig.w16(QENABLE, 1)
    assert (rig.c16(QSIZE), rig.c32(QDESC), rig.c16(QENABLE)) == before
    assert rules(rig.fn) == ["queue/after-driver-ok"] * 4
    rig.w16(QMSIX, 0)                                        # vectors may change any time
    assert rig.c16(QMSIX) == 0 and len(rig.fn.violations) == 4


def test_queue_rules_before_driver_ok() -> None:
    fn, _, _ = bare()
    PciDriver(fn).cw(0x04, 2, 0x6)
    fn.bar_write(0, DSTATUS, 1, ACK)
    fn.bar_write(0, QSEL, 2, 0)
    for bad in (0, 3, 512):
        fn.bar_write(0, QSIZE, 2, bad)
    assert fn.bar_read(0, QSIZE, 2) == 256
    fn.bar_write(0, QENABLE, 2, 0)                            # only 1 may be written
    fn.bar_write(0, QDESC, 4, 0x4000_0008)                    # not 16-aligned
    fn.bar_write(0, QENABLE, 2, 1)
    assert fn.bar_read(0, QENABLE, 2) == 0
    fn.bar_write(0, 58, 2, 1)                                 # queue_reset: not offered
    assert rules(fn) == ["queue/size"] * 3 + ["queue/enable", "queue/alignment",
                                              "queue/reset-not-negotiated"]


def test_status_and_feature_rules() -> None:
    fn, _, _ = bare()
    PciDriver(fn).cw(0x04, 2, 0x6)
    w = lambda off, size, v: fn.bar_write(0, off, size, v)  # noqa: E731
    w(DSTATUS, 1, DRV)
    w(DSTATUS, 1, ACK)
    w(DSTATUS, 1, ACK | FEAT_OK)
    w(DSTATUS, 1, ACK | DRV)
    w(DSTATUS, 1, ACK | DRV | DRV_OK)
    w(GFSEL, 4, 0)
    w(GF, 4, 1 << 23)                                         # not offered
    w(GFSEL, 4, 1)
    w(GF, 4, 1)
    w(DSTATUS, 1, ACK | DRV | FEAT_OK)
    assert fn.bar_read(0, DSTATUS, 1) == ACK | DRV
    w(GFSEL, 4, 0)
    w(GF, 4, 0)
    w(DSTATUS, 1, ACK | DRV | FEAT_OK)
    assert fn.bar_read(0, DSTATUS, 1) == ACK | DRV | FEAT_OK
    w(GF, 4, 1)
    w(DSTATUS, 1, ACK)
    assert rules(fn) == ["status/order", "status/order", "status/order",
                         "features/not-offered", "features/after-features-ok",
                         "status/clear-bit"]


def test_access_sizes_in_common_config() -> None:
    rig = PciRig()
    n = len(rig.fn.violations)
    assert rig.br(rig.common + DSTATUS, 2) == 0                  # 8-bit field read 16-bit
    rig.bw(rig.common + QSEL, 4, 0)                               # 16-bit field written 32
    rig.bw(rig.common + GF + 1, 1, 0)                             # middle of a field
    assert rig.br(rig.common + NUMQ, 4) == 0
    assert rules(rig.fn, n) == ["pci/access-size"] * 4
    assert rig.br(rig.common + 0x100, 4) == 0                      # past the structure
    assert len(rig.fn.violations) == n + 4


def test_bar_access_past_its_size_and_other_bars() -> None:
    rig = PciRig()
    n = len(rig.fn.violations)
    assert rig.fn.bar_read(0, 0x8000, 4) == 0xFFFF_FFFF
    assert rig.fn.bar_read(0, 0x7FFE, 4) == 0xFFFF_FFFF
    assert rig.fn.bar_read(0, -4, 4) == 0xFFFF_FFFF
    assert rig.fn.bar_read(2, 0, 4) == 0xFFFF_FFFF
    assert rig.fn.bar_read(0, 0, 3) == 0xFFFFFF
    assert rig.fn.bar_read(1, 0, 8) == 2**64 - 1
    rig.fn.bar_write(0, 0x8000, 4, 0)
    rig.fn.bar_write(3, 0, 4, 0)
    assert rules(rig.fn, n) == ["pci/bar-access"] * 8
    assert rig.br(0x7000, 4) == 0                                  # unused page inside BAR
    rig.bw(0x7000, 4, 1)
    assert len(rig.fn.violations) == n + 8


def test_memory_space_disabled() -> None:
    rig = PciRig()
    n = len(rig.fn.violations)
    rig.cw(0x04, 2, 0x4)                                          # MASTER only
    assert rig.br(rig.common + NUMQ, 2) == 0xFFFF
    rig.bw(rig.common + DSTATUS, 1, 0)
    assert rules(rig.fn, n) == ["pci/memory-disabled"] * 2
    rig.cw(0x04, 2, 0x6)
    assert rig.c8(DSTATUS) == ACK | DRV | FEAT_OK | DRV_OK          # the write had no effect


def test_config_space_out_of_range() -> None:
    rig = PciRig()
    image = bytes(rig.fn.config.data)
    n = len(rig.fn.violations)
    for off, size in ((0x1000, 4), (0xFFE, 4), (0x40, 8), (0x41, 2), (-1, 1)):
        assert rig.fn.config_read(off, size) == (1 << 8 * size) - 1
        rig.fn.config_write(off, size, 0)
    assert bytes(rig.fn.config.data) == image
    assert rules(rig.fn, n) == ["pci/config-access"] * 10
    assert rig.cr(0xFFC, 4) == 0                                  # in range, nothing there


def test_notify_rules() -> None:
    rig = PciRig()
    n = len(rig.fn.violations)
    base = rig.vcaps[NOTIFY].offset
    rig.bw(base + 2 * 4, 2, 3)                                    # wrong value
    rig.bw(base + 2 * 4, 1, 2)                                    # wrong size
    rig.bw(base + 2, 2, 0)                                        # not on a multiplier
    rig.bw(base + 4 * 4, 2, 4)                                    # no queue 4
    assert rules(rig.fn, n) == ["notify/value", "pci/access-size", "pci/access-size",
                                "queue/not-ready"]
    rig.cw(0x04, 2, 0x2)                                          # bus master off
    rig.kick(2)
    assert rules(rig.fn, n)[-1] == "pci/bus-master"
    assert rig.br(base, 4) == 0


def test_isr_and_intx_without_msix() -> None:
    rig = PciRig(msix=False, intx=True)
    ctx = rig.create_context()
    assert rig.irq.level and rig.cr(0x06, 2) & 0x08              # Status.INTERRUPT
    assert rig.isr() == 1
    assert not rig.irq.level and rig.isr() == 0                    # read-to-clear
    assert rig.cr(0x06, 2) & 0x08 == 0
    assert rig.msi.sent == []
    r = rig.submit(ctx, nop())
    assert r.status == 0 and rig.irq.level
    rig.cw(0x04, 2, 0x6 | 0x400)                                   # INTX_DISABLE
    assert not rig.irq.level and rig.cr(0x06, 2) & 0x08            # status still says so
    rig.cw(0x04, 2, 0x6)
    assert rig.irq.level
    n = len(rig.fn.violations)
    assert rig.br(rig.vcaps[ISR].offset, 4) == 0                   # 8-bit register
    assert rules(rig.fn, n) == ["pci/access-size"] and rig.irq.level
    assert rig.isr() == 1 and not rig.irq.level


def test_msix_completion_and_no_vector() -> None:
    rig = PciRig(event_idx=False)
    ctx = rig.create_context()
    assert rig.msi.sent == [rig.msg(1)]                            # controlq -> vector 1
    rig.submit(ctx, nop(), queue=3)
    assert rig.msi.sent[-1] == rig.msg(4)
    assert rig.isr() == 0                                         # MSI-X: no queue ISR bit
    # a queue whose vector is NO_VECTOR gets no interrupt at all (and no ISR bit)
    rig.w16(QSEL, 0)
    rig.w16(QMSIX, NO_VECTOR)
    sent = len(rig.msi.sent)
    rig.create_context()
    assert len(rig.msi.sent) == sent and rig.isr() == 0
    # MSI-X table masking holds the completion in the PBA until unmasked
    _, _, table, pba = rig.msix_table()
    rig.bw(table + 16 * 4 + 12, 4, 1)                              # mask vector 4 (queue 3)
    rig.submit(ctx, nop(), fence=2, queue=3)
    assert len(rig.msi.sent) == sent and rig.br(pba, 8) == 1 << 4
    rig.bw(table + 16 * 4 + 12, 4, 0)
    assert rig.msi.sent[-1] == rig.msg(4) and rig.br(pba, 8) == 0
    assert rig.fn.violations == []


def test_pci_cfg_window() -> None:
    rig = PciRig()
    cap = rig.vcaps[PCI_CFG].at
    rig.cw(0x04, 2, 0x0)                                          # works with decode off
    rig.cw(cap + 4, 1, 0)
    rig.cw(cap + 8, 4, rig.common + NUMQ)
    rig.cw(cap + 12, 4, 2)
    assert rig.cr(cap + 16, 4) == 4
    rig.cw(cap + 8, 4, rig.common + DSTATUS)
    rig.cw(cap + 12, 4, 1)
    rig.cw(cap + 16, 4, 0)                                        # device reset via window
    rig.cw(0x04, 2, 0x6)
    assert rig.c8(DSTATUS) == 0
    n = len(rig.fn.violations)
    rig.cw(cap + 4, 1, 3)                                         # no BAR 3
    rig.cr(cap + 16, 4)
    rig.cw(cap + 4, 1, 0)
    rig.cw(cap + 12, 4, 3)                                        # bad length
    rig.cw(cap + 16, 4, 0)
    rig.cw(cap + 12, 4, 4)
    rig.cw(cap + 8, 4, 0x7FFE)                                    # unaligned
    rig.cr(cap + 16, 4)
    assert rules(rig.fn, n) == ["pci/cfg-window"] * 3


def test_broken_ring_needs_reset_and_config_vector() -> None:
    rig = PciRig()
    q = rig.queues[2]
    q.w16(q.avail + 4, 99)                                        # head out of range
    q.avail_idx = 1
    q.w16(q.avail + 2, 1)
    rig.kick(2)
    assert rig.c8(DSTATUS) & 0x40
    assert rig.msi.sent == [rig.msg(0)]                            # config vector 0
    assert rig.isr() == 2                                          # config bit always set
    assert rules(rig.fn)[-1] == "ring/head-range"
    rig.kick(2)                                                    # stopped until reset
    assert rig.msi.sent == [rig.msg(0)]
    rig.init()                                                     # status 0, then again
    assert rig.c8(DSTATUS) == 0xF
    assert rig.create_context() == 1


def test_reset_clears_vectors_but_keeps_pci_state() -> None:
    rig = PciRig()
    rig.w8(DSTATUS, 0)
    assert rig.c16(MSIX_CFG) == NO_VECTOR
    rig.w16(QSEL, 1)
    assert rig.c16(QMSIX) == NO_VECTOR and rig.c16(QENABLE) == 0
    cap, _, table, _ = rig.msix_table()
    assert rig.cr(cap + 2, 2) & 0x8000                               # MSI-X still enabled
    assert rig.br(table + 16, 4) == rig.msg(1)[0]
    assert rig.cr(0x04, 2) == 0x6


def test_flr_mid_flight() -> None:
    rig = PciRig()
    ctx = rig.create_context()
    big = b"".join(nop(8) for _ in range(64))
    rig.submit_nowait(ctx, big, fence=1, queue=2)
    rig.submit_nowait(ctx, big, fence=2, queue=3)
    rig.kick(2)
    rig.kick(3)
    assert rig.clock.pending() > 0
    sent, dma_log = len(rig.msi.sent), len(rig.dma.log)
    pcie = rig.cap(0x10)
    rig.cr(pcie + 8, 2)
    rig.cw(pcie + 8, 2, 0x8000 | 0x0020)                           # BCR_FLR, MPS 256
    rig.clock.run()
    assert len(rig.dma.log) == dma_log and len(rig.msi.sent) == sent
    assert rig.queues[2].used_idx() == 0 and rig.queues[3].used_idx() == 0
    # config space back to power-on values
    fresh, _, _ = bare()
    diff = [i for i in range(4096) if rig.fn.config.data[i] != fresh.config.data[i]]
    assert diff == [pcie + 8]                                      # only MPS survives
    assert rig.cr(pcie + 8, 2) == 0x0020
    assert rig.cr(0x04, 2) == 0 and rig.cr(0x10, 4) == 0x4 and rig.cr(0x14, 4) == 0
    cap, n, table, pba = rig.msix_table()
    assert rig.cr(cap + 2, 2) & 0xC000 == 0
    rig.enable()
    for v in range(n):
        assert rig.br(table + 16 * v, 8) == 0 and rig.br(table + 16 * v + 12, 4) == 1
    assert rig.br(pba, 8) == 0
    assert rig.c8(DSTATUS) == 0 and rig.c16(MSIX_CFG) == NO_VECTOR
    # and the function comes back up
    rig.setup_msix()
    rig.init()
    ctx = rig.create_context()
    assert rig.submit(ctx, nop()).status == 0
    assert rig.fn.violations == []


def test_flr_via_api_and_intx_drops() -> None:
    rig = PciRig(msix=False, intx=True)
    rig.create_context()
    assert rig.irq.level
    rig.fn.function_level_reset()
    assert not rig.irq.level and rig.cr(0x06, 2) & 0x08 == 0
    assert rig.cr(0x06, 2) & 0x10                                   # caps still listed


HEADER = "/usr/include/linux/virtio_pci.h"


@pytest.mark.skipif(not os.path.exists(HEADER), reason="kernel headers not installed")
def test_hwspec_virtio_pci_matches_kernel_header() -> None:
    text = open(HEADER).read()
    defs = {m.group(1): int(m.group(2), 0) for m in re.finditer(
        r"#define\s+(VIRTIO_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", text)}
    assert VP.MSI_NO_VECTOR == defs["VIRTIO_MSI_NO_VECTOR"]
    assert VP.ISR_CONFIG == defs["VIRTIO_PCI_ISR_CONFIG"]
    for name in ("COMMON_CFG", "NOTIFY_CFG", "ISR_CFG", "DEVICE_CFG", "PCI_CFG",
                 "SHARED_MEMORY_CFG"):
        assert getattr(VP, "CAP_" + name) == defs["VIRTIO_PCI_CAP_" + name]
    assert VP.CAP.offsets["bar"] == defs["VIRTIO_PCI_CAP_BAR"]
    assert VP.CAP.offsets["length"] == defs["VIRTIO_PCI_CAP_LENGTH"]
    common = {"DFSELECT": "DFSELECT", "Q_NOFF": "Q_NOFF", "Q_USEDHI": "Q_USEDHI",
              "STATUS": "STATUS", "Q_ENABLE": "Q_ENABLE", "MSIX": "MSIX"}
    for ours, theirs in common.items():
        key = "VIRTIO_PCI_COMMON_" + theirs
        if key in defs:
            assert getattr(VP, "COMMON_" + ours) == defs[key]
    assert struct.calcsize(VP.CAP.format) == 16
