"""VFIO groups and device files: status, container membership, device fds, errnos."""
import errno

import numpy as np
import pytest

from device_model.ports import DmaFault
from vmm.iommu import PAGE_SIZE, Iommu, IommuDma, bdf
from vmm.memory import GuestMemory, HostMemory
from vmm.vfio import VfioContainer, VfioDevice, VfioDeviceFile, VfioGroup, vaddr_of
from vmm.vfio import uapi

RID_A = bdf(1, 0, 1)
RID_B = bdf(1, 0, 2)


class FakeDevice:
    """A VfioDevice that records calls, to check what the device file forwards."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.bar = np.zeros(PAGE_SIZE, dtype=np.uint8)

    def get_info(self, info):
        self.calls.append(("get_info",))
        info.flags = uapi.VFIO_DEVICE_FLAGS_PCI | uapi.VFIO_DEVICE_FLAGS_RESET
        info.num_regions, info.num_irqs = uapi.VFIO_PCI_NUM_REGIONS, uapi.VFIO_PCI_NUM_IRQS

    def get_region_info(self, info):
        self.calls.append(("get_region_info", info.index))
        info.size = PAGE_SIZE

    def get_irq_info(self, info):
        self.calls.append(("get_irq_info", info.index))

    def set_irqs(self, irq_set):
        self.calls.append(("set_irqs", irq_set.index))

    def reset(self):
        self.calls.append(("reset",))

    def region_read(self, index, offset, length):
        return self.bar[offset:offset + length].tobytes()

    def region_write(self, index, offset, data):
        self.bar[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def region_mmap(self, index, offset, length):
        return self.bar[offset:offset + length]


@pytest.fixture
def ram():
    host = HostMemory(1 << 20)
    yield GuestMemory(host, 0, 1 << 20)
    host.close()


@pytest.fixture
def iommu():
    return Iommu()


@pytest.fixture
def group():
    g = VfioGroup(12)
    g.add_device("0000:01:00.1", FakeDevice(), RID_A)
    return g


def status(group):
    s = uapi.new("struct vfio_group_status *")
    group.ioctl(uapi.VFIO_GROUP_GET_STATUS, s)
    return s.flags


def errno_of(call, *args):
    with pytest.raises(OSError) as e:
        call(*args)
    return e.value.errno


def ready(iommu, ram, group):
    c = VfioContainer(iommu, [ram])
    group.set_container(c)
    c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    return c


def test_fake_device_satisfies_the_protocol():
    dev: VfioDevice = FakeDevice()  # noqa: F841 (checked by a type checker)


def test_status_flags(iommu, group):
    assert status(group) == uapi.VFIO_GROUP_FLAGS_VIABLE
    group.ioctl(uapi.VFIO_GROUP_SET_CONTAINER, VfioContainer(iommu))
    assert status(group) == uapi.VFIO_GROUP_FLAGS_VIABLE | uapi.VFIO_GROUP_FLAGS_CONTAINER_SET
    group.ioctl(uapi.VFIO_GROUP_UNSET_CONTAINER)
    group.viable = False
    assert status(group) == 0


def test_status_argsz_too_small(group):
    s = uapi.new("struct vfio_group_status *")
    s.argsz, s.flags = 4, 0x55
    assert errno_of(group.get_status, s) == errno.EINVAL
    assert s.flags == 0x55


def test_set_container_errors(iommu, group):
    c = VfioContainer(iommu)
    assert errno_of(group.set_container, object()) == errno.EINVAL  # not a container
    group.set_container(c)
    assert errno_of(group.set_container, c) == errno.EINVAL         # already in one
    assert errno_of(group.set_container, VfioContainer(iommu)) == errno.EINVAL
    assert group.container is c and c.groups == [group]


def test_set_container_of_a_non_viable_group_is_eperm(iommu, group):
    group.viable = False
    c = VfioContainer(iommu)
    assert errno_of(group.set_container, c) == errno.EPERM
    assert group.container is None and c.groups == []


def test_set_container_after_set_iommu_joins_the_domain_or_is_ebusy(iommu, ram, group):
    c = ready(iommu, ram, group)
    g2 = VfioGroup(13)
    g2.add_device("0000:01:00.2", FakeDevice(), RID_B)
    g2.set_container(c)
    assert iommu.domain_of(RID_B) is c.domain
    g3 = VfioGroup(14)
    g3.add_device("0000:01:00.3", FakeDevice(), bdf(1, 0, 3))
    g3.add_device("0000:01:00.4", FakeDevice(), bdf(1, 0, 4))
    iommu.attach(bdf(1, 0, 4), iommu.create_domain())  # taken by someone else
    assert errno_of(g3.set_container, c) == errno.EBUSY
    assert g3.container is None and iommu.domain_of(bdf(1, 0, 3)) is None and g3 not in c.groups


def test_unset_container_errors(iommu, ram, group):
    assert errno_of(group.unset_container) == errno.EINVAL  # in no container
    c = ready(iommu, ram, group)
    f = group.get_device_fd("0000:01:00.1")
    assert errno_of(group.unset_container) == errno.EBUSY   # a device file is open
    assert group.container is c and c.domain is not None
    f.close()
    f.close()  # closing twice is harmless
    group.unset_container()
    assert group.container is None


def test_two_groups_share_mappings_and_the_last_one_out_releases_the_iommu(iommu, ram, group):
    c = ready(iommu, ram, group)
    g2 = VfioGroup(13)
    g2.add_device("0000:01:00.2", FakeDevice(), RID_B)
    g2.set_container(c)
    m = uapi.new("struct vfio_iommu_type1_dma_map *")
    m.flags = uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE
    m.vaddr, m.iova, m.size = vaddr_of(ram, 0), 0, 1 << 20
    c.iommu_map_dma(m)
    a, b = IommuDma(iommu, RID_A), IommuDma(iommu, RID_B)
    a.write(0x100, b"A")
    b.write(0x101, b"B")
    assert ram.read(0x100, 2) == b"AB"
    group.unset_container()                     # the other group keeps the IOMMU
    with pytest.raises(DmaFault, match="no IOMMU domain"):
        a.read(0x100, 1)
    assert b.read(0x100, 2) == b"AB" and c.iommu_type == uapi.VFIO_TYPE1v2_IOMMU
    domain = c.domain
    g2.unset_container()                        # last out: the IOMMU goes, with every mapping
    assert c.domain is None and c.iommu_type is None and domain.destroyed
    with pytest.raises(DmaFault):
        b.read(0x100, 1)
    assert errno_of(c.set_iommu, uapi.VFIO_TYPE1v2_IOMMU) == errno.EINVAL  # no group again


def test_get_device_fd_errors(iommu, ram, group):
    assert errno_of(group.get_device_fd, "0000:01:00.1") == errno.EINVAL   # no container
    c = VfioContainer(iommu, [ram])
    group.set_container(c)
    assert errno_of(group.get_device_fd, "0000:01:00.1") == errno.EINVAL   # no IOMMU yet
    c.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
    assert errno_of(group.get_device_fd, "0000:09:00.0") == errno.ENODEV   # no such device
    assert errno_of(group.get_device_fd, b"") == errno.ENODEV
    f = group.get_device_fd(b"0000:01:00.1")
    g = group.ioctl(uapi.VFIO_GROUP_GET_DEVICE_FD, uapi.ffi.new("char[]", b"0000:01:00.1"))
    assert isinstance(f, VfioDeviceFile) and isinstance(g, VfioDeviceFile)
    assert f.requester_id == RID_A and f.device is g.device
    f.close()
    g.close()


def test_device_file_forwards_and_refuses_after_close(iommu, ram, group):
    ready(iommu, ram, group)
    with group.get_device_fd("0000:01:00.1") as f:
        info = uapi.new("struct vfio_device_info *")
        f.ioctl(uapi.VFIO_DEVICE_GET_INFO, info)
        assert info.flags & uapi.VFIO_DEVICE_FLAGS_PCI and info.num_regions == 9 and info.num_irqs == 5
        r = uapi.new("struct vfio_region_info *")
        r.index = uapi.VFIO_PCI_BAR0_REGION_INDEX
        f.ioctl(uapi.VFIO_DEVICE_GET_REGION_INFO, r)
        assert r.size == PAGE_SIZE
        irq = uapi.new("struct vfio_irq_info *")
        irq.index = uapi.VFIO_PCI_MSIX_IRQ_INDEX
        f.ioctl(uapi.VFIO_DEVICE_GET_IRQ_INFO, irq)
        s = uapi.new("struct vfio_irq_set *", {"data": 4})
        s.index = uapi.VFIO_PCI_MSIX_IRQ_INDEX
        f.ioctl(uapi.VFIO_DEVICE_SET_IRQS, s)
        f.ioctl(uapi.VFIO_DEVICE_RESET)
        f.region_write(0, 8, b"\x01\x02")
        assert f.region_read(0, 8, 2) == b"\x01\x02" and f.region_mmap(0, 8, 2)[1] == 2
        assert errno_of(f.ioctl, uapi.VFIO_IOMMU_MAP_DMA) == errno.ENOTTY
        dev = f.device
    assert dev.calls == [("get_info",), ("get_region_info", 0), ("get_irq_info", 2),
                         ("set_irqs", 2), ("reset",)]
    assert f.closed
    assert errno_of(f.reset) == errno.EBADF
    assert errno_of(f.ioctl, uapi.VFIO_DEVICE_GET_INFO, uapi.new("struct vfio_device_info *")) == errno.EBADF
    group.unset_container()  # nothing open any more


def test_add_device_rules(iommu, ram, group):
    with pytest.raises(ValueError, match="already has a device"):
        group.add_device("0000:01:00.1", FakeDevice(), RID_B)
    with pytest.raises(ValueError, match="already"):
        group.add_device("other", FakeDevice(), RID_A)
    c = ready(iommu, ram, group)
    group.add_device("0000:01:00.2", FakeDevice(), RID_B)  # joins the domain at once
    assert iommu.domain_of(RID_B) is c.domain
    assert [m.name for m in group.members] == ["0000:01:00.1", "0000:01:00.2"]


def test_unknown_group_ioctl_is_enotty(group):
    assert errno_of(group.ioctl, uapi.VFIO_IOMMU_MAP_DMA) == errno.ENOTTY
