"""vfio-pci for one function: every VFIO device call, with the linux/vfio.h semantics."""
from __future__ import annotations

import errno
import os
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_pci_fakes import (BAR0_SIZE, BAR2_SIZE, DOORBELL, EXP_CAP, MSIX_CAP, NVEC,  # noqa: E402
                            PBA, TABLE, FakeHostRig)

from hwspec import pci as P  # noqa: E402
from vmm.eventfd import drain, new_eventfd  # noqa: E402
from vmm.memory import GuestMemory, HostMemory  # noqa: E402
from vmm.vfio import VfioContainer, VfioDeviceFile, uapi, vaddr_of  # noqa: E402
from vmm.vfio.passthrough import query_region, set_irqs  # noqa: E402
from vmm.vfio.pci_device import VfioPciDevice, region_offset  # noqa: E402

SEED = 5
MSIX = uapi.VFIO_PCI_MSIX_IRQ_INDEX
TRIGGER_FD = uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_TRIGGER
CONFIG = uapi.VFIO_PCI_CONFIG_REGION_INDEX


class Rig(FakeHostRig):
    def __init__(self) -> None:
        super().__init__(SEED, bus=1)
        self.group = self.host.bind_vfio(self.hf)
        self.mem_host = HostMemory(1 << 20)
        self.ram = GuestMemory(self.mem_host, 0, 1 << 20)
        self.container = VfioContainer(self.host.iommu, [self.ram])
        self.group.set_container(self.container)
        self.container.set_iommu(uapi.VFIO_TYPE1v2_IOMMU)
        m = uapi.new("struct vfio_iommu_type1_dma_map *")
        m.flags = uapi.VFIO_DMA_MAP_FLAG_READ | uapi.VFIO_DMA_MAP_FLAG_WRITE
        m.vaddr, m.iova, m.size = vaddr_of(self.ram, 0), 0, 1 << 20
        self.container.iommu_map_dma(m)
        self.dev: VfioDeviceFile = self.group.get_device_fd(self.hf.name)
        self.vdev: VfioPciDevice = self.group.members[0].device  # type: ignore[assignment]
        self.fds: list[int] = []

    def eventfds(self, n: int) -> list[int]:
        fds = [new_eventfd() for _ in range(n)]
        self.fds += fds
        return fds

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.dev.close()
        self.mem_host.close()


@pytest.fixture
def rig():  # type: ignore[no-untyped-def]
    r = Rig()
    yield r
    r.close()


def test_get_info(rig: Rig) -> None:
    info = uapi.new("struct vfio_device_info *")
    rig.dev.ioctl(uapi.VFIO_DEVICE_GET_INFO, info)
    assert info.flags == uapi.VFIO_DEVICE_FLAGS_PCI | uapi.VFIO_DEVICE_FLAGS_RESET
    assert (info.num_regions, info.num_irqs) == (uapi.VFIO_PCI_NUM_REGIONS, uapi.VFIO_PCI_NUM_IRQS)
    info.argsz = 8
    with pytest.raises(OSError) as e:
        rig.dev.get_info(info)
    assert e.value.errno == errno.EINVAL


def test_region_info_sparse_areas_leave_out_msix_table_and_pba(rig: Rig) -> None:
    size, flags, offset, areas = query_region(rig.dev, 0)
    assert size == BAR0_SIZE and offset == region_offset(0) == 0
    assert flags & uapi.VFIO_REGION_INFO_FLAG_MMAP and flags & uapi.VFIO_REGION_INFO_FLAG_CAPS
    assert [(a.offset, a.size) for a in areas] == [(0, TABLE)]  # table page 0x2000, PBA 0x3000 out
    for a in areas:
        assert not (a.offset < PBA + 8 and TABLE < a.offset + a.size)
    # too small a buffer: the kernel raises argsz and reports no chain
    info = uapi.new("struct vfio_region_info *")
    info.index = 0
    rig.dev.ioctl(uapi.VFIO_DEVICE_GET_REGION_INFO, info)
    assert info.argsz > uapi.ffi.sizeof("struct vfio_region_info") and info.cap_offset == 0
    # BAR1 is BAR0's upper half, BAR2 maps whole, ROM empty, config 4 KiB
    assert query_region(rig.dev, 1)[0] == 0
    s2, f2, o2, a2 = query_region(rig.dev, 2)
    assert (s2, o2) == (BAR2_SIZE, 2 << 40) and not f2 & uapi.VFIO_REGION_INFO_FLAG_CAPS
    assert [(a.offset, a.size) for a in a2] == [(0, BAR2_SIZE)]
    assert query_region(rig.dev, uapi.VFIO_PCI_ROM_REGION_INDEX)[:2] == (0, 0)
    sc, fc, oc, _ = query_region(rig.dev, CONFIG)
    assert (sc, oc) == (4096, CONFIG << 40) and not fc & uapi.VFIO_REGION_INFO_FLAG_MMAP
    info.index = 9
    with pytest.raises(OSError, match="index 9") as e:
        rig.dev.get_region_info(info)
    assert e.value.errno == errno.EINVAL


def cfg_read(rig: Rig, off: int, size: int) -> int:
    return int.from_bytes(rig.dev.region_read(CONFIG, off, size), "little")


def cfg_write(rig: Rig, off: int, size: int, value: int) -> None:
    rig.dev.region_write(CONFIG, off, value.to_bytes(size, "little"))


def test_config_region_virtualises_bars_rom_and_msix_enable(rig: Rig) -> None:
    host_bar0 = rig.fake.bar_raw[0] | rig.fake.bar_raw[1] << 32
    assert host_bar0  # host firmware placed it
    assert cfg_read(rig, P.VENDOR_ID, 4) == 0x105A_1AF4  # passed through
    cfg_write(rig, P.BASE_ADDRESS_0, 4, 0xFFFF_FFFF)
    cfg_write(rig, P.BASE_ADDRESS_0 + 4, 4, 0xFFFF_FFFF)
    lo, hi = cfg_read(rig, P.BASE_ADDRESS_0, 4), cfg_read(rig, P.BASE_ADDRESS_0 + 4, 4)
    assert ((hi << 32) | (lo & ~0xF)) == (1 << 64) - BAR0_SIZE  # sizing works
    assert lo & 0xF == P.BASE_ADDRESS_MEM_TYPE_64 | P.BASE_ADDRESS_MEM_PREFETCH
    cfg_write(rig, P.BASE_ADDRESS_0, 4, 0x8000_0000)
    cfg_write(rig, P.BASE_ADDRESS_0 + 4, 4, 0x80)
    assert cfg_read(rig, P.BASE_ADDRESS_0, 4) & ~0xF == 0x8000_0000
    assert cfg_read(rig, P.BASE_ADDRESS_0 + 4, 4) == 0x80
    assert rig.fake.bar_raw[0] | rig.fake.bar_raw[1] << 32 == host_bar0  # physical untouched
    assert cfg_read(rig, 0x30, 4) == 0
    cfg_write(rig, MSIX_CAP + 2, 2, P.MSIX_FLAGS_ENABLE)
    assert cfg_read(rig, MSIX_CAP + 2, 2) == P.MSIX_FLAGS_ENABLE | (NVEC - 1)
    assert not rig.fake._enabled()[0]  # the host enables MSI-X itself, at SET_IRQS
    with pytest.raises(OSError):
        rig.dev.region_read(CONFIG, 4094, 4)


def test_region_rw_protects_msix_table_and_mmap_only_sparse_areas(rig: Rig) -> None:
    rig.dev.region_write(0, 0x10, b"\x01\x02\x03\x04\x05")
    assert rig.fake.scratch0[0x10:0x15] == b"\x01\x02\x03\x04\x05"
    assert rig.dev.region_read(0, 0x10, 5) == b"\x01\x02\x03\x04\x05"
    before = bytes(rig.fake.table)
    rig.dev.region_write(0, TABLE, b"\x00" * 16)
    assert bytes(rig.fake.table) == before
    assert rig.dev.region_read(0, TABLE + 12, 4) == b"\xff" * 4
    with pytest.raises(OSError):
        rig.dev.region_read(0, BAR0_SIZE - 2, 4)
    m = rig.dev.region_mmap(0, 0, 0x2000)
    m.write(DOORBELL, 4, 0x100)
    assert rig.fake.doorbells == [0x100]
    for args in ((0, TABLE, 0x1000), (0, 0x1000, 0x2000), (0, 0x10, 0x1000), (CONFIG, 0, 0x1000), (1, 0, 0x1000)):
        with pytest.raises(OSError) as e:
            rig.dev.region_mmap(*args)
        assert e.value.errno == errno.EINVAL


def test_get_irq_info(rig: Rig) -> None:
    info = uapi.new("struct vfio_irq_info *")
    info.index = MSIX
    rig.dev.ioctl(uapi.VFIO_DEVICE_GET_IRQ_INFO, info)
    assert info.count == NVEC
    assert info.flags & uapi.VFIO_IRQ_INFO_EVENTFD and info.flags & uapi.VFIO_IRQ_INFO_MASKABLE
    info.index = uapi.VFIO_PCI_INTX_IRQ_INDEX
    rig.dev.get_irq_info(info)
    assert info.count == 0
    info.index = uapi.VFIO_PCI_NUM_IRQS
    with pytest.raises(OSError) as e:
        rig.dev.get_irq_info(info)
    assert e.value.errno == errno.EINVAL


@pytest.mark.parametrize("index,start,count,word", [
    (uapi.VFIO_PCI_NUM_IRQS, 0, 1, "index 5"),
    (uapi.VFIO_PCI_INTX_IRQ_INDEX, 0, 1, "index 0"),
    (MSIX, NVEC, 1, "start 4"),
    (MSIX, 2, 3, "count 3"),
])
def test_set_irqs_bad_index_start_count_is_einval_naming_it(rig: Rig, index: int, start: int,
                                                           count: int, word: str) -> None:
    fds = rig.eventfds(count)
    with pytest.raises(OSError, match=word) as e:
        set_irqs(rig.dev, TRIGGER_FD, index, start, fds)
    assert e.value.errno == errno.EINVAL
    assert rig.vdev.msix_enabled == 0 and rig.host.msi.allocated() == 0


def test_set_irqs_bad_flags_and_bad_fd(rig: Rig) -> None:
    with pytest.raises(OSError, match="flags") as e:
        set_irqs(rig.dev, TRIGGER_FD | uapi.VFIO_IRQ_SET_DATA_BOOL, MSIX, 0, [1])
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, [1])  # stdout is not an eventfd
    assert e.value.errno == errno.EBADF
    s = uapi.new("struct vfio_irq_set *", {"data": 4})
    s.argsz = 20  # no room for the one fd it claims
    s.flags, s.index, s.start, s.count = TRIGGER_FD, MSIX, 0, 1
    with pytest.raises(OSError, match="argsz"):
        rig.dev.ioctl(uapi.VFIO_DEVICE_SET_IRQS, s)
    assert rig.vdev.msix_enabled == 0


def test_set_irqs_trigger_mask_unmask_loopback_and_disable(rig: Rig) -> None:
    fds = rig.eventfds(NVEC)
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, fds)
    assert rig.fake._enabled() == (True, False) and rig.host.msi.allocated() == NVEC
    addr, data, ctrl = struct.unpack_from("<QII", rig.fake.table, 16)
    assert addr == P.MSI_ADDRESS_BASE and ctrl == 0  # host message, unmasked
    rig.fake.fire(1)
    assert [drain(fd) for fd in fds] == [0, 1, 0, 0]
    set_irqs(rig.dev, uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_MASK, MSIX, 1, [], count=1)
    assert struct.unpack_from("<I", rig.fake.table, 16 + 12)[0] == 1
    rig.fake.fire(1)
    assert drain(fds[1]) == 0 and rig.fake.pending == {1}
    set_irqs(rig.dev, uapi.VFIO_IRQ_SET_DATA_BOOL | uapi.VFIO_IRQ_SET_ACTION_UNMASK, MSIX, 0, [0, 1])
    assert drain(fds[1]) == 1 and not rig.fake.pending
    set_irqs(rig.dev, uapi.VFIO_IRQ_SET_DATA_BOOL | uapi.VFIO_IRQ_SET_ACTION_TRIGGER, MSIX, 2, [1, 0])
    assert [drain(fd) for fd in fds] == [0, 0, 1, 0]  # loopback
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 3, [-1])  # clear one trigger
    rig.fake.fire(3)
    assert drain(fds[3]) == 0
    with pytest.raises(OSError):
        set_irqs(rig.dev, uapi.VFIO_IRQ_SET_DATA_EVENTFD | uapi.VFIO_IRQ_SET_ACTION_MASK, MSIX, 0, [fds[0]])
    set_irqs(rig.dev, uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_TRIGGER, MSIX, 0, [], count=0)
    assert rig.fake._enabled()[0] is False and rig.host.msi.allocated() == 0 and rig.vdev.msix_enabled == 0
    rig.fake.fire(0)
    assert drain(fds[0]) == 0
    with pytest.raises(OSError, match="not enabled"):
        set_irqs(rig.dev, uapi.VFIO_IRQ_SET_DATA_NONE | uapi.VFIO_IRQ_SET_ACTION_UNMASK, MSIX, 0, [], count=1)


def test_noresize_while_enabled(rig: Rig) -> None:
    fds = rig.eventfds(NVEC)
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, fds[:2])
    with pytest.raises(OSError, match="NORESIZE"):
        set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, fds)
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 1, [fds[3]])  # within the enabled two: fine


def test_reset_restores_host_state_and_config_flr_resets(rig: Rig) -> None:
    fds = rig.eventfds(NVEC)
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, fds)
    def phys_bars() -> list[int]:
        return [rig.fake.config_read(P.BASE_ADDRESS_0 + 4 * i, 4) for i in range(6)]
    bars = phys_bars()
    rig.dev.ioctl(uapi.VFIO_DEVICE_RESET)
    assert rig.fake.resets == 1 and phys_bars() == bars and bars[1]
    assert rig.fake._enabled() == (True, False)
    assert rig.fake.config_read(P.COMMAND, 2) & P.COMMAND_MEMORY
    rig.fake.fire(2)
    assert drain(fds[2]) == 1  # the MSI-X table was restored with the host messages
    cfg_write(rig, EXP_CAP + P.EXP_DEVCTL, 2, P.EXP_DEVCTL_BCR_FLR)
    assert rig.fake.resets == 2 and rig.vdev.resets == 2


def test_dma_to_unmapped_iova_faults_and_touches_nothing(rig: Rig) -> None:
    rig.ram.write(0x1000, bytes(range(64)))
    m = rig.dev.region_mmap(0, 0, 0x2000)
    m.write(DOORBELL, 8, 0x1000)
    assert rig.ram.read(0x1040, 64) == bytes(b + 1 for b in range(64))
    before = rig.host.iommu.fault_count
    m.write(DOORBELL, 8, 0x10_0000 - 32)  # runs off the end of the mapped RAM
    assert len(rig.fake.faults) == 1 and rig.host.iommu.fault_count == before + 1
    fault = rig.host.iommu.faults[-1]
    assert fault.requester_id == rig.hf.requester_id and "not mapped" in fault.reason


def test_set_irqs_programs_the_table_even_with_memory_decoding_off(rig: Rig) -> None:
    cfg_write(rig, P.COMMAND, 2, 0)  # the user turned decoding off
    fds = rig.eventfds(1)
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, fds)
    addr, data, ctrl = struct.unpack_from("<QII", rig.fake.table, 0)
    assert addr == P.MSI_ADDRESS_BASE and data >= 0x30 and ctrl == 0
    assert rig.fake.dropped_writes == 0
    assert not rig.fake.config_read(P.COMMAND, 2) & P.COMMAND_MEMORY  # left as the user set it


def test_closing_the_last_device_fd_disables_irqs_and_resets(rig: Rig) -> None:
    fds = rig.eventfds(NVEC)
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, fds)
    second = rig.group.get_device_fd(rig.hf.name)
    second.close()
    assert rig.vdev.msix_enabled == NVEC  # another fd is still open
    rig.dev.close()
    assert rig.vdev.msix_enabled == 0 and rig.host.msi.allocated() == 0
    assert rig.fake.resets == 1 and not rig.fake._enabled()[0]
    rig.fake.fire(0)
    assert all(drain(fd) == 0 for fd in fds)


def test_signal_on_a_closed_eventfd_is_logged_not_raised(rig: Rig) -> None:
    fd = new_eventfd()
    set_irqs(rig.dev, TRIGGER_FD, MSIX, 0, [fd])
    os.close(fd)  # a careless user closes the fd behind vfio's back
    rig.fake.fire(0)
    assert rig.host.eventfds.errors and rig.host.eventfds.errors[-1][0] == fd


def test_extended_config_space_is_read_only_to_the_user(rig: Rig) -> None:
    rig.fake.cfg[0x100:0x104] = (0x0001_0010).to_bytes(4, "little")  # an SR-IOV-like header
    rig.fake.config_write = lambda off, size, value: rig.fake.cfg.__setitem__(  # type: ignore[method-assign]
        slice(off, off + size), value.to_bytes(size, "little"))
    cfg_write(rig, 0x108, 2, 0x1)  # would be SR-IOV VF Enable
    assert rig.fake.cfg[0x108] == 0
    assert cfg_read(rig, 0x100, 4) == 0x0001_0010
