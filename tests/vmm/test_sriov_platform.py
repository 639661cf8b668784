"""The host's SR-IOV platform (vmm.sriov) with the real VA-1 card and PF driver: VF
requester IDs, VF BAR decoding from the PF's VF BAR0, per-RID DMA and MSI, VFIO binding
of VFs, and everything removed on disable."""
from __future__ import annotations

import errno

import pytest

from device_model import DmaFault
from hwspec import pci as P
from hwspec import va1 as A
from hwspec import virtio_pci as VP
from hwspec.va1 import VfResources
from vmm.host import Host
from vmm.iommu import bdf, format_bdf
from vmm.machine import Machine
from vmm.sriov import SriovError, find_ext_cap
from virtaccel.testing.fake_card import FakePfDriver, fake_card_factory

SEED = 4242


@pytest.fixture
def host() -> Host:
    h = Host(Machine(SEED, keep_trace=True))
    h.add_va1_card(total_vfs=8)
    return h


def test_firmware_places_the_vf_bars_aligned_and_apart_from_the_pf(host: Host) -> None:
    plat = host.sriov_platform()
    pf = host.functions["0000:01:00.0"]
    base = plat.vf_bar_base[0]
    assert [b.index for b in plat.vf_bars] == [0] and plat.vf_bars[0].size == A.PCI_BAR_SIZE
    assert plat.vf_bars[0].is_64bit
    assert base % (A.PCI_BAR_SIZE * 8) == 0
    pf_bar = pf.slot.mapped[0][0]
    assert not base <= pf_bar < base + 8 * A.PCI_BAR_SIZE
    cap = find_ext_cap(pf.function, P.EXT_CAP_ID_SRIOV)
    assert cap is not None and pf.function.config_read(cap + P.SRIOV_BAR, 4) & ~0xF == base & 0xFFFF_FFF0


def test_vfs_get_rids_pf_plus_offset_plus_stride_and_their_bars_decode(host: Host) -> None:
    vfs = host.enable_sriov(3)
    pf = host.functions["0000:01:00.0"]
    plat = host.sriov_platform()
    assert [v.requester_id for v in vfs] == [pf.requester_id + A.SRIOV_FIRST_VF_OFFSET + i * A.SRIOV_VF_STRIDE
                                            for i in range(3)]
    assert [v.name for v in vfs] == ["0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]
    base = plat.vf_bar_base[0]
    for n, vf in enumerate(vfs, start=1):
        addr = plat.vf_bar_address(n)
        assert addr == base + (n - 1) * A.PCI_BAR_SIZE
        # a host load at VF n's BAR reaches VF n (num_queues of its common config)
        assert host.bus.read(addr + VP.COMMON_NUMQ, 2) == 2 + vf.function.device.config.num_submit_queues  # type: ignore[attr-defined]
        # its config space answers ECAM at its RID: a VF reads 0xFFFF as vendor
        ecam = P.ecam_offset(vf.slot.bus, vf.slot.dev, vf.slot.fn)
        assert host.pci.read(ecam + P.VENDOR_ID, 2) == 0xFFFF
        assert host.pci.read(ecam + P.CLASS_DEVICE, 2) == P.CLASS_PROCESSING_ACCELERATOR << 8


def test_clearing_vf_mse_unmaps_the_vf_bars_and_setting_it_maps_them_again(host: Host) -> None:
    host.enable_sriov(2)
    plat = host.sriov_platform()
    pf = host.functions["0000:01:00.0"]
    assert plat.cap is not None
    ecam = P.ecam_offset(1, 0, 0) + plat.cap + P.SRIOV_CTRL
    addr = plat.vf_bar_address(2)
    assert addr is not None
    host.pci.write(ecam, 2, P.SRIOV_CTRL_VFE)                 # MSE off
    assert plat.vf_bar_address(2) is None and host.bus.find(addr, 4) is None
    assert host.bus.read(addr, 4) == 0xFFFF_FFFF
    host.pci.write(ecam, 2, P.SRIOV_CTRL_VFE | P.SRIOV_CTRL_MSE)
    assert plat.vf_bar_address(2) == addr
    assert pf.function.config_read(plat.cap + P.SRIOV_NUM_VF, 2) == 2


def test_vf_dma_goes_through_the_iommu_by_its_own_rid(host: Host) -> None:
    vfs = host.enable_sriov(2, bind=False)
    vf = vfs[0]
    with pytest.raises(DmaFault):
        vf.dma.read(0x1000, 8)     # attached to no domain: reaches nothing
    fault = host.iommu.faults[-1]
    assert fault.requester_id == vf.requester_id and "no IOMMU domain" in fault.reason
    # the PF's host DMA domain is the PF's alone
    pf = host.functions["0000:01:00.0"]
    assert host.iommu.domain_of(pf.requester_id) is host.host_kernel().dma_domain
    assert host.iommu.domain_of(vf.requester_id) is None


def test_vf_msi_is_remapped_per_rid(host: Host) -> None:
    vfs = host.enable_sriov(2, bind=False)
    fired: list[str] = []
    msg = host.msi.alloc(lambda: fired.append("vf1"), "vf1-vec", requester_id=vfs[0].requester_id)
    host.msi.port(vfs[1].requester_id).send(msg.address, msg.data)   # VF 2 forges VF 1's vector
    assert fired == [] and "remapping" in host.msi.unknown[-1].reason
    host.msi.port(vfs[0].requester_id).send(msg.address, msg.data)
    assert fired == ["vf1"]


def test_vfs_bound_to_vfio_get_groups_of_their_own_with_virtualised_ids(host: Host) -> None:
    vfs = host.enable_sriov(3)
    groups = [v.group for v in vfs]
    assert all(g is not None for g in groups) and len({id(g) for g in groups}) == 3
    dev = groups[0].members[0].device  # type: ignore[union-attr]
    # vfio-pci shows the PF's vendor and the VF device id (the VF itself reads 0xFFFF)
    cfg = dev.region_read(7, 0, 4)   # VFIO_PCI_CONFIG_REGION_INDEX
    assert int.from_bytes(cfg, "little") == A.PCI_VENDOR_ID | A.SRIOV_VF_DEVICE_ID << 16
    # the VF's BAR is described (64-bit memory) though its BAR registers read 0
    bar = int.from_bytes(dev.region_read(7, P.BASE_ADDRESS_0, 4), "little")
    assert bar & P.BASE_ADDRESS_MEM_TYPE_MASK == P.BASE_ADDRESS_MEM_TYPE_64


def test_disable_removes_every_vf_slot_bar_function_and_group(host: Host) -> None:
    vfs = host.enable_sriov(3)
    addrs = [host.sriov_platform().vf_bar_address(n) for n in (1, 2, 3)]
    host.disable_sriov()
    assert host.vfs() == []
    assert set(host.functions) == {"0000:01:00.0"}
    assert all(host.pci.slot_at(v.slot.bus, v.slot.dev, v.slot.fn) is None for v in vfs)
    assert all(a is not None and host.bus.find(a, 4) is None for a in addrs)
    assert all(v.group is None for v in vfs)
    # and they come back on a new enable, with new functions
    again = host.enable_sriov(2)
    assert [v.name for v in again] == ["0000:01:00.1", "0000:01:00.2"]
    assert again[0].function is not vfs[0].function


@pytest.mark.parametrize("n", [0, 9, -1])
def test_enable_out_of_range_is_refused_before_anything_changes(host: Host, n: int) -> None:
    with pytest.raises(SriovError, match="1 .. 8"):
        host.enable_sriov(n)
    assert host.vfs() == []


def test_resource_count_must_match(host: Host) -> None:
    with pytest.raises(SriovError, match="2 resource sets for 3 VFs"):
        host.enable_sriov(3, [VfResources(), VfResources()])


def test_over_commit_through_the_admin_queue_is_enomem(host: Host) -> None:
    with pytest.raises(OSError) as e:
        host.enable_sriov(2, [VfResources(device_memory=6 << 30), VfResources(device_memory=6 << 30)])
    assert e.value.errno == errno.ENOMEM


def test_the_platform_serves_any_card_fake_included() -> None:
    h = Host(Machine(SEED))
    h.pf_driver_factory = FakePfDriver
    h.add_va1_card(card_factory=fake_card_factory(total_vfs=4))
    vfs = h.enable_sriov(4)
    assert [format_bdf(v.requester_id) for v in vfs] == ["01:00.1", "01:00.2", "01:00.3", "01:00.4"]
    assert vfs[3].requester_id == bdf(1, 0, 4)


def test_no_sriov_pf_is_a_clear_error() -> None:
    h = Host(Machine(SEED))
    h.add_va1()
    with pytest.raises(SriovError, match="add_va1_card"):
        h.enable_sriov(1)


def test_numvfs_cannot_change_while_a_vf_is_assigned_to_a_vm(host: Host) -> None:
    from vmm.vm import Vm
    vfs = host.enable_sriov(2)
    vm = Vm(host.machine, "vm0", ram_size=8 << 20)
    vm.attach_va1_passthrough(host, vfs[1])
    with pytest.raises(SriovError, match="0000:01:00.2 are assigned"):
        host.disable_sriov()
    with pytest.raises(SriovError, match="assigned"):
        host.enable_sriov(1)
    assert len(host.vfs()) == 2
    vm.close()
    host.disable_sriov()
    assert host.vfs() == []


def test_on_a_64k_page_host_firmware_sets_64k_pages_and_vfs_sit_64k_apart() -> None:
    """As Linux sriov_init on a 64 KiB-page host: System Page Size 64 KiB, so VF BAR0
    sizes at 64 KiB and VF n decodes at base + (n-1) * 64 KiB; the PF driver keeps that
    page size and the VFs work."""
    h = Host(Machine(SEED), page_size=0x1_0000)
    h.add_va1_card(total_vfs=4)
    plat = h.sriov_platform()
    pf = h.functions["0000:01:00.0"]
    cap = find_ext_cap(pf.function, P.EXT_CAP_ID_SRIOV)
    assert cap is not None
    assert pf.function.config_read(cap + P.SRIOV_SUP_PGSIZE, 4) == 0x553
    assert pf.function.config_read(cap + P.SRIOV_SYS_PGSIZE, 4) == 0x10
    assert plat.vf_bars[0].size == 0x1_0000
    vfs = h.enable_sriov(3)
    assert pf.function.config_read(cap + P.SRIOV_SYS_PGSIZE, 4) == 0x10
    base = plat.vf_bar_base[0]
    assert base % 0x1_0000 == 0
    for n, vf in enumerate(vfs, start=1):
        addr = plat.vf_bar_address(n)
        assert addr == base + (n - 1) * 0x1_0000
        assert h.bus.read(addr + VP.COMMON_NUMQ, 2) == 2 + vf.function.device.config.num_submit_queues  # type: ignore[attr-defined]
    h.disable_sriov()


def test_a_host_page_larger_than_every_supported_size_cannot_use_sriov() -> None:
    h = Host(Machine(SEED), page_size=8 << 20)
    with pytest.raises(SriovError, match=r"Supported Page Sizes 0x553 has no size >= the host page \(0x800000\)"):
        h.add_va1_card(total_vfs=4)
    assert h.functions == {} and h.sriov == {}
    h.add_va1(bus=1)                                # the slot is free again


@pytest.mark.parametrize("size", [0, 2048, 0x3000])
def test_host_page_size_must_be_a_power_of_two_of_at_least_4k(size: int) -> None:
    with pytest.raises(ValueError, match="host page size"):
        Host(Machine(SEED), page_size=size)
