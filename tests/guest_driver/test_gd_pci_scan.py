"""PCI bus scan over a fake ECAM: slots, multi-function, BAR sizing, capability walks,
enable and FLR. Malformed functions are skipped with a clear error, never a hang."""
import pytest

from gd_fakes import FakeKernel
from gd_pci_fakes import MEM_BASE, FakePciFunction, PciMachine
from guest_driver.pci import (Bdf, PciError, enable_device, function_level_reset,
                              scan_host)
from guest_driver.pci.scan import FLR_WAIT_NS
from hwspec import pci as P

VID = 0x1234


def plain(k, device=0x0001, header=0, **bars):
    f = FakePciFunction(k, VID, device, header_type=header)
    return f


def scan(m):
    return scan_host(m.k, m.host)


def test_empty_slots_multifunction_and_order():
    m = PciMachine()
    m.add(plain(m.k, 0x10), 0, 3)
    multi = plain(m.k, 0x20, header=P.HEADER_TYPE_MULTI_FUNCTION)
    m.add(multi, 0, 5, 0)
    m.add(plain(m.k, 0x21), 0, 5, 2)       # fn 1 empty, fn 2 present
    m.add(plain(m.k, 0x30), 0, 7, 0)       # single-function ...
    m.add(plain(m.k, 0x31), 0, 7, 1)       # ... so its fn 1 must not be looked at
    res = scan(m)
    assert res.errors == []
    assert [(str(f.bdf), f.device_id) for f in res.functions] == [
        ("0000:00:03.0", 0x10), ("0000:00:05.0", 0x20), ("0000:00:05.2", 0x21),
        ("0000:00:07.0", 0x30)]
    looked = {bdf for _, bdf, _, _, _ in m.ecam.log}
    assert (0, 7, 1) not in looked and (0, 3, 1) not in looked
    assert (0, 5, 1) in looked and (0, 5, 7) in looked
    assert (0, 0, 1) not in looked  # empty slot: fn 0 absent, nothing else probed
    assert res.functions[0].class_code == 0x120000 and res.functions[0].revision == 1


def test_bus_range_is_scanned_at_ecam_base_plus_offset():
    m = PciMachine(bus_start=2, bus_end=3)
    m.add(plain(m.k, 0x44), 3, 1)
    res = scan(m)
    assert [str(f.bdf) for f in res.functions] == ["0000:03:01.0"]
    assert min(b for _, (b, _, _), _, _, _ in m.ecam.log) == 2


def test_bars_32_64_io_and_sizing_restores_and_disables_decoding():
    m = PciMachine()
    f = plain(m.k)
    f.add_bar(0, 0x1000)
    f.add_bar(2, 0x10_0000, "mem64", prefetch=True)
    f.add_bar(4, 0x100, "io")
    m.add(f, 0, 2)
    f.cfg[P.COMMAND] = P.COMMAND_MEMORY | P.COMMAND_MASTER
    before = list(f.bar_regs)
    (fn,) = scan(m).functions
    assert f.bar_regs == before  # every BAR restored
    assert f.command == P.COMMAND_MEMORY | P.COMMAND_MASTER  # COMMAND restored
    assert len(f.sizing_commands) == 6
    assert all(not c & (P.COMMAND_MEMORY | P.COMMAND_IO) for c in f.sizing_commands)
    assert sorted(fn.bars) == [0, 2, 4]
    b0, b2, b4 = fn.bars[0], fn.bars[2], fn.bars[4]
    assert (b0.address, b0.size, b0.is_64bit) == (f.bar_address(0), 0x1000, False)
    assert (b2.address, b2.size, b2.is_64bit, b2.prefetchable) == (
        f.bar_address(2), 0x10_0000, True, True)
    assert b2.address >= MEM_BASE
    assert b4.is_io and b4.size == 0x100


def test_64bit_bar_above_4g():
    m = PciMachine(mem_base=0x1_0000_0000)
    f = plain(m.k)
    f.add_bar(0, 0x4000, "mem64")
    m.add(f, 0, 1)
    (fn,) = scan(m).functions
    assert fn.bars[0].address == 0x1_0000_0000 and fn.bars[0].size == 0x4000
    assert 1 not in fn.bars


@pytest.mark.parametrize("breakage, msg", [
    ("size0", "BAR0 reports size 0"),
    ("last64", "BAR5 is 64-bit but has no upper register"),
    ("outside", "outside the host bridge memory window"),
])
def test_malformed_bars_skip_the_device_with_an_error(breakage, msg):
    m = PciMachine()
    f = plain(m.k, 0x99)
    if breakage == "size0":
        f.bar_regs[0] = P.BASE_ADDRESS_MEM_TYPE_64  # implemented, but no address bit sticks
    elif breakage == "last64":
        f.add_bar(5, 0x1000, "mem64")
    m.add(f, 0, 4, assign=breakage != "size0")
    if breakage == "outside":
        f.add_bar(0, 0x1000)
        f.set_bar_address(0, 0x4000_0000)
    m.add(plain(m.k, 0x11), 0, 6)
    res = scan(m)
    assert [f.device_id for f in res.functions] == [0x11]
    assert len(res.errors) == 1 and msg in res.errors[0] and "0000:00:04.0" in res.errors[0]


def test_capability_walk_and_extended_caps():
    m = PciMachine()
    f = plain(m.k)
    a = f.add_cap(P.CAP_ID_VNDR, bytes(14))
    b = f.add_exp()
    c = f.add_cap(P.CAP_ID_VNDR, bytes(6))
    e1 = f.add_ext_cap(P.EXT_CAP_ID_SRIOV, bytes(P.EXT_CAP_SRIOV_SIZEOF - 4))
    e2 = f.add_ext_cap(0x0B, bytes(8))
    m.add(f, 0, 1)
    (fn,) = scan(m).functions
    assert [(x.id, x.offset) for x in fn.caps] == [(P.CAP_ID_VNDR, a), (P.CAP_ID_EXP, b),
                                                   (P.CAP_ID_VNDR, c)]
    assert fn.find_caps(P.CAP_ID_VNDR) == [a, c] and fn.find_cap(P.CAP_ID_MSIX) is None
    assert [(x.id, x.offset) for x in fn.ext_caps] == [(P.EXT_CAP_ID_SRIOV, e1), (0x0B, e2)]
    assert fn.find_ext_cap(P.EXT_CAP_ID_SRIOV) == 0x100


@pytest.mark.parametrize("breakage, msg", [
    ("loop", "loops back to 0x40"),
    ("self", "loops back to 0x44"),
    ("unaligned", "not a dword-aligned offset"),
    ("low", "not a dword-aligned offset >= 0x40"),
    ("ext-loop", "extended capability list loops back to 0x100"),
    ("ext-low", "next pointer 0x080"),
])
def test_malformed_capability_lists_are_skipped_without_hanging(breakage, msg):
    m = PciMachine()
    f = plain(m.k, 0x77)
    a = f.add_cap(P.CAP_ID_VNDR, bytes(2))
    b = f.add_exp()
    f.add_ext_cap(P.EXT_CAP_ID_SRIOV, bytes(8))
    if breakage == "loop":
        f.cfg[b + 1] = a
    elif breakage == "self":
        f.cfg[b + 1] = b
    elif breakage == "unaligned":
        f.cfg[a + 1] = b + 2
    elif breakage == "low":
        f.cfg[b + 1] = 0x20
    elif breakage == "ext-loop":
        f.cfg[0x103] = 0x10  # next = 0x100
    elif breakage == "ext-low":
        f.cfg[0x103] = 0x08  # next = 0x080
    m.add(f, 0, 1)
    m.add(plain(m.k, 0x11), 0, 2)
    n0 = len(m.ecam.log)
    res = scan(m)
    assert [x.device_id for x in res.functions] == [0x11]
    assert len(res.errors) == 1 and msg in res.errors[0], res.errors
    assert "0000:00:01.0" in res.errors[0]
    assert len(m.ecam.log) - n0 < 400  # bounded work


def test_48_caps_fill_the_header_and_are_all_found():
    m = PciMachine()
    f = plain(m.k)
    for _ in range(48):  # 0x40 .. 0xFC: the most dword-aligned caps that fit
        f.add_cap(P.CAP_ID_VNDR, bytes(2))
    m.add(f, 0, 1)
    (fn,) = scan(m).functions
    assert [c.offset for c in fn.caps] == list(range(0x40, 0x100, 4))


def test_enable_device_sets_memory_and_master_keeping_other_bits():
    m = PciMachine()
    f = plain(m.k)
    f.add_bar(0, 0x1000)
    m.add(f, 0, 1)
    f.cfg[P.COMMAND + 1] = P.COMMAND_INTX_DISABLE >> 8
    (fn,) = scan(m).functions
    enable_device(fn)
    assert f.command == P.COMMAND_MEMORY | P.COMMAND_MASTER | P.COMMAND_INTX_DISABLE


def test_flr_waits_100ms_and_restores_bars_and_command():
    m = PciMachine()
    f = plain(m.k)
    f.add_bar(0, 0x1000)
    f.add_bar(2, 0x2000, "mem64")
    f.add_exp(flr=True)
    f.flr_busy_ns = 150_000_000  # still not answering after the 100 ms
    m.add(f, 0, 1)
    (fn,) = scan(m).functions
    enable_device(fn)
    bars = list(f.bar_regs)
    t0 = m.k.sched.now
    function_level_reset(m.k, fn)
    assert f.flr_times == [t0]
    assert m.k.sched.now - t0 >= 150_000_000 >= FLR_WAIT_NS
    assert f.bar_regs == bars and f.command & P.COMMAND_MEMORY
    devctl = int.from_bytes(f.cfg[f.exp_cap + P.EXP_DEVCTL:f.exp_cap + P.EXP_DEVCTL + 2],
                            "little")
    assert not devctl & P.EXP_DEVCTL_BCR_FLR
    w = [x for x in m.ecam.log if x[0] == "w" and x[2] == f.exp_cap + P.EXP_DEVCTL]
    assert len(w) == 1 and w[0][3] == 2 and w[0][4] & P.EXP_DEVCTL_BCR_FLR


def test_flr_exactly_100ms_when_device_is_ready():
    m = PciMachine()
    f = plain(m.k)
    f.add_exp(flr=True)
    m.add(f, 0, 1)
    (fn,) = scan(m).functions
    function_level_reset(m.k, fn)
    assert m.k.sched.now == FLR_WAIT_NS


def test_flr_unsupported_is_an_error():
    m = PciMachine()
    f = plain(m.k)
    f.add_exp(flr=False)
    m.add(f, 0, 1)
    (fn,) = scan(m).functions
    with pytest.raises(PciError, match="does not support FLR"):
        function_level_reset(m.k, fn)
    assert f.flr_times == []


def test_bdf_orders_like_a_scan():
    assert sorted([Bdf(0, 1, 0, 0), Bdf(0, 0, 3, 1), Bdf(0, 0, 3, 0)]) == [
        Bdf(0, 0, 3, 0), Bdf(0, 0, 3, 1), Bdf(0, 1, 0, 0)]
    assert str(Bdf(0, 0x1a, 3, 7)) == "0000:1a:03.7"


def test_no_hosts_no_scan():
    k = FakeKernel()
    assert k.pci_hosts == ()
