"""MSI-X capability, table and PBA: masking (per vector and function), pending bits,
ENABLE, Bus Master, access sizes, reset."""
from __future__ import annotations

from dm_pci_driver import RecordingMsi

from device_model.pci.config import ConfigSpace
from device_model.pci.msix import Msix

ENABLE, MASKALL = 0x8000, 0x4000


class Rig:
    def __init__(self, count: int = 3) -> None:
        self.log: list[str] = []
        self.master = True
        self.cfg = ConfigSpace(0x1AF4, 0x107C, 1, 0x120000, 0x1AF4, 0x4156,
                               log=lambda r, m: self.log.append(r))
        self.msi = RecordingMsi()
        self.m = Msix(self.cfg, count, 0, 0x4000, 0, 0x5000, self.msi,
                      log=lambda r, m: self.log.append(r), bus_master=lambda: self.master)
        self.cap = self.m.cap

    def program(self, v: int, addr: int, data: int, masked: bool = False) -> None:
        self.m.table_write(16 * v, 8, addr)
        self.m.table_write(16 * v + 8, 4, data)
        self.m.table_write(16 * v + 12, 4, int(masked))

    def ctrl(self, value: int) -> None:
        self.cfg.write(self.cap + 2, 2, value)


def test_capability_fields() -> None:
    r = Rig(count=5)
    assert r.cfg.read(r.cap, 1) == 0x11
    assert r.cfg.read(r.cap + 2, 2) == 4                   # table size - 1, disabled
    assert r.cfg.read(r.cap + 4, 4) == 0x4000              # BIR 0
    assert r.cfg.read(r.cap + 8, 4) == 0x5000
    r.cfg.write(r.cap + 2, 2, 0xFFFF)                       # only ENABLE/MASKALL stick
    assert r.cfg.read(r.cap + 2, 2) == 0xC004
    r.cfg.write(r.cap + 4, 4, 0)
    assert r.cfg.read(r.cap + 4, 4) == 0x4000
    assert r.m.info.count == 5 and r.m.info.table_offset == 0x4000


def test_reset_state_every_vector_masked() -> None:
    r = Rig()
    for v in range(3):
        assert r.m.table_read(16 * v + 12, 4) == 1
        assert r.m.table_read(16 * v, 8) == 0
    assert r.m.pba_read(0, 8) == 0


def test_fire_while_masked_sets_pba_then_unmask_sends() -> None:
    r = Rig()
    r.ctrl(ENABLE)
    r.program(1, 0xFEE0_1000, 0x41, masked=True)
    r.m.fire(1)
    assert r.msi.sent == [] and r.m.pba_read(0, 8) == 0b010
    r.m.fire(1)                                             # still one pending bit
    assert r.m.pba_read(0, 4) == 0b010
    r.m.table_write(16 + 12, 4, 0)                          # unmask
    assert r.msi.sent == [(0xFEE0_1000, 0x41)]              # sent once
    assert r.m.pba_read(0, 8) == 0
    r.m.fire(1)
    assert r.msi.sent[-1] == (0xFEE0_1000, 0x41) and len(r.msi.sent) == 2


def test_function_mask_pends_all_and_release_sends() -> None:
    r = Rig()
    r.program(0, 0xFEE0_0000, 0x40)
    r.program(2, 0xFEE0_2000, 0x42)
    r.ctrl(ENABLE | MASKALL)
    r.m.fire(2)
    r.m.fire(0)
    assert r.msi.sent == [] and r.m.pba_read(0, 8) == 0b101
    r.ctrl(ENABLE)
    assert r.msi.sent == [(0xFEE0_0000, 0x40), (0xFEE0_2000, 0x42)]
    assert r.m.pba_read(0, 8) == 0


def test_disabled_sends_nothing_and_pends_nothing() -> None:
    r = Rig()
    r.program(0, 0xFEE0_0000, 0x40)
    r.m.fire(0)
    r.m.fire(7)                                             # beyond the table: ignored
    assert r.msi.sent == [] and r.m.pba_read(0, 8) == 0
    r.ctrl(ENABLE)
    assert r.msi.sent == []
    r.m.fire(0)
    r.m.fire(3)
    assert r.msi.sent == [(0xFEE0_0000, 0x40)]


def test_bus_master_off_pends_until_on() -> None:
    r = Rig()
    r.ctrl(ENABLE)
    r.program(0, 0xFEE0_0000, 0x40)
    r.master = False
    r.m.fire(0)
    assert r.msi.sent == [] and r.m.pending(0)
    r.master = True
    r.m.flush()
    assert r.msi.sent == [(0xFEE0_0000, 0x40)] and not r.m.pending(0)


def test_table_access_sizes_and_readonly_bits() -> None:
    r = Rig()
    r.m.table_write(0, 4, 0xFEE0_0003)                      # low two address bits are 0
    assert r.m.table_read(0, 4) == 0xFEE0_0000
    r.m.table_write(12, 4, 0xFFFF_FFFF)                     # only MASKBIT in vector ctrl
    assert r.m.table_read(12, 4) == 1
    r.m.table_write(8, 8, 0x0000_0000_0000_0055)            # QWORD: data + ctrl (unmask)
    assert r.m.table_read(8, 4) == 0x55 and r.m.table_read(12, 4) == 0
    assert r.log == []
    for off, size in ((0, 2), (1, 4), (4, 8), (0, 1), (2, 4)):
        before = bytes(r.m.table)
        r.m.table_write(off, size, 0xFFFF_FFFF)
        assert r.m.table_read(off, size) == 0
        assert bytes(r.m.table) == before
    assert r.log == ["msix/access-size"] * 10
    r.log.clear()
    r.m.pba_write(0, 8, 0xFF)
    assert r.m.pba_read(0, 8) == 0 and r.log == ["msix/pba-write"]
    assert r.m.pba_read(0, 2) == 0 and r.log[-1] == "msix/access-size"
    # past the table inside its page: reads 0, writes ignored, no violation
    r.log.clear()
    r.m.table_write(0x800, 4, 1)
    assert r.m.table_read(0x800, 4) == 0 and r.log == []


def test_reset_masks_and_clears() -> None:
    r = Rig()
    r.ctrl(ENABLE)
    r.program(0, 0xFEE0_0000, 0x40, masked=True)
    r.m.fire(0)
    assert r.m.pending(0)
    r.m.reset()
    assert r.m.masked(0) and not r.m.pending(0) and r.m.table_read(0, 8) == 0
