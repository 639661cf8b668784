"""PCI configuration space helper: type-0 header, write masks, BAR sizing (32/64-bit),
capability chains (standard and extended), the PCIe capability's FLR, bad accesses; and
hwspec.pci checked against the kernel's pci_regs.h."""
from __future__ import annotations

import os
import re

import pytest

from device_model.pci.config import ConfigSpace, add_pcie_endpoint_cap
from hwspec import pci as P


def make() -> tuple[ConfigSpace, list[tuple[str, str]]]:
    log: list[tuple[str, str]] = []
    cfg = ConfigSpace(vendor_id=0x1AF4, device_id=0x107C, revision=1, class_code=0x120000,
                      subsystem_vendor_id=0x1AF4, subsystem_id=0x4156, interrupt_pin=1,
                      log=lambda r, m: log.append((r, m)))
    return cfg, log


def test_header_identity_and_masks() -> None:
    cfg, log = make()
    assert cfg.read(0x00, 2) == 0x1AF4 and cfg.read(0x02, 2) == 0x107C
    assert cfg.read(0x00, 4) == 0x107C_1AF4
    assert cfg.read(0x08, 4) == 0x1200_0001          # class 0x12, sub 0, prog-if 0, rev 1
    assert cfg.read(0x0E, 1) == 0                     # header type 0, single function
    assert cfg.read(0x2C, 4) == 0x4156_1AF4
    assert cfg.read(0x3D, 1) == 1
    # read-only identity
    cfg.write(0x00, 4, 0xDEAD_BEEF)
    cfg.write(0x08, 4, 0)
    assert cfg.read(0x00, 4) == 0x107C_1AF4 and cfg.read(0x08, 4) == 0x1200_0001
    # command: only MEMORY, MASTER, INTX_DISABLE stick
    cfg.write(0x04, 2, 0xFFFF)
    assert cfg.read(0x04, 2) == 0x0406
    cfg.write(0x04, 2, 0)
    assert cfg.read(0x04, 2) == 0
    cfg.write(0x3C, 1, 0x0B)                          # interrupt line is a scratch byte
    assert cfg.read(0x3C, 1) == 0x0B
    assert cfg.read(0x06, 2) & 0x10 == 0              # no capability yet
    assert log == []


def test_bar_sizing_32_and_64_bit() -> None:
    cfg, _ = make()
    cfg.add_bar(0, 0x8000, is_64bit=True, prefetchable=False)
    cfg.add_bar(2, 0x1000, is_64bit=False, prefetchable=False)
    cfg.add_bar(3, 0x10_0000, is_64bit=True, prefetchable=True)
    assert cfg.read(0x10, 4) == 0x4 and cfg.read(0x14, 4) == 0
    cfg.write(0x10, 4, 0xFFFF_FFFF)
    cfg.write(0x14, 4, 0xFFFF_FFFF)
    assert cfg.read(0x10, 4) == 0xFFFF_8004           # size mask + 64-bit type bits
    assert cfg.read(0x14, 4) == 0xFFFF_FFFF
    cfg.write(0x18, 4, 0xFFFF_FFFF)
    assert cfg.read(0x18, 4) == 0xFFFF_F000           # 32-bit, 4 KiB
    cfg.write(0x1C, 4, 0xFFFF_FFFF)
    assert cfg.read(0x1C, 4) == 0xFFF0_000C           # 64-bit prefetchable, 1 MiB
    # unimplemented BARs read 0 and keep nothing
    cfg.write(0x24, 4, 0xFFFF_FFFF)
    assert cfg.read(0x24, 4) == 0
    # placing: low bits below the size are dropped
    cfg.write(0x10, 4, 0xE000_1234)
    cfg.write(0x14, 4, 0x1)
    assert cfg.bar_address(0) == 0x1_E000_0000
    cfg.write(0x18, 4, 0xC000_0FFF)
    assert cfg.bar_address(2) == 0xC000_0000
    assert [b.index for b in cfg.bars()] == [0, 2, 3]
    with pytest.raises(ValueError):
        cfg.add_bar(1, 0x1000, False, False)           # upper half of BAR0
    with pytest.raises(ValueError):
        cfg.add_bar(5, 0x1000, True, False)            # no room for the upper half
    with pytest.raises(ValueError):
        cfg.add_bar(4, 0x1800, False, False)           # not a power of two


def test_capability_chains() -> None:
    cfg, _ = make()
    a = cfg.add_capability(0x09, bytes([14]) + bytes(13))
    b = cfg.add_capability(0x11, bytes(10))
    c = cfg.add_capability(0x09, bytes([5, 1, 2]))
    assert (a, b, c) == (0x40, 0x50, 0x5C)            # dword aligned, from 0x40
    assert cfg.read(0x06, 2) & 0x10 and cfg.read(0x34, 1) == 0x40
    chain, off = [], cfg.read(0x34, 1)
    while off:
        chain.append((off, cfg.read(off, 1)))
        off = cfg.read(off + 1, 1)
    assert chain == [(0x40, 0x09), (0x50, 0x11), (0x5C, 0x09)]
    e1 = cfg.add_ext_capability(0x0010, 1, bytes(0x3C))
    e2 = cfg.add_ext_capability(0x000E, 1, bytes(4))
    assert (e1, e2) == (0x100, 0x140)
    h1, h2 = cfg.read(0x100, 4), cfg.read(0x140, 4)
    assert (h1 & 0xFFFF, h1 >> 16 & 0xF, h1 >> 20) == (0x10, 1, 0x140)
    assert (h2 & 0xFFFF, h2 >> 16 & 0xF, h2 >> 20) == (0x0E, 1, 0)
    # capability bytes are read-only unless a mask says otherwise
    cfg.write(0x40, 4, 0xFFFF_FFFF)
    cfg.write(0x100, 4, 0)
    assert cfg.read(0x40, 1) == 0x09 and cfg.read(0x41, 1) == 0x50
    assert cfg.read(0x100, 4) == h1
    with pytest.raises(ValueError):
        cfg.add_capability(0x09, bytes(200))


@pytest.mark.parametrize("offset,size", [
    (4096, 4), (4094, 4), (-4, 4), (0x10, 3), (0x10, 8), (0x11, 2), (0x12, 4), (0, 0)])
def test_bad_config_accesses_read_all_ones_and_change_nothing(offset: int, size: int) -> None:
    cfg, log = make()
    cfg.add_bar(0, 0x1000, False, False)
    before = bytes(cfg.data)
    want = (1 << 8 * size) - 1 if 0 < size <= 8 else 0xFFFF_FFFF
    assert cfg.read(offset, size) == want
    cfg.write(offset, size, 0)
    cfg.write(offset, size, 0xFFFF_FFFF_FFFF_FFFF)
    assert bytes(cfg.data) == before
    assert [r for r, _ in log] == ["pci/config-access"] * 3


def test_pcie_cap_flr() -> None:
    cfg, _ = make()
    flrs: list[int] = []
    off = add_pcie_endpoint_cap(cfg, lambda: flrs.append(1))
    assert cfg.read(off, 1) == 0x10
    flags = cfg.read(off + 2, 2)
    assert flags & 0xF == 2 and flags >> 4 & 0xF == 0  # v2 endpoint
    assert cfg.read(off + 4, 4) & (1 << 28)            # DEVCAP.FLR
    cfg.write(off + 8, 2, 0x00E0 | 0x0010)
    assert cfg.read(off + 8, 2) == 0x00F0 and flrs == []
    cfg.write(off + 8, 2, 0x8000 | 0x00F0)
    assert flrs == [1]
    assert cfg.read(off + 8, 2) & 0x8000 == 0          # BCR_FLR always reads 0
    cfg.write(off + 0xA, 2, 0xFFFF)                    # DEVSTA read-only here
    assert cfg.read(off + 0xA, 2) == 0


def test_reset_restores_sealed_image() -> None:
    cfg, _ = make()
    cfg.add_bar(0, 0x1000, False, False)
    cfg.seal_defaults()
    cfg.write(0x04, 2, 0x6)
    cfg.write(0x10, 4, 0xF000_0000)
    cfg.reset()
    assert cfg.read(0x04, 2) == 0 and cfg.read(0x10, 4) == 0


HEADER = "/usr/include/linux/pci_regs.h"


@pytest.mark.skipif(not os.path.exists(HEADER), reason="kernel headers not installed")
def test_hwspec_pci_matches_kernel_header() -> None:
    text = open(HEADER).read()
    defs = {m.group(1): int(m.group(2), 0) for m in re.finditer(
        r"#define\s+PCI_(\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", text)}
    checked = 0
    for name in dir(P):
        value = getattr(P, name)
        if name.isupper() and isinstance(value, int) and name in defs:
            assert value == defs[name], (name, hex(value), hex(defs[name]))
            checked += 1
    assert checked >= 60
    assert P.CAP_EXP_ENDPOINT_SIZEOF_V2 == 0x32
    assert P.STATUS_INTERRUPT == defs["STATUS_INTERRUPT"]
