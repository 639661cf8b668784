"""The host IOMMU and IommuDma: translation, permissions, faults that touch nothing."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from vmm_ram import random_ram  # noqa: E402

from device_model.ports import DmaFault, DmaPort  # noqa: E402
from vmm.iommu import PAGE_SIZE, Iommu, IommuDma, IommuError, IommuFault, bdf, format_bdf  # noqa: E402
from vmm.memory import HostMemory  # noqa: E402

RAM_BASE = 0x4000_0000
RAM_SIZE = 1 << 20
RID = bdf(1, 0, 1)


@pytest.fixture
def ram():
    yield from random_ram(RAM_BASE, RAM_SIZE, seed=7)


@pytest.fixture
def iommu():
    return Iommu()


@pytest.fixture
def domain(iommu):
    d = iommu.create_domain()
    iommu.attach(RID, d)
    return d


@pytest.fixture
def dma(iommu, domain):
    return IommuDma(iommu, RID)


def snapshot(mem):
    return mem.view(RAM_BASE, RAM_SIZE).copy()


def test_bdf_round_trip_and_bounds():
    assert bdf(0, 0, 0) == 0 and bdf(0xFF, 31, 7) == 0xFFFF
    assert format_bdf(bdf(0x3A, 2, 5)) == "3a:02.5"
    for bad in [(256, 0, 0), (0, 32, 0), (0, 0, 8), (-1, 0, 0)]:
        with pytest.raises(IommuError):
            bdf(*bad)


def test_iommu_dma_is_a_dma_port(dma):
    port: DmaPort = dma  # noqa: F841 (the assignment is the structural check for a type checker)
    for name in ("read", "write", "view"):
        assert callable(getattr(dma, name))


def test_map_translates_iova_to_guest_ram_zero_copy(iommu, domain, dma, ram):
    iommu.map(domain, 0x10_0000, ram, RAM_BASE + 0x2000, 4 * PAGE_SIZE)
    assert dma.read(0x10_0010, 8) == ram.read(RAM_BASE + 0x2010, 8)
    dma.write(0x10_0ffe, b"\xaa\xbb\xcc\xdd")  # crosses a page boundary inside one mapping
    assert ram.read(RAM_BASE + 0x2ffe, 4) == b"\xaa\xbb\xcc\xdd"
    v = dma.view(0x10_1000, 16)
    v[:] = 0x5A
    assert ram.read(RAM_BASE + 0x3000, 16) == b"\x5a" * 16
    assert np.shares_memory(v, ram.view(RAM_BASE, RAM_SIZE))
    dma.write(0x10_0100, np.arange(4, dtype=np.float32))
    assert np.array_equal(ram.view(RAM_BASE + 0x2100, 16).view(np.float32), np.arange(4, dtype=np.float32))
    dma.write(0x10_0200, memoryview(b"xyz"))
    assert ram.read(RAM_BASE + 0x2200, 3) == b"xyz"
    assert dma.bytes_read == 8 and dma.bytes_written == 4 + 16 + 3
    assert not iommu.faults


def test_scatter_across_mappings_with_different_backings(iommu, domain, dma, ram):
    other = np.zeros(4 * PAGE_SIZE, dtype=np.uint8)
    iommu.map(domain, 0x20_0000, ram, RAM_BASE + 0x8000, PAGE_SIZE)
    iommu.map(domain, 0x20_1000, other, PAGE_SIZE, PAGE_SIZE)          # an array backing
    iommu.map(domain, 0x20_2000, ram, RAM_BASE + 0x1000, PAGE_SIZE)
    data = bytes(range(256)) * 48  # 3 pages
    dma.write(0x20_0000, data)
    assert ram.read(RAM_BASE + 0x8000, PAGE_SIZE) == data[:PAGE_SIZE]
    assert other[PAGE_SIZE:2 * PAGE_SIZE].tobytes() == data[PAGE_SIZE:2 * PAGE_SIZE]
    assert ram.read(RAM_BASE + 0x1000, PAGE_SIZE) == data[2 * PAGE_SIZE:]
    assert dma.read(0x20_0800, 2 * PAGE_SIZE) == data[0x800:0x2800]
    # mapped but scattered: no zero-copy view, and that is not an IOMMU fault
    with pytest.raises(DmaFault, match="not contiguous"):
        dma.view(0x20_0ff0, 32)
    assert not iommu.faults


def test_view_spans_adjacent_mappings_that_are_contiguous_in_the_backing(iommu, domain, dma, ram):
    iommu.map(domain, 0x30_0000, ram, RAM_BASE, PAGE_SIZE)
    iommu.map(domain, 0x30_1000, ram, RAM_BASE + PAGE_SIZE, PAGE_SIZE)
    v = dma.view(0x30_0800, PAGE_SIZE)
    assert np.shares_memory(v, ram.view(RAM_BASE, RAM_SIZE)) and v.size == PAGE_SIZE
    assert v.tobytes() == ram.read(RAM_BASE + 0x800, PAGE_SIZE)


def test_write_whose_source_aliases_a_target_segment(iommu, domain, dma, ram):
    iommu.map(domain, 0x0, ram, RAM_BASE + 0x1000, PAGE_SIZE)
    iommu.map(domain, 0x1000, ram, RAM_BASE + 0x8000, PAGE_SIZE)
    expect = ram.read(RAM_BASE, 2 * PAGE_SIZE)
    src = ram.view(RAM_BASE, 2 * PAGE_SIZE)  # its second page is the first segment's target
    dma.write(0x0, src)
    assert ram.read(RAM_BASE + 0x1000, PAGE_SIZE) == expect[:PAGE_SIZE]
    assert ram.read(RAM_BASE + 0x8000, PAGE_SIZE) == expect[PAGE_SIZE:]


@pytest.mark.parametrize("op", ["read", "write", "view"])
@pytest.mark.parametrize("iova,length,where", [
    (0x9000_0000, 16, 0x9000_0000),      # nothing mapped there at all
    (0x10_3ff0, 0x20, 0x10_4000),        # runs off the end of the mapping
    (0x0f_fff0, 0x20, 0x0f_f000),        # starts just before it
    (0x10_0000, 0x6000, 0x10_4000),      # spans the mapping and the hole after
])
def test_unmapped_iova_faults_logs_and_touches_nothing(iommu, domain, dma, ram, op, iova, length, where):
    iommu.map(domain, 0x10_0000, ram, RAM_BASE, 4 * PAGE_SIZE)
    iommu.map(domain, 0x10_5000, ram, RAM_BASE + 0x5000, PAGE_SIZE)
    before = snapshot(ram)
    with pytest.raises(DmaFault) as e:
        if op == "read":
            dma.read(iova, length)
        elif op == "write":
            dma.write(iova, b"\xee" * length)
        else:
            dma.view(iova, length)
    assert f"IOVA page {where:#x} is not mapped" in str(e.value)
    assert (e.value.iova, e.value.length) == (iova, length)
    assert list(iommu.faults) == [IommuFault(RID, iova, length, op != "read", e.value.reason.split(": ", 1)[1])]
    assert np.array_equal(before, snapshot(ram))
    assert dma.bytes_read == dma.bytes_written == 0


def test_permission_faults(iommu, domain, dma, ram):
    iommu.map(domain, 0x0, ram, RAM_BASE, PAGE_SIZE, read=True, write=False)
    iommu.map(domain, 0x1000, ram, RAM_BASE + 0x1000, PAGE_SIZE, read=False, write=True)
    before = snapshot(ram)
    with pytest.raises(DmaFault, match="read-only mapping .*no write permission"):
        dma.write(0x10, b"\x01\x02")
    with pytest.raises(DmaFault, match="read-only"):
        dma.write(0xff0, b"\x00" * 0x20)  # the write-only half would be fine: still nothing written
    with pytest.raises(DmaFault, match="write-only mapping .*no read permission"):
        dma.read(0x1000, 4)
    with pytest.raises(DmaFault, match="read-only"):
        dma.view(0x0, 16)  # a writable view needs write permission
    with pytest.raises(DmaFault, match="write-only"):
        dma.view(0x1000, 16)  # every view needs read permission
    assert np.array_equal(before, snapshot(ram))
    assert [(f.iova, f.write) for f in iommu.faults] == [
        (0x10, True), (0xff0, True), (0x1000, False), (0x0, True), (0x1000, True)]
    # what is allowed still works
    assert dma.read(0x0, 4) == ram.read(RAM_BASE, 4)
    dma.write(0x1000, b"ok")
    ro = dma.view(0x0, 16, write=False)
    assert not ro.flags.writeable and ro.tobytes() == ram.read(RAM_BASE, 16)
    dma.check(0x0, 16, write=False)
    with pytest.raises(DmaFault):
        dma.check(0x0, 16, write=True)


def test_requester_without_domain_faults(iommu, ram):
    d = iommu.create_domain()
    iommu.map(d, 0x0, ram, RAM_BASE, PAGE_SIZE)
    stray = IommuDma(iommu, bdf(2, 0, 0))
    before = snapshot(ram)
    for call in (lambda: stray.read(0, 4), lambda: stray.write(0, b"1234"), lambda: stray.view(0, 4)):
        with pytest.raises(DmaFault, match="02:00.0: attached to no IOMMU domain"):
            call()
    assert [f.reason for f in iommu.faults] == ["attached to no IOMMU domain"] * 3
    assert np.array_equal(before, snapshot(ram))


def test_detach_stops_dma_at_once(iommu, domain, dma, ram):
    iommu.map(domain, 0x0, ram, RAM_BASE, PAGE_SIZE)
    dma.write(0x0, b"x")
    iommu.detach(RID)
    with pytest.raises(DmaFault, match="no IOMMU domain"):
        dma.write(0x0, b"y")
    assert ram.read(RAM_BASE, 1) == b"x"


def test_bad_lengths_and_64_bit_overflow_fault(iommu, domain, dma, ram):
    iommu.map(domain, 0x0, ram, RAM_BASE, PAGE_SIZE)
    with pytest.raises(DmaFault, match="negative length"):
        dma.read(0x0, -1)
    with pytest.raises(DmaFault, match="overflows 64 bits"):
        dma.read((1 << 64) - 8, 16)
    assert iommu.fault_count == 2
    assert dma.read(0x0, 0) == b"" and dma.view(0x10, 0).size == 0


def test_attach_rules(iommu):
    a, b = iommu.create_domain(), iommu.create_domain()
    iommu.attach(RID, a)
    with pytest.raises(IommuError, match="already attached to domain"):
        iommu.attach(RID, b)
    with pytest.raises(IommuError, match="attached to no domain"):
        iommu.detach(bdf(9, 0, 0))
    with pytest.raises(IommuError, match="16-bit"):
        iommu.attach(0x10000, a)
    with pytest.raises(IommuError, match="still has requesters"):
        iommu.destroy_domain(a)
    iommu.detach(RID)
    iommu.destroy_domain(a)
    with pytest.raises(IommuError, match="not a live domain"):
        iommu.attach(RID, a)
    with pytest.raises(IommuError, match="not a live domain"):
        Iommu().attach(RID, b)
    assert iommu.domain_of(RID) is None


@pytest.mark.parametrize("iova,offset,size,kw,match", [
    (0x800, RAM_BASE, PAGE_SIZE, {}, "aligned"),
    (0x0, RAM_BASE + 4, PAGE_SIZE, {}, "aligned"),
    (0x0, RAM_BASE, 100, {}, "aligned"),
    (0x0, RAM_BASE, 0, {}, "positive"),
    (0x0, RAM_BASE, PAGE_SIZE, {"read": False, "write": False}, "read or write"),
    (1 << 48, RAM_BASE, PAGE_SIZE, {}, "aperture"),
    ((1 << 48) - PAGE_SIZE, RAM_BASE, 2 * PAGE_SIZE, {}, "aperture"),
    (0x0, RAM_BASE + RAM_SIZE, PAGE_SIZE, {}, "outside guest RAM"),
    (0x0, RAM_BASE - PAGE_SIZE, 2 * PAGE_SIZE, {}, "outside guest RAM"),
    (0x5000, RAM_BASE, PAGE_SIZE, {}, "overlaps mapping"),       # inside the existing one
    (0x3000, RAM_BASE, 2 * PAGE_SIZE, {}, "overlaps mapping"),   # its head
    (0x7000, RAM_BASE, 2 * PAGE_SIZE, {}, "overlaps mapping"),   # its tail
    (0x0, RAM_BASE, 0x10000, {}, "overlaps mapping"),            # covers it
])
def test_bad_map_changes_nothing(iommu, domain, ram, iova, offset, size, kw, match):
    iommu.map(domain, 0x4000, ram, RAM_BASE, 4 * PAGE_SIZE)
    before = domain.mappings
    with pytest.raises(IommuError, match=match):
        iommu.map(domain, iova, ram, offset, size, **kw)
    assert domain.mappings == before


def test_bad_backings(iommu, domain, ram):
    with pytest.raises(IommuError, match="cannot map onto"):
        iommu.map(domain, 0, b"abc" * 4096, 0, PAGE_SIZE)  # type: ignore[arg-type]
    with pytest.raises(IommuError, match="flat, contiguous uint8"):
        iommu.map(domain, 0, np.zeros(PAGE_SIZE, dtype=np.float32), 0, PAGE_SIZE)
    with pytest.raises(IommuError, match="outside the backing"):
        iommu.map(domain, 0, np.zeros(PAGE_SIZE, dtype=np.uint8), PAGE_SIZE, PAGE_SIZE)
    assert domain.mappings == ()


def test_host_memory_backing(iommu, domain, dma):
    host = HostMemory(1 << 16)
    try:
        iommu.map(domain, 0x7000_0000, host, 0x2000, PAGE_SIZE)
        dma.write(0x7000_0004, b"host")
        assert host.array[0x2004:0x2008].tobytes() == b"host"
    finally:
        iommu.unmap(domain, 0x7000_0000, PAGE_SIZE)
        host.close()


def test_unmap_is_per_page_and_may_split(iommu, domain, dma, ram):
    iommu.map(domain, 0x0, ram, RAM_BASE, 4 * PAGE_SIZE)
    assert iommu.unmap(domain, 0x1000, 2 * PAGE_SIZE) == 2 * PAGE_SIZE
    assert [(m.iova, m.size, m.address) for m in domain.mappings] == [
        (0x0, PAGE_SIZE, RAM_BASE), (0x3000, PAGE_SIZE, RAM_BASE + 0x3000)]
    assert dma.read(0x3000, 4) == ram.read(RAM_BASE + 0x3000, 4)
    with pytest.raises(DmaFault, match="0x1000 is not mapped"):
        dma.read(0x0, 0x2000)
    assert iommu.unmap(domain, 0x10_0000, PAGE_SIZE) == 0  # nothing there
    for bad in [(0x800, PAGE_SIZE), (0x0, 0), (0x0, 100), ((1 << 64) - PAGE_SIZE, 2 * PAGE_SIZE)]:
        with pytest.raises(IommuError):
            iommu.unmap(domain, *bad)
    assert len(domain.mappings) == 2


def test_large_ranges_translate_per_mapping_not_per_page(iommu, domain, dma):
    host = HostMemory(1 << 30)  # memfd: pages are only allocated when touched
    try:
        iommu.map(domain, 0x1_0000_0000, host, 0, 1 << 30)
        assert len(domain.translate(0x1_0000_0000, 1 << 30, read=True, write=True)) == 1
        v = dma.view(0x1_0000_0000 + (1 << 29), 1 << 20)
        assert v.size == 1 << 20 and np.shares_memory(v, host.array)
    finally:
        iommu.unmap(domain, 0x1_0000_0000, 1 << 30)
        host.close()


def test_many_small_mappings(iommu, domain, dma, ram):
    # 256 single-page mappings, mapped in a shuffled order, backed in reverse page order
    order = np.random.default_rng(3).permutation(256)
    for i in order:
        iommu.map(domain, int(i) * PAGE_SIZE, ram, RAM_BASE + (255 - int(i)) * PAGE_SIZE, PAGE_SIZE)
    data = np.random.default_rng(4).integers(0, 256, 256 * PAGE_SIZE, dtype=np.uint8)
    dma.write(0x0, data)
    assert dma.read(0x0, 256 * PAGE_SIZE) == data.tobytes()
    assert ram.read(RAM_BASE + 255 * PAGE_SIZE, PAGE_SIZE) == data[:PAGE_SIZE].tobytes()
    assert [m.iova for m in domain.mappings] == [i * PAGE_SIZE for i in range(256)]


def test_fault_log_is_bounded_and_traced(ram):
    events = []

    class Tracer:
        def emit(self, kind, **fields):
            events.append((kind, fields))

    iommu = Iommu(fault_log_size=4, tracer=Tracer())
    dma = IommuDma(iommu, RID)
    for i in range(10):
        with pytest.raises(DmaFault):
            dma.read(i * PAGE_SIZE, 1)
    assert iommu.fault_count == 10
    assert [f.iova for f in iommu.faults] == [6 * PAGE_SIZE, 7 * PAGE_SIZE, 8 * PAGE_SIZE, 9 * PAGE_SIZE]
    assert events[0] == ("iommu_fault", {"requester": "01:00.1", "iova": 0, "length": 1,
                                         "write": False, "reason": "attached to no IOMMU domain"})


def test_domains_are_isolated(iommu, ram):
    a, b = iommu.create_domain(), iommu.create_domain()
    ra, rb = bdf(1, 0, 1), bdf(1, 0, 2)
    iommu.attach(ra, a)
    iommu.attach(rb, b)
    iommu.map(a, 0x0, ram, RAM_BASE, PAGE_SIZE)
    iommu.map(b, 0x0, ram, RAM_BASE + PAGE_SIZE, PAGE_SIZE)
    IommuDma(iommu, ra).write(0, b"A")
    IommuDma(iommu, rb).write(0, b"B")
    assert ram.read(RAM_BASE, 1) == b"A" and ram.read(RAM_BASE + PAGE_SIZE, 1) == b"B"
    with pytest.raises(DmaFault):
        IommuDma(iommu, rb).read(0x1000, 1)  # a's other pages are not b's


def test_cached_translation_ends_with_every_change_to_the_domain(iommu, domain, dma, ram):
    """The IOTLB-like cache of IommuDma never outlives an unmap, a permission change,
    a detach or a fault plan: each access after one is checked (and refused) again."""
    iommu.map(domain, 0x10_0000, ram, RAM_BASE, 4 * PAGE_SIZE)
    assert dma.read(0x10_0000, 4) == ram.read(RAM_BASE, 4)       # fills the cache
    iommu.unmap(domain, 0x10_1000, PAGE_SIZE)
    with pytest.raises(DmaFault, match="not mapped"):
        dma.read(0x10_1000, 4)
    assert dma.read(0x10_0000, 4) == ram.read(RAM_BASE, 4)
    iommu.unmap(domain, 0x10_0000, PAGE_SIZE)
    iommu.map(domain, 0x10_0000, ram, RAM_BASE, PAGE_SIZE, write=False)
    assert dma.read(0x10_0000, 4) == ram.read(RAM_BASE, 4)
    with pytest.raises(DmaFault, match="no write permission"):
        dma.write(0x10_0000, b"\x01")
    with pytest.raises(DmaFault, match="no write permission"):
        dma.view(0x10_0000, 4)
    assert dma.view(0x10_0000, 4, write=False).flags.writeable is False
    dma.read(0x10_2000, 4)
    iommu.detach(RID)
    with pytest.raises(DmaFault, match="no IOMMU domain"):
        dma.view(0x10_2000, 4)
    assert len(iommu.faults) == 4 and dma.bytes_written == 0


def test_a_fault_plan_sees_accesses_the_cache_would_have_served(iommu, domain, dma, ram):
    iommu.map(domain, 0x10_0000, ram, RAM_BASE, PAGE_SIZE)
    dma.write(0x10_0000, b"ok")
    seen = []

    class Hook:
        def dma(self, iova, length, reads, writes):
            seen.append((iova, length, reads, writes))
            return "injected"

    dma.fault_hook = Hook()
    with pytest.raises(DmaFault, match="injected"):
        dma.write(0x10_0000, b"no")
    assert seen == [(0x10_0000, 2, False, True)] and ram.read(RAM_BASE, 2) == b"ok"
    dma.fault_hook = None
    dma.write(0x10_0000, b"go")
    assert ram.read(RAM_BASE, 2) == b"go"


def test_ring_view_only_inside_one_writable_mapping_and_until_the_epoch_moves(
        iommu, domain, dma, ram):
    iommu.map(domain, 0x10_0000, ram, RAM_BASE, 2 * PAGE_SIZE)
    iommu.map(domain, 0x10_2000, ram, RAM_BASE + 0x2000, PAGE_SIZE, write=False)
    epoch = dma.view_epoch
    mv = dma.ring_view(0x10_0ff0, 32)
    assert mv is not None and len(mv) == 32
    mv[0:2] = b"\x12\x34"
    assert ram.read(RAM_BASE + 0xff0, 2) == b"\x12\x34"
    assert dma.bytes_written == 0 and dma.view_epoch == epoch
    assert dma.ring_view(0x10_1ff0, 32) is None      # runs into a read-only mapping
    assert dma.ring_view(0x30_0000, 8) is None       # not mapped: no fault logged
    assert not iommu.faults
    dma.probe_view(0x10_0000, 16)
    with pytest.raises(DmaFault, match="no write permission"):
        dma.probe_view(0x10_2000, 16)
    for change in (lambda: iommu.unmap(domain, 0x10_2000, PAGE_SIZE),
                   lambda: iommu.map(domain, 0x10_2000, ram, RAM_BASE, PAGE_SIZE),
                   lambda: setattr(dma, "fault_hook", None)):
        change()
        assert dma.view_epoch != epoch
        epoch = dma.view_epoch

    class Hook:
        def dma(self, iova, length, reads, writes):
            return None

    dma.fault_hook = Hook()
    assert dma.ring_view(0x10_0000, 8) is None       # a fault plan sees every access
