"""The VM's PCI host bridge: ECAM routing, empty slots, firmware BARs, decoding and remap."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_pci_fakes import BAR0_SIZE, BAR2_SIZE, FakePciFunction  # noqa: E402

from hwspec import pci as P  # noqa: E402
from vmm.bus import MmioBus  # noqa: E402
from vmm.machine import Machine  # noqa: E402
from vmm.pci import PciError, PciHost  # noqa: E402
from vmm.trace import Trace  # noqa: E402

ECAM = 0xE000_0000


@pytest.fixture
def host() -> PciHost:
    m = Machine(3, keep_trace=True)
    return PciHost(MmioBus(), m.trace.tracer("pci"), "pci", ecam_base=ECAM, buses=2)


def cfg(h: PciHost, bus: int, dev: int, fn: int, reg: int, size: int) -> int:
    return h.bus.read(ECAM + P.ecam_offset(bus, dev, fn, reg), size)


def wcfg(h: PciHost, bus: int, dev: int, fn: int, reg: int, size: int, value: int) -> None:
    h.bus.write(ECAM + P.ecam_offset(bus, dev, fn, reg), size, value)


def test_ecam_routes_by_bus_dev_fn_and_empty_slots_read_all_ones(host: PciHost) -> None:
    a, b = FakePciFunction(), FakePciFunction()
    host.add(a, dev=1)
    host.add(b, dev=3, bus=1)
    assert cfg(host, 0, 1, 0, P.VENDOR_ID, 4) == 0x105A_1AF4
    assert cfg(host, 1, 3, 0, P.DEVICE_ID, 2) == 0x105A
    assert cfg(host, 0, 3, 0, P.VENDOR_ID, 2) == 0xFFFF   # b is on bus 1, not 0
    assert cfg(host, 0, 1, 1, P.VENDOR_ID, 4) == 0xFFFF_FFFF  # function 1 empty
    wcfg(host, 0, 2, 0, P.COMMAND, 2, 0x6)  # empty slot: dropped, no crash
    wcfg(host, 1, 3, 0, P.COMMAND, 2, P.COMMAND_MASTER)
    assert cfg(host, 1, 3, 0, P.COMMAND, 2) == P.COMMAND_MASTER
    assert cfg(host, 0, 1, 0, P.COMMAND, 2) == 0


def test_config_access_out_of_range_reads_all_ones_writes_ignored(host: PciHost) -> None:
    f = FakePciFunction()
    host.add(f, dev=1)
    assert cfg(host, 0, 1, 0, P.VENDOR_ID + 1, 2) == 0xFFFF  # misaligned
    assert host.bus.read(ECAM + P.ecam_offset(0, 1, 0, 0), 8) == (1 << 64) - 1  # 8-byte config
    assert host.bus.read(ECAM + (2 << 20), 4) == 0xFFFF_FFFF  # bus 2: outside the window
    before = bytes(f.cfg)
    wcfg(host, 0, 1, 0, P.COMMAND + 1, 2, 0xFFFF)  # misaligned: dropped
    assert bytes(f.cfg) == before
    assert host.bad_accesses >= 3


def test_slots_and_info(host: PciHost) -> None:
    host.add(FakePciFunction(), dev=1)
    with pytest.raises(PciError, match="taken"):
        host.add(FakePciFunction(), dev=1)
    with pytest.raises(PciError, match="no slot"):
        host.add(FakePciFunction(), dev=32)
    info = host.info()
    assert (info.ecam_base, info.bus_start, info.bus_end) == (ECAM, 0, 1)
    assert info.mem_base == host.mem_base and info.mem_size == host.mem_size


def test_firmware_assigns_naturally_aligned_bars_and_leaves_memory_off(host: PciHost) -> None:
    f1, f2 = FakePciFunction(), FakePciFunction()
    s1, s2 = host.add(f1, dev=1), host.add(f2, dev=2)
    p1, p2 = host.assign_bars(s1), host.assign_bars(s2)
    for placed in (p1, p2):
        assert placed[0] % BAR0_SIZE == 0 and placed[0] >= host.mem_base  # 64-bit window
        assert placed[2] % BAR2_SIZE == 0 and placed[2] < 1 << 32           # 32-bit BAR below 4 GiB
    assert p1[0] != p2[0] and p1[2] != p2[2]
    lo = cfg(host, 0, 1, 0, P.BASE_ADDRESS_0, 4)
    hi = cfg(host, 0, 1, 0, P.BASE_ADDRESS_0 + 4, 4)
    assert (hi << 32) | (lo & ~0xF) == p1[0]
    assert lo & P.BASE_ADDRESS_MEM_TYPE_64
    assert not cfg(host, 0, 1, 0, P.COMMAND, 2) & P.COMMAND_MEMORY
    assert host.bus.find(p1[0], 4) is None  # not decoded yet


def test_memory_enable_maps_bars_trapped_and_rewrite_remaps(host: PciHost) -> None:
    f = FakePciFunction()
    slot = host.add(f, dev=1)
    placed = host.assign_bars(slot)
    wcfg(host, 0, 1, 0, P.COMMAND, 2, P.COMMAND_MEMORY)
    r = host.bus.find(placed[0], 4)
    assert r is not None and not r.direct
    host.bus.write(placed[0] + 8, 4, 0xABCD)
    assert host.bus.read(placed[0] + 8, 4) == 0xABCD and f.scratch0[8] == 0xCD
    host.bus.write(placed[2] + 4, 2, 0x77)
    assert f.scratch2[4] == 0x77
    # the guest moves BAR0 (as an OS may re-assign): old address unmapped, new one decodes
    new = placed[0] + 0x10_0000
    wcfg(host, 0, 1, 0, P.BASE_ADDRESS_0, 4, new & 0xFFFF_FFFF | 0xC)
    wcfg(host, 0, 1, 0, P.BASE_ADDRESS_0 + 4, 4, new >> 32)
    assert host.bus.find(placed[0], 4) is None
    assert host.bus.read(new + 8, 4) == 0xABCD
    # memory decoding off: nothing decodes
    wcfg(host, 0, 1, 0, P.COMMAND, 2, 0)
    assert host.bus.find(new, 4) is None and host.bus.find(placed[2], 4) is None
    assert host.bus.read(new + 8, 4) == 0xFFFF_FFFF


def test_bar_access_past_its_size_reads_all_ones(host: PciHost) -> None:
    f = FakePciFunction()
    slot = host.add(f, dev=1)
    placed = host.assign_bars(slot)
    wcfg(host, 0, 1, 0, P.COMMAND, 2, P.COMMAND_MEMORY)
    assert host.bus.read(placed[2] + BAR2_SIZE, 4) == 0xFFFF_FFFF  # past BAR2
    host.bus.write(placed[2] + BAR2_SIZE - 2, 4, 0)  # straddles the end: dropped
    assert host.bus.unclaimed


def test_overlapping_bar_is_not_mapped_and_is_logged(host: PciHost) -> None:
    f1, f2 = FakePciFunction(), FakePciFunction()
    s1, s2 = host.add(f1, dev=1), host.add(f2, dev=2)
    p1 = host.assign_bars(s1)
    host.assign_bars(s2)
    wcfg(host, 0, 1, 0, P.COMMAND, 2, P.COMMAND_MEMORY)
    # point f2's BAR2 at f1's BAR2, then enable f2
    wcfg(host, 0, 2, 0, P.BASE_ADDRESS_0 + 8, 4, p1[2])
    wcfg(host, 0, 2, 0, P.COMMAND, 2, P.COMMAND_MEMORY)
    assert [(c.slot, c.bar) for c in host.conflicts] == [("00:02.0", 2)]
    host.bus.write(p1[2], 4, 5)
    assert f1.scratch2[0] == 5 and f2.scratch2[0] == 0


def test_same_seed_same_trace_digest() -> None:
    def run() -> str:
        m = Machine(11)
        h = PciHost(MmioBus(), m.trace.tracer("pci"), "pci")
        s = h.add(FakePciFunction(), dev=1)
        h.assign_bars(s)
        h.write(P.ecam_offset(0, 1, 0, P.COMMAND), 2, P.COMMAND_MEMORY)
        return m.trace.digest()
    assert run() == run()
    assert isinstance(Trace, type)


def test_window_exhausted_is_a_clear_error_and_remove_unplugs(host: PciHost) -> None:
    small = PciHost(MmioBus(), Machine(1).trace.tracer("p"), "small", mem_size=BAR0_SIZE,
                    mem32_size=BAR2_SIZE)
    s1 = small.add(FakePciFunction(), dev=1)
    small.assign_bars(s1)
    s2 = small.add(FakePciFunction(), dev=2)
    with pytest.raises(PciError, match="no room"):
        small.assign_bars(s2)
    small.write(P.ecam_offset(0, 1, 0, P.COMMAND), 2, P.COMMAND_MEMORY)
    assert s1.mapped
    bases = [b for _, bs in s1.mapped.values() for b in bs]
    small.remove(s1)
    assert small.slot_at(0, 1, 0) is None and all(small.bus.find(b, 4) is None for b in bases)
    assert small.read(P.ecam_offset(0, 1, 0, P.VENDOR_ID), 2) == 0xFFFF
