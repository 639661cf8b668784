import numpy as np
import pytest

from vmm.bus import BusError, MmioBus
from vmm.memory import GuestMemory, GuestMemoryError, HostMemory


@pytest.fixture
def mem():
    host = HostMemory(1 << 20)
    yield GuestMemory(host, 0x1000_0000, 1 << 20)


def test_guest_memory_round_trip_and_zero_copy_view(mem):
    mem.write(0x1000_0010, b"\x01\x02\x03\x04")
    assert mem.read(0x1000_0010, 4) == b"\x01\x02\x03\x04"
    v = mem.view(0x1000_0010, 4)
    v[0] = 9
    assert mem.read(0x1000_0010, 1) == b"\x09"
    mem.write(0x1000_0100, np.arange(4, dtype=np.float32))
    assert np.array_equal(mem.view(0x1000_0100, 16).view(np.float32), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("gpa,length", [
    (0x0FFF_FFFF, 2),                 # starts below RAM
    (0x1000_0000 + (1 << 20) - 1, 2),  # runs past the end
    (0x1000_0000, -1),                # negative length
    (0x2000_0000, 1),                 # far away
])
def test_guest_memory_out_of_range_names_the_range_and_touches_nothing(mem, gpa, length):
    before = mem.view(0x1000_0000, 1 << 20).copy()
    with pytest.raises(GuestMemoryError, match="outside guest RAM"):
        mem.read(gpa, length)
    if length > 0:
        with pytest.raises(GuestMemoryError, match="outside guest RAM"):
            mem.write(gpa, b"\xff" * length)
        with pytest.raises(GuestMemoryError, match="outside guest RAM"):
            mem.view(gpa, length)
    assert np.array_equal(before, mem.view(0x1000_0000, 1 << 20))


class Regs:
    def __init__(self):
        self.writes = []

    def read(self, offset, size):
        return 0x1122334455667788 >> (8 * offset) if offset < 8 else 0

    def write(self, offset, size, value):
        self.writes.append((offset, size, value))


def test_bus_routes_accesses_and_masks_to_size():
    bus = MmioBus()
    regs = Regs()
    bus.add(0x1000, 0x100, regs, "regs")
    assert bus.read(0x1000, 4) == 0x55667788
    assert bus.read(0x1000, 1) == 0x88
    bus.write(0x1004, 2, 0x12345)
    assert regs.writes == [(4, 2, 0x2345)]


def test_bus_refuses_overlapping_regions():
    bus = MmioBus()
    bus.add(0x1000, 0x100, Regs(), "a")
    with pytest.raises(BusError, match="overlaps 'a'"):
        bus.add(0x10F0, 0x100, Regs(), "b")
    with pytest.raises(BusError, match="overlaps 'a'"):
        bus.add(0x0F00, 0x200, Regs(), "c")
    bus.add(0x1100, 0x100, Regs(), "d")  # adjacent is fine


@pytest.mark.parametrize("addr,size,why", [
    (0x5000, 4, "no region"),
    (0x10FE, 4, "no region"),     # straddles the end of the region
    (0x1000, 3, "access size 3"),
])
def test_bus_unclaimed_access_reads_all_ones_is_logged_and_writes_are_dropped(addr, size, why):
    bus = MmioBus()
    regs = Regs()
    bus.add(0x1000, 0x100, regs, "regs")
    value = bus.read(addr, size)
    assert value == ((1 << 64) - 1 if size == 3 else (1 << (8 * size)) - 1)
    bus.write(addr, size, 7)
    assert regs.writes == []
    assert len(bus.unclaimed) == 2
    assert all(why in u.reason for u in bus.unclaimed)
    assert [u.write for u in bus.unclaimed] == [False, True]
