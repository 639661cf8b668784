"""VFIO container with the TYPE1v2 IOMMU: the kernel's rules and errnos, bad input first."""
import errno
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from vmm_ram import random_ram  # noqa: E402

from device_model.ports import DmaFault  # noqa: E402
from vmm.iommu import PAGE_SIZE, Iommu, IommuDma, bdf  # noqa: E402
from vmm.memory import GuestMemory, HostMemory  # noqa: E402
from vmm.vfio import VfioContainer, VfioGroup, vaddr_of  # noqa: E402
from vmm.vfio import uapi  # noqa: E402

RAM_BASE = 0x0
RAM_SIZE = 1 << 21
RID = bdf(1, 0, 1)


class NullDevice:
    """Enough of the VfioDevice protocol for container tests."""


@pytest.fixture
def ram():
    # guest RAM does not start at host offset 0: vaddr != gpa
    yield from random_ram(RAM_BASE, RAM_SIZE, seed=11, host_offset=0x10000)


@pytest.fixture
def iommu():
    return Iommu()


@pytest.fixture
def container(iommu, ram):
    c = VfioContainer(iommu, [ram])
    g = VfioGroup(7)
    g.add_device("0000:01:00.1", NullDevice(), RID)
    g.set_container(c)
    c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    return c


def dma_map(iova, vaddr, size, flags=uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE):
    m = uapi.new("struct vfio_iommu_type1_dma_map *")
    m.flags, m.iova, m.vaddr, m.size = flags, iova, vaddr, size
    return m


def dma_unmap(iova, size, flags=0):
    u = uapi.new("struct vfio_iommu_type1_dma_unmap *")
    u.flags, u.iova, u.size = flags, iova, size
    return u


def raw(cdata):
    return bytes(uapi.ffi.buffer(cdata))


def layout(container):
    return [(m.iova, m.size, m.address, m.read, m.write) for m in container.domain.mappings]


def test_api_version_and_extensions(iommu):
    c = VfioContainer(iommu)
    assert c.get_api_version() == uapi.VFIO_API_VERSION == 0
    assert c.ioctl(uapi.VFIO_GET_API_VERSION) == 0
    assert c.check_extension(uapi.VFIO_TYPE1v2_IOMMU) == 1
    assert c.ioctl(uapi.VFIO_CHECK_EXTENSION, uapi.VFIO_UNMAP_ALL) == 1
    for ext in (uapi.VFIO_TYPE1_IOMMU, uapi.VFIO_NOIOMMU_IOMMU, uapi.VFIO_UPDATE_VADDR, 12345, -1):
        assert c.check_extension(ext) == 0  # unknown or not offered: 0, never an error


def test_set_iommu_before_a_group_is_einval(iommu):
    c = VfioContainer(iommu)
    with pytest.raises(OSError) as e:
        c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    assert e.value.errno == errno.EINVAL and "no group" in str(e.value)
    with pytest.raises(OSError) as e:
        c.ioctl(uapi.VFIO_SET_IOMMU, uapi.VFIO_TYPE1v2_IOMMU)
    assert e.value.errno == errno.EINVAL
    assert c.iommu_type is None and c.domain is None


def test_set_iommu_rules(iommu, ram):
    c = VfioContainer(iommu, [ram])
    g = VfioGroup(1)
    g.add_device("a", NullDevice(), RID)
    g.set_container(c)
    for bad in (uapi.VFIO_TYPE1_IOMMU, uapi.VFIO_SPAPR_TCE_IOMMU, 99):
        with pytest.raises(OSError) as e:
            c.set_iommu(bad)
        assert e.value.errno == errno.ENODEV
    assert c.domain is None and iommu.domain_of(RID) is None
    c.ioctl(uapi.VFIO_SET_IOMMU, uapi.VFIO_TYPE1v2_IOMMU)
    assert c.iommu_type == uapi.VFIO_TYPE1v2_IOMMU and iommu.domain_of(RID) is c.domain
    with pytest.raises(OSError) as e:
        c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    assert e.value.errno == errno.EINVAL and "already" in str(e.value)


def test_set_iommu_when_a_requester_is_taken_elsewhere_is_ebusy_and_rolls_back(iommu, ram):
    other = iommu.create_domain()
    iommu.attach(bdf(1, 0, 2), other)
    c = VfioContainer(iommu, [ram])
    g = VfioGroup(1)
    g.add_device("a", NullDevice(), RID)
    g.add_device("b", NullDevice(), bdf(1, 0, 2))
    g.set_container(c)
    with pytest.raises(OSError) as e:
        c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    assert e.value.errno == errno.EBUSY and "01:00.2" in str(e.value)
    assert c.domain is None and iommu.domain_of(RID) is None and iommu.domain_of(bdf(1, 0, 2)) is other


def test_iommu_ioctls_before_set_iommu_are_einval(iommu, ram):
    c = VfioContainer(iommu, [ram])
    for call, arg in [(c.iommu_get_info, uapi.new("struct vfio_iommu_type1_info *")),
                      (c.iommu_map_dma, dma_map(0, vaddr_of(ram, 0), PAGE_SIZE)),
                      (c.iommu_unmap_dma, dma_unmap(0, PAGE_SIZE))]:
        with pytest.raises(OSError) as e:
            call(arg)
        assert e.value.errno == errno.EINVAL and "no IOMMU" in str(e.value)
    with pytest.raises(OSError) as e:
        c.ioctl(uapi.VFIO_IOMMU_MAP_DMA, dma_map(0, 0, PAGE_SIZE))
    assert e.value.errno == errno.EINVAL


def test_get_info_reports_4k_pages(container):
    info = uapi.new("struct vfio_iommu_type1_info *")
    info.cap_offset = 77
    container.ioctl(uapi.VFIO_IOMMU_GET_INFO, info)
    assert info.flags == uapi.VFIO_IOMMU_INFO_PGSIZES and info.iova_pgsizes == PAGE_SIZE
    assert info.cap_offset == 0
    short = uapi.new("struct vfio_iommu_type1_info *")
    short.argsz = uapi.offsetofend("vfio_iommu_type1_info", "iova_pgsizes") - 1
    before = raw(short)
    with pytest.raises(OSError) as e:
        container.iommu_get_info(short)
    assert e.value.errno == errno.EINVAL and raw(short) == before


def test_unknown_ioctl_numbers(iommu, container):
    with pytest.raises(OSError) as e:
        container.ioctl(uapi.VFIO_DEVICE_RESET)
    assert e.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as e:
        VfioContainer(iommu).ioctl(uapi.VFIO_DEVICE_RESET)
    assert e.value.errno == errno.EINVAL


def test_wrong_struct_type_is_a_type_error(container):
    with pytest.raises(TypeError, match="vfio_iommu_type1_dma_map"):
        container.iommu_map_dma(uapi.new("struct vfio_iommu_type1_dma_unmap *"))
    with pytest.raises(TypeError):
        container.iommu_map_dma({"iova": 0})
    with pytest.raises(TypeError):
        container.iommu_unmap_dma("struct vfio_iommu_type1_dma_unmap")


def test_map_dma_gives_the_device_guest_ram_at_iova_equal_gpa(container, iommu, ram):
    m = dma_map(RAM_BASE, vaddr_of(ram, RAM_BASE), RAM_SIZE)
    container.ioctl(uapi.VFIO_IOMMU_MAP_DMA, m)
    dev = IommuDma(iommu, RID)
    dev.write(0x1234, b"from the device")
    assert ram.read(0x1234, 15) == b"from the device"
    assert dev.read(RAM_SIZE - 4, 4) == ram.read(RAM_SIZE - 4, 4)
    assert np.shares_memory(dev.view(0x10_0000, 64), ram.view(RAM_BASE, RAM_SIZE))
    with pytest.raises(DmaFault, match="not mapped"):
        dev.read(RAM_SIZE, 1)


def test_read_only_map_refuses_device_writes(container, iommu, ram):
    container.iommu_map_dma(dma_map(0x0, vaddr_of(ram, 0x8000), PAGE_SIZE, uapi.VFIO_DMA_MAP_FLAG_READ))
    dev = IommuDma(iommu, RID)
    before = ram.view(RAM_BASE, RAM_SIZE).copy()
    assert dev.read(0x10, 4) == ram.read(0x8010, 4)
    with pytest.raises(DmaFault, match="no write permission"):
        dev.write(0x10, b"\xff\xff\xff\xff")
    assert np.array_equal(before, ram.view(RAM_BASE, RAM_SIZE))
    assert iommu.faults[-1].write and iommu.faults[-1].iova == 0x10


RW = uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE
V = 0x10000  # host offset of guest RAM in the fixture: vaddr of gpa 0


@pytest.mark.parametrize("iova,vaddr,size,flags,err,match", [
    (0x10_0800, V, PAGE_SIZE, RW, errno.EINVAL, "aligned"),                # unaligned iova
    (0x10_0000, V + 0x10, PAGE_SIZE, RW, errno.EINVAL, "aligned"),         # unaligned vaddr
    (0x10_0000, V, PAGE_SIZE + 1, RW, errno.EINVAL, "aligned"),            # unaligned size
    (0x10_0000, V, 0, RW, errno.EINVAL, "non-zero"),                       # zero size
    (0x10_0000, V, PAGE_SIZE, 0, errno.EINVAL, "neither"),                 # no permission
    (0x10_0000, V, PAGE_SIZE, RW | 1 << 7, errno.EINVAL, "unknown flags"),
    (0x10_0000, V, PAGE_SIZE, RW | uapi.VFIO_DMA_MAP_FLAG_VADDR, errno.EINVAL, "FLAG_VADDR"),
    ((1 << 64) - PAGE_SIZE, V, 2 * PAGE_SIZE, RW, errno.EINVAL, "wraps"),  # iova + size overflows
    (0x10_0000, (1 << 64) - PAGE_SIZE, 2 * PAGE_SIZE, RW, errno.EINVAL, "wraps"),
    (1 << 48, V, PAGE_SIZE, RW, errno.EINVAL, "outside the IOMMU"),        # past the aperture
    (0x10_0000, V + RAM_SIZE, PAGE_SIZE, RW, errno.EFAULT, "not inside registered guest RAM"),
    (0x10_0000, V - PAGE_SIZE, 2 * PAGE_SIZE, RW, errno.EFAULT, "not inside registered guest RAM"),
    (0x20_0000, V, PAGE_SIZE, RW, errno.EEXIST, "overlaps"),               # same range
    (0x20_1000, V, PAGE_SIZE, RW, errno.EEXIST, "overlaps"),               # inside it
    (0x1f_f000, V, 2 * PAGE_SIZE, RW, errno.EEXIST, "overlaps"),           # its head
    (0x20_3000, V, 2 * PAGE_SIZE, RW, errno.EEXIST, "overlaps"),           # its tail
    (0x1f_0000, V, 0x2_0000, RW, errno.EEXIST, "overlaps"),                # around it
])
def test_bad_map_dma_fails_with_the_kernels_errno_and_changes_nothing(
        container, iommu, ram, iova, vaddr, size, flags, err, match):
    container.iommu_map_dma(dma_map(0x20_0000, vaddr_of(ram, 0x4000), 4 * PAGE_SIZE))
    before = layout(container)
    m = dma_map(iova, vaddr, size, flags)
    struct_before = raw(m)
    with pytest.raises(OSError) as e:
        container.iommu_map_dma(m)
    assert e.value.errno == err, e.value
    assert match in str(e.value)
    assert layout(container) == before and raw(m) == struct_before


def test_map_dma_argsz_too_small(container, ram):
    m = dma_map(0, vaddr_of(ram, 0), PAGE_SIZE)
    m.argsz = 16
    with pytest.raises(OSError) as e:
        container.iommu_map_dma(m)
    assert e.value.errno == errno.EINVAL and container.domain.mappings == ()


def test_map_dma_entry_limit_is_enospc(iommu, ram):
    c = VfioContainer(iommu, [ram], dma_entry_limit=2)
    g = VfioGroup(1)
    g.add_device("a", NullDevice(), RID)
    g.set_container(c)
    c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    c.iommu_map_dma(dma_map(0x0, vaddr_of(ram, 0), PAGE_SIZE))
    c.iommu_map_dma(dma_map(0x1000, vaddr_of(ram, 0), PAGE_SIZE))  # aliasing is allowed
    with pytest.raises(OSError) as e:
        c.iommu_map_dma(dma_map(0x2000, vaddr_of(ram, 0), PAGE_SIZE))
    assert e.value.errno == errno.ENOSPC


def test_map_at_the_top_of_64_bits_is_not_an_overflow_but_outside_the_aperture(container, ram):
    with pytest.raises(OSError) as e:
        container.iommu_map_dma(dma_map((1 << 64) - PAGE_SIZE, vaddr_of(ram, 0), PAGE_SIZE))
    assert e.value.errno == errno.EINVAL and "outside the IOMMU" in str(e.value)


@pytest.fixture
def mapped(container, ram):
    """Three mappings: [0x10000, +0x4000), [0x14000, +0x2000), [0x20000, +0x1000)."""
    for iova, size in [(0x10000, 0x4000), (0x14000, 0x2000), (0x20000, 0x1000)]:
        container.iommu_map_dma(dma_map(iova, vaddr_of(ram, iova), size))
    return container


@pytest.mark.parametrize("iova,size,flags,match", [
    (0x11000, 0x1000, 0, "starts inside"),            # would split the first mapping
    (0x10000, 0x1000, 0, "ends inside"),              # its head only
    (0x12000, 0x4000, 0, "starts inside"),            # tail of one + all of the next
    (0x10000, 0x5000, 0, "ends inside"),              # all of one + head of the next
    (0x10800, 0x4000, 0, "aligned"),                  # unaligned iova
    (0x10000, 0x4800, 0, "aligned"),                  # unaligned size
    (0x10000, 0, 0, "non-zero"),                      # zero size
    ((1 << 64) - PAGE_SIZE, 2 * PAGE_SIZE, 0, "wrap"),
    (0x10000, 0x4000, 1 << 5, "unknown flags"),
    (0x10000, 0x4000, uapi.VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP, "dirty"),
    (0x10000, 0x4000, uapi.VFIO_DMA_UNMAP_FLAG_VADDR, "VADDR"),
    (0x10000, 0, uapi.VFIO_DMA_UNMAP_FLAG_ALL, "iova = size = 0"),
    (0, 0x1000, uapi.VFIO_DMA_UNMAP_FLAG_ALL, "iova = size = 0"),
])
def test_bad_unmap_dma_is_einval_and_changes_nothing(mapped, iova, size, flags, match):
    before = layout(mapped)
    u = dma_unmap(iova, size, flags)
    struct_before = raw(u)
    with pytest.raises(OSError) as e:
        mapped.iommu_unmap_dma(u)
    assert e.value.errno == errno.EINVAL
    assert match in str(e.value)
    assert layout(mapped) == before and raw(u) == struct_before


def test_unmap_of_whole_mappings_reports_the_size(mapped, iommu, ram):
    u = dma_unmap(0x0, 0x18000)  # covers the first two whole, and holes around them
    mapped.ioctl(uapi.VFIO_IOMMU_UNMAP_DMA, u)
    assert u.size == 0x6000
    assert [m[:2] for m in layout(mapped)] == [(0x20000, 0x1000)]
    with pytest.raises(DmaFault, match="not mapped"):
        IommuDma(iommu, RID).read(0x10000, 1)
    u = dma_unmap(0x40000, 0x1000)  # nothing there: success, size 0
    mapped.iommu_unmap_dma(u)
    assert u.size == 0
    u = dma_unmap(0x20000, 0x1000)  # exactly one mapping
    mapped.iommu_unmap_dma(u)
    assert u.size == 0x1000 and mapped.domain.mappings == ()


def test_unmap_all(mapped):
    u = dma_unmap(0, 0, uapi.VFIO_DMA_UNMAP_FLAG_ALL)
    mapped.iommu_unmap_dma(u)
    assert u.size == 0x7000 and mapped.domain.mappings == ()


def test_unmap_up_to_the_top_of_64_bits(mapped):
    u = dma_unmap(0x1_0000_0000, (1 << 64) - 0x1_0000_0000)
    mapped.iommu_unmap_dma(u)
    assert u.size == 0 and len(mapped.domain.mappings) == 3


def test_vaddr_of_and_register_memory(iommu, ram):
    assert vaddr_of(ram, RAM_BASE) == ram.host_offset == 0x10000
    with pytest.raises(ValueError):
        vaddr_of(ram, RAM_BASE + RAM_SIZE)
    c = VfioContainer(iommu)
    c.register_memory(ram)
    c.register_memory(ram)  # the same memory twice is a no-op
    other_host = HostMemory(1 << 16)
    try:
        with pytest.raises(ValueError, match="another HostMemory"):
            c.register_memory(GuestMemory(other_host, 0x1000_0000, 1 << 16))
    finally:
        other_host.close()


def test_two_ram_regions_of_one_host(iommu):
    host = HostMemory(1 << 20)
    try:
        low, high = GuestMemory(host, 0x0, 1 << 19), GuestMemory(host, 0x1_0000_0000, 1 << 19)
        c = VfioContainer(iommu, [low, high])
        g = VfioGroup(1)
        g.add_device("a", NullDevice(), RID)
        g.set_container(c)
        c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
        c.iommu_map_dma(dma_map(0x0, vaddr_of(low, 0x0), 1 << 19))
        c.iommu_map_dma(dma_map(0x1_0000_0000, vaddr_of(high, 0x1_0000_0000), 1 << 19))
        with pytest.raises(OSError) as e:  # one vaddr range may not straddle two regions
            c.iommu_map_dma(dma_map(0x2_0000_0000, vaddr_of(low, (1 << 19) - PAGE_SIZE), 2 * PAGE_SIZE))
        assert e.value.errno == errno.EFAULT
        dev = IommuDma(iommu, RID)
        dev.write(0x1_0000_0010, b"high")
        assert high.read(0x1_0000_0010, 4) == b"high"
    finally:
        host.close()
